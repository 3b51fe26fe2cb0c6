"""The chunk checksum: one definition, summed where a chunk's bytes are read on the
source and again where they land on the destination.

A piece of a region (``staging.region``) is cut into equal segments: one per (head,
buffer) in ``Order.HEADS`` (a head's rows of one buffer), one per buffer in
``Order.TOKENS``. Every span a destination rank reads of a source's gathered box is a
run of whole segments (``outgoing.Box.piece_span``), and its own piece in its slot has
the same segments in the same order, so the source's per-segment sums add up to what
the destination must find in its piece, whatever the TP pair.

A segment's sum, over its little-endian 32-bit words ``v[p]``, is
``sum((v[p] ^ key(p)) * (key(p) | 1)) mod 2**32`` with ``key(p) = p * MULTIPLIER +
INCREMENT mod 2**32``: for a fixed position the term is a bijection of the word, so a
single corrupted word always changes the sum, and the key makes it depend on where
each word lies. The CUDA kernel (``cuda_copy``), the native sum (``_spans.c``) and
``sums_of`` here (torch, any device; the reference) compute the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstage.staging import hostcopy
from kvstage.staging.region import Order, RegionPiece

MULTIPLIER = 0x9E3779B1
INCREMENT = 0x7F4A7C15
MASK = 0xFFFFFFFF
#: words summed per torch pass: bounds the reference's int64 temporaries to about 256 MiB
_PASS_WORDS = 1 << 23


def segment_count(piece: RegionPiece) -> int:
    """How many segments ``piece`` has: one per (head, buffer) in ``Order.HEADS``, one per buffer in
    ``Order.TOKENS``."""
    return piece.heads * len(piece.buffers) if piece.order is Order.HEADS else len(piece.buffers)


def segments(piece: RegionPiece, head_bytes: int, count: int) -> tuple[int, int]:
    """(segments, bytes of each) of ``piece`` in a region of ``count`` tokens; ValueError where
    a segment is not whole 32-bit words (a head of bytes not a multiple of 4)."""
    n = segment_count(piece)
    size = piece.nbytes(head_bytes, count) // n
    if head_bytes % 4:
        raise ValueError(f"a head of {head_bytes} bytes is not whole 32-bit words: the checksum sums words")
    return n, size


def sums_of(data: torch.Tensor, nseg: int) -> torch.Tensor:
    """The per-segment sums (int64 tensor of ``nseg``, each < 2**32) of ``data``, a contiguous
    uint8 tensor of ``nseg`` equal segments, on its own device."""
    words = data.view(torch.int32).view(nseg, -1)
    seg_words = words.shape[1]
    out = torch.zeros(nseg, dtype=torch.int64, device=data.device)
    step = max(1, _PASS_WORDS // seg_words) if seg_words <= _PASS_WORDS else 0
    if step:  # whole segments per pass
        keys = _keys(0, seg_words, data.device)
        for s in range(0, nseg, step):
            out[s : s + step] = _terms(words[s : s + step], keys).sum(dim=1)
    else:  # segments longer than a pass: a pass is part of one segment
        for s in range(nseg):
            for p in range(0, seg_words, _PASS_WORDS):
                part = words[s, p : p + _PASS_WORDS]
                out[s] += _terms(part, _keys(p, p + part.numel(), data.device)).sum()
    return out & MASK


def _keys(lo: int, hi: int, device) -> torch.Tensor:
    return (torch.arange(lo, hi, dtype=torch.int64, device=device) * MULTIPLIER + INCREMENT) & MASK


def _terms(words: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    v = words.to(torch.int64) & MASK
    return ((v ^ keys) * (keys | 1)) & MASK  # int64 wraps mod 2**64: its low 32 bits are the product's


def reference(data: bytes | np.ndarray, nseg: int = 1) -> np.ndarray:
    """``sums_of`` of host bytes, as uint32 numpy: the definition, for tests and messages."""
    t = torch.from_numpy(np.frombuffer(bytes(data), dtype=np.uint8).copy())
    return sums_of(t, nseg).numpy().astype(np.uint32)


@dataclass
class ChunkSums:
    """The per-segment sums of a chunk's pieces, in piece order: ``values`` (uint32, on the host)
    is filled by the copy that reads the bytes, valid once that copy's fence has passed;
    ``starts[k]`` is piece ``k``'s first segment."""

    starts: tuple[int, ...]
    values: np.ndarray
    device: torch.Tensor | None = None  # where a kernel adds them up (CUDA), copied into ``values``
    pinned: torch.Tensor | None = None  # the pinned host buffer ``values`` views (CUDA)

    @staticmethod
    def of(pieces: Sequence[RegionPiece], head_bytes: int, count: int) -> ChunkSums:
        starts, n = [], 0
        for p in pieces:
            segments(p, head_bytes, count)  # refuses heads that are not whole words
            starts.append(n)
            n += segment_count(p)
        return ChunkSums(tuple(starts), np.zeros(n, dtype=np.uint32))

    def piece(self, k: int) -> np.ndarray:
        end = self.starts[k + 1] if k + 1 < len(self.starts) else len(self.values)
        return self.values[self.starts[k] : end]

    def total(self, k: int, lo: int = 0, hi: int | None = None) -> int:
        """Piece ``k``'s sum over its segments ``lo .. hi`` (all of them by default)."""
        return int(self.piece(k)[lo:hi].astype(np.uint64).sum() & MASK)


def span_total(sums: ChunkSums, piece: RegionPiece, head_bytes: int, count: int, offset: int, nbytes: int) -> int:
    """The sum a reader of bytes ``offset .. offset + nbytes`` of ``piece`` (the first piece of
    ``sums``, a source's box) must find: its whole segments' sums added."""
    _, size = segments(piece, head_bytes, count)
    if offset % size or nbytes % size:
        raise ValueError(f"span {offset}+{nbytes} is not whole segments of {size} bytes")
    return sums.total(0, offset // size, (offset + nbytes) // size)


def region_sums(region: torch.Tensor, pieces: Sequence[RegionPiece], head_bytes: int, count: int, sums: ChunkSums):
    """Fill ``sums`` from ``region``'s bytes of each piece's whole rows in a pass after the copy: the
    native sum on the host where it was built, else torch on the region's device (queued on the current
    stream, copied to the host behind it)."""
    flat = region.view(torch.uint8).reshape(-1)
    if flat.device.type == "cpu" and hostcopy.available():
        for k, p in enumerate(pieces):
            n, size = segments(p, head_bytes, count)
            if p.offset + n * size > flat.numel():
                raise ValueError(
                    f"piece {k} spans bytes {p.offset}..{p.offset + n * size}, past the region's {flat.numel()}"
                )
            hostcopy.checksum_segments(flat.data_ptr() + p.offset, n, size, sums.piece(k))
        return
    parts = []
    for p in pieces:
        n, size = segments(p, head_bytes, count)
        parts.append(sums_of(flat[p.offset : p.offset + n * size], n))
    values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    if values.device.type == "cpu":
        sums.values[:] = values.numpy().astype(np.uint32)
    else:
        sums.device = values.to(torch.int32)
        to_host(sums)


def on_device(sums: ChunkSums, device: torch.device) -> int:
    """Zeroed device sums for a kernel to add into (queued on the current stream); their address."""
    sums.device = torch.zeros(len(sums.values), dtype=torch.int32, device=device)
    return sums.device.data_ptr()


def to_host(sums: ChunkSums) -> None:
    """Queue the device sums' copy into pinned host memory on the current stream, after the copy
    that adds them up: ``values`` holds them once that stream's fence has passed."""
    assert sums.device is not None
    if sums.pinned is None:
        sums.pinned = torch.empty(len(sums.values), dtype=torch.int32, pin_memory=True)
        sums.values = sums.pinned.numpy().view(np.uint32)
    sums.pinned.copy_(sums.device, non_blocking=True)
