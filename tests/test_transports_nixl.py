"""What only the NIXL transport does: real NIXL agents in real processes, no mocks.

Why its UCX backend runs with ``MM_ERROR_HANDLING=y``: without it a READ of a
stopped peer waits for that peer (the flush over tcp after UCX's wireup
message), which is also the one way to see ``abandon`` refuse to call a running
NIXL read over. With the option the same read completes: the contract suite's
stopped-source test (tests/test_transports.py), which every transport keeps.
"""

import os
import signal
import time

import numpy as np

from kvstage.transports.base import Spans, WriteState
from kvstage.transports.nixl import UCX_ENGINE_CONFIG
from support.read_sources import ReadSources, finish


def test_without_shared_memory_messages_a_read_of_a_stopped_peer_waits_and_is_not_abandoned(monkeypatch):
    assert UCX_ENGINE_CONFIG["MM_ERROR_HANDLING"] == "y"  # the option the environment overrides below
    monkeypatch.setenv("UCX_MM_ERROR_HANDLING", "n")  # UCX's own default; every agent here and in the source
    with ReadSources("nixl", 1, 1 << 20, 1 << 20) as s:
        s.ask(0, "run", 1.0)
        s.offer(0, [0], [1 << 20], then_stop=True)
        s.wait_stopped(0)
        h = s.tr.read(s.peers[0], Spans.single(s.region, [0], [1 << 20]), Spans.single(s.remotes[0], [0], [1 << 20]))
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert s.tr.poll(h) is WriteState.PENDING  # the bytes may be there; the flush waits for the peer
        assert s.tr.abandon(h) is False  # UCX cannot cancel it: the memory stays out of use
        os.kill(s.procs[0].pid, signal.SIGCONT)
        finish(s.tr, [h], timeout=10)
        assert s.tr.abandon(h) is True
        s.tr.release(h)
        assert np.array_equal(s.dst.numpy(), s.data[0])
