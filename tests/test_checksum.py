"""The chunk checksum (``staging.checksum``): its definition, and every host copier summing
what it moves as the definition says (the kernel's own sums: test_kernel_source.py on the
host, test_cuda_copy.py on a GPU).

A source's box is summed by its gather, each destination's span of it by that destination's
scatter; for every TP pair's pieces the two must agree, and any flipped byte must not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.outgoing import region_box
from kvstage.staging import checksum
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import SideSpec, plan as make_plan
from support.regions import random_bytes


def _scalar(data: bytes) -> int:
    """The definition word by word, in plain Python."""
    s = 0
    for p, (v,) in enumerate(np.frombuffer(data, dtype="<u4").reshape(-1, 1)):
        key = (p * checksum.MULTIPLIER + checksum.INCREMENT) & checksum.MASK
        s = (s + (int(v) ^ key) * (key | 1)) & checksum.MASK
    return s


def test_the_reference_is_the_definition_word_by_word():
    data = np.random.default_rng(0).integers(0, 256, 4 * 300, dtype=np.uint8).tobytes()
    assert int(checksum.reference(data)[0]) == _scalar(data)
    assert list(checksum.reference(data, 3)) == [_scalar(data[k * 400 : (k + 1) * 400]) for k in range(3)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4 * 64 - 1), st.integers(1, 255), st.integers(0, 2**32 - 1))
def test_any_one_changed_byte_changes_its_segments_sum(at, flip, seed):
    data = bytearray(np.random.default_rng(seed).integers(0, 256, 4 * 64, dtype=np.uint8).tobytes())
    before = checksum.reference(bytes(data), 4)
    data[at] ^= flip
    after = checksum.reference(bytes(data), 4)
    assert [k for k in range(4) if before[k] != after[k]] == [at // 64]


def test_two_swapped_words_change_the_sum():
    data = np.arange(64, dtype="<u4")
    swapped = data.copy()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert checksum.reference(data.tobytes())[0] != checksum.reference(swapped.tobytes())[0]


def test_a_head_that_is_not_whole_words_is_refused_by_name():
    with pytest.raises(ValueError, match="6 bytes is not whole 32-bit words"):
        checksum.ChunkSums.of([RegionPiece(0, 1, range(2), 0)], 6, 4)


def _cache(spec: SideSpec, rank: int, copier: str) -> RankCache:
    return RankCache.allocate(spec, rank, 64, fill=None, copier=copier)


def _rank_spec(geo: KVGeometry, tp: int, page: PageLayout) -> SideSpec:
    return SideSpec(geo, tp, page)


COPIERS = ["torch", "native"]


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize(
    "src_tp,dst_tp,geo",
    [
        (1, 2, KVGeometry(2, 4, 8, "float16")),  # a source box read by two destination ranks (heads order)
        (2, 1, KVGeometry(2, 4, 8, "float16")),  # whole shards (tokens order)
        (4, 2, KVGeometry(3, 2, 16, "bfloat16")),  # GQA replication: two sources hold each head
        (1, 2, KVGeometry(2, 1, 16, "bfloat16", mla=True)),  # MLA: every rank reads the whole latent
    ],
)
def test_a_sources_box_sums_add_up_to_what_each_destination_scatters(copier, src_tp, dst_tp, geo):
    """The source gathers its box with sums; each destination rank's span of it, read verbatim into a
    slot at its own offset, is scattered with sums; the span's total equals the scatter's, and a
    flipped byte in the slot changes it."""
    src_page, dst_page = PageLayout(4, "nhd"), PageLayout(8, "hnd")
    plan = make_plan(_rank_spec(geo, src_tp, src_page), _rank_spec(geo, dst_tp, dst_page))
    hb, count = geo.head_bytes(), 13
    rng = np.random.default_rng(src_tp * 10 + dst_tp)
    for s in range(src_tp):
        pieces = [p for p in plan.pieces if p.src_rank == s]
        if not pieces:
            continue
        src = _cache(plan.src, s, copier)
        random_bytes(src, count)
        ids = rng.permutation(64)[:4]
        box = region_box(pieces, plan.src)
        region = torch.zeros(box.nbytes(count), dtype=torch.uint8)
        sums = checksum.ChunkSums.of([box.piece()], hb, count)
        src.copier.gather(TokenIndex(src, ids, 0, count), [box.piece()], region, sums)
        assert np.array_equal(sums.values, checksum.reference(region.numpy(), len(sums.values)))
        for piece in pieces:
            offset, nbytes = box.piece_span(piece, count)
            want = checksum.span_total(sums, box.piece(), hb, count, offset, nbytes)
            dst = _cache(plan.dst, piece.dst_rank, copier)
            slot = torch.zeros(nbytes + 64, dtype=torch.uint8)
            slot[32 : 32 + nbytes] = region[offset : offset + nbytes]
            rp = RegionPiece(piece.dst_offset, piece.heads.count, piece.buffers, 32, box.order)
            landed = checksum.ChunkSums.of([rp], hb, count)
            dst_ids = rng.permutation(64)[:2]
            dst.copier.prepare_scatter(TokenIndex(dst, dst_ids, 0, count), [rp], slot, None, landed)()
            assert landed.total(0) == want, (piece, landed.values)
            slot[32 + nbytes // 2] ^= 0x10
            again = checksum.ChunkSums.of([rp], hb, count)
            dst.copier.scatter_chunk(TokenIndex(dst, dst_ids, 0, count), [rp], slot, None, again)
            assert again.total(0) != want


@pytest.mark.parametrize("copier", COPIERS)
def test_a_scatter_of_a_row_window_sums_the_pieces_whole_rows(copier):
    """A destination that receives only the tail of a chunk (its request starts inside it) scatters a row
    window; its sums still cover every row it read, so they match the source's."""
    geo = KVGeometry(2, 2, 8, "float16")
    spec = SideSpec(geo, 1, PageLayout(4, "nhd"))
    hb, count, skip = geo.head_bytes(), 12, 5
    cache = _cache(spec, 0, copier)
    pieces = end_to_end(
        [
            RegionPiece(0, 2, range(4), 0, Order.HEADS, rows=count, row_first=skip),
            RegionPiece(0, 2, range(4), 0, Order.TOKENS, rows=count, row_first=skip),
        ],
        hb,
        count - skip,
        offset=16,
    )
    slot = torch.from_numpy(np.random.default_rng(1).integers(0, 256, pieces[-1].offset + 4096, dtype=np.uint8))
    sums = checksum.ChunkSums.of(pieces, hb, count - skip)
    cache.copier.scatter_chunk(TokenIndex(cache, np.arange(4), skip, count - skip), pieces, slot, None, sums)
    for k, p in enumerate(pieces):
        n, size = checksum.segments(p, hb, count - skip)
        whole = slot[p.offset : p.offset + n * size].numpy()
        assert np.array_equal(sums.piece(k), checksum.reference(whole, n))
        assert n * size == p.heads * len(p.buffers) * count * hb  # whole rows: the window's and the rest


def test_the_native_sum_is_the_reference():
    from kvstage.staging import hostcopy

    if not hostcopy.available():
        pytest.skip(hostcopy.why_unavailable())
    data = np.random.default_rng(2).integers(0, 256, 3 * 4096, dtype=np.uint8)
    out = np.empty(3, dtype=np.uint32)
    hostcopy.checksum_segments(data.ctypes.data, 3, 4096, out)
    assert np.array_equal(out, checksum.reference(data, 3))
