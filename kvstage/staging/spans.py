"""Where a piece of a chunk (``staging.region.RegionPiece``) sits in a rank's pages, as
byte spans.

A reader that copies a piece straight from another rank's pages (one span list
per chunk, no gather on the far side) computes them from that rank's spec and page
ids alone, with ``piece_spans``: the spans come in the region's order, so the bytes
land exactly as a gather would have laid them out, and spans contiguous in both
the pages and the region are merged. ``cheapest_order`` picks the piece order
that gives a page layout the fewest spans. The native copier
(``copier_native``) copies a host cache's chunks through the same spans.
"""

from __future__ import annotations

import numpy as np

from kvstage.layout import element_offsets, token_major, token_positions
from kvstage.staging.region import Order, RegionPiece, check_pieces
from kvstage.tp import SideSpec


def _merged(at_buffer: np.ndarray, at_region: np.ndarray, length: int):
    """Spans of ``length`` bytes in copy order, each run contiguous on both sides merged into one."""
    lengths = np.full(len(at_buffer), length, dtype=np.int64)
    if not len(at_buffer):
        return at_buffer, at_region, lengths
    new = np.ones(len(at_buffer), dtype=bool)
    new[1:] = (at_buffer[1:] != at_buffer[:-1] + length) | (at_region[1:] != at_region[:-1] + length)
    first = np.flatnonzero(new)
    return at_buffer[first], at_region[first], np.add.reduceat(lengths, first)


def spans_per_buffer(
    spec: SideSpec, page_ids, start: int, count: int, piece: RegionPiece
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(byte offset inside the buffer, byte offset inside the region, length)`` of every span
    of ``piece``'s first buffer, in region order, merged; every buffer of a rank has the same
    spans, each later buffer's region offsets ``piece.buffer_stride`` further on. The piece
    is taken as checked (``piece_spans`` checks it)."""
    geo, page = spec.geometry, spec.page
    local = 1 if geo.mla else spec.local_heads()
    hb = geo.head_bytes()
    pid, off = token_positions(page_ids, page.page_size, start, count)
    t = np.arange(count, dtype=np.int64)[:, None]
    j = np.arange(piece.heads, dtype=np.int64)[None, :]
    at_buffer = element_offsets(geo, page, local, pid[:, None], off[:, None], piece.head_lo + j) * geo.itemsize
    r = piece.row_first + t
    if piece.order is Order.TOKENS:  # [rows][heads]: token-major, as the arrays are
        at_region = piece.offset + (r * piece.heads + j) * hb
    else:  # [heads][buffers][rows]: head-major
        at_region = (piece.offset + (j * len(piece.buffers) * piece.row_tokens(count) + r) * hb).T
        at_buffer = at_buffer.T
    return _merged(at_buffer.reshape(-1), at_region.reshape(-1), hb)


def piece_spans(
    spec: SideSpec, page_ids, start: int, count: int, piece: RegionPiece
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(buffer index, byte offset inside that buffer, length, byte offset inside the region) of every span that
    holds piece's bytes of tokens start..start+count of a request on page_ids in a rank of spec, in region order,
    merging spans contiguous on both sides."""
    geo = spec.geometry
    (piece,) = check_pieces(
        [piece],
        local_heads=1 if geo.mla else spec.local_heads(),
        buffers=geo.buffers,
        head_bytes=geo.head_bytes(),
        count=count,
    )
    at_buffer, at_region, lengths = spans_per_buffer(spec, page_ids, start, count, piece)
    nb, n = len(piece.buffers), len(lengths)
    stride = piece.buffer_stride(geo.head_bytes(), count)
    index = np.repeat(np.arange(piece.buffers.start, piece.buffers.stop, dtype=np.int64), n)
    region = (np.arange(nb, dtype=np.int64) * stride)[:, None] + at_region[None, :]
    at, lens, to = np.tile(at_buffer, nb), np.tile(lengths, nb), region.reshape(-1)
    if piece.order is Order.HEADS and nb > 1:  # a head's buffers interleave with the next head's
        order = np.argsort(to, kind="stable")
        return index[order], at[order], lens[order], to[order]
    return index, at, lens, to


def cheapest_order(spec: SideSpec, heads: int) -> Order:
    """The order whose spans are fewest for that page layout (TOKENS for NHD and MLA, HEADS for HND):
    the piece's runs then follow the pages' own (a token's heads, or a head's tokens in a page).
    With one head the two orders lay out the same bytes."""
    if heads < 1:
        raise ValueError(f"heads={heads!r}: must be >= 1")
    return Order.TOKENS if token_major(spec.geometry, spec.page) else Order.HEADS
