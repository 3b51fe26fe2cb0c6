"""Layer-wise streaming (real endpoints, real NIXL, every byte checked).

A streamed request leaves in layer groups as the prefill's forward writes them
(``Source.stream``, ``Source.send(layers=)``); the destination reads each group
as soon as every source rank it needs said ready for it, and its one handle is
done once every layer is in. Each case fills the full cache from a seed, shards
it by source TP into random pages, streams it group by group, and compares the
destination's pages with the full cache sharded by destination TP.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.bench.reference import check_shard, fill_shard
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.protocol import stream as stream_mod
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.protocol.stream import MAX_GROUPS, STREAM_MIN_TOKENS, layer_groups
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

TOKEN = "s3cret"
SETTINGS = {"auth_token": TOKEN, "arena_mb": 0.25, "stall_timeout_s": 10.0}
TOKENS = STREAM_MIN_TOKENS + 37  # streamed, not on a page boundary


def _pages(ep, tokens: int, seed: int) -> np.ndarray:
    n = pages_needed(tokens, ep.spec.page.page_size)
    return np.random.default_rng([seed, ep.rank]).permutation(ep.cache.pages)[:n]


def _pair(src_tp, dst_tp, geo, src_page=(16, "nhd"), dst_page=(16, "nhd"), path="auto", dst_pages=None,
          device="cpu"):
    """Endpoints in this process (on a GPU too: one process cannot open its own CUDA IPC handles, so the
    route takes the read path there)."""
    tokens_pages = pages_needed(TOKENS, dst_page[0]) * 2 + 8
    dsts = [Destination(RankCache.allocate(SideSpec(geo, dst_tp, PageLayout(*dst_page)), r, dst_pages or tokens_pages,
                                           device), Settings(**SETTINGS)) for r in range(dst_tp)]
    srcs = [Source(RankCache.allocate(SideSpec(geo, src_tp, PageLayout(*src_page)), r,
                                      pages_needed(TOKENS, src_page[0]) * 2 + 8, device),
                   Settings(**(SETTINGS | {"path": path}))) for r in range(src_tp)]
    for s in srcs:
        s.connect([d.address for d in dsts])
    return srcs, dsts


def _close(*eps) -> None:
    for ep in eps:
        ep.close()


def _clear(*eps) -> None:
    fr.until(lambda: all((st.requests, st.slots_free) == (0, st.slots_total) for st in (ep.stats() for ep in eps)), 5)


def _stream(srcs, dsts, seed: int, tokens: int = TOKENS, expect_first: bool = True):
    """Stream one request from every source rank, layer by layer; the destinations' handles and pages."""
    spages = [_pages(s, tokens, seed) for s in srcs]
    for s, p in zip(srcs, spages):
        fill_shard(s.cache, seed, p, tokens)
    dpages = [_pages(d, tokens, seed) for d in dsts]
    expect = lambda: [d.expect("r", p, tokens) for d, p in zip(dsts, dpages)]  # noqa: E731
    hd = expect() if expect_first else None
    streams = [s.stream("r", p, tokens) for s, p in zip(srcs, spages)]
    for layer in range(1, srcs[0].spec.geometry.layers + 1):
        for st in streams:
            st.written(layer)
    if hd is None:
        hd = expect()
    return streams, hd, dpages


GEO = KVGeometry(6, 4, 16, "bfloat16")
CASES = {
    "2to1": dict(src_tp=2, dst_tp=1, geo=GEO),
    "1to2": dict(src_tp=1, dst_tp=2, geo=GEO),
    "4to2_replicas": dict(src_tp=4, dst_tp=2, geo=KVGeometry(4, 2, 16, "bfloat16"), dst_page=(4, "nhd")),
    "2to4_replicas": dict(src_tp=2, dst_tp=4, geo=KVGeometry(4, 2, 16, "bfloat16")),
    "mla_4to1_spread": dict(src_tp=4, dst_tp=1, geo=KVGeometry(8, 1, 32, "bfloat16", True)),
    "page16nhd_to_page1hnd": dict(src_tp=2, dst_tp=1, geo=GEO, dst_page=(1, "hnd")),
}
PATHS = ("read", "pages")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_streamed_request_lands_byte_exact(name, path):
    """Every plan shape (ratios, replicas, an MLA spread over layers, page size and layout), every host path:
    the groups are read as they come and the destination's pages hold exactly its shard."""
    srcs, dsts = _pair(**CASES[name], path=path)
    try:
        streams, hd, dpages = _stream(srcs, dsts, seed=7)
        for h in hd:
            h.wait(20)
        for st in streams:
            st.wait(20)
            assert len(st.groups) == min(MAX_GROUPS, srcs[0].spec.geometry.layers) > 1
        for d, h, p in zip(dsts, hd, dpages):
            assert h.state is State.DONE and h.path == path
            assert check_shard(d.cache, 7, p, TOKENS, untouched_fill=None) == []
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)


def test_a_streamed_request_on_the_direct_path_and_sent_before_it_is_expected():
    """Equal paging, whole shards: each group's page runs go straight into the destination's pages, and groups
    said ready before the destination expects the request are kept and read once it does."""
    srcs, dsts = _pair(2, 2, GEO, path="direct")
    try:
        streams, hd, dpages = _stream(srcs, dsts, seed=3, expect_first=False)
        for h in hd:
            h.wait(20)
        for d, h, p in zip(dsts, hd, dpages):
            assert h.path == "direct" and check_shard(d.cache, 3, p, TOKENS, untouched_fill=None) == []
        for st in streams:
            st.wait(20)
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)


def test_a_short_request_moves_whole_after_the_forward():
    """Below ``STREAM_MIN_TOKENS`` the stream is one group, sent once every layer is written."""
    assert layer_groups(32, STREAM_MIN_TOKENS - 1) == (range(0, 32),)
    srcs, dsts = _pair(2, 1, GEO)
    try:
        tokens = STREAM_MIN_TOKENS - 1
        spages = [_pages(s, tokens, 4) for s in srcs]
        for s, p in zip(srcs, spages):
            fill_shard(s.cache, 4, p, tokens)
        dp = _pages(dsts[0], tokens, 4)
        hd = dsts[0].expect("r", dp, tokens)
        streams = [s.stream("r", p, tokens) for s, p in zip(srcs, spages)]
        for st in streams:
            st.written(GEO.layers - 1)
            assert st.handles == []  # nothing leaves before the last layer
        for st in streams:
            st.written(GEO.layers)
            assert len(st.handles) == 1
        hd.wait(20)
        assert check_shard(dsts[0].cache, 4, dp, tokens, untouched_fill=None) == []
    finally:
        _close(*srcs, *dsts)


def test_layer_groups_are_even_whole_layers_covering_every_layer():
    for layers in (2, 3, 7, 8, 9, 32, 61, 80):
        for tokens in (STREAM_MIN_TOKENS, 8192):
            groups = layer_groups(layers, tokens)
            assert groups[0].start == 0 and groups[-1].stop == layers
            assert all(a.stop == b.start for a, b in zip(groups, groups[1:]))
            assert len(groups) == min(MAX_GROUPS, layers)
            assert max(map(len, groups)) - min(map(len, groups)) <= 1
    with pytest.raises(ValueError, match="layers=0"):
        layer_groups(0, 100)


def test_the_groups_of_one_request_must_not_overlap_and_lie_within_the_model():
    srcs, dsts = _pair(1, 1, GEO)
    try:
        p = _pages(srcs[0], TOKENS, 1)
        srcs[0].send("r", p, TOKENS, layers=range(0, 3))
        with pytest.raises(ValueError, match="layers 2..4 of request 'r' already in flight"):
            srcs[0].send("r", p, TOKENS, layers=range(2, 4))
        for bad in (range(0, 7), range(3, 3), range(0, 6, 2), (0, 3)):
            with pytest.raises(ValueError, match="must be a range of consecutive layers within 0..6"):
                srcs[0].send("q", p, TOKENS, layers=bad)
    finally:
        _close(*srcs, *dsts)


def test_a_request_aborted_mid_forward_frees_everything_on_both_sides():
    """The engine drops the request after some groups moved: the source aborts, the destination's handle fails
    by name, the groups not written yet are never sent, and every slot and request is free on both sides."""
    srcs, dsts = _pair(2, 1, GEO, path="read")
    try:
        spages = [_pages(s, TOKENS, 5) for s in srcs]
        for s, p in zip(srcs, spages):
            fill_shard(s.cache, 5, p, TOKENS)
        hd = dsts[0].expect("r", _pages(dsts[0], TOKENS, 5), TOKENS)
        streams = [s.stream("r", p, TOKENS) for s, p in zip(srcs, spages)]
        for st in streams:
            st.written(2)
        for st in streams:
            for h in st.handles:
                h.wait(20)  # those groups moved
        assert hd.state is State.TRANSFERRING
        streams[0].abort("client gone")
        with pytest.raises(TransferFailed) as err:
            hd.wait(5)
        assert err.value.peer == "source rank 0" and "client gone" in err.value.cause
        for st in streams:
            st.written(GEO.layers)  # the forward goes on: nothing more is sent
            assert len(st.handles) == 2 or st is streams[1]
        with pytest.raises(TransferFailed):
            streams[1].wait(5)
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)


def test_a_destination_that_aborts_fails_the_groups_still_to_come_at_once():
    """The decode drops the request after the first group: a group sent afterwards fails at once, naming it."""
    srcs, dsts = _pair(1, 1, GEO)
    try:
        sp = _pages(srcs[0], TOKENS, 6)
        fill_shard(srcs[0].cache, 6, sp, TOKENS)
        hd = dsts[0].expect("r", _pages(dsts[0], TOKENS, 6), TOKENS)
        st = srcs[0].stream("r", sp, TOKENS)
        st.written(1)
        st.handles[0].wait(20)
        hd.abort("decode dropped it")
        fr.until(lambda: srcs[0].stats().requests == 0, 5)
        st.written(GEO.layers)
        with pytest.raises(TransferFailed) as err:
            st.wait(5)
        assert "decode dropped it" in err.value.cause
        assert all(h.state is State.FAILED for h in st.handles[1:])
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)


def test_a_source_killed_after_some_groups_fails_the_request_by_name():
    """A prefill rank dies mid-forward, after some groups moved: the destination's request fails within a
    second, naming that rank, and nothing is held."""
    settings = fr.SETTINGS | {"auth_token": TOKEN}
    geo = KVGeometry(8, 4, 16, "bfloat16")
    dst = Destination(RankCache.allocate(fr.dst_spec(1, geo), 0, 512), Settings(**settings))
    src = fr.Rank(fr.source_rank, 1, 0, 256, settings, "", geo)
    try:
        src.call("connect", [list(dst.address)])
        hd = dst.expect("r", _pages(dst, TOKENS, 9), TOKENS)
        assert src.call("stream", "r", TOKENS, 9, 3) == [[0, 1], [1, 2], [2, 3]]
        fr.until(lambda: hd.state is State.TRANSFERRING, 10)
        t_kill = src.kill()
        with pytest.raises(TransferFailed) as err:
            hd.wait(5)
        took = time.monotonic() - t_kill
        # seen first by its control connection (connection lost) or by a read of its arena (remote disconnect)
        assert err.value.peer == "source rank 0" and any(
            x in err.value.cause for x in ("connection lost", "DISCONNECT")), str(err.value)
        assert took < 1.0, took
        fr.until(lambda: fr.free(dst.stats()), 5)
    finally:
        src.close()
        dst.close()


def test_the_rule_is_logged_once_per_model_and_choice(caplog, monkeypatch):
    monkeypatch.setattr(stream_mod, "_logged", set())
    with caplog.at_level("INFO", logger="kvstage"):
        for _ in range(3):
            layer_groups(32, 8192), layer_groups(32, 16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("streaming:")]
    assert len(lines) == 2, lines


# -- token spans: a chunked prefill's chunks, each sent as its forward ends ------------------------


def _send_spans(srcs, seed: int, tokens: int, cut: int, layers=None) -> list:
    """Every source rank sends its pages of the request in spans of ``cut`` tokens (a chunked prefill whose
    chunks are ``cut`` tokens), each with ``send(span=)``; the handles."""
    hs = []
    for s in srcs:
        pages = _pages(s, tokens, seed)
        fill_shard(s.cache, seed, pages, tokens)
        size = s.spec.page.page_size
        for a in range(0, tokens, cut):
            span = range(a, min(tokens, a + cut))
            chunk = pages[a // size : -(-span.stop // size)]
            hs.append(s.send("r", chunk, tokens, layers=layers, span=span))
    return hs


@pytest.mark.parametrize("path,src_tp,dst_tp,dst_page", [("read", 2, 1, (4, "nhd")), ("pages", 2, 1, (1, "hnd")),
                                                         ("direct", 2, 2, (16, "nhd")), ("read", 1, 2, (16, "nhd"))])
def test_a_chunked_prefill_sent_chunk_by_chunk_lands_byte_exact(path, src_tp, dst_tp, dst_page):
    """Each chunk's pages move as its forward ends (``send(span=)``, chunks of 128 tokens, the last one
    short): the destination reads each span as it comes, and its pages hold exactly its shard."""
    srcs, dsts = _pair(src_tp, dst_tp, GEO, dst_page=dst_page, path=path)
    try:
        dpages = [_pages(d, TOKENS, 11) for d in dsts]
        hd = [d.expect("r", p, TOKENS) for d, p in zip(dsts, dpages, strict=True)]
        hs = _send_spans(srcs, 11, TOKENS, 128)
        for h in hd + hs:
            h.wait(20)
        for d, h, p in zip(dsts, hd, dpages, strict=True):
            assert h.path == path and check_shard(d.cache, 11, p, TOKENS, untouched_fill=None) == []
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)


@pytest.mark.parametrize("first", [128, 150])
def test_spans_of_a_request_whose_prefix_is_cached_here_move_only_the_rest(first):
    """The decode holds the first ``first`` tokens already: spans wholly before them are not read (their
    sources still hear done), and the span they end in is read from ``first`` on, inside a page of the
    decode's or on its boundary."""
    srcs, dsts = _pair(2, 1, GEO, path="read")
    try:
        dst = dsts[0]
        want = TOKENS - first
        dpages = _pages(dst, want, 12)
        hd = dst.expect("r", dpages, want, first=first)
        hs = _send_spans(srcs, 12, TOKENS, 64)
        for h in [hd, *hs]:
            h.wait(20)
        fr.check_suffix(dst.cache, 12, dpages, first, want)
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)


def test_spans_and_layer_groups_together_cover_the_request_once():
    """Parts of both kinds (a span's layer groups) land byte-exact; a part overlapping another is refused
    by name on the source."""
    srcs, dsts = _pair(1, 1, GEO, path="read")
    try:
        dp = _pages(dsts[0], TOKENS, 13)
        hd = dsts[0].expect("r", dp, TOKENS)
        hs = _send_spans(srcs, 13, TOKENS, 256, layers=range(0, 3)) + _send_spans(srcs, 13, TOKENS, 256,
                                                                                  layers=range(3, 6))
        with pytest.raises(ValueError, match="layers 2..4 of tokens 0..256 of request 'r' already in flight"):
            srcs[0].send("r", _pages(srcs[0], 256, 13), TOKENS, layers=range(2, 4), span=range(0, 256))
        for h in [hd, *hs]:
            h.wait(20)
        assert check_shard(dsts[0].cache, 13, dp, TOKENS, untouched_fill=None) == []
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["2to1", "1to2", "4to2_replicas", "mla_4to1_spread", "page16nhd_to_page1hnd"])
def test_streamed_layer_groups_and_token_spans_on_a_gpu(name):
    """CUDA caches: layer groups, then token spans (a prefix cached at the decode), byte-exact."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    srcs, dsts = _pair(**CASES[name], path="auto", device="cuda")
    try:
        streams, hd, dpages = _stream(srcs, dsts, seed=21)
        for h in hd:
            h.wait(30)
        for d, p in zip(dsts, dpages, strict=True):
            assert check_shard(d.cache, 21, p, TOKENS, untouched_fill=None) == []
        for st in streams:
            st.wait(30)
        hs = _send_spans(srcs, 22, TOKENS, 128)
        dp = [_pages(d, TOKENS, 22) for d in dsts]
        hd = [d.expect("r", p, TOKENS) for d, p in zip(dsts, dp, strict=True)]
        for h in hd + hs:
            h.wait(30)
        for d, p in zip(dsts, dp, strict=True):
            assert check_shard(d.cache, 22, p, TOKENS, untouched_fill=None) == []
        _clear(*srcs, *dsts)
    finally:
        _close(*srcs, *dsts)
