"""The compatibility probe: which path the KV bytes take to each peer, whether
it is the best this hardware offers, and if not, why and what to change.

- ``run_selftest``: two local processes, a measured write, UCX's own account of
  the transport it selected (``UCX_PROTO_INFO=y``), judged by ``assess``.
- ``connect_line``: the one line the transfer engine logs per peer at connect.
- ``collect_local``: this process's facts, each labelled with its source.
- ``parse_proto_info`` / ``select``: the parser for UCX's protocol tables.

``kvstage probe`` is ``kvstage.probe.cli`` (``add_arguments``, ``run``).
"""

from kvstage.probe.assess import assess
from kvstage.probe.connect import connect_line
from kvstage.probe.facts import collect_local
from kvstage.probe.finding import Evidence, Finding, Severity
from kvstage.probe.ucx_info import parse_proto_info, select

__all__ = [
    "Evidence",
    "Finding",
    "Severity",
    "assess",
    "collect_local",
    "connect_line",
    "parse_proto_info",
    "run_selftest",
    "select",
]


def run_selftest(*args, **kwargs):
    """See ``kvstage.probe.selftest.run_selftest`` (imported on first use)."""
    from kvstage.probe.selftest import run_selftest as _run

    return _run(*args, **kwargs)
