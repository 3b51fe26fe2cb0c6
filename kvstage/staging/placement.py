"""Where a source rank's head slices land in a destination rank's pages: the pure half
of the direct page write (``cuda_place`` is the kernel, ``shared_buffers`` maps the pages).

On one host a source can store each head slice of a chunk straight into the
destination's KV pages, converting page size and NHD/HND on the way, with no
staging region between. The destination names its pages in each grant, so the
source checks them before any launch (``check_write``): a hostile or buggy grant
must never steer the kernel outside the destination's buffers. ``byte_offsets``
is the kernel's addressing in numpy (``words.place_index``), so the CPU suite
tests it byte for byte.
"""

from __future__ import annotations

import numpy as np

from kvstage.errors import IncompatibleGeometry, ProtocolError
from kvstage.layout import buffer_shape, pages_needed
from kvstage.staging.words import WordGeometry, chunk_pages, place_index
from kvstage.tp import Piece, SideSpec, check_pair

#: bytes the kernel moves per load and store
WORD = 16
#: a piece's words in one buffer are indexed in 32 bits on the device
MAX_PIECE_WORDS = 2**31 - 1


def refusal(src: SideSpec, dst: SideSpec) -> str | None:
    """Why direct page writes cannot copy between these two sides, or None: the sides must
    pair (``tp.check_pair``) and a head must be a whole number of 16-byte words."""
    try:
        check_pair(src, dst)
    except IncompatibleGeometry as e:
        return str(e)
    if WordGeometry.of(src, WORD) is None:
        g = src.geometry
        return (f"a head is {g.head_bytes()} bytes (head_dim={g.head_dim} of {g.dtype}), not a whole number of "
                f"{WORD}-byte words: direct page writes move {WORD}-byte words (the staged path moves any size)")
    return None


def page_bytes(spec: SideSpec) -> int:
    """Bytes of one page of one of a rank's buffers."""
    g = spec.geometry
    return int(np.prod(buffer_shape(g, spec.page, spec.local_heads(), 1))) * g.itemsize


def chunk_span(page_size: int, start: int, count: int) -> tuple[int, int]:
    """(offset of token ``start`` in its page, pages holding tokens ``start .. start+count``)."""
    first = start % page_size
    return first, pages_needed(first + count, page_size)


def buffer_pages(spec: SideSpec, spans) -> int:
    """The pages each buffer of a rank of ``spec`` holds, given its buffers as (address,
    bytes) pairs: one per (layer, plane), all the same size, a whole number of pages, on
    16-byte boundaries. Raises ``ValueError`` naming the first that is not."""
    spans = list(spans)
    g = spec.geometry
    if len(spans) != g.buffers:
        raise ValueError(f"{len(spans)} buffers; need layers*planes = {g.layers}*{g.planes} = {g.buffers}")
    per_page = page_bytes(spec)
    sizes = {nbytes for _, nbytes in spans}
    nbytes = spans[0][1]
    if len(sizes) != 1 or nbytes % per_page or nbytes < per_page:
        raise ValueError(f"buffer sizes {sorted(sizes)[:4]} bytes: every buffer must hold the same whole number of "
                         f"{per_page}-byte pages")
    for i, (address, _) in enumerate(spans):
        if address % WORD:
            raise ValueError(f"buffer {i} at {address:#x} is not on a {WORD}-byte boundary")
    return nbytes // per_page


def check_piece(src: SideSpec, dst: SideSpec, piece: Piece) -> None:
    """``piece``'s heads lie inside both ranks' shards. Raises ``ValueError`` otherwise."""
    heads = piece.heads.count
    if heads < 1 or piece.src_offset < 0 or piece.dst_offset < 0:
        raise ValueError(f"piece {piece}: heads and offsets must be positive")
    for side, offset, spec in (("source", piece.src_offset, src), ("destination", piece.dst_offset, dst)):
        if offset + heads > spec.local_heads():
            raise ValueError(f"piece {piece}: {side} heads {offset}..{offset + heads} past its "
                             f"{spec.local_heads()} local heads")


def check_write(dst: SideSpec, dst_page_ids, dst_pages: int, start: int, count: int, heads: int) -> np.ndarray:
    """A grant's destination page ids for tokens ``start .. start+count``, checked before
    any launch: as many as pages those tokens span at the destination's page size, each in
    ``[0, dst_pages)``, and the piece's words within 32-bit indices. Returns them as int64.
    Raises ``ProtocolError`` naming what is wrong."""
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (start, count)):
        raise ProtocolError(f"tokens start={start!r} count={count!r}: must be integers")
    if start < 0 or count < 1:
        raise ProtocolError(f"tokens start={start} count={count}: start must be >= 0 and count >= 1")
    try:
        ids = np.asarray(dst_page_ids)
    except (ValueError, TypeError, OverflowError):
        ids = None
    if ids is None or ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ProtocolError("destination page ids must be a list of integers")
    _, span = chunk_span(dst.page.page_size, start, count)
    if len(ids) != span:
        raise ProtocolError(f"{len(ids)} destination page ids for tokens {start}..{start + count}; "
                            f"they span {span} pages of {dst.page.page_size}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= dst_pages:
        raise ProtocolError(f"destination page ids must lie in [0, {dst_pages}); got {lo}..{hi}")
    words = count * heads * (dst.geometry.head_bytes() // WORD)
    if words > MAX_PIECE_WORDS:
        raise ProtocolError(f"{count} tokens of {heads} heads are {words} words, past the kernel's 32-bit index")
    return ids.astype(np.int64, copy=False)


def byte_offsets(src: SideSpec, dst: SideSpec, piece: Piece, src_page_ids, dst_page_ids, start: int,
                 count: int, dst_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every 16-byte word of a direct write of ``piece``, tokens ``start .. start+count``,
    from the source's request pages ``src_page_ids`` into the destination's chunk pages
    ``dst_page_ids`` (a grant's, checked by ``check_write``): its buffer, its byte offset in
    the source's buffer and in the destination's. The kernel's arithmetic, word for word."""
    why = refusal(src, dst)
    if why:
        raise ValueError(why)
    check_piece(src, dst, piece)
    heads = piece.heads.count
    dst_ids = check_write(dst, dst_page_ids, dst_pages, start, count, heads)
    sg, dg = WordGeometry.of(src, WORD), WordGeometry.of(dst, WORD)
    src_ids, src_first = chunk_pages(np.asarray(src_page_ids), src.page.page_size, start, count)
    dst_first, _ = chunk_span(dst.page.page_size, start, count)
    s, d = place_index(sg, dg, src_ids, src_first, dst_ids, dst_first, count, piece.src_offset, piece.dst_offset, heads)
    n = src.geometry.buffers
    buffer = np.repeat(np.arange(n, dtype=np.int64), len(s))
    return buffer, np.tile(s * WORD, n), np.tile(d * WORD, n)
