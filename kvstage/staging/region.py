"""What a staging region holds: pieces, each some local heads of some (layer, plane)
buffers of a chunk's tokens, in one of two byte orders.

Pure: no I/O, no device work. Every copier (``staging.copier``), the kernel's numpy
mirror (``staging.words``) and the span lists of a remote reader (``staging.spans``)
address a region through this module's rule, so all of them agree byte for byte.

For token ``t`` of a chunk's ``TokenIndex``, head ``j`` of a piece, buffer ``b`` of
its ``buffers`` (``bi = b - buffers.start``, ``nb = len(buffers)``) and byte ``k`` of
the head, with ``R = piece.row_tokens(count)`` and ``r = row_first + t``, the byte is
at, inside the region:

- ``Order.HEADS``:  ``offset + ((j * nb + bi) * R + r) * head_bytes + k``
- ``Order.TOKENS``: ``offset + ((bi * R + r) * heads + j) * head_bytes + k``

and in the cache it is byte ``k`` of local head ``head_lo + j`` of that token in
buffer ``b`` (``layout.element_offsets``). A row holds ``R`` tokens, so a region sized
for a whole request (``rows``) can take its chunks one window at a time (``row_first``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

#: bytes a piece's offset is a multiple of: the CUDA kernel moves 16-byte words
ALIGN = 16


class Order(str, enum.Enum):
    """The byte order of a piece: which of its runs is contiguous."""

    HEADS = "heads"  # piece bytes [heads][buffers][rows][head_bytes]: one head's rows are contiguous
    TOKENS = "tokens"  # piece bytes [buffers][rows][heads][head_bytes]: one token's heads are contiguous


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RegionPiece:
    """Local heads ``[head_lo, head_lo+heads)`` of buffers ``buffers`` of a chunk's tokens,
    at byte ``offset`` of a region, laid out in ``order``. Refused when made if a field
    cannot be right on any rank; ``check_pieces`` checks it against a rank and a region."""

    head_lo: int  # first local head (index inside this rank's shard; MLA: 0)
    heads: int
    buffers: range  # (layer, plane) buffer indices of the cache, step 1, non-empty
    offset: int  # byte offset of the piece inside the region, a multiple of ALIGN
    order: Order = Order.HEADS
    rows: int | None = None  # tokens each row of the piece holds in the region; None: the index's count
    row_first: int = 0  # the row position of the index's first token (rows is not None)

    def __post_init__(self) -> None:
        if not _integer(self.head_lo) or self.head_lo < 0:
            raise ValueError(f"head_lo={self.head_lo!r}: must be an integer >= 0")
        if not _integer(self.heads) or self.heads < 1:
            raise ValueError(f"heads={self.heads!r}: must be an integer >= 1")
        b = self.buffers
        if not isinstance(b, range) or b.step != 1 or not len(b) or b.start < 0:
            raise ValueError(f"buffers={b!r}: must be a non-empty range of step 1 from an index >= 0")
        if not _integer(self.offset) or self.offset < 0 or self.offset % ALIGN:
            raise ValueError(f"offset={self.offset!r}: must be an integer >= 0 and a multiple of {ALIGN}")
        try:
            object.__setattr__(self, "order", Order(self.order))
        except ValueError:
            raise ValueError(f"order={self.order!r}: must be one of {', '.join(o.value for o in Order)}") from None
        if self.rows is not None and (not _integer(self.rows) or self.rows < 1):
            raise ValueError(f"rows={self.rows!r}: must be None (the index's count) or an integer >= 1")
        if not _integer(self.row_first) or self.row_first < 0:
            raise ValueError(f"row_first={self.row_first!r}: must be an integer >= 0")
        if self.rows is None and self.row_first:
            raise ValueError(
                f"row_first={self.row_first}: needs rows (rows=None: the rows are the index's tokens, from row 0)"
            )

    def row_tokens(self, count: int) -> int:
        """Tokens each row holds: ``rows``, or the index's ``count``."""
        return count if self.rows is None else self.rows

    def nbytes(self, head_bytes: int, count: int) -> int:
        """Bytes the piece spans in the region, its whole rows included."""
        return self.heads * len(self.buffers) * self.row_tokens(count) * head_bytes

    def buffer_stride(self, head_bytes: int, count: int) -> int:
        """Bytes from one buffer's part of the piece to the next one's: the region byte of
        buffer ``b`` is that of ``buffers.start`` plus ``(b - buffers.start)`` of these."""
        rows = self.row_tokens(count)
        return rows * head_bytes if self.order is Order.HEADS else rows * self.heads * head_bytes


def check_pieces(
    pieces: Sequence, *, local_heads: int, buffers: int, head_bytes: int, count: int, region_bytes: int | None = None
) -> tuple[RegionPiece, ...]:
    """``pieces`` as a tuple, each checked against a rank holding ``local_heads`` heads in
    ``buffers`` buffers and a region of ``region_bytes`` bytes (None: not known here) for
    ``count`` tokens; a ``ValueError`` naming the piece, the field and the rule, before
    anything is copied."""
    out = tuple(pieces)
    for n, p in enumerate(out):
        if not isinstance(p, RegionPiece):
            raise TypeError(f"pieces[{n}]={p!r}: must be a staging.region.RegionPiece")
        if p.head_lo + p.heads > local_heads:
            raise ValueError(
                f"pieces[{n}].heads: head_lo={p.head_lo} + heads={p.heads} = {p.head_lo + p.heads} "
                f"must be <= {local_heads}, the local heads of this rank"
            )
        if p.buffers.stop > buffers:
            raise ValueError(
                f"pieces[{n}].buffers={p.buffers!r}: must lie in range(0, {buffers}), the buffers of this geometry"
            )
        rows = p.row_tokens(count)
        if p.row_first + count > rows:
            raise ValueError(
                f"pieces[{n}].rows: row_first={p.row_first} + count={count} = {p.row_first + count} "
                f"must be <= rows={rows}"
            )
        end = p.offset + p.nbytes(head_bytes, count)
        if region_bytes is not None and end > region_bytes:
            raise ValueError(
                f"pieces[{n}].offset: the piece spans bytes {p.offset}..{end}, past the region's {region_bytes}"
            )
    return out


def end_to_end(pieces: Sequence[RegionPiece], head_bytes: int, count: int, offset: int = 0) -> list[RegionPiece]:
    """``pieces`` laid one after another from ``offset``, each at the next multiple of
    ``ALIGN``: a slot's layout when its writers' pieces are given in slot order."""
    out = []
    for p in pieces:
        offset = -(-offset // ALIGN) * ALIGN
        out.append(replace(p, offset=offset))
        offset += p.nbytes(head_bytes, count)
    return out
