"""Where a chunk's head slice sits in a rank's own pages, as byte spans.

A transport that walks many spans at the cost of one (``Transport.gathers``)
writes a chunk straight from the pages with these, instead of a gather into
the arena first. The spans come in a region's order, ``[buffers, count, heads,
head_dim]`` (``staging.copier``), so the bytes land exactly as a gather would
have laid them out; spans that touch in memory are merged.
"""

from __future__ import annotations

import numpy as np

from kvstage.layout import element_offsets, token_major, token_positions
from kvstage.staging.cache import RankCache


def buffer_spans(cache: RankCache, page_ids: np.ndarray, start: int, count: int, head_lo: int,
                 heads: int) -> tuple[np.ndarray, np.ndarray]:
    """``(byte offset, length)`` of every span of one buffer holding local heads
    ``[head_lo, head_lo+heads)`` of tokens ``start .. start+count`` of a request on
    ``page_ids``, in a region's order; every buffer of the cache has the same."""
    spec = cache.spec
    geo, page = spec.geometry, spec.page
    local = 1 if geo.mla else spec.local_heads()
    if head_lo < 0 or heads < 1 or head_lo + heads > local:
        raise ValueError(f"heads {head_lo}..{head_lo + heads}: this rank holds {local}")
    pid, off = token_positions(page_ids, page.page_size, start, count)
    hb = geo.head_bytes()
    if token_major(geo, page):  # a token's heads are one run
        offsets = element_offsets(geo, page, local, pid, off, head_lo) * geo.itemsize
        lengths = np.full(count, heads * hb, dtype=np.int64)
    else:  # HND: one run per (token, head), token-major like the region
        offsets = np.stack([element_offsets(geo, page, local, pid, off, head_lo + j) for j in range(heads)], axis=1)
        offsets = offsets.reshape(-1) * geo.itemsize
        lengths = np.full(len(offsets), hb, dtype=np.int64)
    if not len(offsets):
        return offsets, lengths
    new = np.ones(len(offsets), dtype=bool)
    new[1:] = offsets[1:] != offsets[:-1] + lengths[:-1]
    first = np.flatnonzero(new)
    return offsets[first], np.add.reduceat(lengths, first)


def chunk_spans(cache: RankCache, page_ids: np.ndarray, start: int, count: int, head_lo: int,
                heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(buffer index, byte offset in the buffer, length)`` of every span holding local heads
    ``[head_lo, head_lo+heads)`` of tokens ``start .. start+count`` of a request on ``page_ids``."""
    offsets, lengths = buffer_spans(cache, page_ids, start, count, head_lo, heads)
    n = cache.spec.geometry.buffers
    return np.repeat(np.arange(n, dtype=np.int64), len(offsets)), np.tile(offsets, n), np.tile(lengths, n)
