"""The copier rule (``staging.copier.choose_copier``): which implementation each kind of
cache gets, the forced choice and its refusal, one log line; and the contract: every
implementation (the GPU ones on a GPU) copies exactly the bytes the region rule says,
against an independent reference (``support.regions``), and refuses a bad piece by its
field before anything moves."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstage.errors import ConfigError
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging import cuda_copy, hostcopy
from kvstage.staging.cache import RankCache
from kvstage.staging.copier import choose_copier
from kvstage.staging.copy import (CopyThreads, TokenIndex, gather, prepare_piece_scatters, prepare_scatter,
                                  scatter_chunk, upload_pages)
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import SideSpec, plan
from support.regions import expected_cache, expected_region, host_buffers, random_bytes, same_buffers

SPEC = SideSpec(KVGeometry(2, 2, 8, "bfloat16"), 1, PageLayout(4, "nhd"))
NOT_BUILT = "kvstage.staging._spans is not built (no compiler)"


@pytest.fixture
def unbuilt(monkeypatch):
    """An install without a C compiler: no native span copies."""
    monkeypatch.setattr(hostcopy, "_lib", None)
    monkeypatch.setattr(hostcopy, "_why_not", NOT_BUILT)


def _gpu_cache(kernel: bool, monkeypatch):
    """A stand-in for a CUDA cache on this GPU-less machine: the rule reads its device; with
    ``kernel`` CuPy is taken to be importable (the kernel's copier is stubbed, it needs a GPU)."""
    monkeypatch.setattr(cuda_copy, "available", lambda: kernel)
    monkeypatch.setattr(cuda_copy, "WordCopier", lambda spec, buffers: SimpleNamespace(spec=spec))
    return SimpleNamespace(spec=SPEC, rank=0, buffers=[], device=torch.device("cuda", 0))


def test_a_host_cache_copies_natively_where_built_and_logs_it_once(caplog):
    cache = RankCache.allocate(SPEC, 0, 8)
    with caplog.at_level(logging.INFO, logger="kvstage"):
        first = cache.copier
        assert cache.copier is first and first.name == "native"  # chosen once
        upload_pages(cache, np.arange(4))
        TokenIndex(cache, np.arange(4), 0, 16)
    lines = [r.getMessage() for r in caplog.records if " copies: " in r.getMessage()]
    assert lines == ["rank 0 copies: native (streaming span copies, kvstage.staging._spans)"]


def test_the_first_use_from_two_threads_chooses_one_copier(caplog):
    cache = RankCache.allocate(SPEC, 0, 8)
    got, go = [], threading.Barrier(2)

    def first_use():
        go.wait()
        got.append(cache.copier)

    with caplog.at_level(logging.INFO, logger="kvstage"):
        threads = [threading.Thread(target=first_use) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == 2 and got[0] is got[1]
    assert sum(" copies: " in r.getMessage() for r in caplog.records) == 1


def test_without_the_native_build_a_host_cache_copies_with_torch_and_says_why(unbuilt, caplog):
    with caplog.at_level(logging.INFO, logger="kvstage"):
        c = RankCache.allocate(SPEC, 0, 8).copier
    assert c.name == "torch" and c.why == f"torch/numpy indexed copies: {NOT_BUILT}"
    assert [r.getMessage() for r in caplog.records if " copies: " in r.getMessage()] == [
        f"rank 0 copies: torch (torch/numpy indexed copies: {NOT_BUILT})"]
    with pytest.raises(ConfigError, match=r"copier='native': kvstage.staging._spans is not built \(no compiler\)"):
        RankCache.allocate(SPEC, 0, 8, copier="native").copier


def test_a_cuda_cache_gets_the_kernel_where_cupy_is_there(monkeypatch):
    c = choose_copier(_gpu_cache(True, monkeypatch))
    assert c.name == "cuda" and c.uploads and "fused kernel" in c.why
    assert choose_copier(_gpu_cache(True, monkeypatch), "torch").name == "torch"
    with pytest.raises(ConfigError, match=r"copier='native': this rank's cache is on cuda:0; native span copies "
                                          r"are for host caches"):
        choose_copier(_gpu_cache(True, monkeypatch), "native")


def test_a_cuda_cache_without_cupy_copies_with_torch_and_refuses_the_kernel_by_name(monkeypatch):
    c = choose_copier(_gpu_cache(False, monkeypatch))
    assert c.name == "torch" and not c.uploads and "needs CuPy" in c.why
    with pytest.raises(ConfigError, match=r"copier='cuda': the fused kernel needs CuPy with a CUDA device"):
        choose_copier(_gpu_cache(False, monkeypatch), "cuda")


@pytest.mark.parametrize("want,needle", [
    ("cuda", r"copier='cuda': this rank's cache is on cpu; the kernel copies CUDA caches"),
    ("fast", r"copier='fast': must be one of cuda, native, torch"),
])
def test_a_copier_that_cannot_run_is_refused_by_name(want, needle):
    with pytest.raises(ConfigError, match=needle):
        RankCache.allocate(SPEC, 0, 8, copier=want).copier


def test_a_forced_copier_is_the_one_used():
    torch_copier = RankCache.allocate(SPEC, 0, 8, copier="torch").copier
    assert torch_copier.name == "torch" and torch_copier.why == "torch indexed copies, forced: copier='torch'"
    assert RankCache(SPEC, 0, RankCache.allocate(SPEC, 0, 8).buffers, copier="native").copier.name == "native"


def test_host_copiers_upload_nothing_and_index_on_the_host():
    """Only the kernel's copier takes a request's page ids (and checks them first); a host
    copier checks each chunk's own pages when it is indexed."""
    for name in ("torch", "native"):
        cache = RankCache.allocate(SPEC, 0, 8, copier=name)
        assert upload_pages(cache, np.array([0, 12])) is None
        pieces = [RegionPiece(0, 1, range(4), 0), RegionPiece(1, 1, range(4), 512)]
        assert cache.copier.prepare_piece_scatters(TokenIndex(cache, np.arange(4), 0, 8), pieces,
                                                   torch.zeros(1024, dtype=torch.uint8)) is None
        with pytest.raises(IndexError, match=r"page ids must lie in \[0, 8\); got 0\.\.12"):
            TokenIndex(cache, np.array([0, 12]), 0, 8)


def _gpu():
    return pytest.mark.skipif(not (torch.cuda.is_available() and cuda_copy.available()), reason="needs CUDA and CuPy")


# (copier, device, region device): every implementation, the torch one also on a CUDA cache
# with its region on the device and in pinned host memory (bounced through a device copy)
HOST_COPIERS = [("torch", "cpu", "cpu"), ("native", "cpu", "cpu")]
COPIERS = HOST_COPIERS + [
    pytest.param("cuda", "cuda", "cuda", marks=[pytest.mark.gpu, _gpu()]),
    pytest.param("cuda", "cuda", "pinned", marks=[pytest.mark.gpu, _gpu()]),
    pytest.param("torch", "cuda", "cuda", marks=[pytest.mark.gpu, _gpu()]),
    pytest.param("torch", "cuda", "pinned", marks=[pytest.mark.gpu, _gpu()]),
]

DTYPES = {1: "int8", 2: "bfloat16", 4: "float32"}


def _region(data: np.ndarray, where: str) -> torch.Tensor:
    """``data``'s bytes as a region on ``where``: "cpu", "pinned" host memory or "cuda"."""
    r = torch.from_numpy(np.array(data, dtype=np.uint8))
    if where == "cuda":
        return r.cuda()
    return r.pin_memory() if where == "pinned" else r


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _ids(rng, start: int, count: int, page_size: int) -> np.ndarray:
    """A request's page ids in random order, with pages outside the request between them."""
    need = pages_needed(start + count, page_size)
    return rng.permutation(need + 9)[:need]


def _pieces(kind: str, geo: KVGeometry, count: int) -> list[RegionPiece]:
    """The pieces of one slot, laid end to end. Scattered pieces cover disjoint (head, buffer) pairs."""
    every = range(geo.buffers)
    H, T = Order.HEADS, Order.TOKENS
    if kind == "heads":  # two writers of two heads each, head order
        pieces = [RegionPiece(0, 2, every, 0, H), RegionPiece(2, 2, every, 0, H)]
    elif kind == "tokens-tiled":  # token order, adjacent heads end to end (the host's tiled scatter)
        pieces = [RegionPiece(0, 2, every, 0, T), RegionPiece(2, 2, every, 0, T)]
    elif kind == "tokens-reversed":
        pieces = [RegionPiece(2, 2, every, 0, T), RegionPiece(0, 2, every, 0, T)]
    elif kind == "mixed":  # both orders, shares of the buffers, row windows longer than the chunk
        pieces = [RegionPiece(0, 2, range(0, 3), 0, H, rows=count + 7, row_first=3),
                  RegionPiece(2, 2, every, 0, T),
                  RegionPiece(0, 1, range(3, 6), 0, T, rows=count + 1, row_first=1),
                  RegionPiece(1, 1, range(3, 6), 0, H)]
    elif kind == "mla-shares":  # MLA 4 -> 1: a share of the layers from each holder (tp.plan), 1, 2, 1, 2 layers
        src = SideSpec(geo, 4, PageLayout(16))
        writers = plan(src, SideSpec(geo, 1, PageLayout(16))).writers_of(0)
        assert [len(w.buffers) for w in writers] == [1, 2, 1, 2]
        pieces = [RegionPiece(0, 1, w.buffers, 0, (H, T)[k % 2], rows=count + 3 * k, row_first=k)
                  for k, w in enumerate(writers)]
    else:
        raise AssertionError(kind)
    return end_to_end(pieces, geo.head_bytes(), count, offset=16)


def _moves(spec, name: str, device: str, where: str, start: int, count: int, ids, pieces) -> None:
    """One copier's gather, and its scatter every way (alone, shared among threads, prepared,
    piece by piece), each checked against the reference, every byte of region and cache."""
    geo = spec.geometry
    pages = int(ids.max()) + 4
    hb = geo.head_bytes()
    size = max(p.offset + p.nbytes(hb, count) for p in pieces) + 32
    rng = np.random.default_rng(9)

    def fresh(fill):
        return RankCache.allocate(spec, 0, pages, device, fill=fill, copier=name)

    src = fresh(None)
    random_bytes(src, 7)
    before = rng.integers(0, 256, size, dtype=np.uint8)  # bytes outside the pieces must stay
    region = _region(before, where)
    if name == "cuda":
        assert src.copier.name == "cuda" and src.copier.supports(region, pieces, count)  # the kernel, no fallback
    gather(src, TokenIndex(src, ids, start, count, upload_pages(src, ids)), pieces, region)
    _sync(device)
    want = expected_region(spec, host_buffers(src), ids, start, count, pieces, before)
    assert np.array_equal(region.cpu().numpy(), want), "gather"

    slot_bytes = rng.integers(0, 256, size, dtype=np.uint8)
    slot = _region(slot_bytes, where)
    zero = host_buffers(fresh(0))
    want = expected_cache(spec, zero, ids, start, count, pieces, slot_bytes)
    assert not same_buffers(want, zero)

    def check(way, c):
        _sync(device)
        assert same_buffers(host_buffers(c), want), way

    c = fresh(0)
    scatter_chunk(c, TokenIndex(c, ids, start, count), pieces, slot)
    check("scatter_chunk", c)
    c = fresh(0)
    pool = CopyThreads(2)
    try:
        scatter_chunk(c, TokenIndex(c, ids, start, count), pieces, slot, pool)
    finally:
        pool.close()
    check("shared", c)
    c = fresh(0)
    run = prepare_scatter(c, TokenIndex(c, ids, start, count, upload_pages(c, ids)), pieces, slot)
    _sync(device)
    assert same_buffers(host_buffers(c), zero), "a prepared scatter moved bytes before it was called"
    run()
    check("prepared", c)
    c = fresh(0)
    launches = prepare_piece_scatters(c, TokenIndex(c, ids, start, count), pieces, slot)
    assert (launches is None) == (name != "cuda")  # only the kernel scatters a chunk piece by piece
    if launches is None:
        scatter_chunk(c, TokenIndex(c, ids, start, count), pieces, slot)
    else:
        assert len(launches) == len(pieces)
        for launch in reversed(launches):
            launch()
    check("pieces", c)
    assert np.array_equal(slot.cpu().numpy(), slot_bytes), "a scatter wrote into its region"


@pytest.mark.parametrize("name,device,where", COPIERS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kind", ["heads", "tokens-tiled", "tokens-reversed", "mixed", "mla-shares"])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("start,count", [(3, 37), (0, 128)])
def test_every_copier_moves_the_bytes_the_region_rule_says(name, device, where, layout, page_size, kind, itemsize,
                                                           start, count):
    """Random pages, chunks mid-page and from a page boundary (whole pages), 128-byte heads of
    1-, 2- and 4-byte elements (whole 16-byte words: the kernel runs them)."""
    mla = kind == "mla-shares"
    geo = KVGeometry(6 if mla else 3, 1 if mla else 4, 128 // itemsize, DTYPES[itemsize], mla)
    spec = SideSpec(geo, 1, PageLayout(page_size, layout))
    rng = np.random.default_rng([page_size, itemsize, len(layout), start])
    ids = _ids(rng, start, count, page_size)
    _moves(spec, name, device, where, start, count, ids, _pieces(kind, geo, count))


@st.composite
def _cases(draw):
    """A rank, a chunk and pieces of it: any head size of 1-, 2- or 4-byte elements (words of
    16 bytes or not), heads, buffer ranges, both orders, row windows."""
    itemsize = draw(st.sampled_from([1, 2, 4]))
    head_bytes = draw(st.sampled_from([4, 12, 16, 48]))
    mla = draw(st.booleans())
    geo = KVGeometry(draw(st.integers(1, 3)), 1 if mla else draw(st.sampled_from([1, 2, 4])),
                     head_bytes // itemsize, DTYPES[itemsize], mla)
    spec = SideSpec(geo, 1, PageLayout(draw(st.sampled_from([1, 2, 16])), draw(st.sampled_from(["nhd", "hnd"]))))
    start, count = draw(st.integers(0, 40)), draw(st.integers(1, 40))
    heads = 1 if mla else geo.kv_heads
    pieces = []
    for _ in range(draw(st.integers(1, 3))):
        lo = draw(st.integers(0, heads - 1))
        b0 = draw(st.integers(0, geo.buffers - 1))
        extra = draw(st.sampled_from([None, 0, 5]))
        buffers = range(b0, draw(st.integers(b0 + 1, geo.buffers)))
        pieces.append(RegionPiece(lo, draw(st.integers(1, heads - lo)), buffers, 0, draw(st.sampled_from(list(Order))),
                                  None if extra is None else count + extra,
                                  0 if extra is None else draw(st.integers(0, extra))))
    return spec, start, count, end_to_end(pieces, geo.head_bytes(), count, offset=draw(st.sampled_from([0, 16, 48])))


def _disjoint(pieces) -> bool:
    cells = [(p.head_lo + j, b) for p in pieces for j in range(p.heads) for b in p.buffers]
    return len(cells) == len(set(cells))


@pytest.mark.parametrize("name,device,where", COPIERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases(), seed=st.integers(0, 2**16))
def test_any_pieces_gather_and_scatter_by_the_region_rule(name, device, where, case, seed):
    """Gather into a region of random bytes, scatter that region back into a zeroed cache (the
    round trip: overlapping pieces carry the same bytes), and, for pieces of disjoint heads
    and buffers, scatter a region of random bytes."""
    spec, start, count, pieces = case
    rng = np.random.default_rng(seed)
    ids = _ids(rng, start, count, spec.page.page_size)
    pages = int(ids.max()) + 2
    hb = spec.geometry.head_bytes()
    size = max(p.offset + p.nbytes(hb, count) for p in pieces) + int(rng.integers(0, 40))
    src = RankCache.allocate(spec, 0, pages, device, fill=None, copier=name)
    random_bytes(src, seed)
    before = rng.integers(0, 256, size, dtype=np.uint8)
    region = _region(before, where)
    gather(src, TokenIndex(src, ids, start, count, upload_pages(src, ids)), pieces, region)
    _sync(device)
    gathered = region.cpu().numpy()
    assert np.array_equal(gathered, expected_region(spec, host_buffers(src), ids, start, count, pieces, before))
    dst = RankCache.allocate(spec, 0, pages, device, fill=0, copier=name)
    zero = host_buffers(dst)
    scatter_chunk(dst, TokenIndex(dst, ids, start, count), pieces, region)
    _sync(device)
    assert same_buffers(host_buffers(dst), expected_cache(spec, zero, ids, start, count, pieces, gathered))
    if _disjoint(pieces):
        dst = RankCache.allocate(spec, 0, pages, device, fill=0, copier=name)
        prepare_scatter(dst, TokenIndex(dst, ids, start, count), pieces, _region(before, where))()
        _sync(device)
        assert same_buffers(host_buffers(dst), expected_cache(spec, zero, ids, start, count, pieces, before))


REFUSED = [  # (piece, the words its refusal must say), for a rank of 4 local heads, 6 buffers, 16-byte heads
    (RegionPiece(3, 2, range(6), 0), r"pieces\[1\]\.heads: head_lo=3 \+ heads=2 = 5 must be <= 4"),
    (RegionPiece(0, 1, range(4, 7), 0), r"pieces\[1\]\.buffers=range\(4, 7\): must lie in range\(0, 6\)"),
    (RegionPiece(0, 1, range(6), 0, rows=12, row_first=3), r"pieces\[1\]\.rows: row_first=3 \+ count=10 = 13 "
                                                           r"must be <= rows=12"),
    (RegionPiece(0, 1, range(6), 0, rows=5), r"pieces\[1\]\.rows: row_first=0 \+ count=10 = 10 must be <= rows=5"),
    (RegionPiece(0, 4, range(6), 4096), r"pieces\[1\]\.offset: the piece spans bytes 4096\.\.7936, past the "
                                        r"region's 4096"),
]


@pytest.mark.parametrize("name,device,where", COPIERS)
@pytest.mark.parametrize("bad,match", REFUSED)
def test_a_bad_piece_is_refused_by_its_field_before_anything_moves(name, device, where, bad, match):
    spec = SideSpec(KVGeometry(3, 4, 8, "bfloat16"), 1, PageLayout(4))
    ids, count = np.arange(3), 10
    good = RegionPiece(0, 4, range(6), 0)
    before = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    src = RankCache.allocate(spec, 0, 4, device, fill=None, copier=name)
    random_bytes(src, 2)
    dst = RankCache.allocate(spec, 0, 4, device, fill=0, copier=name)
    region = _region(before, where)
    for call in (lambda: gather(src, TokenIndex(src, ids, 0, count), [good, bad], region),
                 lambda: scatter_chunk(dst, TokenIndex(dst, ids, 0, count), [good, bad], region),
                 lambda: prepare_scatter(dst, TokenIndex(dst, ids, 0, count), [good, bad], region),
                 lambda: prepare_piece_scatters(dst, TokenIndex(dst, ids, 0, count), [good, bad], region)):
        with pytest.raises(ValueError, match=match):
            call()
    _sync(device)
    assert np.array_equal(region.cpu().numpy(), before)  # the good piece was not gathered either
    assert not any(b.any() for b in host_buffers(dst))


@pytest.mark.parametrize("name,device,where", COPIERS)
def test_the_old_tuple_pieces_are_refused(name, device, where):
    spec = SideSpec(KVGeometry(3, 4, 8, "bfloat16"), 1, PageLayout(4))
    cache = RankCache.allocate(spec, 0, 4, device, copier=name)
    with pytest.raises(TypeError, match=r"pieces\[0\]=\(0, 2, 0\): must be a staging.region.RegionPiece"):
        gather(cache, TokenIndex(cache, np.arange(3), 0, 10), [(0, 2, 0)], _region(np.zeros(4096), where))


@pytest.mark.parametrize("copier", ["native", "torch", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("page", [(1, "nhd"), (16, "nhd"), (4, "hnd")])
@pytest.mark.parametrize("start,count", [(0, 37), (5, 64)])
def test_a_sum_with_no_copy_equals_a_gathers_sums(copier, page, start, count):
    """``sum_cache``: the sums a gather of the pieces adds up, with no region (the paths that gather nothing
    sum a request's pages this way on both sides); a flipped byte moves its own piece's sum only."""
    from kvstage.staging.checksum import ChunkSums

    if copier == "native" and not hostcopy.available():
        pytest.skip(hostcopy.why_unavailable())
    device = "cuda" if copier == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    geo = KVGeometry(3, 4, 16, "float32")
    cache = RankCache.allocate(SideSpec(geo, 1, PageLayout(*page)), 0, 90, device, fill=None, copier=copier)
    assert cache.copier.name == copier
    random_bytes(cache, 90 * page[0])
    ids = np.random.default_rng(count).permutation(90)[: pages_needed(start + count, page[0])]
    hb = geo.head_bytes()
    pieces = end_to_end([RegionPiece(0, 2, range(0, 5), 0, Order.HEADS), RegionPiece(2, 2, range(3, 6), 0,
                                                                                  Order.HEADS)], hb, count)
    idx = TokenIndex(cache, ids, start, count, upload_pages(cache, ids))
    gathered = ChunkSums.of(pieces, hb, count)
    region = torch.empty(pieces[-1].offset + pieces[-1].nbytes(hb, count), dtype=torch.uint8, device=device)
    gather(cache, idx, pieces, region, gathered)
    summed = ChunkSums.of(pieces, hb, count)
    cache.copier.sum_cache(idx, pieces, summed)
    if device == "cuda":
        torch.cuda.synchronize()
    assert gathered.values.any() and np.array_equal(summed.values, gathered.values)
    buf = cache.buffers[0]  # buffer 0 lies only in the first piece
    buf.view(torch.uint8).reshape(buf.shape[0], -1)[int(ids[start // page[0]])] ^= 1  # the page of token start
    flipped = ChunkSums.of(pieces, hb, count)
    cache.copier.sum_cache(idx, pieces, flipped)
    if device == "cuda":
        torch.cuda.synchronize()
    assert flipped.total(0) != summed.total(0) and flipped.total(1) == summed.total(1)
