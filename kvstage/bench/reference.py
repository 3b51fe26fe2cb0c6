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


def head_column(seed: int, buffer: int, head: int, tokens: int, head_bytes: int) -> torch.Tensor:
    """Bytes of one head of buffer ``buffer`` of the full cache: ``[tokens, head_bytes]`` uint8.

    Each (buffer, head) has its own generator, so a rank builds only the heads
    it holds; drawn as int64 and viewed as bytes (several times faster than
    drawing bytes one by one)."""
    key = np.random.SeedSequence([int(seed), int(buffer), int(head)]).generate_state(1, np.uint64)[0]
    gen = torch.Generator().manual_seed(int(key) >> 1)  # any seed size, well mixed, inside manual_seed's range
    n = tokens * head_bytes
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (-(-n // 8),), dtype=torch.int64, generator=gen)
    return words.view(torch.uint8)[:n].view(tokens, head_bytes)


def full_buffer(seed: int, buffer: int, tokens: int, heads: int, head_bytes: int, first: int = 0) -> torch.Tensor:
    """Bytes of heads ``first .. heads-1`` of buffer ``buffer`` of the full cache:
    ``[tokens, heads - first, head_bytes]`` uint8."""
    return torch.stack([head_column(seed, buffer, h, tokens, head_bytes) for h in range(first, heads)], dim=1)


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
        full = full_buffer(seed, i, tokens, heads.stop, g.head_bytes(), heads.start)
        _, put = _token_view(cache, buf, pid, off)
        put(full.to(cache.device))


def check_shard(
    cache: RankCache,
    seed: int,
    pages: np.ndarray,
    tokens: int,
    untouched_fill: int | None = 0,
    written=None,
) -> list[str]:
    """Compare this rank's pages with the reference shard, byte for byte.

    Also checks that pages outside ``written`` (default: ``pages``; pass the
    pages of every request in flight when several were) still hold
    ``untouched_fill`` (a stray write shows up there). Returns a list of
    mismatches, empty if exact."""
    g = cache.spec.geometry
    heads = cache.spec.heads_of(cache.rank)
    pid, off = _positions(cache, pages, tokens)
    errors = []
    others = np.setdiff1d(np.arange(cache.pages), pages if written is None else np.asarray(written))
    for i, buf in enumerate(cache.buffers):
        full = full_buffer(seed, i, tokens, heads.stop, g.head_bytes(), heads.start)
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
