"""A piece as spans of a rank's pages (``staging.spans``): read into the region at their region
offsets, the spans give exactly the bytes the region rule puts there, for every layout, in
region order and merged wherever both sides are contiguous; the order with the fewest spans."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.cache import RankCache
from kvstage.staging.region import Order, RegionPiece
from kvstage.staging.spans import cheapest_order, piece_spans
from kvstage.tp import SideSpec
from support.regions import expected_region, host_buffers, random_bytes

SIDES = [(16, "nhd"), (4, "hnd"), (1, "nhd"), (8, "hnd"), (1, "hnd")]
RANGES = [(0, 37), (16, 32), (5, 20), (0, 64), (63, 1)]
PIECES = [  # (first local head, heads, buffers, rows past the chunk, row_first) of a rank holding 4 heads, 6 buffers
    (0, 4, range(6), None, 0), (2, 2, range(6), None, 0), (1, 1, range(2, 5), None, 0), (0, 4, range(4, 6), 3, 2),
    (1, 2, range(0, 1), 0, 0),
]


def _read(cache, spans, size: int) -> np.ndarray:
    """The region a reader fills by copying each span from the cache to its region offset."""
    index, offsets, lengths, at = spans
    raw = [b.view(torch.uint8).reshape(-1).numpy() for b in cache.buffers]
    out = np.zeros(size, dtype=np.uint8)
    for i, o, n, r in zip(index, offsets, lengths, at):
        out[r : r + n] = raw[i][o : o + n]
    return out


def _check_shape(spans, piece: RegionPiece, head_bytes: int, count: int) -> None:
    """In region order, disjoint, covering the piece's bytes exactly, and merged: no span
    continues its predecessor in both its buffer and the region."""
    index, offsets, lengths, at = spans
    assert len(index) == len(offsets) == len(lengths) == len(at) and lengths.min() > 0
    assert np.all(at[1:] >= at[:-1] + lengths[:-1]), "spans out of region order, or overlapping"
    assert lengths.sum() == piece.heads * len(piece.buffers) * count * head_bytes
    assert set(index) <= set(piece.buffers)
    touching = (index[1:] == index[:-1]) & (offsets[1:] == offsets[:-1] + lengths[:-1]) & \
               (at[1:] == at[:-1] + lengths[:-1])
    assert not touching.any(), "spans contiguous on both sides were not merged"


@pytest.mark.parametrize("side,rng,fields", list(itertools.product(SIDES, RANGES, PIECES)) + [
    ((16, "nhd"), (0, 64), "mla"), ((1, "nhd"), (3, 40), "mla"), ((4, "hnd"), (3, 40), "mla")])
@pytest.mark.parametrize("order", list(Order))
def test_spans_read_into_the_region_are_the_region_rule(side, rng, fields, order):
    start, count = rng
    mla = fields == "mla"
    geo = KVGeometry(3, 1 if mla else 8, 8, "bfloat16", mla)
    spec = SideSpec(geo, 1 if mla else 2, PageLayout(*side))
    lo, n, buffers, extra, row_first = (0, 1, range(1, 3), 2, 1) if mla else fields
    piece = RegionPiece(lo, n, buffers, 32, order, None if extra is None else count + extra, row_first)
    cache = RankCache.allocate(spec, 0, 80, fill=None)
    random_bytes(cache, 3)
    pages = np.random.default_rng(4).permutation(80)[: pages_needed(start + count, side[0])]
    size = piece.offset + piece.nbytes(geo.head_bytes(), count) + 16
    spans = piece_spans(spec, pages, start, count, piece)
    zero = np.zeros(size, dtype=np.uint8)
    assert np.array_equal(_read(cache, spans, size), expected_region(spec, host_buffers(cache), pages, start, count,
                                                                     [piece], zero))
    _check_shape(spans, piece, geo.head_bytes(), count)


@settings(max_examples=100, deadline=None)
@given(local=st.sampled_from([1, 2, 4]), page=st.sampled_from([(1, "nhd"), (3, "hnd"), (16, "nhd"), (4, "hnd")]),
       start=st.integers(0, 40), count=st.integers(1, 40), order=st.sampled_from(list(Order)), lo=st.integers(0, 3),
       b=st.tuples(st.integers(0, 3), st.integers(1, 4)), extra=st.sampled_from([None, 0, 4]), seed=st.integers(0, 99))
def test_any_piece_of_any_layout(local, page, start, count, order, lo, b, extra, seed):
    geo = KVGeometry(2, local, 4, "float32")
    spec = SideSpec(geo, 1, PageLayout(*page))
    lo = min(lo, local - 1)
    b0, b1 = min(b), max(min(b) + 1, max(b))
    piece = RegionPiece(lo, local - lo, range(b0, b1), 0, order, None if extra is None else count + extra,
                        0 if extra is None else extra // 2)
    cache = RankCache.allocate(spec, 0, 90, fill=None)
    random_bytes(cache, seed)
    pages = np.random.default_rng(seed).permutation(90)[: pages_needed(start + count, page[0])]
    size = piece.nbytes(geo.head_bytes(), count)
    spans = piece_spans(spec, pages, start, count, piece)
    assert np.array_equal(_read(cache, spans, size), expected_region(spec, host_buffers(cache), pages, start, count,
                                                                     [piece], np.zeros(size, dtype=np.uint8)))
    _check_shape(spans, piece, geo.head_bytes(), count)


def test_token_order_on_nhd_pages_of_all_heads_is_one_span_per_run_of_adjacent_pages():
    geo = KVGeometry(2, 8, 128, "bfloat16")
    spec = SideSpec(geo, 4, PageLayout(16, "nhd"))
    pages = np.array([9, 3, 4, 40, 7, 1, 2, 0])  # 3, 4 and 1, 2 lie side by side: one span each
    piece = RegionPiece(0, 2, range(geo.buffers), 0, Order.TOKENS)
    index, offsets, lengths, at = piece_spans(spec, pages, 16, 96, piece)  # pages 3 .. 2 of the request
    page_bytes = 16 * 2 * 256
    assert list(lengths[:4]) == [2 * page_bytes, page_bytes, page_bytes, 2 * page_bytes]
    assert list(offsets[:4]) == [3 * page_bytes, 40 * page_bytes, 7 * page_bytes, 1 * page_bytes]
    assert list(index) == [i for i in range(geo.buffers) for _ in range(4)]
    assert list(at) == list(np.cumsum(lengths) - lengths)  # the region filled end to end
    # fewer than the rank's heads: a token's heads are one run, and tokens do not merge
    assert len(piece_spans(spec, pages, 16, 96, RegionPiece(1, 1, range(1), 0, Order.TOKENS))[0]) == 96


def test_head_order_on_hnd_pages_is_one_span_per_head_and_page():
    geo = KVGeometry(2, 4, 64, "bfloat16")
    spec = SideSpec(geo, 1, PageLayout(16, "hnd"))
    pages = np.array([5, 2, 8, 1])
    piece = RegionPiece(1, 2, range(1, 4), 0, Order.HEADS)
    index, offsets, lengths, at = piece_spans(spec, pages, 8, 50, piece)  # 8 tokens of page 5, 16 of 2, 8, then 10 of 1
    assert len(index) == 2 * 3 * 4  # heads x buffers x pages touched
    assert list(lengths[:4] // 128) == [8, 16, 16, 10]
    head_page = 16 * 128
    assert list(offsets[:4]) == [(5 * 4 + 1) * head_page + 8 * 128, (2 * 4 + 1) * head_page, (8 * 4 + 1) * head_page,
                                 (1 * 4 + 1) * head_page]
    assert list(index[:8]) == [1, 1, 1, 1, 2, 2, 2, 2]  # region order: head 1's buffers, then head 2's


@pytest.mark.parametrize("geo,page,want", [
    (KVGeometry(2, 8, 16, "bfloat16"), PageLayout(16, "nhd"), Order.TOKENS),
    (KVGeometry(2, 8, 16, "bfloat16"), PageLayout(16, "hnd"), Order.HEADS),
    (KVGeometry(2, 1, 64, "bfloat16", True), PageLayout(16, "hnd"), Order.TOKENS),  # MLA pages are token-major
    (KVGeometry(2, 1, 64, "bfloat16", True), PageLayout(1, "nhd"), Order.TOKENS),
])
def test_the_cheapest_order_gives_the_fewest_spans(geo, page, want):
    spec = SideSpec(geo, 1 if geo.mla else 2, PageLayout(page.page_size, page.order))
    heads = 1 if geo.mla else 3
    assert cheapest_order(spec, heads) is want
    pages = np.random.default_rng(1).permutation(200)[: pages_needed(105, page.page_size)]
    count = {o: len(piece_spans(spec, pages, 5, 100, RegionPiece(0, heads, range(geo.buffers), 0, o))[0])
             for o in Order}
    assert count[want] == min(count.values())
    if not geo.mla:
        assert count[want] < max(count.values())


def test_pieces_outside_the_rank_are_refused_by_their_field():
    spec = SideSpec(KVGeometry(2, 8, 16, "bfloat16"), 2, PageLayout(16, "nhd"))
    with pytest.raises(ValueError, match=r"pieces\[0\]\.heads: head_lo=3 \+ heads=2 = 5 must be <= 4"):
        piece_spans(spec, np.arange(4), 0, 10, RegionPiece(3, 2, range(4), 0))
    with pytest.raises(ValueError, match=r"pieces\[0\]\.buffers=range\(2, 5\): must lie in range\(0, 4\)"):
        piece_spans(spec, np.arange(4), 0, 10, RegionPiece(0, 2, range(2, 5), 0))
    with pytest.raises(ValueError, match=r"pieces\[0\]\.rows: row_first=1 \+ count=10 = 11 must be <= rows=10"):
        piece_spans(spec, np.arange(4), 0, 10, RegionPiece(0, 2, range(4), 0, rows=10, row_first=1))
