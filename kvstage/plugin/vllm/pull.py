"""A decode rank's "connect to me" to a prefill rank, where the two are not connected yet.

kvstage's sources connect to destinations: a prefill rank's ``Source`` connects to a
decode rank's ``Destination``. In vLLM's disaggregated flow the prefill learns of a
decode only when that decode reads a request of it, so each prefill rank listens on
one TCP port where a decode rank that is not connected to it asks it to connect
(the decode's first request from that prefill engine, or after a rank came back).
The prefill connects, sends the requests it holds for any engine, and the decode
reads them. Once connected, nothing crosses this port for a request.

Messages are kvstage's framed JSON (``kvstage.protocol.wire``):

- ``{"type": "connect", "token", "req", "address": "kvstage://SECRET@HOST:PORT", "engine", "rank"}`` ->
  ``{"type": "ok"}`` once the prefill rank is connected to that address (the decode rank's
  ``Destination.address``, whose secret it presents there), or ``{"type": "error", "reason"}``.

Who may ask: the holder of request ``req``'s ``kv_transfer_params``, which carry this rank's
``pull_secret`` of it (an HMAC of the id under the rank's own secret), or a peer presenting the
deployment's auth token where one is set; with neither set, anyone only where
``allow_unauthenticated`` says so by name. Anyone else is told only that authentication failed.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections.abc import Callable

from kvstage.errors import KVStageError, ProtocolError
from kvstage.protocol.handshake import AUTH_FAILED
from kvstage.protocol.wire import Connection

log = logging.getLogger("kvstage.vllm")


class PullError(KVStageError):
    """A connect request was refused or the prefill rank could not be reached."""


class PullServer:
    """Answers connect requests with ``handler(msg) -> reply``; one thread per connection."""

    def __init__(
        self,
        host: str,
        handler: Callable[[dict], dict],
        token: str = "",
        port: int = 0,
        secret_of: Callable[[str], str] | None = None,
        open_to_all: bool = False,
    ):
        """``token``: the deployment's, accepted from anyone presenting it (""; none); ``secret_of(req)``: what
        the holder of request ``req``'s transfer params presents; ``open_to_all``: no check at all (the
        operator's ``allow_unauthenticated``, with no token)."""
        self._handler, self._token, self._secret_of, self._open = handler, token, secret_of, open_to_all
        self._sock = socket.create_server((host, port))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closing = False
        threading.Thread(target=self._accept, name="kvstage-pull-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            conn = Connection(sock, f"{addr[0]}:{addr[1]}")
            threading.Thread(target=self._serve, args=(conn,), name="kvstage-pull", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            conn.sock.settimeout(30.0)
            while True:
                msg = conn.recv()
                if not self._admits(msg):
                    reply = {"type": "error", "reason": AUTH_FAILED}
                else:
                    try:
                        reply = self._handler(msg)
                    except KVStageError as e:
                        reply = {"type": "error", "reason": str(e)}
                    except Exception as e:  # a bug must answer, not leave the decode waiting
                        log.exception("kvstage connect port: the handler failed on %s", msg.get("type"))
                        reply = {"type": "error", "reason": f"{type(e).__name__}: {e}"}
                conn.send(reply)
        except (ConnectionError, OSError, ProtocolError):
            pass
        finally:
            conn.close()

    def _admits(self, msg: dict) -> bool:
        given = str(msg.get("token", "")).encode()
        if self._token and hmac.compare_digest(given, self._token.encode()):
            return True
        req = msg.get("req")
        if self._secret_of is not None and isinstance(req, str) and 0 < len(req) <= 512:
            return hmac.compare_digest(given, self._secret_of(req).encode())
        return self._open and not self._token

    def close(self) -> None:
        self._closing = True
        self._sock.close()


def pull(address, msg: dict, token: str = "", timeout: float = 10.0) -> dict:
    """Send one message to a prefill rank and return its ``ok`` reply.

    Raises ``PullError`` naming the rank's address when it cannot be reached,
    does not answer within ``timeout`` seconds, or refuses."""
    host, port = address[0], int(address[1])
    where = f"prefill rank at {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise PullError(f"{where}: cannot connect ({e})") from e
    conn = Connection(sock, where)
    try:
        sock.settimeout(timeout)
        conn.send(dict(msg, token=token))
        reply = conn.recv()
    except (OSError, ConnectionError, ProtocolError) as e:
        raise PullError(
            f"{where}: no answer to {msg.get('type')} within {timeout:g} s ({e or type(e).__name__})"
        ) from e
    finally:
        conn.close()
    if reply.get("type") != "ok":
        raise PullError(f"{where}: {reply.get('reason', reply)}")
    return reply
