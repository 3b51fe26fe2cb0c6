"""The copier rule (``staging.copier.choose_copier``): which implementation each kind of
cache gets, the forced choice and its refusal, one log line, and byte-identical copies
from every implementation (the GPU ones on a GPU)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.protocol.destination import Destination
from kvstage.staging import cuda_copy, hostcopy
from kvstage.staging.cache import RankCache
from kvstage.staging.copier import choose_copier
from kvstage.staging.copy import (CopyThreads, TokenIndex, gather, gather_pieces, prepare_piece_scatters,
                                  prepare_scatter, region_bytes, scatter, scatter_chunk, upload_pages)
from kvstage.tp import SideSpec

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
        ep = Destination(cache, Settings(arena_mb=1))
        ep.close()
        assert cache.copier is ep.copier and cache.copier.name == "native"  # chosen once
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
        assert cache.copier.prepare_piece_scatters(TokenIndex(cache, np.arange(4), 0, 8), [(0, 1, 0), (1, 1, 64)],
                                                   torch.zeros(128, dtype=torch.uint8)) is None
        with pytest.raises(IndexError, match=r"page ids must lie in \[0, 8\); got 0\.\.12"):
            TokenIndex(cache, np.array([0, 12]), 0, 8)


def _gpu():
    return pytest.mark.skipif(not (torch.cuda.is_available() and cuda_copy.available()), reason="needs CUDA and CuPy")


# (copier, device, region device): every implementation, the torch one also on a CUDA cache
# with its region on the device and in pinned host memory (bounced through a device copy)
COPIERS = [
    ("torch", "cpu", "cpu"),
    ("native", "cpu", "cpu"),
    pytest.param("cuda", "cuda", "cuda", marks=[pytest.mark.gpu, _gpu()]),
    pytest.param("cuda", "cuda", "pinned", marks=[pytest.mark.gpu, _gpu()]),
    pytest.param("torch", "cuda", "cuda", marks=[pytest.mark.gpu, _gpu()]),
    pytest.param("torch", "cuda", "pinned", marks=[pytest.mark.gpu, _gpu()]),
]


def _region(n: int, where: str) -> torch.Tensor:
    r = torch.zeros(n, dtype=torch.uint8, device="cuda" if where == "cuda" else "cpu")
    return r.pin_memory() if where == "pinned" else r


def _bytes(cache) -> torch.Tensor:
    return torch.cat([b.view(torch.uint8).reshape(-1).cpu() for b in cache.buffers])


def _moves(spec, name: str, device: str, where: str, start: int, count: int, ids, pieces) -> dict:
    """Everything one copier does to the same random cache and slot, as host bytes."""
    geo = spec.geometry
    heads = 1 if geo.mla else geo.kv_heads
    pages = int(ids.max()) + 4

    def fresh(fill):
        return RankCache.allocate(spec, 0, pages, device, fill=fill, copier=name)

    src = fresh(None)
    g = torch.Generator().manual_seed(7)
    for b in src.buffers:
        b.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, generator=g))
    kernel_pages = upload_pages(src, ids)
    out = {}
    region = _region(region_bytes(src, count, heads), where)
    gather(src, TokenIndex(src, ids, start, count, kernel_pages), 0, heads, region)
    parts = [_region(region_bytes(src, count, n), where) for _, n, _ in pieces]
    gather_pieces(src, TokenIndex(src, ids, start, count), [(lo, n, r) for (lo, n, _), r in zip(pieces, parts)])
    slot = _region(max(base + region_bytes(src, count, n) for _, n, base in pieces) + 16, where)
    slot.copy_(torch.randint(0, 256, (slot.numel(),), dtype=torch.uint8, generator=g))
    one, chunk, shared, ready, each = (fresh(0) for _ in range(5))
    scatter(one, TokenIndex(one, ids, start, count), 0, heads, region)
    scatter_chunk(chunk, TokenIndex(chunk, ids, start, count), pieces, slot)
    pool = CopyThreads(2)
    try:
        scatter_chunk(shared, TokenIndex(shared, ids, start, count), pieces, slot, pool)
    finally:
        pool.close()
    run = prepare_scatter(ready, TokenIndex(ready, ids, start, count, upload_pages(ready, ids)), pieces, slot)
    assert not _bytes(ready).any()  # nothing moves until it is called
    run()
    launches = prepare_piece_scatters(each, TokenIndex(each, ids, start, count), pieces, slot)
    assert (launches is None) == (name != "cuda")  # only the kernel scatters a chunk piece by piece
    if launches is None:
        scatter_chunk(each, TokenIndex(each, ids, start, count), pieces, slot)
    else:
        for launch in reversed(launches):
            launch()
    if device == "cuda":
        torch.cuda.synchronize()
    out["gather"] = region.cpu()
    out["gather_pieces"] = [r.cpu() for r in parts]
    for key, c in (("scatter", one), ("scatter_chunk", chunk), ("shared", shared), ("prepared", ready),
                   ("pieces", each)):
        out[key] = _bytes(c)
    return out


@pytest.mark.parametrize("name,device,where", COPIERS)
@pytest.mark.parametrize("order", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", ["adjacent", "reversed", "mla"])
def test_every_copier_moves_the_same_bytes(name, device, where, order, page_size, kind):
    """Gather, gather_pieces, scatter, scatter_chunk (alone and shared among threads), a
    prepared scatter and per-piece scatters of random pages, mid-page: byte-identical regions
    and caches from each implementation and the torch copier on the host. ``kind``: two
    writers laid end to end over adjacent heads, the same in reverse head order, or MLA
    (one latent head, one writer)."""
    mla, tiled = kind == "mla", kind == "adjacent"
    geo = KVGeometry(3, 1 if mla else 4, 64, "bfloat16", mla)  # 128-byte heads: whole 16-byte words
    spec = SideSpec(geo, 1, PageLayout(page_size, order))
    rng = np.random.default_rng([page_size, int(mla), len(order)])
    start, count = 3, 37
    need = pages_needed(start + count, page_size)
    ids = rng.permutation(need + 9)[:need]
    size = region_bytes(RankCache.allocate(spec, 0, 1), count, 2)
    pieces = ([(0, 1, 0)] if mla else [(0, 2, 0), (2, 2, size)] if tiled else [(2, 2, 0), (0, 2, size)])
    want = _moves(spec, "torch", "cpu", "cpu", start, count, ids, pieces)
    got = _moves(spec, name, device, where, start, count, ids, pieces)
    assert want["gather"].any() and want["scatter"].any() and want["scatter_chunk"].any()
    for key, value in want.items():
        if isinstance(value, list):
            assert all(torch.equal(a, b) for a, b in zip(got[key], value)), key
        else:
            assert torch.equal(got[key], value), key
    assert torch.equal(want["scatter_chunk"], want["shared"]) and torch.equal(want["scatter_chunk"], want["prepared"])
