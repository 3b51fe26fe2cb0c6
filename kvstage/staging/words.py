"""Where each word of a staging region lives in a rank's KV buffers.

A region holds, for ``count`` tokens and ``heads`` heads, the bytes of every
(layer, plane) buffer: ``[buffers, count, heads, head_bytes]``. Every buffer
of a rank has the same shape, so one index map serves all of them. The CUDA
kernel (``cuda_copy``) computes the map word by word from the chunk's page ids
alone, so the host uploads a request's page ids once instead of a copy list
per chunk; ``word_index`` computes the same map with numpy, the same
arithmetic, so the addressing is tested on machines without a GPU.
``place_index`` does the same for the direct page-write kernel (``cuda_place``),
which copies from one rank's pages into another's with no region between and
divides by its run-time divisors with a multiply and a shift (``divider``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstage.layout import token_major
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
    def of(spec: SideSpec, word: int = 16) -> "WordGeometry | None":
        """The geometry in ``word``-byte words, or None when a head is not a whole number of them."""
        g = spec.geometry
        hb = g.head_bytes()
        if hb % word:
            return None
        heads = 1 if g.mla else spec.local_heads()
        return WordGeometry(spec.page.page_size, heads, hb // word, not token_major(g, spec.page), word)


def chunk_pages(page_ids: np.ndarray, page_size: int, start: int, count: int) -> tuple[np.ndarray, int]:
    """The pages holding tokens ``start .. start+count`` and the first token's offset in the first."""
    first_page = start // page_size
    last_page = (start + count - 1) // page_size
    return np.asarray(page_ids[first_page : last_page + 1], dtype=np.int64), start % page_size


def word_index(wg: WordGeometry, pages: np.ndarray, first: int, count: int, head_lo: int, heads: int) -> np.ndarray:
    """For each word of one buffer's part of a region (``count * heads * head_words``
    words), the index of the word in the KV buffer; mirrors the kernel line by line."""
    i = np.arange(count * heads * wg.head_words, dtype=np.int64)
    per_token = heads * wg.head_words
    t, r = i // per_token, i % per_token
    j, w = r // wg.head_words, r % wg.head_words
    u = first + t
    page, off = pages[u // wg.page_size], u % wg.page_size
    h = head_lo + j
    if wg.hnd:
        return ((page * wg.heads + h) * wg.page_size + off) * wg.head_words + w
    return ((page * wg.page_size + off) * wg.heads + h) * wg.head_words + w


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


def place_index(src: WordGeometry, dst: WordGeometry, src_pages: np.ndarray, src_first: int, dst_pages: np.ndarray,
                dst_first: int, count: int, src_lo: int, dst_lo: int, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """For each word of one buffer's part of a direct write (``count * heads * head_words``
    words, token by token, head by head), its index in the source's KV buffer and in the
    destination's: source head ``src_lo + j`` of token ``src_first + t`` of ``src_pages``
    goes to destination head ``dst_lo + j`` of token ``dst_first + t`` of ``dst_pages``.
    Mirrors the direct-write kernel (``cuda_place``) line by line, its divisions included."""
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
    return (_slot(src, np.asarray(src_pages, dtype=np.int64)[qs], us - qs * src.page_size, src_lo + j, w),
            _slot(dst, np.asarray(dst_pages, dtype=np.int64)[qd], ud - qd * dst.page_size, dst_lo + j, w))


def _slot(wg: WordGeometry, page: np.ndarray, off: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Index in a KV buffer of word ``w`` of local head ``h`` of the token at (``page``, ``off``)."""
    if wg.hnd:
        return ((page * wg.heads + h) * wg.page_size + off) * wg.head_words + w
    return ((page * wg.page_size + off) * wg.heads + h) * wg.head_words + w
