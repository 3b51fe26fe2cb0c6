"""What source and destination endpoints share: the transport, the staging
arena, the control connections and the single thread that drives them all.

One loop thread per endpoint drives every piece of mutable state and reads
every control connection itself: it waits on the sockets (``select``, without
the GIL) and handles a message the moment it arrives, with no reader thread to
hand it over. Other threads (the listener's, the caller's) post events to its
queue and wake it, with one exception: a sent request's first steps
(``Source.send``) run on the caller's own thread, holding the state lock the
loop holds whenever it handles anything. The caller is awake already, and
handing the request over would wait for the loop's wake-up. The state machines
stay single-threaded (one holder of the lock at a time), and the order of
events is the order they are handled in. While a request is in flight on a GPU
host, the loop polls its sockets for ``POLL_S`` after each event instead of
sleeping until the next message: a thread that slept long wakes late and runs
its next steps slowly.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstage.config import PING_INTERVAL_S, Settings
from kvstage.errors import ConfigError, KVStageError, ProtocolError, TransportError
from kvstage.ids import PeerReqKey
from kvstage.layout import token_bytes
from kvstage.link.connect import connect_line
from kvstage.link.facts import memory_facts, value
from kvstage.link.finding import Finding, Severity
from kvstage.metrics import endpoint_metrics, start_from_settings
from kvstage.protocol import beat, opening
from kvstage.protocol.common import check_engine, check_model_id, remember
from kvstage.protocol.gate import PRE_AUTH_MAX_FRAME, PRE_AUTH_TYPES, RefusalLog, host_of, pending_cap
from kvstage.protocol.messages import MAX_ID, Error, Message, Ping, decode
from kvstage.protocol.waiting import SocketWait, tight_timer
from kvstage.protocol.wire import MAX_FRAME, Connection
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import copy_stream
from kvstage.transports.base import Region, Transport

log = logging.getLogger("kvstage")
#: errors of a connection whose peer's host stopped answering (a cut link, a dead host), not one it closed
_UNANSWERED = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN)

# seconds between transport polls while reads run: a GPU's copy engines move the bytes meanwhile, and 20 us
# keeps a poll near; on a host the loop sleeps between polls, which leaves the GIL to the threads that copy
# (a host read's or scatter's, whose calls need it to return: a spinning loop slowed them ten-fold)
_BUSY_WAIT = {"cuda": 0.00002, "cpu": 0.0002}
#: while a request is in flight, the loop polls its sockets this long after each event (a message other
#: than a ping, a call, a send) instead of sleeping: on the GPU hosts a thread that slept runs its next
#: CUDA call or message read 0.1-0.2 ms late; on a host cache the cores do the copies, so it sleeps
POLL_S = {"cuda": 0.05, "cpu": 0.0}
_IDLE_WAIT = 0.05
#: a loop that did not run for this long, though it wakes every ``_IDLE_WAIT``, was stopped or starved
#: (SIGSTOP, a host too busy): the time it lost is not held against its peers
PAUSE_S = 1.0
MAX_ABORTED = 4096
#: peer links whose judgement ``stats`` keeps: every live peer of an engine, not every connection it ever had
MAX_LINKS = 256
#: a peer whose last ping says its loop turned within this is running: a request it stalls is stuck, not
#: waiting for a busy engine (pings come every ``PING_INTERVAL_S`` from a thread that needs no GIL)
LIVE_LOOP_S = 2.0
#: a request whose next step has waited this long (a chunk not landed after its grant, a write not complete)
#: is reported slow once, in one log line; it fails only as ``stall_timeout_s`` says
SLOW_S = 5.0


@dataclass(frozen=True)
class EndpointStats:
    """A read-only view of an endpoint, taken on its loop (``Endpoint.stats``)."""

    role: str
    rank: int
    slots_total: int
    slots_free: int
    requests: int  # in flight (a failed request is held until no write of it can land)
    peers: int  # connected peer ranks, of every peer engine
    engines: int = 0  # peer engines known (each with its own plan)
    late_holds: int = 0  # destination: reads of failed requests that may still land (their slots or pages held)
    unknown_announced: int = 0  # destination: requests said ready that it was not told of yet
    announced: int = 0  # destination: requests in flight that every writer announced
    aborts_remembered: int = 0  # aborts of requests this side was not told of yet
    polling: bool = False  # the loop polls the transport now (a transfer is near)
    wait: str = "select"  # how the loop waits on its sockets: select(2), or epoll past descriptor 1023
    links: tuple = ()  # the connect-time judgement of each peer's link (``Finding.to_dict``)


class Endpoint:
    """Base of ``Source`` and ``Destination``."""

    role = "endpoint"

    def __init__(
        self,
        cache: RankCache,
        settings: Settings | None = None,
        transport: Transport | None = None,
        engine: str = "",
        model: str = "",
    ):
        self.cache, self.spec, self.rank = cache, cache.spec, cache.rank
        self.engine = check_engine(engine)
        self.model = check_model_id(model)
        self.settings = settings or Settings()
        self.transport, made = opening.open_transport(self, transport)
        try:
            self._check_cache()
            self.facts = opening.local_facts(self)
            self.arena, self.arena_location = opening.make_arena(self)
            self.arena_region: Region = self.transport.register(self.arena.buffer)
            self.facts.update(memory_facts(self.arena.buffer, value(self.facts, "gpus")))
        except BaseException:
            if made:  # a transport the caller passed in stays the caller's to close
                self.transport.close()
            raise
        self._kv_regions: list[Region] | None = None
        self._kv_facts: dict | None = None
        self._links: dict = {}  # (peer, KV pages?) -> its connect-time finding, as logged; the latest MAX_LINKS
        self.metrics = endpoint_metrics(self.role, self.rank, self.engine)
        start_from_settings(self.settings, self.rank)
        self._init_loop()

    # -- construction (the transport, facts and arena: ``opening``) -------------
    def _check_cache(self) -> None:
        """The cache suits the transport; its copier is chosen (and logged) now, not on a request's path."""
        if self.transport.host_only and self.cache.device.type == "cuda":
            raise ConfigError(
                f"transport={self.transport.name!r} moves host memory only; this rank's cache is on "
                f"{self.cache.device}: use nixl or ucx"
            )
        self.copier = self.cache.copier

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of this rank's shard: every layer, K and V."""
        return token_bytes(self.spec.geometry, self.spec.local_heads())

    def _init_loop(self) -> None:
        """The loop's state and thread (started by the subclass, last in its constructor)."""
        #: (engine, req) -> (peer, cause): aborted before this side knew it
        self._aborted: dict[PeerReqKey, tuple[str, str]] = {}
        self._events: queue.Queue = queue.Queue()
        self._pending: dict = {}  # connection not authenticated yet -> (deadline, seconds given); insertion order = age
        self._refusals = RefusalLog(log, f"{self.role} {self.rank}")
        self._turned = time.monotonic()  # the end of the loop's last turn: a long gap is a pause (``PAUSE_S``)
        device = "cuda" if self.cache.device.type == "cuda" else "cpu"
        self._busy_wait, self._poll = _BUSY_WAIT[device], POLL_S[device]
        # the control sockets the loop reads and its wait on them (select(2), or epoll past descriptor 1023)
        self._sockets = SocketWait(f"{self.role} {self.rank}", self._busy_wait)
        self._stirred = 0.0  # the loop's last event: a message other than a ping, a call, a send (loop thread only)
        self.requests: dict = {}  # (peer engine, req) -> the subclass's record of a request in flight
        self._heard: dict = {}  # control connection -> when its peer last sent anything
        self._peer_loop: dict = {}  # control connection -> (when, its loop's age) from the peer's last ping
        self._pinged = 0.0
        self.silence_max_s = 0.0  # the longest a connected peer was quiet, as this loop saw it
        self._clock = beat.LoopClock() if beat.available() else None
        if self._clock is None:
            log.info(
                "%s %d: pings come from this endpoint's loop (%s): while this process's Python is busy they "
                "stop, and its peers may take it for stopped after peer_timeout_s",
                self.role,
                self.rank,
                beat.why_unavailable(),
            )
        self._closing = False
        self._state = threading.Lock()  # held while state changes: by the loop, or by a caller in ``_here``
        self._thread = threading.Thread(target=self._run, name=f"kvstage-{self.role}{self.rank}", daemon=True)

    def _start(self) -> None:
        """Start the loop; subclasses call this last in their constructor."""
        self._thread.start()

    # -- threads ------------------------------------------------------------
    def _post(self, kind: str, *args) -> None:
        self._events.put((kind, args))
        self._wake_loop()

    def _wake_loop(self) -> None:
        try:
            self._sockets.waker.send(b"\0")
        except OSError:  # full (the loop has bytes to read already) or closed (it stopped)
            pass

    def _here(self, fn: Callable):
        """Run ``fn`` on the caller's thread, holding the state lock, and return its
        result (or raise its error); then wake the loop, which waits on what ``fn``
        started (a copy, a write, a grant). Copies go on the stream the loop's own go on."""
        try:
            with self._state:
                self._check_open()
                with copy_stream(self.cache.device):
                    return fn()
        finally:
            self._wake_loop()

    def _check_open(self) -> None:
        """A call on a closed endpoint fails at once, instead of waiting for a loop that is gone."""
        if self._closing or not self._thread.is_alive():
            raise TransportError(f"{self.role} rank {self.rank}: the endpoint is closed")

    def _call(self, fn: Callable, timeout: float = 30.0):
        """Run ``fn`` on the loop thread and return its result (or raise its error)."""
        self._check_open()
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed back to the caller's thread
                box["error"] = e
            done.set()

        self._post("call", run)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.role} {self.rank}: loop did not answer in {timeout} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _watch(self, conn: Connection, authenticate_within: float | None = None) -> None:
        """Have the loop read ``conn``'s messages from now on. With ``authenticate_within``, the
        peer is a stranger until ``_admit``: it is dropped if not admitted within that many seconds,
        its frames are held to ``PRE_AUTH_MAX_FRAME``, and at most ``gate.pending_cap()``
        strangers are held (the oldest goes for a new one)."""
        self._post("watch", conn, authenticate_within)

    def _admit(self, conn: Connection) -> None:
        """``conn``'s peer authenticated: no deadline, the full frame size."""
        self._pending.pop(conn, None)
        conn.max_frame = MAX_FRAME

    def _refuse(self, conn: Connection, cause: str) -> None:
        """Close a stranger's connection: one log line per address and cause (``gate.RefusalLog``)."""
        self._refusals.refuse(host_of(conn.peer), cause, time.monotonic())
        conn.close()
        self._drop(conn, cause)

    def _run(self) -> None:
        tight_timer()
        while True:
            try:
                if not self._turn():
                    break
            except Exception:  # a bug must not kill the loop silently
                log.exception("%s %d: loop error", self.role, self.rank)
        with self._state:
            self._shutdown()

    def _turn(self) -> bool:
        """Wait for something to do, do all of it, move the transfers on. False: stop.
        The state lock is held except while waiting."""
        with self._state:
            for conn in [c for c in self._sockets.watched.values() if c is not None and c.closed]:
                self._drop(
                    conn, "closed by this side"
                )  # a refused hello, a replaced peer: before a new socket takes its number
            fence, busy = self._copying(), self._busy()
            poll_until = self._stirred + self._poll if self._poll and self.requests else 0.0
        readable = self._wait(fence, busy, poll_until)
        with self._state:
            return self._handle(readable)

    def _handle(self, readable: list[Connection]) -> bool:
        self._check_pause(self._turned)
        started = time.monotonic()
        for conn in readable:  # first: what had arrived before a call posted since was made
            self._read(conn)
        while True:
            try:
                kind, args = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "stop":
                return False
            if kind == "call":
                args[0]()
            elif kind == "watch" and not args[0].closed:
                self._watch_now(*args)
        now = time.monotonic()
        for conn, (deadline, within) in list(self._pending.items()):
            if now > deadline:
                self._refuse(conn, f"not authenticated within {within:g} s")
        self._progress()
        if now - self._pinged >= PING_INTERVAL_S:
            self._pinged = now
            if self._clock is None:  # no native pinger: the loop pings itself
                self._ping()
            self._refusals.flush(now)
        if self._check_pause(started):  # stopped while handling: the deadlines below moved on
            now = time.monotonic()
        self._check_stalls(now)
        self.metrics.slots(self.arena.allocator.free, self.arena.allocator.count)
        self.metrics.in_flight(len(self.requests))
        self._turned = time.monotonic()
        if self._clock is not None:
            self._clock.turned(self._turned)
        return True

    def _watch_now(self, conn: Connection, authenticate_within: float | None) -> None:
        if authenticate_within is not None:
            most = pending_cap()
            while len(self._pending) >= most:
                self._refuse(
                    next(iter(self._pending)),
                    f"dropped for a newer one: at most {most} connections are held before they authenticate",
                )
            self._pending[conn] = (time.monotonic() + authenticate_within, authenticate_within)
            conn.max_frame = PRE_AUTH_MAX_FRAME
        self._sockets.watched[conn.sock] = conn
        self._sockets.changed()

    def _check_pause(self, since: float) -> bool:
        """Whether the loop lost more than ``PAUSE_S`` since ``since`` (then handled: ``_resumed``)."""
        gap = time.monotonic() - since
        if gap <= PAUSE_S:
            return False
        self._resumed(gap)
        return True

    def _resumed(self, gap: float) -> None:
        """The loop did not run for ``gap`` seconds: this process was stopped or starved. Every
        deadline is moved on by that much (``_forgive``), so that no peer is blamed for it."""
        log.warning(
            "%s %d: this process did not run for %.1f s (stopped or starved); its deadlines move on by "
            "that much, so its peers are not blamed for the time it lost",
            self.role,
            self.rank,
            gap,
        )
        for conn in self._heard:
            self._heard[conn] += gap
        for conn, (when, age) in self._peer_loop.items():
            self._peer_loop[conn] = (when + gap, age)
        for conn, (deadline, within) in self._pending.items():
            self._pending[conn] = (deadline + gap, within)
        self._forgive(gap)

    def _idle_wait(self) -> float:
        """How long the loop sleeps with no transfer near (a role may need its transport driven meanwhile)."""
        return _IDLE_WAIT

    def _wait(self, fence, busy: bool, poll_until: float = 0.0) -> list[Connection]:
        """The connections with bytes to read, once something is to be done: a message,
        a posted event, a device copy's end (``fence``), or (while a transfer is near,
        ``busy``) the poll interval. Until ``poll_until`` (``POLL_S`` after the
        last event, while a request is in flight) a wait for messages alone polls instead
        of sleeping: a thread that slept is slow to wake and slow for its next steps."""
        if fence is None and not busy and time.perf_counter() < poll_until:
            ready = self._sockets.poll(poll_until)
            if not ready:  # the window passed quietly: back to sleeping
                return []
        elif (
            fence is None
        ):  # the transport is polled every _busy_wait while a transfer is near; a message ends the wait
            ready = self._sockets.ready(self._busy_wait if busy else self._idle_wait())
        else:  # messages first; then the copy's end wakes the loop, with no thread in between
            ready = self._sockets.ready(0)
            if not ready:
                try:
                    fence.wait()
                except Exception:  # a CUDA error: logged; the copy's fence keeps failing the poll too
                    log.exception("%s %d: waiting for a device copy", self.role, self.rank)
                    time.sleep(self._busy_wait)
                ready = self._sockets.ready(0)
        conns = []
        for sock in ready:
            conn = self._sockets.watched.get(sock)
            if conn is not None:
                conns.append(conn)
            elif sock is self._sockets.wake:  # a call or a send: an event (``_read`` notes the messages)
                self._stirred = time.perf_counter()
                try:
                    self._sockets.wake.recv(4096)
                except OSError:
                    pass
        return conns

    def _read(self, conn: Connection) -> None:
        """Handle every whole message ``conn`` holds now, each decoded and checked (``messages.decode``);
        a closed or broken connection is dropped."""
        try:
            for raw in conn.feed():
                if conn in self._pending and raw["type"] not in PRE_AUTH_TYPES:
                    self._refuse(
                        conn,
                        f"sent {str(raw['type'])[:32]!r} before authenticating (only a hello or a "
                        "probe request may come first)",
                    )
                    return
                now = time.monotonic()
                self.silence_max_s = max(self.silence_max_s, now - self._heard.get(conn, now))
                self._heard[conn] = now
                try:
                    msg = decode(raw)
                except ProtocolError as e:  # a field that breaks its rule: refused, the stream goes on
                    if conn in self._pending:  # a hello or a probe: the peer hears why, then the connection closes
                        try:
                            conn.send(Error(str(e), str(raw["type"])).to_wire())
                        except OSError:
                            pass
                        self._refuse(conn, str(e))
                        return
                    self._reject(conn, raw, e)
                    continue
                if isinstance(msg, Ping):
                    self._peer_loop[conn] = (now, msg.loop_s if msg.loop_s is not None else 0.0)
                else:  # a ping is no event: the peers' pings do not keep a loop polling
                    self._stirred = time.perf_counter()
                    try:
                        self._on_message(conn, msg)
                    except OSError as e:  # the peer went away while this side answered it: that is its loss
                        self._drop(
                            conn, str(e) or type(e).__name__, answered=getattr(e, "errno", None) not in _UNANSWERED
                        )
                        return
                    except KVStageError as e:
                        self._reject(conn, raw, e)
                    except Exception:  # a bug must not kill the loop or the rest of the batch
                        log.exception("%s %d: handling %s from %s", self.role, self.rank, msg.TYPE, conn.peer)
                if conn.closed:
                    return
        except ProtocolError as e:  # a frame that is not one (too large, not JSON): the stream cannot go on
            if conn in self._pending:
                self._refuse(conn, str(e))
                return
            log.warning("%s %d: dropped %s: %s", self.role, self.rank, conn.peer, e)
            conn.close()
            self._drop(conn, str(e))
        except (ConnectionError, OSError) as e:
            self._drop(conn, str(e) or type(e).__name__, answered=getattr(e, "errno", None) not in _UNANSWERED)

    def _drop(self, conn: Connection, reason: str, answered: bool = True) -> None:
        """Stop watching ``conn`` and tell the endpoint it is gone (``answered``:
        see ``_on_closed``)."""
        if self._sockets.watched.pop(conn.sock, None) is not None:
            self._sockets.changed()
        self._pending.pop(conn, None)
        self._heard.pop(conn, None)
        self._peer_loop.pop(conn, None)
        self._on_closed(conn, reason, answered)

    def _ping(self) -> None:
        for conn in self._peers():
            try:
                conn.send(Ping().to_wire())
            except OSError:
                pass  # a broken connection is reported by its reader

    def _replace_peer(self, old: Connection, name: str, new_peer: str) -> None:
        """``name`` (a peer rank) connected again, from ``new_peer``: a restarted or reconnected rank
        with the same identity. Its old connection closes, and what was in flight on it fails."""
        log.warning(
            "%s %d: %s connected again (%s); its connection %s is closed",
            self.role,
            self.rank,
            name,
            new_peer,
            old.peer,
        )
        old.close()
        self._drop(old, f"replaced by a new connection of {name}")

    def _pinged_peer(self, conn: Connection) -> None:
        """``conn`` leads to a peer endpoint: the native pinger pings it from now on (without
        one, ``_ping`` does, from this loop), and this side's messages go through the pinger's
        sends so a ping never lands inside one."""
        if self._clock is not None:
            self._clock.watch(conn.sock.fileno())
            conn.native = True

    def _peer_running(self, conn: Connection, now: float, since: float) -> bool:
        """Whether a ping heard after ``since`` (the moment a step became late) says the peer's
        loop turned within ``LIVE_LOOP_S``, and that ping is the latest due (pings come every
        ``PING_INTERVAL_S``): it ran after the step was due, so what it stalls is stuck. A ping
        from before then, or a late one, says nothing either way, and nothing is failed on it.
        A peer whose loop pings itself (no native pinger there) runs whenever it pings."""
        when, age = self._peer_loop.get(conn, (self._heard.get(conn, now), 0.0))
        return when >= since and age <= LIVE_LOOP_S and now - when <= 1.5 * PING_INTERVAL_S

    def _silent(self, conn: Connection, now: float) -> float | None:
        """Seconds since ``conn``'s peer last sent anything, if past ``peer_timeout_s``.
        A live peer pings every second, from a native thread however busy its Python
        is; a stopped or hung one (its kernel still answering TCP) goes quiet."""
        quiet = now - self._heard.setdefault(conn, now)
        return quiet if quiet > self.settings.peer_timeout_s else None

    # -- for subclasses ------------------------------------------------------
    def _peers(self) -> list[Connection]:
        """The control connections to peer endpoints (pinged, watched for silence)."""
        return []

    def _remember_abort(self, key: PeerReqKey, peer: str, cause: str) -> None:
        """A peer aborted request ``key`` (peer engine, request id) before this side was told of
        it: fail it the moment it is added instead of waiting for a grant or a writer that will
        never come. At most ``MAX_ABORTED`` are kept, the oldest dropped first."""
        remember(self._aborted, key, (peer, cause), MAX_ABORTED)

    def _take_abort(self, key: PeerReqKey, handle, keep: bool = False) -> bool:
        """Fail ``handle`` if its peer aborted request ``key`` already; ``keep``: the abort is kept for a
        later layer group of the same request."""
        got = self._aborted.get(key) if keep else self._aborted.pop(key, None)
        if got is not None:
            handle._fail(got[0], "abort", got[1])
        return got is not None

    def _busy(self) -> bool:
        return False

    def _forgive(self, gap: float) -> None:
        """Move the subclass's deadlines on by ``gap`` seconds this process did not run (``_resumed``)."""

    def _copying(self):
        """The oldest ``CopyFence`` of a device copy still running, if any. With
        nothing else to handle, the loop blocks on it (CUDA waits without the
        GIL): the next step (post the write, free the slot) follows the copy's
        end by microseconds instead of a poll interval or a thread hand-off."""
        return None

    def _on_message(self, conn: Connection, msg: Message) -> None:
        raise NotImplementedError

    def _on_closed(self, conn: Connection, reason: str, answered: bool) -> None:
        """``conn`` is gone. ``answered``: the peer's host ended it (end of stream,
        reset, garbage), so the link was up; False: it stopped answering (a
        timeout, no route), and the link may be down."""
        raise NotImplementedError

    def _progress(self) -> None:
        """Poll the transport and move work forward."""

    def _check_stalls(self, now: float) -> None:
        """Fail requests that made no progress for ``stall_timeout_s``."""

    def _shutdown(self) -> None:
        self.metrics.close()
        self.transport.close()
        self._sockets.close()

    def _reject(self, conn: Connection, raw: dict, err: KVStageError) -> None:
        """Refuse one message of an authenticated peer: one line here, an ``error`` naming it there."""
        kind = str(raw.get("type"))[:32]
        log.warning("%s %d: rejected %s message from %s: %s", self.role, self.rank, kind, conn.peer, err)
        req = raw.get("req")
        try:
            conn.send(Error(str(err), kind, req if isinstance(req, str) and len(req) <= MAX_ID else None).to_wire())
        except OSError:
            pass

    def kv_facts(self) -> dict:
        """Facts about the memory of this rank's KV buffers: what the page paths register
        (an engine's allocator may hand out memory the arena's ``cudaMalloc`` is not)."""
        if self._kv_facts is None:
            self._kv_facts = memory_facts(self.cache.buffers[0], value(self.facts, "gpus"))
        return self._kv_facts

    def _judge_link(
        self, peer_facts, peer_name: str, peer_kv_facts=None, kv: bool = False, label: str = ""
    ) -> Finding | None:
        """The connect-time judgement of the link to one peer (docs/probe.md), logged once, kept
        for ``stats``: of the arenas, or with ``kv`` of the KV buffers the page paths read. None
        when the peer's facts are unreadable (said in one line)."""
        local, peer = self.facts, peer_facts if isinstance(peer_facts, dict) else None
        if kv:
            local = {**self.facts, **self.kv_facts()}
            peer = {**(peer or {}), **(peer_kv_facts if isinstance(peer_kv_facts, dict) else {})}
        try:
            finding = connect_line(local, peer, self.transport.name, None, peer_name=peer_name)
        except Exception as e:  # a peer's malformed facts must not break the connection
            log.info("%s %d: link to %s: not assessed (peer facts unreadable: %s)", self.role, self.rank, peer_name, e)
            return None
        finding.path = ("KV pages: " if kv else "") + finding.path
        finding.log(log)
        self.metrics.link(label or peer_name, finding.path, finding.severity, kv=kv)
        remember(self._links, (peer_name, kv), finding.to_dict(), MAX_LINKS)
        return finding

    def _log_link(self, peer_facts, peer_name: str, peer_kv_facts=None, pages: bool = False, label: str = "") -> bool:
        """Judge the memory each path to this peer registers: the arenas, and the KV buffers when
        a page path may read them. True when that path's link is healthy (not WARNING or worse).
        ``label``: the peer as the metrics name it (``peer_label``)."""
        self._judge_link(peer_facts, peer_name, label=label)
        if not pages:
            return False
        kv = self._judge_link(peer_facts, peer_name, peer_kv_facts, kv=True, label=label)
        return kv is None or kv.severity is Severity.INFO

    def kv_regions(self) -> list[Region]:
        """Register this rank's KV buffers with the transport once: what the direct and pages paths read.
        A buffer that stands in two places (an engine's layer described twice) is registered once."""
        if self._kv_regions is None:
            seen: dict = {}
            for b in self.cache.buffers:
                key = (b.data_ptr(), b.numel() * b.element_size())
                if key not in seen:
                    seen[key] = self.transport.register(b)
            self._kv_regions = [seen[(b.data_ptr(), b.numel() * b.element_size())] for b in self.cache.buffers]
        return self._kv_regions

    def stats(self) -> EndpointStats:
        """A read-only view of this endpoint (slots, requests, peers, links), taken on its loop."""
        return self._call(self._stats)

    def _stats(self) -> EndpointStats:
        a = self.arena.allocator
        return EndpointStats(
            self.role,
            self.rank,
            a.count,
            a.free,
            len(self.requests),
            len(self._peers()),
            aborts_remembered=len(self._aborted),
            polling=self._busy(),
            wait="select" if self._sockets.low else "epoll",
            links=tuple(self._links.values()),
        )

    # -- public --------------------------------------------------------------
    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._post("stop")
        self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
