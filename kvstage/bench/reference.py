"""The reference KV cache the benchmark and the tests check against.

The full cache (all heads, all tokens) is defined by a seed, one buffer at a
time, so any process can rebuild exactly the bytes it needs. Filling and
checking use plain indexing written independently of ``kvstage.staging`` so a
bug there cannot cancel itself out.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstage.layout import token_positions
from kvstage.staging.cache import RankCache


def full_buffer(seed: int, buffer: int, tokens: int, heads: int, head_bytes: int) -> torch.Tensor:
    """Bytes of buffer ``buffer`` of the full cache: ``[tokens, heads, head_bytes]`` uint8."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + buffer)
    return torch.randint(0, 256, (tokens, heads, head_bytes), dtype=torch.uint8, generator=gen)


def _token_view(cache: RankCache, buf: torch.Tensor, pid: torch.Tensor, off: torch.Tensor):
    """Indexer (getter, setter) over the tokens at (pid, off) of ``buf`` as ``[T, heads, head_bytes]`` bytes."""
    spec = cache.spec
    g, P = spec.geometry, spec.page.page_size
    hb = g.head_bytes()
    if g.mla:
        u = buf.view(torch.uint8).view(cache.pages, P, 1, hb)
        return (lambda: u[pid, off]), (lambda v: u.__setitem__((pid, off), v))
    h = spec.local_heads()
    if spec.page.order == "nhd":
        u = buf.view(torch.uint8).view(cache.pages, P, h, hb)
        return (lambda: u[pid, off]), (lambda v: u.__setitem__((pid, off), v))
    u = buf.view(torch.uint8).view(cache.pages, h, P, hb)
    return (lambda: u[pid, :, off]), (lambda v: u.__setitem__((pid, slice(None), off), v))


def _positions(cache: RankCache, pages: np.ndarray, tokens: int):
    pid, off = token_positions(pages, cache.spec.page.page_size, 0, tokens)
    return torch.from_numpy(pid).to(cache.device), torch.from_numpy(off).to(cache.device)


def fill_shard(cache: RankCache, seed: int, pages: np.ndarray, tokens: int) -> None:
    """Write this rank's shard of the reference cache into ``pages``."""
    g = cache.spec.geometry
    heads = cache.spec.heads_of(cache.rank)
    pid, off = _positions(cache, pages, tokens)
    for i, buf in enumerate(cache.buffers):
        full = full_buffer(seed, i, tokens, g.kv_heads, g.head_bytes())
        _, put = _token_view(cache, buf, pid, off)
        put(full[:, heads.start : heads.stop].to(cache.device))


def check_shard(cache: RankCache, seed: int, pages: np.ndarray, tokens: int, untouched_fill: int | None = 0) -> list[str]:
    """Compare this rank's pages with the reference shard, byte for byte.

    Also checks that pages outside ``pages`` still hold ``untouched_fill``
    (a stray write shows up there). Returns a list of mismatches, empty if exact."""
    g = cache.spec.geometry
    heads = cache.spec.heads_of(cache.rank)
    pid, off = _positions(cache, pages, tokens)
    errors = []
    others = np.setdiff1d(np.arange(cache.pages), pages)
    for i, buf in enumerate(cache.buffers):
        full = full_buffer(seed, i, tokens, g.kv_heads, g.head_bytes())[:, heads.start : heads.stop]
        get, _ = _token_view(cache, buf, pid, off)
        got = get().cpu()
        if not torch.equal(got, full):
            bad = (got != full).reshape(tokens, -1).any(dim=1).nonzero().flatten()
            errors.append(f"buffer {i}: {len(bad)} of {tokens} tokens differ (first token {int(bad[0])})")
        if untouched_fill is not None and len(others):
            rest = buf.view(torch.uint8)[torch.from_numpy(others).to(cache.device)]
            if not bool((rest == untouched_fill).all()):
                errors.append(f"buffer {i}: a page outside the request was written")
    return errors
