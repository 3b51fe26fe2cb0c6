"""Where each word of a staging region lives in a rank's KV buffers.

A region holds, for ``count`` tokens and ``heads`` heads, the bytes of every
(layer, plane) buffer: ``[buffers, count, heads, head_bytes]``. Every buffer
of a rank has the same shape, so one index map serves all of them. The CUDA
kernel (``cuda_copy``) computes the map word by word from the chunk's page ids
alone, so the host uploads a request's page ids once instead of a copy list
per chunk; ``word_index`` computes the same map with numpy, the same
arithmetic, so the addressing is tested on machines without a GPU.
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
