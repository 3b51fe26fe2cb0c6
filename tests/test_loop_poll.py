"""The endpoint loop polls its sockets for ``poll_us`` after each event while it
holds a request in flight, and sleeps otherwise (real endpoints, real NIXL, the loop
thread's own wake-ups as Linux counts them)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

import fault_ranks as fr
from kvstage.bench.reference import check_shard
from kvstage.config import DEFAULT_POLL_US, Settings
from kvstage.errors import ConfigError
from kvstage.protocol.destination import Destination
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache

POLLING = 200  # wake-ups a polling loop makes at least in WINDOW (every 20-200 µs: 1,250-12,500)
SLEEPING = 30  # and a sleeping one at most (a 50 ms idle wait: 5, and the peers' pings)
WINDOW = 0.25


def loop_wakeups(ep, seconds: float = WINDOW) -> int:
    """Times the endpoint's loop thread gave up its CPU (a wait) over the next ``seconds``."""
    status = f"/proc/self/task/{ep._thread.native_id}/status"

    def switches() -> int:
        with open(status) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))

    before = switches()
    time.sleep(seconds)
    return switches() - before


def test_settings_refuse_a_poll_that_is_not_a_bounded_number_of_microseconds(monkeypatch):
    for bad in (-1, 1_000_001, math.nan, math.inf, True, "5"):
        with pytest.raises(ConfigError, match=r"poll_us=.*: must be a number of microseconds in \[0, 1000000\]"):
            Settings(poll_us=bad)
    monkeypatch.setenv("KVSTAGE_POLL_US", "fast")
    with pytest.raises(ConfigError, match="KVSTAGE_POLL_US='fast': must be a float"):
        Settings()
    monkeypatch.setenv("KVSTAGE_POLL_US", "500")
    assert Settings().poll_seconds("cuda") == pytest.approx(500e-6)
    monkeypatch.delenv("KVSTAGE_POLL_US")
    s = Settings()
    assert s.poll_us is None
    assert s.poll_seconds("cuda") == pytest.approx(DEFAULT_POLL_US["cuda"] * 1e-6) and DEFAULT_POLL_US["cuda"] > 0
    assert s.poll_seconds("cpu") == 0.0
    assert Settings(poll_us=0).poll_seconds("cuda") == 0.0


def test_a_loop_polls_after_an_event_only_while_it_holds_a_request_and_only_within_the_window():
    """A destination with nothing in flight sleeps whatever ``poll_us`` says. Once it
    expects a request (the call is an event) it polls, for ``poll_us`` and no longer;
    with ``poll_us`` 0 it sleeps throughout."""
    cache = RankCache.allocate(fr.dst_spec(), 0, 8)
    polling = Destination(cache, Settings(**fr.SETTINGS, poll_us=600_000))
    still = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS, poll_us=0))
    try:
        polling.slots_free()  # an event, with no request held
        assert loop_wakeups(polling) < SLEEPING
        for ep in (polling, still):
            ep.expect("r", np.arange(2), 8)  # no source connected: the request stays in flight
        t = time.perf_counter()
        assert loop_wakeups(polling) > POLLING
        assert loop_wakeups(still) < SLEEPING
        time.sleep(max(0.0, 0.6 - (time.perf_counter() - t)) + 0.05)  # the window has passed
        assert loop_wakeups(polling) < SLEEPING
        assert polling.tracks("r")  # an event again: a call, the request still held
        assert loop_wakeups(polling) > POLLING
    finally:
        polling.close()
        still.close()


def test_a_peers_pings_do_not_keep_a_loop_polling():
    """A connected source pings its destination every second. The destination holds a
    request that source has not sent: once the window after ``expect`` has passed, the
    pings leave it asleep (each would otherwise open a new window)."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS, poll_us=300_000))
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), Settings(**fr.SETTINGS, poll_us=0))
    try:
        src.connect([dst.address])
        dst.expect("r", np.arange(2), 8)
        heard = dst._call(lambda: max(dst._heard.values()))  # a call: an event too
        time.sleep(0.4)  # its window has passed
        wakeups = loop_wakeups(dst, 2.5)
        assert dst._call(lambda: max(dst._heard.values())) > heard + 1.4  # a ping came while they were counted
        assert wakeups < 100  # 50 idle waits of 50 ms, and the pings; one window a ping opened: 1,500
    finally:
        src.close()
        dst.close()


def test_polling_loops_move_requests_byte_exact_and_sleep_once_they_are_done():
    """Every loop polls (a 2->1 transfer of several chunks, callers taking the state
    lock the polling loops leave free between waits): the requests land exactly, and
    with nothing left in flight the loops sleep though the window is still open."""
    n, tokens = 3, 150  # 32-token slots at the destination: 5 chunks each
    settings = Settings(**fr.SETTINGS, poll_us=1_000_000)
    dst, srcs, dpages, spages = fr.two_to_one(settings, n, tokens, seed=11, content=200)
    dcache = dst.cache
    try:
        hd = [dst.expect(f"r{k}", dpages[k], tokens) for k in range(n)]
        hs = [s.send(f"r{k}", p[k], tokens) for k in range(n) for s, p in zip(srcs, spages)]
        for h in hs + hd:
            h.wait(30)
        for k in range(n):
            assert check_shard(dcache, 200 + k, dpages[k], tokens, written=dpages) == [], f"request r{k}"
        deadline = time.monotonic() + 10
        while any(ep._call(lambda ep=ep: bool(ep.requests)) for ep in [dst] + srcs):
            assert time.monotonic() < deadline, "requests still held after they completed"
            time.sleep(0.01)
        for ep in [dst] + srcs:
            assert loop_wakeups(ep) < SLEEPING, f"{ep.role} {ep.rank} still polls with nothing in flight"
    finally:
        for s in srcs:
            s.close()
        dst.close()
