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
from collections.abc import Callable

from kvstage.errors import TransferFailed

log = logging.getLogger("kvstage.request")


class State(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class TransferHandle:
    """What ``Source.send`` and ``Destination.expect`` return.

    ``stages`` holds seconds spent per stage on this rank so a slow request
    says where its time went: on a source ``gather`` (its chunks into its arena,
    the read path); on a destination ``read`` (its transport reads, from the
    first posted to the last done, per chunk), ``scatter`` (into its pages),
    ``slot_wait`` (a readable chunk waiting for a free slot of its arena: a full
    arena, or its engine at its share of the slots); ``gather_gpu``,
    ``read_gpu`` and ``scatter_gpu``: the device copies' own time where CUDA
    events measure it. On the ipc path ``read`` is the one-pass kernel's launch
    to its seen end, and ``read_gpu`` the kernel's own time."""

    def __init__(self, req: str, role: str, tokens: int):
        self.req, self.role, self.tokens = req, role, tokens
        self.state = State.PENDING
        self.error: TransferFailed | None = None
        self.bytes = 0
        self.descriptors = 0  # spans the destination's reads posted
        self.writes = 0  # transport reads the destination posted (one per chunk and source rank on the read path)
        self.path: str | None = None  # the paths it takes (``route.Path``: ipc, direct, pages, read), once known
        self.created = time.perf_counter()
        self.finished: float | None = None
        self.stages = {"gather": 0.0, "read": 0.0, "scatter": 0.0, "slot_wait": 0.0}
        self._done = threading.Event()
        self._abort: Callable[[str], None] | None = None  # set by the endpoint: callable(reason)

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

    def wait(self, timeout: float | None = None) -> TransferHandle:
        """Block until final. Raises ``TransferFailed`` on failure, ``TimeoutError`` if not final in time."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"{self.role} request {self.req!r} not finished after {timeout} s (state {self.state.value})"
            )
        if self.error is not None:
            raise self.error
        return self

    def abort(self, reason: str = "aborted by caller") -> None:
        """Fail the request on both sides; its slots are freed once no read can still touch them."""
        if self._abort is not None and not self.done():
            self._abort(reason)

    @property
    def seconds(self) -> float | None:
        return None if self.finished is None else self.finished - self.created
