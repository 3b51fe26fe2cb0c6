"""The source (prefill) side: announces requests, gathers and writes granted chunks.

For each grant the source gathers its piece of the chunk (its head slice, the
chunk's tokens, all layers, K and V) into a slot of its own arena and issues
one write into the granted destination slot, with a notice that lands after
the bytes. Its own arena is back-pressure too: a grant waits for a free slot.
When the destination shares its arena and this process can map it (same
host: CUDA IPC, or shared memory with ``mapped="on"``), the gather goes
straight into the granted slot there and a ``landed`` control message
replaces the write and its notice. A transport that walks many spans at the
cost of one (``Transport.gathers``: ``cma``) writes the chunk straight from
this rank's pages into the granted slot, with no gather and no slot here.

One source serves any number of decode engines, each with its own plan (its
own TP size): a destination is known by its engine (the id its welcome names)
and rank, a request by that engine and its id. A destination is connected
once; later ``connect`` calls to the same address reuse the connection.

A destination grants the first chunks of a request as soon as it expects it,
often before this side's ``send``: such grants are checked on arrival and held
until the request is sent (its first gather then starts at once), or until
that destination aborts the request or goes away.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass, field as dc_field

import numpy as np

from kvstage.errors import ConfigError, KVStageError, ProtocolError, TransferFailed
from kvstage.layout import pages_needed
from kvstage.link.context import link_context
from kvstage.protocol.endpoint import (SLOW_S, Endpoint, EndpointStats, check_engine, check_pages, peer_label, rank_name,
                                      remember)
from kvstage.protocol.handshake import (HANDSHAKE_TIMEOUT_S, check_model, check_transport, check_version, md_from_wire,
                                        md_to_wire, peer_engine, spec_from_wire, spec_to_wire)
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.wire import PROTOCOL_VERSION, Connection, field, notice_fields
from kvstage.protocol.writes import (DirectPageRuns, FromPages, InFlight, MappedGather, PlacedPages, StagedWrite,
                                     WritePath)
from kvstage.staging.arena import ArenaSize
from kvstage.staging.copy import upload_pages
from kvstage.staging.cuda_place import PlacedCopier, PlacedDestination
from kvstage.staging.mapped import MappedArena, MappingError, open_shared
from kvstage.staging.shared_buffers import OpenedBuffers, open_buffers
from kvstage.tp import Piece, TransferPlan, plan
from kvstage.transports.base import Region, WriteState

log = logging.getLogger("kvstage")

MAX_HELD = 4096  # grants kept for requests not sent here yet
MAX_FINISHED = 4096  # finished request ids remembered, so a late grant for one is refused, not held
#: destination addresses remembered that this rank writes nothing to (another source rank covers them),
#: so a later ``connect`` to them needs no handshake
MAX_IDLE_ADDRESSES = 1024
#: a ``send`` whose gathers are the whole request (a small one, granted early, into mapped arenas) waits
#: this long on the caller's thread for them and says ``landed`` from there: the loop would first have
#: to wake, which takes longer on a GPU host than such a gather
SEND_WAIT_S = 200e-6


@dataclass
class Target:
    engine: str
    rank: int
    conn: Connection
    agent: str
    plan: TransferPlan
    piece: Piece
    arena: Region
    kv: list[Region]
    address: tuple = ()  # (host, port) it was connected at
    mapped: MappedArena | None = None  # the destination's arena mapped here: gathers go straight into it
    path: WritePath | None = None  # how its staged chunks go (decided at connect); direct grants go direct
    placed: "PlacedTarget | None" = None  # its KV pages opened here: direct-ipc grants write straight into them

    @property
    def name(self) -> str:
        return rank_name(self.engine, "destination", self.rank)


@dataclass
class PlacedTarget:
    """A destination rank's KV buffers opened here (``shared_buffers.open_buffers``) and the
    kernel's view of them: what a direct-ipc grant's head slices are stored into."""

    opened: OpenedBuffers
    copier: PlacedCopier
    destination: PlacedDestination


@dataclass
class DestinationEngine:
    """One decode engine's ranks as this source sees them: the plan from its welcomes, and the
    connected ranks this source writes to."""

    name: str
    plan: TransferPlan
    targets: dict = dc_field(default_factory=dict)  # destination rank -> Target


@dataclass
class Job:
    req: str
    dst: int
    chunk: int
    start: int
    count: int
    engine: str = ""  # the destination's engine
    ipc_pages: np.ndarray | None = None  # a direct-ipc grant: the destination's page ids of the request
    offset: int | None = 0  # in the destination's arena; None where no arena is written (direct, direct-ipc)
    pages: np.ndarray | None = None  # a direct grant: the destination's page ids
    ticket: bytes = b""  # from the destination's transport.expect (two-sided transports)
    queued: float = dc_field(default_factory=time.perf_counter)  # granted (or sent, for a held grant)
    blocked: float | None = None  # when it first found no free slot in this arena


@dataclass
class Outgoing:
    handle: TransferHandle
    pages: np.ndarray
    engine: str  # the decode engine it goes to
    chunks: dict = dc_field(default_factory=dict)  # dst rank -> chunks it will grant
    granted: dict = dc_field(default_factory=dict)  # dst rank -> set of chunk indices granted
    written: dict = dc_field(default_factory=dict)  # dst rank -> chunks fully written
    inflight: int = 0
    slow: bool = False  # said to be slow (once: ``Source._check_stalls``)
    stage: str = "waiting for grant"
    touched: float = dc_field(default_factory=time.monotonic)
    kernel_pages: object = None  # the page ids where the GPU copies read them (``upload_pages``), once at ``send``

    @property
    def key(self) -> tuple[str, str]:
        return self.engine, self.handle.req


class Source(Endpoint):
    """A source rank. ``connect`` it to the destination ranks of a decode engine, then ``send``
    to that engine; any number of decode engines (``engine``: this rank's own engine id, told to
    every destination, which names the requests it expects from it)."""

    role = "src"

    def __init__(self, cache, settings=None, transport=None, engine: str = "", model: str = ""):
        super().__init__(cache, settings, transport, engine, model)
        self.engines: dict[str, DestinationEngine] = {}
        self._targets: dict[Connection, Target] = {}  # every connected destination, by its control connection
        self._idle: dict[tuple, tuple[str, int]] = {}  # address this rank writes nothing to -> (engine, rank)
        self.requests: dict[tuple[str, str], Outgoing] = {}
        self._jobs: collections.deque[Job] = collections.deque()
        self._inflight: list = []  # writes.InFlight
        self._gathering: list = []  # writes.Gathering
        self._held: dict[tuple, dict] = {}  # (engine, req) not sent yet -> {(dst rank, chunk): (Job, chunks, tokens)}
        self._held_count = 0
        self._finished: dict[tuple, str] = {}  # (engine, req) -> final state, oldest first
        self._direct = DirectPageRuns(self)
        self._staged = FromPages(self) if self.transport.gathers else StagedWrite(self)
        self._mapped = MappedGather(self)
        self._placed = PlacedPages(self)
        self._placed_copiers: dict = {}  # destination spec -> PlacedCopier (one per peer engine's geometry)
        if self.transport.gathers:
            log.info("src %d: %s writes each chunk straight from the KV pages into the granted slot (no gather "
                     "into this rank's arena)", self.rank, self.transport.name)
        self._start()

    # -- public --------------------------------------------------------------
    def connect(self, addresses) -> list[int]:
        """Handshake with each destination rank at ``addresses`` (host, port) this source is not
        connected to yet; an address connected before is reused as it is.

        Keeps the connections to ranks this source writes to and returns their
        ranks. Raises ``TransferFailed`` when a destination refuses."""
        kept = []
        for host, port in addresses:
            address = (host, int(port))
            known = self._here(lambda: self._known(address))
            if known is None:
                known = self._handshake(host, int(port))
            if known is not None and known >= 0:
                kept.append(known)
        return kept

    def send(self, req: str, page_ids, tokens: int, engine: str = "") -> TransferHandle:
        """Send ``tokens`` tokens of request ``req`` held in ``page_ids`` (this rank's pages) to
        the ranks of decode engine ``engine`` (the id its destinations were made with)."""
        if not isinstance(req, str) or not 0 < len(req) <= 256:
            raise ValueError(f"req={req!r}: must be a non-empty string of at most 256 characters")
        check_engine(engine)
        pages = check_pages(self.cache, page_ids, tokens)
        handle = TransferHandle(req, "src", int(tokens))
        log.debug("src %d: %s sent by the caller, %d tokens", self.rank, req, tokens)
        key = (engine, req)
        handle._abort = lambda reason: self._post("call", lambda: self._fail(key, "local", "abort", reason, tell=True))
        self._here(lambda: self._add(handle, pages, engine))  # on this thread: it is awake, the loop may not be
        return handle

    def target_of(self, job: Job) -> Target | None:
        """The connected destination rank a granted job writes to (None once it is gone)."""
        eng = self.engines.get(job.engine)
        return eng.targets.get(job.dst) if eng is not None else None

    def _known(self, address: tuple) -> int | None:
        """The destination rank already connected at ``address`` (-1: known, written to by another
        source rank), or None: a handshake is needed."""
        for t in self._targets.values():
            if t.address == address and not t.conn.closed:
                return t.rank
        idle = self._idle.get(address)
        if idle is not None and idle[0] in self.engines:
            return -1
        return None

    # -- construction ------------------------------------------------------------
    def _arena_size(self, where: str) -> ArenaSize:
        """A transport that reads the pages itself (``gathers``) leaves this rank's arena unused:
        one page keeps its shape, not the rule's arena. The hello announces the rule's slot size
        either way: the destination cuts chunks to fit it."""
        size = super()._arena_size(where)
        self.slot_bytes = size.slot_bytes  # announced in the hello
        if self.transport.gathers:
            return ArenaSize(4096, 1, f"{self.transport.name} writes from the pages: one page kept; chunks cut to "
                                      f"{size.slot_bytes} B ({size.why})")
        return size

    # -- handshake (caller's thread; state changes go to the loop) -------------
    def _handshake(self, host: str, port: int) -> int | None:
        peer = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
        except OSError as e:
            raise TransferFailed("-", f"destination {peer}", "handshake", f"cannot connect: {e}") from e
        conn = Connection(sock, peer)
        try:
            conn.send({
                "type": "hello", "version": PROTOCOL_VERSION, "token": self.settings.auth_token, "engine": self.engine,
                "model": self.model, "uid": os.getuid(), "kv_ipc": self._asks_kv_ipc(),
                "spec": spec_to_wire(self.spec), "rank": self.rank, "agent": self.transport.id,
                "transport": self.transport.name,
                "metadata": md_to_wire(self.transport.metadata()), "slot_bytes": self.slot_bytes,
                "facts": self.facts, "kv_facts": self.kv_facts(),
            })
            msg = conn.recv()
        except (OSError, ConnectionError, ProtocolError) as e:
            conn.close()
            raise TransferFailed("-", f"destination {peer}", "handshake", f"no welcome: {e}") from e
        if msg["type"] == "error":
            conn.close()
            reason = str(msg.get("reason"))[:300]
            log.warning("src %d: destination %s refused this source: %s", self.rank, peer, reason)
            raise TransferFailed("-", f"destination {peer}", "handshake", f"refused: {reason}")
        try:
            if msg["type"] != "welcome":
                raise ProtocolError(f"expected welcome, got {msg['type']!r}")
            check_version(msg, "destination")
            check_transport(msg, self.transport.name, "destination")
            check_model(msg, self.model, "destination")
            engine = peer_engine(msg)
            dst = spec_from_wire(field(msg, "spec", dict))
            p = plan(self.spec, dst)
            rank = field(msg, "rank", int, minimum=0, maximum=dst.tp - 1)
            piece = next((x for x in p.targets_of(self.rank) if x.dst_rank == rank), None)
            if piece is None:  # another source rank covers this destination
                conn.close()
                self._call(lambda: self._set_idle(engine, p, rank, (host, port), conn))
                return None
            arena = Region.from_wire(field(msg, "arena", dict))
            kv = [Region.from_wire(r) for r in field(msg, "kv", list)]
            md = md_from_wire(field(msg, "metadata", str))
        except (KVStageError, ValueError) as e:
            conn.close()
            raise TransferFailed("-", f"destination {peer}", "handshake", str(e)) from e
        conn.sock.settimeout(None)
        self._call(lambda: self._add_target(engine, p, rank, conn, md, piece, arena, kv, msg, (host, port)))
        self._watch(conn)
        return rank

    # -- loop thread -----------------------------------------------------------
    def _engine(self, engine: str, p: TransferPlan, conn: Connection) -> DestinationEngine:
        """The decode engine ``engine`` with plan ``p``: one engine's ranks share one spec. An engine
        none of whose ranks is connected any more may come back with another."""
        eng = self.engines.get(engine)
        if eng is not None and p.dst != eng.plan.dst:
            if eng.targets:
                conn.close()
                raise TransferFailed("-", conn.peer, "handshake", f"destination spec {p.dst} differs from "
                                     f"{eng.plan.dst}, which engine {engine!r}'s other ranks connected with")
            eng = None
        if eng is None:
            eng = self.engines[engine] = DestinationEngine(engine, p)
            log.info("src %d: decode engine %r: %s -> %s", self.rank, engine, p.src, p.dst)
        return eng

    def _set_idle(self, engine: str, p: TransferPlan, rank: int, address: tuple, conn: Connection) -> None:
        self._engine(engine, p, conn)
        remember(self._idle, address, (engine, rank), MAX_IDLE_ADDRESSES)

    def _add_target(self, engine: str, p: TransferPlan, rank: int, conn: Connection, md: bytes, piece: Piece,
                    arena: Region, kv: list[Region], welcome: dict, address: tuple) -> None:
        eng = self._engine(engine, p, conn)
        if kv and len(kv) != len(self.cache.buffers):
            conn.close()
            raise TransferFailed("-", conn.peer, "handshake", f"destination offered {len(kv)} KV regions, need {len(self.cache.buffers)}")
        old = eng.targets.get(rank)
        if old is not None:  # the same identity again: the new connection replaces the old one
            self._replace_peer(old.conn, old.name, conn.peer)
            eng = self._engine(engine, p, conn)  # made anew if the old connection was its last
        facts = welcome.get("facts")
        mapped = self._map_arena(conn, arena, welcome.get("mapped"), facts)
        placed = self._open_pages(conn, welcome.get("kv_ipc"), facts, p)
        agent = self.transport.connect(md)
        name = rank_name(engine, "destination", rank)
        conn.peer = f"{name} ({conn.peer})"
        path = self._mapped if mapped is not None else self._staged
        target = eng.targets[rank] = Target(engine, rank, conn, agent, p, piece, arena, kv, address, mapped, path,
                                            placed)
        self._targets[conn] = target
        self._pinged_peer(conn)
        if welcome.get("kv_ipc") is not None:  # its requests wait for this answer
            conn.send({"type": "placed", "ok": placed is not None})
        if placed is not None:
            log.info("src %d: %s shares its KV pages (CUDA IPC, %s): its direct-ipc grants are stored straight into "
                     "them, in its page size and layout", self.rank, conn.peer,
                     "this GPU" if placed.opened.on(self.cache.device) else "another GPU, through peer access")
        log.debug("src %d: connected to %s, heads %d..%d, %s path%s", self.rank, conn.peer, piece.heads.start,
                  piece.heads.stop, path.name, ", direct offered" if kv else "")
        self._log_link(facts, conn.peer, welcome.get("kv_facts"), direct=bool(kv), label=peer_label(engine, rank))
        if mapped is not None:
            conn.send({"type": "mapped"})  # before any ready: its chunks owe the destination no transport notice
            log.info("src %d: %s shares its arena (%s, same host): chunks are gathered straight into its slots, "
                     "no transport write", self.rank, conn.peer, mapped.kind)

    def _map_arena(self, conn: Connection, arena: Region, shared, peer_facts) -> MappedArena | None:
        """The destination's arena mapped here, or None (with ``mapped="on"``, no mapping fails the handshake)."""
        setting = self.settings.mapped
        if setting == "off" or not self.transport.one_sided:
            return None
        why = None
        if shared is None:
            why = "the destination does not share its arena (it runs with mapped=off, or its arena is not shareable: " \
                  "a host arena is shared only with KVSTAGE_MAPPED=on on the destination)"
        elif link_context(self.facts, peer_facts if isinstance(peer_facts, dict) else None).same_host is False:
            why = "the destination runs on another host (hostname and boot id differ)"
        else:
            try:
                mapped = open_shared(shared, arena.nbytes, self.cache.device)
            except MappingError as e:
                why = str(e)
            else:
                if setting == "on" or mapped.on(self.cache.device):
                    return mapped
                # another GPU: the transport's copy engines write it over the link as fast and leave this GPU's
                # SMs to the model; mapped=on stores over the link anyway
                log.info("src %d: %s shares its arena on another GPU (%s) or one of unknown identity: chunks go "
                         "by transport writes (KVSTAGE_MAPPED=on maps it)", self.rank, conn.peer, mapped.gpu)
                mapped.close()
                return None
        if setting == "on":
            conn.close()
            raise TransferFailed("-", conn.peer, "handshake", f"mapped=on, but {why}")
        if shared is not None:  # offered and not usable: say so once; the chunks go by transport writes
            log.info("src %d: %s offered its arena, not mapped here (%s): chunks go by transport writes",
                     self.rank, conn.peer, why)
        return None

    def _asks_kv_ipc(self) -> bool:
        """Whether this source asks destinations on its host for their KV pages (direct-ipc)."""
        return self.settings.share_kv != "off" and self.cache.device.type == "cuda"

    def _open_pages(self, conn: Connection, desc, peer_facts, p: TransferPlan) -> "PlacedTarget | None":
        """The destination's KV buffers opened here, or None (said in one line when offered and not
        opened: its chunks then go through the arena)."""
        if desc is None or not self._asks_kv_ipc():
            return None
        if link_context(self.facts, peer_facts if isinstance(peer_facts, dict) else None).same_host is not True:
            log.info("src %d: %s offered its KV pages from another host; not opened", self.rank, conn.peer)
            return None
        try:
            opened = open_buffers(desc, self.cache.device)
        except MappingError as e:
            log.info("src %d: %s offered its KV pages, not opened here (%s): chunks go through its arena",
                     self.rank, conn.peer, e)
            return None
        try:
            copier = self._placed_copiers.get(p.dst)
            if copier is None:
                copier = self._placed_copiers[p.dst] = PlacedCopier(self.cache, p.dst)
            return PlacedTarget(opened, copier, copier.destination(opened.spans))
        except (ConfigError, ValueError) as e:
            opened.close()
            log.info("src %d: %s offered its KV pages, not written here (%s): chunks go through its arena",
                     self.rank, conn.peer, e)
            return None

    def _close_target(self, target: Target) -> None:
        """Close a destination's connection and unmap its arena and pages, once no copy still writes into them."""
        target.conn.close()
        if target.mapped is not None or target.placed is not None:
            for g in self._gathering:
                if g.slot is None and any((j.engine, j.dst) == (target.engine, target.rank) for j in g.jobs):
                    g.fence.wait()
        if target.mapped is not None:
            target.mapped.close()
        if target.placed is not None:
            target.placed.opened.close()

    def _add(self, handle: TransferHandle, pages: np.ndarray, engine: str) -> None:
        """A sent request (caller's thread, state lock held): announce it, apply the grants
        held for it and launch the gathers they allow. Writes, slots and the transport's
        polls stay the loop's."""
        key = (engine, handle.req)
        if key in self.requests:
            raise ValueError(f"request {handle.req!r} to engine {engine!r} is already in flight on source rank {self.rank}")
        eng = self.engines.get(engine)
        if eng is None:
            known = ", ".join(repr(e) for e in self.engines) or "none"
            raise TransferFailed(handle.req, "-", "send", f"not connected to any destination rank of engine {engine!r} "
                                 f"(engines connected: {known}); call connect() first")
        want = [p.dst_rank for p in eng.plan.targets_of(self.rank)]
        missing = [d for d in want if d not in eng.targets]
        if missing:
            raise TransferFailed(handle.req, f"destination ranks {missing}" + (f" of engine {engine}" if engine else ""),
                                 "send", "not connected")
        if not want:  # replicas or MLA: another source rank covers these heads
            handle._move(State.DONE)
            return
        self._finished.pop(key, None)
        if self._take_abort(key, handle):  # every destination hears of it: none keeps slots granted to it
            for d in want:
                self._send(engine, d, {"type": "abort", "req": handle.req, "reason": handle.error.cause})
                self._send(engine, d, {"type": "abort_ack", "req": handle.req})
            return
        out = Outgoing(handle, pages, engine)
        self.requests[key] = out
        held = self._drop_held(key)
        # the announcements go first: each destination handles its ``ready`` while this side gathers
        ready = {"type": "ready", "req": handle.req, "tokens": handle.tokens}
        for d in want:
            out.written[d] = 0
            out.granted[d] = set()
            self._send(engine, d, ready)  # a send that fails here fails the request when the loop sees the closed connection
        out.kernel_pages = upload_pages(self.cache, pages, checked=True)
        for job, chunks, tokens in sorted(held.values(), key=lambda g: (g[0].chunk, g[0].dst)):
            if not handle.done():  # a grant naming other tokens fails it
                self._apply_grant(out, job, chunks, tokens)
        # on CUDA the early grants' gathers into mapped arenas start here (a launch returns at once);
        # a host gather runs in the call: the loop does those
        if held and self.cache.device.type == "cuda":
            self._launch_mapped()
            if handle.state is not State.FAILED:  # FAILED: an abort went to each destination instead
                self._finish_here(out)

    def _finish_here(self, out: Outgoing) -> None:
        """When ``send`` gathered every chunk of the request into mapped arenas (a small
        request, granted early), wait for those gathers on the caller's thread, at most
        ``SEND_WAIT_S``, and send their ``landed`` from here. Not when the gathers have not
        started on the GPU (work queued before them, an engine's model step, would hold the
        caller for the whole bound): the loop does it then."""
        req = out.handle.req
        if any((j.engine, j.req) == out.key for j in self._jobs) or any(len(out.granted[d]) != out.chunks.get(d)
                                                                          for d in out.written):
            return
        fences = [g.fence for g in self._gathering if g.out is out and g.slot is None]
        if not fences or not all(f.started() for f in fences):
            return
        deadline = time.perf_counter() + SEND_WAIT_S
        while not all(f.done() for f in fences):
            if time.perf_counter() > deadline:
                log.debug("src %d: %s gathers still running after %g us: the loop reports them", self.rank, req,
                          SEND_WAIT_S * 1e6)
                return
        self._poll_gathers()

    def _busy(self) -> bool:
        return bool(self._inflight or self._jobs or self._gathering)

    def _copying(self):
        return next((g.fence for g in self._gathering if not g.fence.done()), None)

    def _on_message(self, conn: Connection, msg: dict) -> None:
        target = self._targets.get(conn)
        if target is None:
            return
        kind = msg["type"]
        try:
            if kind == "grant":
                self._on_grant(target, msg)
            elif kind == "abort":
                req = field(msg, "req", str)
                key = (target.engine, req)
                cause = "destination aborted: " + str(msg.get("reason"))[:200]
                if key in self.requests:
                    self._fail(key, target.name, "abort", cause, tell=False)
                else:  # not sent here (yet): nothing of it can land, its early grants are void
                    self._drop_held(key)
                    self._remember_abort(key, target.name, cause)
                    self._send(target.engine, target.rank, {"type": "abort_ack", "req": req})
            elif kind == "done":
                field(msg, "req", str)
            elif kind == "error":
                reason = str(msg.get("reason"))[:300]
                log.warning("src %d: %s refused our %s: %s", self.rank, conn.peer, msg.get("about"), reason)
                if isinstance(msg.get("req"), str):
                    self._fail((target.engine, msg["req"]), conn.peer, str(msg.get("about")), f"refused: {reason}",
                               tell=False)
            else:
                raise ProtocolError(f"unknown message type {kind!r}")
        except KVStageError as e:
            self._reject(conn, msg, e)

    def _on_grant(self, target: Target, msg: dict) -> None:
        """Check a grant on arrival; apply it, or hold it until the request is sent. A grant
        naming the destination's ``pages`` is a direct one (page runs in place)."""
        req = field(msg, "req", str)
        d = target.rank
        tokens = field(msg, "tokens", int, minimum=1)
        chunks = field(msg, "chunks", int, minimum=1, maximum=tokens)
        c = field(msg, "chunk", int, minimum=0, maximum=chunks - 1)
        start = field(msg, "start", int, minimum=0, maximum=tokens - 1)
        count = field(msg, "count", int, minimum=1, maximum=tokens - start)
        job = Job(req, d, c, start, count, target.engine)
        if "ipc_pages" in msg:
            if target.placed is None:
                raise ProtocolError(f"direct-ipc grant for {req!r}, but this source has not opened the destination's "
                                    "KV pages")
            pages = field(msg, "ipc_pages", list)
            if (chunks, start, count) != (1, 0, tokens):
                raise ProtocolError(f"direct-ipc grant for {req!r} must cover the whole request in one chunk")
            if len(pages) != pages_needed(tokens, target.plan.dst.page.page_size) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pages
            ):
                raise ProtocolError(f"direct-ipc grant for {req!r} has a malformed page list")
            job.ipc_pages, job.offset = np.asarray(pages, dtype=np.int64), None
        elif "pages" in msg:
            if not target.kv:
                raise ProtocolError(f"direct grant for {req!r}, but the destination offered no KV regions")
            pages = field(msg, "pages", list)
            if (chunks, start, count) != (1, 0, tokens):
                raise ProtocolError(f"direct grant for {req!r} must cover the whole request in one chunk")
            if len(pages) != pages_needed(tokens, self.spec.page.page_size) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pages
            ):
                raise ProtocolError(f"direct grant for {req!r} has a malformed page list")
            job.pages = np.asarray(pages, dtype=np.int64)
        else:
            job.offset = field(msg, "offset", int, minimum=0)
            if "ticket" in msg:
                try:
                    job.ticket = base64.b64decode(field(msg, "ticket", str), validate=True)
                except ValueError:
                    raise ProtocolError(f"grant for {req!r} chunk {c}: ticket is not base64") from None
            nbytes = target.plan.piece_token_bytes(target.piece) * count
            if job.offset + nbytes > target.arena.nbytes:
                raise ProtocolError(
                    f"grant for {req!r} chunk {c}: {nbytes} bytes at offset {job.offset} exceed the "
                    f"destination arena of {target.arena.nbytes} bytes"
                )
        key = (target.engine, req)
        out = self.requests.get(key)
        if out is None:
            if key in self._finished:
                raise ProtocolError(f"grant for request {req!r}, which already {self._finished[key]} here")
            return self._hold(job, chunks, tokens)
        if out.handle.done():
            raise ProtocolError(f"grant for request {req!r}, which already {out.handle.state.value} here")
        self._apply_grant(out, job, chunks, tokens)

    def _hold(self, job: Job, chunks: int, tokens: int) -> None:
        """Keep a grant for a request not sent here yet (at most ``MAX_HELD``)."""
        key = (job.engine, job.req)
        held = self._held.get(key)
        if held is not None:
            if (job.dst, job.chunk) in held:
                raise ProtocolError(f"chunk {job.chunk} of {job.req!r} granted twice")
            other = next((g for (d, _), g in held.items() if d == job.dst), None)
            if other is not None and (other[1], other[2]) != (chunks, tokens):
                raise ProtocolError(f"grant says {chunks} chunks of {tokens} tokens for {job.req!r}; an earlier "
                                    f"grant said {other[1]} of {other[2]}")
        if self._held_count >= MAX_HELD:
            raise ProtocolError(f"more than {MAX_HELD} grants held for requests not sent to this source rank")
        self._held.setdefault(key, {})[(job.dst, job.chunk)] = (job, chunks, tokens)
        self._held_count += 1
        log.debug("src %d: %s chunk %d granted by destination rank %d, held until sent", self.rank, job.req,
                  job.chunk, job.dst)

    def _drop_held(self, key: tuple) -> dict:
        held = self._held.pop(key, {})
        self._held_count -= len(held)
        return held

    def _apply_grant(self, out: Outgoing, job: Job, chunks: int, tokens: int) -> None:
        req, d, c = job.req, job.dst, job.chunk
        if tokens != out.handle.tokens:
            return self._fail(out.key, rank_name(job.engine, "destination", d), "grant",
                              f"destination expects {tokens} tokens, this source sends {out.handle.tokens}", tell=True)
        if out.chunks.get(d, chunks) != chunks:
            raise ProtocolError(f"grant says {chunks} chunks for {req!r}; an earlier grant said {out.chunks[d]}")
        if c in out.granted[d]:
            raise ProtocolError(f"chunk {c} of {req!r} granted twice")
        out.chunks[d] = chunks
        out.granted[d].add(c)
        out.handle.path = self._path_of(job).name
        out.stage = "gather"
        out.touched = time.monotonic()
        if out.handle.state is State.PENDING:
            out.handle._move(State.TRANSFERRING)
        job.queued = time.perf_counter()
        self._jobs.append(job)
        log.debug("src %d: %s chunk %d granted by destination rank %d", self.rank, req, c, d)

    def _path_of(self, job: Job) -> WritePath:
        """The write path of a granted job: direct for a grant naming pages, else its destination's."""
        if job.ipc_pages is not None:
            return self._placed
        if job.pages is not None:
            return self._direct
        target = self.target_of(job)
        return target.path if target is not None else self._staged

    def _progress(self) -> None:
        self._poll_writes()
        self._poll_gathers()
        while self._jobs:
            out = self.requests.get((self._jobs[0].engine, self._jobs[0].req))
            if out is None or out.handle.done():
                self._jobs.popleft()
                continue
            if not self._path_of(self._jobs[0]).start(out):
                return  # back-pressure: wait for a write to finish

    def _launch_mapped(self) -> None:
        """Launch the queued gathers into mapped arenas, and nothing else (``_add``, on the
        caller's thread); the loop takes the queue from the first job that needs a slot, a
        write or the transport."""
        while self._jobs and self._path_of(self._jobs[0]) in (self._mapped, self._placed):
            out = self.requests.get((self._jobs[0].engine, self._jobs[0].req))
            if out is None or out.handle.done():
                self._jobs.popleft()
                continue
            self._path_of(self._jobs[0]).start(out, poll=False)

    def _poll_gathers(self) -> None:
        """Post the write of every chunk whose gather has finished on the device (or, gathered
        into mapped arenas, say ``landed``)."""
        still = []
        for g in self._gathering:
            if not g.fence.done():
                still.append(g)
                continue
            t1 = time.perf_counter()
            out, job = g.out, g.jobs[0]
            log.debug("src %d: %s chunk %d gathered", self.rank, job.req, job.chunk)
            out.inflight -= 1
            gone = next((j.dst for j in g.jobs if self.target_of(j) is None), None)
            mapped = g.slot is None
            going = not (out.handle.done() or gone is not None or (g.write is None and not mapped))
            if going:  # what the destinations wait for goes first (this path runs cold), the accounting after
                if mapped:  # the gather's stores were the transfer: tell each destination they are done
                    for j, nbytes in zip(g.jobs, g.sizes):
                        self._send(j.engine, j.dst, {"type": "landed", **notice_fields(j.req, j.chunk, self.rank,
                                                                                        j.offset, nbytes)})
                else:
                    self._post_write(out, job, g.slot, g.write, g.sizes[0], 1, t1)
            out.handle.stages["gather"] += t1 - g.started
            self.metrics.stage("gather", t1 - g.started)
            gpu = g.fence.gpu_seconds()
            g.fence.release()
            if gpu is not None:
                out.handle.stages["gather_gpu"] = out.handle.stages.get("gather_gpu", 0.0) + gpu
            if not going:
                if g.write is not None:
                    g.write.drop()
                if not mapped:
                    self.arena.allocator.release(g.slot)
                if gone is not None:
                    self._fail(out.key, rank_name(job.engine, "destination", gone), "write", "not connected", tell=False)
                self._maybe_forget(out)
                continue
            if mapped:
                for j, nbytes in zip(g.jobs, g.sizes):
                    log.debug("src %d: %s chunk %d landed in destination rank %d's mapped arena", self.rank, j.req,
                              j.chunk, j.dst)
                    out.handle.bytes += nbytes
                    self._chunk_written(out, j)
        self._gathering = still

    def _post_write(self, out, job, slot, write, nbytes: int, descriptors: int, t: float) -> None:
        try:
            h = write.post()
        except KVStageError as e:
            write.drop()
            if slot is not None:
                self.arena.allocator.release(slot)
            return self._fail(out.key, rank_name(job.engine, "destination", job.dst), "write", str(e), tell=True)
        log.debug("src %d: %s chunk %d write posted to destination rank %d", self.rank, job.req, job.chunk, job.dst)
        out.inflight += 1
        out.stage = "write"
        out.handle.bytes += nbytes
        out.handle.descriptors += descriptors
        out.handle.writes += 1
        self._inflight.append(InFlight(h, job, slot, t))

    def _poll_writes(self) -> None:
        still = []
        for w in self._inflight:
            try:
                state = self.transport.poll(w.handle)
            except KVStageError as e:
                state = e
            if state is WriteState.PENDING:
                still.append(w)
                continue
            self.transport.release(w.handle)
            if w.slot is not None:
                self.arena.allocator.release(w.slot)
            out = self.requests.get((w.job.engine, w.job.req))
            if out is None:
                continue
            out.inflight -= 1
            out.touched = time.monotonic()
            took = time.perf_counter() - w.posted
            out.handle.stages["write"] += took
            self.metrics.stage("write", took)
            log.debug("src %d: %s chunk %d write complete", self.rank, w.job.req, w.job.chunk)
            if isinstance(state, Exception):
                self._fail(out.key, rank_name(w.job.engine, "destination", w.job.dst), "write", str(state), tell=True)
                self._maybe_forget(out)
            else:
                self._chunk_written(out, w.job)
        self._inflight = still

    def _chunk_written(self, out: Outgoing, job: Job) -> None:
        """A chunk is in its destination slot (or pages); the request is done with its last one."""
        if not out.handle.done():
            out.written[job.dst] += 1
            if all(out.written[d] == out.chunks.get(d, -1) for d in out.written):
                out.handle._move(State.DONE)
                self.metrics.request_finished(peer_label(out.engine), True, out.handle.seconds, out.handle.bytes)
        self._maybe_forget(out)

    # -- failures --------------------------------------------------------------
    def _fail(self, key: tuple, peer: str, stage: str, cause: str, tell: bool) -> None:
        out = self.requests.get(key)
        if out is None or out.handle.done():
            return
        req = out.handle.req
        out.handle._fail(peer, stage, cause)
        self.metrics.failure(peer_label(out.engine), stage, cause)
        self.metrics.request_finished(peer_label(out.engine), False, 0.0, out.handle.bytes)
        log.warning("src %d: request %s failed at %s with %s: %s", self.rank, req, stage, peer, cause)
        if tell:
            for d in out.written:
                self._send(out.engine, d, {"type": "abort", "req": req, "reason": cause})
        self._maybe_forget(out)

    def _maybe_forget(self, out: Outgoing) -> None:
        """Drop a final request once no write of it can still land; tell the
        destinations (after a failure) that its slots may be reused."""
        if not out.handle.done() or out.inflight:
            return
        self.requests.pop(out.key, None)
        remember(self._finished, out.key, out.handle.state.value, MAX_FINISHED)
        if out.handle.state is State.FAILED:
            for d in out.written:
                self._send(out.engine, d, {"type": "abort_ack", "req": out.handle.req})

    def _send(self, engine: str, rank: int, msg: dict) -> None:
        eng = self.engines.get(engine)
        t = eng.targets.get(rank) if eng is not None else None
        if t is not None:
            try:
                t.conn.send(msg)
            except OSError as e:
                log.debug("src %d: send to %s failed: %s", self.rank, t.name, e)

    def _on_closed(self, conn: Connection, reason: str, answered: bool) -> None:
        target = self._targets.pop(conn, None)
        conn.close()
        if target is None:
            return
        eng = self.engines[target.engine]
        if eng.targets.get(target.rank) is target:
            del eng.targets[target.rank]
        self._close_target(target)
        self.transport.disconnect(target.agent)
        d = target.rank
        for key, held in list(self._held.items()):  # that destination's early grants died with it
            if key[0] != target.engine:
                continue
            for k in [k for k in held if k[0] == d]:
                del held[k]
                self._held_count -= 1
            if not held:
                del self._held[key]
        hit = [key for key, out in self.requests.items()
               if out.engine == target.engine and d in out.written and out.written[d] != out.chunks.get(d, -1)]
        (log.warning if hit else log.info)("src %d: %s disconnected (%s), %d requests affected",
                                           self.rank, target.name, reason, len(hit))
        for key in hit:
            self._fail(key, target.name, self.requests[key].stage, f"connection lost ({reason})", tell=True)
        if not eng.targets and not any(out.engine == eng.name for out in self.requests.values()):
            del self.engines[target.engine]  # connected again later, possibly with another spec
            log.info("src %d: decode engine %r has no rank connected any more", self.rank, target.engine)

    def _peers(self) -> list:
        return list(self._targets)

    def _stats(self) -> EndpointStats:
        return dataclasses.replace(super()._stats(), held_grants=self._held_count, engines=len(self.engines))

    def _check_stalls(self, now: float) -> None:
        """An announced request never granted within ``ready_timeout_s``, or a
        write not complete after ``stall_timeout_s``, fails. Waiting for grants
        is the destination's back-pressure; a dead destination closes the
        control connection (or misses its keepalives), a frozen one stops
        pinging: its requests fail after ``peer_timeout_s`` of silence."""
        for t in list(self._targets.values()):
            quiet = self._silent(t.conn, now)
            if quiet is None:
                continue
            for key, out in list(self.requests.items()):
                if out.engine == t.engine and t.rank in out.written and not out.handle.done():
                    self._fail(key, t.name, out.stage,
                               f"no control message for {quiet:.1f} s: the destination is stopped or hung, or the link is down", tell=True)
        for key, out in list(self.requests.items()):
            if not out.handle.done() and out.handle.state is State.PENDING and now - out.touched > self.settings.ready_timeout_s:
                self._fail(key, "destination", "waiting for grant", f"no grant within {self.settings.ready_timeout_s:g} s", tell=True)
        t = time.perf_counter()
        for w in self._inflight:
            waited = t - w.posted
            if waited <= min(SLOW_S, self.settings.stall_timeout_s):
                continue
            out = self.requests.get((w.job.engine, w.job.req))
            target = self.target_of(w.job)
            running = target is not None and self._peer_running(target.conn, now, now - waited + min(SLOW_S, self.settings.stall_timeout_s))
            if out is not None and not out.slow:
                out.slow = True
                self.metrics.slow(peer_label(w.job.engine, w.job.dst), "write")
                log.warning("src %d: request %s is slow: chunk %d's write to %s not complete after %.1f s (%s)",
                            self.rank, w.job.req, w.job.chunk, rank_name(w.job.engine, "destination", w.job.dst),
                            waited, "it runs" if running else "it is alive, busy: its loop does not turn")
            if waited > self.settings.stall_timeout_s and target is not None and \
                    self._peer_running(target.conn, now, now - waited + self.settings.stall_timeout_s):
                self._fail((w.job.engine, w.job.req), rank_name(w.job.engine, "destination", w.job.dst), "write",
                           f"write not complete after {self.settings.stall_timeout_s:g} s, while the destination runs",
                           tell=True)

    def _forgive(self, gap: float) -> None:
        for out in self.requests.values():
            out.touched += gap
        for w in self._inflight:
            w.posted += gap

    def _shutdown(self) -> None:
        for key in list(self.requests):
            self._fail(key, "local", "shutdown", "source closed", tell=True)
        for t in list(self._targets.values()):
            self._close_target(t)
        super()._shutdown()
