"""The benchmark's reference check must catch a wrong byte and a stray write."""

import numpy as np
import torch

from kvstage.bench.reference import check_shard, fill_shard
from kvstage.layout import KVGeometry, PageLayout
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec


def _cache(order):
    spec = SideSpec(KVGeometry(2, 4, 8, "bfloat16"), 2, PageLayout(4, order))
    c = RankCache.allocate(spec, 1, 12)
    pages = np.array([7, 2, 9])
    fill_shard(c, 5, pages, 10)
    return c, pages


def test_exact_shard_passes_and_other_seed_fails():
    for order in ("nhd", "hnd"):
        c, pages = _cache(order)
        assert check_shard(c, 5, pages, 10) == []
        assert check_shard(c, 6, pages, 10)


def test_one_flipped_byte_is_found():
    c, pages = _cache("hnd")
    c.buffers[3].view(torch.uint8)[9, 1, 1, 0] ^= 1  # page 9, head 1, token slot 1 -> token 9
    errs = check_shard(c, 5, pages, 10)
    assert errs == ["buffer 3: 1 of 10 tokens differ (first token 9)"]


def test_stray_write_outside_the_request_is_found():
    c, pages = _cache("nhd")
    c.buffers[0][0, 0, 0, 0] = 1.0
    assert any("outside the request" in e for e in check_shard(c, 5, pages, 10))
