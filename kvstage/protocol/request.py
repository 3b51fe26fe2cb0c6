"""One request's lifecycle, as its caller sees it.

States: PENDING (waiting for the other side) -> TRANSFERRING -> DONE | FAILED.
DONE and FAILED are final; nothing partial is ever reported DONE. Every
change is logged at debug level, one line each.
"""

from __future__ import annotations

import enum
import logging
import threading
import time

from kvstage.errors import TransferFailed

log = logging.getLogger("kvstage.request")


class State(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class TransferHandle:
    """What ``Source.send`` and ``Destination.expect`` return.

    ``stages`` holds seconds spent per stage on this rank (gather, write,
    scatter, queued, slot_wait) so a slow request says where its time went.
    On a source, ``queued`` is a granted chunk waiting for the rank's earlier
    chunks (one loop gathers them in turn) and ``slot_wait`` only the time the
    arena had no free slot for it; ``start`` runs from ``send`` to its first copy
    (a gather launched or a direct write posted), including any wait for the
    first grant. On a destination, ``slot_wait`` is the time the announced
    request's next chunk waited for a free slot of its arena (a full arena, or
    its engine at its share of the slots)."""

    def __init__(self, req: str, role: str, tokens: int):
        self.req, self.role, self.tokens = req, role, tokens
        self.state = State.PENDING
        self.error: TransferFailed | None = None
        self.bytes = 0
        self.descriptors = 0  # spans handed to the transport (a gathering transport takes a chunk's pages)
        self.writes = 0  # transport writes: one per chunk and destination on the staged path
        self.path: str | None = None  # "staged" or "direct", once known
        self.created = time.perf_counter()
        self.finished: float | None = None
        self.stages = {"gather": 0.0, "write": 0.0, "scatter": 0.0, "queued": 0.0, "slot_wait": 0.0}
        self._done = threading.Event()
        self._abort = None  # set by the endpoint: callable(reason)

    # -- endpoint side -------------------------------------------------------
    def _move(self, new: State) -> None:
        if self.state in (State.DONE, State.FAILED):
            return
        log.debug("%s %s: %s -> %s", self.role, self.req, self.state.value, new.value)
        self.state = new
        if new in (State.DONE, State.FAILED):
            self.finished = time.perf_counter()
            self._done.set()

    def _fail(self, peer: str, stage: str, cause: str) -> None:
        if self.state in (State.DONE, State.FAILED):
            return
        self.error = TransferFailed(self.req, peer, stage, cause)
        log.debug("%s %s: failed at %s with %s: %s", self.role, self.req, stage, peer, cause)
        self._move(State.FAILED)

    # -- caller side ---------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> "TransferHandle":
        """Block until final. Raises ``TransferFailed`` on failure, ``TimeoutError`` if not final in time."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.role} request {self.req!r} not finished after {timeout} s (state {self.state.value})")
        if self.error is not None:
            raise self.error
        return self

    def abort(self, reason: str = "aborted by caller") -> None:
        """Fail the request on both sides; its slots are freed once no write can still land."""
        if self._abort is not None and not self.done():
            self._abort(reason)

    @property
    def seconds(self) -> float | None:
        return None if self.finished is None else self.finished - self.created
