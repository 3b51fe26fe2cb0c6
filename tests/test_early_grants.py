"""Early grants: a destination grants the first ``grants.EARLY_CHUNKS`` chunks of a
request when it expects it, before its sources announce it, so a source
gathers and writes the moment it sends. Checked against a hand-driven source
(``fake_peers.FakeSource``, real NIXL writes): how many early grants go out,
that announced requests come first, when a request may be DONE, and that the
stall clock of an early grant starts only with the announcement.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from support import fault_ranks as fr
from support.fake_peers import FakeSource
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.staging.cache import RankCache

TOKEN = "early-test"
CHUNK = 32  # tokens per chunk: 4 slots of 16 KiB, 512 B a token (fault_ranks geometry, source TP 1)


def _pair(**over):
    # peer_timeout_s: the fake source does not ping like a real one
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 1024),
                      Settings(**(fr.SETTINGS | dict(auth_token=TOKEN, peer_timeout_s=600) | over)))
    return dst, FakeSource(dst.address, TOKEN)


@pytest.fixture
def pair():
    dst, src = _pair()
    yield dst, src
    src.close()
    dst.close()


def _expect(dst: Destination, req: str, tokens: int, first_page: int):
    ids = np.random.default_rng(first_page).permutation(np.arange(first_page, first_page + pages_needed(tokens, 4)))
    return dst.expect(req, ids, tokens), ids


def _no_grant(src: FakeSource, req: str, wait: float = 0.3) -> None:
    with pytest.raises(TimeoutError):
        m = src.message(lambda m: m["type"] == "grant" and m["req"] == req, timeout=wait)
        pytest.fail(f"unexpected grant {m}")


def test_early_grants_take_at_most_early_chunks_each_and_leave_half_the_slots(pair):
    dst, src = pair
    tokens = 8 * CHUNK
    ha, ids_a = _expect(dst, "a", tokens, 0)
    ga = {c: src.grant("a", c) for c in (0, 1)}  # before anyone announced "a"
    assert ga[0]["tokens"] == tokens and ga[0]["chunks"] == 8
    _no_grant(src, "a")
    assert dst.slots_free() == 2 and ha.state is State.PENDING
    hb, ids_b = _expect(dst, "b", tokens, 200)
    _no_grant(src, "b")  # one more early slot would leave fewer than half of the 4 free
    src.announce("b", tokens, 2)
    gb = {c: src.grant("b", c) for c in (0, 1)}  # announced: the free half is its
    assert dst.slots_free() == 0 and hb.state is State.TRANSFERRING and ha.state is State.PENDING
    src.announce("a", tokens, 1)
    for c in range(8):
        src.write("a", ga[c] if c in ga else src.grant("a", c))
    for c in range(8):
        src.write("b", gb[c] if c in gb else src.grant("b", c))
    ha.wait(10), hb.wait(10)
    assert fr.check(dst.cache, 1, ids_a, tokens) == [] and fr.check(dst.cache, 2, ids_b, tokens) == []
    assert dst.slots_free() == 4 and dst.stats().requests == 0


def test_announced_requests_take_freed_slots_before_early_grants(pair):
    dst, src = pair
    hk, ids_k = _expect(dst, "k", CHUNK, 0)  # holds one slot throughout
    gk = src.grant("k", 0)
    hh, _ = _expect(dst, "h", 3 * CHUNK, 100)
    src.announce("h", 3 * CHUNK, 1)
    for c in range(3):
        src.grant("h", c)
    hx, _ = _expect(dst, "x", 8 * CHUNK, 200)  # expected first, never announced
    hb, ids_b = _expect(dst, "b", 8 * CHUNK, 300)
    src.announce("b", 8 * CHUNK, 2)
    assert dst.slots_free() == 0
    hh.abort("three slots free at once")
    assert src.message(lambda m: m["type"] == "abort" and m["req"] == "h")
    src.conn.send({"type": "abort_ack", "req": "h"})  # nothing of "h" was written: its 3 slots come back together
    gb = {c: src.grant("b", c) for c in range(3)}
    _no_grant(src, "x")  # an early grant now would leave fewer than half the slots to "b"
    for c in range(8):
        src.write("b", gb[c] if c in gb else src.grant("b", c))
    hb.wait(10)
    assert fr.check(dst.cache, 2, ids_b, 8 * CHUNK) == []
    src.announce("k", CHUNK, 3)
    src.write("k", gk)
    hk.wait(10)
    assert fr.check(dst.cache, 3, ids_k, CHUNK) == []
    hx.abort("done with the test")


def test_early_grants_alone_leave_the_loop_idle(pair):
    """Chunks granted to a prefill still computing do not make the destination's
    loop poll the transport every few microseconds; the announcement does."""
    dst, src = pair
    h, ids = _expect(dst, "r", CHUNK, 0)
    g = src.grant("r", 0)
    assert dst.stats().polling is False
    src.announce("r", CHUNK, 9)
    deadline = time.monotonic() + 5
    while not dst.stats().polling:
        assert time.monotonic() < deadline, "announced, and still idle"
        time.sleep(0.01)
    src.write("r", g)
    h.wait(10)
    assert fr.check(dst.cache, 9, ids, CHUNK) == []


def test_a_request_expected_before_its_writer_connects_is_granted_on_connect():
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 1024),
                      Settings(**(fr.SETTINGS | dict(auth_token=TOKEN, peer_timeout_s=600))))
    try:
        h, ids = _expect(dst, "r", 3 * CHUNK, 0)
        src = FakeSource(dst.address, TOKEN)
        try:
            g0, g1 = src.grant("r", 0), src.grant("r", 1)
            src.announce("r", 3 * CHUNK, 4)
            src.write("r", g0), src.write("r", g1), src.write("r", src.grant("r", 2))
            h.wait(10)
            assert fr.check(dst.cache, 4, ids, 3 * CHUNK) == []
        finally:
            src.close()
    finally:
        dst.close()


def _scattered(dst: Destination) -> None:
    """Wait until the destination has taken every landed chunk off its slots (notices are polled)."""
    deadline = time.monotonic() + 5
    while dst.slots_free() != dst.arena.allocator.count:
        assert time.monotonic() < deadline, "the landed chunk was not scattered"
        time.sleep(0.01)


def test_done_waits_for_the_announcement_which_checks_the_token_count(pair):
    """Every chunk can land before the source's ``ready`` (control and data take
    different paths); the request is DONE only once that announcement came and
    named the expected token count."""
    dst, src = pair
    h, ids = _expect(dst, "r", CHUNK, 0)
    src.announce("r", CHUNK, 5, say=False)
    src.write("r", src.grant("r", 0))
    _scattered(dst)
    time.sleep(0.1)
    assert h.state is State.PENDING  # scattered, slot free, not done
    src.conn.send({"type": "ready", "req": "r", "tokens": CHUNK})
    h.wait(10)
    assert fr.check(dst.cache, 5, ids, CHUNK) == []

    h, _ = _expect(dst, "bad", CHUNK, 100)
    src.announce("bad", CHUNK, 6, say=False)
    src.write("bad", src.grant("bad", 0))
    _scattered(dst)  # the chunk landed before the announcement (else it would wait in quarantine for an ack)
    src.conn.send({"type": "ready", "req": "bad", "tokens": CHUNK + 1})
    with pytest.raises(TransferFailed, match=f"source announced {CHUNK + 1} tokens, destination expects {CHUNK}"):
        h.wait(10)
    assert dst.slots_free() == 4


def test_the_stall_clock_of_an_early_grant_starts_with_the_announcement():
    dst, src = _pair(stall_timeout_s=0.5)
    try:
        h, ids = _expect(dst, "r", CHUNK, 0)
        g = src.grant("r", 0)
        time.sleep(1.0)  # twice stall_timeout_s: the prefill is still running, nothing is late
        assert h.state is State.PENDING
        src.announce("r", CHUNK, 7)
        src.write("r", g)
        h.wait(10)
        assert fr.check(dst.cache, 7, ids, CHUNK) == []

        h, _ = _expect(dst, "late", CHUNK, 100)
        src.grant("late", 0)
        src.announce("late", CHUNK, 8)  # announced, and then never written, while the source runs
        with pytest.raises(TransferFailed, match="chunk 0 not landed 0.5 s after its grant"):
            for _ in range(50):  # 5 s
                src.ping()
                time.sleep(0.1)
                if h.done():
                    h.wait(0)
    finally:
        src.close()
        dst.close()
