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
events is the order they are handled in. While a request is in flight, the
loop polls its sockets every 20 µs (CUDA) for ``Settings.poll_us`` after each
event instead of sleeping until the next message (GPU hosts: a thread that
slept long wakes 0.1-0.2 ms late, and runs its next steps slowly).
"""

from __future__ import annotations

import base64
import ctypes
import errno
import logging
import os
import queue
import select
import selectors
import socket
import threading
import time
from typing import Callable

import numpy as np
import torch

from kvstage.config import PING_INTERVAL_S, Settings
from kvstage.errors import ConfigError, KVStageError, ProtocolError, TransportError
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.probe.connect import connect_line
from kvstage.probe.facts import collect_local, memory_facts, value
from kvstage.protocol import switch_interval
from kvstage.protocol.wire import Connection, field
from kvstage.staging.arena import StagingArena, choose_arena
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import copy_stream, use_host_copies
from kvstage.staging.landing import WORDS_PER_SLOT
from kvstage.tp import SideSpec
from kvstage.transports.base import Region, Transport

log = logging.getLogger("kvstage")
#: errors of a connection whose peer's host stopped answering (a cut link, a dead host), not one it closed
_UNANSWERED = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN)

# seconds between transport polls while writes or notices are expected: GPU hosts have
# cores to spare and sub-millisecond chunks; on a host cache the copies are the cores' work
_BUSY_WAIT = {"cuda": 0.00002, "cpu": 0.0002}
_IDLE_WAIT = 0.05
_SELECT_LIMIT = 1024  # select(2) sees no descriptor from here on (FD_SETSIZE)
_PR_SET_TIMERSLACK = 29
MAX_ABORTED = 4096


def _tight_timer() -> None:
    """Linux lets a sleep overshoot by the thread's timer slack, 50 us by default:
    more than the loop's poll interval on a GPU host. 1 us for the calling thread."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: its sleeps keep their own precision
        pass


def remember(recent: dict, key, value, most: int) -> None:
    """Put ``key`` last in ``recent`` (insertion order = age), keeping at most ``most`` entries: the oldest go."""
    recent.pop(key, None)
    recent[key] = value
    while len(recent) > most:
        recent.pop(next(iter(recent)))


def spec_to_wire(spec: SideSpec) -> dict:
    g = spec.geometry
    return {
        "layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim, "dtype": g.dtype, "mla": g.mla,
        "tp": spec.tp, "page_size": spec.page.page_size, "order": spec.page.order,
    }


def spec_from_wire(d: dict) -> SideSpec:
    try:
        geo = KVGeometry(
            field(d, "layers", int), field(d, "kv_heads", int), field(d, "head_dim", int),
            field(d, "dtype", str), field(d, "mla", bool),
        )
        return SideSpec(geo, field(d, "tp", int), PageLayout(field(d, "page_size", int), field(d, "order", str)))
    except ConfigError as e:
        raise ProtocolError(f"peer's spec is invalid: {e}") from e


def md_to_wire(md: bytes) -> str:
    return base64.b64encode(md).decode()


def md_from_wire(s: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except ValueError as e:
        raise ProtocolError("agent metadata is not base64") from e


def check_pages(cache: RankCache, page_ids, tokens: int) -> np.ndarray:
    """Validate a request's page list against this rank's cache (caller's thread), and
    keep a copy of it: a chunk's copy reads it later, on the host or in its launch.

    On a request's critical path, which runs cold (its thread just woke): the checks
    work on a Python list, about half the time of numpy's reductions and ``unique``
    on such a path, and faster for long lists too (docs/benchmarks.md, session 14)."""
    if not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise ConfigError(f"tokens={tokens!r}: must be a positive integer")
    ids = np.array(page_ids, dtype=np.int64).reshape(-1)  # a copy: the caller may reuse its list once this returns
    need = pages_needed(int(tokens), cache.spec.page.page_size)
    if len(ids) < need:
        raise ConfigError(
            f"page_ids: {len(ids)} pages given, {tokens} tokens of page size {cache.spec.page.page_size} need {need}"
        )
    ids = ids[:need]
    values = ids.tolist()
    low, high = min(values), max(values)
    if low < 0 or high >= cache.pages:
        raise ConfigError(f"page_ids: values must lie in [0, {cache.pages}); got {low}..{high}")
    if len(set(values)) != len(values):
        raise ConfigError("page_ids: a page appears twice; each token needs its own place")
    return ids


def check_transport(msg: dict, mine: str, who: str) -> None:
    """Both sides of a connection must move bytes with the same transport (absent: nixl, protocol 1's only one)."""
    theirs = msg.get("transport", "nixl")
    if theirs != mine:
        raise ProtocolError(
            f"transport: the {who} uses {str(theirs)[:32]!r}, this side {mine!r}; set the same KVSTAGE_TRANSPORT on both sides"
        )


def _plugins(transport: Transport) -> list[str] | None:
    plugins = getattr(transport, "plugins", None)
    return plugins() if callable(plugins) else None


class Endpoint:
    """Base of ``Source`` and ``Destination``."""

    role = "endpoint"
    shares_arena = False  # offers its arena to sources on this host (``transports.mapped``)

    def __init__(self, cache: RankCache, settings: Settings | None = None, transport: Transport | None = None):
        self.cache = cache
        self.spec = cache.spec
        self.rank = cache.rank
        self.settings = settings or Settings()
        made = transport is None
        if made:
            from kvstage.transports import make_transport

            transport = make_transport(self.settings.transport, f"kvstage-{self.role}{self.rank}")
        elif self.settings.direct and not transport.one_sided:
            raise ConfigError(
                f"direct=True with a {transport.name} transport: {transport.name} is two-sided and has no direct "
                f"path; pass Settings(transport={transport.name!r}) (direct then defaults to off) or direct=False"
            )
        self.transport = transport
        try:
            if transport.host_only and cache.device.type == "cuda":
                raise ConfigError(f"transport={transport.name!r} moves host memory only; this rank's cache is on "
                                  f"{cache.device}: use nixl or ucx")
            #: how this rank's host gathers and scatters copy ("native", "numpy"); None: a GPU cache's kernel
            self.host_copy, how = use_host_copies(cache, self.settings.host_copy) if cache.device.type == "cpu" else (None, "")
        except ConfigError:
            if made:  # a transport the caller passed in stays the caller's to close
                transport.close()
            raise
        if self.host_copy is not None:
            log.info("%s %d: host gathers and scatters: %s", self.role, self.rank, how)
        # facts first: the arena's place follows the UCX this transport really runs
        self.facts = collect_local(agent_plugins=_plugins(self.transport))
        own = getattr(self.transport, "facts", None)
        if callable(own):  # the transport's own introspection (UCXX's UCX, not NIXL's bundled one)
            self.facts.update(own())
        where, why = choose_arena(self.settings.arena, cache.device, value(self.facts, "ucx_modules"), os.environ)
        on_gpu = where == "device"
        # a destination's host arena goes in shared memory only when asked (mapped="on"): sources on this
        # host then gather into it; a CUDA arena is shareable as it is (CUDA IPC)
        shared = self.shares_arena and self.settings.mapped == "on" and cache.device.type == "cpu"
        # and beside a shared CUDA arena, the words its writers set as their pieces land (``staging.landing``)
        words = self.settings.slots * WORDS_PER_SLOT if (
            self.shares_arena and on_gpu and self.settings.mapped != "off" and self.settings.prearm
            and self.transport.one_sided) else 0
        self.arena = StagingArena(*self._arena_slots(), cache.device if on_gpu else torch.device("cpu"),
                                  pinned=cache.device.type == "cuda", shared=shared, words=words)
        self.arena_location = where
        if cache.device.type == "cuda":
            log.info("%s %d: staging arena of %d MiB in %s (%s)", self.role, self.rank,
                     self.arena.buffer.numel() >> 20, f"{cache.device} memory" if on_gpu else "pinned host memory", why)
        self.arena_region: Region = self.transport.register(self.arena.buffer)
        self.facts.update(memory_facts(self.arena.buffer, value(self.facts, "gpus")))
        self._kv_regions: list[Region] | None = None
        self._aborted: dict[str, tuple[str, str]] = {}  # req -> (peer, cause): aborted by a peer before this side knew it
        self._events: queue.Queue = queue.Queue()
        self._selector = None  # epoll over the watched sockets, made only while one is past select's reach
        self._wake, self._waker = socket.socketpair()  # a byte on _waker: the queue holds an event
        for s in (self._wake, self._waker):
            s.setblocking(False)
        self._watched: dict = {self._wake: None}  # socket -> its connection (None: the wake-up socket)
        self._socks, self._low = [self._wake], True
        self._sockets_changed()
        self._first: dict = {}  # watched connection -> deadline of its first message
        self._busy_wait = _BUSY_WAIT["cuda" if cache.device.type == "cuda" else "cpu"]
        self._poll = self.settings.poll_seconds(cache.device.type)
        self._stirred = 0.0  # the loop's last event: a message other than a ping, a call, a send (loop thread only)
        self.requests: dict = {}  # req -> the subclass's record of a request in flight
        self._heard: dict = {}  # control connection -> when its peer last sent anything
        self._pinged = 0.0
        self._closing = False
        self._state = threading.Lock()  # held while state changes: by the loop, or by a caller in ``_here``
        self._thread = threading.Thread(target=self._run, name=f"kvstage-{self.role}{self.rank}", daemon=True)
        self._claimed_switch = False  # holds a claim on the interpreter's switch interval (settings.switch_interval_us)

    def _start(self) -> None:
        """Start the loop; subclasses call this last in their constructor."""
        if self.settings.switch_interval_us is not None:  # given back when the loop ends (``_run``)
            switch_interval.claim(self.settings.switch_interval_us, f"{self.role} {self.rank}")
            self._claimed_switch = True
        self._thread.start()

    # -- threads ------------------------------------------------------------
    def _post(self, kind: str, *args) -> None:
        self._events.put((kind, args))
        self._wake_loop()

    def _wake_loop(self) -> None:
        try:
            self._waker.send(b"\0")
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

    def _watch(self, conn: Connection, first_timeout: float | None = None) -> None:
        """Have the loop read ``conn``'s messages from now on; with ``first_timeout``, a
        connection whose first message is not there within that many seconds is dropped."""
        self._post("watch", conn, first_timeout)

    def _run(self) -> None:
        _tight_timer()
        while True:
            try:
                if not self._turn():
                    break
            except Exception:  # a bug must not kill the loop silently
                log.exception("%s %d: loop error", self.role, self.rank)
        with self._state:
            try:
                self._shutdown()
            finally:
                if self._claimed_switch:
                    self._claimed_switch = False
                    switch_interval.release(f"{self.role} {self.rank}")

    def _turn(self) -> bool:
        """Wait for something to do, do all of it, move the transfers on. False: stop.
        The state lock is held except while waiting."""
        with self._state:
            for conn in [c for c in self._watched.values() if c is not None and c.closed]:
                self._drop(conn, "closed by this side")  # a refused hello, a replaced peer: before a new socket takes its number
            fence, busy = self._copying(), self._busy()
            poll_until = self._stirred + self._poll if self._poll and self.requests else 0.0
        readable = self._wait(fence, busy, poll_until)
        with self._state:
            return self._handle(readable)

    def _handle(self, readable: list[Connection]) -> bool:
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
                self._watched[args[0].sock] = args[0]
                self._sockets_changed()
                if args[1] is not None:
                    self._first[args[0]] = time.monotonic() + args[1]
        now = time.monotonic()
        for conn, deadline in list(self._first.items()):
            if now > deadline:
                conn.close()
                self._drop(conn, "timed out")
        self._progress()
        if now - self._pinged >= PING_INTERVAL_S:
            self._pinged = now
            self._ping()
        self._check_stalls(now)
        return True

    def _wait(self, fence, busy: bool, poll_until: float = 0.0) -> list[Connection]:
        """The connections with bytes to read, once something is to be done: a message,
        a posted event, a device copy's end (``fence``), or (while a transfer is near,
        ``busy``) the poll interval. Until ``poll_until`` (``Settings.poll_us`` after the
        last event, while a request is in flight) a wait for messages alone polls instead
        of sleeping: a thread that slept is slow to wake and slow for its next steps."""
        if fence is None and not busy and time.perf_counter() < poll_until:
            ready = self._poll_sockets(poll_until)
            if not ready:  # the window passed quietly: back to sleeping
                return []
        elif fence is None:  # the transport is polled every _busy_wait while a transfer is near; a message ends the wait
            ready = self._ready(self._busy_wait if busy else _IDLE_WAIT)
        else:  # messages first; then the copy's end wakes the loop, with no thread in between
            ready = self._ready(0)
            if not ready:
                try:
                    fence.wait()
                except Exception:  # a CUDA error: logged; the copy's fence keeps failing the poll too
                    log.exception("%s %d: waiting for a device copy", self.role, self.rank)
                    time.sleep(self._busy_wait)
                ready = self._ready(0)
        conns = []
        for sock in ready:
            conn = self._watched.get(sock)
            if conn is not None:
                conns.append(conn)
            elif sock is self._wake:  # a call or a send: an event (``_read`` notes the messages)
                self._stirred = time.perf_counter()
                try:
                    self._wake.recv(4096)
                except OSError:
                    pass
        return conns

    def _poll_sockets(self, until: float) -> list:
        """The readable sockets, polled every ``_busy_wait`` until one is readable or
        ``until`` passes. Short waits keep the thread warm and wake it fast, and leave
        the GIL (an engine's own Python thread) and the state lock free between polls."""
        while True:
            left = until - time.perf_counter()
            ready = self._ready(min(self._busy_wait, max(left, 0.0)))
            if ready or left <= 0:
                return ready

    def _ready(self, timeout: float) -> list:
        """The watched sockets readable within ``timeout`` s. select(2) waits in
        microseconds (the loop polls the transport every 20-200 µs while a transfer
        is near) but sees no descriptor past 1023; past that (a process with many
        files open), epoll, which waits in milliseconds: a shorter wait is then a
        sleep before the check, and a message waits for its end."""
        if self._low:
            return select.select(self._socks, [], [], timeout)[0]
        if 0 < timeout < 1e-3:
            time.sleep(timeout)
            timeout = 0
        return [key.fileobj for key, _ in self._selector.select(timeout)]

    def _sockets_changed(self) -> None:
        """The wait's view of ``_watched``: select(2)'s list, and past its reach an epoll set."""
        self._socks = list(self._watched)
        low = all(sock.fileno() < _SELECT_LIMIT for sock in self._socks)
        if low != self._low:
            log.info("%s %d: control sockets %s descriptor %d: the loop waits with %s", self.role, self.rank,
                     "below" if low else "past", _SELECT_LIMIT - 1,
                     "select(2) again" if low else "epoll (millisecond timeouts: shorter waits become sleeps)")
        self._low = low
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if not low:
            self._selector = selectors.DefaultSelector()
            for sock in self._socks:
                if sock.fileno() >= 0:  # one closed by this side is swept before the next wait
                    self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, conn: Connection) -> None:
        """Handle every whole message ``conn`` holds now; a closed or broken connection is dropped."""
        try:
            for msg in conn.feed():
                self._first.pop(conn, None)
                self._heard[conn] = time.monotonic()
                if msg["type"] != "ping":  # a ping is no event: the peers' pings do not keep a loop polling
                    self._stirred = time.perf_counter()
                    try:
                        self._on_message(conn, msg)
                    except Exception:  # a bug must not kill the loop or the rest of the batch
                        log.exception("%s %d: handling %s from %s", self.role, self.rank, msg["type"], conn.peer)
                if conn.closed:
                    return
        except (ConnectionError, OSError, ProtocolError) as e:
            self._drop(conn, str(e) or type(e).__name__, answered=getattr(e, "errno", None) not in _UNANSWERED)

    def _drop(self, conn: Connection, reason: str, answered: bool = True) -> None:
        """Stop watching ``conn`` and tell the endpoint it is gone (``answered``:
        see ``_on_closed``)."""
        if self._watched.pop(conn.sock, None) is not None:
            self._sockets_changed()
        self._first.pop(conn, None)
        self._heard.pop(conn, None)
        self._on_closed(conn, reason, answered)

    def _ping(self) -> None:
        for conn in self._peers():
            try:
                conn.send({"type": "ping"})
            except OSError:
                pass  # a broken connection is reported by its reader

    def _silent(self, conn: Connection, now: float) -> float | None:
        """Seconds since ``conn``'s peer last sent anything, if past ``peer_timeout_s``.
        A live peer pings every second from its loop; a frozen or hung one (its
        kernel still answering TCP) goes quiet."""
        quiet = now - self._heard.setdefault(conn, now)
        return quiet if quiet > self.settings.peer_timeout_s else None

    # -- for subclasses ------------------------------------------------------
    def _peers(self) -> list[Connection]:
        """The control connections to peer endpoints (pinged, watched for silence)."""
        return []

    def _remember_abort(self, req: str, peer: str, cause: str) -> None:
        """A peer aborted ``req`` before this side was told of it: fail it the
        moment it is added instead of waiting for a grant or a writer that will
        never come. At most ``MAX_ABORTED`` are kept, the oldest dropped first."""
        remember(self._aborted, req, (peer, cause), MAX_ABORTED)

    def _take_abort(self, handle) -> bool:
        got = self._aborted.pop(handle.req, None)
        if got is not None:
            handle._fail(got[0], "abort", got[1])
        return got is not None

    def _arena_slots(self) -> tuple[int, int]:
        """(bytes per slot, slots) of this endpoint's arena."""
        return self.settings.slot_bytes, self.settings.slots

    def _busy(self) -> bool:
        return False

    def _copying(self):
        """The oldest ``CopyFence`` of a device copy still running, if any. With
        nothing else to handle, the loop blocks on it (CUDA waits without the
        GIL): the next step (post the write, free the slot) follows the copy's
        end by microseconds instead of a poll interval or a thread hand-off."""
        return None

    def _on_message(self, conn: Connection, msg: dict) -> None:
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
        self.transport.close()
        if self._selector is not None:
            self._selector.close()
        self._wake.close()
        self._waker.close()

    def _reject(self, conn: Connection, msg: dict, err: KVStageError) -> None:
        log.warning("%s %d: rejected %s message from %s: %s", self.role, self.rank, msg.get("type"), conn.peer, err)
        try:
            reply = {"type": "error", "reason": str(err), "about": str(msg.get("type"))[:32]}
            if isinstance(msg.get("req"), str) and len(msg["req"]) <= 256:
                reply["req"] = msg["req"]
            conn.send(reply)
        except OSError:
            pass

    def _log_link(self, peer_facts, peer_name: str) -> None:
        """The one line per peer about the path its bytes take (see docs/probe.md)."""
        try:
            finding = connect_line(self.facts, peer_facts if isinstance(peer_facts, dict) else None,
                                   self.transport.name, None, peer_name=peer_name)
        except Exception as e:  # a peer's malformed facts must not break the connection
            log.info("%s %d: link to %s: not assessed (peer facts unreadable: %s)", self.role, self.rank, peer_name, e)
            return
        finding.log(log)

    def kv_regions(self) -> list[Region]:
        """Register this rank's KV buffers (the direct path only) once."""
        if self._kv_regions is None:
            self._kv_regions = [self.transport.register(b) for b in self.cache.buffers]
        return self._kv_regions

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
