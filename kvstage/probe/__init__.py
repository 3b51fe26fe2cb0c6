"""``kvstage probe``: the compatibility probe's command.

``cli`` (arguments and exit codes), ``selftest`` (two local processes, a
measured write, UCX's own account of the transport it selected), ``peer``
(a measured write into a running destination's lent slot) and ``worker`` (the
writer process). The facts and the judgement they use live in ``kvstage.link``.
"""
