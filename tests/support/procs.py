"""The tests' multiprocessing context: each child forked from a warm server, as spawned children were.

A ``spawn`` child is a fresh Python that imports torch and kvstage (about 1.6 s of CPU on the
2-core CI machine) and tears them down at exit (0.5 s more): most of a short case's time, most of
the suite's. ``CTX`` is multiprocessing's ``forkserver`` context instead: its server, started by
the first child of the session, imports ``PRELOAD`` once; each child is forked from it, a real
process of its own, and runs its target as a spawned child did. The server imports modules
only, never a transport, an endpoint or a CUDA context, so nothing is shared that a fork breaks.

A spawned child got two things from the test at ``start()`` that a forked one would get from the
server instead: the environment, and stdout and stderr (a ``capfd`` test reads a child's lines).
``Process`` hands both over at ``start()``: the child takes ``os.environ`` as it is then in the
test, and the test's fds 1 and 2. Only a variable read at import time by a preloaded module
(none of kvstage's are) would see the server's environment instead.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.context
import os
from multiprocessing import reduction

#: what the tests' children import: loaded once by the server, before any fork
PRELOAD = [
    "numpy",
    "torch",
    "pytest",
    "kvstage.bench.reference",
    "kvstage.config",
    "kvstage.protocol.destination",
    "kvstage.protocol.source",
    "kvstage.staging.cache",
    "kvstage.transports",
    "kvstage.transports.base",
    "kvstage.transports.cma",
    "kvstage.transports.nixl",
    "kvstage.transports.ucx",
    "support.fault_ranks",
    "support.multi_peer_ranks",
    "support.read_sources",
    "support.transport_pair",
    "support._preloaded",  # last: freezes what the children inherit (gc.freeze)
]


class _Stdio:
    """The test's stdout and stderr, passed to the child as fds when the process is pickled."""

    def __reduce__(self):
        return _attach, (reduction.DupFd(1), reduction.DupFd(2))


def _attach(out, err) -> None:
    for fd, dup in ((1, out), (2, err)):
        got = dup.detach()
        os.dup2(got, fd)
        os.close(got)


class Process(mp.context.ForkServerProcess):
    """A forkserver child with the test's environment and stdio as of ``start()`` (see above)."""

    def start(self) -> None:
        self._as_spawned = (dict(os.environ), _Stdio())
        super().start()

    def run(self) -> None:
        env, _ = self._as_spawned  # the stdio was attached when this process was unpickled
        os.environ.clear()
        os.environ.update(env)
        super().run()


class _Context(mp.context.ForkServerContext):
    Process = Process  # type: ignore[assignment]


CTX = _Context()
CTX.set_forkserver_preload(PRELOAD)
