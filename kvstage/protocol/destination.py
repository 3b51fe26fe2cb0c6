"""The destination (decode) side: grants slots, scatters landed chunks.

One destination serves the source ranks of any number of prefill engines at
once, each engine with its own plan (its own TP size): a writer is known by
its engine and rank, a request by its engine and id. The arena, the
transport and the loop are shared by every engine; ``grants`` shares the
slots fairly among the engines that wait for them, and a writer that leaves
fails only its own engine's requests.

Per request: grant one arena slot per chunk to all writers at once. The first
chunks are granted as soon as the request is expected (``grants.EARLY_CHUNKS``),
so a source that already holds its grant gathers and writes the moment its
``send`` is called; the rest once every writer the plan names has announced
the request (``ready``). A chunk whose writers have all landed is scattered
into this rank's pages and its slot is freed for the next grant. Sources never
learn KV addresses on the staged path; on the direct path (whole shards, same
paging, where ``route`` expects it to be at least as fast) they get the
registered KV regions and the request's page ids, and write page runs in place.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field as dc_field

import numpy as np

from kvstage.config import Settings
from kvstage.errors import IncompatibleGeometry, KVStageError, ProtocolError
from kvstage.link.context import link_context
from kvstage.protocol import grants, route
from kvstage.protocol.endpoint import (SLOW_S, Endpoint, EndpointStats, check_engine, check_pages, peer_label, rank_name,
                                      remember)
from kvstage.protocol.gate import PRE_AUTH_TYPES, check_listen
from kvstage.protocol.handshake import (HANDSHAKE_TIMEOUT_S, check_model, check_peer, hello_spec, md_from_wire,
                                        md_to_wire, peer_engine, spec_to_wire)
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.wire import PROTOCOL_VERSION, Connection, decode_notice, field, notice_from_message
from kvstage.staging import placement
from kvstage.staging.copy import CopyThreads, TokenIndex, prepare_piece_scatters, prepare_scatter, upload_pages
from kvstage.staging.fence import CopyFence
from kvstage.staging.mapped import share, unshare
from kvstage.staging.shared_buffers import NotShareable, share_buffers
from kvstage.tp import Piece, TransferPlan, plan
from kvstage.transports.base import Region, Spans

log = logging.getLogger("kvstage")

MAX_EARLY = 4096  # ready messages kept for requests this side has not been told about yet
#: agents of lost writers remembered (agent -> engine), so a late write's notice finds its request
MAX_LOST_AGENTS = 1024
#: how long a writer lost with writes not landed holds their slots when its host closed the connection (the link
#: is up: what it queued arrives within round trips); when its host stopped answering, ``late_write_hold_s``
ANSWERED_HOLD_S = 1.0
#: a probe's lent slot goes back this long after it was lent: a measured write takes milliseconds
PROBE_LEASE_S = 10.0
#: probes hold at most this share of the arena's slots at once (at least one): requests keep the rest
PROBE_SHARE = 0.25
#: after a failed accept (out of descriptors), the listener waits this long, doubling to ``ACCEPT_BACKOFF_MAX_S``
ACCEPT_BACKOFF_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
#: a burst of failed accepts ends with an accept this long after the last failure
ACCEPT_QUIET_S = 2 * ACCEPT_BACKOFF_MAX_S


def scatter_threads(transport_gathers: bool, cores: int) -> int:
    """Threads a host cache's scatter runs on: two where the sources leave a core free (a
    transport that writes from their pages, cma, does no gather on the sources' cores), else
    one (the sources' gathers take the other core)."""
    return 2 if transport_gathers and cores >= 2 else 1


@dataclass
class Writer:
    engine: str
    rank: int
    conn: Connection
    agent: str
    piece: Piece
    slot_bytes: int
    direct: bool = False  # it was offered the KV regions: its requests may go direct (``route``)
    mapped: bool = False  # it gathers into this arena (its ``mapped`` message says so): no notice to poll for
    placed: bool = False  # it opened this rank's KV pages (its ``placed`` message says so): direct-ipc
    asked: bool = False  # offered the KV pages, its ``placed`` answer not in yet: its requests wait for it

    @property
    def name(self) -> str:
        return rank_name(self.engine, "source", self.rank)


@dataclass
class SourceEngine:
    """One prefill engine's ranks as this destination sees them: its plan, fixed by its first
    hello, and its connected writers by source rank."""

    name: str
    plan: TransferPlan
    writers: dict = dc_field(default_factory=dict)  # source rank -> Writer

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces that write into destination rank ``rank``."""
        return self.plan.writers_of(rank)

    def ranks(self, rank: int) -> list[int]:
        return [p.src_rank for p in self.plan.writers_of(rank)]


@dataclass
class Chunk:
    index: int
    start: int
    count: int
    slot: int | None
    pending: set = dc_field(default_factory=set)  # writer ranks not landed yet
    #: pending writers lost (control connection closed) before they landed: rank -> (agent, held until,
    #: whether its host answered: the hold's length and how its end is logged).
    #: Their writes may still land (bytes queued on a cut link), so the chunk's slot stays out of use
    #: until the write's notice arrives or the hold ends (``Destination._on_closed``).
    lost: dict = dc_field(default_factory=dict)
    granted: float = dc_field(default_factory=time.monotonic)
    scatter: object = None  # the whole chunk's prepared scatter (``prepare_scatter``), run once every writer landed
    piece_scatters: dict | None = None  # or, on the kernel path: writer rank -> its piece's, run as that piece lands
    fences: list = dc_field(default_factory=list)  # the scatters launched so far

    def scattered(self) -> bool:
        return all(f.done() for f in self.fences)

    def wait(self) -> None:
        """Until the scatters launched into this chunk's pages are done."""
        for f in self.fences:
            f.wait()

    def settle(self) -> float | None:
        """Wait for the scatters launched into this chunk's pages and hand their fences
        back; the seconds they took on the GPU (None on the CPU)."""
        self.wait()
        seconds = [f.gpu_seconds() for f in self.fences]
        for f in self.fences:
            f.release()
        self.fences = []
        return sum(seconds) if seconds and seconds[0] is not None else None


@dataclass
class Incoming:
    handle: TransferHandle
    pages: np.ndarray
    engine: str  # the prefill engine whose writers send it
    ready: dict = dc_field(default_factory=dict)  # writer rank -> tokens announced
    direct: bool = False
    placed: bool = False  # direct-ipc: the writers store their head slices straight into its pages
    chunk_tokens: int = 0
    chunks: int = 0
    next_chunk: int = 0
    open: dict = dc_field(default_factory=dict)  # chunk index -> Chunk (granted, not scattered)
    quarantine: dict = dc_field(default_factory=dict)  # chunk index -> Chunk (failed, writes may land)
    scattered: int = 0
    landings: int = 0  # writer landings so far (the path says how they came)
    stage: str = "waiting for writers"
    touched: float = dc_field(default_factory=time.monotonic)  # expected, or the last writer announced it
    announced: float | None = None  # when the last writer announced it
    slow: bool = False  # said to be slow (once: ``Destination._check_slow``)
    slot_blocked: float | None = None  # since when its next chunk waits for a slot (``stages["slot_wait"]``)
    kernel_pages: object = None  # the page ids where the GPU copies read them (``upload_pages``), before any chunk lands

    @property
    def key(self) -> tuple[str, str]:
        return self.engine, self.handle.req


class Destination(Endpoint):
    """A destination rank. ``address`` is where sources connect: the ranks of any number of
    prefill engines (``engine``: this rank's own engine id, told to every source)."""

    role = "dst"
    shares_arena = True

    def __init__(self, cache, settings=None, transport=None, listen: tuple[str, int] = ("127.0.0.1", 0),
                 engine: str = "", model: str = ""):
        settings = settings or Settings()
        check_listen(settings, listen, f"dst {getattr(cache, 'rank', '?')}")
        super().__init__(cache, settings, transport, engine, model)
        self.engines: dict[str, SourceEngine] = {}
        self._writers: dict[Connection, Writer] = {}  # every connected writer, by its control connection
        self._agents: dict[str, Writer] = {}  # and by its transport agent (notices name an agent)
        self._lost_agents: dict[str, str] = {}  # agent of a lost writer -> its engine (late notices)
        self.requests: dict[tuple[str, str], Incoming] = {}
        self._early: dict[tuple[str, str], dict[int, int]] = {}
        self._rr: list[tuple[str, str]] = []  # requests waiting for grants, in arrival order (``grants.grant_order``)
        self._scattering: list = []  # (request, chunk, time its last piece landed) of chunks still scattering
        self._probes: dict[Connection, tuple[int, str, float]] = {}  # probe connection -> (slot, prober agent, lease end)
        self._routes: dict = {}  # (engine, writer rank, path) whose route was logged, the latest ones
        self._kv_share: dict | None | bool = False  # this rank's KV buffers as shared (False: not tried yet)
        # what a source on this host needs to map the arena and gather straight into it (None: not shared)
        self._shared = share(self.arena.buffer) if self.settings.mapped != "off" and self.transport.one_sided else None
        self._scatter_threads = self._copy_threads()
        self._listener = socket.create_server(listen)
        self.address = self._listener.getsockname()[:2]
        self._start()
        threading.Thread(target=self._accept, name=f"kvstage-accept{self.rank}", daemon=True).start()
        log.info("dst %d: listening on %s:%d (%d slots of %d bytes)", self.rank, *self.address,
                 self.arena.allocator.count, self.arena.slot_bytes)
        if not self.settings.auth_token:
            log.warning("dst %d: no auth token: anyone who can reach %s:%d can connect and use staging slots (the "
                        "direct path and probe leases are off without one); set KVSTAGE_AUTH_TOKEN, the same on "
                        "every rank", self.rank, *self.address)

    def _copy_threads(self) -> CopyThreads | None:
        """The threads a host cache's scatters share (``scatter_threads``), or None for one (logged when more)."""
        if self.cache.device.type != "cpu":
            return None
        n = scatter_threads(self.transport.gathers, os.cpu_count() or 1)
        if n == 1:
            return None
        log.info("dst %d: host scatters on %d threads (%s: the sources write from their pages and leave a core free)",
                 self.rank, n, self.transport.name)
        return CopyThreads(n)

    def _accept(self) -> None:
        """Accept connections until closed. A failed accept (out of descriptors, a connection
        aborted before it was taken) is logged once per burst; the listener backs off and goes on,
        and says so when it has accepted again with no failure for ``ACCEPT_QUIET_S``."""
        failed, last_failure, backoff = 0, 0.0, ACCEPT_BACKOFF_S
        while not self._closing:
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._closing or self._listener.fileno() < 0:
                    return
                if not failed:
                    log.warning("dst %d: accept failed: %s; retrying, backing off up to %g s", self.rank, e,
                                ACCEPT_BACKOFF_MAX_S)
                failed, last_failure = failed + 1, time.monotonic()
                time.sleep(backoff)
                backoff = min(2 * backoff, ACCEPT_BACKOFF_MAX_S)
                continue
            backoff = ACCEPT_BACKOFF_S
            if failed and time.monotonic() - last_failure > ACCEPT_QUIET_S:
                log.warning("dst %d: accepting again after %d failed accepts", self.rank, failed)
                failed = 0
            try:
                conn = Connection(sock, f"{addr[0]}:{addr[1]}")
            except OSError:  # reset before its options could be set
                sock.close()
                continue
            self._watch(conn, authenticate_within=HANDSHAKE_TIMEOUT_S)

    # -- public --------------------------------------------------------------
    def expect(self, req: str, page_ids, tokens: int, engine: str = "") -> TransferHandle:
        """Receive ``tokens`` tokens of request ``req`` into ``page_ids`` (this rank's pages) from
        the ranks of prefill engine ``engine`` (the id its sources were made with)."""
        if not isinstance(req, str) or not 0 < len(req) <= 256:
            raise ValueError(f"req={req!r}: must be a non-empty string of at most 256 characters")
        check_engine(engine)
        pages = check_pages(self.cache, page_ids, tokens)
        handle = TransferHandle(req, "dst", int(tokens))
        key = (engine, req)
        handle._abort = lambda reason: self._post("call", lambda: self._fail(key, "local", "abort", reason, tell=True))
        self._call(lambda: self._add(handle, pages, engine))
        return handle

    def slots_free(self) -> int:
        return self.stats().slots_free

    def late_write_holds(self) -> int:
        """Slots held for writes of lost writers that may still land (``Chunk.lost``)."""
        return self.stats().late_holds

    def tracks(self, req: str, engine: str = "") -> bool:
        """Whether this rank still holds request ``req`` of ``engine``: a failed request is held
        until no write of it can still land (its pages must not be reused before then)."""
        return bool(self._call(lambda: (engine, req) in self.requests))

    def _stats(self) -> EndpointStats:
        holds = sum(ch.slot is not None for inc in self.requests.values() for ch in inc.quarantine.values() if ch.lost)
        return dataclasses.replace(super()._stats(), late_holds=holds, unknown_announced=len(self._early),
                                   announced=sum(inc.announced is not None for inc in self.requests.values()),
                                   mapped_peers=sum(w.mapped for w in self._writers.values()),
                                   engines=len(self.engines))

    # -- loop thread -----------------------------------------------------------
    def _add(self, handle: TransferHandle, pages: np.ndarray, engine: str) -> None:
        key = (engine, handle.req)
        if key in self.requests:
            raise ValueError(f"request {handle.req!r} of engine {engine!r} is already in flight on destination "
                             f"rank {self.rank}")
        if self._take_abort(key, handle):  # a writer aborted it already: the others hear of it now
            self._early.pop(key, None)
            eng = self.engines.get(engine)
            for r in eng.ranks(self.rank) if eng else []:
                self._send(engine, r, {"type": "abort", "req": handle.req, "reason": handle.error.cause})
            return
        inc = Incoming(handle, pages, engine, kernel_pages=upload_pages(self.cache, pages, checked=True))
        self.requests[key] = inc
        for w, tokens in self._early.pop(key, {}).items():
            self._on_ready_tokens(inc, w, tokens)
        self._refresh(inc)

    def _busy(self) -> bool:
        """Poll the transport often only while a notice is near: chunks granted
        early to a prefill still computing are not (its ``ready`` wakes the loop),
        nor chunks only mapped writers still owe (their ``landed`` message does)."""
        if self._scattering:
            return True
        for r in self.requests.values():
            if any(ch.pending - ch.lost.keys() for ch in r.quarantine.values()):  # a lost writer's notice can wait
                return True
            if r.open and r.announced and any(not self._mapped_writer(r.engine, w)
                                              for c in r.open.values() for w in c.pending):
                return True
        return False

    def _mapped_writer(self, engine: str, rank: int) -> bool:
        """Whether that writer's chunks land by its own stores, said in a ``landed`` message (no notice to poll)."""
        eng = self.engines.get(engine)
        w = eng.writers.get(rank) if eng is not None else None
        return w is not None and (w.mapped or w.placed)

    def _copying(self):
        return next((f for _, c, _ in self._scattering for f in c.fences if not f.done()), None)

    def _on_message(self, conn: Connection, msg: dict) -> None:
        kind = msg["type"]
        writer = self._writers.get(conn)
        if writer is None and kind in PRE_AUTH_TYPES:
            try:
                (self._on_hello if kind == "hello" else self._on_probe)(conn, msg)
            except KVStageError as e:
                try:  # the peer hears why (one message), then the connection closes
                    conn.send({"type": "error", "reason": str(e), "about": kind})
                except OSError:
                    pass
                self._refuse(conn, f"{kind}: {e}")
            return
        try:
            if kind in PRE_AUTH_TYPES:
                raise ProtocolError(f"{kind} on a connection that is already authenticated")
            if writer is None:  # a prober: it writes into its lent slot and sends nothing more
                raise ProtocolError(f"{kind!r} on a probe's connection")
            if kind == "ready":
                self._on_ready(writer, msg)
            elif kind == "mapped":  # it maps this arena: its chunks land by its own stores, with ``landed``
                if self._shared is None:
                    raise ProtocolError("mapped message, but this destination shares no arena (mapped=off, or not shareable)")
                writer.mapped = True
                log.debug("dst %d: source rank %d gathers straight into this arena", self.rank, writer.rank)
            elif kind == "placed":  # its answer to the KV pages offered: opened (direct-ipc) or not
                if not writer.asked:
                    raise ProtocolError("placed message, but this destination offered this source no KV pages")
                writer.asked, writer.placed = False, field(msg, "ok", bool)
                log.debug("dst %d: %s %s this rank's KV pages", self.rank, writer.name,
                          "writes straight into" if writer.placed else "did not open")
                for inc in list(self.requests.values()):  # requests that waited for the answer
                    if inc.engine == writer.engine:
                        self._refresh(inc)
            elif kind == "landed":  # a chunk a source stored itself: into this arena (mapped) or these pages
                if self._shared is None and not writer.placed:
                    raise ProtocolError("landed message, but this destination shares no arena (mapped=off, or not shareable)")
                if not writer.placed:
                    writer.mapped = True  # decided at its connect: every chunk of it lands this way
                self._on_landed(notice_from_message(msg), writer, mapped=True)
            elif kind == "abort":
                key = (writer.engine, field(msg, "req", str))
                cause = "source aborted: " + str(msg.get("reason"))[:200]
                if key in self.requests:  # the other writers of the request hear of it too
                    self._fail(key, writer.name, "abort", cause, tell=True, skip=writer.rank)
                else:
                    self._early.pop(key, None)
                    self._remember_abort(key, writer.name, cause)
            elif kind == "abort_ack":
                self._on_abort_ack(writer, field(msg, "req", str))
            elif kind == "error":  # the source refused a grant of ours: that request cannot complete
                reason = str(msg.get("reason"))[:300]
                log.warning("dst %d: %s refused our %s: %s", self.rank, writer.name, str(msg.get("about"))[:32], reason)
                if isinstance(msg.get("req"), str):
                    self._fail((writer.engine, msg["req"]), writer.name, str(msg.get("about"))[:32],
                               f"refused: {reason}", tell=True)
            else:
                raise ProtocolError(f"unknown message type {kind!r}")
        except KVStageError as e:
            self._reject(conn, msg, e)

    def _on_hello(self, conn: Connection, msg: dict) -> None:
        check_peer(msg, self.settings.auth_token, self.transport.name, "source")
        check_model(msg, self.model, "source")
        src, rank = hello_spec(msg)
        engine = peer_engine(msg)
        p = plan(src, self.spec)
        eng = self.engines.get(engine)
        if eng is not None and p.src != eng.plan.src:
            if eng.writers or any(inc.engine == engine for inc in self.requests.values()):
                raise IncompatibleGeometry(f"source spec {src} differs from the spec {eng.plan.src} engine {engine!r}'s "
                                           "other ranks connected with; one engine's ranks share one spec")
            log.info("dst %d: prefill engine %r comes back with spec %s (was %s)", self.rank, engine, src, eng.plan.src)
            eng = None
        piece = next((x for x in p.writers_of(self.rank) if x.src_rank == rank), None)
        welcome = {"type": "welcome", "version": PROTOCOL_VERSION, "spec": spec_to_wire(self.spec), "rank": self.rank,
                   "transport": self.transport.name, "engine": self.engine, "model": self.model}
        if piece is None:  # nothing to send here; the source closes this connection
            self._admit(conn)
            conn.send(welcome)
            return
        slot_bytes = field(msg, "slot_bytes", int, minimum=1)
        agent = field(msg, "agent", str)
        md_from_wire(field(msg, "metadata", str))  # well-formed; the destination only receives
        need = p.piece_token_bytes(piece)
        if slot_bytes < need or self.arena.slot_bytes < p.dst_token_bytes():
            raise ProtocolError(
                f"slot too small for one token: source slot {slot_bytes} B (needs {need}), destination slot "
                f"{self.arena.slot_bytes} B (needs {p.dst_token_bytes()}); raise KVSTAGE_ARENA_MB"
            )
        if eng is None:
            eng = self.engines[engine] = SourceEngine(engine, p)
            log.info("dst %d: prefill engine %r connects: %s -> %s", self.rank, engine, p.src, p.dst)
        old = eng.writers.get(rank)
        if old is not None:  # the same identity again: the new connection replaces the old one
            self._replace_peer(old.conn, old.name, conn.peer)
            eng = self.engines.setdefault(engine, eng)  # kept anew if the old connection was its last
        name = rank_name(engine, "source", rank)
        conn.peer = f"{name} ({conn.peer})"
        may_direct = p.direct and self.settings.may_go_direct
        # the link judged on the memory each path registers; a direct path whose KV memory UCX cannot
        # reach well (a WARNING) is not offered: its requests go staged
        direct = self._log_link(msg.get("facts"), conn.peer, msg.get("kv_facts"), direct=may_direct,
                                label=peer_label(engine, rank))
        if may_direct and not direct:
            log.info("dst %d: %s: the direct path is not offered (its KV link is judged above); requests go staged",
                     self.rank, conn.peer)
        kv_ipc = self._share_kv_with(msg, p)
        writer = eng.writers[rank] = Writer(engine, rank, conn, agent, piece, slot_bytes, direct=direct,
                                            asked=bool(kv_ipc))
        self._writers[conn] = writer
        self._agents[agent] = writer
        self._admit(conn)
        self._pinged_peer(conn)
        kv = [r.to_wire() for r in self.kv_regions()] if direct else []  # registered before the metadata is taken
        conn.send(welcome | {
            "metadata": md_to_wire(self.transport.metadata()), "arena": self.arena_region.to_wire(), "kv": kv,
            "facts": self.facts,
        } | ({"kv_facts": self.kv_facts()} if direct else {}) | ({"mapped": self._shared} if self._shared else {})
          | ({"kv_ipc": kv_ipc} if kv_ipc else {}))
        log.debug("dst %d: %s connected, heads %d..%d%s", self.rank, conn.peer, piece.heads.start, piece.heads.stop,
                  ", direct offered" if direct else "")
        for inc in list(self.requests.values()):  # requests expected before every writer was connected
            if inc.engine == engine:
                self._refresh(inc)

    def _share_kv_with(self, hello: dict, p: TransferPlan) -> dict | None:
        """What a source needs to open this rank's KV buffers and write its head slices straight
        into its pages (direct-ipc), or None: only to an authenticated source on this host and
        user that asks for it (``kv_ipc`` in its hello), with ``share_kv`` not off, a CUDA cache,
        and a pair the kernel can place. The buffers are described once (``share_buffers``);
        memory that cannot be shared (VMM) is said once and never offered."""
        if (hello.get("kv_ipc") is not True or self.settings.share_kv == "off" or not self.settings.auth_token
                or self.cache.device.type != "cuda" or hello.get("uid") != os.getuid()):
            return None
        facts = hello.get("facts")
        try:
            same_host = link_context(self.facts, facts if isinstance(facts, dict) else None).same_host
        except Exception:  # a peer's malformed facts: not known to be on this host
            same_host = None
        if same_host is not True or placement.refusal(p.src, self.spec):
            return None
        if self._kv_share is False:
            try:
                self._kv_share = share_buffers(self.cache.buffers)
                log.info("dst %d: KV pages shared with the sources of this host and user that ask (CUDA IPC, %d "
                         "allocations): they write their head slices straight into them (direct-ipc)", self.rank,
                         len(self._kv_share["allocations"]))
            except NotShareable as e:
                self._kv_share = None
                log.info("dst %d: KV pages not shared with sources on this host: %s; they write through the arena",
                         self.rank, e)
        return self._kv_share or None

    def _on_probe(self, conn: Connection, msg: dict) -> None:
        """``kvstage probe --peer``: lend one free arena slot for a measured write.

        The prober writes into that slot only, the same memory KV chunks land
        in. A lease needs the auth token (a destination without one lends
        nothing), one per connection, at most ``PROBE_SHARE`` of the slots at
        once; the slot returns when the prober disconnects or after
        ``PROBE_LEASE_S``, when its connection is closed."""
        if conn in self._probes:
            raise ProtocolError("one probe per connection")
        check_peer(msg, self.settings.auth_token, self.transport.name, "prober")
        if not self.settings.auth_token:
            raise ProtocolError("probe: this destination has no auth token and lends slots only to peers presenting "
                                "one; set KVSTAGE_AUTH_TOKEN on both sides")
        if not self.transport.one_sided:
            raise ProtocolError(
                f"probe: this destination moves bytes with transport={self.transport.name}; `kvstage probe --peer` "
                "measures NIXL writes only; the ucx transport logs the UCX it runs at connect (docs/transports.md)"
            )
        nbytes = min(field(msg, "nbytes", int, minimum=1), self.arena.slot_bytes)
        agent = field(msg, "agent", str)
        most = max(1, int(self.arena.allocator.count * PROBE_SHARE))
        if len(self._probes) >= most:
            raise ProtocolError(f"busy: {len(self._probes)} probes hold the {most} slots probes may use; probe again later")
        slot = self.arena.allocator.acquire()
        if slot is None:
            raise ProtocolError(f"busy: all {self.arena.allocator.count} arena slots are in use; probe again later")
        self._probes[conn] = (slot, agent, time.monotonic() + PROBE_LEASE_S)
        self._admit(conn)
        base = self.arena_region
        region = Region(base.addr + self.arena.offset(slot), nbytes, base.device, base.device_id)
        conn.send({"type": "probe_ok", "facts": self.facts, "metadata": md_to_wire(self.transport.metadata()),
                   "region": region.to_wire(), "rank": self.rank, "lease_s": PROBE_LEASE_S})
        log.info("dst %d: lent slot %d (%d bytes) to a probe from %s for %g s", self.rank, slot, nbytes, conn.peer,
                 PROBE_LEASE_S)

    def _forgive(self, gap: float) -> None:
        for inc in self.requests.values():
            inc.touched += gap
            if inc.announced is not None:
                inc.announced += gap
            for ch in inc.open.values():
                ch.granted += gap
        for conn, (slot, agent, until) in self._probes.items():
            self._probes[conn] = (slot, agent, until + gap)

    def _end_leases(self, now: float) -> None:
        for conn, (slot, _, until) in list(self._probes.items()):
            if now > until:
                log.info("dst %d: the probe lease of %s ended after %g s: slot %d returns", self.rank, conn.peer,
                         PROBE_LEASE_S, slot)
                conn.close()
                self._drop(conn, "probe lease ended")

    def _on_ready(self, writer: Writer, msg: dict) -> None:
        key = (writer.engine, field(msg, "req", str))
        tokens = field(msg, "tokens", int, minimum=1)
        inc = self.requests.get(key)
        if inc is None:
            early = self._early.setdefault(key, {})
            if len(self._early) > MAX_EARLY:
                self._early.pop(key)
                raise ProtocolError(f"more than {MAX_EARLY} announced requests unknown to this destination")
            early[writer.rank] = tokens
            return
        self._on_ready_tokens(inc, writer.rank, tokens)
        self._refresh(inc)

    def _on_ready_tokens(self, inc: Incoming, rank: int, tokens: int) -> None:
        if inc.handle.done():
            return
        if tokens != inc.handle.tokens:
            self._fail(inc.key, rank_name(inc.engine, "source", rank), "ready",
                       f"source announced {tokens} tokens, destination expects {inc.handle.tokens}", tell=True)
            return
        inc.ready[rank] = tokens
        inc.touched = time.monotonic()
        log.debug("dst %d: %s ready from source rank %d", self.rank, inc.handle.req, rank)

    def _refresh(self, inc: Incoming) -> None:
        """Cut a request into chunks once every writer is connected (its grants,
        early ones included, can then go out); it is TRANSFERRING once every
        writer announced it, and DONE only then (each announcement checks the
        token count)."""
        eng = self.engines.get(inc.engine)
        if inc.handle.done() or eng is None:
            return
        pieces = eng.pieces(self.rank)
        if not inc.chunks:
            if any(p.src_rank not in eng.writers or eng.writers[p.src_rank].asked for p in pieces):
                return  # a writer not connected yet, or not answered whether it opened this rank's pages
            inc.placed = all(eng.writers[p.src_rank].placed for p in pieces)
            inc.direct = not inc.placed and self._route(inc, eng, pieces)
            if inc.placed:
                self._log_route(inc, pieces, "direct-ipc", "the sources store their head slices straight into this "
                                "rank's pages (one pass, no copy here)")
            if inc.direct or inc.placed:
                inc.chunk_tokens, inc.chunks = inc.handle.tokens, 1
            else:
                per = min(eng.writers[p.src_rank].slot_bytes // eng.plan.piece_token_bytes(p) for p in pieces)
                fit = min(per, self.arena.slot_bytes // eng.plan.dst_token_bytes())
                inc.chunk_tokens = grants.chunk_tokens(inc.handle.tokens, fit, eng.plan.src.page.page_size,
                                                       self.spec.page.page_size)
                inc.chunks = -(-inc.handle.tokens // inc.chunk_tokens)
            inc.handle.path = "direct-ipc" if inc.placed else "direct" if inc.direct else "staged"
            self._rr.append(inc.key)
            log.debug("dst %d: %s starts, %d chunks of %d tokens, %s", self.rank, inc.handle.req, inc.chunks,
                      inc.chunk_tokens, inc.handle.path)
        if inc.announced is None and all(p.src_rank in inc.ready for p in pieces):
            inc.announced = time.monotonic()
            inc.stage = "grant"
            inc.handle._move(State.TRANSFERRING)
            log.debug("dst %d: %s announced by every writer", self.rank, inc.handle.req)
            self._maybe_done(inc)

    def _route(self, inc: Incoming, eng: SourceEngine, pieces) -> bool:
        """Whether this request's page runs go in place (``route``): only for a writer offered the
        KV regions, and only where that is expected to be at least as fast as staging. The choice
        is logged once per writer and path, with the estimate behind it."""
        if not (eng.plan.direct and all(eng.writers[p.src_rank].direct for p in pieces)):
            return False
        memory = "cuda" if self.cache.device.type == "cuda" else "cpu"
        cost = self.transport.span_cost_s.get(memory, self.transport.span_cost_s.get("cpu", 0.0))
        page_bytes = self.cache.buffers[0].nbytes // self.cache.pages
        r = route.choose(inc.pages, len(self.cache.buffers), page_bytes, cost, memory,
                         forced=self.settings.direct is True)
        self._log_route(inc, pieces, "direct (page runs in place)" if r.direct else "staged", r.reason)
        return r.direct

    def _log_route(self, inc: Incoming, pieces, path: str, reason: str) -> None:
        """One line per writer and path, the first time its requests take it."""
        for p in pieces:
            key = (inc.engine, p.src_rank, path)
            if key not in self._routes:
                remember(self._routes, key, True, MAX_LOST_AGENTS)
                log.info("dst %d: requests from %s go %s: %s (first: %s)", self.rank,
                         rank_name(inc.engine, "source", p.src_rank), path, reason, inc.handle.req)

    def _grant(self) -> None:
        """Hand free slots to waiting chunks in ``grants.grant_order``."""
        waiting = []
        for key in list(self._rr):
            inc = self.requests.get(key)
            if inc is None or inc.handle.done() or inc.next_chunk >= inc.chunks:
                self._rr.remove(key)
                continue
            waiting.append(grants.Waiting(key, inc.announced is not None, inc.next_chunk, inc.chunks,
                                          inc.direct or inc.placed, inc.engine))
        if not waiting:
            return
        a = self.arena.allocator
        held = self._slots_held() if a.free and (len(self.engines) > 1 or len({w.peer for w in waiting}) > 1) else None
        order = grants.grant_order(waiting, a.free, a.count, held, len(self.engines))
        now = time.perf_counter()
        served = set(order)
        for w in waiting:  # announced, wanting a chunk, and given none: it waits for a slot
            if w.announced and not w.direct and w.req not in served:  # (direct: needs no slot)
                inc = self.requests[w.req]
                if inc.slot_blocked is None:
                    inc.slot_blocked = now
        for key in order:
            inc = self.requests.get(key)
            if inc is None or inc.handle.done():
                continue
            if inc.placed:
                self._grant_placed(inc)
                continue
            if inc.direct:
                self._grant_direct(inc)
                continue
            slot = a.acquire()
            if slot is None:
                return
            if inc.slot_blocked is not None:
                inc.handle.stages["slot_wait"] += now - inc.slot_blocked
                self.metrics.stage("slot_wait", now - inc.slot_blocked)
                inc.slot_blocked = None
            self._grant_chunk(inc, slot)

    def _slots_held(self) -> dict[str, int]:
        """Arena slots each source engine's requests hold now: granted, landing, scattering, or kept
        for a lost writer's late write (``grants.grant_order`` shares the slots by it)."""
        held: dict[str, int] = {}
        for inc in self.requests.values():
            n = sum(ch.slot is not None for ch in (*inc.open.values(), *inc.quarantine.values()))
            if n:
                held[inc.engine] = held.get(inc.engine, 0) + n
        for inc, chunk, _ in self._scattering:
            if chunk.slot is not None:
                held[inc.engine] = held.get(inc.engine, 0) + 1
        return held

    def _grant_direct(self, inc: Incoming) -> None:
        eng = self.engines[inc.engine]
        (piece,) = eng.pieces(self.rank)
        inc.open[0] = Chunk(0, 0, inc.handle.tokens, None, {piece.src_rank})
        inc.next_chunk = 1
        self._send(inc.engine, piece.src_rank, {
            "type": "grant", "req": inc.handle.req, "tokens": inc.handle.tokens, "chunk": 0, "chunks": 1, "start": 0,
            "count": inc.handle.tokens, "pages": inc.pages.tolist(),
        })

    def _grant_placed(self, inc: Incoming) -> None:
        """The whole request to every writer at once, with this rank's page ids: no slot, no scatter."""
        ranks = self.engines[inc.engine].ranks(self.rank)
        inc.open[0] = Chunk(0, 0, inc.handle.tokens, None, set(ranks))
        inc.next_chunk = 1
        grant = {"type": "grant", "req": inc.handle.req, "tokens": inc.handle.tokens, "chunk": 0, "chunks": 1,
                 "start": 0, "count": inc.handle.tokens, "ipc_pages": inc.pages.tolist()}
        for r in ranks:
            self._send(inc.engine, r, grant)

    def _grant_chunk(self, inc: Incoming, slot: int) -> None:
        eng = self.engines[inc.engine]
        c = inc.next_chunk
        start = c * inc.chunk_tokens
        count = min(inc.chunk_tokens, inc.handle.tokens - start)
        offsets = eng.plan.writer_offsets(self.rank, count)
        base = self.arena.offset(slot)
        tickets = {}
        try:  # a two-sided transport posts its receives now, before any writer can send
            for rank, off in offsets.items():
                nbytes = eng.plan.piece_token_bytes(eng.writers[rank].piece) * count
                tickets[rank] = self.transport.expect(eng.writers[rank].agent,
                                                      Spans.single(self.arena_region, [base + off], [nbytes]))
        except KVStageError as e:
            self.arena.allocator.release(slot)
            return self._fail(inc.key, "local", "grant", f"posting receives: {e}", tell=True)
        idx = TokenIndex(self.cache, inc.pages, start, count, inc.kernel_pages)
        writers = eng.pieces(self.rank)
        pieces = [(p.dst_offset, p.heads.count, offsets[p.src_rank]) for p in writers]
        region = self.arena.view(self.arena.offset(slot), self.arena.slot_bytes)
        chunk = inc.open[c] = Chunk(c, start, count, slot, set(offsets))
        # several writers, on the kernel path: each piece is scattered as it lands, so only the last
        # writer's is left once the chunk is complete (one GPU: fills the gaps between the writers' gathers)
        each = prepare_piece_scatters(self.cache, idx, pieces, region) if len(pieces) > 1 else None
        if each is None:
            chunk.scatter = prepare_scatter(self.cache, idx, pieces, region, self._scatter_threads)
        else:
            chunk.piece_scatters = {p.src_rank: launch for p, launch in zip(writers, each)}
        inc.next_chunk += 1
        for rank, off in offsets.items():
            grant = {"type": "grant", "req": inc.handle.req, "tokens": inc.handle.tokens, "chunk": c,
                     "chunks": inc.chunks, "start": start, "count": count, "offset": base + off}
            if tickets[rank]:
                grant["ticket"] = md_to_wire(tickets[rank])
            self._send(inc.engine, rank, grant)
        log.debug("dst %d: %s chunk %d granted (slot %d)%s", self.rank, inc.handle.req, c, slot,
                  "" if inc.announced else ", early")

    def _progress(self) -> None:
        self._poll_scatters()
        for agent, data in self.transport.notifications():
            try:
                self._on_notice(agent, data)
            except ProtocolError as e:
                self._reject_notice(agent, data, e)
        self._grant()

    def _reject_notice(self, agent: str, data: bytes, err: ProtocolError) -> None:
        """A notice that breaks the protocol changes nothing but what it names
        (see ``_on_notice``); its writer hears why on its control connection."""
        writer = self._agents.get(agent)
        who = f"{writer.name} (agent {agent})" if writer else f"agent {agent}, not a connected source"
        log.warning("dst %d: rejected a landing notice from %s: %s", self.rank, who, err)
        if writer is not None:
            self._reject(writer.conn, {"type": "landed"}, err)

    def _on_notice(self, agent: str, data: bytes) -> None:
        """Check a "chunk landed" notice against the grant it answers.

        Refused without effect: a notice that is malformed, names another
        writer than the agent that sent it, an unknown or finished request, a
        chunk out of range, not granted yet, or already landed. A notice for
        a granted chunk whose write went elsewhere or had another length than
        the grant fails that request: its slot does not hold the chunk."""
        if any(agent == a for _, a, _ in self._probes.values()):
            return  # a probe's measured write into its lent slot
        notice = decode_notice(data)
        if self._late_landing(agent, notice):
            return
        writer = self._agents.get(agent)
        if writer is None or writer.rank != notice.writer:
            raise ProtocolError(f"notice names writer {notice.writer}, but agent {agent} is not that source rank's")
        self._on_landed(notice, writer)

    def _late_landing(self, agent: str, notice) -> bool:
        """The notice of a write from a writer lost before it landed: that write is
        over (a notice follows its bytes), so its slot can be reused."""
        engine = self._lost_agents.get(agent)
        inc = self.requests.get((engine, notice.req)) if engine is not None else None
        chunk = inc.quarantine.get(notice.chunk) if inc is not None else None
        lost = chunk.lost.get(notice.writer) if chunk is not None else None
        if lost is None or lost[0] != agent:
            return False
        log.warning("dst %d: chunk %d of %s from lost %s landed after the loss; its slot is reused",
                    self.rank, notice.chunk, notice.req, rank_name(engine, "source", notice.writer))
        self._unquarantine(inc, notice.chunk, notice.writer)
        return True

    def _on_landed(self, notice, writer: Writer, mapped: bool = False) -> None:
        """A writer's chunk is in its slot (its notice, or its ``landed`` message
        when it gathered straight into this arena), checked as ``_on_notice`` says."""
        req, c, rank, offset, nbytes = notice
        if rank != writer.rank:
            raise ProtocolError(f"landed message names writer {rank}, but came from source rank {writer.rank}")
        inc = self.requests.get((writer.engine, req))
        plan_ = self.engines[writer.engine].plan
        if inc is None:
            raise ProtocolError(f"notice for unknown request {req!r}")
        if c in inc.quarantine:
            self._unquarantine(inc, c, rank)
            return
        if inc.handle.done():
            raise ProtocolError(f"notice for chunk {c} of {req!r}, which already {inc.handle.state.value}")
        if not inc.chunks:
            raise ProtocolError(f"notice for chunk {c} of {req!r}, which is not granted yet (the request waits for its writers to connect)")
        if c >= inc.chunks:
            raise ProtocolError(f"notice for chunk {c} of {req!r}, out of range: the request has {inc.chunks} chunks")
        if c >= inc.next_chunk:
            raise ProtocolError(f"notice for chunk {c} of {req!r}, which is not granted yet")
        chunk = inc.open.get(c)
        if chunk is None or rank not in chunk.pending:
            raise ProtocolError(f"duplicate notice: chunk {c} of {req!r} from writer {rank} already landed")
        if inc.direct:
            want_offset, want = None, len(inc.pages) * sum(b.nbytes // self.cache.pages for b in self.cache.buffers)
        elif inc.placed:
            want_offset, want = None, plan_.piece_token_bytes(writer.piece) * chunk.count
        else:
            want_offset = self.arena.offset(chunk.slot) + plan_.writer_offsets(self.rank, chunk.count)[rank]
            want = plan_.piece_token_bytes(writer.piece) * chunk.count
        if offset != want_offset or nbytes != want:
            chunk.pending.discard(rank)  # its write is over, if not where it belongs
            what = "wrong slot" if offset != want_offset else "wrong size"
            self._fail(inc.key, writer.name, "write",
                       f"{what}: chunk {c} was written as {nbytes} bytes at arena offset {offset}; its grant was "
                       f"{want} bytes at {want_offset}", tell=True)
            raise ProtocolError(f"{what}: chunk {c} of {req!r} written as {nbytes} bytes at arena offset {offset}, "
                                f"granted {want} bytes at {want_offset}; the request failed")
        chunk.pending.discard(rank)
        log.debug("dst %d: %s chunk %d landed from %s%s", self.rank, req, c, writer.name, " (mapped)" if mapped else "")
        if not (inc.direct or inc.placed):  # "mapped" while every landing so far came by the writers' own stores
            way = "mapped" if mapped else "staged"
            inc.handle.path = way if not inc.landings or inc.handle.path == way else "staged+mapped"
            inc.landings += 1
        t0 = time.perf_counter()
        if chunk.piece_scatters is not None:  # this writer's piece goes to the pages now
            fence = CopyFence(self.cache.device)
            chunk.piece_scatters.pop(rank)()
            chunk.fences.append(fence.close())
            log.debug("dst %d: %s chunk %d piece of source rank %d scatter launched", self.rank, req, c, rank)
        if chunk.pending:
            return
        del inc.open[c]
        if inc.direct or inc.placed:
            return self._landed(inc, chunk)
        inc.stage = "scatter"
        if chunk.scatter is not None:
            fence = CopyFence(self.cache.device)
            chunk.scatter()
            chunk.fences.append(fence.close())
            log.debug("dst %d: %s chunk %d scatter launched", self.rank, req, c)
        self._scattering.append((inc, chunk, t0))
        self._poll_scatters()

    def _poll_scatters(self) -> None:
        """Finish every chunk whose scatter has passed its fence: free its slot, count it."""
        still = []
        for inc, chunk, t0 in self._scattering:
            if not chunk.scattered():
                still.append((inc, chunk, t0))
                continue
            took = time.perf_counter() - t0
            inc.handle.stages["scatter"] += took
            self.metrics.stage("scatter", took)
            gpu = chunk.settle()
            if gpu is not None:
                inc.handle.stages["scatter_gpu"] = inc.handle.stages.get("scatter_gpu", 0.0) + gpu
            self.arena.allocator.release(chunk.slot)
            log.debug("dst %d: %s chunk %d scattered", self.rank, inc.handle.req, chunk.index)
            if not inc.handle.done():
                inc.stage = "grant"
                self._landed(inc, chunk)
        self._scattering = still

    def _landed(self, inc: Incoming, chunk: Chunk) -> None:
        """A chunk is in this rank's pages."""
        inc.handle.bytes += self.engines[inc.engine].plan.dst_token_bytes() * chunk.count
        inc.scattered += 1
        self._maybe_done(inc)

    def _maybe_done(self, inc: Incoming) -> None:
        """Done with its last chunk scattered, once every writer announced it
        (early grants can land before a writer's ``ready``, which checks its token count)."""
        if inc.chunks and inc.scattered == inc.chunks and inc.announced is not None and not inc.handle.done():
            inc.handle._move(State.DONE)
            self.metrics.request_finished(peer_label(inc.engine), True, time.monotonic() - inc.announced,
                                          inc.handle.bytes)
            del self.requests[inc.key]
            if inc.key in self._rr:
                self._rr.remove(inc.key)
            for r in self.engines[inc.engine].ranks(self.rank):
                self._send(inc.engine, r, {"type": "done", "req": inc.handle.req})

    def _send(self, engine: str, rank: int, msg: dict) -> None:
        eng = self.engines.get(engine)
        w = eng.writers.get(rank) if eng is not None else None
        if w is not None:
            try:
                w.conn.send(msg)
            except OSError as e:
                log.debug("dst %d: send to %s failed: %s", self.rank, w.name, e)

    # -- failures --------------------------------------------------------------
    def _fail(self, key: tuple, peer: str, stage: str, cause: str, tell: bool, skip: int | None = None) -> None:
        inc = self.requests.get(key)
        if inc is None or inc.handle.done():
            return
        req = inc.handle.req
        # the handle says FAILED (its pages may be reused at once) only when no scatter of ours still writes them
        for chunk in inc.open.values():
            chunk.settle()
        for other, chunk, _ in self._scattering:
            if other is inc:
                chunk.wait()
        inc.handle._fail(peer, stage, cause)
        self.metrics.failure(peer_label(inc.engine), stage, cause)
        self.metrics.request_finished(peer_label(inc.engine), False, 0.0, inc.handle.bytes)
        log.warning("dst %d: request %s failed at %s with %s: %s", self.rank, req, stage, peer, cause)
        if key in self._rr:
            self._rr.remove(key)
        for c, chunk in list(inc.open.items()):
            if chunk.pending:  # a lost writer's too (``Chunk.lost``): its write may still land
                inc.quarantine[c] = chunk
            elif chunk.slot is not None:
                self.arena.allocator.release(chunk.slot)
        inc.open.clear()
        eng = self.engines.get(inc.engine)
        if tell and eng is not None:
            for r in eng.ranks(self.rank):
                if r != skip:
                    self._send(inc.engine, r, {"type": "abort", "req": req, "reason": cause})
        self._forget_if_clear(inc)

    def _unquarantine(self, inc: Incoming, c: int, rank: int) -> None:
        chunk = inc.quarantine[c]
        chunk.pending.discard(rank)
        chunk.lost.pop(rank, None)
        if not chunk.pending:
            del inc.quarantine[c]
            if chunk.slot is not None:
                self.arena.allocator.release(chunk.slot)
        self._forget_if_clear(inc)

    def _forget_if_clear(self, inc: Incoming) -> None:
        if inc.handle.done() and not inc.quarantine and not inc.open:
            self.requests.pop(inc.key, None)

    def _on_abort_ack(self, writer: Writer, req: str) -> None:
        """The writer has no write in flight for ``req`` any more: its slots can be reused."""
        inc = self.requests.get((writer.engine, req))
        if inc is None:
            return
        rank = writer.rank
        for c in [c for c, ch in inc.quarantine.items() if rank in ch.pending and rank not in ch.lost]:
            self._unquarantine(inc, c, rank)  # a lost writer's chunks wait for their notices (``_late_landing``)

    def _on_closed(self, conn: Connection, reason: str, answered: bool) -> None:
        writer = self._writers.pop(conn, None)
        conn.close()
        probe = self._probes.pop(conn, None)
        if probe is not None:  # the prober waited for its writes before closing
            self.arena.allocator.release(probe[0])
        if writer is None:
            return
        eng = self.engines[writer.engine]
        if eng.writers.get(writer.rank) is writer:
            del eng.writers[writer.rank]
        if self._agents.get(writer.agent) is writer:
            del self._agents[writer.agent]
        remember(self._lost_agents, writer.agent, writer.engine, MAX_LOST_AGENTS)
        live = [k for k, inc in self.requests.items() if inc.engine == writer.engine and not inc.handle.done()]
        (log.warning if live else log.info)("dst %d: %s disconnected (%s), %d requests affected",
                                            self.rank, writer.name, reason, len(live))
        # a closed control connection does not end the data path: UCX keeps its own connections, and what
        # the writer queued before the loss may still land in its granted slots. Its host answered (the
        # link is up): that is a matter of round trips. It stopped answering: whenever the link is back
        hold = min(ANSWERED_HOLD_S, self.settings.late_write_hold_s) if answered else self.settings.late_write_hold_s
        until, held = time.monotonic() + hold, 0
        for inc in self.requests.values():
            if inc.engine != writer.engine:
                continue
            for ch in (*inc.open.values(), *inc.quarantine.values()):
                if writer.rank in ch.pending:
                    ch.lost[writer.rank] = (writer.agent, until, answered)
                    held += 1
        if held:  # a staged chunk holds its slot; a direct one its request's pages (``tracks``)
            log.warning("dst %d: %s was lost with %d granted chunks not landed; their slots and pages stay "
                        "out of use until its late writes' notices arrive or %g s pass (%s)", self.rank, writer.name,
                        held, hold, "its host closed the connection" if answered
                        else "its host stopped answering: late_write_hold_s")
        for key in live:
            inc = self.requests.get(key)
            if inc is not None:
                self._fail(key, writer.name, inc.stage, f"connection lost ({reason})", tell=True)
        if not eng.writers:  # an engine gone whole leaves nothing behind but its failed requests' holds
            del self.engines[writer.engine]
            log.info("dst %d: prefill engine %r has no rank connected any more", self.rank, writer.engine)

    def _peers(self) -> list:
        return list(self._writers)

    def _check_stalls(self, now: float) -> None:
        """A request waiting for its announcement past ``ready_timeout_s``, or a
        granted chunk not landed ``stall_timeout_s`` after its grant (or after
        the last announcement, for early grants), fails; so does every request
        while a writer has been silent (no ping) for ``peer_timeout_s``.
        Waiting for a free slot is back-pressure, never a failure. A lost
        writer's slots are reused when their hold ends (``_on_closed``) if no
        notice of their writes came by then."""
        self._end_leases(now)
        over: dict = {}  # (rank, agent, answered) -> chunks released
        for inc in list(self.requests.values()):
            for c, ch in list(inc.quarantine.items()):
                for rank, (agent, until, answered) in list(ch.lost.items()):
                    if now > until:
                        key = (rank, agent, answered)
                        over[key] = over.get(key, 0) + 1
                        self._unquarantine(inc, c, rank)
        for (rank, agent, answered), n in over.items():
            (log.info if answered else log.warning)(
                "dst %d: hold over for lost source rank %d (agent %s): %d chunks released with no notice of their writes; "
                "their slots and pages are reused%s", self.rank, rank, agent, n,
                "" if answered else " (a write of them landing later would overwrite what is placed there next)")
        for w in list(self._writers.values()):
            quiet = self._silent(w.conn, now)
            if quiet is None:
                continue
            for key, inc in list(self.requests.items()):
                if inc.engine == w.engine and not inc.handle.done():
                    owes = any(w.rank in c.pending for c in inc.open.values())  # its writes are what the request waits for
                    self._fail(key, w.name, "write" if owes else inc.stage,
                               f"no control message for {quiet:.1f} s: the source is stopped or hung, or the link is down",
                               tell=True)
        for key, inc in list(self.requests.items()):
            if inc.handle.done():
                continue
            if inc.announced is None:
                if now - inc.touched > self.settings.ready_timeout_s:
                    eng = self.engines.get(inc.engine)
                    missing = sorted(set(eng.ranks(self.rank)) - set(inc.ready)) if eng else []
                    who = "source ranks " + ",".join(map(str, missing)) if missing else "sources"
                    if inc.engine:
                        who += f" of engine {inc.engine}"
                    self._fail(key, who, "waiting for writers", f"not announced within {self.settings.ready_timeout_s:g} s", tell=True)
                continue
            self._check_slow(inc, now)

    def _check_slow(self, inc: Incoming, now: float) -> None:
        """A granted chunk not landed ``SLOW_S`` after its grant (or after the last announcement,
        for early grants) makes the request slow: said once. It fails past ``stall_timeout_s``
        only while every writer it waits for runs (its pings say its loop turns): a busy engine
        is waited for, a running one that does not deliver is stuck."""
        waited = {c.index: now - max(c.granted, inc.announced) for c in inc.open.values()}
        slow = min(SLOW_S, self.settings.stall_timeout_s)
        if not waited or max(waited.values()) <= slow:
            return
        eng = self.engines.get(inc.engine)
        late = [c for c in inc.open.values() if waited[c.index] > slow]
        pending = sorted(set().union(*(c.pending for c in late)))
        who = (rank_name(inc.engine, "source", pending[0]) if len(pending) == 1 else
               "source ranks " + ",".join(map(str, pending)) + (f" of engine {inc.engine}" if inc.engine else ""))
        writers = [eng.writers.get(r) for r in pending] if eng else []
        def runs_since(since: float) -> bool:
            return all(w is not None and self._peer_running(w.conn, now, since) for w in writers)
        first = max(waited[c.index] for c in late)  # how long the longest-waiting chunk has waited
        running = runs_since(now - first + slow)
        if not inc.slow:
            inc.slow = True
            self.metrics.slow(peer_label(inc.engine), "write")
            log.warning("dst %d: request %s is slow: chunk %d not landed %.1f s after its grant; waiting for %s (%s)",
                        self.rank, inc.handle.req, late[0].index, waited[late[0].index], who,
                        "running" if running else "alive, busy: its loop does not turn")
        stuck = [c for c in late if waited[c.index] > self.settings.stall_timeout_s]
        if stuck and runs_since(now - first + self.settings.stall_timeout_s):
            self._fail(inc.key, who, "write", f"chunk {stuck[0].index} not landed {self.settings.stall_timeout_s:g} s "
                       "after its grant, while the source runs", tell=True)

    def _shutdown(self) -> None:
        self._listener.close()
        for conn in list(self._writers):
            conn.close()
        for key in list(self.requests):
            self._fail(key, "local", "shutdown", "destination closed", tell=False)
        unshare(self.arena.buffer)  # no new source can map it; those that did keep their mapping until they close
        if self._scatter_threads is not None:
            self._scatter_threads.close()
        super()._shutdown()
