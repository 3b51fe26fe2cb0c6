"""Control messages on the wire: framing and the one field check.

Control traffic (the handshake, readiness, reads, completion, aborts) goes over
one TCP connection per (source rank, destination rank) pair as length-prefixed
JSON; ``messages`` defines every message and decodes it. The bytes themselves
never cross this connection: the destination reads them (``protocol.reads``).

``field`` checks one value read from a peer: a malformed or hostile message
raises ``ProtocolError`` naming the field, never a KeyError deep inside.
"""

from __future__ import annotations

import json
import socket
import struct
import threading

from kvstage.errors import ProtocolError
from kvstage.protocol import beat

MAX_FRAME = 16 << 20
_LEN = struct.Struct("!I")
# one encoder for every message: ``json.dumps`` with separators builds a new one per call, on a request's critical path
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def field(msg: dict, name: str, kind: type | tuple, *, minimum: int | None = None, maximum: int | None = None):
    """``msg[name]`` checked against ``kind`` (and bounds for ints)."""
    if not isinstance(msg, dict) or name not in msg:
        raise ProtocolError(f"message {str(msg)[:80]!r} lacks field {name!r}")
    v = msg[name]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ProtocolError(f"field {name}={str(v)[:80]!r} is not {getattr(kind, '__name__', kind)}")
    if isinstance(v, int) and not isinstance(v, bool):
        if minimum is not None and v < minimum:
            raise ProtocolError(f"field {name}={v} is below {minimum}")
        if maximum is not None and v > maximum:
            raise ProtocolError(f"field {name}={v} is above {maximum}")
    return v


def _keepalive(sock: socket.socket, idle: int = 1, interval: int = 1, count: int = 3) -> None:
    """Probe an idle peer every second and drop it after three missed answers:
    a peer whose host or link died is noticed in ~4 s even with nothing to send.

    Keepalive only runs while nothing sent is waiting for an acknowledgement;
    with a grant or an abort stuck in a cut link, TCP would retransmit for
    ~15 minutes instead. ``TCP_USER_TIMEOUT`` bounds that wait to the same
    ~4 s, so a dead link closes the connection (and frees its slots) either way."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
        ("TCP_USER_TIMEOUT", (idle + interval * count) * 1000),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Connection:
    """A framed JSON message stream over a connected TCP socket.

    ``send`` may be called from any thread. Reading is either blocking
    (``recv``: a handshake) or, once an endpoint's loop watches the socket,
    ``feed`` each time it is readable; never both at once."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(sock)
        self.sock, self.peer = sock, peer
        self._send_lock = threading.Lock()
        self._inbox = bytearray()  # bytes read by ``feed`` not yet a whole frame
        #: the largest frame read from this peer, checked from its length prefix before the body is
        #: read; an endpoint lowers it until the peer is authenticated (``gate.PRE_AUTH_MAX_FRAME``)
        self.max_frame = MAX_FRAME
        self.closed = False
        #: the native pinger pings this socket (``beat``): every frame goes through its sends, so a
        #: ping never lands inside one
        self.native = False

    def send(self, msg: dict) -> None:
        data = _COMPACT.encode(msg).encode()
        frame = _LEN.pack(len(data)) + data
        with self._send_lock:
            if self.native:
                beat.send(self.sock.fileno(), frame)
            else:
                self.sock.sendall(frame)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self.sock.recv(min(n - len(buf), 1 << 20))
            if not part:
                raise ConnectionError("peer closed the connection")
            buf += part
        return bytes(buf)

    def recv(self) -> dict:
        """Next message; ``ConnectionError`` when closed, ``ProtocolError`` when malformed."""
        (n,) = _LEN.unpack(self._exact(_LEN.size))
        return _decode(self._exact(_frame_size(n, self.max_frame)))

    def feed(self):
        """The messages completed by one read of a readable socket (which then does not
        block), in order; ``ConnectionError`` when closed, ``ProtocolError`` at a malformed
        frame (after the whole ones before it)."""
        part = self.sock.recv(1 << 16)
        if not part:
            raise ConnectionError("peer closed the connection")
        self._inbox += part
        while len(self._inbox) >= _LEN.size:
            n = _frame_size(_LEN.unpack_from(self._inbox)[0], self.max_frame)
            if len(self._inbox) < _LEN.size + n:
                return
            data = bytes(self._inbox[_LEN.size : _LEN.size + n])
            del self._inbox[: _LEN.size + n]
            yield _decode(data)

    def close(self) -> None:
        self._inbox = bytearray()  # what a peer left unfinished is not held past its connection
        if not self.closed:
            self.closed = True
            if self.native:  # before the descriptor can be closed and reused
                beat.forget(self.sock.fileno())
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


def _frame_size(n: int, limit: int = MAX_FRAME) -> int:
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes exceeds the {limit}-byte limit")
    return n


def _decode(data: bytes) -> dict:
    """A frame's message: a JSON object with a string ``type``."""
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"frame is not JSON: {data[:60]!r}") from e
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame is not a JSON object: {data[:60]!r}")
    field(msg, "type", str)
    if len(msg["type"]) > 32:
        raise ProtocolError(f"frame type {msg['type'][:32]!r}... is longer than 32 characters")
    return msg
