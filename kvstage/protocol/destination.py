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

This module holds the ``Destination`` (its state, public calls, message
dispatch, failures and the loop's hooks); its parts live beside it:
``dst_handshake`` (a source's hello and offer), ``dst_requests`` (an expected
request's state), ``dst_grants`` (arena slots for chunks) and ``dst_listener``
(the accept thread and probe leases).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstage.config import Settings
from kvstage.errors import KVStageError, ProtocolError
from kvstage.ids import EngineId, ReqId, ReqKey
from kvstage.protocol import dst_grants, dst_handshake, dst_listener, dst_requests
from kvstage.protocol.address import Address, new_secret
from kvstage.protocol.checksums import Warned
from kvstage.protocol.common import check_engine, check_pages, peer_label, remember
from kvstage.protocol.endpoint import SLOW_S, Endpoint, EndpointStats
from kvstage.protocol.gate import PRE_AUTH_TYPES
from kvstage.protocol.incoming import Incoming, SourceEngine, Writer
from kvstage.protocol.messages import (
    Abort,
    Chunk,
    Error,
    Hello,
    Message,
    Offer,
    Opened,
    Probe,
    Sums,
)
from kvstage.protocol.messages import Ready as ReadyMessage
from kvstage.protocol.reads import Leftover
from kvstage.protocol.request import TransferHandle
from kvstage.protocol.route import Path, allowed_paths
from kvstage.protocol.wire import Connection
from kvstage.staging.copy import CopyThreads
from kvstage.staging.fence import CopyFence, HostFence
from kvstage.transports.base import Region, WriteState

log = logging.getLogger("kvstage")

#: prefill engines remembered as gone (their last rank left): a request that names one later fails at once
MAX_GONE = 1024


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
        self.requests: dict[ReqKey, Incoming] = {}
        self._early: dict[ReqKey, dict] = {}  # (engine, req) -> {source rank: [ready, chunks...]}
        self._gone: dict[str, str] = {}  # prefill engine whose last rank left -> why
        self._order: list[tuple] = []  # (request, layer group) reading through the arena, in arrival order
        self._leftovers: list[Leftover] = []  # reads of failed requests that may still land
        self.warned_checksums = Warned()  # the peers a checksum mismatch was logged for (once each)
        self.unchecked_prefixes = Warned()  # the peers told once that a cached prefix leaves a part unchecked
        self._probes: dict[
            Connection, tuple[int, str, float]
        ] = {}  # probe connection -> (slot, prober agent, lease end)
        # (tensor, region) a warm read lands in (``dst_handshake.warm_read``)
        self._scratch: tuple[Any, Region] | None = None
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
        threading.Thread(
            target=dst_listener.accept, args=(self,), name=f"kvstage-accept{self.rank}", daemon=True
        ).start()
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

    # -- public --------------------------------------------------------------
    def expect(self, req: ReqId, page_ids, tokens: int, engine: EngineId = "", first: int = 0) -> TransferHandle:
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
        self._here(
            lambda: dst_requests.add(self, handle, pages, engine, first)
        )  # on this thread: it is awake, the loop may not be
        return handle

    def connected(self, engine: EngineId = "") -> bool:
        """Whether every source rank of prefill engine ``engine`` that sends to this rank is connected and
        has offered what it sends (a request of it then needs nothing but its ``ready``)."""

        def check():
            eng = self.engines.get(engine)
            return eng is not None and all(
                p.src_rank in eng.writers and eng.writers[p.src_rank].offered for p in eng.pieces(self.rank)
            )

        return bool(self._call(check))

    def release(self, req: ReqId, engine: EngineId = "", reason: str = "released") -> None:
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

    def tracks(self, req: ReqId, engine: EngineId = "") -> bool:
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

    # -- requests (``dst_requests``, ``dst_grants``; caller's thread or loop, state lock held) ----
    def _ipc_copier(self, engine: EngineId):
        eng = self.engines[engine]
        if eng.ipc_copier is None:
            from kvstage.staging.cuda_ipc import IpcReadCopier

            eng.ipc_copier = IpcReadCopier(self.cache, eng.plan.src)
        return eng.ipc_copier

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
        dst_handshake.poll_warm(self)
        if self._probes:  # a prober writes into its lent slot: its connection and writes need this side's UCX to answer
            self.transport.notifications()
        for inc in list(self.requests.values()):
            for m in inc.moves:
                if not inc.handle.done():
                    m.progress(self)
            dst_requests.finish(self, inc)
        dst_grants.start_chunks(self)
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
                    dst_handshake.on_hello(self, conn, msg)
                else:
                    assert isinstance(msg, Probe)  # PRE_AUTH_TYPES: hello and probe
                    dst_listener.on_probe(self, conn, msg)
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
            return dst_handshake.on_offer(self, writer, msg)
        if not writer.offered:
            raise ProtocolError(f"{msg.TYPE} before the source's offer")
        if isinstance(msg, (ReadyMessage, Chunk, Sums)):
            key = (writer.engine, msg.req)
            inc = self.requests.get(key)
            if inc is None:
                return dst_requests.hold_early(self, writer, key, msg)
            if inc.handle.done():
                return
            dst_requests.on_request_message(self, writer, inc, msg)
            dst_requests.refresh(self, inc)
            dst_grants.start_chunks(self)
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

    # -- failures --------------------------------------------------------------
    def _fail(self, key: ReqKey, peer: str, stage: str, cause: str, tell: bool, skip: int | None = None) -> None:
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
        dst_listener.end_leases(self, now)
        for w in list(self._writers.values()):
            quiet = self._silent(w.conn, now)
            if quiet is None:
                continue
            for key, inc in list(self.requests.items()):
                if inc.engine == w.engine and not inc.handle.done() and dst_requests.owes(self, inc, w):
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
            owing = [w for w in (eng.writers.values() if eng else ()) if dst_requests.owes(self, inc, w)]
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
