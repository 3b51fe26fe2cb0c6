"""The torch copier: indexed torch and numpy copies, on any device.

Copies are bytes: each head is moved as the widest integer word that tiles it,
since torch's indexed copies run per element. Whole pages at the front of a
chunk that starts on a page boundary move as page rows. On the host, scatters
are numpy's indexed assignments, which copy each row as one block where torch's
``index_copy_`` goes element by element, and writers laid end to end over
adjacent heads are scattered with one indexed assignment per buffer. A region on
another device than the cache (a host arena of a CUDA cache) is bounced through
a copy on the cache's device.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstage.layout import token_major
from kvstage.staging.copier import Copier
from kvstage.staging.copy import region_bytes

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class TorchCopier(Copier):
    name = "torch"

    def __init__(self, cache, why: str = ""):
        super().__init__(cache, why)
        geo = cache.spec.geometry
        hb = geo.head_bytes()
        self._n, self._dt = next((n, dt) for n, dt in _WIDE if hb % n == 0)  # the widest word that tiles a head
        self._heads = 1 if geo.mla else cache.spec.local_heads()
        self._hw = hb // self._n  # words per head

    # -- views ------------------------------------------------------------------------------
    def _region_view(self, region: torch.Tensor, count: int, heads: int) -> torch.Tensor:
        return region.view(self._dt).view(self.cache.spec.geometry.buffers, count, heads, self._hw)

    def _words(self, buf: torch.Tensor) -> torch.Tensor:
        """A buffer as words, keeping its shape but the last dim (head_dim elements -> words)."""
        return buf.view(torch.uint8).view(self._dt)

    def _flat(self, buf: torch.Tensor) -> torch.Tensor:
        return self._words(buf).view(-1, self._heads, self._hw)

    def _page_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """A token-major buffer as one row of words per page."""
        return self._words(buf).view(self.cache.pages, -1)

    def _bounce(self, region: torch.Tensor) -> torch.Tensor | None:
        """A device copy of a region on another device (a host arena of a CUDA cache):
        the indexed copies need both sides on one device."""
        return None if region.device == self.cache.device else torch.empty_like(region, device=self.cache.device)

    # -- the contract -----------------------------------------------------------------------
    def gather(self, idx, head_lo: int, heads: int, region) -> None:
        cache = self.cache
        tmp = self._bounce(region)
        if tmp is not None:
            self.gather(idx, head_lo, heads, tmp)
            region.copy_(tmp)
            return
        out = self._region_view(region, idx.count, heads)
        whole = idx.full_pages if heads == self._heads else 0
        t0 = whole * cache.spec.page.page_size
        for i, buf in enumerate(cache.buffers):
            if whole:
                torch.index_select(self._page_rows(buf), 0, idx.pages, out=out[i, :t0].reshape(whole, -1))
            if t0 == idx.count:
                continue
            if idx.flat_order:
                torch.index_select(self._flat(buf)[:, head_lo : head_lo + heads], 0, idx.flat[t0:], out=out[i, t0:])
            else:
                out[i].copy_(self._words(buf)[idx.page, head_lo : head_lo + heads, idx.offset])

    def scatter(self, idx, head_lo: int, heads: int, region) -> None:
        cache = self.cache
        tmp = self._bounce(region)
        if tmp is not None:
            tmp.copy_(region)
            region = tmp
        src = self._region_view(region, idx.count, heads)
        whole = idx.full_pages if heads == self._heads else 0
        t0 = whole * cache.spec.page.page_size
        for i, buf in enumerate(cache.buffers):
            if idx.on_cpu:
                if whole:
                    self._page_rows(buf).numpy()[idx.pages_np] = src[i, :t0].reshape(whole, -1).numpy()
                if t0 == idx.count:
                    continue
                if idx.flat_order:
                    self._flat(buf).numpy()[idx.flat_np[t0:], head_lo : head_lo + heads] = src[i, t0:].numpy()
                else:
                    self._words(buf).numpy()[idx.page_np, head_lo : head_lo + heads, idx.offset_np] = src[i].numpy()
                continue
            if whole:
                self._page_rows(buf).index_copy_(0, idx.pages, src[i, :t0].reshape(whole, -1))
            if t0 == idx.count:
                continue
            if idx.flat_order:
                self._flat(buf)[:, head_lo : head_lo + heads].index_copy_(0, idx.flat[t0:], src[i, t0:])
            else:
                self._words(buf)[idx.page, head_lo : head_lo + heads, idx.offset] = src[i]

    def scatter_chunk(self, idx, pieces, region, threads=None) -> None:
        """``threads``: share a host cache's tiled scatter (NHD pieces laid end to end) among them, by buffer."""
        tmp = self._bounce(region)
        if tmp is not None:
            tmp.copy_(region)
            region = tmp
        tiled = self._tiling(idx.count, pieces) if self.cache.device.type == "cpu" else None
        if tiled is not None:
            return self._scatter_tiled(idx, *tiled, region, threads)
        for lo, n, base in pieces:
            self.scatter(idx, lo, n, region[base : base + region_bytes(self.cache, idx.count, n)])

    # -- the tiled host scatter ------------------------------------------------------------------
    def _tiling(self, count: int, pieces) -> tuple[int, int, int, int] | None:
        """``(head_lo, writers, heads each, base)`` when the pieces, in region order, are
        equal-width runs of adjacent heads laid end to end: the region is then one
        ``[writers, buffers, count, heads, words]`` array that a single indexed
        assignment per buffer can place (each destination token written whole)."""
        if len(pieces) < 2 or not token_major(self.cache.spec.geometry, self.cache.spec.page):
            return None
        lo, n, base = pieces[0]
        size = region_bytes(self.cache, count, n)
        for k, (lo_k, n_k, base_k) in enumerate(pieces):
            if n_k != n or lo_k != lo + k * n or base_k != base + k * size:
                return None
        return lo, len(pieces), n, base

    def _scatter_tiled(self, idx, lo: int, k: int, n: int, base: int, region, threads=None) -> None:
        cache = self.cache
        geo = cache.spec.geometry
        hw = self._hw
        size = region_bytes(cache, idx.count, n)
        src = region[base : base + k * size].view(self._dt).numpy().reshape(k, geo.buffers, idx.count, n, hw)
        whole = idx.full_pages if k * n == self._heads else 0
        P = cache.spec.page.page_size
        t0 = whole * P
        # whole pages: one writer's heads of one token as one numpy element ("V<bytes>"), so each
        # element moves as one block straight from the slot to its page, with no temporary that
        # interleaves the writers first
        piece = np.dtype(f"V{n * geo.head_bytes()}")
        pieces = src.reshape(-1).view(piece).reshape(k, geo.buffers, idx.count)

        def place(i: int, buf: torch.Tensor) -> None:
            if whole:  # [pages, tokens, writers] in the cache <- [writers, tokens] of the slot, transposed
                pages = buf.view(torch.uint8).numpy().reshape(-1).view(piece).reshape(cache.pages, P, k)
                pages[idx.pages_np] = pieces[:, i, :t0].T.reshape(whole, P, k)
            if t0 < idx.count:  # the tokens past the whole pages, as rows of [writers, heads, words]
                rows = src[:, i].transpose(1, 0, 2, 3)
                self._flat(buf).numpy()[idx.flat_np[t0:], lo : lo + k * n] = rows[t0:].reshape(-1, k * n, hw)

        if threads is None:
            for i, buf in enumerate(cache.buffers):
                place(i, buf)
        else:
            threads.run(place, list(enumerate(cache.buffers)))
