"""The CUDA gather/scatter kernel against the host copies, byte for byte (on a GPU).

Covers the paths the endpoints take: page ids uploaded once per request
(``upload_pages``), the scatter prepared ahead and launched later
(``prepare_scatter``), chunks that start mid-page, several writers per slot.
"""

import itertools

import numpy as np
import pytest
import torch

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging import cuda_copy
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather, prepare_scatter, region_bytes, scatter_chunk, upload_pages
from kvstage.tp import SideSpec
from test_staging import _random_cache as random_cache  # the same random bytes, made on the host

GEO = KVGeometry(3, 4, 64, "bfloat16")  # 128-byte heads: 8 words of 16 bytes
SIDES = [(16, "nhd"), (4, "hnd"), (1, "nhd")]
RANGES = [(0, 37), (16, 32), (5, 300)]


def _random_cache(spec, pages, seed, device):
    host = random_cache(spec, pages, seed)
    return RankCache(spec, 0, [b.to(device) for b in host.buffers])


@pytest.fixture
def gpu():
    if not (torch.cuda.is_available() and cuda_copy.available()):
        pytest.skip("needs CUDA and CuPy")


@pytest.mark.gpu
@pytest.mark.parametrize("side,rng,uploaded", list(itertools.product(SIDES, RANGES, (False, True))))
def test_kernel_gather_and_scatter_equal_the_host_copies(gpu, side, rng, uploaded):
    start, count = rng
    spec = SideSpec(GEO, 1, PageLayout(*side))
    pages = 400
    ids = np.random.default_rng(1).permutation(pages)[: pages_needed(start + count, side[0])]
    gpu = _random_cache(spec, pages, 2, "cuda")
    host = RankCache(spec, 0, [b.cpu() for b in gpu.buffers])
    dev_ids = upload_pages(gpu, ids) if uploaded else None
    assert (dev_ids is not None) == uploaded
    for lo, n in ((0, 4), (1, 2), (3, 1)):
        want = torch.empty(region_bytes(host, count, n), dtype=torch.uint8)
        gather(host, TokenIndex(host, ids, start, count), lo, n, want)
        got = torch.empty(want.numel(), dtype=torch.uint8, device="cuda")
        gather(gpu, TokenIndex(gpu, ids, start, count, dev_ids), lo, n, got)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), (lo, n)
    # two writers of two heads each into one slot, scattered by a prepared launch
    parts = [(0, 2, 0), (2, 2, region_bytes(host, count, 2))]
    slot = torch.randint(0, 256, (2 * region_bytes(host, count, 2) + 64,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    ref = RankCache(spec, 0, [b.clone() for b in host.buffers])
    scatter_chunk(ref, TokenIndex(ref, ids, start, count), parts, slot)
    run = prepare_scatter(gpu, TokenIndex(gpu, ids, start, count, dev_ids), parts, slot.cuda())
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(gpu.buffers, host.buffers))
    run()  # nothing moved until now
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(gpu.buffers, ref.buffers))


@pytest.mark.gpu
def test_upload_pages_refuses_page_ids_outside_the_cache(gpu):
    gpu_cache = _random_cache(SideSpec(GEO, 1, PageLayout(4)), 10, 4, "cuda")
    with pytest.raises(IndexError, match=r"page ids must lie in \[0, 10\); got 0\.\.12"):
        upload_pages(gpu_cache, np.array([0, 12]))
