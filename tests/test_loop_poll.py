"""The endpoint loop polls its sockets for ``endpoint.POLL_S`` after each event while
it holds a request in flight (a CUDA cache: 50 ms; a host cache: never), and sleeps
otherwise (real endpoints, real NIXL, the loop thread's own wake-ups as Linux counts them)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.bench.reference import check_shard
from kvstage.config import PING_INTERVAL_S, Settings
from kvstage.protocol.destination import Destination
from kvstage.protocol.endpoint import POLL_S
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache

POLLING = 200  # wake-ups a polling loop makes at least in its window (every 20 µs: up to 2,500 in 50 ms)
SLEEPING = 30  # and a sleeping one at most in WINDOW (a 50 ms idle wait: 5, and the peers' pings)
WINDOW = 0.25


def _loop_thread(ep) -> threading.Thread:
    """The endpoint's loop thread, by the name it is given (``kvstage-<role><rank>``)."""
    return next(t for t in threading.enumerate() if t.name == f"kvstage-{ep.role}{ep.rank}")


def _cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda", 0)


def loop_wakeups(ep, seconds: float = WINDOW) -> int:
    """Times the endpoint's loop thread gave up its CPU (a wait) over the next ``seconds``."""
    status = f"/proc/self/task/{_loop_thread(ep).native_id}/status"

    def switches() -> int:
        with open(status) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))

    before = switches()
    time.sleep(seconds)
    return switches() - before


def test_the_poll_window_is_a_gpu_hosts_and_a_host_cache_never_polls():
    assert POLL_S["cuda"] > 0 and POLL_S["cpu"] == 0


def test_a_host_cache_loop_sleeps_while_it_holds_a_request():
    """On a host cache the cores do the copies: its loop never polls, request or not."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS))
    try:
        dst.expect("r", np.arange(2), 8)  # no source connected: the request stays in flight
        assert loop_wakeups(dst) < SLEEPING
    finally:
        dst.close()


@pytest.mark.gpu
def test_a_loop_polls_after_an_event_only_while_it_holds_a_request_and_only_within_the_window():
    """A destination with nothing in flight sleeps. Once it expects a request (the call is
    an event) it polls, for ``POLL_S`` and no longer."""
    dev = _cuda()
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8, dev), Settings(**fr.SETTINGS))
    try:
        dst.slots_free()  # an event, with no request held
        assert loop_wakeups(dst) < SLEEPING
        dst.expect("r", np.arange(2), 8)  # no source connected: the request stays in flight
        assert loop_wakeups(dst, POLL_S["cuda"]) > POLLING
        time.sleep(POLL_S["cuda"] + 0.05)  # the window has passed
        assert loop_wakeups(dst) < SLEEPING
        assert dst.tracks("r")  # an event again: a call, the request still held
        assert loop_wakeups(dst, POLL_S["cuda"]) > POLLING
    finally:
        dst.close()


@pytest.mark.gpu
def test_a_peers_pings_do_not_keep_a_loop_polling():
    """A connected source pings its destination every second. The destination holds a
    request that source has not sent: once the window after ``expect`` has passed, the
    pings leave it asleep (each would otherwise open a new window)."""
    dev = _cuda()
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8, dev), Settings(**fr.SETTINGS))
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8, dev), Settings(**fr.SETTINGS))
    try:
        src.connect([dst.address])
        dst.expect("r", np.arange(2), 8)
        time.sleep(POLL_S["cuda"] + 0.1)  # its window has passed
        wakeups = loop_wakeups(dst, 2.5 * PING_INTERVAL_S)  # two pings at least arrive meanwhile
        assert wakeups < 100  # 50 idle waits of 50 ms, and the pings; one window a ping opened: 2,500
    finally:
        src.close()
        dst.close()


def test_loops_move_requests_byte_exact_and_sleep_once_they_are_done():
    """A 2->1 transfer of several chunks, callers taking the state lock the loops leave
    free between waits: the requests land exactly, and with nothing left in flight the
    loops sleep."""
    n, tokens = 3, 150  # 32-token slots at the destination: 5 chunks each
    settings = Settings(**fr.SETTINGS)
    dst, srcs, dpages, spages = fr.two_to_one(settings, n, tokens, seed=11, content=200)
    dcache = dst.cache
    try:
        hd = [dst.expect(f"r{k}", dpages[k], tokens) for k in range(n)]
        hs = [s.send(f"r{k}", p[k], tokens) for k in range(n) for s, p in zip(srcs, spages)]
        for h in hs + hd:
            h.wait(30)
        for k in range(n):
            assert check_shard(dcache, 200 + k, dpages[k], tokens, written=dpages) == [], f"request r{k}"
        fr.until(lambda: all(ep.stats().requests == 0 for ep in [dst] + srcs), 10)
        for ep in [dst] + srcs:
            assert loop_wakeups(ep) < SLEEPING, f"{ep.role} {ep.rank} still polls with nothing in flight"
    finally:
        for s in srcs:
            s.close()
        dst.close()
