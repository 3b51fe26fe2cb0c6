"""The two references staged mode is measured against.

- ``bulk``: the same bytes as one contiguous write per (source, destination)
  pair: the ceiling of the link for this traffic pattern.
- ``per-slice``: one descriptor per contiguous head slice, written straight
  into the destination's KV pages with prepared descriptor lists: what engines
  did before staging.
"""

from __future__ import annotations

import numpy as np

from kvstage.layout import element_offsets, token_major, token_positions
from kvstage.tp import Piece, SideSpec
from kvstage.transports.base import Region, Spans


def slice_spans(
    piece: Piece,
    src: SideSpec,
    dst: SideSpec,
    src_pages,
    dst_pages,
    tokens: int,
    src_regions: list[Region],
    dst_regions: list[Region],
) -> tuple[Spans, Spans]:
    """One span per contiguous run of ``piece``'s heads per token and buffer, on both sides."""
    g = src.geometry
    es = g.itemsize
    sp, so = token_positions(src_pages, src.page.page_size, 0, tokens)
    dp, do = token_positions(dst_pages, dst.page.page_size, 0, tokens)
    whole = token_major(src.geometry, src.page) and token_major(dst.geometry, dst.page)
    heads = [0] if whole else list(range(piece.heads.count))
    length = (piece.heads.count if whole else 1) * g.head_dim * es
    s_off = (
        np.concatenate([element_offsets(g, src.page, src.local_heads(), sp, so, piece.src_offset + j) for j in heads])
        * es
    )
    d_off = (
        np.concatenate([element_offsets(g, dst.page, dst.local_heads(), dp, do, piece.dst_offset + j) for j in heads])
        * es
    )
    n = len(s_off)
    nbuf = g.buffers
    index = np.repeat(np.arange(nbuf), n)
    lengths = np.full(n * nbuf, length, dtype=np.int64)
    local = Spans(tuple(src_regions), index, np.tile(s_off, nbuf), lengths)
    remote = Spans(tuple(dst_regions), index, np.tile(d_off, nbuf), lengths)
    return local, remote
