"""The orders a request's two sides can meet in (real endpoints, real NIXL, bytes checked).

A source's ``send`` and a destination's ``expect`` are independent calls on two
engines: either may come first, the source may not even be connected yet, and a
request sent to any engine is read by whichever engine expects it first. Every
order lands byte-exact or fails both sides by name; none waits for a timeout it
need not.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.bench.reference import fill_shard
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import PageLayout, pages_needed
from kvstage.protocol import dst_requests
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

TOKEN = "s3cret"
SETTINGS = fr.SETTINGS | {"auth_token": TOKEN}


def _dst(spec=None, rank: int = 0, pages: int = 128, engine: str = "", **over) -> Destination:
    return Destination(RankCache.allocate(spec or fr.dst_spec(), rank, pages), Settings(**(SETTINGS | over)),
                       engine=engine)


def _src(tp: int = 1, rank: int = 0, spec=None, engine: str = "", **over) -> Source:
    return Source(RankCache.allocate(spec or fr.src_spec(tp), rank, 64), Settings(**(SETTINGS | over)), engine=engine)


def _pages(ep, tokens: int, seed: int) -> np.ndarray:
    """Random pages of ``ep``'s cache for ``tokens`` tokens."""
    n = pages_needed(tokens, ep.spec.page.page_size)
    return np.random.default_rng([seed, ep.rank]).permutation(ep.cache.pages)[:n]


def _filled(src, tokens: int, seed: int) -> np.ndarray:
    pages = _pages(src, tokens, seed)
    fill_shard(src.cache, seed, pages, tokens)
    return pages


def _fails(h, peer: str, stage: str, cause: str, within: float = 5.0) -> None:
    with pytest.raises(TransferFailed) as err:
        h.wait(within)
    e = err.value
    assert (e.peer, e.stage) == (peer, stage) and cause in e.cause, str(e)


def _clear(*eps) -> None:
    """Nothing of any request is held and every slot is free, on every endpoint."""
    fr.until(lambda: all((st.requests, st.slots_free) == (0, st.slots_total) for st in (ep.stats() for ep in eps)), 5)


def _close(*eps) -> None:
    for ep in eps:
        ep.close()


def test_ready_before_expect_is_kept_and_read_when_expected():
    """The source says ready first (its prefill ended before the decode scheduled the request): the
    destination keeps the ready and reads the request the moment it is expected."""
    dst, src = _dst(), _src()
    try:
        src.connect([dst.address])
        spages = _filled(src, 100, 1)
        hs = src.send("r", spages, 100)
        fr.until(lambda: dst.stats().unknown_announced == 1, 5)
        assert hs.state is State.PENDING
        dpages = _pages(dst, 100, 1)
        hd = dst.expect("r", dpages, 100)
        hd.wait(10), hs.wait(10)
        assert fr.check(dst.cache, 1, dpages, 100) == []
        assert dst.stats().unknown_announced == 0
        _clear(dst, src)
    finally:
        _close(src, dst)


def test_readies_kept_before_expect_are_bounded_the_oldest_dropped(monkeypatch):
    """At most ``MAX_EARLY`` requests' readies are kept: past that the oldest goes, and its request,
    expected later, waits for a ready that will not come again, until ``ready_timeout_s`` fails it on
    both sides; the kept ones are read byte-exact."""
    monkeypatch.setattr(dst_requests, "MAX_EARLY", 2)
    dst, src = _dst(ready_timeout_s=0.5), _src(ready_timeout_s=60)
    try:
        src.connect([dst.address])
        sent = {f"e{i}": (src.send(f"e{i}", _filled(src, 40, 10 + i), 40), 10 + i) for i in range(3)}
        fr.until(lambda: dst.stats().unknown_announced == 2, 5)
        for req in ("e1", "e2"):
            dpages = _pages(dst, 40, sent[req][1])
            dst.expect(req, dpages, 40).wait(10)
            sent[req][0].wait(10)
            assert fr.check(dst.cache, sent[req][1], dpages, 40) == []
        hd = dst.expect("e0", _pages(dst, 40, 10), 40)
        _fails(hd, "source ranks 0", "waiting for writers", "not ready within 0.5 s")
        _fails(sent["e0"][0], "destination rank 0", "abort", "destination aborted: not ready within 0.5 s")
        _clear(dst, src)
    finally:
        _close(src, dst)


def test_expect_before_ready_waits_for_every_writer():
    """Prefill TP 2: the destination expects first, then rank 0 says ready, then rank 1: nothing is
    read until the last writer is ready, then every byte lands."""
    dst, s0, s1 = _dst(), _src(2, 0), _src(2, 1)
    try:
        s0.connect([dst.address]), s1.connect([dst.address])
        dpages = _pages(dst, 150, 2)
        hd = dst.expect("r", dpages, 150)
        h0 = s0.send("r", _filled(s0, 150, 2), 150)
        time.sleep(0.2)  # rank 0's ready is in
        assert hd.state is State.PENDING and h0.state is State.PENDING  # one writer of two: nothing read yet
        assert dst.stats().announced == 0
        h1 = s1.send("r", _filled(s1, 150, 2), 150)
        for h in (hd, h0, h1):
            h.wait(10)
        assert fr.check(dst.cache, 2, dpages, 150) == []
        _clear(dst, s0, s1)
    finally:
        _close(s0, s1, dst)


def test_expect_before_the_source_even_connected():
    """The decode schedules a request before the prefill engine's ranks connect: it waits for them,
    unfailed, and lands once they connect and send."""
    dst = _dst()
    src = None
    try:
        dpages = _pages(dst, 100, 3)
        hd = dst.expect("r", dpages, 100)
        assert not dst.connected()
        src = _src()
        src.connect([dst.address])
        assert dst.connected() and hd.state is State.PENDING
        src.send("r", _filled(src, 100, 3), 100).wait(10)
        hd.wait(10)
        assert fr.check(dst.cache, 3, dpages, 100) == []
    finally:
        _close(*([src] if src else []), dst)


@pytest.mark.parametrize("early", [False, True], ids=["expected_first", "ready_first"])
def test_a_token_count_that_differs_fails_both_sides_by_name(early):
    """The destination expects 10 tokens, both source ranks send 13: whichever comes first, the
    destination refuses the ready naming both counts, and every source hears why and frees its slots."""
    dst, s0, s1 = _dst(), _src(2, 0), _src(2, 1)
    try:
        s0.connect([dst.address]), s1.connect([dst.address])
        if not early:
            hd = dst.expect("r", np.arange(3), 10)
        hs = [s.send("r", _filled(s, 13, 4), 13) for s in (s0, s1)]
        if early:
            fr.until(lambda: dst.stats().unknown_announced == 1 and dst.stats().requests == 0, 5)
            hd = dst.expect("r", np.arange(3), 10)
        words = "the source sends 13 tokens of 'r'; this rank expects tokens 0..10"
        with pytest.raises(TransferFailed) as err:
            hd.wait(5)
        assert err.value.stage == "ready" and err.value.peer in ("source rank 0", "source rank 1")
        assert err.value.cause.endswith(words), str(err.value)
        for h in hs:
            _fails(h, "destination rank 0", "abort", "destination aborted: " + words)
        _clear(dst, s0, s1)
    finally:
        _close(s0, s1, dst)


def test_a_request_of_an_engine_whose_every_rank_left_fails_at_once():
    """Engine p's only rank connected and left: a request expected from p fails the moment it is
    expected, naming why (no ready can come). One from an engine that never connected waits."""
    dst = _dst()
    try:
        src = _src(engine="p")
        src.connect([dst.address])
        src.close()
        fr.until(lambda: dst.stats().engines == 0, 5)
        h = dst.expect("r", np.arange(3), 10, engine="p")
        _fails(h, "prefill engine 'p'", "waiting for writers", "every rank of prefill engine 'p' left: connection lost "
               "with the last, source rank 0 of engine p (", within=0.5)
        waits = dst.expect("r", np.arange(3, 6), 10, engine="q")
        assert not waits.done() and dst.tracks("r", engine="q")
        waits.abort("test over")
    finally:
        dst.close()


def test_a_request_that_needs_a_rank_that_left_fails_at_once_and_reads_again_once_it_rejoins():
    """Rank 0 of a TP 2 prefill engine left (a killed prefill's ranks leave one by one); rank 1 is still
    connected. A request expected now fails at once, naming rank 0 and why, and rank 1 hears the abort
    (the ready it sent first is let go). Rank 0 comes back under the same identity: the next request is
    read, byte-exact."""
    dst = _dst()
    s0, s1 = _src(2, 0, engine="p"), _src(2, 1, engine="p")
    try:
        s0.connect([dst.address]), s1.connect([dst.address])
        s0.close()
        fr.until(lambda: dst.stats().peers == 1, 5)
        early = s1.send("r", _filled(s1, 10, 1), 10)
        fr.until(lambda: dst.stats().unknown_announced == 1, 5)
        h = dst.expect("r", np.arange(3), 10, engine="p")
        _fails(h, "source rank 0 of engine p", "waiting for writers", "source rank 0 of engine p left: connection "
               "lost (", within=0.5)
        _fails(early, "destination rank 0", "abort", "destination aborted: source rank 0 of engine p left")
        s0 = _src(2, 0, engine="p")
        s0.connect([dst.address])
        ids = _pages(dst, 10, 2)
        hd = dst.expect("again", ids, 10, engine="p")
        hs = [s.send("again", _filled(s, 10, 3 + s.rank), 10) for s in (s0, s1)]
        hd.wait(10)
        for hh in hs:
            hh.wait(10)
        _clear(dst, s0, s1)
    finally:
        _close(s0, s1, dst)


@pytest.mark.parametrize("path,first,read_by", [("read", 40, "read"), ("read", 70, "read"), ("pages", 37, "pages"),
                                                ("direct", 40, "direct"), ("direct", 38, "pages")])
def test_first_past_zero_receives_a_suffix(path, first, read_by):
    """The decode has the first tokens cached already (``first``): it receives only the rest, by the
    path the source named; chunks wholly before ``first`` are not read (their slots come back), and a
    direct read whose tokens start inside a page reads the head slices instead."""
    tokens = 130
    spec = SideSpec(fr.GEO, 1, PageLayout(4)) if path == "direct" else None
    dst, src = _dst(), _src(spec=spec, path=path)
    try:
        src.connect([dst.address])
        hs = src.send("r", _filled(src, tokens, 5), tokens)
        dpages = _pages(dst, tokens - first, 5)
        hd = dst.expect("r", dpages, tokens - first, first=first)
        hd.wait(10), hs.wait(10)
        assert hd.path == read_by and hs.path == path
        fr.check_suffix(dst.cache, 5, dpages, first, tokens - first)
        _clear(dst, src)
    finally:
        _close(src, dst)


def test_a_request_sent_to_any_engine_is_read_by_one_and_the_others_hear_abort():
    """vLLM's prefill does not know its decode: ``engine=None`` tells every connected decode engine.
    The first to expect it reads it byte-exact; the other hears ``abort`` and fails it at once when it
    expects it after all."""
    d1, d2, src = _dst(engine="d1"), _dst(engine="d2"), _src()
    try:
        src.connect([d1.address, d2.address])
        hs = src.send("r", _filled(src, 100, 6), 100, engine=None)
        fr.until(lambda: d1.stats().unknown_announced == 1 and d2.stats().unknown_announced == 1, 5)
        dpages = _pages(d1, 100, 6)
        d1.expect("r", dpages, 100).wait(10)
        hs.wait(10)
        assert fr.check(d1.cache, 6, dpages, 100) == []
        fr.until(lambda: (d2.stats().unknown_announced, d2.stats().aborts_remembered) == (0, 1), 5)
        _fails(d2.expect("r", _pages(d2, 100, 6), 100), "source rank 0", "abort",
               "source aborted: taken by engine 'd1'", within=1)
        _clear(d1, d2, src)
    finally:
        _close(src, d1, d2)


def test_a_request_sent_before_a_second_engine_connects_is_read_by_it():
    """A request sent to any engine is told to an engine that connects after the send (here of another
    TP size, two ranks): that engine reads it, and the first engine, which did not, hears ``abort``."""
    d1 = _dst(engine="d1")
    spec2 = SideSpec(fr.GEO, 2, PageLayout(4))
    d2 = [_dst(spec2, rank, engine="d2") for rank in range(2)]
    src = _src()
    try:
        src.connect([d1.address])
        hs = src.send("r", _filled(src, 100, 7), 100, engine=None)
        fr.until(lambda: d1.stats().unknown_announced == 1, 5)
        assert src.connect([d.address for d in d2]) == [0, 1]
        pages = [_pages(d, 100, 7) for d in d2]
        hd = [d.expect("r", p, 100) for d, p in zip(d2, pages)]
        for h in hd + [hs]:
            h.wait(10)
        for d, p in zip(d2, pages):
            assert fr.check(d.cache, 7, p, 100) == []
        fr.until(lambda: (d1.stats().unknown_announced, d1.stats().aborts_remembered) == (0, 1), 5)
        _clear(d1, *d2, src)
    finally:
        _close(src, d1, *d2)


@pytest.mark.parametrize("slots", [1, 4])
def test_a_chunk_takes_a_slot_with_its_first_writer_and_slot_wait_counts_only_a_full_arena(slots):
    """Prefill TP 2, two fake sources: rank 0 says both chunks are gathered, rank 1 only 0.3 s later. A
    chunk takes a destination slot as soon as its first writer's piece is readable and holds it until
    every writer's is read; the second chunk, readable meanwhile, waits for a slot only where there is
    none free (``slot_wait``). Either way every byte lands."""
    from support.fake_peers import FakeSource

    tokens, per, seed = 16, 8, 17  # two chunks of 8 tokens: a 4 KiB destination slot each
    dst = _dst(arena_mb=slots * 4096 / 2**20, pages=16)
    fakes = []
    try:
        assert dst.stats().slots_total == slots
        fakes = [FakeSource(dst.address, token=TOKEN, spec=fr.src_spec(2), rank=r, engine="two") for r in range(2)]
        dpages = _pages(dst, tokens, seed)
        hd = dst.expect("r", dpages, tokens, engine="two")
        for f in fakes:
            f.ready("r", tokens, "read", chunk_tokens=per, chunks=2, gathered=[], order="tokens")
        for f in fakes:
            for i in range(2):
                f.stage(seed, i * per, per, i * 16384)
        for i in range(2):
            fakes[0].chunk("r", i, i * 16384)
        time.sleep(0.3)
        for i in range(2):
            fakes[1].chunk("r", i, i * 16384)
        hd.wait(5)
        assert fr.check(dst.cache, seed, dpages, tokens) == []
        if slots == 1:
            assert hd.stages["slot_wait"] >= 0.25, hd.stages
        else:
            assert hd.stages["slot_wait"] < 0.05, hd.stages
    finally:
        for f in fakes:
            f.close()
        dst.close()
