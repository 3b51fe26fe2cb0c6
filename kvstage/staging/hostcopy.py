"""Host copies of many byte spans in one native call, with streaming stores.

numpy and torch copy a few-KiB row with ordinary stores, which first read every
destination line they write; streaming stores skip that read, so a host copy
costs less memory traffic and CPU.
``_spans.c`` is built with the package (a C library loaded with ctypes; ctypes
releases the GIL for the call); where it was not built, ``available()`` says
why and ``staging.copier.choose_copier`` gives a host cache the torch copier.

Every span is checked here against the buffers it reads and writes before the
native call: the C side trusts its arguments.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstage.native import load as load_native

_I64 = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
_U64 = np.ctypeslib.ndpointer(dtype=np.uint64, flags="C_CONTIGUOUS")
_U32 = np.ctypeslib.ndpointer(dtype=np.uint32, flags="C_CONTIGUOUS")
_lib: ctypes.CDLL | None = None
_why_not = ""


def _load() -> None:
    global _lib, _why_not
    if _lib is not None or _why_not:
        return
    lib, _why_not = load_native("kvstage.staging._spans")
    if lib is None:
        return
    # every span call's leading arguments: both sides' buffer bases and count, the spans' offsets, lengths, count
    spans: list[Any] = [_U64, _U64, ctypes.c_size_t, _I64, _I64, _I64, ctypes.c_size_t]
    lib.kvstage_copy_spans.restype = None
    lib.kvstage_copy_spans.argtypes = [*spans, ctypes.c_int]
    lib.kvstage_copy_spans_sum.restype = None
    lib.kvstage_copy_spans_sum.argtypes = [*spans, ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t, _U32]
    lib.kvstage_sum_spans.restype = None
    lib.kvstage_sum_spans.argtypes = [*spans, ctypes.c_uint64, ctypes.c_size_t, _U32]
    lib.kvstage_checksum_segments.restype = None
    lib.kvstage_checksum_segments.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, _U32]
    _lib = lib


def available() -> bool:
    _load()
    return _lib is not None


def why_unavailable() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    _load()
    return _why_not


@dataclass(frozen=True)
class SpanSums:
    """Where a span copy adds its checksum terms (``staging.checksum``): the region side (the copy's
    destination for a gather, its source for a scatter) is cut into ``seg_bytes`` segments from address
    ``origin``; ``sums`` (uint32, zeroed by the caller) takes one sum per segment. The spans must lie in
    those segments: the caller's piece."""

    region_is_dst: bool
    origin: int
    seg_bytes: int
    sums: np.ndarray


class SpanCopy:
    """The same spans copied in each of several (destination, source) buffer pairs.

    ``dst_off``, ``src_off``, ``lengths``: byte offsets of each span in the
    destination and the source buffer, and its length, in copy order. The spans
    are checked here once; each buffer's size on every ``run``."""

    def __init__(self, dst_off: np.ndarray, src_off: np.ndarray, lengths: np.ndarray, streaming: bool = True):
        if not available():
            raise RuntimeError(f"native span copies are unavailable: {_why_not}")
        self.dst_off, self.src_off, self.lengths = (
            np.ascontiguousarray(a, dtype=np.int64) for a in (dst_off, src_off, lengths)
        )
        if not (len(self.dst_off) == len(self.src_off) == len(self.lengths)):
            raise ValueError(
                f"spans: {len(self.dst_off)} destination offsets, {len(self.src_off)} source "
                f"offsets, {len(self.lengths)} lengths; they must be as many"
            )
        n = len(self.lengths)
        if n and (self.lengths.min() < 1 or self.dst_off.min() < 0 or self.src_off.min() < 0):
            raise ValueError("spans: offsets must be >= 0 and lengths >= 1")
        self.dst_end = int((self.dst_off + self.lengths).max()) if n else 0
        self.src_end = int((self.src_off + self.lengths).max()) if n else 0
        self.streaming = streaming

    @property
    def nbytes(self) -> int:
        """Bytes copied per buffer pair."""
        return int(self.lengths.sum())

    def run(
        self, dst: Sequence[tuple[int, int]], src: Sequence[tuple[int, int]], checksum: SpanSums | None = None
    ) -> None:
        """Copy the spans from each ``src[b]`` to ``dst[b]``, given as (address, bytes there); with
        ``checksum``, add every copied word's checksum term to its segment's sum as it goes."""
        if len(dst) != len(src):
            raise ValueError(f"{len(dst)} destination buffers, {len(src)} source buffers")
        if not dst or not len(self.lengths):
            return
        d = _buffers(dst, self.dst_end, "destination")
        s = _buffers(src, self.src_end, "source")
        spans = (
            np.ascontiguousarray(d[:, 0]),
            np.ascontiguousarray(s[:, 0]),
            len(d),
            self.dst_off,
            self.src_off,
            self.lengths,
            len(self.lengths),
            int(self.streaming),
        )
        if checksum is None:
            _library().kvstage_copy_spans(*spans)
        else:
            c = checksum
            _library().kvstage_copy_spans_sum(*spans, int(c.region_is_dst), c.origin, c.seg_bytes, c.sums)

    def sum_only(self, at: Sequence[int], src: Sequence[tuple[int, int]], checksum: SpanSums) -> None:
        """``run``'s checksum with no copy: each span is read from ``src[b]`` (address, bytes there) and
        summed as if copied to ``at[b]`` plus its destination offset, a place in ``checksum``'s segments
        that is never written (``checksum.region_is_dst`` is ignored)."""
        if len(at) != len(src):
            raise ValueError(f"{len(at)} region places, {len(src)} source buffers")
        if not src or not len(self.lengths):
            return
        s = _buffers(src, self.src_end, "source")
        a = np.array(at, dtype=np.uint64)
        lo, hi = int(a.min()) + int(self.dst_off.min()), int(a.max()) + self.dst_end
        if lo < checksum.origin or hi - checksum.origin > checksum.seg_bytes * len(checksum.sums):
            raise IndexError(
                f"the spans lie at {lo}..{hi}; the sums' {len(checksum.sums)} segments of {checksum.seg_bytes} bytes "
                f"cover {checksum.origin}..{checksum.origin + checksum.seg_bytes * len(checksum.sums)}"
            )
        if checksum.seg_bytes % 4 or checksum.sums.dtype != np.uint32:
            raise ValueError(
                f"segments of {checksum.seg_bytes} bytes into {checksum.sums.dtype}: need whole words, uint32"
            )
        _library().kvstage_sum_spans(
            a,
            np.ascontiguousarray(s[:, 0]),
            len(s),
            self.dst_off,
            self.src_off,
            self.lengths,
            len(self.lengths),
            checksum.origin,
            checksum.seg_bytes,
            checksum.sums,
        )


def _buffers(buffers: Sequence[tuple[int, int]], end: int, side: str) -> np.ndarray:
    """``buffers`` as (address, bytes) rows, each checked to hold the spans' ``end`` bytes: the C side
    trusts its arguments."""
    rows = np.array(buffers, dtype=np.uint64).reshape(-1, 2)
    if rows[:, 1].min() < end:
        b = int(np.argmin(rows[:, 1]))
        raise IndexError(f"{side} buffer {b} holds {int(rows[b, 1])} bytes; the spans reach {end}")
    return rows


def _library() -> ctypes.CDLL:
    """The loaded library, or why it is not."""
    if _lib is None:
        raise RuntimeError(f"native span copies are not loaded: {_why_not or 'available() was not asked'}")
    return _lib


def checksum_segments(address: int, nseg: int, seg_bytes: int, out: np.ndarray) -> None:
    """``staging.checksum``'s sums of ``nseg`` segments of ``seg_bytes`` bytes from host ``address``
    into ``out`` (uint32, ``nseg``), in one native call; the caller checks the bytes are its own."""
    lib = _library()
    if seg_bytes % 4 or len(out) != nseg or out.dtype != np.uint32:
        raise ValueError(
            f"{nseg} segments of {seg_bytes} bytes into {len(out)} {out.dtype}: need uint32, bytes % 4 == 0"
        )
    lib.kvstage_checksum_segments(address, nseg, seg_bytes, out)
