"""KV geometry and addressing: how one rank's KV cache sits in memory.

Pure: no I/O, no device work. Every other layer asks this module for shapes,
sizes and element offsets instead of re-deriving them.

A rank's cache is a list of buffers, one per (layer, plane), where the planes
are K and V (MHA/GQA) or the single latent plane (MLA). Each buffer is paged:

- ``nhd``: ``[pages, page_size, heads, head_dim]``
- ``hnd``: ``[pages, heads, page_size, head_dim]``
- MLA:    ``[pages, page_size, latent_dim]`` (stored as ``nhd`` with one head)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstage.errors import ConfigError

#: Supported dtypes and their size in bytes. Transfers are byte copies, so any
#: dtype of a known size works; the name must still match on both sides.
DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

ORDERS = ("nhd", "hnd")


def _positive(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{field}={value!r}: must be a positive integer")


@dataclass(frozen=True)
class KVGeometry:
    """Model-level KV shape, identical on both sides of a transfer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    mla: bool = False

    def __post_init__(self) -> None:
        _positive("layers", self.layers)
        _positive("kv_heads", self.kv_heads)
        _positive("head_dim", self.head_dim)
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPE_SIZES)}")
        if self.mla and self.kv_heads != 1:
            raise ConfigError(
                f"kv_heads={self.kv_heads} with mla=True: MLA keeps one latent "
                "vector per token, so kv_heads must be 1 (head_dim is the latent dim)"
            )

    @property
    def planes(self) -> int:
        """Buffers per layer: K and V, or the one MLA latent."""
        return 1 if self.mla else 2

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def buffers(self) -> int:
        return self.layers * self.planes

    def head_bytes(self) -> int:
        """Bytes of one head of one token in one buffer."""
        return self.head_dim * self.itemsize


@dataclass(frozen=True)
class PageLayout:
    """How tokens are paged in one side's buffers."""

    page_size: int
    order: str = "nhd"

    def __post_init__(self) -> None:
        _positive("page_size", self.page_size)
        if self.order not in ORDERS:
            raise ConfigError(f"order={self.order!r}: must be one of {', '.join(ORDERS)}")


def token_major(geo: KVGeometry, page: PageLayout) -> bool:
    """Whether a buffer keeps each token's heads together (NHD, and MLA's one
    latent head): then a token's heads are one contiguous run."""
    return geo.mla or page.order == "nhd"


def buffer_shape(geo: KVGeometry, page: PageLayout, heads: int, pages: int) -> tuple[int, ...]:
    """Shape of one (layer, plane) buffer holding ``heads`` local heads."""
    if geo.mla:
        return (pages, page.page_size, geo.head_dim)
    if page.order == "nhd":
        return (pages, page.page_size, heads, geo.head_dim)
    return (pages, heads, page.page_size, geo.head_dim)


def token_bytes(geo: KVGeometry, heads: int) -> int:
    """Bytes of one token over all layers and planes for ``heads`` heads."""
    return geo.buffers * heads * geo.head_bytes()


def pages_needed(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def token_positions(page_ids: np.ndarray, page_size: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(page id, offset in page) of tokens ``start .. start+count`` of a request
    whose pages are ``page_ids`` in order."""
    t = np.arange(start, start + count, dtype=np.int64)
    return np.asarray(page_ids, dtype=np.int64)[t // page_size], t % page_size


def element_offsets(
    geo: KVGeometry, page: PageLayout, heads: int, page_ids: np.ndarray, offsets: np.ndarray, head: int | np.ndarray
) -> np.ndarray:
    """Element offset, inside one buffer, of ``head`` of each token given by
    (page id, offset in page). The ``head_dim`` elements from there are contiguous."""
    p = np.asarray(page_ids, dtype=np.int64)
    o = np.asarray(offsets, dtype=np.int64)
    if token_major(geo, page):
        return ((p * page.page_size + o) * heads + head) * geo.head_dim
    return ((p * heads + head) * page.page_size + o) * geo.head_dim
