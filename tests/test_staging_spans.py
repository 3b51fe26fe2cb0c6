"""A chunk as spans of the rank's own pages (``staging.spans``): read in order, the
spans give exactly the bytes a gather lays into a region, for every layout."""

import itertools

import numpy as np
import pytest
import torch

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather, region_bytes
from kvstage.staging.spans import chunk_spans
from kvstage.tp import SideSpec
from test_staging import _random_cache

pytestmark = pytest.mark.usefixtures("host_copy")  # against the torch copier's gather too, not only the spans'

SIDES = [(16, "nhd"), (4, "hnd"), (1, "nhd"), (8, "hnd")]
RANGES = [(0, 37), (16, 32), (5, 20), (0, 64), (63, 1)]
HEADS = [(0, 4), (2, 2), (1, 1)]  # (first local head, heads) of a rank holding 4


def _read(cache, spans):
    index, offsets, lengths = spans
    raw = [b.view(torch.uint8).reshape(-1).numpy() for b in cache.buffers]
    return np.concatenate([raw[i][o : o + n] for i, o, n in zip(index, offsets, lengths)])


@pytest.mark.parametrize("side,rng,heads", list(itertools.product(SIDES, RANGES, HEADS)) + [
    ((16, "nhd"), (0, 64), "mla"), ((1, "nhd"), (3, 40), "mla")])
def test_spans_read_in_order_are_the_gathered_region(side, rng, heads):
    start, count = rng
    mla = heads == "mla"
    geo = KVGeometry(3, 1 if mla else 8, 8, "bfloat16", mla)
    spec = SideSpec(geo, 1 if mla else 2, PageLayout(*side))
    lo, n = (0, 1) if mla else heads
    cache = _random_cache(spec, 80, 3)
    pages = np.random.default_rng(4).permutation(80)[: pages_needed(start + count, side[0])]
    region = torch.empty(region_bytes(cache, count, n), dtype=torch.uint8)
    gather(cache, TokenIndex(cache, pages, start, count), lo, n, region)
    spans = chunk_spans(cache, pages, start, count, lo, n)
    assert np.array_equal(_read(cache, spans), region.numpy())
    index, offsets, lengths = spans
    assert len(index) == len(offsets) == len(lengths) and lengths.min() > 0
    ends = offsets[:-1] + lengths[:-1]
    assert not np.any((index[1:] == index[:-1]) & (offsets[1:] == ends))  # touching spans were merged


def test_whole_pages_of_all_heads_are_one_span_per_page_and_buffer():
    geo = KVGeometry(2, 8, 128, "bfloat16")
    spec = SideSpec(geo, 4, PageLayout(16, "nhd"))
    cache = RankCache.allocate(spec, 0, 64)
    pages = np.array([9, 3, 4, 40, 7, 1, 2, 0])  # 3, 4 and 1, 2 lie side by side: one span each
    index, offsets, lengths = chunk_spans(cache, pages, 16, 96, 0, 2)  # pages 3 .. 2 of the request
    page_bytes = 16 * 2 * 256
    assert list(lengths[:4]) == [2 * page_bytes, page_bytes, page_bytes, 2 * page_bytes]
    assert list(offsets[:4]) == [3 * page_bytes, 40 * page_bytes, 7 * page_bytes, 1 * page_bytes]
    assert list(index) == [i for i in range(geo.buffers) for _ in range(4)]


def test_heads_outside_the_rank_are_refused():
    spec = SideSpec(KVGeometry(2, 8, 16, "bfloat16"), 2, PageLayout(16, "nhd"))
    cache = RankCache.allocate(spec, 0, 4)
    with pytest.raises(ValueError, match="this rank holds 4"):
        chunk_spans(cache, np.arange(4), 0, 10, 3, 2)
