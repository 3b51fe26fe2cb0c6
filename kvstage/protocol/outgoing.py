"""A source's request as it is read: its chunks, the box its gathers fill, and who still reads what;
and the destination ranks it is sent to (``Target``, ``DestinationEngine``).

The read path gathers, per chunk, a box of this rank's shard into one slot:
the local heads and buffers its destinations' pieces lie in. Where every piece
covers all of the box's heads (4 -> 1, MLA, replicas), token-major
(``staging.region.Order.TOKENS``: a token's heads together, as NHD pages hold
them: the cheap gather on the host); else head-major (``Order.HEADS``: one
head's rows of every buffer, then the next head's). Either way every piece is
one contiguous span of the chunk, whatever the destination's TP: a piece
either covers all of the box's buffers (a shard that is not replicated) or one
head (replicated heads and MLA, whose holders serve layer shares). A request
sent to any engine gathers the whole shard head-major, which holds every
engine's pieces. Pure but for the records' state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvstage.ids import OutKey, PartKey, RangeKey
from kvstage.protocol.common import rank_name
from kvstage.protocol.request import TransferHandle
from kvstage.protocol.wire import Connection
from kvstage.staging.checksum import ChunkSums
from kvstage.staging.region import Order, RegionPiece
from kvstage.tp import Piece, SideSpec, TransferPlan, restrict


@dataclass(frozen=True)
class Box:
    """Local heads ``[head_lo, head_lo + heads)`` of buffers ``buffers`` of a rank of ``spec``."""

    spec: SideSpec
    head_lo: int
    heads: int
    buffers: range
    order: Order = Order.HEADS

    @property
    def token_bytes(self) -> int:
        return self.heads * len(self.buffers) * self.spec.geometry.head_bytes()

    def nbytes(self, count: int) -> int:
        return self.token_bytes * count

    def piece(self) -> RegionPiece:
        """The whole box as the gather's one region piece."""
        return RegionPiece(self.head_lo, self.heads, self.buffers, 0, self.order)

    def piece_span(self, piece: Piece, count: int) -> tuple[int, int]:
        """(byte offset, bytes) of ``piece`` inside a chunk of ``count`` tokens gathered into this box.
        Raises ``ValueError`` where the piece is not one span of it (never for a plan's pieces)."""
        hb = self.spec.geometry.head_bytes()
        j, b = piece.src_offset - self.head_lo, piece.buffers.start - self.buffers.start
        if j < 0 or j + piece.heads.count > self.heads or b < 0 or piece.buffers.stop > self.buffers.stop:
            raise ValueError(f"piece {piece} lies outside the box {self}")
        if piece.heads.count > 1 and piece.buffers != self.buffers:
            raise ValueError(f"piece {piece} of several heads covers a share of the box's buffers: not one span")
        row = count * hb
        if self.order is Order.TOKENS:
            if piece.heads.count != self.heads:
                raise ValueError(f"piece {piece} covers some of a token-major box's heads: not one span")
            return b * row * self.heads, len(piece.buffers) * row * self.heads
        return (j * len(self.buffers) + b) * row, piece.heads.count * len(piece.buffers) * row


def region_box(pieces: list[Piece] | None, spec: SideSpec, buffers: range | None = None) -> Box:
    """The box that holds ``pieces`` (a rank's pieces to the destination ranks it sends to), or the rank's
    whole shard (of ``buffers``: a streamed layer group's) for ``None``."""
    every = range(spec.geometry.buffers) if buffers is None else buffers
    local = 1 if spec.geometry.mla else spec.local_heads()
    if not pieces:
        return Box(spec, 0, local, every)
    lo = min(p.src_offset for p in pieces)
    hi = max(p.src_offset + p.heads.count for p in pieces)
    b0 = min(p.buffers.start for p in pieces)
    b1 = max(p.buffers.stop for p in pieces)
    whole = all(p.heads.count == hi - lo for p in pieces)
    return Box(spec, lo, hi - lo, range(b0, b1), Order.TOKENS if whole else Order.HEADS)


@dataclass
class SrcChunk:
    """One chunk of a read request: its tokens, the slot it is gathered into and who still reads it."""

    index: int
    start: int
    count: int
    slot: int | None = None
    offset: int = 0  # of the slot in this rank's arena
    fence: object = None  # the gather's ``CopyFence``
    gathered: bool = False
    readers: dict = field(default_factory=dict)  # engine -> destination ranks told of it that have not read it
    offers: list = field(default_factory=list)  # two-sided transports: offers not taken yet
    blocked: float = 0.0  # when it found no free slot (``stages["slot_wait"]``)
    sums: ChunkSums | None = None  # a checksummed request's: its gather's sums of the box


def plan_chunks(tokens: int, own: int, capacity: int, src_page: int, dst_pages: list[int]) -> list[SrcChunk]:
    """The chunks of a read request: as many tokens as fit this rank's slot (``own``) and every reading
    destination rank's slot (``capacity``), cut to whole pages of both sides where a chunk holds that many."""
    fit = max(1, min(own, capacity))
    step = math.lcm(src_page, *dst_pages) if dst_pages else src_page
    per = fit // step * step if fit >= step else fit
    return [SrcChunk(i, s, min(per, tokens - s)) for i, s in enumerate(range(0, tokens, per))]


def group_key(group: range | None) -> RangeKey | None:
    """A layer group as a key (None: every layer)."""
    return None if group is None else (group.start, group.stop)


def part_key(layers: range | None, span: range | None) -> PartKey | None:
    """A part of a streamed request as a key: its layer group and token span (None: the whole request)."""
    return None if layers is None and span is None else (group_key(layers), group_key(span))


def group_piece(plan: TransferPlan, piece: Piece, group: range | None) -> Piece | None:
    """``piece`` cut to layer group ``group`` of ``plan`` (None: none of its buffers lie in it)."""
    return piece if group is None else restrict(piece, plan.layer_buffers(group))


def overlaps(a: range | None, b: range | None) -> bool:
    """Whether two layer groups share a layer, or two token spans a token (None: all of them)."""
    return a is None or b is None or (a.start < b.stop and b.start < a.stop)


@dataclass
class Outgoing:
    """One sent request, or one part of a streamed request (a layer group, a token span), on a source rank.
    Its handle counts the tokens its pages hold; ``total``: the whole request's."""

    handle: TransferHandle
    pages: np.ndarray
    engine: str | None  # the decode engine it was sent to; None: whichever connected engine reads it first
    bound: str | None = None  # the engine that reads it (``engine``, or the first to read)
    targets: dict = field(default_factory=dict)  # (engine, destination rank) -> its Path
    told: set = field(default_factory=set)  # (engine, destination rank) that were sent its ``ready``
    done: set = field(default_factory=set)  # ranks of ``bound`` that said ``done``
    freed: set = field(default_factory=set)  # (engine, chunk) whose slot came back
    box: Box | None = None
    chunks: list = field(default_factory=list)  # SrcChunk, for the read path
    kernel_pages: object = None  # the page ids where the GPU gathers read them, once per request
    caller_stream: object = None  # CUDA: the stream the caller's work (the forward) ran on
    event_recorded: bool = False
    touched: float = 0.0
    slow: bool = False
    layers: range | None = None  # the layer group it makes readable (None: every layer)
    span: range | None = None  # the request's tokens its pages hold (None: every token)
    total: int = 0  # tokens of the whole request (0: the handle's)
    checksum: bool = False  # it carries a checksum (``protocol.checksums``), on whichever path it takes

    def __post_init__(self) -> None:
        import time

        self.touched = time.monotonic()
        if self.engine is not None:
            self.bound = self.engine

    @property
    def key(self) -> OutKey:
        return self.engine, self.handle.req, part_key(self.layers, self.span)

    @property
    def layers_wire(self) -> list | None:
        return None if self.layers is None else [self.layers.start, self.layers.stop]

    @property
    def span_wire(self) -> list | None:
        return None if self.span is None else [self.span.start, self.span.stop]

    def final(self, layers: int) -> bool:
        """Whether it is the last part of its request (its last layers and tokens)."""
        return (self.layers is None or self.layers.stop == layers) and (
            self.span is None or self.span.stop == (self.total or self.handle.tokens)
        )

    def buffers(self, plan: TransferPlan) -> range | None:
        """The buffers of its layer group (None: every buffer)."""
        return None if self.layers is None else plan.layer_buffers(self.layers)

    def piece_of(self, target) -> Piece | None:
        """What it sends destination rank ``target``: the target's piece, cut to its layer group."""
        return group_piece(target.plan, target.piece, self.layers)


@dataclass
class Target:
    """One connected destination rank, as routes and reads need it."""

    engine: str
    rank: int
    conn: Connection
    agent: str
    plan: TransferPlan
    piece: Piece  # what this rank sends it
    address: tuple  # (host, port) it was connected at
    ipc: bool  # it opened this rank's KV pages and ready event (same host, CUDA IPC)
    paths: frozenset  # the paths both sides' settings allow
    capacity: int  # tokens of its slot (its whole shard): a ``read`` chunk holds at most this many

    @property
    def name(self) -> str:
        return rank_name(self.engine, "destination", self.rank)


@dataclass
class DestinationEngine:
    """One decode engine's ranks as this source sees them: the plan from its welcomes, and the
    connected ranks this source sends to."""

    name: str
    plan: TransferPlan
    targets: dict[int, Target] = field(default_factory=dict)  # destination rank -> Target
