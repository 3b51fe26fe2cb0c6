"""Staging: gather/scatter between ranks of different paging (native span copies and torch/numpy), the CUDA
kernel's word addressing, the slot allocator."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.arena import SlotAllocator, StagingArena
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather, prepare_piece_scatters, scatter_chunk
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.staging.words import META, WordGeometry, chunk_pages, piece_table, word_index
from kvstage.tp import SideSpec
from support.regions import expected_cache, expected_region, host_buffers, random_bytes, same_buffers

pytestmark = pytest.mark.usefixtures("host_copy")  # every host copy both ways: the native and the torch copier

GEO = KVGeometry(3, 4, 8, "bfloat16")
SIDES = [(16, "nhd"), (4, "hnd"), (1, "nhd"), (8, "hnd")]
RANGES = [(0, 37), (16, 32), (5, 20), (0, 64)]


def _token(buf, side, page_ids, t, lo, n):
    P = side.page.page_size
    p, o = page_ids[t // P], t % P
    if side.geometry.mla:
        v = buf[p, o]
    else:
        v = buf[p, o, lo : lo + n] if side.page.order == "nhd" else buf[p, lo : lo + n, o]
    return v.contiguous().view(torch.uint8)  # compare bytes: random bytes include NaNs


def _random_cache(side, pages, seed):
    c = RankCache.allocate(side, 0, pages, fill=None)
    random_bytes(c, seed)
    return c


@pytest.mark.parametrize("src,dst,rng", list(itertools.product(SIDES, SIDES, RANGES)))
@pytest.mark.parametrize("order", list(Order))
def test_gather_then_scatter_moves_exactly_the_slice(src, dst, rng, order):
    """A source of 4 heads gathers its heads 2..4 with its paging; a destination of 2 heads
    scatters them as its heads 0..2 with its own: page size and NHD/HND change on the way."""
    start, count = rng
    s = SideSpec(GEO, 1, PageLayout(*src))
    d = SideSpec(GEO, 2, PageLayout(*dst))
    sc = _random_cache(s, 80, 1)
    dc = RankCache.allocate(d, 0, 90, fill=0)
    rs = np.random.default_rng(2)
    sp = rs.permutation(80)[: pages_needed(start + count, src[0])]
    dp = rs.permutation(90)[: pages_needed(start + count, dst[0])]
    piece = RegionPiece(2, 2, range(GEO.buffers), 0, order)
    region = torch.empty(piece.nbytes(GEO.head_bytes(), count), dtype=torch.uint8)
    gather(sc, TokenIndex(sc, sp, start, count), [piece], region)
    scatter_chunk(dc, TokenIndex(dc, dp, start, count), [RegionPiece(0, 2, piece.buffers, 0, order)], region)
    for i in range(GEO.buffers):
        for t in range(start, start + count):
            assert torch.equal(_token(sc.buffers[i], s, sp, t, 2, 2), _token(dc.buffers[i], d, dp, t, 0, 2)), (i, t)
    touched = {int(p) for p in dp[start // dst[0] : pages_needed(start + count, dst[0])]}
    for p in set(range(90)) - touched:
        assert not dc.buffers[0][p].view(torch.uint8).any()


def test_a_region_for_a_whole_request_takes_its_chunks_one_row_window_at_a_time():
    """Rows of the whole request (``rows``), each chunk at its own ``row_first``: the chunks'
    gathers fill the region a gather of the whole request fills, and the region's
    chunk-by-chunk scatter rebuilds the request's pages."""
    s = SideSpec(GEO, 1, PageLayout(4, "hnd"))
    d = SideSpec(GEO, 1, PageLayout(16, "nhd"))
    sc = _random_cache(s, 40, 3)
    tokens = 90
    sp = np.random.default_rng(4).permutation(40)[: pages_needed(tokens, 4)]
    dp = np.random.default_rng(5).permutation(10)[: pages_needed(tokens, 16)]
    for order in Order:
        whole = RegionPiece(1, 3, range(1, 5), 0, order)
        want = torch.zeros(whole.nbytes(GEO.head_bytes(), tokens), dtype=torch.uint8)
        gather(sc, TokenIndex(sc, sp, 0, tokens), [whole], want)
        got = torch.zeros_like(want)
        dc, ref = RankCache.allocate(d, 0, 10, fill=0), RankCache.allocate(d, 0, 10, fill=0)
        for start in range(0, tokens, 37):
            count = min(37, tokens - start)
            window = RegionPiece(1, 3, range(1, 5), 0, order, rows=tokens, row_first=start)
            gather(sc, TokenIndex(sc, sp, start, count), [window], got)
            scatter_chunk(dc, TokenIndex(dc, dp, start, count), [window], want)
        assert torch.equal(got, want), order
        scatter_chunk(ref, TokenIndex(ref, dp, 0, tokens), [whole], want)
        assert same_buffers(host_buffers(dc), host_buffers(ref)), order


def _words_of(buf, word):
    return buf.view(-1).view(torch.uint8).numpy().view(np.dtype((np.void, word)))


def _kernel_on_host(cache, wg, pages, first, count, pieces, region: np.ndarray, to_region: bool) -> None:
    """Every word the kernel moves for ``pieces``, moved on the host through ``word_index``."""
    words = region.view(np.dtype((np.void, wg.word)))
    for piece in pieces:
        buffer, at_region, at_buffer = word_index(wg, pages, first, count, piece)
        for b in np.unique(buffer):
            mine = buffer == b
            kv = _words_of(cache.buffers[b], wg.word)
            if to_region:
                words[at_region[mine]] = kv[at_buffer[mine]]
            else:
                kv[at_buffer[mine]] = words[at_region[mine]]


def _kernel_pieces(mla: bool, count: int) -> list[RegionPiece]:
    """Pieces of disjoint heads and buffers in both orders, with shares of the buffers and row windows."""
    if mla:
        pieces = [RegionPiece(0, 1, range(0, 1), 0, Order.HEADS, rows=count + 2, row_first=2),
                  RegionPiece(0, 1, range(1, 2), 0, Order.TOKENS)]
    else:
        pieces = [RegionPiece(0, 4, range(0, 2), 0, Order.HEADS),
                  RegionPiece(1, 2, range(2, 6), 0, Order.TOKENS, rows=count + 5, row_first=4),
                  RegionPiece(3, 1, range(2, 6), 0, Order.HEADS, rows=count, row_first=0),
                  RegionPiece(0, 1, range(2, 6), 0, Order.TOKENS)]
    return end_to_end(pieces, 32, count, offset=16)


@pytest.mark.parametrize("side,rng,mla,word", [(s, r, m, w) for s in SIDES for r in RANGES for m in (False, True)
                                               for w in (16, 4) if not (m and s[1] == "hnd")])
def test_kernel_word_addressing_matches_the_reference(side, rng, mla, word):
    """The kernel's word map (``word_index``, the same arithmetic as the CUDA source, reading
    the same piece table), executed on the host, gathers the reference region and scatters
    the reference cache, every byte."""
    start, count = rng
    geo = KVGeometry(2, 1, 16, "bfloat16", True) if mla else KVGeometry(3, 4, 16, "bfloat16")  # 32-byte heads
    spec = SideSpec(geo, 1, PageLayout(*side))
    wg = WordGeometry.of(spec, word)
    assert wg is not None and wg.hnd == (side[1] == "hnd" and not mla)
    c = _random_cache(spec, 80, 3)
    ids = np.random.default_rng(4).permutation(80)[: pages_needed(start + count, side[0])]
    pages, first = chunk_pages(ids, side[0], start, count)
    pieces = _kernel_pieces(mla, count)
    size = pieces[-1].offset + pieces[-1].nbytes(geo.head_bytes(), count) + 16
    before = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    region = before.copy()
    _kernel_on_host(c, wg, pages, first, count, pieces, region, to_region=True)
    assert np.array_equal(region, expected_region(spec, host_buffers(c), ids, start, count, pieces, before))
    a = RankCache.allocate(spec, 0, 80, fill=0)
    zero = host_buffers(a)
    _kernel_on_host(a, wg, pages, first, count, pieces, before.copy(), to_region=False)
    assert same_buffers(host_buffers(a), expected_cache(spec, zero, ids, start, count, pieces, before))


@settings(max_examples=80, deadline=None)
@given(heads=st.sampled_from([1, 2, 3]), page=st.sampled_from([(1, "nhd"), (3, "hnd"), (16, "nhd"), (2, "hnd")]),
       start=st.integers(0, 30), count=st.integers(1, 30), order=st.sampled_from(list(Order)),
       lo=st.integers(0, 2), extra=st.sampled_from([None, 0, 3]), b0=st.integers(0, 3), seed=st.integers(0, 99))
def test_the_word_map_moves_each_word_once_to_the_place_the_rule_says(heads, page, start, count, order, lo, extra,
                                                                      b0, seed):
    """For any piece: no region word is written twice, and every word lands where the
    reference puts it."""
    geo = KVGeometry(2, heads, 8, "float32")  # 32-byte heads: two 16-byte words
    spec = SideSpec(geo, 1, PageLayout(*page))
    lo = min(lo, heads - 1)
    rows = None if extra is None else count + extra
    piece = RegionPiece(lo, heads - lo, range(b0, 4), 16, order, rows, 0 if extra is None else extra)
    ids = np.random.default_rng(seed).permutation(80)[: pages_needed(start + count, page[0])]
    pages, first = chunk_pages(ids, page[0], start, count)
    wg = WordGeometry.of(spec, 16)
    buffer, at_region, _ = word_index(wg, pages, first, count, piece)
    assert len(np.unique(at_region)) == len(at_region)
    c = _random_cache(spec, 80, seed)
    size = piece.offset + piece.nbytes(geo.head_bytes(), count)
    before = np.zeros(size, dtype=np.uint8)
    region = before.copy()
    _kernel_on_host(c, wg, pages, first, count, [piece], region, to_region=True)
    assert np.array_equal(region, expected_region(spec, host_buffers(c), ids, start, count, [piece], before))


def test_the_piece_table_holds_every_field_the_kernel_reads_in_order():
    pieces = [RegionPiece(1, 2, range(3, 7), 48, Order.TOKENS, rows=90, row_first=37), RegionPiece(0, 1, range(2), 0)]
    table = piece_table(pieces)
    assert table.dtype == np.int64 and len(table) == META * len(pieces)
    assert list(table) == [1, 2, 3, 4, 1, 90, 37, 48, 0, 0, 1, 0, 2, 0, 0, 0, 0, 4]  # last: its first checksum segment


def test_token_index_refuses_page_ids_outside_the_cache():
    c = RankCache.allocate(SideSpec(GEO, 1, PageLayout(4)), 0, 10)
    with pytest.raises(IndexError, match=r"page ids must lie in \[0, 10\); got 3\.\.10"):
        TokenIndex(c, np.array([3, 10, 4]), 0, 9)
    TokenIndex(c, np.array([3, 10, 4]), 0, 4)  # only the chunk's own pages are looked at


def test_word_geometry_refuses_heads_that_are_not_whole_words():
    spec = SideSpec(KVGeometry(2, 4, 4, "float16"), 1, PageLayout(4))  # 8-byte heads
    assert WordGeometry.of(spec, 16) is None
    assert WordGeometry.of(spec, 8) == WordGeometry(4, 4, 1, False, 8)


def test_on_the_host_a_chunks_pieces_scatter_in_one_pass():
    sc = _random_cache(SideSpec(GEO, 1, PageLayout(4, "hnd")), 40, 11)
    pieces = end_to_end([RegionPiece(0, 2, range(6), 0), RegionPiece(2, 2, range(6), 0)], GEO.head_bytes(), 45)
    region = torch.zeros(pieces[-1].offset + pieces[-1].nbytes(GEO.head_bytes(), 45), dtype=torch.uint8)
    assert prepare_piece_scatters(sc, TokenIndex(sc, np.arange(12), 3, 45), pieces, region) is None


@pytest.mark.parametrize("side,rng", list(itertools.product(SIDES, RANGES)))
@pytest.mark.parametrize("heads", [
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # four writers of one head each: the whole token
    [(0, 2), (2, 2)],
    [(1, 1), (2, 1), (3, 1)],  # adjacent but not the whole token
    [(2, 2), (0, 2)],  # out of head order: not a tiling
])
@pytest.mark.parametrize("order", list(Order))
def test_a_slot_of_writers_scatters_as_the_reference_says(side, rng, heads, order):
    """On the host, token-order writers laid end to end over adjacent heads are placed by one
    assignment per buffer (the torch copier's tiling); every slot, tiled or not, must leave
    the cache the reference leaves."""
    start, count = rng
    d = SideSpec(GEO, 1, PageLayout(*side))
    ids = np.random.default_rng(6).permutation(80)[: pages_needed(start + count, side[0])]
    pieces = end_to_end([RegionPiece(lo, n, range(GEO.buffers), 0, order) for lo, n in heads], GEO.head_bytes(), count)
    size = pieces[-1].offset + pieces[-1].nbytes(GEO.head_bytes(), count) + 32
    slot = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    one = RankCache.allocate(d, 0, 80, fill=0)
    zero = host_buffers(one)
    scatter_chunk(one, TokenIndex(one, ids, start, count), pieces, torch.from_numpy(slot.copy()))
    assert same_buffers(host_buffers(one), expected_cache(d, zero, ids, start, count, pieces, slot))


def test_slot_allocator_is_bounded_and_refuses_double_release():
    a = SlotAllocator(2)
    s1, s2 = a.acquire(), a.acquire()
    assert a.acquire() is None and a.free == 0  # back-pressure, never growth
    a.release(s1)
    assert a.acquire() == s1  # the most recently freed slot comes back first
    a.release(s2)
    with pytest.raises(ValueError, match="released twice"):
        a.release(s2)


def test_arena_slots_are_disjoint_views_of_one_buffer():
    arena = StagingArena(4096, 3, torch.device("cpu"))
    views = [arena.view(arena.offset(s), 4096) for s in range(3)]
    assert {v.data_ptr() - arena.buffer.data_ptr() for v in views} == {0, 4096, 8192}
    assert arena.buffer.numel() == 3 * 4096
