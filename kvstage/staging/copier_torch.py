"""The torch copier: indexed torch and numpy copies, on any device.

Copies are bytes: each head is moved as the widest integer word that tiles it,
since torch's indexed copies run per element. A piece of the region is viewed as
``[buffers, count, heads, words]`` whatever its order (a strided view for
``Order.HEADS`` and for a row window), so every copy is one indexed copy per
buffer. Whole pages at the front of a chunk that starts on a page boundary move
as page rows. On the host, scatters are numpy's indexed assignments, which copy
each row as one block where torch's ``index_copy_`` goes element by element, and
token-order pieces laid end to end over adjacent heads are scattered with one
indexed assignment per buffer. A region on another device than the cache (a
host arena of a CUDA cache) is bounced through a copy of each piece's window on
the cache's device, so bytes of the region outside the pieces are never written.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstage.layout import token_major
from kvstage.staging.copier import Copier
from kvstage.staging.region import Order, RegionPiece

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
    def _piece_view(self, region: torch.Tensor, piece: RegionPiece, count: int) -> torch.Tensor:
        """The piece's tokens in ``region`` as ``[buffers, count, heads, words]``: a view, strided
        where the order or the row window makes it so."""
        hb = self.cache.spec.geometry.head_bytes()
        words = region[piece.offset : piece.offset + piece.nbytes(hb, count)].view(self._dt)
        nb, rows, heads, lo = len(piece.buffers), piece.row_tokens(count), piece.heads, piece.row_first
        if piece.order is Order.TOKENS:
            return words.view(nb, rows, heads, self._hw)[:, lo : lo + count]
        return words.view(heads, nb, rows, self._hw)[:, :, lo : lo + count].permute(1, 2, 0, 3)

    def _words(self, buf: torch.Tensor) -> torch.Tensor:
        """A buffer as words, keeping its shape but the last dim (head_dim elements -> words)."""
        return buf.view(torch.uint8).view(self._dt)

    def _flat(self, buf: torch.Tensor) -> torch.Tensor:
        return self._words(buf).view(-1, self._heads, self._hw)

    def _page_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """A token-major buffer as one row of words per page."""
        return self._words(buf).view(self.cache.pages, -1)

    # -- one buffer's part of a piece ---------------------------------------------------------
    def _gather_buffer(self, idx, buf: torch.Tensor, lo: int, heads: int, out: torch.Tensor) -> None:
        """Local heads ``[lo, lo+heads)`` of the indexed tokens of ``buf`` into ``out``
        (``[count, heads, words]``, on the cache's device)."""
        whole = idx.full_pages if heads == self._heads else 0
        t0 = whole * self.cache.spec.page.page_size
        if whole:
            rows = out[:t0]
            if rows.is_contiguous():
                torch.index_select(self._page_rows(buf), 0, idx.pages, out=rows.view(whole, -1))
            else:
                rows.copy_(torch.index_select(self._page_rows(buf), 0, idx.pages).view(rows.shape))
        if t0 == idx.count:
            return
        if idx.flat_order:
            rest, src = out[t0:], self._flat(buf)[:, lo : lo + heads]
            if rest.is_contiguous():
                torch.index_select(src, 0, idx.flat[t0:], out=rest)
            else:
                rest.copy_(torch.index_select(src, 0, idx.flat[t0:]))
        else:
            out.copy_(self._words(buf)[idx.page, lo : lo + heads, idx.offset])

    def _scatter_buffer(self, idx, buf: torch.Tensor, lo: int, heads: int, src: torch.Tensor) -> None:
        """``src`` (``[count, heads, words]``, on the cache's device) into local heads
        ``[lo, lo+heads)`` of the indexed tokens of ``buf``."""
        whole = idx.full_pages if heads == self._heads else 0
        t0 = whole * self.cache.spec.page.page_size
        if idx.on_cpu:
            if whole:
                self._page_rows(buf).numpy()[idx.pages_np] = src[:t0].reshape(whole, -1).numpy()
            if t0 == idx.count:
                return
            if idx.flat_order:
                self._flat(buf).numpy()[idx.flat_np[t0:], lo : lo + heads] = src[t0:].numpy()
            else:
                self._words(buf).numpy()[idx.page_np, lo : lo + heads, idx.offset_np] = src.numpy()
            return
        if whole:
            self._page_rows(buf).index_copy_(0, idx.pages, src[:t0].reshape(whole, -1))
        if t0 == idx.count:
            return
        if idx.flat_order:
            self._flat(buf)[:, lo : lo + heads].index_copy_(0, idx.flat[t0:], src[t0:])
        else:
            self._words(buf)[idx.page, lo : lo + heads, idx.offset] = src

    # -- the contract -----------------------------------------------------------------------
    def _gather(self, idx, pieces, region, sums=None) -> None:
        cache = self.cache
        for piece in pieces:
            view = self._piece_view(region, piece, idx.count)
            out = (
                view
                if region.device == cache.device
                else torch.empty(view.shape, dtype=view.dtype, device=cache.device)
            )
            for bi, b in enumerate(piece.buffers):
                self._gather_buffer(idx, cache.buffers[b], piece.head_lo, piece.heads, out[bi])
            if out is not view:
                view.copy_(out)
        self._sum(idx, pieces, region, sums)

    def _scatter(self, idx, pieces, region, threads=None, sums=None) -> None:
        """``threads``: share a host cache's tiled scatter (token-order pieces laid end to end)
        among them, by buffer."""
        self._sum(idx, pieces, region, sums)
        cache = self.cache
        tiled = self._tiling(idx.count, pieces) if cache.device.type == region.device.type == "cpu" else None
        if tiled is not None:
            return self._scatter_tiled(idx, *tiled, region, threads)
        for piece in pieces:
            src = self._piece_view(region, piece, idx.count)
            if region.device != cache.device:
                src = src.to(cache.device)
            for bi, b in enumerate(piece.buffers):
                self._scatter_buffer(idx, cache.buffers[b], piece.head_lo, piece.heads, src[bi])

    # -- the tiled host scatter ------------------------------------------------------------------
    def _tiling(self, count: int, pieces) -> tuple[int, int, int, int, range] | None:
        """``(head_lo, writers, heads each, base, buffers)`` when the pieces, in region order,
        are token-order pieces of the same buffers and whole rows, equal-width runs of
        adjacent heads laid end to end: the region is then one ``[writers, buffers, count,
        heads, words]`` array that a single indexed assignment per buffer can place (each
        destination token written whole)."""
        if len(pieces) < 2 or not token_major(self.cache.spec.geometry, self.cache.spec.page):
            return None
        first = pieces[0]
        lo, n, base, buffers = first.head_lo, first.heads, first.offset, first.buffers
        size = first.nbytes(self.cache.spec.geometry.head_bytes(), count)
        for k, p in enumerate(pieces):
            if (
                p.order is not Order.TOKENS
                or p.rows is not None
                or p.buffers != buffers
                or p.heads != n
                or p.head_lo != lo + k * n
                or p.offset != base + k * size
            ):
                return None
        return lo, len(pieces), n, base, buffers

    def _scatter_tiled(self, idx, lo: int, k: int, n: int, base: int, buffers: range, region, threads=None) -> None:
        cache = self.cache
        geo = cache.spec.geometry
        hw, nb = self._hw, len(buffers)
        size = n * nb * idx.count * geo.head_bytes()
        src = region[base : base + k * size].view(self._dt).numpy().reshape(k, nb, idx.count, n, hw)
        whole = idx.full_pages if k * n == self._heads else 0
        P = cache.spec.page.page_size
        t0 = whole * P
        # whole pages: one writer's heads of one token as one numpy element ("V<bytes>"), so each
        # element moves as one block straight from the slot to its page, with no temporary that
        # interleaves the writers first
        piece = np.dtype(f"V{n * geo.head_bytes()}")
        pieces = src.reshape(-1).view(piece).reshape(k, nb, idx.count)

        def place(i: int, buf: torch.Tensor) -> None:
            if whole:  # [pages, tokens, writers] in the cache <- [writers, tokens] of the slot, transposed
                pages = buf.view(torch.uint8).numpy().reshape(-1).view(piece).reshape(cache.pages, P, k)
                pages[idx.pages_np] = pieces[:, i, :t0].T.reshape(whole, P, k)
            if t0 < idx.count:  # the tokens past the whole pages, as rows of [writers, heads, words]
                rows = src[:, i].transpose(1, 0, 2, 3)
                self._flat(buf).numpy()[idx.flat_np[t0:], lo : lo + k * n] = rows[t0:].reshape(-1, k * n, hw)

        items = [(i, cache.buffers[b]) for i, b in enumerate(buffers)]
        if threads is None:
            for item in items:
                place(*item)
        else:
            threads.run(place, items)
