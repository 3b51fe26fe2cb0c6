"""The source (prefill) side: makes a request readable, then lets the destination move it.

``send`` runs on the caller's thread, right after the forward that wrote the
request's KV, and does everything this rank's process has to do for it:

- ``ipc`` (one host, CUDA memory): it records this rank's ready event on the
  caller's stream and says ``ready`` with the page ids; the destination's kernel
  reads the pages (shared over CUDA IPC at the handshake) after that event;
- ``direct`` / ``pages``: it says ``ready`` with the page ids; the destination
  reads page runs or head slices straight from the registered KV buffers;
- ``read``: it gathers its slices of each chunk into a slot of its arena
  (head-major, ``outgoing``), says where, and the destination reads them. Chunks
  that find no free slot are gathered by this rank's loop as the destination's
  ``read`` messages free slots: only then is this process on the request's path.

The destination's ``done`` ends the request here (its pages may be reused). A
request is sent to one decode engine (``engine``) or, with ``engine=None``, to
whichever connected engine reads it first (an engine that connects later is
told too); the first engine to read it takes it, and the others hear ``abort``.

A destination is connected once; later ``connect`` calls to the same address
reuse the connection. The handshake (``hello``, ``welcome``, ``offer``,
``opened``) runs whole inside ``connect``, so a request sent after it returns
knows how each destination rank can read it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import select
import socket
import time
from dataclasses import dataclass
from dataclasses import field as dc_field

import numpy as np

from kvstage.errors import KVStageError, ProtocolError, TransferFailed
from kvstage.link.context import link_context
from kvstage.protocol import route
from kvstage.protocol.address import Address
from kvstage.protocol.endpoint import (
    SLOW_S,
    Endpoint,
    EndpointStats,
    check_engine,
    check_pages,
    peer_label,
    rank_name,
    remember,
)
from kvstage.protocol.handshake import (
    HANDSHAKE_TIMEOUT_S,
    check_same_model,
    check_transport,
    check_version,
    check_welcome_proof,
    spec_from_wire,
    spec_to_wire,
)
from kvstage.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Chunk,
    Done,
    Error,
    Hello,
    Message,
    Offer,
    Opened,
    Ping,
    Read,
    Ready,
    Welcome,
    decode,
)
from kvstage.protocol.outgoing import (
    Outgoing,
    SrcChunk,
    group_piece,
    overlaps,
    part_key,
    plan_chunks,
    region_box,
)
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.route import Path
from kvstage.protocol.stream import LayerStream, check_layers, check_span
from kvstage.protocol.wire import Connection
from kvstage.staging.copy import TokenIndex, gather, upload_pages
from kvstage.staging.fence import CopyFence
from kvstage.tp import Piece, TransferPlan, plan
from kvstage.transports.base import Spans, WriteState

log = logging.getLogger("kvstage")

MAX_FINISHED = 4096  # finished request ids remembered, so a late message for one is refused by name
#: destination addresses remembered that this rank reads nothing to (another source rank covers them),
#: so a later ``connect`` to them needs no handshake
MAX_IDLE_ADDRESSES = 1024
#: on CUDA, a ``send`` whose gathers are launched waits this long on the caller's thread for them and
#: announces them from there: the loop would first have to wake, which takes longer on a GPU host
SEND_WAIT_S = 200e-6
#: a failed request's gathered slots return this long after its ``abort`` went out, unless each destination
#: that may read them answered first: a read already posted may still be copying from them
ABORT_HOLD_S = 1.0
#: how often the loop drives the transport while a request is readable and nothing else is near
#: (``Source._readable``): a read over UCX's tcp waits up to this long for this process's answer, and an engine
#: whose requests wait long for their decode does not give its GIL to a loop turn every few microseconds
DRIVE_S = 0.001


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
    targets: dict[int, Target] = dc_field(default_factory=dict)  # destination rank -> Target


class Source(Endpoint):
    """A source rank. ``connect`` it to the destination ranks of a decode engine, then ``send``
    to that engine, or to any connected one; any number of decode engines (``engine``: this rank's
    own engine id, told to every destination, which names the requests it expects from it)."""

    role = "src"

    def __init__(self, cache, settings=None, transport=None, engine: str = "", model: str = ""):
        super().__init__(cache, settings, transport, engine, model)
        self.engines: dict[str, DestinationEngine] = {}
        self._targets: dict[Connection, Target] = {}  # every connected destination, by its control connection
        self._idle: dict[tuple, tuple[str, int]] = {}  # address this rank sends nothing to -> (engine, rank)
        self.requests: dict[tuple, Outgoing] = {}  # (engine or None, req) -> the request
        self._waiting: collections.deque = collections.deque()  # (request, chunk) with no free slot yet
        self._gathering: list = []  # (request, chunk) whose gather runs on the device
        self._held: list = []  # (release time, slot) of failed requests' chunks (``ABORT_HOLD_S``)
        self._draining: list = []  # done requests whose offers are not over yet: their slots return when they are
        self._finished: dict[tuple, str] = {}  # (engine, req) -> final state, oldest first
        self._routes: dict = {}  # (engine, rank, path) whose route was logged, the latest ones
        self._ipc = self._share_pages()
        if self._reads_pages():
            self.kv_regions()  # before the hello: the transport's metadata it carries must name them
        self._start()

    # -- construction ------------------------------------------------------------
    def _reads_pages(self) -> bool:
        """Whether a destination may read this rank's KV buffers with the transport (the direct and pages
        paths): a one-sided transport, a token, and a path setting that allows one of them."""
        return (
            self.settings.offers_pages
            and self.transport.one_sided
            and bool({Path.DIRECT, Path.PAGES} & _allowed(self.settings))
        )

    def _share_pages(self):
        """This rank's KV pages and ready event, shared over CUDA IPC with destinations of this host
        that open them (the ``ipc`` path), or None (said in one line when it cannot be)."""
        if self.cache.device.type != "cuda" or not self.settings.offers_pages or "ipc" not in _allowed(self.settings):
            return None
        from kvstage.staging.shared_buffers import NotShareable, ReadyEvent, share_buffers

        try:
            shared = {"buffers": share_buffers(self.cache.buffers), "event": None}
            event = ReadyEvent(self.cache.device)
        except NotShareable as e:
            log.warning(
                "src %d: KV pages not shared over CUDA IPC: %s; destinations on this host read them through "
                "the arena (the read path) instead of one pass (the ipc path)",
                self.rank,
                e,
            )
            return None
        shared["event"] = event
        log.info(
            "src %d: KV pages shared over CUDA IPC with destinations of this host and user that open them "
            "(%d allocations): their kernel reads these pages in one pass (the ipc path)",
            self.rank,
            len(shared["buffers"]["allocations"]),
        )
        return shared

    # -- public --------------------------------------------------------------
    def connect(self, addresses) -> list[int]:
        """Handshake with each destination rank at ``addresses`` this source is not connected to yet;
        an address connected before is reused as it is. Each is a destination's ``address`` as it handed
        it out (an ``Address``, or its ``kvstage://SECRET@HOST:PORT`` url), whose secret this source
        presents, or a plain (host, port), for which it presents its own ``auth_token``.

        Keeps the connections to ranks this source sends to and returns their
        ranks. Raises ``TransferFailed`` when a destination refuses, ``ConfigError``
        for an address that is not one."""
        kept = []
        for given in addresses:
            at = Address.parse(given)
            host, port = address = (at.host, at.port)
            known = self._here(lambda address=address: self._known(address))
            if known is None:
                known = self._handshake(host, port, at.secret or self.settings.auth_token)
            if known is not None and known >= 0:
                kept.append(known)
        return kept

    def send(
        self,
        req: str,
        page_ids,
        tokens: int,
        engine: str | None = "",
        layers: range | None = None,
        span: range | None = None,
    ) -> TransferHandle:
        """Make ``tokens`` tokens of request ``req``, held in ``page_ids`` (this rank's pages, written by
        the work queued on the caller's stream so far), readable by the ranks of decode engine ``engine``
        (the id its destinations were made with), or with ``engine=None`` by whichever connected decode
        engine reads it first. The handle is done once the destination ranks hold every byte.

        ``layers``: only that group of layers (a streamed request, sent group by group as the forward
        writes them; ``stream`` does it by the rule). ``span``: ``page_ids`` hold only those tokens of the
        request's ``tokens`` (a chunk of a chunked prefill, sent as its forward ends; it starts on a page).
        The parts of one request must not overlap."""
        if not isinstance(req, str) or not 0 < len(req) <= 256 or not req.isprintable():
            raise ValueError(f"req={req!r}: must be a non-empty printable string of at most 256 characters")
        if engine is not None:
            check_engine(engine)
        group = check_layers(layers, self.spec.geometry.layers)
        part = check_span(span, tokens, self.spec.page.page_size)
        count = int(tokens) if part is None else len(part)
        pages = check_pages(self.cache, page_ids, count)
        handle = TransferHandle(req, "src", count)
        log.debug(
            "src %d: %s sent by the caller, %d tokens%s",
            self.rank,
            req,
            tokens,
            ("" if group is None else f", layers {group.start}..{group.stop}")
            + ("" if part is None else f", its tokens {part.start}..{part.stop}"),
        )
        key = (engine, req, part_key(group, part))
        handle._abort = lambda reason: self._post("call", lambda: self._fail(key, "local", "abort", reason, tell=True))
        caller = self._caller_stream()  # taken here: ``_here`` runs on the copies' stream
        # on this thread: the loop may sleep
        self._here(lambda: self._add(handle, pages, engine, caller, group, part, int(tokens)))
        return handle

    def stream(self, req: str, page_ids, tokens: int, engine: str | None = "") -> LayerStream:
        """Send request ``req`` layer group by layer group while the forward writes it: call the stream's
        ``written(n)`` as the forward has written layers ``0 .. n``. The groups follow
        ``stream.layer_groups`` (a short request goes whole, once every layer is written)."""
        return LayerStream(
            lambda layers: self.send(req, page_ids, tokens, engine, layers),
            req,
            self.spec.geometry.layers,
            int(tokens),
            lambda reason: self.abort(req, engine, reason),
        )

    def abort(self, req: str, engine: str | None = "", reason: str = "aborted by caller") -> None:
        """Drop request ``req`` (every layer group of it, in flight or done): its destination ranks hear
        ``abort`` and fail it (a streamed request dropped mid-forward)."""

        def drop():
            outs = (
                self._groups_of(engine, req)
                if engine is not None
                else [o for k, o in self.requests.items() if k[1] == req]
            )
            live = [o for o in outs if not o.handle.done()]
            for out in live:
                self._fail(out.key, "local", "abort", reason, tell=True)
            if not live:  # every group sent so far is read already: the destinations still expect the rest
                eng = self.engines.get(engine) if engine is not None else None
                for t in eng.targets.values() if eng is not None else self._targets.values():
                    self._tell(t, Abort(req, reason))

        self._post("call", drop)

    def _caller_stream(self):
        """CUDA: the stream the caller's work (the forward that wrote the pages) is queued on."""
        if self.cache.device.type != "cuda":
            return None
        import torch

        return torch.cuda.current_stream(self.cache.device)

    def _known(self, address: tuple) -> int | None:
        """The destination rank already connected at ``address`` (-1: known, served by another
        source rank), or None: a handshake is needed."""
        for t in self._targets.values():
            if t.address == address and not t.conn.closed:
                return t.rank
        idle = self._idle.get(address)
        if idle is not None and idle[0] in self.engines:
            return -1
        return None

    # -- handshake (caller's thread; state changes go to the loop) -------------
    def _handshake(self, host: str, port: int, token: str) -> int | None:
        """``token``: what this source presents there (the destination's secret, or the auth token), and
        what the welcome must prove the destination holds."""
        peer = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
        except OSError as e:
            raise TransferFailed("-", f"destination {peer}", "handshake", f"cannot connect: {e}") from e
        conn = Connection(sock, peer)
        nonce = secrets.token_hex(16)
        try:
            conn.send(
                Hello(
                    PROTOCOL_VERSION,
                    token,
                    self.engine,
                    self.model,
                    os.getuid(),
                    spec_to_wire(self.spec),
                    self.rank,
                    self.transport.id,
                    self.transport.name,
                    self.transport.metadata(),
                    self.slot_bytes,
                    self.facts,
                    self.kv_facts(),
                    sorted(p.value for p in _allowed(self.settings)),
                    nonce,
                ).to_wire()
            )
            msg = _expect(conn, Welcome)
            check_version(msg.version, "destination")
            check_transport(msg.transport, self.transport.name, "destination")
            check_same_model(msg.model, self.model, "destination")
            dst = spec_from_wire(msg.spec)
            p = plan(self.spec, dst)
            if msg.rank >= dst.tp:
                raise ProtocolError(f"welcome: rank={msg.rank} is past the destination's tp={dst.tp}")
            piece = next((x for x in p.targets_of(self.rank) if x.dst_rank == msg.rank), None)
            if piece is None:  # another source rank covers this destination rank
                conn.close()
                self._call(lambda: self._set_idle(msg.engine, p, msg.rank, (host, port), conn))
                return None
            check_welcome_proof(msg, token, nonce)
            if msg.slot_bytes is None or (msg.metadata is None and self.transport.reads_offered):
                raise ProtocolError("welcome lacks the destination's slot size, or the metadata its offers need")
            warm = self._warm_offer(msg.metadata)
            offer = self._offer(p, msg, warm[0] if warm else None)
            conn.send(offer.to_wire())
            opened = self._await_opened(conn, warm[1] if warm else None)
        except TransferFailed:
            conn.close()
            raise
        except (OSError, ConnectionError, KVStageError, ValueError) as e:
            conn.close()
            raise TransferFailed("-", f"destination {peer}", "handshake", str(e)) from e
        conn.sock.settimeout(None)
        self._call(lambda: self._add_target(msg, p, piece, conn, opened, (host, port)))
        self._watch(conn)
        return msg.rank

    def _warm_offer(self, metadata: bytes):
        """A two-sided transport: connect to the destination now and offer it the first 16 bytes of the arena,
        (ticket, handle), which it reads before its ``opened`` while this rank drives its transport: the
        connection's wire-up in both directions happens then, so no later read of a request waits for this
        process (a source stopped right after ``send`` is read all the same). None for a one-sided transport
        (the destination's first read of the arena does the same without an offer)."""
        if not self.transport.reads_offered:
            return None

        def offer():
            agent = self.transport.connect(metadata)
            return self.transport.offer(agent, Spans.single(self.arena_region, [0], [16]))

        return self._here(offer)

    def _offer(self, p: TransferPlan, welcome: Welcome, warm: bytes | None = None) -> Offer:
        """What the destination may read of this rank: its arena, its KV buffers where a page path can
        read them, and on this host its shared pages and event (ipc)."""
        kv = []
        if self._reads_pages() and (p.direct or self.cache.device.type == "cpu"):
            kv = [r.to_wire() for r in self.kv_regions()]
        ipc = None
        same_host = link_context(self.facts, welcome.facts).same_host if isinstance(welcome.facts, dict) else None
        if self._ipc is not None and same_host is True and "ipc" in (welcome.paths or ()):
            ipc = {"buffers": self._ipc["buffers"], "event": _b64(self._ipc["event"].handle())}
        return Offer(self.arena_region.to_wire(), kv, ipc, warm)

    def _await_opened(self, conn: Connection, warm=None) -> Opened:
        """The destination's ``opened``, while this rank's transport is driven: the destination's first read
        of the arena (its connection's wire-up) needs this process's transport to answer. A source receives
        no notifications, so draining them is only the drive. ``warm``: the handle of a two-sided transport's
        warm offer (``_warm_offer``), released once its reader took it."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        answer = select.poll()  # not select(2): it sees no descriptor past 1023
        answer.register(conn.sock, select.POLLIN)
        try:
            while not answer.poll(1):  # milliseconds
                if time.monotonic() > deadline:
                    raise ProtocolError(f"no opened within {HANDSHAKE_TIMEOUT_S:g} s")
                self._here(self.transport.notifications)
            opened = _expect(conn, Opened)
            while warm is not None and self._here(lambda: self.transport.poll(warm)) is WriteState.PENDING:
                if time.monotonic() > deadline:
                    raise ProtocolError(f"the destination did not take the first read within {HANDSHAKE_TIMEOUT_S:g} s")
                time.sleep(0.0005)
            return opened
        finally:
            if warm is not None:
                self._here(lambda: (self.transport.abandon(warm), self.transport.release(warm)))

    def _set_idle(self, engine: str, p: TransferPlan, rank: int, address: tuple, conn: Connection) -> None:
        self._engine(engine, p, conn)
        remember(self._idle, address, (engine, rank), MAX_IDLE_ADDRESSES)

    # -- loop thread -----------------------------------------------------------
    def _engine(self, engine: str, p: TransferPlan, conn: Connection) -> DestinationEngine:
        """The decode engine ``engine`` with plan ``p``: one engine's ranks share one spec. An engine
        none of whose ranks is connected any more may come back with another."""
        eng = self.engines.get(engine)
        if eng is not None and p.dst != eng.plan.dst:
            if eng.targets:
                conn.close()
                raise TransferFailed(
                    "-",
                    conn.peer,
                    "handshake",
                    f"destination spec {p.dst} differs from "
                    f"{eng.plan.dst}, which engine {engine!r}'s other ranks connected with",
                )
            eng = None
        if eng is None:
            eng = self.engines[engine] = DestinationEngine(engine, p)
            log.info("src %d: decode engine %r: %s -> %s", self.rank, engine, p.src, p.dst)
        return eng

    def _add_target(
        self, welcome: Welcome, p: TransferPlan, piece: Piece, conn: Connection, opened: Opened, address: tuple
    ) -> None:
        eng = self._engine(welcome.engine, p, conn)
        old = eng.targets.get(welcome.rank)
        if old is not None:  # the same identity again: the new connection replaces the old one
            self._replace_peer(old.conn, old.name, conn.peer)
            eng = self._engine(welcome.engine, p, conn)  # made anew if the old connection was its last
        # a one-sided transport's reads need nothing of the destination here: its metadata is not even loaded,
        # so this rank holds no key to the destination's memory; a two-sided one's offers go to its endpoint
        assert welcome.slot_bytes is not None  # _on_welcome refuses a welcome without it
        agent = ""
        if self.transport.reads_offered:
            assert welcome.metadata is not None  # _on_welcome refuses a welcome without it for this transport
            agent = self.transport.connect(welcome.metadata)
        name = rank_name(welcome.engine, "destination", welcome.rank)
        conn.peer = f"{name} ({conn.peer})"
        paths = _allowed(self.settings) & frozenset(Path(x) for x in (welcome.paths or ()) if x in route.PATH_SETTINGS)
        target = eng.targets[welcome.rank] = Target(
            welcome.engine,
            welcome.rank,
            conn,
            agent,
            p,
            piece,
            address,
            opened.ipc,
            paths,
            max(1, welcome.slot_bytes // max(1, p.dst_token_bytes())),
        )
        self._targets[conn] = target
        self._pinged_peer(conn)
        if opened.ipc:
            log.info(
                "src %d: %s opened this rank's KV pages (CUDA IPC): it reads them in one pass", self.rank, conn.peer
            )
        elif self._ipc is not None and opened.reason:
            log.info("src %d: %s did not open this rank's KV pages (%s)", self.rank, conn.peer, opened.reason)
        log.debug(
            "src %d: connected to %s, heads %d..%d, buffers %d..%d",
            self.rank,
            conn.peer,
            piece.heads.start,
            piece.heads.stop,
            piece.buffers.start,
            piece.buffers.stop,
        )
        self._log_link(welcome.facts, conn.peer, None, pages=False, label=peer_label(welcome.engine, welcome.rank))
        for out in list(self.requests.values()):  # requests sent to any engine before this one connected
            if out.engine is None and out.bound is None and not out.handle.done():
                self._announce(out, [target])

    def _add(
        self,
        handle: TransferHandle,
        pages: np.ndarray,
        engine: str | None,
        caller=None,
        group: range | None = None,
        span: range | None = None,
        total: int = 0,
    ) -> None:
        """A sent request or part of one (caller's thread, state lock held): route it to each destination rank,
        gather what the read path needs into free slots, record the ready event, say ``ready``."""
        key = (engine, handle.req, part_key(group, span))
        for k, other in self.requests.items():
            if (
                k[1] == handle.req
                and (engine is None or k[0] in (engine, None))
                and overlaps(other.layers, group)
                and overlaps(other.span, span)
            ):
                what = "" if group is None else f"layers {group.start}..{group.stop} of "
                what += "" if span is None else f"tokens {span.start}..{span.stop} of "
                raise ValueError(f"{what}request {handle.req!r} already in flight on source rank {self.rank}")
        if engine is not None:
            eng = self.engines.get(engine)
            if eng is None:
                known = ", ".join(repr(e) for e in self.engines) or "none"
                raise TransferFailed(
                    handle.req,
                    "-",
                    "send",
                    f"not connected to any destination rank of engine "
                    f"{engine!r} (engines connected: {known}); call connect() first",
                )
            want = [x.dst_rank for x in eng.plan.targets_of(self.rank) if group_piece(eng.plan, x, group) is not None]
            missing = [d for d in want if d not in eng.targets]
            if missing:
                raise TransferFailed(
                    handle.req,
                    f"destination ranks {missing}" + (f" of engine {engine}" if engine else ""),
                    "send",
                    "not connected",
                )
            if not want:  # replicas or layer shares: other source ranks serve this engine (or these layers)
                handle._move(State.DONE)
                return
            targets = [eng.targets[d] for d in want]
        else:
            targets = [t for t in self._targets.values() if group_piece(t.plan, t.piece, group) is not None]
        self._finished.pop(key, None)
        out = Outgoing(handle, pages, engine, layers=group, span=span, total=total)
        last = out.final(self.spec.geometry.layers)  # else a later part still needs the abort
        if self._take_abort(key[:2], handle, keep=not last):  # every destination hears of it
            assert handle.error is not None  # a new handle, failed by _take_abort just now
            for t in targets:
                self._tell(t, Abort(handle.req, handle.error.cause))
            return
        self.requests[key] = out
        if caller is not None:
            self._order_after_caller(out, caller)
        self._announce(out, targets)
        if not out.targets and engine is not None:
            self._maybe_forget(out)

    def _order_after_caller(self, out: Outgoing, caller) -> None:
        """On CUDA, what reads the pages follows the work queued on the caller's stream (the forward that
        wrote them): the gathers (on the copies' stream, current here) wait on it, and the ready event is
        recorded on it."""
        import torch

        copies = torch.cuda.current_stream(self.cache.device)
        if copies != caller:
            copies.wait_stream(caller)
        out.caller_stream = caller

    def _announce(self, out: Outgoing, targets: list) -> None:
        """Route ``out`` to each of ``targets`` it has a piece for, gather what its read routes need, and say
        ``ready``."""
        routed = []
        for t in targets:
            if out.piece_of(t) is None:  # a layer group this rank holds none of for ``t`` (layer shares)
                continue
            r = self._route(out, t)
            if r.path is None:
                return self._fail(out.key, t.name, "route", r.reason, tell=True)
            out.targets[(t.engine, t.rank)] = r.path
            routed.append((t, r.path))
        reads = [t for t, path in routed if path is Path.READ]
        gather = bool(reads) and not out.chunks
        if gather:
            self._plan_read(out, reads)
        if any(path is Path.IPC for _, path in routed) and not out.event_recorded:
            self._ipc["event"].record(out.caller_stream)
            out.event_recorded = True
        for t, path in routed:
            self._tell(t, self._ready_message(out, t, path))
            out.told.add((t.engine, t.rank))
        if gather:  # each chunk is announced as it is gathered: the destination reads the first meanwhile
            for c in out.chunks:
                if not self._gather(out, c):
                    c.blocked = time.perf_counter()
                    self._waiting.append((out, c))
                elif c.gathered:
                    self._announce_chunk(out, c)
        if self._gathering:
            self._finish_here(out)
        out.touched = time.monotonic()
        if out.handle.state is State.PENDING and routed:
            out.handle.path = ",".join(sorted({p.value for _, p in routed}))

    def _announce_chunk(self, out: Outgoing, c: SrcChunk) -> None:
        """Tell every read destination rank told of ``out`` (and not passed over) that chunk ``c`` is gathered."""
        for t in self._read_targets(out):
            if (t.engine, t.rank) in out.told and (out.bound is None or out.bound == t.engine):
                index, offset, ticket = self._listing(out, c, t)
                self._tell(
                    t, Chunk(out.handle.req, index, offset, _unb64(ticket) or None, out.layers_wire, out.span_wire)
                )

    def _route(self, out: Outgoing, t: Target) -> route.Route:
        """``route.choose`` for this request to ``t``, logged once per destination rank and path."""
        memory = "cuda" if self.cache.device.type == "cuda" else "cpu"
        piece, spec = out.piece_of(t), self.spec
        assert piece is not None  # _announce routes only the targets it has a piece for
        nbytes = t.plan.piece_token_bytes(piece) * out.handle.tokens
        runs = route.page_runs(out.pages) * len(piece.buffers)
        page_spans = _page_span_count(spec, out.pages, out.handle.tokens, piece) if memory == "cpu" else 0
        box = region_box([piece] if out.engine is not None else None, spec, out.buffers(t.plan))
        per = min(self.slot_bytes // box.token_bytes, t.capacity)
        fits = per > 0 and -(-out.handle.tokens // per) <= self.arena.allocator.free
        link = route.Link(
            memory,
            t.ipc,
            bool(self._kv_regions),
            t.plan.direct,
            self.transport.read_span_cost_s.get(memory, 0.0),
            t.paths,
        )
        if not t.paths:
            return route.Route(
                None,
                f"path={self.settings.path} is not allowed to this destination rank: a page path "
                "needs KVSTAGE_AUTH_TOKEN on both sides (its KV pages are read only by a peer that "
                "presented the token), and both sides' path settings must allow it",
            )
        r = route.choose(link, route.Request(nbytes, runs, page_spans, fits))
        key = (t.engine, t.rank, r.path)
        if r.path is not None and key not in self._routes:
            remember(self._routes, key, True, MAX_IDLE_ADDRESSES)
            log.info(
                "src %d: requests to %s go %s: %s (first: %s)", self.rank, t.name, r.path, r.reason, out.handle.req
            )
        return r

    def _read_targets(self, out: Outgoing) -> list:
        return [t for t in self._targets.values() if out.targets.get((t.engine, t.rank)) is Path.READ]

    def _plan_read(self, out: Outgoing, reads: list) -> None:
        """Cut ``out`` into chunks for the read path. A request sent to any engine gathers this rank's whole
        shard, which every engine's pieces lie in."""
        pieces = [p for p in (out.piece_of(t) for t in reads) if p is not None] if out.engine is not None else None
        assert pieces is None or len(pieces) == len(reads)  # every read target was routed: it has a piece
        out.box = region_box(pieces, self.spec, out.buffers(reads[0].plan))
        capacity = min(t.capacity for t in reads)
        out.chunks = plan_chunks(
            out.handle.tokens,
            self.slot_bytes // out.box.token_bytes,
            capacity,
            self.spec.page.page_size,
            [t.plan.dst.page.page_size for t in reads],
        )
        if self.cache.device.type == "cuda" and out.kernel_pages is None:
            out.kernel_pages = upload_pages(self.cache, out.pages, checked=True)

    def _gather(self, out: Outgoing, c: SrcChunk) -> bool:
        """Gather chunk ``c`` into a free slot; False where none is free (it waits for one)."""
        slot = self.arena.allocator.acquire()
        if slot is None:
            return False
        assert out.box is not None  # _plan_read made it with the chunks
        c.slot, c.offset = slot, self.arena.offset(slot)
        t0 = time.perf_counter()
        idx = TokenIndex(self.cache, out.pages, c.start, c.count, out.kernel_pages)
        region = self.arena.view(c.offset, out.box.nbytes(c.count))
        try:
            fence = CopyFence(self.cache.device)
            gather(self.cache, idx, [out.box.piece()], region)
            c.fence = fence.close()
        except Exception as e:
            self.arena.allocator.release(slot)
            c.slot = None
            self._fail(out.key, "local", "gather", f"{type(e).__name__}: {e}", tell=True)
            return True
        took = time.perf_counter() - t0
        out.handle.stages["gather"] += took
        self.metrics.stage("gather", took)
        if c.fence.done():
            c.gathered = True
        else:
            self._gathering.append((out, c))
        log.debug(
            "src %d: %s chunk %d gathered into slot %d%s",
            self.rank,
            out.handle.req,
            c.index,
            slot,
            "" if c.gathered else " (launched)",
        )
        return True

    def _ready_message(self, out: Outgoing, t: Target, path: Path) -> Ready:
        """The ``ready`` for destination rank ``t``: its path and what that path reads."""
        if path is not Path.READ:
            return Ready(
                out.handle.req,
                out.total or out.handle.tokens,
                path.value,
                out.pages.tolist(),
                layers=out.layers_wire,
                span=out.span_wire,
            )
        listed = [self._listing(out, c, t) for c in out.chunks if c.gathered]
        assert out.box is not None  # a read-path request: _plan_read made its box
        return Ready(
            out.handle.req,
            out.total or out.handle.tokens,
            path.value,
            None,
            out.chunks[0].count if out.chunks else None,
            len(out.chunks),
            listed,
            out.box.order.value,
            out.layers_wire,
            out.span_wire,
        )

    def _listing(self, out: Outgoing, c: SrcChunk, t: Target) -> list:
        """[index, offset, ticket] of ``t``'s piece of gathered chunk ``c``: where it lies in this arena, and
        for a two-sided transport the offer its receive matches."""
        piece = out.piece_of(t)
        assert out.box is not None and piece is not None  # a read target's chunk: planned, and it has a piece
        offset, nbytes = out.box.piece_span(piece, c.count)
        ticket = b""
        if self.transport.reads_offered:
            ticket, handle = self.transport.offer(
                t.agent, Spans.single(self.arena_region, [c.offset + offset], [nbytes])
            )
            c.offers.append(handle)
        c.readers.setdefault(t.engine, set()).add(t.rank)
        return [c.index, c.offset + offset, _b64(ticket)]

    def _finish_here(self, out: Outgoing) -> None:
        """On CUDA: wait up to ``SEND_WAIT_S`` on the caller's thread for ``out``'s gathers that started on
        the device, and announce them from here (the loop does it otherwise)."""
        mine = [c for o, c in self._gathering if o is out]
        if not mine or not all(c.fence.started() for c in mine):
            return
        deadline = time.perf_counter() + SEND_WAIT_S
        while not all(c.fence.done() for c in mine) and time.perf_counter() < deadline:
            pass
        self._poll_gathers()

    def _poll_gathers(self) -> None:
        """Announce every chunk whose gather has passed its fence to the destination ranks told of its request."""
        still = []
        for out, c in self._gathering:
            if not c.fence.done():
                still.append((out, c))
                continue
            c.gathered = True
            gpu = c.fence.gpu_seconds()
            if gpu is not None:
                out.handle.stages["gather_gpu"] = out.handle.stages.get("gather_gpu", 0.0) + gpu
            if not out.handle.done():
                self._announce_chunk(out, c)
        self._gathering = still

    def _busy(self) -> bool:
        return bool(
            self._gathering or self._draining or any(c.offers for out in self.requests.values() for c in out.chunks)
        )

    def _idle_wait(self) -> float:
        return DRIVE_S if self._readable() else super()._idle_wait()

    def _readable(self) -> bool:
        """Whether a request in flight may be read with this rank's transport (any path but ipc). Its loop then
        drives the transport: over UCX's tcp a destination's read completes only as the source's UCX answers
        (its flush, a get), which needs this process to progress its worker; over shared memory, cma or RDMA
        nothing waits for it, and a stopped source is read all the same."""
        return any(p is not Path.IPC for out in self.requests.values() for p in out.targets.values())

    def _copying(self):
        return next((c.fence for _, c in self._gathering if not c.fence.done()), None)

    def _progress(self) -> None:
        self._poll_gathers()
        self._poll_offers()
        if self._readable():
            self.transport.notifications()  # the drive (``_readable``): a source receives no notifications
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            self.arena.allocator.release(self._held.pop(0)[1])
        while self._waiting:
            out, c = self._waiting[0]
            if out.handle.done():
                self._waiting.popleft()
                continue
            if not self._gather(out, c):
                return  # back-pressure: wait for the destination to read a slot
            self._waiting.popleft()
            waited = time.perf_counter() - c.blocked
            out.handle.stages["slot_wait"] += waited
            self.metrics.stage("slot_wait", waited)
            if c.gathered:
                self._announce_chunk(out, c)

    def _poll_offers(self) -> None:
        """Two-sided transports: an offer is over once its reader took the bytes; a chunk's slot returns once
        every reader said ``read`` and every offer of it is over (a done request's too: its ``done`` may come
        before this side saw its offers end)."""
        for out in list(self.requests.values()) + self._draining:
            for c in out.chunks:
                if not c.offers:
                    continue
                pending = []
                for h in c.offers:
                    try:
                        over = self.transport.poll(h) is not WriteState.PENDING
                    except KVStageError:
                        over = True  # a failed offer: its reader's read fails too, and says so
                    if over:
                        self.transport.release(h)
                    else:
                        pending.append(h)
                c.offers = pending
                self._maybe_free(out, c)
        for out in self._draining:  # done: every reader has read every chunk; a slot returns with its offers
            for c in out.chunks:
                if c.slot is not None and not c.offers:
                    self.arena.allocator.release(c.slot)
                    c.slot = None
        self._draining = [out for out in self._draining if any(c.slot is not None for c in out.chunks)]

    # -- messages --------------------------------------------------------------
    def _on_message(self, conn: Connection, msg: Message) -> None:
        target = self._targets.get(conn)
        if target is None:
            return
        if isinstance(msg, Read):
            # taken only once the read is checked
            out = self._request_of(target, msg.req, msg.group, msg.tokens_span, take=False)
            if not 0 <= msg.index < len(out.chunks):
                raise ProtocolError(f"read of chunk {msg.index} of {msg.req!r}, which has {len(out.chunks)} chunks")
            c = out.chunks[msg.index]
            readers = c.readers.get(target.engine, set())
            if target.rank not in readers:
                raise ProtocolError(
                    f"read of chunk {msg.index} of {msg.req!r}, which {target.name} was not offered or read already"
                )
            self._take(out, target)
            readers.discard(target.rank)
            out.touched = time.monotonic()
            self._maybe_free(out, c)
        elif isinstance(msg, Done):
            out = self._request_of(target, msg.req, msg.group, msg.tokens_span)
            out.done.add(target.rank)
            out.touched = time.monotonic()
            log.debug("src %d: %s done at %s", self.rank, msg.req, target.name)
            self._maybe_done(out)
        elif isinstance(msg, Abort):  # the whole request: every layer group of it
            outs = self._groups_of(target.engine, msg.req)
            cause = "destination aborted: " + msg.reason
            if not any(o.final(self.spec.geometry.layers) for o in outs):
                self._remember_abort((target.engine, msg.req), target.name, cause)  # for the parts not sent yet
            for out in outs:
                if out.bound in (None, target.engine):  # a destination aborts only what it was to read
                    self._fail(out.key, target.name, "abort", cause, tell=True, answered=target)
        elif isinstance(msg, Error):
            log.warning("src %d: %s refused our %s: %s", self.rank, conn.peer, msg.about, msg.reason)
            for out in self._groups_of(target.engine, msg.req) if msg.req else ():
                self._fail(out.key, conn.peer, str(msg.about), f"refused: {msg.reason}", tell=False)
        else:
            raise ProtocolError(f"{msg.TYPE} message from a destination")

    def _lookup(self, engine: str, req: str, group: range | None = None, span: range | None = None) -> Outgoing | None:
        g = part_key(group, span)
        return self.requests.get((engine, req, g)) or self.requests.get((None, req, g))

    def _groups_of(self, engine: str, req: str) -> list[Outgoing]:
        """Every part of ``req`` in flight to ``engine`` (or to any engine), in token then layer order."""
        outs = [o for k, o in self.requests.items() if k[1] == req and k[0] in (engine, None)]
        return sorted(
            outs, key=lambda o: (-1 if o.span is None else o.span.start, -1 if o.layers is None else o.layers.start)
        )

    def _request_of(
        self, target: Target, req: str, group: range | None = None, span: range | None = None, take: bool = True
    ) -> Outgoing:
        """The in-flight request ``req`` (its part: layer group ``group``, token span ``span``) a message of
        ``target`` names, with ``take`` taken by its engine (``_take``)."""
        out = self._lookup(target.engine, req, group, span)
        if out is None:
            g = part_key(group, span)
            what = f"request {req!r}" + ("" if group is None else f" layers {group.start}..{group.stop}")
            what += "" if span is None else f" tokens {span.start}..{span.stop}"
            if (target.engine, req, g) in self._finished or (None, req, g) in self._finished:
                raise ProtocolError(f"{what} already {self._finished.get((target.engine, req, g), 'finished')} here")
            raise ProtocolError(f"{what} is not in flight here")
        if (target.engine, target.rank) not in out.told:
            raise ProtocolError(f"request {req!r} was not offered to {target.name}")
        if out.bound not in (None, target.engine):
            raise ProtocolError(f"request {req!r} was taken by engine {out.bound!r}")
        if take:
            self._take(out, target)
        return out

    def _take(self, out: Outgoing, target: Target) -> None:
        """``target``'s engine reads ``out``: one sent to any engine is taken by it (the others hear
        ``abort``), and the request is under way."""
        req = out.handle.req
        if out.bound is None:
            out.bound = target.engine
            log.debug("src %d: %s taken by engine %r", self.rank, req, target.engine)
            for t in self._targets.values():
                if t.engine != target.engine and (t.engine, t.rank) in out.told:
                    self._tell(t, Abort(req, f"taken by engine {target.engine!r}"))
                    out.targets.pop((t.engine, t.rank), None)
            for c in out.chunks:
                for e in [e for e in c.readers if e != target.engine]:
                    del c.readers[e]
                self._maybe_free(out, c)
        if out.handle.state is State.PENDING:
            out.handle._move(State.TRANSFERRING)

    def _maybe_free(self, out: Outgoing, c: SrcChunk) -> None:
        """Return chunk ``c``'s slot once the engine that reads it has (every rank's ``read``, every offer over)."""
        if c.slot is None or c.offers or not c.gathered or out.bound is None or c.readers.get(out.bound):
            return
        if (out.bound, c.index) in out.freed:
            return
        self.arena.allocator.release(c.slot)
        c.slot = None
        out.freed.add((out.bound, c.index))
        log.debug("src %d: %s chunk %d read: slot free", self.rank, out.handle.req, c.index)

    def _maybe_done(self, out: Outgoing) -> None:
        want = {d for (e, d) in out.targets if e == out.bound}
        if out.handle.done() or not want or not want <= out.done:
            return
        for c in out.chunks:  # every reader reported every chunk it read (``done`` follows its last ``read``)
            if c.slot is not None and not c.offers:
                self.arena.allocator.release(c.slot)
                c.slot = None
        if any(c.slot is not None for c in out.chunks):  # offers not over yet (``_poll_offers``)
            self._draining.append(out)
        out.handle.bytes = sum(out_bytes(out, t) for t in self._targets.values() if (t.engine, t.rank) in out.targets)
        out.handle._move(State.DONE)
        seconds = out.handle.seconds
        assert seconds is not None  # DONE just now: its end time is set
        self.metrics.request_finished(peer_label(out.bound), True, seconds, out.handle.bytes)
        self._maybe_forget(out)

    def _tell(self, t: Target, msg: Message) -> None:
        try:
            t.conn.send(msg.to_wire())
        except OSError as e:
            log.debug("src %d: send to %s failed: %s", self.rank, t.name, e)

    def _drop_target(self, out: Outgoing, t: Target) -> None:
        """An engine that did not take a request sent to any engine lets it go (aborted there, or gone)."""
        out.targets.pop((t.engine, t.rank), None)
        out.told.discard((t.engine, t.rank))
        for c in out.chunks:
            readers = c.readers.get(t.engine)
            if readers is not None:
                readers.discard(t.rank)

    # -- failures --------------------------------------------------------------
    def _fail(self, key: tuple, peer: str, stage: str, cause: str, tell: bool, answered: Target | None = None) -> None:
        out = self.requests.get(key)
        if out is None or out.handle.done():
            return
        req = out.handle.req
        out.handle._fail(peer, stage, cause)
        label = peer_label(out.bound or out.engine or "")
        self.metrics.failure(label, stage, cause)
        self.metrics.request_finished(label, False, 0.0, out.handle.bytes)
        log.warning("src %d: request %s failed at %s with %s: %s", self.rank, req, stage, peer, cause)
        readers = set()
        for t in self._targets.values():
            if (t.engine, t.rank) in out.told:
                if tell and t is not answered:
                    self._tell(t, Abort(req, cause))
                if t is not answered:
                    readers.add((t.engine, t.rank))
        self._waiting = collections.deque((o, c) for o, c in self._waiting if o is not out)
        for c in out.chunks:
            for h in c.offers:
                self.transport.abandon(h)
                self.transport.release(h)
            c.offers = []
            if c.slot is not None and c.fence is not None and not c.fence.done():
                c.fence.wait()  # the gather into it ends before the slot is anyone else's
            if c.slot is not None:
                if readers and c.gathered:  # a destination may have posted a read of it
                    self._held.append((time.monotonic() + ABORT_HOLD_S, c.slot))
                else:
                    self.arena.allocator.release(c.slot)
                c.slot = None
        self._gathering = [(o, c) for o, c in self._gathering if o is not out]
        self._maybe_forget(out)

    def _maybe_forget(self, out: Outgoing) -> None:
        if out.handle.done():
            self.requests.pop(out.key, None)
            remember(self._finished, out.key, out.handle.state.value, MAX_FINISHED)

    def _on_closed(self, conn: Connection, reason: str, answered: bool) -> None:
        target = self._targets.pop(conn, None)
        conn.close()
        if target is None:
            return
        eng = self.engines[target.engine]
        if eng.targets.get(target.rank) is target:
            del eng.targets[target.rank]
        if target.agent:
            self.transport.disconnect(target.agent)
        hit = []
        for key, out in list(self.requests.items()):
            if (target.engine, target.rank) not in out.targets:
                continue
            if out.engine is None and out.bound is None:
                self._drop_target(out, target)
            else:
                hit.append(key)
        (log.warning if hit else log.info)(
            "src %d: %s disconnected (%s), %d requests affected", self.rank, target.name, reason, len(hit)
        )
        for key in hit:
            self._fail(key, target.name, "read", f"connection lost ({reason})", tell=True, answered=target)
        if not eng.targets and not any(
            out.bound == eng.name or out.engine == eng.name for out in self.requests.values()
        ):
            del self.engines[target.engine]  # connected again later, possibly with another spec
            log.info("src %d: decode engine %r has no rank connected any more", self.rank, target.engine)

    def _peers(self) -> list:
        return list(self._targets)

    def _stats(self) -> EndpointStats:
        return dataclasses.replace(super()._stats(), engines=len(self.engines))

    def _check_stalls(self, now: float) -> None:
        """A request no destination started reading within ``ready_timeout_s`` fails; one a destination
        reads that makes no progress for ``stall_timeout_s`` while it runs fails; a destination silent for
        ``peer_timeout_s`` (no ping) fails its requests."""
        for t in list(self._targets.values()):
            quiet = self._silent(t.conn, now)
            if quiet is None:
                continue
            for key, out in list(self.requests.items()):
                if (t.engine, t.rank) in out.targets and out.bound in (None, t.engine) and out.engine is not None:
                    self._fail(
                        key,
                        t.name,
                        "read",
                        f"no control message for {quiet:.1f} s: the destination is "
                        "stopped or hung, or the link is down",
                        tell=True,
                    )
        for key, out in list(self.requests.items()):
            waited = now - out.touched
            if out.bound is None or out.handle.state is State.PENDING:  # no destination started reading it
                if waited > self.settings.ready_timeout_s:
                    self._fail(
                        key,
                        "destination",
                        "waiting for a reader",
                        f"no destination started reading it within {self.settings.ready_timeout_s:g} s",
                        tell=True,
                    )
                continue
            if waited <= min(SLOW_S, self.settings.stall_timeout_s):
                continue
            eng = self.engines.get(out.bound)
            late = [
                t
                for t in (eng.targets.values() if eng else ())
                if (t.engine, t.rank) in out.targets and t.rank not in out.done
            ]
            running = bool(late) and all(
                self._peer_running(t.conn, now, out.touched + min(SLOW_S, self.settings.stall_timeout_s)) for t in late
            )
            if not out.slow:
                out.slow = True
                self.metrics.slow(peer_label(out.bound), "read")
                log.warning(
                    "src %d: request %s is slow: no destination progress for %.1f s (%s)",
                    self.rank,
                    out.handle.req,
                    waited,
                    "it runs" if running else "it is alive, busy: its loop does not turn",
                )
            if (
                waited > self.settings.stall_timeout_s
                and late
                and all(self._peer_running(t.conn, now, out.touched + self.settings.stall_timeout_s) for t in late)
            ):
                self._fail(
                    key,
                    late[0].name,
                    "read",
                    f"no progress for {self.settings.stall_timeout_s:g} s while the destination runs",
                    tell=True,
                )

    def _forgive(self, gap: float) -> None:
        for out in self.requests.values():
            out.touched += gap
        self._held = [(t + gap, s) for t, s in self._held]

    def _shutdown(self) -> None:
        for key in list(self.requests):
            self._fail(key, "local", "shutdown", "source closed", tell=True)
        for t in list(self._targets.values()):
            t.conn.close()
        super()._shutdown()

    @property
    def slot_bytes(self) -> int:
        return self.arena.slot_bytes


def _allowed(settings) -> frozenset:
    """The paths this rank's settings allow: ``path`` (auto: all), with no page path without a token."""
    paths = route.allowed_paths(settings.path)
    return paths if settings.auth_token else paths & {Path.READ}


def _page_span_count(spec, pages: np.ndarray, tokens: int, piece: Piece) -> int:
    """Spans a destination's pages read of ``piece`` would post (the route's estimate)."""
    from kvstage.staging.region import RegionPiece
    from kvstage.staging.spans import cheapest_order, piece_spans

    order = cheapest_order(spec, piece.heads.count)
    rp = RegionPiece(piece.src_offset, piece.heads.count, piece.buffers, 0, order)
    return len(piece_spans(spec, pages, 0, tokens, rp)[0])


def out_bytes(out: Outgoing, t: Target) -> int:
    piece = out.piece_of(t)
    return 0 if piece is None else t.plan.piece_token_bytes(piece) * out.handle.tokens


def _expect(conn: Connection, cls):
    """The next message on a handshaking connection, which must be a ``cls`` (an ``error`` is a refusal). A
    ping is passed over: the destination pings a source from its hello on, so one may come before its answer."""
    try:
        msg = decode(conn.recv())
        while isinstance(msg, Ping):
            msg = decode(conn.recv())
    except TimeoutError:  # the socket's timeout is the handshake's
        raise ProtocolError(f"no {cls.TYPE} within {HANDSHAKE_TIMEOUT_S:g} s: timed out") from None
    if isinstance(msg, Error):
        log.warning("destination %s refused this source: %s", conn.peer, msg.reason)
        raise TransferFailed("-", f"destination {conn.peer}", "handshake", f"refused: {msg.reason}")
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected {cls.TYPE}, got {msg.TYPE}")
    return msg


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode() if data else ""


def _unb64(text: str) -> bytes:
    import base64

    return base64.b64decode(text) if text else b""
