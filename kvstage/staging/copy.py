"""Gather a head slice of some tokens into a staging region, and scatter it back.

A region holds, for ``count`` tokens and ``heads`` heads, the bytes of every
(layer, plane) buffer in order: ``[buffers, count, heads, head_dim]``. The
source gathers with its own page size and layout; the destination scatters
with its own, which is how page size and NHD/HND conversion happen.

These are torch ops (any device). Fused GPU kernels replace them on CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstage.layout import token_positions
from kvstage.staging.cache import RankCache


class TokenIndex:
    """Where tokens ``start .. start+count`` of a request sit in one rank's cache."""

    def __init__(self, cache: RankCache, page_ids: np.ndarray, start: int, count: int):
        page = cache.spec.page
        pid, off = token_positions(page_ids, page.page_size, start, count)
        if len(pid) and (pid.min() < 0 or pid.max() >= cache.pages):
            raise IndexError(f"page ids must lie in [0, {cache.pages}); got {pid.min()}..{pid.max()}")
        self.count = count
        self.flat_order = cache.spec.geometry.mla or page.order == "nhd"
        if self.flat_order:
            self.flat = torch.from_numpy(pid * page.page_size + off).to(cache.device)
        else:
            self.page = torch.from_numpy(pid).to(cache.device)
            self.offset = torch.from_numpy(off).to(cache.device)


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(cache: RankCache) -> tuple[int, torch.dtype]:
    """The widest integer word that tiles one head: copies are bytes, and
    torch's indexed copies run per element, so wider elements copy faster."""
    hb = cache.spec.geometry.head_bytes()
    return next((n, dt) for n, dt in _WIDE if hb % n == 0)


def _region_view(region: torch.Tensor, cache: RankCache, count: int, heads: int) -> torch.Tensor:
    geo = cache.spec.geometry
    n, dt = _word(cache)
    return region.view(dt).view(geo.buffers, count, heads, geo.head_bytes() // n)


def _words(buf: torch.Tensor, cache: RankCache) -> torch.Tensor:
    """A buffer as words, keeping its shape but the last dim (head_dim elements -> words)."""
    n, dt = _word(cache)
    return buf.view(torch.uint8).view(dt)


def _flat(buf: torch.Tensor, cache: RankCache) -> torch.Tensor:
    geo = cache.spec.geometry
    n, _ = _word(cache)
    return _words(buf, cache).view(-1, 1 if geo.mla else cache.spec.local_heads(), geo.head_bytes() // n)


def region_bytes(cache: RankCache, count: int, heads: int) -> int:
    geo = cache.spec.geometry
    return geo.buffers * count * heads * geo.head_bytes()


def gather(cache: RankCache, idx: TokenIndex, head_lo: int, heads: int, region: torch.Tensor) -> None:
    """Copy local heads ``[head_lo, head_lo+heads)`` of the indexed tokens into ``region``."""
    out = _region_view(region, cache, idx.count, heads)
    for i, buf in enumerate(cache.buffers):
        if idx.flat_order:
            torch.index_select(_flat(buf, cache)[:, head_lo : head_lo + heads], 0, idx.flat, out=out[i])
        else:
            out[i].copy_(_words(buf, cache)[idx.page, head_lo : head_lo + heads, idx.offset])


def scatter(cache: RankCache, idx: TokenIndex, head_lo: int, heads: int, region: torch.Tensor) -> None:
    """Copy ``region`` into local heads ``[head_lo, head_lo+heads)`` of the indexed tokens."""
    src = _region_view(region, cache, idx.count, heads)
    for i, buf in enumerate(cache.buffers):
        if idx.flat_order:
            _flat(buf, cache)[:, head_lo : head_lo + heads].index_copy_(0, idx.flat, src[i])
        else:
            _words(buf, cache)[idx.page, head_lo : head_lo + heads, idx.offset] = src[i]
