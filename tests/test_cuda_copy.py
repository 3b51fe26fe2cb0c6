"""The CUDA gather/scatter kernel against the host copies, byte for byte (on a GPU).

Covers the paths the endpoints take: page ids uploaded once per request
(``upload_pages``), the scatter prepared ahead and launched later
(``prepare_scatter``), each writer's piece scattered on its own as it lands
(``prepare_piece_scatters``), one launch gathering into several regions
(``gather_pieces``: a 1->N source's mapped destinations), chunks that start
mid-page, several writers per slot, a launch from a thread with no CUDA context,
gathers launched at once from two threads.
"""

import itertools
import threading

import numpy as np
import pytest
import torch

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging import cuda_copy
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import (TokenIndex, gather, gather_pieces, prepare_piece_scatters, prepare_scatter,
                                  region_bytes, scatter_chunk, upload_pages)
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
@pytest.mark.parametrize("side,rng,uploaded,inline", list(itertools.product(SIDES, RANGES, (False, True), (True, False))))
def test_kernel_gather_and_scatter_equal_the_host_copies(gpu, side, rng, uploaded, inline, monkeypatch):
    """``uploaded``: the request's ids from ``upload_pages`` (else each chunk's own);
    ``inline``: page ids up to ``INLINE_PAGES`` travel in the launch (else always on the device)."""
    if not inline:
        monkeypatch.setattr(cuda_copy, "INLINE_PAGES", 0)
    start, count = rng
    spec = SideSpec(GEO, 1, PageLayout(*side))
    pages = 400
    ids = np.random.default_rng(1).permutation(pages)[: pages_needed(start + count, side[0])]
    gpu = _random_cache(spec, pages, 2, "cuda")
    host = RankCache(spec, 0, [b.cpu() for b in gpu.buffers])
    dev_ids = upload_pages(gpu, ids) if uploaded else None
    assert (dev_ids is not None) == uploaded
    if uploaded:  # the host keeps them only when they fit in a launch (5..305 at page size 1 does not)
        assert isinstance(dev_ids, torch.Tensor) == (not inline or len(ids) > cuda_copy.INLINE_PAGES)
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
    with pytest.raises(IndexError, match=r"page ids must lie in \[0, 10\); got 0\.\.12"):
        TokenIndex(gpu_cache, np.array([0, 12]), 0, 8)  # a chunk's own page ids (not uploaded): checked too


@pytest.mark.gpu
def test_uploads_wait_for_their_pinned_buffer_while_the_stream_is_busy(gpu, monkeypatch):
    """Page-id uploads go through a ring of four pinned buffers (``cuda_copy._Upload``):
    with the stream held up by a long kernel, the fifth upload must wait until the
    first copy has read its buffer. Every uploaded tensor holds its own ids."""
    monkeypatch.setattr(cuda_copy, "INLINE_PAGES", 0)  # every request's ids go through the ring
    spec = SideSpec(GEO, 1, PageLayout(16))
    dev = RankCache.allocate(spec, 0, 600, "cuda")
    rng = np.random.default_rng(14)
    want = [rng.integers(0, 600, n) for n in (5, 17, 3, 4100, 8, 8, 5000, 1, 2, 9, 4097, 6)]
    for ids in want:  # first: the kernel loaded, pinned buffers grown, device blocks cached (any may synchronize)
        upload_pages(dev, ids)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every copy on this stream
    got = [upload_pages(dev, ids) for ids in want]
    torch.cuda.synchronize()
    for k, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g.cpu().numpy(), w), k


@pytest.mark.gpu
def test_ten_one_head_pieces_in_one_launch_each_way(gpu):
    """A slot of ten one-head writers (a wide model, many source ranks), laid out in
    reverse head order: one gather launch into ten regions and one scatter launch
    of the slot copy what the host copies do."""
    n = 10
    geo = KVGeometry(2, n, 64, "bfloat16")
    spec = SideSpec(geo, 1, PageLayout(16))
    start, count, pages = 3, 70, 40
    ids = np.random.default_rng(14).permutation(pages)[: pages_needed(start + count, 16)]
    dev = _random_cache(spec, pages, 15, "cuda")
    host = RankCache(spec, 0, [b.cpu() for b in dev.buffers])
    size = region_bytes(host, count, 1)
    regions = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
    gather_pieces(dev, TokenIndex(dev, ids, start, count), [(h, 1, r) for h, r in zip(range(n), regions)])
    torch.cuda.synchronize()
    for h, r in enumerate(regions):
        want = torch.empty(size, dtype=torch.uint8)
        gather(host, TokenIndex(host, ids, start, count), h, 1, want)
        assert torch.equal(r.cpu(), want), h
    slot = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(16))
    parts = [(h, 1, (n - 1 - h) * size) for h in range(n)]  # writers laid out in reverse head order
    scatter_chunk(host, TokenIndex(host, ids, start, count), parts, slot)
    prepare_scatter(dev, TokenIndex(dev, ids, start, count), parts, slot.cuda())()
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dev.buffers, host.buffers))


@pytest.mark.gpu
@pytest.mark.parametrize("side", SIDES)
def test_one_launch_gathers_into_several_regions_and_pieces_scatter_one_by_one(gpu, side):
    start, count = 5, 300
    spec = SideSpec(GEO, 1, PageLayout(*side))
    pages = 400
    ids = np.random.default_rng(7).permutation(pages)[: pages_needed(start + count, side[0])]
    dev = _random_cache(spec, pages, 8, "cuda")
    host = RankCache(spec, 0, [b.cpu() for b in dev.buffers])
    dev_ids = upload_pages(dev, ids)
    # three regions in three separate allocations (three destinations' arenas), one launch
    heads = [(0, 1), (1, 2), (3, 1)]
    regions = [torch.full((region_bytes(host, count, n) + 32,), 0xAB, dtype=torch.uint8, device="cuda") for _, n in heads]
    gather_pieces(dev, TokenIndex(dev, ids, start, count, dev_ids),
                  [(lo, n, r[16 : 16 + region_bytes(host, count, n)]) for (lo, n), r in zip(heads, regions)])
    torch.cuda.synchronize()
    for (lo, n), r in zip(heads, regions):
        want = torch.empty(region_bytes(host, count, n), dtype=torch.uint8)
        gather(host, TokenIndex(host, ids, start, count), lo, n, want)
        got = r.cpu()
        assert torch.equal(got[16 : 16 + want.numel()], want), (lo, n)
        assert bool((got[:16] == 0xAB).all()) and bool((got[16 + want.numel() :] == 0xAB).all()), "wrote outside its region"
    # a slot of three writers' pieces, each scattered by its own launch, in landing order
    parts, off = [], 0
    for lo, n in heads:
        parts.append((lo, n, off))
        off += region_bytes(host, count, n)
    slot = torch.randint(0, 256, (off,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    ref = RankCache(spec, 0, [b.clone() for b in host.buffers])
    scatter_chunk(ref, TokenIndex(ref, ids, start, count), parts, slot)
    launches = prepare_piece_scatters(dev, TokenIndex(dev, ids, start, count, dev_ids), parts, slot.cuda())
    assert len(launches) == 3
    for k in (2, 0):
        launches[k]()
    torch.cuda.synchronize()
    assert not all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dev.buffers, ref.buffers))
    launches[1]()
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dev.buffers, ref.buffers))


@pytest.mark.gpu
def test_a_prepared_copy_launches_from_a_thread_with_no_cuda_context(gpu):
    """The endpoints' loop threads launch copies prepared elsewhere: the launch makes
    the device's context current itself (the driver call has no implicit one)."""
    spec = SideSpec(GEO, 1, PageLayout(16))
    ids = np.arange(4)
    dev = _random_cache(spec, 8, 10, "cuda")
    host = RankCache(spec, 0, [b.cpu() for b in dev.buffers])
    want = torch.empty(region_bytes(host, 50, 4), dtype=torch.uint8)
    gather(host, TokenIndex(host, ids, 0, 50), 0, 4, want)
    got = torch.zeros(want.numel(), dtype=torch.uint8, device="cuda")
    assert dev.copier.name == "cuda"
    launch = dev.copier.prepare(TokenIndex(dev, ids, 0, 50, upload_pages(dev, ids)), [(0, 4, 0)], got, to_region=True)
    torch.cuda.synchronize()
    errors = []
    t = threading.Thread(target=lambda: errors.append(_run(launch)))
    t.start()
    t.join()
    assert errors == [None]
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_gathers_launched_at_once_from_two_threads_keep_their_own_arguments(gpu):
    """A gather is launched at once from the calling thread's own argument block
    (``WordCopier.launch``): two threads launching into the same cache, with
    different heads, tokens and regions, each get exactly their own copies."""
    spec = SideSpec(GEO, 1, PageLayout(16))
    ids = np.random.default_rng(11).permutation(40)[:20]
    dev = _random_cache(spec, 40, 12, "cuda")
    host = RankCache(spec, 0, [b.cpu() for b in dev.buffers])
    dev_ids = upload_pages(dev, ids)
    jobs = {"a": (0, 2, 0, 37), "b": (2, 2, 16, 200)}  # head_lo, heads, start, count
    reps = 100
    want, got = {}, {}
    for name, (lo, n, start, count) in jobs.items():
        want[name] = torch.empty(region_bytes(host, count, n), dtype=torch.uint8)
        gather(host, TokenIndex(host, ids, start, count), lo, n, want[name])
        got[name] = torch.zeros(reps, want[name].numel(), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    blocks, errors = {}, []

    def work(name):
        lo, n, start, count = jobs[name]
        try:
            for k in range(reps):
                gather(dev, TokenIndex(dev, ids, start, count, dev_ids), lo, n, got[name][k])
            blocks[name] = dev.copier.kernel._blocks.block
            torch.cuda.synchronize()
        except Exception as e:  # the assertion below names it
            errors.append(e)

    threads = [threading.Thread(target=work, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert blocks["a"] is not blocks["b"]
    for name in jobs:
        for k in range(reps):
            assert torch.equal(got[name][k].cpu(), want[name]), (name, k)


def _run(launch):
    try:
        launch()
        torch.cuda.synchronize()
    except Exception as e:  # the assertion in the test names it
        return e
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["misaligned", "pageable"])
def test_calls_the_kernel_cannot_run_go_the_torch_way_with_the_same_bytes(gpu, where):
    """A region the kernel cannot run (not on 16-byte words, or host memory the GPU cannot
    reach) is copied by the CUDA copier the torch way, per call: the same bytes, and no
    prepared per-piece launches."""
    spec = SideSpec(GEO, 1, PageLayout(16))
    start, count = 5, 40
    ids = np.random.default_rng(17).permutation(20)[: pages_needed(start + count, 16)]
    dev = _random_cache(spec, 20, 18, "cuda")
    host = RankCache(spec, 0, [b.cpu() for b in dev.buffers])
    size = region_bytes(host, count, 2)

    def region(n):
        if where == "pageable":
            return torch.zeros(n, dtype=torch.uint8)
        return torch.zeros(n + 8, dtype=torch.uint8, device="cuda")[8:]  # 8 bytes past a 16-byte word

    r = region(size)
    assert dev.copier.name == "cuda" and not dev.copier.supports(r, [(1, 2, 0)], count)
    gather(dev, TokenIndex(dev, ids, start, count), 1, 2, r)
    want = torch.empty(size, dtype=torch.uint8)
    gather(host, TokenIndex(host, ids, start, count), 1, 2, want)
    torch.cuda.synchronize()
    assert torch.equal(r.cpu(), want)
    parts = [(0, 2, 0), (2, 2, size)]
    slot = region(2 * size)
    slot.copy_(torch.randint(0, 256, (2 * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(19)))
    assert prepare_piece_scatters(dev, TokenIndex(dev, ids, start, count), parts, slot) is None
    prepare_scatter(dev, TokenIndex(dev, ids, start, count), parts, slot)()
    scatter_chunk(host, TokenIndex(host, ids, start, count), parts, slot.cpu())
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dev.buffers, host.buffers))
