"""The destination (decode) side: it moves the bytes.

One destination serves the source ranks of any number of prefill engines at
once, each engine with its own plan (its own TP size): a writer is known by
its engine and rank, a request by its engine and id. The arena, the
transport and the loop are shared by every engine; ``slots`` shares the arena
fairly among the engines whose requests wait for it, and a writer that leaves
fails only its own engine's requests.

Per request: once every writer the plan names has said ``ready`` (before
``expect`` or after it: a ``ready`` that comes first is kept), the request's
moves start (``reads``), on the caller's thread when ``expect`` finds the
readies in, else on the loop: one kernel launch for the ipc writers, page-run
reads for direct ones, and for read and pages writers chunk after chunk through
this rank's arena. When every byte is in its pages the request is done and each
writer hears ``done``. The sources' processes are not needed after their
``ready``: a source stopped right after ``send`` is read all the same.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstage.config import Settings
from kvstage.errors import IncompatibleGeometry, KVStageError, ProtocolError
from kvstage.link.context import link_context
from kvstage.protocol import slots
from kvstage.protocol.address import Address, new_secret
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
from kvstage.protocol.gate import PRE_AUTH_TYPES
from kvstage.protocol.handshake import (
    HANDSHAKE_TIMEOUT_S,
    check_hello,
    check_same_model,
    check_token,
    check_transport,
    check_version,
    md_to_wire,
    proof,
    spec_to_wire,
)
from kvstage.protocol.incoming import Group, Incoming, SourceEngine, Writer, add_chunk, check_ready
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
    Probe,
    Welcome,
)
from kvstage.protocol.messages import Ready as ReadyMessage
from kvstage.protocol.outgoing import group_piece, overlaps, part_key
from kvstage.protocol.reads import ArenaMove, DirectMove, IpcMove, Leftover
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.route import Path, allowed_paths
from kvstage.protocol.wire import Connection
from kvstage.staging.copy import CopyThreads, upload_pages
from kvstage.staging.fence import CopyFence, HostFence
from kvstage.transports.base import Region, WriteState

log = logging.getLogger("kvstage")

#: requests this side was told are ready before it expected them, kept at most this many (the oldest go)
MAX_EARLY = 4096
#: prefill engines remembered as gone (their last rank left): a request that names one later fails at once
MAX_GONE = 1024
#: a probe's lent slot goes back this long after it was lent: a measured write takes milliseconds
PROBE_LEASE_S = 10.0
#: probes hold at most this share of the arena's slots at once (at least one): requests keep the rest
PROBE_SHARE = 0.25
#: after a failed accept (out of descriptors), the listener waits this long, doubling to ``ACCEPT_BACKOFF_MAX_S``
ACCEPT_BACKOFF_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
#: a burst of failed accepts ends with an accept this long after the last failure
ACCEPT_QUIET_S = 2 * ACCEPT_BACKOFF_MAX_S


def _b64(data: bytes | None) -> str:
    import base64

    return base64.b64encode(data).decode() if data else ""


def scatter_threads(cores: int) -> int:
    """Threads a host cache's scatter runs on: two where there are cores for it (the destination does the
    reads and the scatters of every writer), else one."""
    return 2 if cores >= 2 else 1


class Destination(Endpoint):
    """A destination rank. ``address`` is where sources connect, with the secret they present (an
    ``Address``: pass it, or its ``url``, to ``Source.connect``): the ranks of any number of prefill
    engines (``engine``: this rank's own engine id, told to every source)."""

    role = "dst"

    def __init__(
        self,
        cache,
        settings=None,
        transport=None,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        engine: str = "",
        model: str = "",
    ):
        settings = settings or Settings()
        super().__init__(cache, settings, transport, engine, model)
        #: what a source must present: the deployment's token, else a secret of this endpoint's own (handed to
        #: peers in ``address``), or nothing where the operator opted out by name (``allow_unauthenticated``)
        self.secret = settings.auth_token or ("" if settings.allow_unauthenticated else new_secret())
        self.engines: dict[str, SourceEngine] = {}
        self._writers: dict[Connection, Writer] = {}  # every connected writer, by its control connection
        self.requests: dict[tuple[str, str], Incoming] = {}
        self._early: dict[tuple[str, str], dict] = {}  # (engine, req) -> {source rank: [ready, chunks...]}
        self._gone: dict[str, str] = {}  # prefill engine whose last rank left -> why
        self._order: list[tuple] = []  # (request, layer group) reading through the arena, in arrival order
        self._leftovers: list[Leftover] = []  # reads of failed requests that may still land
        self._probes: dict[
            Connection, tuple[int, str, float]
        ] = {}  # probe connection -> (slot, prober agent, lease end)
        self._scratch: tuple[Any, Region] | None = None  # (tensor, region) a warm read lands in (``_warm_read``)
        self.paths = self._paths()
        self._scatter_threads = self._copy_threads()
        # host scatters run off the loop's thread (``launch_copy``); one at a time, each on ``_scatter_threads``
        self._host_copies = (
            ThreadPoolExecutor(1, thread_name_prefix=f"kvstage-copy{self.rank}")
            if self.cache.device.type == "cpu"
            else None
        )
        self._listener = socket.create_server(listen)
        host, port = self._listener.getsockname()[:2]
        #: where sources connect, with the secret they present (none where the deployment set a token: its
        #: sources hold it): pass it to ``Source.connect`` as it is, or its ``url``
        self.address = Address(host, port, "" if settings.auth_token else self.secret)
        self._start()
        threading.Thread(target=self._accept, name=f"kvstage-accept{self.rank}", daemon=True).start()
        auth = (
            "sources present the auth token"
            if settings.auth_token
            else "sources present this rank's own secret, handed to them in its address (no auth token set)"
            if self.secret
            else "no authentication"
        )
        log.info(
            "dst %d: listening on %s:%d (%d slots of %d bytes; %s)",
            self.rank,
            *self.address,
            self.arena.allocator.count,
            self.arena.slot_bytes,
            auth,
        )
        if not self.secret:
            log.warning(
                "dst %d: no auth token and allow_unauthenticated=True: anyone who can reach %s:%d can connect "
                "and have its arena read (no page path and no probe lease is offered without a token); unset "
                "KVSTAGE_ALLOW_UNAUTHENTICATED to make a secret of this rank's own",
                self.rank,
                *self.address,
            )

    def _paths(self) -> frozenset:
        """The paths this rank reads by: its ``path`` setting (auto: all), the page paths only with a token,
        ``ipc`` only for a CUDA cache whose kernel can run, ``direct``/``pages`` only one-sided."""
        paths = allowed_paths(self.settings.path)
        if not self.settings.auth_token:
            paths &= {Path.READ}
        if self.cache.device.type != "cuda":
            paths -= {Path.IPC}
        if not self.transport.one_sided:
            paths -= {Path.DIRECT, Path.PAGES}
        return frozenset(paths)

    def launch_copy(self, copy) -> object:
        """Start ``copy`` (a prepared scatter) and return its fence: on CUDA it is queued on this rank's
        stream; on the host it runs on a thread of its own, so the loop goes on posting reads meanwhile."""
        if self._host_copies is None:
            fence = CopyFence(self.cache.device)
            copy()
            return fence.close()
        return HostFence(self._host_copies.submit(copy))

    def _copy_threads(self) -> CopyThreads | None:
        """The threads a host cache's scatters share (``scatter_threads``), or None for one (logged when more)."""
        if self.cache.device.type != "cpu":
            return None
        n = scatter_threads(os.cpu_count() or 1)
        if n == 1:
            return None
        log.info("dst %d: host scatters on %d threads", self.rank, n)
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
                    log.warning(
                        "dst %d: accept failed: %s; retrying, backing off up to %g s",
                        self.rank,
                        e,
                        ACCEPT_BACKOFF_MAX_S,
                    )
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
    def expect(self, req: str, page_ids, tokens: int, engine: str = "", first: int = 0) -> TransferHandle:
        """Receive ``tokens`` tokens of request ``req`` into ``page_ids`` (this rank's pages) from the ranks
        of prefill engine ``engine`` (the id its sources were made with): tokens ``first .. first + tokens``
        of what they sent (``first`` > 0: the tokens before are cached here already)."""
        if not isinstance(req, str) or not 0 < len(req) <= 256 or not req.isprintable():
            raise ValueError(f"req={req!r}: must be a non-empty printable string of at most 256 characters")
        check_engine(engine)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError(f"first={first!r}: must be a non-negative integer (the first token received)")
        pages = check_pages(self.cache, page_ids, tokens)
        handle = TransferHandle(req, "dst", int(tokens))
        key = (engine, req)
        handle._abort = lambda reason: self._post("call", lambda: self._fail(key, "local", "abort", reason, tell=True))
        self._here(lambda: self._add(handle, pages, engine, first))  # on this thread: it is awake, the loop may not be
        return handle

    def connected(self, engine: str = "") -> bool:
        """Whether every source rank of prefill engine ``engine`` that sends to this rank is connected and
        has offered what it sends (a request of it then needs nothing but its ``ready``)."""

        def check():
            eng = self.engines.get(engine)
            return eng is not None and all(
                p.src_rank in eng.writers and eng.writers[p.src_rank].offered for p in eng.pieces(self.rank)
            )

        return bool(self._call(check))

    def release(self, req: str, engine: str = "", reason: str = "released") -> None:
        """Tell the source ranks of ``engine`` that send to this rank that it will not read request ``req``
        (a request it never expected: cached here, or dropped), so they free what they hold for it."""

        def tell():
            self._early.pop((engine, req), None)
            eng = self.engines.get(engine)
            for p in eng.pieces(self.rank) if eng is not None else ():
                w = eng.writers.get(p.src_rank)
                if w is not None:
                    self._tell(w, Abort(req, reason))

        self._post("call", tell)

    def slots_free(self) -> int:
        return self.stats().slots_free

    def tracks(self, req: str, engine: str = "") -> bool:
        """Whether this rank still holds request ``req`` of ``engine``: a failed request is held until no
        read of it can still land in its pages (they must not be reused before then)."""
        return bool(self._call(lambda: (engine, req) in self.requests))

    def _stats(self) -> EndpointStats:
        return dataclasses.replace(
            super()._stats(),
            unknown_announced=len(self._early),
            engines=len(self.engines),
            announced=sum(inc.announced is not None for inc in self.requests.values()),
            late_holds=len(self._leftovers),
        )

    # -- requests (caller's thread or loop, state lock held) --------------------
    def _add(self, handle: TransferHandle, pages: np.ndarray, engine: str, first: int) -> None:
        key = (engine, handle.req)
        if key in self.requests:
            raise ValueError(
                f"request {handle.req!r} of engine {engine!r} is already in flight on destination rank {self.rank}"
            )
        if self._take_abort(key, handle):  # a writer aborted it already: the others hear of it now
            self._early.pop(key, None)
            return
        inc = Incoming(handle, pages, engine, first, kernel_pages=upload_pages(self.cache, pages, checked=True))
        self.requests[key] = inc
        gone = self._gone.get(engine)
        if gone is not None and engine not in self.engines:
            self._early.pop(key, None)
            return self._fail(key, f"prefill engine {engine!r}", "waiting for writers", gone, tell=False)
        eng = self.engines.get(engine)
        lost = [p.src_rank for p in eng.pieces(self.rank) if p.src_rank in eng.lost] if eng is not None else []
        if lost:  # a rank it needs left (a dead prefill's ranks leave one by one): it fails now, not at a timeout
            assert eng is not None  # lost is empty without an engine
            self._early.pop(key, None)  # the ranks still here hear the abort
            return self._fail(
                key, f"source rank {lost[0]} of engine {engine}", "waiting for writers", eng.lost[lost[0]], tell=True
            )
        for rank, news in self._early.pop(key, {}).items():
            w = self.engines[engine].writers.get(rank) if engine in self.engines else None
            for msg in news:
                if w is not None and not inc.handle.done():
                    self._on_request_message(w, inc, msg)
        self._refresh(inc)

    def _group(self, inc: Incoming, layers: range | None, span: range | None = None) -> Group:
        """The part of ``inc`` a message names (made at its first ``ready``): every layer and token, or a
        streamed part (a layer group, a token span, or both), which may not overlap another part of it."""
        key = part_key(layers, span)
        g = inc.groups.get(key)
        if g is not None:
            return g
        eng = self.engines[inc.engine]
        total, tokens = eng.plan.geometry.layers, inc.first + inc.handle.tokens
        if layers is not None and layers.stop > total:
            raise ProtocolError(f"layers {layers.start}..{layers.stop} of {inc.handle.req!r}: the model has {total}")
        if span is not None and (span.stop > tokens or span.start % eng.plan.src.page.page_size):
            raise ProtocolError(
                f"tokens {span.start}..{span.stop} of {inc.handle.req!r}: must lie within its {tokens} tokens and "
                f"start on a page of the source (page size {eng.plan.src.page.page_size})"
            )
        g = Group(layers, (), span)
        clash = next((o for o in inc.groups.values() if overlaps(o.layers, layers) and overlaps(o.span, span)), None)
        if clash is not None:
            raise ProtocolError(
                f"{inc.handle.req!r}:{g.name or ' all of it'} overlaps the part{clash.name or ' of all of it'} "
                "another source rank (or this one) said ready for"
            )
        g.pieces = tuple(x for x in (group_piece(eng.plan, p, layers) for p in eng.pieces(self.rank)) if x is not None)
        if span is None:
            g.first, g.count = inc.first, inc.handle.tokens
        else:  # the span's tokens this rank receives: those from ``first`` on
            lo, hi = max(span.start, inc.first), min(span.stop, tokens)
            g.first, g.count, g.dst_start = lo - span.start, max(0, hi - lo), lo - inc.first
        inc.groups[key] = g
        return g

    def _on_request_message(self, w: Writer, inc: Incoming, msg: ReadyMessage | Chunk) -> None:
        """A writer's ``ready`` or ``chunk`` for an expected request, checked; a refused one fails the request."""
        p = self.engines[w.engine].plan
        try:
            if isinstance(msg, ReadyMessage):
                g = self._group(inc, msg.group, msg.tokens_span)
                if w.rank in g.readies:
                    raise ProtocolError(f"ready for {msg.req!r}{g.name} said twice")
                piece = next((x for x in g.pieces if x.src_rank == w.rank), None)
                if piece is None:
                    raise ProtocolError(
                        f"ready for {msg.req!r}{g.name}: {w.name} holds none of these layers for this rank"
                    )
                if inc.first + inc.handle.tokens != msg.tokens:
                    raise ProtocolError(
                        f"the source sends {msg.tokens} tokens of {msg.req!r}; this rank expects "
                        f"tokens {inc.first}..{inc.first + inc.handle.tokens}"
                    )
                g.readies[w.rank] = check_ready(
                    msg, w, self.paths, p.piece_token_bytes(piece), p.direct, None if g.span is None else len(g.span)
                )
                log.debug("dst %d: %s%s ready from %s (%s)", self.rank, msg.req, g.name, w.name, msg.path)
            else:
                cg = inc.groups.get(part_key(msg.group, msg.tokens_span))
                ready = cg.readies.get(w.rank) if cg is not None else None
                if cg is None or ready is None or ready.path is not Path.READ:
                    raise ProtocolError(
                        f"chunk {msg.index} of {msg.req!r} from a source that did not say ready for the read path"
                    )
                piece = next(x for x in cg.pieces if x.src_rank == w.rank)
                add_chunk(ready, w, msg.req, [msg.index, msg.offset, _b64(msg.ticket)], p.piece_token_bytes(piece))
        except ProtocolError as e:
            return self._fail(inc.key, w.name, "ready", str(e), tell=True)
        inc.touched = time.monotonic()

    def _refresh(self, inc: Incoming) -> None:
        """Start each group's moves once every writer it needs is connected and said ``ready`` for it."""
        eng = self.engines.get(inc.engine)
        if inc.handle.done() or eng is None:
            return
        for g in list(inc.groups.values()):
            if not g.started and all(p.src_rank in g.readies for p in g.pieces):
                self._start_group(inc, g, eng)
                if inc.handle.done():
                    return
        self._finish(inc)

    def _start_group(self, inc: Incoming, g: Group, eng: SourceEngine) -> None:
        g.started = True
        if inc.announced is None:
            inc.announced = time.monotonic()
        inc.handle._move(State.TRANSFERRING)
        paths: dict = {}
        for p in g.pieces:
            w, ready = eng.writers.get(p.src_rank), g.readies[p.src_rank]
            if w is None:
                return self._fail(
                    inc.key, rank_name(inc.engine, "source", p.src_rank), "read", "not connected", tell=True
                )
            path = ready.path
            if g.count == 0 and path is not Path.READ:
                continue  # a span wholly before ``first`` (cached here): nothing of it to read
            if path is Path.DIRECT and (g.first % self.spec.page.page_size or g.dst_start % self.spec.page.page_size):
                path = Path.PAGES  # the tokens received start inside a page: read the head slices instead
            paths.setdefault(Path.READ if path is Path.PAGES else path, []).append((w, p, ready))
        try:
            if Path.IPC in paths:
                g.moves.append(IpcMove(inc, paths[Path.IPC], g))
            if Path.DIRECT in paths:
                g.moves.append(DirectMove(inc, paths[Path.DIRECT], g))
            if Path.READ in paths:
                move = ArenaMove(inc, paths[Path.READ], self._own_chunk_tokens(eng, paths[Path.READ]), g)
                need = move.slot_bytes(move.per)
                if need > self.arena.slot_bytes:
                    raise ProtocolError(
                        f"a chunk of {move.per} tokens needs {need} bytes of a slot here, which holds "
                        f"{self.arena.slot_bytes}; raise KVSTAGE_ARENA_MB on this rank"
                    )
                g.moves.append(move)
                self._order.append((inc.key, part_key(g.layers, g.span)))
            inc.handle.path = ",".join(sorted({m.path.value for m in inc.moves})) or inc.handle.path
            for m in g.moves:
                m.start(self)
        except KVStageError as e:
            return self._fail(inc.key, "local", "read", str(e), tell=True)
        except Exception as e:  # a bug must fail its request by name, not leave it waiting
            log.exception("dst %d: starting the reads of %s", self.rank, inc.handle.req)
            return self._fail(inc.key, "local", "read", f"{type(e).__name__}: {e}", tell=True)
        inc.stage = "read"
        log.debug("dst %d: %s%s reading (%s)", self.rank, inc.handle.req, g.name, inc.handle.path)
        self._start_chunks()
        for m in g.moves:  # a move may be done already (a small ipc read): it times itself first
            if not inc.handle.done():
                m.progress(self)

    def _own_chunk_tokens(self, eng: SourceEngine, writers: list) -> int:
        """Tokens of a chunk this rank cuts itself (every writer on the pages path): what fits a slot,
        on whole pages of both sides where that many fit."""
        per_token = sum(eng.plan.piece_token_bytes(p) for _, p, _ in writers)
        fit = max(1, self.arena.slot_bytes // per_token)
        import math

        step = math.lcm(eng.plan.src.page.page_size, self.spec.page.page_size)
        return fit // step * step if fit >= step else fit

    def _ipc_copier(self, engine: str):
        eng = self.engines[engine]
        if eng.ipc_copier is None:
            from kvstage.staging.cuda_ipc import IpcReadCopier

            eng.ipc_copier = IpcReadCopier(self.cache, eng.plan.src)
        return eng.ipc_copier

    def _start_chunks(self) -> None:
        """Hand free slots to the arena moves' readable chunks in ``slots.slot_order``."""
        waiting, moves = [], {}
        for key in list(self._order):  # (request key, group key)
            inc = self.requests.get(key[0])
            g = inc.groups.get(key[1]) if inc is not None else None
            move = next((m for m in g.moves if isinstance(m, ArenaMove)), None) if g is not None else None
            if inc is None or move is None or inc.handle.done() or move.done():  # no inc: no move
                self._order.remove(key)
                continue
            move.skip_unwanted(self)
            ready = move.readable(self.arena.allocator.free)
            if ready:
                waiting.append(slots.Waiting(key, len(ready), inc.engine))
                moves[key] = (move, ready)
        a = self.arena.allocator
        if not waiting or not a.free:
            return
        held = self._slots_held() if len(self.engines) > 1 or len({w.peer for w in waiting}) > 1 else None
        for key in slots.slot_order(waiting, a.free, a.count, held, len(self.engines)):
            move, ready = moves[key]
            slot = a.acquire()
            if slot is None:
                return
            chunk = ready.pop(0)
            try:
                move.begin(self, chunk, slot)
            except KVStageError as e:  # the chunk holds its slot: the failure's ``stop`` returns it
                self._fail(key[0], "local", "read", str(e), tell=True)

    def _slots_held(self) -> dict[str, int]:
        """Arena slots each source engine's requests hold now (``slots.slot_order`` shares them by it)."""
        held: dict[str, int] = {}
        for inc in self.requests.values():
            n = sum(m.slots() for m in inc.moves if isinstance(m, ArenaMove))
            if n:
                held[inc.engine] = held.get(inc.engine, 0) + n
        return held

    def _finish(self, inc: Incoming) -> None:
        """A group is done once its moves are (its writers hear ``done``); the request once every layer is
        in this rank's pages."""
        eng = self.engines.get(inc.engine)
        if inc.handle.done() or eng is None or not inc.groups:
            return
        for g in inc.groups.values():
            if g.done or not g.started or not all(m.done() for m in g.moves):
                continue
            g.done = True
            if g.layers is not None or g.span is not None:
                log.debug("dst %d: %s%s in", self.rank, inc.handle.req, g.name)
                for p in g.pieces:
                    w = eng.writers.get(p.src_rank)
                    if w is not None:
                        self._tell(w, Done(inc.handle.req, *g.wire))
        total = eng.plan.geometry.layers
        if inc.area_done(total) < total * inc.handle.tokens:
            return
        inc.handle.bytes = eng.plan.dst_token_bytes() * inc.handle.tokens
        inc.handle._move(State.DONE)
        self.metrics.request_finished(
            peer_label(inc.engine), True, time.monotonic() - (inc.announced or inc.touched), inc.handle.bytes
        )
        del self.requests[inc.key]
        if None in inc.groups:  # unstreamed: its writers hear ``done`` now (a streamed one's heard it per group)
            for p in eng.pieces(self.rank):
                w = eng.writers.get(p.src_rank)
                if w is not None:
                    self._tell(w, Done(inc.handle.req))

    def _busy(self) -> bool:
        """Poll often while a read, a first read, a probe's lease or a host scatter runs (a host scatter's end is
        polled: the loop must not block on it while chunks become readable)."""
        return (
            bool(self._leftovers)
            or bool(self._probes)
            or any(w.warm is not None for w in self._writers.values())
            or any(m.busy() or isinstance(m.fence(), HostFence) for inc in self.requests.values() for m in inc.moves)
        )

    def _copying(self):
        for inc in self.requests.values():
            for m in inc.moves:
                f = m.fence()
                if f is not None and not isinstance(f, HostFence):
                    return f
        return None

    def _progress(self) -> None:
        self._poll_warm()
        if self._probes:  # a prober writes into its lent slot: its connection and writes need this side's UCX to answer
            self.transport.notifications()
        for inc in list(self.requests.values()):
            for m in inc.moves:
                if not inc.handle.done():
                    m.progress(self)
            self._finish(inc)
        self._start_chunks()
        self._poll_leftovers()

    def _poll_leftovers(self) -> None:
        still = []
        for left in self._leftovers:
            try:
                over = self.transport.poll(left.handle) is not WriteState.PENDING
            except KVStageError:
                over = True
            if over:
                self.transport.release(left.handle)
            else:
                still.append(left)
        ended = {x.slot for x in self._leftovers} - {x.slot for x in still}
        for slot in ended:
            if slot is not None:
                self.arena.allocator.release(slot)
        self._leftovers = still
        for inc in list(self.requests.values()):
            if inc.handle.done():
                self._forget_if_clear(inc)

    def _tell(self, w: Writer, msg: Message) -> None:
        if not w.offered and not isinstance(msg, (Opened, Error)):  # mid-handshake: it hears it after opened
            w.held.append(msg)
            return
        try:
            w.conn.send(msg.to_wire())
        except OSError as e:
            log.debug("dst %d: send to %s failed: %s", self.rank, w.name, e)

    # -- messages --------------------------------------------------------------
    def _on_message(self, conn: Connection, msg: Message) -> None:
        writer = self._writers.get(conn)
        if writer is None and msg.TYPE in PRE_AUTH_TYPES:
            try:
                if isinstance(msg, Hello):
                    self._on_hello(conn, msg)
                else:
                    assert isinstance(msg, Probe)  # PRE_AUTH_TYPES: hello and probe
                    self._on_probe(conn, msg)
            except KVStageError as e:
                try:  # the peer hears why (one message), then the connection closes
                    conn.send(Error(str(e), msg.TYPE).to_wire())
                except OSError:
                    pass
                self._refuse(conn, f"{msg.TYPE}: {e}")
            return
        if msg.TYPE in PRE_AUTH_TYPES:
            raise ProtocolError(f"{msg.TYPE} on a connection that is already authenticated")
        if writer is None:  # a prober: it writes into its lent slot and sends nothing more
            raise ProtocolError(f"{msg.TYPE!r} on a probe's connection")
        if isinstance(msg, Offer):
            return self._on_offer(writer, msg)
        if not writer.offered:
            raise ProtocolError(f"{msg.TYPE} before the source's offer")
        if isinstance(msg, (ReadyMessage, Chunk)):
            key = (writer.engine, msg.req)
            inc = self.requests.get(key)
            if inc is None:
                return self._hold_early(writer, key, msg)
            if inc.handle.done():
                return
            self._on_request_message(writer, inc, msg)
            self._refresh(inc)
            self._start_chunks()
        elif isinstance(msg, Abort):
            key = (writer.engine, msg.req)
            cause = "source aborted: " + msg.reason
            if key in self.requests:
                self._fail(key, writer.name, "abort", cause, tell=True, skip=writer.rank)
            else:
                self._early.pop(key, None)
                self._remember_abort(key, writer.name, cause)
        elif isinstance(msg, Error):  # the source refused a message of ours: that request cannot complete
            log.warning("dst %d: %s refused our %s: %s", self.rank, writer.name, msg.about, msg.reason)
            if msg.req is not None:
                self._fail((writer.engine, msg.req), writer.name, str(msg.about), f"refused: {msg.reason}", tell=True)
        else:
            raise ProtocolError(f"{msg.TYPE} message from a source")

    def _hold_early(self, w: Writer, key: tuple, msg: ReadyMessage | Chunk) -> None:
        """A ``ready`` (or ``chunk``) for a request not expected yet: kept for ``expect``, at most
        ``MAX_EARLY`` requests (the oldest go)."""
        news = self._early.get(key)
        if news is None:
            if not isinstance(msg, ReadyMessage):
                return  # the chunk of a request not expected here, nor announced: nothing to keep it for
            remember(self._early, key, {}, MAX_EARLY)
            news = self._early[key]
        news.setdefault(w.rank, []).append(msg)
        if len(news[w.rank]) > 1 + 2 * (msg.chunks if isinstance(msg, ReadyMessage) and msg.chunks else 1) + 4096:
            raise ProtocolError(f"too many messages for {msg.req!r}, which is not expected here")

    def _on_hello(self, conn: Connection, msg: Hello) -> None:
        src, rank = check_hello(msg, self.secret, self.transport.name)  # nothing of this side is told before it
        check_same_model(msg.model, self.model, "source")
        from kvstage.tp import plan

        p = plan(src, self.spec)
        engine = msg.engine
        eng = self.engines.get(engine)
        if eng is not None and p.src != eng.plan.src:
            if eng.writers or any(inc.engine == engine for inc in self.requests.values()):
                raise IncompatibleGeometry(
                    f"source spec {src} differs from the spec {eng.plan.src} engine {engine!r}'s "
                    "other ranks connected with; one engine's ranks share one spec"
                )
            log.info("dst %d: prefill engine %r comes back with spec %s (was %s)", self.rank, engine, src, eng.plan.src)
            eng = None
        piece = next((x for x in p.writers_of(self.rank) if x.src_rank == rank), None)
        welcome = Welcome(
            PROTOCOL_VERSION,
            self.engine,
            self.model,
            spec_to_wire(self.spec),
            self.rank,
            self.transport.name,
            None,
            None,
            None,
            None,
            piece is not None,
        )
        if piece is None:  # nothing to read from it here; the source closes this connection
            self._admit(conn)
            conn.send(welcome.to_wire())
            return
        if eng is None:
            eng = self.engines[engine] = SourceEngine(engine, p)
            self._gone.pop(engine, None)
            log.info("dst %d: prefill engine %r connects: %s -> %s", self.rank, engine, p.src, p.dst)
        old = eng.writers.get(rank)
        if old is not None:  # the same identity again: the new connection replaces the old one
            self._replace_peer(old.conn, old.name, conn.peer)
            eng = self.engines.setdefault(engine, eng)  # kept anew if the old connection was its last
        name = rank_name(engine, "source", rank)
        conn.peer = f"{name} ({conn.peer})"
        paths = self.paths & frozenset(Path(x) for x in msg.paths if x in {p.value for p in Path})
        writer = eng.writers[rank] = Writer(engine, rank, conn, self.transport.connect(msg.metadata), piece, src, paths)
        eng.lost.pop(rank, None)  # back: its later requests are read again
        try:
            same_host = link_context(self.facts, msg.facts).same_host
        except Exception:  # a peer's malformed facts: not known to be on this host
            same_host = None
        writer.local = same_host is True and msg.uid == os.getuid()
        self._writers[conn] = writer
        self._admit(conn)
        self._log_link(
            msg.facts, conn.peer, msg.kv_facts, pages=bool(paths - {Path.READ}), label=peer_label(engine, rank)
        )
        if p.direct and Path.DIRECT in paths:
            self.kv_regions()  # registered before any direct read lands in these pages
        # a source needs this rank's metadata only to offer its bytes over a two-sided transport: one-sided, it
        # is not given it, so it holds no key to this rank's memory
        conn.send(
            dataclasses.replace(
                welcome,
                metadata=self.transport.metadata() if self.transport.reads_offered else None,
                slot_bytes=self.arena.slot_bytes,
                facts=self.facts,
                paths=sorted(x.value for x in paths),
                proof=proof(self.secret, msg.nonce) if self.secret else None,
            ).to_wire()
        )
        log.debug(
            "dst %d: %s connected, heads %d..%d, buffers %d..%d",
            self.rank,
            conn.peer,
            piece.heads.start,
            piece.heads.stop,
            piece.buffers.start,
            piece.buffers.stop,
        )

    def _on_offer(self, w: Writer, msg: Offer) -> None:
        """What the source made readable: its arena, its KV buffers, and on this host its pages and event
        (opened here for the ipc path, or said why not)."""
        if w.offered:
            raise ProtocolError("offer sent twice")
        try:
            w.arena = Region.from_wire(msg.arena)
            w.kv = [Region.from_wire(r) for r in msg.kv]
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"offer: a region is malformed: {e}") from None
        if w.kv and len(w.kv) != w.spec.geometry.buffers:
            raise ProtocolError(
                f"offer: {len(w.kv)} KV regions; the source's spec has {w.spec.geometry.buffers} buffers"
            )
        if not w.kv:
            w.paths -= {Path.DIRECT, Path.PAGES}
        why = self._open_pages(w, msg.ipc) if msg.ipc is not None else "not offered"
        if w.ipc is None:
            w.paths -= {Path.IPC}
        w.why_not_ipc = why or ""
        w.warm = self._warm_read(w, msg.warm)
        if w.warm is None:
            self._offered(w)

    def _warm_read(self, w: Writer, ticket: bytes | None = None):
        """A first read of a few bytes of the source's arena, before any request: it makes the transport's
        connection to the source (whose wire-up needs the source's process, which waits for ``opened`` and
        drives its transport meanwhile), so no later read needs that process. A two-sided transport reads
        the source's warm offer (``ticket``). None where nothing is needed."""
        if w.arena is None or (self.transport.reads_offered and not ticket):
            return None
        from kvstage.transports.base import Spans

        if self._scratch is None:
            import torch

            buf = torch.zeros(4096, dtype=torch.uint8, device=self.arena.buffer.device)
            self._scratch = (buf, self.transport.register(buf))
        local = Spans.single(self._scratch[1], [0], [16])
        remote = Spans.single(w.arena, [0], [16])
        return self.transport.read(w.agent, local, remote, ticket or b""), time.monotonic() + HANDSHAKE_TIMEOUT_S

    def _poll_warm(self) -> None:
        for w in list(self._writers.values()):
            if w.warm is None:
                continue
            handle, deadline = w.warm
            try:
                over = self.transport.poll(handle) is not WriteState.PENDING
            except KVStageError as e:
                self.transport.release(handle)
                w.warm = None
                self._refuse_writer(w, f"the first read of its arena failed: {e}")
                continue
            if over:
                self.transport.release(handle)
                w.warm = None
                self._offered(w)
            elif time.monotonic() > deadline:
                w.warm = None
                self._refuse_writer(w, f"the first read of its arena did not complete within {HANDSHAKE_TIMEOUT_S:g} s")

    def _refuse_writer(self, w: Writer, why: str) -> None:
        log.warning("dst %d: %s refused: %s", self.rank, w.name, why)
        self._tell(w, Error(why, "offer"))
        w.conn.close()

    def _offered(self, w: Writer) -> None:
        """The source's offer is in and its connection made: it may now be read, and hears ``opened``."""
        w.offered = True
        self._tell(w, Opened(w.ipc is not None, w.why_not_ipc))
        while w.held:
            self._tell(w, w.held.popleft())
        self._pinged_peer(w.conn)  # from now on: a ping inside the handshake would come where the source
        # waits for its welcome or its opened
        for inc in list(self.requests.values()):  # requests expected before every writer was connected
            if inc.engine == w.engine:
                self._refresh(inc)
        self._start_chunks()

    def _open_pages(self, w: Writer, ipc: dict) -> str | None:
        """Open a source's shared pages and ready event for this rank's kernel; None, or why not."""
        if Path.IPC not in w.paths:
            return "the ipc path is not allowed here (path setting, no token, or no CUDA cache)"
        from kvstage.staging import ipc_read
        from kvstage.staging.shared_buffers import OpenedEvent, open_buffers

        why = ipc_read.refusal(w.spec, self.spec)
        if why:
            return why
        if not w.local:
            return "the source runs on another host, or as another user"
        try:
            opened = open_buffers(ipc.get("buffers"), self.cache.device)
        except KVStageError as e:
            return str(e)
        try:
            event = ipc.get("event")
            if not isinstance(event, str):
                raise ProtocolError("offer: the ipc event handle must be base64 text")
            import base64

            w.event = OpenedEvent(base64.b64decode(event, validate=True), self.cache.device)
            w.ipc = self._ipc_copier(w.engine).source(opened.spans)
            w.opened = opened
        except (KVStageError, ValueError) as e:  # a malformed handle, or spans the kernel cannot read
            opened.close()
            w.event = None
            return str(e)
        return None

    def _on_probe(self, conn: Connection, msg: Probe) -> None:
        """``kvstage probe --peer``: lend one free arena slot for a measured write.

        The prober writes into that slot only, the same memory KV chunks are read
        into. A lease needs this rank's secret (the auth token, or the secret in
        its address; a destination without either lends nothing), one per
        connection, at most ``PROBE_SHARE`` of the slots at once; the slot
        returns when the prober disconnects or after ``PROBE_LEASE_S``, when its
        connection is closed."""
        if conn in self._probes:
            raise ProtocolError("one probe per connection")
        check_version(msg.version, "prober")
        check_token(msg.token, self.secret)
        check_transport(msg.transport, self.transport.name, "prober")
        if not self.secret:
            raise ProtocolError(
                "probe: this destination has no auth token and lends slots only to peers presenting "
                "one; set KVSTAGE_AUTH_TOKEN on both sides"
            )
        if not self.transport.one_sided:
            raise ProtocolError(
                f"probe: this destination moves bytes with transport={self.transport.name}; `kvstage probe --peer` "
                "measures NIXL writes only; the ucx transport logs the UCX it runs at connect (docs/transports.md)"
            )
        nbytes = min(msg.nbytes, self.arena.slot_bytes)
        most = max(1, int(self.arena.allocator.count * PROBE_SHARE))
        if len(self._probes) >= most:
            raise ProtocolError(
                f"busy: {len(self._probes)} probes hold the {most} slots probes may use; probe again later"
            )
        slot = self.arena.allocator.acquire()
        if slot is None:
            raise ProtocolError(f"busy: all {self.arena.allocator.count} arena slots are in use; probe again later")
        self._probes[conn] = (slot, msg.agent, time.monotonic() + PROBE_LEASE_S)
        self._admit(conn)
        base = self.arena_region
        region = Region(base.addr + self.arena.offset(slot), nbytes, base.device, base.device_id)
        conn.send(
            {
                "type": "probe_ok",
                "facts": self.facts,
                "metadata": md_to_wire(self.transport.metadata()),
                "region": region.to_wire(),
                "rank": self.rank,
                "lease_s": PROBE_LEASE_S,
            }
        )
        log.info(
            "dst %d: lent slot %d (%d bytes) to a probe from %s for %g s",
            self.rank,
            slot,
            nbytes,
            conn.peer,
            PROBE_LEASE_S,
        )

    def _end_leases(self, now: float) -> None:
        for conn, (slot, _, until) in list(self._probes.items()):
            if now > until:
                log.info(
                    "dst %d: the probe lease of %s ended after %g s: slot %d returns",
                    self.rank,
                    conn.peer,
                    PROBE_LEASE_S,
                    slot,
                )
                conn.close()
                self._drop(conn, "probe lease ended")

    # -- failures --------------------------------------------------------------
    def _fail(self, key: tuple, peer: str, stage: str, cause: str, tell: bool, skip: int | None = None) -> None:
        inc = self.requests.get(key)
        if inc is None or inc.handle.done():
            return
        req = inc.handle.req
        for m in inc.moves:  # this rank's own kernels end first; reads that cannot be cancelled are kept
            inc.leftover += m.stop(self)
        self._leftovers += inc.leftover
        inc.handle._fail(peer, stage, cause)
        self.metrics.failure(peer_label(inc.engine), stage, cause)
        self.metrics.request_finished(peer_label(inc.engine), False, 0.0, inc.handle.bytes)
        log.warning("dst %d: request %s failed at %s with %s: %s", self.rank, req, stage, peer, cause)
        eng = self.engines.get(inc.engine)
        if tell and eng is not None:
            for p in eng.pieces(self.rank):
                w = eng.writers.get(p.src_rank)
                if w is not None and p.src_rank != skip:
                    self._tell(w, Abort(req, cause))
        self._forget_if_clear(inc)

    def _forget_if_clear(self, inc: Incoming) -> None:
        """A failed request is forgotten once none of its reads can still land in its pages."""
        if inc.handle.done() and not any(x in self._leftovers for x in inc.leftover if x.slot is None):
            self.requests.pop(inc.key, None)

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
            eng.lost[writer.rank] = f"{writer.name} left: connection lost ({reason})"
        self.transport.disconnect(writer.agent)
        live = [
            k
            for k, inc in self.requests.items()
            if inc.engine == writer.engine
            and not inc.handle.done()
            and any(p.src_rank == writer.rank for p in eng.pieces(self.rank))
        ]
        (log.warning if live else log.info)(
            "dst %d: %s disconnected (%s), %d requests affected", self.rank, writer.name, reason, len(live)
        )
        for key in live:
            inc = self.requests.get(key)
            if inc is not None:
                self._fail(key, writer.name, inc.stage, f"connection lost ({reason})", tell=True)
        for key in [k for k in self._early if k[0] == writer.engine]:
            self._early[key].pop(writer.rank, None)
        if writer.opened is not None:
            writer.opened.close()
        if not eng.writers:  # an engine gone whole: later requests that name it fail at once
            del self.engines[writer.engine]
            remember(
                self._gone,
                writer.engine,
                f"every rank of prefill engine {writer.engine!r} left: connection "
                f"lost with the last, {writer.name} ({reason})",
                MAX_GONE,
            )
            log.info("dst %d: prefill engine %r has no rank connected any more", self.rank, writer.engine)

    def _peers(self) -> list:
        return list(self._writers)

    def _check_stalls(self, now: float) -> None:
        """A request waiting for its writers' ``ready`` past ``ready_timeout_s`` fails; so does one whose
        reads make no progress for ``stall_timeout_s`` (a read path that is stuck), and every request
        of a writer silent (no ping) for ``peer_timeout_s`` that still owes it a ``ready`` or a chunk."""
        self._end_leases(now)
        for w in list(self._writers.values()):
            quiet = self._silent(w.conn, now)
            if quiet is None:
                continue
            for key, inc in list(self.requests.items()):
                if inc.engine == w.engine and not inc.handle.done() and self._owes(inc, w):
                    self._fail(
                        key,
                        w.name,
                        inc.stage,
                        f"no control message for {quiet:.1f} s: the source is stopped or hung, or the link is down",
                        tell=True,
                    )
        for key, inc in list(self.requests.items()):
            if inc.handle.done():
                continue
            waited = now - inc.touched
            if inc.announced is None:
                if waited > self.settings.ready_timeout_s:
                    eng = self.engines.get(inc.engine)
                    missing = sorted({p.src_rank for p in eng.pieces(self.rank)} - inc.ready_ranks()) if eng else []
                    who = "source ranks " + ",".join(map(str, missing)) if missing else "sources"
                    if inc.engine:
                        who += f" of engine {inc.engine}"
                    self._fail(
                        key,
                        who,
                        "waiting for writers",
                        f"not ready within {self.settings.ready_timeout_s:g} s",
                        tell=True,
                    )
                continue
            if waited <= min(SLOW_S, self.settings.stall_timeout_s):
                continue
            eng = self.engines.get(inc.engine)
            owing = [w for w in (eng.writers.values() if eng else ()) if self._owes(inc, w)]
            reading = any(m.busy() for m in inc.moves)

            def runs(
                since: float, owing=owing
            ) -> bool:  # every writer it waits for runs: what it owes is stuck, not late
                return all(self._peer_running(w.conn, now, since) for w in owing)

            if not inc.slow:
                inc.slow = True
                self.metrics.slow(peer_label(inc.engine), "read")
                who = ", ".join(w.name for w in owing) or "its reads"
                log.warning(
                    "dst %d: request %s is slow: no progress for %.1f s at stage %s; waiting for %s (%s)",
                    self.rank,
                    inc.handle.req,
                    waited,
                    inc.stage,
                    who,
                    "this rank's transport"
                    if not owing
                    else "running"
                    if runs(inc.touched + SLOW_S)
                    else "alive, busy: its loop does not turn",
                )
            if waited > self.settings.stall_timeout_s and (
                reading or (owing and runs(inc.touched + self.settings.stall_timeout_s))
            ):
                who = owing[0].name if owing else "local"
                self._fail(
                    key,
                    who,
                    inc.stage,
                    f"no progress for {self.settings.stall_timeout_s:g} s"
                    + (", while the source runs" if owing else ": a read did not complete"),
                    tell=True,
                )

    def _owes(self, inc: Incoming, w: Writer) -> bool:
        """Whether ``inc`` still waits for something only ``w``'s process sends: a ``ready`` (of a part it holds
        layers of, or of the layers and tokens no part covers yet), or a chunk."""
        eng = self.engines.get(inc.engine)
        if eng is None or not any(p.src_rank == w.rank for p in eng.pieces(self.rank)):
            return False
        layers = eng.plan.geometry.layers
        if sum(g.area(layers) for g in inc.groups.values()) < layers * inc.handle.tokens:
            return True
        for g in inc.groups.values():
            ready = g.readies.get(w.rank)
            if ready is None and any(p.src_rank == w.rank for p in g.pieces):
                return True
            if ready is not None and ready.path is Path.READ and len(ready.gathered) < ready.chunks:
                return True
        return False

    def _forgive(self, gap: float) -> None:
        for inc in self.requests.values():
            inc.touched += gap
            if inc.announced is not None:
                inc.announced += gap
        for conn, (slot, agent, until) in self._probes.items():
            self._probes[conn] = (slot, agent, until + gap)

    def _shutdown(self) -> None:
        self._listener.close()
        for conn in list(self._writers):
            conn.close()
        for key in list(self.requests):
            self._fail(key, "local", "shutdown", "destination closed", tell=False)
        for w in self._writers.values():
            if w.opened is not None:
                w.opened.close()
        if self._host_copies is not None:
            self._host_copies.shutdown(wait=True)
        if self._scatter_threads is not None:
            self._scatter_threads.close()
        super()._shutdown()
