"""Gather pieces (``staging.region.RegionPiece``) of some tokens into a staging region,
and scatter them back.

The verbs the protocol calls; each runs on the copier its cache chose once
(``RankCache.copier``, the contract in ``staging.copier``). Also here: where
a chunk's tokens sit (``TokenIndex``), the stream every copy of a rank goes
on (``copy_stream``), and threads a host scatter may share (``CopyThreads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstage.layout import token_major, token_positions
from kvstage.staging.words import chunk_pages

if TYPE_CHECKING:
    from kvstage.staging.cache import RankCache
    from kvstage.staging.region import RegionPiece


def copy_stream(device: torch.device):
    """Where a rank's copies go, whichever thread launches them: the device's default
    stream (a fresh thread's current one). A request's page ids are uploaded on it and
    read by its later chunks' copies, so every copy of the rank must be on the same
    stream. A context that is empty when the caller is on it already."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from kvstage.staging.cuda_copy import current_stream, default_stream

    default = default_stream(device)
    if current_stream(device) is default:
        return contextlib.nullcontext()
    return torch.cuda.stream(default)


def _check_bounds(cache: RankCache, pages: np.ndarray) -> None:
    if len(pages) and (pages.min() < 0 or pages.max() >= cache.pages):
        raise IndexError(f"page ids must lie in [0, {cache.pages}); got {pages.min()}..{pages.max()}")


def upload_pages(cache: RankCache, page_ids: np.ndarray, checked: bool = False):
    """A request's page ids where the cache's copier reads them (``Copier.upload_pages``),
    or None where the copies index on the host; once per request, when it is posted, so
    no chunk's copy waits for an upload or a bounds check (pass the result to
    ``TokenIndex``). ``checked``: the ids were checked against this cache already (an
    endpoint's ``check_pages``), so the bounds are not checked twice."""
    copier = cache.copier
    if not copier.uploads:
        return None
    if not checked:
        _check_bounds(cache, np.asarray(page_ids))
    return copier.upload_pages(page_ids)


class TokenIndex:
    """Where tokens ``start .. start+count`` of a request sit in one rank's cache.
    ``kernel_pages``: the request's page ids from ``upload_pages``, if any. The token
    arrays the torch and numpy copies need are built on first use only."""

    def __init__(self, cache: RankCache, page_ids: np.ndarray, start: int, count: int, kernel_pages=None):
        P = cache.spec.page.page_size
        # the chunk's pages and the first token's offset: all the CUDA kernel needs
        self.kernel_pages, self.first_page, self.first = kernel_pages, start // P, start % P
        if kernel_pages is None:
            self.chunk_pages, _ = chunk_pages(page_ids, P, start, count)
            _check_bounds(cache, self.chunk_pages)
        elif len(kernel_pages) != len(page_ids):  # checked against the cache by upload_pages or its caller
            raise ValueError(f"kernel_pages holds {len(kernel_pages)} page ids, page_ids {len(page_ids)}")
        self.page_ids, self.start, self.count = page_ids, start, count
        self._cache = cache

    def _positions(self) -> None:
        cache, start, count = self._cache, self.start, self.count
        page = cache.spec.page
        pid, off = token_positions(self.page_ids, page.page_size, start, count)
        self.flat_order = token_major(cache.spec.geometry, page)
        self.on_cpu = cache.device.type == "cpu"
        # Whole pages at the front of the range (the range starts on a page
        # boundary) can move as page rows: 16x fewer, larger rows at page size 16.
        P = page.page_size
        self.full_pages = count // P if (start % P == 0 and P > 1 and self.flat_order) else 0
        self.pages_np = pid[: self.full_pages * P : P]
        self.flat_np = pid * P + off if self.flat_order else None
        self.page_np, self.offset_np = pid, off
        self._device = cache.device
        self._on_device: dict = {}

    def __getattr__(self, name: str):
        """Token arrays for the torch paths, built on first use."""
        if "_cache" not in self.__dict__ or "_on_device" in self.__dict__:
            raise AttributeError(name)
        self._positions()
        return object.__getattribute__(self, name)

    def _dev(self, name: str) -> torch.Tensor:
        """Index arrays reach the device only when a torch path needs them."""
        if name not in self._on_device:
            self._on_device[name] = torch.from_numpy(getattr(self, name + "_np")).to(self._device)
        return self._on_device[name]

    pages = property(lambda self: self._dev("pages"))
    flat = property(lambda self: self._dev("flat"))
    page = property(lambda self: self._dev("page"))
    offset = property(lambda self: self._dev("offset"))


class CopyThreads:
    """Threads that take a share of a host scatter's buffers beside the caller's own:
    numpy's copies and the native span copies release the GIL, so the scatter runs on
    ``threads`` cores. Worth it only where a core is free (``destination.scatter_threads``)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvstage-scatter")

    def run(self, place, items: list) -> None:
        """``place(*item)`` for every item, items dealt round-robin; the caller's share first."""
        shares = [items[k :: self.threads] for k in range(self.threads)]

        def place_all(share: list) -> None:
            for x in share:
                place(*x)

        others = [self._pool.submit(place_all, share) for share in shares[1:] if share]
        try:
            for x in shares[0]:
                place(*x)
        finally:
            for f in others:
                f.result()  # re-raises a failed share's error, after every share has stopped

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# -- the verbs, on the copier the cache chose ------------------------------------------------
def gather(cache: RankCache, idx: TokenIndex, pieces: Sequence[RegionPiece], region: torch.Tensor, sums=None) -> None:
    """Copy every piece of the indexed tokens from the cache into ``region`` (and sum them into ``sums``,
    a ``checksum.ChunkSums``)."""
    cache.copier.gather(idx, pieces, region, sums)


def scatter_chunk(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor, threads=None, sums=None) -> None:
    """Copy every piece (``RegionPiece``) from ``region`` into the indexed tokens of the cache (and sum the
    region's pieces); ``threads``: a ``CopyThreads`` that may share a host scatter."""
    cache.copier.scatter_chunk(idx, pieces, region, threads, sums)


def prepare_scatter(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor, threads=None, sums=None):
    """``scatter_chunk`` made ready when the chunk is granted: a callable that runs it."""
    return cache.copier.prepare_scatter(idx, pieces, region, threads, sums)


def prepare_piece_scatters(
    cache: RankCache, idx: TokenIndex, pieces: Sequence[RegionPiece], region: torch.Tensor
) -> list | None:
    """One prepared scatter per piece, or None where a chunk's pieces scatter in one pass."""
    return cache.copier.prepare_piece_scatters(idx, pieces, region)
