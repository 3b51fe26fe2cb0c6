"""Staging: gather/scatter (native span copies and torch/numpy), the CUDA kernel's word addressing, the slot allocator."""

import itertools

import numpy as np
import pytest
import torch

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.arena import SlotAllocator, StagingArena
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather, gather_pieces, prepare_piece_scatters, region_bytes, scatter, scatter_chunk
from kvstage.staging.words import WordGeometry, chunk_pages, word_index
from kvstage.tp import SideSpec

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
    g = torch.Generator().manual_seed(seed)
    for b in c.buffers:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return c


@pytest.mark.parametrize("src,dst,rng", list(itertools.product(SIDES, SIDES, RANGES)))
def test_gather_then_scatter_moves_exactly_the_slice(src, dst, rng):
    start, count = rng
    s = SideSpec(GEO, 1, PageLayout(*src))
    d = SideSpec(GEO, 2, PageLayout(*dst))
    sc = _random_cache(s, 80, 1)
    dc = RankCache.allocate(d, 0, 90, fill=0)
    rs = np.random.default_rng(2)
    sp = rs.permutation(80)[: pages_needed(start + count, src[0])]
    dp = rs.permutation(90)[: pages_needed(start + count, dst[0])]
    region = torch.empty(region_bytes(sc, count, 2), dtype=torch.uint8)
    gather(sc, TokenIndex(sc, sp, start, count), 2, 2, region)
    scatter(dc, TokenIndex(dc, dp, start, count), 0, 2, region)
    for i in range(GEO.buffers):
        for t in range(start, start + count):
            assert torch.equal(_token(sc.buffers[i], s, sp, t, 2, 2), _token(dc.buffers[i], d, dp, t, 0, 2)), (i, t)
    touched = {int(p) for p in dp[start // dst[0] : pages_needed(start + count, dst[0])]}
    for p in set(range(90)) - touched:
        assert not dc.buffers[0][p].view(torch.uint8).any()


def _words_of(buf, word):
    return buf.view(-1).view(torch.uint8).numpy().view(np.dtype((np.void, word)))


@pytest.mark.parametrize("side,rng,mla,word", [(s, r, m, w) for s in SIDES for r in RANGES for m in (False, True)
                                               for w in (16, 4) if not (m and s[1] == "hnd")])
def test_kernel_word_addressing_matches_the_reference_copy(side, rng, mla, word):
    """The kernel's word map (word_index, the same arithmetic as the CUDA source),
    executed on the host, equals the torch gather; and scattering through it equals the torch scatter."""
    start, count = rng
    geo = KVGeometry(2, 1, 16, "bfloat16", True) if mla else GEO
    spec = SideSpec(geo, 1, PageLayout(*side))
    wg = WordGeometry.of(spec, word)
    assert wg is not None and wg.hnd == (side[1] == "hnd" and not mla)
    c = _random_cache(spec, 80, 3)
    ids = np.random.default_rng(4).permutation(80)[: pages_needed(start + count, side[0])]
    pages, first = chunk_pages(ids, side[0], start, count)
    for lo, n in ([(0, 1)] if mla else [(0, 4), (1, 2), (3, 1)]):
        ref = torch.empty(region_bytes(c, count, n), dtype=torch.uint8)
        gather(c, TokenIndex(c, ids, start, count), lo, n, ref)
        at = word_index(wg, pages, first, count, lo, n)
        per_buffer = ref.numel() // geo.buffers
        assert len(at) * word == per_buffer
        host = np.concatenate([_words_of(b, word)[at] for b in c.buffers])
        assert host.tobytes() == ref.numpy().tobytes(), (lo, n)
        # and back: scatter through the map into a zeroed copy equals the torch scatter
        a = RankCache.allocate(spec, 0, 80, fill=0)
        b = RankCache.allocate(spec, 0, 80, fill=0)
        region = ref.numpy().view(np.dtype((np.void, word))).reshape(geo.buffers, -1)
        for k, buf in enumerate(a.buffers):
            _words_of(buf, word)[at] = region[k]
        scatter(b, TokenIndex(b, ids, start, count), lo, n, ref)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.buffers, b.buffers))


def test_token_index_refuses_page_ids_outside_the_cache():
    c = RankCache.allocate(SideSpec(GEO, 1, PageLayout(4)), 0, 10)
    with pytest.raises(IndexError, match=r"page ids must lie in \[0, 10\); got 3\.\.10"):
        TokenIndex(c, np.array([3, 10, 4]), 0, 9)
    TokenIndex(c, np.array([3, 10, 4]), 0, 4)  # only the chunk's own pages are looked at


def test_word_geometry_refuses_heads_that_are_not_whole_words():
    spec = SideSpec(KVGeometry(2, 4, 4, "float16"), 1, PageLayout(4))  # 8-byte heads
    assert WordGeometry.of(spec, 16) is None
    assert WordGeometry.of(spec, 8) == WordGeometry(4, 4, 1, False, 8)


def test_scatter_chunk_places_every_writer():
    d = SideSpec(GEO, 1, PageLayout(4, "hnd"))
    dc = RankCache.allocate(d, 0, 30, fill=0)
    ids = np.random.default_rng(5).permutation(30)[:10]
    parts = [torch.randint(0, 256, (region_bytes(dc, 40, 2),), dtype=torch.uint8) for _ in range(2)]
    slot = torch.cat(parts + [torch.zeros(64, dtype=torch.uint8)])
    scatter_chunk(dc, TokenIndex(dc, ids, 0, 40), [(0, 2, 0), (2, 2, parts[0].numel())], slot)
    back = torch.empty(region_bytes(dc, 40, 4), dtype=torch.uint8)
    for k, lo in enumerate((0, 2)):
        gather(dc, TokenIndex(dc, ids, 0, 40), lo, 2, back[: parts[k].numel()])
        assert torch.equal(back[: parts[k].numel()], parts[k])


def test_gather_pieces_fills_each_region_as_its_own_gather_would():
    """On the host (no kernel) ``gather_pieces`` is one gather per piece; on a GPU it
    is one launch (tests/test_cuda_copy.py): both must give each region its slice."""
    s = SideSpec(GEO, 1, PageLayout(4, "hnd"))
    sc = _random_cache(s, 40, 11)
    ids = np.random.default_rng(12).permutation(40)[:12]
    heads = [(3, 1), (0, 2), (2, 1)]
    regions = [torch.zeros(region_bytes(sc, 45, n), dtype=torch.uint8) for _, n in heads]
    gather_pieces(sc, TokenIndex(sc, ids, 3, 45), [(lo, n, r) for (lo, n), r in zip(heads, regions)])
    for (lo, n), r in zip(heads, regions):
        want = torch.empty_like(r)
        gather(sc, TokenIndex(sc, ids, 3, 45), lo, n, want)
        assert torch.equal(r, want), (lo, n)
    # on the host a chunk's pieces are scattered in one pass, not one by one
    assert prepare_piece_scatters(sc, TokenIndex(sc, ids, 3, 45), [(0, 2, 0), (2, 2, 64)], regions[1]) is None


@pytest.mark.parametrize("side,rng", list(itertools.product(SIDES, RANGES)))
@pytest.mark.parametrize("pieces", [
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # four writers of one head each: the whole token
    [(0, 2), (2, 2)],
    [(1, 1), (2, 1), (3, 1)],  # adjacent but not the whole token
    [(2, 2), (0, 2)],  # out of head order: not a tiling
])
def test_scatter_chunk_of_adjacent_writers_equals_one_scatter_per_writer(side, rng, pieces):
    """On the host, writers laid end to end over adjacent heads are placed by one
    assignment per buffer; that must equal scattering each writer on its own."""
    start, count = rng
    d = SideSpec(GEO, 1, PageLayout(*side))
    ids = np.random.default_rng(6).permutation(80)[: pages_needed(start + count, side[0])]
    gen = torch.Generator().manual_seed(7)
    parts, at = [], 0
    for lo, n in pieces:
        parts.append((lo, n, at))
        at += region_bytes(RankCache.allocate(d, 0, 1), count, n)
    slot = torch.randint(0, 256, (at + 32,), dtype=torch.uint8, generator=gen)
    one, each = RankCache.allocate(d, 0, 80, fill=0), RankCache.allocate(d, 0, 80, fill=0)
    scatter_chunk(one, TokenIndex(one, ids, start, count), parts, slot)
    for lo, n, base in parts:
        scatter(each, TokenIndex(each, ids, start, count), lo, n, slot[base : base + region_bytes(each, count, n)])
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(one.buffers, each.buffers))
    assert any(x.view(torch.uint8).any() for x in one.buffers)


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
