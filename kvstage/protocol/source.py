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

This module holds the ``Source`` (its state, public calls, message dispatch,
failures and the loop's hooks); its parts live beside it: ``src_connect`` (the
handshake and each connected ``Target``), ``src_requests`` (a sent request's
routes, readies and end) and ``src_chunks`` (the read path's gathers, chunks
and slots).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from kvstage.errors import ProtocolError
from kvstage.ids import EngineId, OutKey, ReqId
from kvstage.protocol import src_chunks, src_connect, src_requests, src_sums
from kvstage.protocol.address import Address
from kvstage.protocol.common import check_engine, check_pages, peer_label, remember
from kvstage.protocol.endpoint import SLOW_S, Endpoint, EndpointStats
from kvstage.protocol.messages import (
    Abort,
    Done,
    Error,
    Message,
    Read,
)
from kvstage.protocol.outgoing import (
    DestinationEngine,
    Outgoing,
    Target,
    part_key,
)
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.route import Path
from kvstage.protocol.src_connect import allowed
from kvstage.protocol.stream import LayerStream, check_layers, check_span
from kvstage.protocol.wire import Connection

log = logging.getLogger("kvstage")

MAX_FINISHED = 4096  # finished request ids remembered, so a late message for one is refused by name
#: a failed request's gathered slots return this long after its ``abort`` went out, unless each destination
#: that may read them answered first: a read already posted may still be copying from them
ABORT_HOLD_S = 1.0
#: how often the loop drives the transport while a request is readable and nothing else is near
#: (``Source._readable``): a read over UCX's tcp waits up to this long for this process's answer, and an engine
#: whose requests wait long for their decode does not give its GIL to a loop turn every few microseconds
DRIVE_S = 0.001


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
        self.requests: dict[OutKey, Outgoing] = {}  # each part of each request this rank sends
        self._waiting: collections.deque = collections.deque()  # (request, chunk) with no free slot yet
        self._gathering: list = []  # (request, chunk) whose gather runs on the device
        self._summing: list = []  # ``src_sums.Summing``: sum passes still running on the device
        self._held: list = []  # (release time, slot) of failed requests' chunks (``ABORT_HOLD_S``)
        self._draining: list = []  # done requests whose offers are not over yet: their slots return when they are
        self._finished: dict[OutKey, str] = {}  # a request's part -> its final state, oldest first
        self._routes: dict = {}  # (engine, rank, path) whose route was logged, the latest ones
        self._ipc = src_connect.share_pages(self)
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
            and bool({Path.DIRECT, Path.PAGES} & allowed(self.settings))
        )

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
            known = self._here(lambda address=address: src_connect.known(self, address))
            if known is None:
                known = src_connect.handshake(self, host, port, at.secret or self.settings.auth_token)
            if known is not None and known >= 0:
                kept.append(known)
        return kept

    def send(
        self,
        req: ReqId,
        page_ids,
        tokens: int,
        engine: EngineId | None = "",
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
        self._here(lambda: src_requests.add(self, handle, pages, engine, caller, group, part, int(tokens)))
        return handle

    def stream(self, req: ReqId, page_ids, tokens: int, engine: EngineId | None = "") -> LayerStream:
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

    def abort(self, req: ReqId, engine: EngineId | None = "", reason: str = "aborted by caller") -> None:
        """Drop request ``req`` (every layer group of it, in flight or done): its destination ranks hear
        ``abort`` and fail it (a streamed request dropped mid-forward)."""

        def drop():
            outs = (
                src_requests.groups_of(self, engine, req)
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

    # -- loop thread -----------------------------------------------------------
    def _busy(self) -> bool:
        return bool(
            self._gathering
            or self._summing
            or self._draining
            or any(c.offers for out in self.requests.values() for c in out.chunks)
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
        running = [c.fence for _, c in self._gathering] + [s.fence for s in self._summing]
        return next((f for f in running if not f.done()), None)

    def _progress(self) -> None:
        src_chunks.poll_gathers(self)
        src_sums.poll(self)
        src_chunks.poll_offers(self)
        if self._readable():
            self.transport.notifications()  # the drive (``_readable``): a source receives no notifications
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            self.arena.allocator.release(self._held.pop(0)[1])
        src_chunks.gather_waiting(self)

    # -- messages --------------------------------------------------------------
    def _on_message(self, conn: Connection, msg: Message) -> None:
        target = self._targets.get(conn)
        if target is None:
            return
        if isinstance(msg, Read):
            # taken only once the read is checked
            out = src_requests.request_of(self, target, msg.req, msg.group, msg.tokens_span, take=False)
            if not 0 <= msg.index < len(out.chunks):
                raise ProtocolError(f"read of chunk {msg.index} of {msg.req!r}, which has {len(out.chunks)} chunks")
            c = out.chunks[msg.index]
            readers = c.readers.get(target.engine, set())
            if target.rank not in readers:
                raise ProtocolError(
                    f"read of chunk {msg.index} of {msg.req!r}, which {target.name} was not offered or read already"
                )
            src_requests.take_request(self, out, target)
            readers.discard(target.rank)
            out.touched = time.monotonic()
            src_chunks.maybe_free(self, out, c)
        elif isinstance(msg, Done):
            out = src_requests.request_of(self, target, msg.req, msg.group, msg.tokens_span)
            out.done.add(target.rank)
            out.touched = time.monotonic()
            log.debug("src %d: %s done at %s", self.rank, msg.req, target.name)
            src_requests.maybe_done(self, out)
        elif isinstance(msg, Abort):  # the whole request: every layer group of it
            outs = src_requests.groups_of(self, target.engine, msg.req)
            cause = "destination aborted: " + msg.reason
            if not any(o.final(self.spec.geometry.layers) for o in outs):
                self._remember_abort((target.engine, msg.req), target.name, cause)  # for the parts not sent yet
            for out in outs:
                if out.bound in (None, target.engine):  # a destination aborts only what it was to read
                    self._fail(out.key, target.name, "abort", cause, tell=True, answered=target)
        elif isinstance(msg, Error):
            log.warning("src %d: %s refused our %s: %s", self.rank, conn.peer, msg.about, msg.reason)
            for out in src_requests.groups_of(self, target.engine, msg.req) if msg.req else ():
                self._fail(out.key, conn.peer, str(msg.about), f"refused: {msg.reason}", tell=False)
        else:
            raise ProtocolError(f"{msg.TYPE} message from a destination")

    def _tell(self, t: Target, msg: Message) -> None:
        try:
            t.conn.send(msg.to_wire())
        except OSError as e:
            log.debug("src %d: send to %s failed: %s", self.rank, t.name, e)

    # -- failures --------------------------------------------------------------
    def _fail(self, key: OutKey, peer: str, stage: str, cause: str, tell: bool, answered: Target | None = None) -> None:
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
        self._summing = [s for s in self._summing if s.out is not out]
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
                src_requests.drop_target(self, out, target)
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
