"""The CUDA gather/scatter kernel against the independent reference (``support.regions``),
byte for byte (on a GPU).

Covers the paths the endpoints take: page ids uploaded once per request
(``upload_pages``), in the launch or on the device, the scatter prepared ahead and
launched later (``prepare_scatter``), each piece scattered on its own as it lands
(``prepare_piece_scatters``), one launch for every piece of a region (both orders,
shares of the buffers of different lengths, row windows), chunks that start mid-page,
a launch from a thread with no CUDA context, gathers launched at once from two
threads, and the calls the kernel cannot run.
"""

import itertools
import threading

import numpy as np
import pytest
import torch

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging import cuda_copy
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import (TokenIndex, gather, prepare_piece_scatters, prepare_scatter, scatter_chunk,
                                  upload_pages)
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import SideSpec
from support.regions import expected_cache, expected_region, host_buffers, random_bytes, same_buffers

GEO = KVGeometry(3, 4, 64, "bfloat16")  # 128-byte heads: 8 words of 16 bytes
HB = GEO.head_bytes()
SIDES = [(16, "nhd"), (4, "hnd"), (1, "nhd")]
RANGES = [(0, 37), (16, 32), (5, 300)]


def _random_cache(spec, pages, seed, device="cuda"):
    c = RankCache.allocate(spec, 0, pages, device, fill=None)
    random_bytes(c, seed)
    return c


def _slot_pieces(count: int) -> list[RegionPiece]:
    """Pieces of disjoint (head, buffer) pairs covering the rank: both orders, buffer ranges of
    3, 6 and 3 buffers (blocks past a piece's buffers return), row windows."""
    return end_to_end([RegionPiece(0, 2, range(0, 3), 0, Order.HEADS, rows=count + 7, row_first=3),
                       RegionPiece(2, 2, range(0, 6), 0, Order.TOKENS),
                       RegionPiece(0, 1, range(3, 6), 0, Order.TOKENS, rows=count + 1, row_first=1),
                       RegionPiece(1, 1, range(3, 6), 0, Order.HEADS)], HB, count, offset=16)


def _size(pieces, count: int, spare: int = 32) -> int:
    return max(p.offset + p.nbytes(HB, count) for p in pieces) + spare


def _counting(monkeypatch, copier) -> list:
    """Count the copier's kernel launches (each still runs)."""
    launches = []
    real = copier.kernel._launch

    def launch(*args):
        launches.append(args[1])
        return real(*args)

    monkeypatch.setattr(copier.kernel, "_launch", launch)
    return launches


@pytest.fixture
def gpu():
    if not (torch.cuda.is_available() and cuda_copy.available()):
        pytest.skip("needs CUDA and CuPy")


@pytest.mark.gpu
@pytest.mark.parametrize("side,rng,uploaded,inline",
                         list(itertools.product(SIDES, RANGES, (False, True), (True, False))))
def test_kernel_gather_and_scatter_equal_the_reference(gpu, side, rng, uploaded, inline, monkeypatch):
    """``uploaded``: the request's ids from ``upload_pages`` (else each chunk's own);
    ``inline``: page ids up to ``INLINE_PAGES`` travel in the launch (else always on the device).
    One launch gathers every piece, one prepared launch scatters them."""
    if not inline:
        monkeypatch.setattr(cuda_copy, "INLINE_PAGES", 0)
    start, count = rng
    spec = SideSpec(GEO, 1, PageLayout(*side))
    pages = 400
    ids = np.random.default_rng(1).permutation(pages)[: pages_needed(start + count, side[0])]
    dev = _random_cache(spec, pages, 2)
    host = host_buffers(dev)
    dev_ids = upload_pages(dev, ids) if uploaded else None
    assert (dev_ids is not None) == uploaded
    if uploaded:  # the host keeps them only when they fit in a launch (5..305 at page size 1 does not)
        assert isinstance(dev_ids, torch.Tensor) == (not inline or len(ids) > cuda_copy.INLINE_PAGES)
    pieces = _slot_pieces(count)
    size = _size(pieces, count)
    rng_ = np.random.default_rng(3)
    before = rng_.integers(0, 256, size, dtype=np.uint8)
    region = torch.from_numpy(before.copy()).cuda()
    assert dev.copier.name == "cuda" and dev.copier.supports(region, pieces, count)
    launches = _counting(monkeypatch, dev.copier)
    gather(dev, TokenIndex(dev, ids, start, count, dev_ids), pieces, region)
    torch.cuda.synchronize()
    assert len(launches) == 1
    assert np.array_equal(region.cpu().numpy(), expected_region(spec, host, ids, start, count, pieces, before))
    slot = rng_.integers(0, 256, size, dtype=np.uint8)
    run = prepare_scatter(dev, TokenIndex(dev, ids, start, count, dev_ids), pieces, torch.from_numpy(slot).cuda())
    torch.cuda.synchronize()
    assert same_buffers(host_buffers(dev), host)  # nothing moved until now
    run()
    torch.cuda.synchronize()
    assert len(launches) == 2
    assert same_buffers(host_buffers(dev), expected_cache(spec, host, ids, start, count, pieces, slot))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [(16, "nhd"), (1, "nhd"), (64, "hnd")])
def test_mla_shares_of_the_layers_in_one_launch(gpu, page):
    """MLA 4 -> 1: four holders' shares of 1, 2, 1, 2 layers, each its own piece (grid y of two
    buffers, the one-buffer pieces' second row of blocks returning)."""
    geo = KVGeometry(6, 1, 256, "float8_e4m3fn", True)  # 256-byte latents of 1-byte elements
    spec = SideSpec(geo, 1, PageLayout(*page))
    start, count = 9, 70
    ids = np.random.default_rng(4).permutation(200)[: pages_needed(start + count, page[0])]
    dev = _random_cache(spec, 200, 5)
    host = host_buffers(dev)
    shares = [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    pieces = end_to_end([RegionPiece(0, 1, b, 0, (Order.HEADS, Order.TOKENS)[k % 2]) for k, b in enumerate(shares)],
                        geo.head_bytes(), count)
    size = pieces[-1].offset + pieces[-1].nbytes(geo.head_bytes(), count)
    region = torch.zeros(size, dtype=torch.uint8, device="cuda")
    assert dev.copier.supports(region, pieces, count)
    gather(dev, TokenIndex(dev, ids, start, count), pieces, region)
    torch.cuda.synchronize()
    want = expected_region(spec, host, ids, start, count, pieces, np.zeros(size, dtype=np.uint8))
    assert np.array_equal(region.cpu().numpy(), want)
    back = RankCache.allocate(spec, 0, 200, "cuda", fill=0)
    zero = host_buffers(back)
    scatter_chunk(back, TokenIndex(back, ids, start, count), pieces, region)
    torch.cuda.synchronize()
    assert same_buffers(host_buffers(back), expected_cache(spec, zero, ids, start, count, pieces, want))


@pytest.mark.gpu
def test_upload_pages_refuses_page_ids_outside_the_cache(gpu):
    gpu_cache = _random_cache(SideSpec(GEO, 1, PageLayout(4)), 10, 4)
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
@pytest.mark.parametrize("order", list(Order))
def test_ten_one_head_pieces_in_one_launch_each_way(gpu, order, monkeypatch):
    """A slot of ten one-head writers (a wide model, many source ranks), laid out in
    reverse head order: one gather launch and one scatter launch of the slot copy what
    the reference says."""
    n = 10
    geo = KVGeometry(2, n, 64, "bfloat16")
    spec = SideSpec(geo, 1, PageLayout(16))
    start, count, pages = 3, 70, 40
    ids = np.random.default_rng(14).permutation(pages)[: pages_needed(start + count, 16)]
    dev = _random_cache(spec, pages, 15)
    host = host_buffers(dev)
    pieces = end_to_end([RegionPiece(h, 1, range(geo.buffers), 0, order) for h in reversed(range(n))],
                        geo.head_bytes(), count)
    size = pieces[-1].offset + pieces[-1].nbytes(geo.head_bytes(), count)
    launches = _counting(monkeypatch, dev.copier)
    region = torch.zeros(size, dtype=torch.uint8, device="cuda")
    gather(dev, TokenIndex(dev, ids, start, count), pieces, region)
    torch.cuda.synchronize()
    zero = np.zeros(size, dtype=np.uint8)
    assert np.array_equal(region.cpu().numpy(), expected_region(spec, host, ids, start, count, pieces, zero))
    slot = np.random.default_rng(16).integers(0, 256, size, dtype=np.uint8)
    prepare_scatter(dev, TokenIndex(dev, ids, start, count), pieces, torch.from_numpy(slot).cuda())()
    torch.cuda.synchronize()
    assert len(launches) == 2
    assert same_buffers(host_buffers(dev), expected_cache(spec, host, ids, start, count, pieces, slot))


@pytest.mark.gpu
@pytest.mark.parametrize("side", SIDES)
def test_pieces_scatter_one_by_one_in_landing_order(gpu, side):
    start, count = 5, 300
    spec = SideSpec(GEO, 1, PageLayout(*side))
    pages = 400
    ids = np.random.default_rng(7).permutation(pages)[: pages_needed(start + count, side[0])]
    dev = _random_cache(spec, pages, 8)
    host = host_buffers(dev)
    dev_ids = upload_pages(dev, ids)
    pieces = _slot_pieces(count)
    slot = np.random.default_rng(9).integers(0, 256, _size(pieces, count), dtype=np.uint8)
    launches = prepare_piece_scatters(dev, TokenIndex(dev, ids, start, count, dev_ids), pieces,
                                      torch.from_numpy(slot).cuda())
    assert len(launches) == len(pieces)
    for k in (2, 0, 3):
        launches[k]()
    torch.cuda.synchronize()
    assert same_buffers(host_buffers(dev), expected_cache(spec, host, ids, start, count,
                                                          [pieces[k] for k in (2, 0, 3)], slot))
    launches[1]()
    torch.cuda.synchronize()
    assert same_buffers(host_buffers(dev), expected_cache(spec, host, ids, start, count, pieces, slot))


@pytest.mark.gpu
def test_a_prepared_copy_launches_from_a_thread_with_no_cuda_context(gpu):
    """The endpoints' loop threads launch copies prepared elsewhere: the launch makes
    the device's context current itself (the driver call has no implicit one)."""
    spec = SideSpec(GEO, 1, PageLayout(16))
    ids = np.arange(4)
    dev = _random_cache(spec, 8, 10)
    pieces = [RegionPiece(0, 4, range(GEO.buffers), 0, Order.HEADS)]
    size = pieces[0].nbytes(HB, 50)
    want = expected_region(spec, host_buffers(dev), ids, 0, 50, pieces, np.zeros(size, dtype=np.uint8))
    got = torch.zeros(size, dtype=torch.uint8, device="cuda")
    assert dev.copier.name == "cuda"
    launch = dev.copier.prepare(TokenIndex(dev, ids, 0, 50, upload_pages(dev, ids)), pieces, got, to_region=True)
    torch.cuda.synchronize()
    errors = []
    t = threading.Thread(target=lambda: errors.append(_run(launch)))
    t.start()
    t.join()
    assert errors == [None]
    torch.cuda.synchronize()
    assert np.array_equal(got.cpu().numpy(), want)


@pytest.mark.gpu
def test_gathers_launched_at_once_from_two_threads_keep_their_own_arguments(gpu):
    """A gather is launched at once from the calling thread's own argument block
    (``WordCopier.launch``): two threads launching into the same cache, with
    different pieces, tokens and regions, each get exactly their own copies."""
    spec = SideSpec(GEO, 1, PageLayout(16))
    ids = np.random.default_rng(11).permutation(40)[:20]
    dev = _random_cache(spec, 40, 12)
    host = host_buffers(dev)
    dev_ids = upload_pages(dev, ids)
    jobs = {"a": ([RegionPiece(0, 2, range(6), 0, Order.HEADS)], 0, 37),
            "b": ([RegionPiece(2, 2, range(1, 5), 0, Order.TOKENS, rows=250, row_first=9)], 16, 200)}
    reps = 100
    want, got = {}, {}
    for name, (pieces, start, count) in jobs.items():
        size = pieces[0].nbytes(HB, count)
        want[name] = expected_region(spec, host, ids, start, count, pieces, np.zeros(size, dtype=np.uint8))
        got[name] = torch.zeros(reps, size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    blocks, errors = {}, []

    def work(name):
        pieces, start, count = jobs[name]
        try:
            for k in range(reps):
                gather(dev, TokenIndex(dev, ids, start, count, dev_ids), pieces, got[name][k])
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
            assert np.array_equal(got[name][k].cpu().numpy(), want[name]), (name, k)


def _run(launch):
    try:
        launch()
        torch.cuda.synchronize()
    except Exception as e:  # the assertion in the test names it
        return e
    return None


@pytest.mark.gpu
def test_the_kernel_refuses_pieces_whose_words_pass_32_bits(gpu):
    dev = _random_cache(SideSpec(GEO, 1, PageLayout(16)), 4, 13)
    region = torch.zeros(64, dtype=torch.uint8, device="cuda")
    words_per_row = 4 * 6 * 8  # 4 heads of 8 words in 6 buffers
    rows = -(-2**31 // words_per_row)  # the fewest rows whose words reach 2**31
    fits, past = RegionPiece(0, 4, range(6), 0, rows=rows - 1), RegionPiece(0, 4, range(6), 0, rows=rows)
    assert (rows - 1) * words_per_row < 2**31 <= rows * words_per_row
    assert dev.copier.supports(region, [fits], 10) and not dev.copier.supports(region, [fits, past], 10)
    assert not dev.copier.supports(region, [], 10)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["misaligned", "pageable"])
def test_calls_the_kernel_cannot_run_go_the_torch_way_with_the_same_bytes(gpu, where):
    """A region the kernel cannot run (not on 16-byte words, or host memory the GPU cannot
    reach) is copied by the CUDA copier the torch way, per call: the same bytes, and no
    prepared per-piece launches."""
    spec = SideSpec(GEO, 1, PageLayout(16))
    start, count = 5, 40
    ids = np.random.default_rng(17).permutation(20)[: pages_needed(start + count, 16)]
    dev = _random_cache(spec, 20, 18)
    host = host_buffers(dev)
    pieces = _slot_pieces(count)
    size = _size(pieces, count)

    def region(data: np.ndarray):
        if where == "pageable":
            return torch.from_numpy(data.copy())
        r = torch.zeros(len(data) + 8, dtype=torch.uint8, device="cuda")[8:]  # 8 bytes past a 16-byte word
        r.copy_(torch.from_numpy(data))
        return r

    before = np.random.default_rng(19).integers(0, 256, size, dtype=np.uint8)
    r = region(before)
    assert dev.copier.name == "cuda" and not dev.copier.supports(r, pieces, count)
    gather(dev, TokenIndex(dev, ids, start, count), pieces, r)
    torch.cuda.synchronize()
    assert np.array_equal(r.cpu().numpy(), expected_region(spec, host, ids, start, count, pieces, before))
    slot_bytes = np.random.default_rng(20).integers(0, 256, size, dtype=np.uint8)
    slot = region(slot_bytes)
    assert prepare_piece_scatters(dev, TokenIndex(dev, ids, start, count), pieces, slot) is None
    prepare_scatter(dev, TokenIndex(dev, ids, start, count), pieces, slot)()
    torch.cuda.synchronize()
    assert same_buffers(host_buffers(dev), expected_cache(spec, host, ids, start, count, pieces, slot_bytes))


@pytest.mark.gpu
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("host_region", [False, True])
def test_kernel_sums_every_checksum_segment_as_the_reference_does(gpu, side, host_region):
    """The fused kernel's sums (staging.checksum) on a gather and on a prepared scatter, device or
    pinned host region, several pieces of both orders; a row window's scatter sums its whole rows
    in a pass after the copy; one flipped byte moves one segment's sum."""
    from kvstage.staging import checksum

    spec = SideSpec(GEO, 1, PageLayout(*side))
    start, count = 5, 300
    src = _random_cache(spec, 400, 11)
    ids = np.random.default_rng(2).permutation(400)[: pages_needed(start + count, side[0])]
    whole = end_to_end([RegionPiece(0, 2, range(0, 3), 0, Order.HEADS), RegionPiece(2, 2, range(0, 6), 0, Order.TOKENS),
                        RegionPiece(0, 2, range(3, 6), 0, Order.HEADS)], HB, count, offset=16)
    kw = {"dtype": torch.uint8}
    region = torch.zeros(_size(whole, count), device="cpu" if host_region else "cuda", **kw)
    if host_region:
        region = region.pin_memory()
    idx = TokenIndex(src, ids, start, count, upload_pages(src, ids))
    sums = checksum.ChunkSums.of(whole, HB, count)
    gather(src, idx, whole, region, sums)
    torch.cuda.synchronize()
    want = checksum.ChunkSums.of(whole, HB, count)
    checksum.region_sums(region.cpu(), whole, HB, count, want)
    assert want.values.any() and np.array_equal(sums.values, want.values)
    dst = _random_cache(spec, 400, 12)
    landed = checksum.ChunkSums.of(whole, HB, count)
    prepare_scatter(dst, idx, whole, region, None, landed)()
    torch.cuda.synchronize()
    assert np.array_equal(landed.values, want.values)
    windows = _slot_pieces(count)  # two of its pieces are row windows: summed in a pass over their rows
    slot = torch.randint(0, 256, (_size(windows, count),), dtype=torch.uint8, device=region.device)
    if host_region:
        slot = slot.pin_memory()
    got = checksum.ChunkSums.of(windows, HB, count)
    scatter_chunk(dst, idx, windows, slot, None, got)
    torch.cuda.synchronize()
    ref = checksum.ChunkSums.of(windows, HB, count)
    checksum.region_sums(slot.cpu(), windows, HB, count, ref)
    assert np.array_equal(got.values, ref.values)
    region[whole[1].offset + 3] ^= 0x40
    flipped = checksum.ChunkSums.of(whole, HB, count)
    scatter_chunk(dst, idx, whole, region, None, flipped)
    torch.cuda.synchronize()
    assert list(np.flatnonzero(flipped.values != want.values)) == [checksum.segment_count(whole[0])]
