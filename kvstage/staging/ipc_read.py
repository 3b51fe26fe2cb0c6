"""Where a destination's read of a source rank's head slices goes: the pure half of the
one-host read (``cuda_ipc`` is the kernel, ``shared_buffers`` maps the source's pages).

On one host the destination reads each source rank's head slices straight out of the
source's KV pages, shared with it over CUDA IPC at the handshake, and writes them into
its own pages, converting page size and NHD/HND on the way, with no staging region
between. A source names its pages in its ready message, so the destination checks them
before any launch (``check_pages``): a hostile or buggy message must never steer the
kernel outside the source's buffers. ``byte_offsets`` is the kernel's addressing in
numpy (``words.place_index``), so the CPU suite tests it byte for byte.
"""

from __future__ import annotations

import numpy as np

from kvstage.errors import IncompatibleGeometry, ProtocolError
from kvstage.layout import buffer_shape, pages_needed
from kvstage.staging.words import WordGeometry, place_index
from kvstage.tp import Piece, SideSpec, check_pair

#: bytes the kernel moves per load and store
WORD = 16
#: a piece's words in one buffer are indexed in 32 bits on the device
MAX_PIECE_WORDS = 2**31 - 1


def refusal(src: SideSpec, dst: SideSpec) -> str | None:
    """Why the kernel cannot copy between these two sides, or None: the sides must pair
    (``tp.check_pair``) and a head must be a whole number of 16-byte words."""
    try:
        check_pair(src, dst)
    except IncompatibleGeometry as e:
        return str(e)
    if WordGeometry.of(src, WORD) is None:
        g = src.geometry
        return (
            f"a head is {g.head_bytes()} bytes (head_dim={g.head_dim} of {g.dtype}), not a whole number of "
            f"{WORD}-byte words: reads from the source's pages move {WORD}-byte words (the staged path moves "
            "any size)"
        )
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
        raise ValueError(
            f"buffer sizes {sorted(sizes)[:4]} bytes: every buffer must hold the same whole number of "
            f"{per_page}-byte pages"
        )
    for i, (address, _) in enumerate(spans):
        if address % WORD:
            raise ValueError(f"buffer {i} at {address:#x} is not on a {WORD}-byte boundary")
    return nbytes // per_page


def check_piece(src: SideSpec, dst: SideSpec, piece: Piece) -> None:
    """``piece``'s heads lie inside both ranks' shards and its buffers are a non-empty run
    of the geometry's. Raises ``ValueError`` otherwise."""
    heads = piece.heads.count
    if heads < 1 or piece.src_offset < 0 or piece.dst_offset < 0:
        raise ValueError(f"piece {piece}: heads and offsets must be positive")
    for side, offset, spec in (("source", piece.src_offset, src), ("destination", piece.dst_offset, dst)):
        if offset + heads > spec.local_heads():
            raise ValueError(
                f"piece {piece}: {side} heads {offset}..{offset + heads} past its {spec.local_heads()} local heads"
            )
    b, n = piece.buffers, src.geometry.buffers
    if not isinstance(b, range) or b.step != 1 or not len(b) or b.start < 0 or b.stop > n:
        raise ValueError(f"piece {piece}: buffers {b!r} must be a non-empty range of step 1 inside the {n} buffers")


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _page_id_array(page_ids, what: str) -> np.ndarray:
    """``page_ids`` as a one-dimensional integer array, or ``ProtocolError``: a peer's list
    may hold anything JSON does, and numpy would quietly read a bool as 1."""
    ids = None
    if isinstance(page_ids, np.ndarray):
        ids = page_ids
    elif isinstance(page_ids, (list, tuple)):
        types = set(map(type, page_ids))
        if bool not in types and np.bool_ not in types:
            try:
                ids = np.asarray(page_ids)
            except (ValueError, TypeError, OverflowError):
                ids = None
    if ids is None or ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ProtocolError(f"{what} must be a flat list of integers")
    return ids


def check_pages(spec: SideSpec, page_ids, buffer_pages: int, start: int, count: int, what: str) -> np.ndarray:
    """The ids of the pages holding tokens ``start .. start+count`` of a request whose pages
    are ``page_ids`` (first to last), as int64; checked before any launch, since they come
    from a peer: a flat list of integers, enough of them for those tokens at ``spec``'s page
    size, each in ``[0, buffer_pages)``, and a piece of that many tokens within the kernel's
    32-bit word index. Raises ``ProtocolError`` naming ``what`` and what is wrong."""
    if not (_integer(start) and _integer(count)):
        raise ProtocolError(f"{what}: tokens start={start!r} count={count!r} must be integers")
    start, count = int(start), int(count)
    if start < 0 or count < 1:
        raise ProtocolError(f"{what}: tokens start={start} count={count}: start must be >= 0 and count >= 1")
    head_words = -(-spec.geometry.head_bytes() // WORD)
    words = count * spec.local_heads() * head_words
    if words > MAX_PIECE_WORDS:
        raise ProtocolError(
            f"{what}: {count} tokens of {spec.local_heads()} heads are {words} words, past the kernel's 32-bit index"
        )
    ids = _page_id_array(page_ids, what)
    P = spec.page.page_size
    first, last = start // P, (start + count - 1) // P
    if len(ids) <= last:
        raise ProtocolError(
            f"{what}: {len(ids)} page ids; tokens {start}..{start + count} need {last + 1} pages of {P}"
        )
    lo, hi = ids.min(), ids.max()
    if lo < 0 or hi >= buffer_pages:
        raise ProtocolError(f"{what} must lie in [0, {buffer_pages}); got {lo}..{hi}")
    return ids[first : last + 1].astype(np.int64, copy=False)


def byte_offsets(
    src: SideSpec,
    dst: SideSpec,
    piece: Piece,
    src_pages,
    src_start: int,
    dst_pages,
    dst_start: int,
    count: int,
    src_buffer_pages: int,
    dst_buffer_pages: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every 16-byte word of a read of ``piece`` (its heads of its buffers), source tokens
    ``src_start .. src_start+count`` of the source's request pages ``src_pages`` into
    destination tokens ``dst_start .. dst_start+count`` of ``dst_pages``: its buffer, its byte
    offset in the source's buffer and in the destination's, buffer by buffer in the piece's
    order. Both sides' page ids are checked first (``check_pages``). The kernel's arithmetic
    (``cuda_ipc``), word for word."""
    why = refusal(src, dst)
    if why:
        raise ValueError(why)
    check_piece(src, dst, piece)
    s_ids = check_pages(src, src_pages, src_buffer_pages, src_start, count, "source page ids")
    d_ids = check_pages(dst, dst_pages, dst_buffer_pages, dst_start, count, "destination page ids")
    sg, dg = WordGeometry.exact(src, WORD), WordGeometry.exact(dst, WORD)
    s, d = place_index(
        sg,
        dg,
        s_ids,
        src_start % sg.page_size,
        d_ids,
        dst_start % dg.page_size,
        count,
        piece.src_offset,
        piece.dst_offset,
        piece.heads.count,
    )
    b = piece.buffers
    buffer = np.repeat(np.arange(b.start, b.stop, dtype=np.int64), len(s))
    return buffer, np.tile(s * WORD, len(b)), np.tile(d * WORD, len(b))
