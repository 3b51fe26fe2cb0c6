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
import logging
import socket
import time
from dataclasses import dataclass, field as dc_field

import numpy as np

from kvstage.errors import KVStageError, ProtocolError, TransferFailed
from kvstage.layout import pages_needed
from kvstage.probe.context import link_context
from kvstage.protocol.endpoint import Endpoint, check_pages, check_transport, md_from_wire, md_to_wire, remember, spec_from_wire, spec_to_wire
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.wire import PROTOCOL_VERSION, Connection, encode_notice, field, notice_fields
from kvstage.staging import landing
from kvstage.staging.copy import TokenIndex, gather, gather_pieces, upload_pages
from kvstage.staging.fence import CopyFence
from kvstage.staging.spans import chunk_spans
from kvstage.tp import Piece, TransferPlan, plan
from kvstage.transports.base import ReadyWrite, Region, Spans, WriteState
from kvstage.transports.mapped import MappedArena, MappingError, open_shared

log = logging.getLogger("kvstage")

MAX_HELD = 4096  # grants kept for requests not sent here yet
MAX_FINISHED = 4096  # finished request ids remembered, so a late grant for one is refused, not held


@dataclass
class Target:
    rank: int
    conn: Connection
    agent: str
    piece: Piece
    arena: Region
    kv: list[Region]
    mapped: MappedArena | None = None  # the destination's arena mapped here: gathers go straight into it


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
    word: tuple[int, int] | None = None  # (device address, value) of the landing word to set after the gather
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


@dataclass
class Gathering:
    """A chunk whose gather is launched; its write, made ready while the gather
    runs, is posted once the fence passes. Gathered straight into mapped arenas
    (``slot`` None), one launch may fill several destinations' pieces of the same
    tokens: ``jobs`` and ``sizes`` list them (otherwise one job)."""

    fence: CopyFence
    out: "Outgoing"
    jobs: list[Job]
    slot: int | None
    sizes: list[int]
    started: float
    write: ReadyWrite | None = None


@dataclass
class InFlight:
    handle: object
    job: Job
    slot: int | None
    posted: float


class Source(Endpoint):
    """A source rank. ``connect`` it to every destination rank, then ``send``."""

    role = "src"

    def __init__(self, cache, settings=None, transport=None):
        super().__init__(cache, settings, transport)
        self.plan: TransferPlan | None = None
        self.targets: dict[int, Target] = {}
        self.requests: dict[str, Outgoing] = {}
        self._jobs: collections.deque[Job] = collections.deque()
        self._inflight: list[InFlight] = []
        self._gathering: list[Gathering] = []
        self._held: dict[str, dict] = {}  # req not sent yet -> {(dst rank, chunk): (Job, chunks, tokens)}
        self._held_count = 0
        self._finished: dict[str, str] = {}  # req -> final state, oldest first
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

    # -- handshake (caller's thread; state changes go to the loop) -------------
    def _handshake(self, host: str, port: int) -> int | None:
        peer = f"{host}:{port}"
        timeout = self.settings.handshake_timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise TransferFailed("-", f"destination {peer}", "handshake", f"cannot connect: {e}") from e
        conn = Connection(sock, peer)
        try:
            conn.send({
                "type": "hello", "version": PROTOCOL_VERSION, "token": self.settings.auth_token,
                "spec": spec_to_wire(self.spec), "rank": self.rank, "agent": self.transport.id,
                "transport": self.transport.name,
                "metadata": md_to_wire(self.transport.metadata()), "slot_bytes": self.settings.slot_bytes,
                "facts": self.facts,
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
            if field(msg, "version", int) != PROTOCOL_VERSION:
                raise ProtocolError(f"destination speaks protocol {msg['version']}, this side {PROTOCOL_VERSION}")
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
        self._call(lambda: self._add_target(p, rank, conn, md, piece, arena, kv, msg.get("facts"), msg.get("mapped")))
        self._watch(conn)
        return rank

    # -- loop thread -----------------------------------------------------------
    def _set_plan(self, p: TransferPlan, conn: Connection) -> None:
        if self.plan is not None and p.dst != self.plan.dst:
            conn.close()
            raise TransferFailed("-", conn.peer, "handshake", f"destination spec {p.dst} differs from {self.plan.dst}")
        self.plan = p

    def _add_target(self, p: TransferPlan, rank: int, conn: Connection, md: bytes, piece, arena, kv, facts,
                    shared) -> None:
        self._set_plan(p, conn)
        direct = bool(kv)
        if direct and len(kv) != len(self.cache.buffers):
            conn.close()
            raise TransferFailed("-", conn.peer, "handshake", f"destination offered {len(kv)} KV regions, need {len(self.cache.buffers)}")
        mapped = None if direct else self._map_arena(conn, arena, shared, facts)
        if rank in self.targets:
            self._close_target(self.targets[rank])
        agent = self.transport.connect(md)
        conn.peer = f"destination rank {rank} ({conn.peer})"
        self.targets[rank] = Target(rank, conn, agent, piece, arena, kv, mapped)
        log.debug("src %d: connected to %s, heads %d..%d, %s path", self.rank, conn.peer, piece.heads.start,
                  piece.heads.stop, "direct" if direct else "mapped" if mapped else "staged")
        self._log_link(facts, conn.peer)
        if mapped is not None:
            conn.send({"type": "mapped"})  # before any ready: the destination may queue its scatters ahead
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
                # another GPU: NIXL's copy engines write it over the link as fast (docs/benchmarks.md,
                # session 5) and leave this GPU's SMs to the model; mapped=on stores over the link anyway
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
        # The announcements go first: each destination handles its ``ready`` while this side
        # gathers, instead of after (docs/benchmarks.md, session 16)
        ready = {"type": "ready", "req": handle.req, "tokens": handle.tokens}
        for d in want:
            out.written[d] = 0
            out.granted[d] = set()
            self._send(d, ready)  # a send that fails here fails the request when the loop sees the closed connection
        if not all(self.targets[d].kv for d in want):
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
        ``send_wait_us``, and send their ``landed`` from here: the caller's thread is awake,
        the loop would first have to wake (docs/benchmarks.md, session 15). Not when the
        gathers have not started on the GPU (work queued before them, an engine's model
        step, would hold the caller for the whole bound): the loop does it then."""
        wait = self.settings.send_wait_us
        req = out.handle.req
        if (wait <= 0 or any(j.req == req for j in self._jobs)
                or any(len(out.granted[d]) != out.chunks.get(d) for d in out.written)):
            return
        fences = [g.fence for g in self._gathering if g.out is out and g.slot is None]
        if not fences or not all(f.started() for f in fences):
            return
        deadline = time.perf_counter() + wait * 1e-6
        while not all(f.done() for f in fences):
            if time.perf_counter() > deadline:
                log.debug("src %d: %s gathers still running after send_wait_us=%g: the loop reports them",
                          self.rank, req, wait)
                return
        self._poll_gathers()

    def _arena_slots(self) -> tuple[int, int]:
        """A transport that reads the pages itself (``gathers``) leaves this rank's arena unused:
        one page keeps its shape, not ``arena_mb`` of memory. The hello announces the slot size
        of the settings either way: the destination cuts chunks to fit it."""
        return (4096, 1) if self.transport.gathers else super()._arena_slots()

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
        """Check a grant on arrival; apply it, or hold it until the request is sent."""
        req = field(msg, "req", str)
        d = target.rank
        tokens = field(msg, "tokens", int, minimum=1)
        chunks = field(msg, "chunks", int, minimum=1, maximum=tokens)
        c = field(msg, "chunk", int, minimum=0, maximum=chunks - 1)
        start = field(msg, "start", int, minimum=0, maximum=tokens - 1)
        count = field(msg, "count", int, minimum=1, maximum=tokens - start)
        job = Job(req, d, c, start, count)
        if target.kv:
            pages = field(msg, "pages", list)
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
            if "word" in msg:  # set after the gather, when gathering into its mapped arena (else unused)
                word, value = field(msg, "word", int, minimum=0), field(msg, "value", int, minimum=1, maximum=2**32 - 1)
                if target.mapped is not None and target.mapped.words is not None:
                    try:  # word_addr checks it against the words the arena shares
                        job.word = (target.mapped.word_addr(word), value)
                    except IndexError as e:
                        raise ProtocolError(f"grant for {req!r} chunk {c}: {e}") from None
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
        out.handle.path = "direct" if job.pages is not None else "mapped" if self.targets[d].mapped else "staged"
        out.stage = "gather"
        out.touched = time.monotonic()
        if out.handle.state is State.PENDING:
            out.handle._move(State.TRANSFERRING)
        job.queued = time.perf_counter()
        self._jobs.append(job)
        log.debug("src %d: %s chunk %d granted by destination rank %d", self.rank, req, c, d)

    def _progress(self) -> None:
        self._poll_writes()
        self._poll_gathers()
        while self._jobs:
            job = self._jobs[0]
            out = self.requests.get(job.req)
            if out is None or out.handle.done():
                self._jobs.popleft()
                continue
            if job.pages is not None:
                self._jobs.popleft()
                self._write_direct(out, job)
                continue
            if self._mapped(job):  # the granted slot is the gather's output
                self._write_staged(out, self._take_mapped(), None)
                continue
            if self.transport.gathers:  # the write reads the pages: no slot of this arena
                self._jobs.popleft()
                self._write_from_pages(out, job)
                continue
            slot = self.arena.allocator.acquire()
            if slot is None:  # back-pressure: wait for a write to finish
                if job.blocked is None:
                    job.blocked = time.perf_counter()
                return
            self._jobs.popleft()
            if job.blocked is not None:
                out.handle.stages["slot_wait"] += time.perf_counter() - job.blocked
            self._write_staged(out, [job], slot)

    def _launch_mapped(self) -> None:
        """Launch the queued gathers into mapped arenas, and nothing else (``_add``, on the
        caller's thread); the loop takes the queue from the first job that needs a slot, a
        write or the transport."""
        while self._jobs and self._mapped(self._jobs[0]):
            out = self.requests.get(self._jobs[0].req)
            if out is None or out.handle.done():
                self._jobs.popleft()
                continue
            self._write_staged(out, self._take_mapped(), None, poll=False)

    def _mapped(self, job: Job) -> bool:
        target = self.targets.get(job.dst)
        return job.pages is None and target is not None and target.mapped is not None

    def _take_mapped(self) -> list[Job]:
        """The queue's first job and the jobs right behind it for the same tokens of the
        same request into other destinations' mapped arenas (a 1->N source's pieces of
        one chunk, granted together): one gather launch fills them all."""
        jobs = [self._jobs.popleft()]
        head = jobs[0]
        while self._jobs:
            job = self._jobs[0]
            if ((job.req, job.start, job.count) != (head.req, head.start, head.count) or not self._mapped(job)
                    or any(j.dst == job.dst for j in jobs)):
                break
            jobs.append(self._jobs.popleft())
        return jobs

    def _write_staged(self, out: Outgoing, jobs: list[Job], slot: int | None, poll: bool = True) -> None:
        """Gather the chunk into ``slot`` of this arena and make its write ready; ``slot``
        None: gather straight into the granted slots of the destinations' mapped arenas
        (``jobs``: the same tokens for each of them, one launch; ``poll`` False: the loop
        reports them landed, on its next turn)."""
        job = jobs[0]
        targets = [self.targets.get(j.dst) for j in jobs]
        if None in targets:
            if slot is not None:
                self.arena.allocator.release(slot)
            gone = jobs[targets.index(None)].dst
            return self._fail(job.req, f"destination rank {gone}", "write", "not connected", tell=False)
        sizes = [self.plan.piece_token_bytes(t.piece) * j.count for t, j in zip(targets, jobs)]
        t0 = time.perf_counter()
        stages = out.handle.stages
        stages.setdefault("start", t0 - out.handle.created)  # send() to its first copy (see request.py)
        # granted to gathered, less any wait for a slot: behind this rank's earlier chunks (one loop copies them in turn)
        stages["queued"] += max(0.0, (job.blocked if job.blocked is not None else t0) - job.queued)
        try:
            fence = CopyFence(self.cache.device)
            idx = TokenIndex(self.cache, out.pages, job.start, job.count, out.kernel_pages)
            if slot is None:
                gather_pieces(self.cache, idx, [(t.piece.src_offset, t.piece.heads.count, t.mapped.view(j.offset, n))
                                                for t, j, n in zip(targets, jobs, sizes)])
                for j in jobs:  # each destination's queued scatter of its piece starts now
                    if j.word is not None:
                        landing.signal(self.cache.device, *j.word)
            else:
                piece = targets[0].piece
                gather(self.cache, idx, piece.src_offset, piece.heads.count,
                       self.arena.view(self.arena.offset(slot), sizes[0]))
            fence.close()
            log.debug("src %d: %s chunk %d gather launched%s", self.rank, job.req, job.chunk,
                      f" (one launch for destination ranks {','.join(str(j.dst) for j in jobs)})" if len(jobs) > 1 else "")
        except Exception as e:
            if slot is not None:
                self.arena.allocator.release(slot)
            return self._fail(job.req, "local", "gather", f"{type(e).__name__}: {e}", tell=True)
        out.inflight += 1  # the request is not forgotten while its gather may still run
        g = Gathering(fence, out, jobs, slot, sizes, t0)
        self._gathering.append(g)
        if slot is None:
            if poll:
                self._poll_gathers()
            return
        try:  # the write's descriptors and transfer request, made while the GPU gathers
            g.write = self.transport.prepare_write(
                targets[0].agent, Spans.single(self.arena_region, [self.arena.offset(slot)], [sizes[0]]),
                Spans.single(targets[0].arena, [job.offset], [sizes[0]]),
                encode_notice(job.req, job.chunk, self.rank, job.offset, sizes[0]), job.ticket)
        except KVStageError as e:  # the slot is freed once the gather into it has finished
            self._fail(job.req, f"destination rank {job.dst}", "write", str(e), tell=True)
        self._poll_gathers()

    def _poll_gathers(self) -> None:
        """Post the write of every chunk whose gather has finished on the device."""
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

    def _write_from_pages(self, out: Outgoing, job: Job) -> None:
        """The chunk's head slice straight from this rank's pages into the granted slot,
        laid out as a gather would have (``staging.spans``)."""
        target = self.targets.get(job.dst)
        if target is None:
            return self._fail(job.req, f"destination rank {job.dst}", "write", "not connected", tell=False)
        t = time.perf_counter()
        stages = out.handle.stages
        stages.setdefault("start", t - out.handle.created)
        stages["queued"] += max(0.0, t - job.queued)
        index, offsets, lengths = chunk_spans(self.cache, out.pages, job.start, job.count, target.piece.src_offset,
                                              target.piece.heads.count)
        local = Spans(tuple(self.kv_regions()), index, offsets, lengths)
        remote = Spans((target.arena,), np.zeros_like(index), job.offset + np.cumsum(lengths) - lengths, lengths)
        nbytes = int(lengths.sum())
        try:
            write = self.transport.prepare_write(target.agent, local, remote,
                                                 encode_notice(job.req, job.chunk, self.rank, job.offset, nbytes), job.ticket)
        except KVStageError as e:
            return self._fail(job.req, f"destination rank {job.dst}", "write", str(e), tell=True)
        self._post_write(out, job, None, write, nbytes, len(local), t)

    def _write_direct(self, out: Outgoing, job: Job) -> None:
        """Whole pages straight into the destination's KV, coalesced into runs."""
        target = self.targets[job.dst]
        src, dst = out.pages, job.pages
        n = len(src)
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        runs = np.diff(np.concatenate((starts, [n])))
        local_regions = self.kv_regions()
        nbuf = len(local_regions)
        page_bytes = np.array([b.nbytes // self.cache.pages for b in self.cache.buffers], dtype=np.int64)
        index = np.repeat(np.arange(nbuf), len(starts))
        pb = page_bytes[index]
        local = Spans(tuple(local_regions), index, np.tile(src[starts], nbuf) * pb, np.tile(runs, nbuf) * pb)
        remote = Spans(tuple(target.kv), index, np.tile(dst[starts], nbuf) * pb, np.tile(runs, nbuf) * pb)
        nbytes = int(local.lengths.sum())
        t = time.perf_counter()
        out.handle.stages.setdefault("start", t - out.handle.created)
        try:
            write = self.transport.prepare_write(target.agent, local, remote,
                                                 encode_notice(job.req, job.chunk, self.rank, None, nbytes), job.ticket)
        except KVStageError as e:
            return self._fail(job.req, f"destination rank {job.dst}", "write", str(e), tell=True)
        self._post_write(out, job, None, write, nbytes, len(local), t)

    def _post_write(self, out, job, slot, write: ReadyWrite, nbytes: int, descriptors: int, t: float) -> None:
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

    def _shutdown(self) -> None:
        for req in list(self.requests):
            self._fail(req, "local", "shutdown", "source closed", tell=True)
        for t in list(self.targets.values()):
            self._close_target(t)
        super()._shutdown()
