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
import socket
import time
from dataclasses import dataclass, field as dc_field

import numpy as np

from kvstage.errors import KVStageError, ProtocolError, TransferFailed
from kvstage.layout import pages_needed
from kvstage.link.context import link_context
from kvstage.protocol.endpoint import Endpoint, EndpointStats, check_pages, remember
from kvstage.protocol.handshake import (HANDSHAKE_TIMEOUT_S, check_transport, check_version, md_from_wire, md_to_wire,
                                        spec_from_wire, spec_to_wire)
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.wire import PROTOCOL_VERSION, Connection, field, notice_fields
from kvstage.protocol.writes import DirectPageRuns, FromPages, InFlight, MappedGather, StagedWrite, WritePath
from kvstage.staging.arena import ArenaSize
from kvstage.staging.copy import upload_pages
from kvstage.staging.mapped import MappedArena, MappingError, open_shared
from kvstage.tp import Piece, TransferPlan, plan
from kvstage.transports.base import Region, WriteState

log = logging.getLogger("kvstage")

MAX_HELD = 4096  # grants kept for requests not sent here yet
MAX_FINISHED = 4096  # finished request ids remembered, so a late grant for one is refused, not held
#: a ``send`` whose gathers are the whole request (a small one, granted early, into mapped arenas) waits
#: this long on the caller's thread for them and says ``landed`` from there: the loop would first have
#: to wake, which takes longer on a GPU host than such a gather
SEND_WAIT_S = 200e-6


@dataclass
class Target:
    rank: int
    conn: Connection
    agent: str
    piece: Piece
    arena: Region
    kv: list[Region]
    mapped: MappedArena | None = None  # the destination's arena mapped here: gathers go straight into it
    path: WritePath | None = None  # how its staged chunks go (decided at connect); direct grants go direct


@dataclass
class Job:
    req: str
    dst: int
    chunk: int
    start: int
    count: int
    offset: int = 0
    pages: np.ndarray | None = None
    ticket: bytes = b""  # from the destination's transport.expect (two-sided transports)
    queued: float = dc_field(default_factory=time.perf_counter)  # granted (or sent, for a held grant)
    blocked: float | None = None  # when it first found no free slot in this arena


@dataclass
class Outgoing:
    handle: TransferHandle
    pages: np.ndarray
    chunks: dict = dc_field(default_factory=dict)  # dst rank -> chunks it will grant
    granted: dict = dc_field(default_factory=dict)  # dst rank -> set of chunk indices granted
    written: dict = dc_field(default_factory=dict)  # dst rank -> chunks fully written
    inflight: int = 0
    stage: str = "waiting for grant"
    touched: float = dc_field(default_factory=time.monotonic)
    kernel_pages: object = None  # the page ids where the GPU copies read them (``upload_pages``), once at ``send``


class Source(Endpoint):
    """A source rank. ``connect`` it to every destination rank, then ``send``."""

    role = "src"

    def __init__(self, cache, settings=None, transport=None):
        super().__init__(cache, settings, transport)
        self.plan: TransferPlan | None = None
        self.targets: dict[int, Target] = {}
        self.requests: dict[str, Outgoing] = {}
        self._jobs: collections.deque[Job] = collections.deque()
        self._inflight: list = []  # writes.InFlight
        self._gathering: list = []  # writes.Gathering
        self._held: dict[str, dict] = {}  # req not sent yet -> {(dst rank, chunk): (Job, chunks, tokens)}
        self._held_count = 0
        self._finished: dict[str, str] = {}  # req -> final state, oldest first
        self._direct = DirectPageRuns(self)
        self._staged = FromPages(self) if self.transport.gathers else StagedWrite(self)
        self._mapped = MappedGather(self)
        if self.transport.gathers:
            log.info("src %d: %s writes each chunk straight from the KV pages into the granted slot (no gather "
                     "into this rank's arena)", self.rank, self.transport.name)
        self._start()

    # -- public --------------------------------------------------------------
    def connect(self, addresses) -> list[int]:
        """Handshake with each destination rank at ``addresses`` (host, port).

        Keeps the connections to ranks this source writes to and returns their
        ranks. Raises ``TransferFailed`` when a destination refuses."""
        kept = []
        for host, port in addresses:
            rank = self._handshake(host, int(port))
            if rank is not None:
                kept.append(rank)
        return kept

    def send(self, req: str, page_ids, tokens: int) -> TransferHandle:
        """Send ``tokens`` tokens of request ``req`` held in ``page_ids`` (this rank's pages)."""
        if not isinstance(req, str) or not 0 < len(req) <= 256:
            raise ValueError(f"req={req!r}: must be a non-empty string of at most 256 characters")
        pages = check_pages(self.cache, page_ids, tokens)
        handle = TransferHandle(req, "src", int(tokens))
        log.debug("src %d: %s sent by the caller, %d tokens", self.rank, req, tokens)
        handle._abort = lambda reason: self._post("call", lambda: self._fail(req, "local", "abort", reason, tell=True))
        self._here(lambda: self._add(handle, pages))  # on this thread: it is awake, the loop may not be
        return handle

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
                "type": "hello", "version": PROTOCOL_VERSION, "token": self.settings.auth_token,
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
            raise TransferFailed("-", f"destination {peer}", "handshake", f"refused: {msg.get('reason')}")
        try:
            if msg["type"] != "welcome":
                raise ProtocolError(f"expected welcome, got {msg['type']!r}")
            check_version(msg, "destination")
            check_transport(msg, self.transport.name, "destination")
            dst = spec_from_wire(field(msg, "spec", dict))
            p = plan(self.spec, dst)
            rank = field(msg, "rank", int, minimum=0, maximum=dst.tp - 1)
            piece = next((x for x in p.targets_of(self.rank) if x.dst_rank == rank), None)
            if piece is None:  # another source rank covers this destination
                conn.close()
                self._call(lambda: self._set_plan(p, conn))
                return None
            arena = Region.from_wire(field(msg, "arena", dict))
            kv = [Region.from_wire(r) for r in field(msg, "kv", list)]
            md = md_from_wire(field(msg, "metadata", str))
        except (KVStageError, ValueError) as e:
            conn.close()
            raise TransferFailed("-", f"destination {peer}", "handshake", str(e)) from e
        conn.sock.settimeout(None)
        self._call(lambda: self._add_target(p, rank, conn, md, piece, arena, kv, msg))
        self._watch(conn)
        return rank

    # -- loop thread -----------------------------------------------------------
    def _set_plan(self, p: TransferPlan, conn: Connection) -> None:
        if self.plan is not None and p.dst != self.plan.dst:
            conn.close()
            raise TransferFailed("-", conn.peer, "handshake", f"destination spec {p.dst} differs from {self.plan.dst}")
        self.plan = p

    def _add_target(self, p: TransferPlan, rank: int, conn: Connection, md: bytes, piece: Piece, arena: Region,
                    kv: list[Region], welcome: dict) -> None:
        self._set_plan(p, conn)
        if kv and len(kv) != len(self.cache.buffers):
            conn.close()
            raise TransferFailed("-", conn.peer, "handshake", f"destination offered {len(kv)} KV regions, need {len(self.cache.buffers)}")
        facts = welcome.get("facts")
        mapped = self._map_arena(conn, arena, welcome.get("mapped"), facts)
        if rank in self.targets:
            self._close_target(self.targets[rank])
        agent = self.transport.connect(md)
        conn.peer = f"destination rank {rank} ({conn.peer})"
        path = self._mapped if mapped is not None else self._staged
        self.targets[rank] = Target(rank, conn, agent, piece, arena, kv, mapped, path)
        log.debug("src %d: connected to %s, heads %d..%d, %s path%s", self.rank, conn.peer, piece.heads.start,
                  piece.heads.stop, path.name, ", direct offered" if kv else "")
        self._log_link(facts, conn.peer, welcome.get("kv_facts"), direct=bool(kv))
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

    def _close_target(self, target: Target) -> None:
        """Close a destination's connection and unmap its arena, once no gather still writes into it."""
        target.conn.close()
        if target.mapped is not None:
            for g in self._gathering:
                if g.slot is None and any(j.dst == target.rank for j in g.jobs):
                    g.fence.wait()
            target.mapped.close()

    def _add(self, handle: TransferHandle, pages: np.ndarray) -> None:
        """A sent request (caller's thread, state lock held): announce it, apply the grants
        held for it and launch the gathers they allow. Writes, slots and the transport's
        polls stay the loop's."""
        if handle.req in self.requests:
            raise ValueError(f"request {handle.req!r} is already in flight on source rank {self.rank}")
        if self.plan is None:
            raise TransferFailed(handle.req, "-", "send", "not connected to any destination rank; call connect() first")
        want = [p.dst_rank for p in self.plan.targets_of(self.rank)]
        missing = [d for d in want if d not in self.targets]
        if missing:
            raise TransferFailed(handle.req, f"destination ranks {missing}", "send", "not connected")
        if not want:  # replicas or MLA: another source rank covers these heads
            handle._move(State.DONE)
            return
        self._finished.pop(handle.req, None)
        if self._take_abort(handle):  # every destination hears of it: none keeps slots granted to it
            for d in want:
                self._send(d, {"type": "abort", "req": handle.req, "reason": handle.error.cause})
                self._send(d, {"type": "abort_ack", "req": handle.req})
            return
        out = Outgoing(handle, pages)
        self.requests[handle.req] = out
        held = self._drop_held(handle.req)
        # the announcements go first: each destination handles its ``ready`` while this side gathers
        ready = {"type": "ready", "req": handle.req, "tokens": handle.tokens}
        for d in want:
            out.written[d] = 0
            out.granted[d] = set()
            self._send(d, ready)  # a send that fails here fails the request when the loop sees the closed connection
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
        if any(j.req == req for j in self._jobs) or any(len(out.granted[d]) != out.chunks.get(d) for d in out.written):
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
        target = next((t for t in self.targets.values() if t.conn is conn), None)
        if target is None:
            return
        kind = msg["type"]
        try:
            if kind == "grant":
                self._on_grant(target, msg)
            elif kind == "abort":
                req = field(msg, "req", str)
                cause = "destination aborted: " + str(msg.get("reason"))[:200]
                if req in self.requests:
                    self._fail(req, f"destination rank {target.rank}", "abort", cause, tell=False)
                else:  # not sent here (yet): nothing of it can land, its early grants are void
                    self._drop_held(req)
                    self._remember_abort(req, f"destination rank {target.rank}", cause)
                    self._send(target.rank, {"type": "abort_ack", "req": req})
            elif kind == "done":
                field(msg, "req", str)
            elif kind == "error":
                reason = str(msg.get("reason"))[:300]
                log.warning("src %d: %s refused our %s: %s", self.rank, conn.peer, msg.get("about"), reason)
                if isinstance(msg.get("req"), str):
                    self._fail(msg["req"], conn.peer, str(msg.get("about")), f"refused: {reason}", tell=False)
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
        job = Job(req, d, c, start, count)
        if "pages" in msg:
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
            nbytes = self.plan.piece_token_bytes(target.piece) * count
            if job.offset + nbytes > target.arena.nbytes:
                raise ProtocolError(
                    f"grant for {req!r} chunk {c}: {nbytes} bytes at offset {job.offset} exceed the "
                    f"destination arena of {target.arena.nbytes} bytes"
                )
        out = self.requests.get(req)
        if out is None:
            if req in self._finished:
                raise ProtocolError(f"grant for request {req!r}, which already {self._finished[req]} here")
            return self._hold(job, chunks, tokens)
        if out.handle.done():
            raise ProtocolError(f"grant for request {req!r}, which already {out.handle.state.value} here")
        self._apply_grant(out, job, chunks, tokens)

    def _hold(self, job: Job, chunks: int, tokens: int) -> None:
        """Keep a grant for a request not sent here yet (at most ``MAX_HELD``)."""
        held = self._held.get(job.req)
        if held is not None:
            if (job.dst, job.chunk) in held:
                raise ProtocolError(f"chunk {job.chunk} of {job.req!r} granted twice")
            other = next((g for (d, _), g in held.items() if d == job.dst), None)
            if other is not None and (other[1], other[2]) != (chunks, tokens):
                raise ProtocolError(f"grant says {chunks} chunks of {tokens} tokens for {job.req!r}; an earlier "
                                    f"grant said {other[1]} of {other[2]}")
        if self._held_count >= MAX_HELD:
            raise ProtocolError(f"more than {MAX_HELD} grants held for requests not sent to this source rank")
        self._held.setdefault(job.req, {})[(job.dst, job.chunk)] = (job, chunks, tokens)
        self._held_count += 1
        log.debug("src %d: %s chunk %d granted by destination rank %d, held until sent", self.rank, job.req,
                  job.chunk, job.dst)

    def _drop_held(self, req: str) -> dict:
        held = self._held.pop(req, {})
        self._held_count -= len(held)
        return held

    def _apply_grant(self, out: Outgoing, job: Job, chunks: int, tokens: int) -> None:
        req, d, c = job.req, job.dst, job.chunk
        if tokens != out.handle.tokens:
            return self._fail(req, f"destination rank {d}", "grant",
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
        if job.pages is not None:
            return self._direct
        target = self.targets.get(job.dst)
        return target.path if target is not None else self._staged

    def _progress(self) -> None:
        self._poll_writes()
        self._poll_gathers()
        while self._jobs:
            out = self.requests.get(self._jobs[0].req)
            if out is None or out.handle.done():
                self._jobs.popleft()
                continue
            if not self._path_of(self._jobs[0]).start(out):
                return  # back-pressure: wait for a write to finish

    def _launch_mapped(self) -> None:
        """Launch the queued gathers into mapped arenas, and nothing else (``_add``, on the
        caller's thread); the loop takes the queue from the first job that needs a slot, a
        write or the transport."""
        while self._jobs and self._path_of(self._jobs[0]) is self._mapped:
            out = self.requests.get(self._jobs[0].req)
            if out is None or out.handle.done():
                self._jobs.popleft()
                continue
            self._mapped.start(out, poll=False)

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
            gone = next((j.dst for j in g.jobs if j.dst not in self.targets), None)
            mapped = g.slot is None
            going = not (out.handle.done() or gone is not None or (g.write is None and not mapped))
            if going:  # what the destinations wait for goes first (this path runs cold), the accounting after
                if mapped:  # the gather's stores were the transfer: tell each destination they are done
                    for j, nbytes in zip(g.jobs, g.sizes):
                        self._send(j.dst, {"type": "landed", **notice_fields(j.req, j.chunk, self.rank, j.offset, nbytes)})
                else:
                    self._post_write(out, job, g.slot, g.write, g.sizes[0], 1, t1)
            out.handle.stages["gather"] += t1 - g.started
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
                    self._fail(job.req, f"destination rank {gone}", "write", "not connected", tell=False)
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
            return self._fail(job.req, f"destination rank {job.dst}", "write", str(e), tell=True)
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
            out = self.requests.get(w.job.req)
            if out is None:
                continue
            out.inflight -= 1
            out.touched = time.monotonic()
            out.handle.stages["write"] += time.perf_counter() - w.posted
            log.debug("src %d: %s chunk %d write complete", self.rank, w.job.req, w.job.chunk)
            if isinstance(state, Exception):
                self._fail(w.job.req, f"destination rank {w.job.dst}", "write", str(state), tell=True)
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
        self._maybe_forget(out)

    # -- failures --------------------------------------------------------------
    def _fail(self, req: str, peer: str, stage: str, cause: str, tell: bool) -> None:
        out = self.requests.get(req)
        if out is None or out.handle.done():
            return
        out.handle._fail(peer, stage, cause)
        log.warning("src %d: request %s failed at %s with %s: %s", self.rank, req, stage, peer, cause)
        if tell:
            for d in out.written:
                self._send(d, {"type": "abort", "req": req, "reason": cause})
        self._maybe_forget(out)

    def _maybe_forget(self, out: Outgoing) -> None:
        """Drop a final request once no write of it can still land; tell the
        destinations (after a failure) that its slots may be reused."""
        if not out.handle.done() or out.inflight:
            return
        self.requests.pop(out.handle.req, None)
        remember(self._finished, out.handle.req, out.handle.state.value, MAX_FINISHED)
        if out.handle.state is State.FAILED:
            for d in out.written:
                self._send(d, {"type": "abort_ack", "req": out.handle.req})

    def _send(self, rank: int, msg: dict) -> None:
        t = self.targets.get(rank)
        if t is not None:
            try:
                t.conn.send(msg)
            except OSError as e:
                log.debug("src %d: send to destination rank %d failed: %s", self.rank, rank, e)

    def _on_closed(self, conn: Connection, reason: str, answered: bool) -> None:
        target = next((t for t in self.targets.values() if t.conn is conn), None)
        conn.close()
        if target is None:
            return
        del self.targets[target.rank]
        self._close_target(target)
        self.transport.disconnect(target.agent)
        d = target.rank
        for req, held in list(self._held.items()):  # that destination's early grants died with it
            for key in [k for k in held if k[0] == d]:
                del held[key]
                self._held_count -= 1
            if not held:
                del self._held[req]
        hit = [req for req, out in self.requests.items() if d in out.written and out.written[d] != out.chunks.get(d, -1)]
        (log.warning if hit else log.info)("src %d: destination rank %d disconnected (%s), %d requests affected",
                                           self.rank, d, reason, len(hit))
        for req in hit:
            self._fail(req, f"destination rank {d}", self.requests[req].stage, f"connection lost ({reason})", tell=True)

    def _peers(self) -> list:
        return [t.conn for t in self.targets.values()]

    def _stats(self) -> EndpointStats:
        return dataclasses.replace(super()._stats(), held_grants=self._held_count)

    def _check_stalls(self, now: float) -> None:
        """An announced request never granted within ``ready_timeout_s``, or a
        write not complete after ``stall_timeout_s``, fails. Waiting for grants
        is the destination's back-pressure; a dead destination closes the
        control connection (or misses its keepalives), a frozen one stops
        pinging: its requests fail after ``peer_timeout_s`` of silence."""
        for d, t in list(self.targets.items()):
            quiet = self._silent(t.conn, now)
            if quiet is None:
                continue
            for req, out in list(self.requests.items()):
                if d in out.written and not out.handle.done():
                    self._fail(req, f"destination rank {d}", out.stage,
                               f"no control message for {quiet:.1f} s: the destination is frozen or hung, or the link is down", tell=True)
        for req, out in list(self.requests.items()):
            if not out.handle.done() and out.handle.state is State.PENDING and now - out.touched > self.settings.ready_timeout_s:
                self._fail(req, "destination", "waiting for grant", f"no grant within {self.settings.ready_timeout_s:g} s", tell=True)
        t = time.perf_counter()
        for w in self._inflight:
            if t - w.posted > self.settings.stall_timeout_s:
                self._fail(w.job.req, f"destination rank {w.job.dst}", "write",
                           f"write not complete after {self.settings.stall_timeout_s:g} s", tell=True)

    def _forgive(self, gap: float) -> None:
        for out in self.requests.values():
            out.touched += gap
        for w in self._inflight:
            w.posted += gap

    def _shutdown(self) -> None:
        for req in list(self.requests):
            self._fail(req, "local", "shutdown", "source closed", tell=True)
        for t in list(self.targets.values()):
            self._close_target(t)
        super()._shutdown()
