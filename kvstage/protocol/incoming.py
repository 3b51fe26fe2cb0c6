"""A destination's view of its peers and of one expected request.

``Writer`` is one connected source rank: what its offer made readable (its
arena, its KV buffers, on one host its pages and ready event). ``Ready`` is
what that writer said of one request, checked against the writer and this
rank before anything is read (``check_ready``). ``Incoming`` is the request:
its pages here, the readies it waits for and the moves that read it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstage.errors import ProtocolError
from kvstage.ids import ReqKey
from kvstage.layout import buffer_shape, pages_needed
from kvstage.protocol.common import rank_name
from kvstage.protocol.messages import Ready as ReadyMessage
from kvstage.protocol.request import TransferHandle
from kvstage.protocol.route import Path
from kvstage.protocol.wire import Connection
from kvstage.staging.region import Order
from kvstage.tp import Piece, SideSpec, TransferPlan
from kvstage.transports.base import Region

if TYPE_CHECKING:
    from kvstage.staging.cuda_ipc import SourcePages
    from kvstage.staging.shared_buffers import OpenedBuffers, OpenedEvent

#: messages one handshaking writer may have waiting for it (``Writer.held``)
MAX_HELD = 1024


@dataclass
class Writer:
    """One connected source rank of a prefill engine."""

    engine: str
    rank: int
    conn: Connection
    agent: str
    piece: Piece  # what it sends this rank
    spec: SideSpec  # its engine's spec
    paths: frozenset  # the paths both sides' settings allow
    arena: Region | None = None  # its arena (the read path reads its chunks there)
    kv: list = field(default_factory=list)  # its KV buffers' regions (the direct and pages paths read them)
    ipc: SourcePages | None = None  # its pages as this rank's kernel reads them, opened over CUDA IPC
    opened: OpenedBuffers | None = None  # the ``OpenedBuffers`` behind ``ipc``, closed with the connection
    event: OpenedEvent | None = None  # its ready event opened here (``shared_buffers.OpenedEvent``)
    offered: bool = False  # its ``offer`` arrived: what it offers is known
    local: bool = False  # it runs on this host, as this user (the ipc path may open its pages)
    warm: tuple[Any, float] | None = None  # (read handle, deadline) of the first read of its arena, until it completes
    why_not_ipc: str = ""  # why its pages were not opened here, told in ``opened``
    #: messages for it while its handshake runs (the source reads only ``opened`` then), sent after ``opened``;
    #: bounded: an older abort dropped here leaves the source's own ready timeout to free that request
    held: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_HELD))

    @property
    def name(self) -> str:
        return rank_name(self.engine, "source", self.rank)

    def buffer_pages(self) -> int | None:
        """Pages each of its KV buffers holds, from what it offered (None: it offered none)."""
        if self.ipc is not None:
            return self.ipc.pages
        if self.kv:
            return self.kv[0].nbytes // page_bytes(self.spec)
        return None


def page_bytes(spec: SideSpec) -> int:
    """Bytes of one page of one of a rank's buffers."""
    g = spec.geometry
    return int(np.prod(buffer_shape(g, spec.page, spec.local_heads(), 1))) * g.itemsize


@dataclass
class SourceEngine:
    """One prefill engine's ranks as this destination sees them: its plan, fixed by its first
    hello, and its connected writers by source rank."""

    name: str
    plan: TransferPlan
    writers: dict[int, Writer] = field(default_factory=dict)  # source rank -> Writer
    lost: dict = field(default_factory=dict)  # source rank that left and has not come back -> why
    ipc_copier: object = None  # the kernel reading this engine's pages (``cuda_ipc.IpcReadCopier``), made once

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The pieces that land on destination rank ``rank``."""
        return self.plan.writers_of(rank)


@dataclass
class Ready:
    """One writer's ``ready`` for a request, checked: its path, its page ids (the page paths) or its
    chunking and the chunks gathered so far (the read path: index -> (arena offset, ticket, checksum or None))."""

    path: Path
    tokens: int
    pages: np.ndarray | None = None
    chunk_tokens: int = 0
    chunks: int = 0
    gathered: dict = field(default_factory=dict)
    order: Order = Order.HEADS  # the read path: how each chunk's piece is laid out in the source's arena
    #: checksummed: on the read path each chunk comes with the checksum its bytes must have; on the others
    #: a ``sums`` follows with ``total``, what this rank's piece must sum to
    checksum: bool = False
    total: int | None = None


def check_ready(
    msg: ReadyMessage, writer: Writer, allowed: frozenset, piece_bytes: int, direct: bool, tokens: int | None = None
) -> Ready:
    """A writer's ``ready``, refused (``ProtocolError``, naming what) where its path is not allowed or
    not one its offer or the plan can carry (``direct``: the plan's pieces are whole shards with equal
    paging), or its pages or chunks lie outside what it offered. ``tokens``: those its pages hold (a
    token span's), where not the whole request's."""
    tokens = msg.tokens if tokens is None else tokens
    try:
        path = Path(msg.path)
    except ValueError:
        raise ProtocolError(
            f"ready for {msg.req!r}: path {msg.path!r} is none of {', '.join(p.value for p in Path)}"
        ) from None
    if path not in allowed:
        raise ProtocolError(
            f"ready for {msg.req!r}: path {path} is not allowed here (this rank's path setting "
            f"allows {', '.join(sorted(p.value for p in allowed))})"
        )
    if path not in writer.paths:
        raise ProtocolError(
            f"ready for {msg.req!r}: path {path} is not allowed here (the handshake with this "
            f"source agreed {', '.join(sorted(p.value for p in writer.paths)) or 'none'})"
        )
    if path is Path.READ:
        if writer.arena is None or msg.chunk_tokens is None or msg.chunks is None:
            raise ProtocolError(f"ready for {msg.req!r}: the read path needs an arena, chunk_tokens and chunks")
        if msg.chunks != -(-tokens // msg.chunk_tokens):
            raise ProtocolError(
                f"ready for {msg.req!r}: {msg.chunks} chunks of {msg.chunk_tokens} tokens do not cut {tokens} tokens"
            )
        try:
            order = Order(msg.order or "heads")
        except ValueError:
            raise ProtocolError(f"ready for {msg.req!r}: order {msg.order!r} is none of heads, tokens") from None
        ready = Ready(path, tokens, None, msg.chunk_tokens, msg.chunks, order=order, checksum=bool(msg.checksum))
        for entry in msg.gathered or []:
            add_chunk(ready, writer, msg.req, entry, piece_bytes)
        return ready
    if path is Path.DIRECT and not direct:
        raise ProtocolError(
            f"ready for {msg.req!r}: path direct, but the pieces are not whole shards with equal paging"
        )
    if path is Path.IPC and writer.ipc is None:
        raise ProtocolError(f"ready for {msg.req!r}: path ipc, but this rank did not open the source's pages")
    if path in (Path.DIRECT, Path.PAGES) and not writer.kv:
        raise ProtocolError(f"ready for {msg.req!r}: path {path}, but the source offered no KV buffers")
    if msg.pages is None:
        raise ProtocolError(f"ready for {msg.req!r}: path {path} needs the source's page ids")
    need = pages_needed(tokens, writer.spec.page.page_size)
    if len(msg.pages) != need:
        raise ProtocolError(
            f"ready for {msg.req!r}: {len(msg.pages)} page ids for {tokens} tokens of page size "
            f"{writer.spec.page.page_size}; they need {need}"
        )
    pages = np.asarray(msg.pages, dtype=np.int64)
    most = writer.buffer_pages()
    if most is not None and len(pages) and int(pages.max()) >= most:
        raise ProtocolError(
            f"ready for {msg.req!r}: page id {int(pages.max())} is past the {most} pages the source offered"
        )
    if len(set(msg.pages)) != len(msg.pages):
        raise ProtocolError(f"ready for {msg.req!r}: a page id appears twice")
    return Ready(path, tokens, pages, checksum=bool(msg.checksum))


def add_chunk(ready: Ready, writer: Writer, req: str, entry, piece_bytes: int) -> None:
    """One gathered chunk of a read request: [index, arena offset, ticket] and, where the request is
    checksummed, the sum its bytes must have, inside the writer's arena."""
    if not (
        isinstance(entry, (list, tuple))
        and len(entry) in (3, 4)
        and type(entry[0]) is int
        and type(entry[1]) is int
        and isinstance(entry[2], str)
        and (len(entry) == 3 or (type(entry[3]) is int and 0 <= entry[3] <= 0xFFFFFFFF))
    ):
        raise ProtocolError(
            f"ready for {req!r}: a gathered chunk must be [index, offset, ticket] or [index, offset, ticket, "
            "checksum] (checksum an integer in 0..2**32-1)"
        )
    index, offset, ticket = entry[:3]
    checksum = entry[3] if len(entry) == 4 else None
    if (checksum is None) == ready.checksum:
        raise ProtocolError(
            f"chunk {entry[0]} of {req!r}: {'no' if checksum is None else 'a'} checksum, but its ready said the "
            f"request has {'them' if ready.checksum else 'none'}"
        )
    if not 0 <= index < ready.chunks:
        raise ProtocolError(f"chunk {index} of {req!r} is out of range: the request has {ready.chunks} chunks")
    if index in ready.gathered:
        raise ProtocolError(f"chunk {index} of {req!r} announced twice")
    count = min(ready.chunk_tokens, ready.tokens - index * ready.chunk_tokens)
    nbytes = piece_bytes * count
    assert writer.arena is not None  # check_ready: a read-path ready comes from a writer with an arena
    if offset < 0 or offset + nbytes > writer.arena.nbytes:
        raise ProtocolError(
            f"chunk {index} of {req!r}: {nbytes} bytes at offset {offset} lie outside the source's "
            f"arena of {writer.arena.nbytes} bytes"
        )
    import base64

    try:
        ready.gathered[index] = (offset, base64.b64decode(ticket, validate=True) if ticket else b"", checksum)
    except ValueError:
        raise ProtocolError(f"chunk {index} of {req!r}: its ticket is not base64") from None


@dataclass
class Group:
    """One part of a request as this rank reads it: a layer group, a token span (a chunk of a chunked
    prefill), both, or (unstreamed) every layer and token; its writers' readies, and its moves once every
    writer it needs said ready. ``first``, ``count``, ``dst_start``: the tokens of the part's own source
    request (its span) this rank receives, and where they start in this rank's pages."""

    layers: range | None  # None: every layer
    pieces: tuple  # the pieces landing here, cut to these layers (``tp.restrict``)
    span: range | None = None  # None: every token
    first: int = 0
    count: int = 0
    dst_start: int = 0
    readies: dict = field(default_factory=dict)  # source rank -> Ready
    moves: list = field(default_factory=list)  # the reads under way (``reads``)
    started: bool = False
    done: bool = False

    @property
    def wire(self) -> tuple[list | None, list | None]:
        """(layers, span) as its messages name them."""
        return (
            None if self.layers is None else [self.layers.start, self.layers.stop],
            None if self.span is None else [self.span.start, self.span.stop],
        )

    @property
    def name(self) -> str:
        out = "" if self.layers is None else f" layers {self.layers.start}..{self.layers.stop}"
        return out + ("" if self.span is None else f" tokens {self.span.start}..{self.span.stop}")

    def area(self, layers: int) -> int:
        """Layers x tokens of this rank's request it holds."""
        return (layers if self.layers is None else len(self.layers)) * self.count


@dataclass
class Incoming:
    """One expected request on a destination rank."""

    handle: TransferHandle
    pages: np.ndarray
    engine: str  # the prefill engine whose ranks send it
    first: int = 0  # the first token of the source's request this rank receives
    groups: dict = field(default_factory=dict)  # layer group key (None: every layer) -> Group, in arrival order
    kernel_pages: object = None  # this rank's page ids where its GPU copies read them, once
    stage: str = "waiting for writers"
    touched: float = field(default_factory=time.monotonic)  # expected, or a writer's last news
    announced: float | None = None  # when its first group's last writer said ready
    slow: bool = False
    leftover: list = field(default_factory=list)  # reads of a failed request that may still land (``reads.Leftover``)

    @property
    def key(self) -> ReqKey:
        return self.engine, self.handle.req

    @property
    def moves(self) -> list:
        """Every group's moves."""
        return [m for g in self.groups.values() for m in g.moves]

    def ready_ranks(self) -> set:
        """Source ranks that said ready for some group of it."""
        return {r for g in self.groups.values() for r in g.readies}

    def area_done(self, layers: int) -> int:
        """Layers x tokens of it that are in this rank's pages (all: ``layers`` x its tokens)."""
        return sum(g.area(layers) for g in self.groups.values() if g.done)
