"""Shard adapters: which KV heads each rank holds, and the plan that maps
source TP shards onto destination TP shards.

Read this file first. It is pure (no I/O, no device work) and everything that
moves bytes follows the ``TransferPlan`` built here.

Rules
- ``tp <= kv_heads``: rank ``r`` holds heads ``[r*h/tp, (r+1)*h/tp)``; ``tp`` must divide ``kv_heads``.
- ``tp > kv_heads``: heads are replicated; ``tp`` must be a multiple of ``kv_heads``
  and ranks ``[k*tp/h, (k+1)*tp/h)`` all hold head ``k``.
- MLA: the latent is never split; every rank holds all of it.

A plan is a list of pieces ``(src_rank, dst_rank, heads, buffers)`` covering
every (head, buffer) of every destination rank exactly once; a buffer is one
(layer, plane) of the cache. Pieces come from interval intersection, so any
valid pair of TP sizes works (4 -> 6 with 12 heads too).

Where several source ranks hold the same heads (replication, MLA), every holder
serves a share: with at least as many destination ranks wanting those heads as
holders, each destination rank takes them whole from one holder, round robin;
with fewer, each destination rank takes them from several holders, a share of
the layers from each, so MLA 4 -> 1 reads a quarter of the layers from each of
the four prefill ranks (their links and memory in parallel), not all from one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvstage.errors import IncompatibleGeometry
from kvstage.layout import KVGeometry, PageLayout, token_bytes


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads ``[start, stop)``."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def intersect(self, other: HeadRange) -> HeadRange | None:
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return HeadRange(lo, hi) if lo < hi else None


def check_tp(geometry: KVGeometry, tp, side: str) -> None:
    """A TP size that can shard ``geometry``'s heads: a positive int dividing them or a multiple (MLA: any)."""
    heads = geometry.kv_heads
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise IncompatibleGeometry(f"{side} tp={tp!r}: must be a positive integer")
    if not geometry.mla and heads % tp and tp % heads:
        raise IncompatibleGeometry(
            f"{side} tp={tp} with kv_heads={heads}: tp must divide kv_heads or be a multiple of it"
        )


@dataclass(frozen=True)
class SideSpec:
    """One side of a transfer: model KV geometry, TP size and page layout."""

    geometry: KVGeometry
    tp: int
    page: PageLayout

    def __post_init__(self) -> None:
        check_tp(self.geometry, self.tp, "spec")  # refused where it is made, not when a peer connects

    @classmethod
    def of(cls, geometry: KVGeometry, tp: int, page: PageLayout, side: str) -> SideSpec:
        """A spec whose refusal names its ``side`` ("source", "destination")."""
        check_tp(geometry, tp, side)
        return cls(geometry, tp, page)

    def check(self, side: str) -> None:
        check_tp(self.geometry, self.tp, side)

    def heads_of(self, rank: int) -> HeadRange:
        """Global heads held by ``rank``."""
        if not 0 <= rank < self.tp:
            raise IndexError(f"rank={rank}: must be in [0, {self.tp})")
        heads = self.geometry.kv_heads
        if self.geometry.mla:
            return HeadRange(0, 1)
        if self.tp <= heads:
            per = heads // self.tp
            return HeadRange(rank * per, (rank + 1) * per)
        head = rank // (self.tp // heads)
        return HeadRange(head, head + 1)

    def holders_of(self, head: int) -> range:
        """Ranks holding global ``head`` (several when replicated)."""
        heads = self.geometry.kv_heads
        if self.geometry.mla:
            return range(self.tp)
        if self.tp <= heads:
            r = head // (heads // self.tp)
            return range(r, r + 1)
        rep = self.tp // heads
        return range(head * rep, (head + 1) * rep)

    def local_heads(self) -> int:
        """Heads held by each rank (the same on every rank)."""
        return self.heads_of(0).count


@dataclass(frozen=True)
class Piece:
    """Heads ``heads`` of buffers ``buffers`` travel from ``src_rank`` to ``dst_rank``.

    ``src_offset`` / ``dst_offset`` are the first head's index inside each
    rank's own shard; ``buffers`` are (layer, plane) buffer indices, every
    buffer unless the heads' holders share them (a whole number of layers each)."""

    src_rank: int
    dst_rank: int
    heads: HeadRange
    src_offset: int
    dst_offset: int
    buffers: range


@dataclass(frozen=True)
class TransferPlan:
    src: SideSpec
    dst: SideSpec
    pieces: tuple[Piece, ...]

    @property
    def geometry(self) -> KVGeometry:
        return self.src.geometry

    @property
    def direct(self) -> bool:
        """Page runs can move without staging: identical paging, and every piece
        is a whole source shard and a whole destination shard (equal TP, MLA, or
        replicated heads on both sides); a piece may be a holder's share of the layers."""
        if self.src.page != self.dst.page:
            return False
        return all(p.heads == self.src.heads_of(p.src_rank) == self.dst.heads_of(p.dst_rank) for p in self.pieces)

    def writers_of(self, dst_rank: int) -> tuple[Piece, ...]:
        """Pieces landing on ``dst_rank``, in destination head order, then buffer order (the slot order)."""
        return tuple(
            sorted((p for p in self.pieces if p.dst_rank == dst_rank), key=lambda p: (p.dst_offset, p.buffers.start))
        )

    def targets_of(self, src_rank: int) -> tuple[Piece, ...]:
        """Pieces ``src_rank`` sends, one per destination rank at most."""
        return tuple(p for p in self.pieces if p.src_rank == src_rank)

    def piece_token_bytes(self, piece: Piece) -> int:
        """Bytes of one token of ``piece``: its heads in its buffers."""
        return piece.heads.count * len(piece.buffers) * self.geometry.head_bytes()

    def dst_token_bytes(self) -> int:
        return token_bytes(self.geometry, self.dst.local_heads())

    def layer_buffers(self, layers: range) -> range:
        """The buffers of ``layers`` (each layer's planes are consecutive buffers)."""
        planes = self.geometry.planes
        return range(layers.start * planes, layers.stop * planes)

    def writer_offsets(self, dst_rank: int, tokens: int) -> dict[int, int]:
        """Byte offset of each writer's piece inside a slot holding ``tokens`` tokens."""
        out, at = {}, 0
        for p in self.writers_of(dst_rank):
            out[p.src_rank] = at
            at += self.piece_token_bytes(p) * tokens
        return out


def restrict(piece: Piece, buffers: range) -> Piece | None:
    """``piece`` cut to the buffers of ``buffers`` (a streamed layer group), or None where it holds none of them."""
    lo, hi = max(piece.buffers.start, buffers.start), min(piece.buffers.stop, buffers.stop)
    return dataclasses.replace(piece, buffers=range(lo, hi)) if lo < hi else None


def check_pair(src: SideSpec, dst: SideSpec) -> None:
    """Raise ``IncompatibleGeometry`` naming the first field that cannot pair."""
    a, b = src.geometry, dst.geometry
    for name in ("mla", "dtype", "head_dim", "layers", "kv_heads"):
        va, vb = getattr(a, name), getattr(b, name)
        if va != vb:
            raise IncompatibleGeometry(
                f"{name} differs: source {name}={va!r}, destination {name}={vb!r}; "
                "both sides must serve the same model with the same KV dtype"
            )
    src.check("source")
    dst.check("destination")


def layer_share(layers: int, planes: int, index: int, holders: int) -> range:
    """The buffers holder ``index`` of ``holders`` serves: an even share of whole layers
    (empty where there are more holders than layers)."""
    return range(index * layers // holders * planes, (index + 1) * layers // holders * planes)


def plan(src: SideSpec, dst: SideSpec) -> TransferPlan:
    """Build the transfer plan for a pair of sides (validated first)."""
    check_pair(src, dst)
    geo = src.geometry
    every = range(geo.buffers)
    pieces: list[Piece] = []
    # source head groups: the distinct shards, each with the ranks holding it (several when replicated)
    groups: dict[HeadRange, list[int]] = {}
    for r in range(src.tp):
        groups.setdefault(src.heads_of(r), []).append(r)
    for shard, holders in groups.items():
        wanting = [d for d in range(dst.tp) if dst.heads_of(d).intersect(shard) is not None]
        for j, d in enumerate(wanting):
            got = dst.heads_of(d).intersect(shard)
            assert got is not None  # ``wanting`` holds only ranks that want some of ``shard``
            if len(wanting) >= len(holders):  # one holder each, round robin
                mine = [(holders[j % len(holders)], every)]
            else:  # several holders each, a share of the layers from every one of them
                share = holders[j :: len(wanting)]
                mine = [(s, layer_share(geo.layers, geo.planes, i, len(share))) for i, s in enumerate(share)]
            for s, buffers in mine:
                if len(buffers):
                    pieces.append(Piece(s, d, got, got.start - shard.start, got.start - dst.heads_of(d).start, buffers))
    return TransferPlan(src, dst, tuple(sorted(pieces, key=lambda p: (p.dst_rank, p.dst_offset, p.buffers.start))))
