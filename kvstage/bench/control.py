"""Rendezvous and lockstep for benchmark processes, over plain TCP.

One ``Coordinator`` (in the ``kvstage bench`` process that holds the
destination ranks, or the only one on a single host) listens on one port.
Every rank process, and on a two-host run the ``--role src`` process of each
source host, connects to it with a ``Link``. Over these connections the
coordinator hands out each group's configuration and the destination ranks'
addresses and NIXL metadata, runs the lockstep schedule (``prep`` -> ``armed``
from all -> ``go`` -> ``result`` from all, per step), and collects results.
No other service is involved.

Clocks: reports carry ``time.perf_counter()`` stamps (CLOCK_MONOTONIC on
Linux). Processes of one kernel (same ``boot_id``, network namespaces
included) share that clock; a process on another host measures its offset to
the coordinator's clock at connect time (the sample with the shortest round
trip of 16 pings: error at most half that round trip) and reports in the
coordinator's clock.

Messages are ``kvstage.protocol.wire`` frames (length-prefixed JSON objects).
A hello must carry the ``KVSTAGE_AUTH_TOKEN`` of the coordinator's side.
"""

from __future__ import annotations

import hmac
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

from kvstage.errors import KVStageError, ProtocolError
from kvstage.protocol.wire import Connection

log = logging.getLogger("kvstage.bench")

VERSION = 1
HELLO_TIMEOUT_S = 10.0
SYNC_PINGS = 16


class BenchError(KVStageError):
    """A benchmark process failed or went away; the message says which and why."""


class Aborted(BenchError):
    """The coordinator ended the run (another process failed, or Ctrl-C)."""


def boot_id() -> str:
    """This kernel's boot id: equal ids share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"{socket.gethostname()}-unknown"


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    from kvstage.errors import ConfigError

    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what}={text!r}: must be HOST:PORT with a port in 0..65535")
    return host, int(port)


def wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def rank_name(role: str | None, rank: int | None, engine: int | None = None) -> str:
    """``source rank 1``, or in a multi-engine group ``source rank 1 of engine s0``. A peer's hello may
    lack its role or rank (``Peer``): it is named all the same, in the errors that report it."""
    side = "source" if role == "src" else "destination"
    return f"{side} rank {rank}" + ("" if engine is None else f" of engine {'s' if role == 'src' else 'd'}{engine}")


# -- the client side ----------------------------------------------------------------
class Link:
    """A rank's or source host's connection to the coordinator.

    A reader thread queues incoming messages; ``recv`` takes them in order.
    When the coordinator closes the connection or sends ``abort``, ``on_lost``
    runs once (rank processes end themselves there)."""

    def __init__(
        self,
        address: tuple[str, int],
        hello: dict,
        token: str = "",
        on_lost=None,
        timeout: float = HELLO_TIMEOUT_S,
        clock_sync: bool = False,
    ):
        """``clock_sync``: measure the offset to the coordinator's clock even on its own kernel
        (``kvstage bench --clock-sync``; processes on other kernels always do)."""
        self.address = address
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as e:
            raise BenchError(f"cannot reach the coordinator at {address[0]}:{address[1]}: {e}") from e
        self.conn = Connection(sock, f"coordinator {address[0]}:{address[1]}")
        self.local_host = sock.getsockname()[0]
        self.finished = False
        self._q: queue.Queue = queue.Queue()
        self._on_lost = on_lost
        self.offset = 0.0
        try:
            self.conn.send(
                {
                    "type": "hello",
                    "version": VERSION,
                    "token": token,
                    "boot_id": boot_id(),
                    "host": socket.gethostname(),
                    **hello,
                }
            )
            welcome = self.conn.recv()
        except (OSError, ConnectionError, ProtocolError) as e:
            self.conn.close()
            raise BenchError(f"coordinator at {address[0]}:{address[1]} did not welcome us: {e}") from e
        if welcome["type"] != "welcome":
            self.conn.close()
            raise BenchError(f"coordinator at {address[0]}:{address[1]} refused: {welcome.get('reason', welcome)}")
        self.welcome = welcome
        if welcome.get("boot_id") != boot_id() or clock_sync:
            self.offset, self.sync_error = self._sync()
        else:
            self.sync_error = 0.0
        self.conn.send({"type": "join"})
        sock.settimeout(None)
        threading.Thread(target=self._read, name="kvstage-bench-link", daemon=True).start()

    def _sync(self) -> tuple[float, float]:
        best: tuple[float, float] | None = None
        for _ in range(SYNC_PINGS):
            a = time.perf_counter()
            self.conn.send({"type": "ping"})
            msg = self.conn.recv()
            b = time.perf_counter()
            if msg["type"] != "pong":
                raise BenchError(f"clock sync: expected pong, got {msg['type']!r}")
            sample = (b - a, float(msg["t"]) - (a + b) / 2)
            best = sample if best is None or sample[0] < best[0] else best
        assert best is not None, "SYNC_PINGS > 0: the loop took a sample"
        return best[1], best[0] / 2

    def now(self) -> float:
        """Now, on the coordinator's clock."""
        return time.perf_counter() + self.offset

    def to_coord(self, t: float | None) -> float | None:
        return None if t is None else t + self.offset

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                self._q.put(msg)
                if msg["type"] == "abort":
                    break
        except (OSError, ConnectionError, ProtocolError) as e:
            self._q.put({"type": "lost", "reason": str(e) or type(e).__name__})
        if not self.finished and self._on_lost is not None:
            self._on_lost()

    def send(self, msg: dict) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise BenchError(f"lost the coordinator: {e}") from e

    def recv(self, kind: str | None = None, timeout: float | None = None) -> dict:
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no {kind or 'message'} from the coordinator after {timeout} s") from None
        if msg["type"] == "abort":
            raise Aborted(f"run aborted by the coordinator: {msg.get('reason')}")
        if msg["type"] == "lost":
            raise BenchError(f"lost the coordinator: {msg['reason']}")
        if kind is not None and msg["type"] != kind:
            raise BenchError(f"expected {kind!r} from the coordinator, got {msg['type']!r}")
        return msg

    def close(self) -> None:
        self.finished = True
        self.conn.close()


# -- the coordinator side --------------------------------------------------------------
@dataclass(eq=False)
class Peer:
    conn: Connection
    kind: str  # "rank" or "agent"
    role: str | None
    rank: int | None
    group: int | None
    host: str
    boot_id: str
    local_host: str  # this host's address as the peer reached it
    said_bye: bool = False  # finished cleanly: its connection closing is no failure
    engine: int | None = None  # its engine in a multi-engine group (source engine s0, destination engine d1)

    @property
    def name(self) -> str:
        if self.kind == "agent":
            return f"source host {self.host} ({self.conn.peer})"
        return rank_name(self.role, self.rank, self.engine)

    def send(self, msg: dict) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise BenchError(f"lost {self.name}: {e}") from e


class Coordinator:
    """Accepts ranks and source hosts; their messages arrive as events on ``get``.

    Events: ``("joined", peer)``, ``("msg", peer, msg)``, ``("closed", peer, reason)``."""

    def __init__(self, listen: tuple[str, int], token: str = ""):
        try:
            self._server = socket.create_server(listen, family=socket.AF_INET6 if ":" in listen[0] else socket.AF_INET)
        except OSError as e:
            raise BenchError(f"cannot listen on {listen[0]}:{listen[1]}: {e}") from e
        self.address = self._server.getsockname()[:2]
        self._token = token
        self.boot = boot_id()
        self._events: queue.Queue = queue.Queue()
        self._closing = False
        self.peers: list[Peer] = []
        threading.Thread(target=self._accept, name="kvstage-bench-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, addr = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, addr), name="kvstage-bench-peer", daemon=True).start()

    def _serve(self, sock: socket.socket, addr) -> None:
        conn = Connection(sock, f"{addr[0]}:{addr[1]}")
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = conn.recv()
            if hello["type"] != "hello" or hello.get("version") != VERSION:
                raise ProtocolError(f"expected a version {VERSION} hello, got {str(hello)[:80]}")
            if not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token.encode()):
                raise ProtocolError("auth token does not match KVSTAGE_AUTH_TOKEN on the coordinator's side")
            kind = hello.get("kind")
            if kind not in ("rank", "agent"):
                raise ProtocolError(f"unknown peer kind {kind!r}")
            engine = hello.get("engine")
            if engine is not None and (isinstance(engine, bool) or not isinstance(engine, int)):
                raise ProtocolError(f"engine={str(engine)[:40]!r}: must be an engine index")
            peer = Peer(
                conn,
                kind,
                hello.get("role"),
                hello.get("rank"),
                hello.get("group"),
                str(hello.get("host", "?"))[:100],
                str(hello.get("boot_id", "")),
                sock.getsockname()[0],
                engine=engine,
            )
            conn.send({"type": "welcome", "boot_id": self.boot})
        except (OSError, ConnectionError, ProtocolError) as e:
            log.warning("bench coordinator: refused %s: %s", conn.peer, e)
            try:
                conn.send({"type": "error", "reason": str(e)})
            except OSError:
                pass
            conn.close()
            return
        sock.settimeout(None)
        self.peers.append(peer)
        joined = False
        try:
            while True:
                msg = conn.recv()
                if msg["type"] == "ping":  # answered here, at once, for an accurate clock offset
                    conn.send({"type": "pong", "t": time.perf_counter()})
                elif msg["type"] == "join" and not joined:  # clock sync done: the peer is ready for messages
                    joined = True
                    self._events.put(("joined", peer))
                elif not joined:
                    raise ProtocolError(f"{msg['type']!r} before join")
                else:
                    self._events.put(("msg", peer, msg))
        except (OSError, ConnectionError, ProtocolError) as e:
            self._events.put(("closed", peer, str(e) or type(e).__name__))

    def get(self, timeout: float):
        """The next event, or None after ``timeout`` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def abort(self, reason: str) -> None:
        """Tell every connected process to stop."""
        for p in list(self.peers):
            try:
                p.conn.send({"type": "abort", "reason": reason})
            except OSError:
                pass

    def close(self) -> None:
        self._closing = True
        try:
            self._server.close()
        except OSError:
            pass
        for p in list(self.peers):
            p.conn.close()
