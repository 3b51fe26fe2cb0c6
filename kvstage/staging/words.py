"""Where each word of a staging region lives in a rank's KV buffers.

A region holds pieces (``staging.region``): some local heads of some (layer,
plane) buffers, in one of two orders. Every buffer of a rank has the same
shape, so one index map serves all of a piece's buffers. The CUDA kernel
(``cuda_copy``) computes the map word by word from the chunk's page ids and the
piece table alone, so the host uploads a request's page ids once instead of a
copy list per chunk; ``word_index`` computes the same map with numpy, the same
arithmetic, so the addressing is tested on machines without a GPU.
``place_index`` does the same for the kernel that reads a source rank's pages
into a destination's (``cuda_ipc``), with no region between, dividing by its
run-time divisors with a multiply and a shift (``divider``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstage.layout import token_major
from kvstage.staging.checksum import segment_count
from kvstage.staging.region import Order, RegionPiece
from kvstage.tp import SideSpec


@dataclass(frozen=True)
class WordGeometry:
    """One rank's buffer shape in words: ``page_size`` tokens per page, ``heads``
    local heads of ``head_words`` words; head-major pages (``hnd``) or token-major."""

    page_size: int
    heads: int
    head_words: int
    hnd: bool
    word: int

    @staticmethod
    def of(spec: SideSpec, word: int = 16) -> WordGeometry | None:
        """The geometry in ``word``-byte words, or None when a head is not a whole number of them."""
        g = spec.geometry
        hb = g.head_bytes()
        if hb % word:
            return None
        heads = 1 if g.mla else spec.local_heads()
        return WordGeometry(spec.page.page_size, heads, hb // word, not token_major(g, spec.page), word)

    @staticmethod
    def exact(spec: SideSpec, word: int = 16) -> WordGeometry:
        """``of`` for a side whose heads are whole words (checked before: ``ipc_read.refusal``, the copier
        rule); ValueError naming the head size otherwise."""
        geometry = WordGeometry.of(spec, word)
        if geometry is None:
            raise ValueError(f"a head of {spec.geometry.head_bytes()} bytes is not a whole number of {word}-byte words")
        return geometry


def chunk_pages(page_ids: np.ndarray, page_size: int, start: int, count: int) -> tuple[np.ndarray, int]:
    """The pages holding tokens ``start .. start+count`` and the first token's offset in the first."""
    first_page = start // page_size
    last_page = (start + count - 1) // page_size
    return np.asarray(page_ids[first_page : last_page + 1], dtype=np.int64), start % page_size


#: int64 fields per piece in the kernel's piece table (``piece_table``; ``META`` in the kernel source)
META = 9
#: how the piece table names each order (the kernel's ``by_token`` flag)
ORDER_CODES = {Order.HEADS: 0, Order.TOKENS: 1}


def piece_table(pieces) -> np.ndarray:
    """The kernel's piece table: ``META`` int64 per piece, (head_lo, heads, buffer_lo, nbuffers,
    order code, rows or 0 for the chunk's count, row_first, byte offset, its first checksum
    segment: the segments of the pieces before it, ``staging.checksum.segments``)."""
    rows, first = [], 0
    for p in pieces:
        rows.append(
            (
                p.head_lo,
                p.heads,
                p.buffers.start,
                len(p.buffers),
                ORDER_CODES[p.order],
                p.rows or 0,
                p.row_first,
                p.offset,
                first,
            )
        )
        first += segment_count(p)
    return np.array(rows, dtype=np.int64).reshape(-1)


def word_index(
    wg: WordGeometry, pages: np.ndarray, first: int, count: int, piece: RegionPiece
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each word the kernel moves for ``piece`` (block row ``bi`` of its buffers, then
    word ``i`` of that buffer's ``count * heads * head_words``), the buffer it is in, its
    index in the region and its index in that buffer; mirrors the kernel line by line,
    reading the piece from its row of the piece table as the kernel does."""
    head_lo, heads, buffer_lo, nbuffers, by_token, rows, row_first, offset, _ = (int(v) for v in piece_table([piece]))
    rows = rows if rows else count
    hw = wg.head_words
    per_head, per_token = count * hw, heads * hw
    bi = np.repeat(np.arange(nbuffers, dtype=np.int64), count * per_token)
    i = np.tile(np.arange(count * per_token, dtype=np.int64), nbuffers)
    if by_token:  # i walks [count][heads][words]
        t = i // per_token
        r = i - t * per_token
        j = r // hw
        w = r - j * hw
        in_region = ((bi * rows + row_first + t) * heads + j) * hw + w
    else:  # i walks [heads][count][words]: the region's rows in order
        j = i // per_head
        r = i - j * per_head
        t = r // hw
        w = r - t * hw
        in_region = ((j * nbuffers + bi) * rows + row_first + t) * hw + w
    u = first + t
    q = u // wg.page_size
    off = u - q * wg.page_size
    page = np.asarray(pages, dtype=np.int64)[q]
    h = head_lo + j
    return buffer_lo + bi, offset // wg.word + in_region, _slot(wg, page, off, h, w)


def divider(d: int) -> tuple[int, int]:
    """(multiplier, shift) with which a kernel divides an unsigned 32-bit ``n`` by ``d``
    without a division instruction: ``(umulhi(n, multiplier) + n) >> shift``, the sum taken
    in 64 bits (Granlund and Montgomery's method for invariant divisors)."""
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or not 1 <= d < 2**31:
        raise ValueError(f"divisor {d!r}: must be an integer in [1, 2**31)")
    d = int(d)
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def divide(n: np.ndarray, multiplier: int, shift: int) -> np.ndarray:
    """``n // d`` the way the kernel computes it from ``divider(d)``: exact for n < 2**32."""
    n = np.asarray(n, dtype=np.uint64)
    return ((((n * np.uint64(multiplier)) >> np.uint64(32)) + n) >> np.uint64(shift)).astype(np.int64)


def place_index(
    src: WordGeometry,
    dst: WordGeometry,
    src_pages: np.ndarray,
    src_first: int,
    dst_pages: np.ndarray,
    dst_first: int,
    count: int,
    src_lo: int,
    dst_lo: int,
    heads: int,
) -> tuple[np.ndarray, np.ndarray]:
    """For each word of one buffer's part of a page-to-page copy (``count * heads * head_words``
    words, token by token, head by head), its index in the source's KV buffer and in the
    destination's: source head ``src_lo + j`` of token ``src_first + t`` of ``src_pages``
    goes to destination head ``dst_lo + j`` of token ``dst_first + t`` of ``dst_pages``
    (each side's pages from the one holding its first token). Mirrors the read kernel
    (``cuda_ipc``) line by line, its divisions included."""
    if src.head_words != dst.head_words:
        raise ValueError(f"head_words differ: source {src.head_words}, destination {dst.head_words}")
    hw = src.head_words
    i = np.arange(count * heads * hw, dtype=np.int64)
    row = divide(i, *divider(hw))
    w = i - row * hw
    t = divide(row, *divider(heads))
    j = row - t * heads
    us, ud = src_first + t, dst_first + t
    qs, qd = divide(us, *divider(src.page_size)), divide(ud, *divider(dst.page_size))
    return (
        _slot(src, np.asarray(src_pages, dtype=np.int64)[qs], us - qs * src.page_size, src_lo + j, w),
        _slot(dst, np.asarray(dst_pages, dtype=np.int64)[qd], ud - qd * dst.page_size, dst_lo + j, w),
    )


def _slot(wg: WordGeometry, page: np.ndarray, off: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Index in a KV buffer of word ``w`` of local head ``h`` of the token at (``page``, ``off``)."""
    if wg.hnd:
        return ((page * wg.heads + h) * wg.page_size + off) * wg.head_words + w
    return ((page * wg.page_size + off) * wg.heads + h) * wg.head_words + w
