"""Layer-wise streaming: a request's KV leaves in layer groups while the prefill's forward still runs.

A source sends a streamed request as consecutive layer groups (``Source.send(..., layers=)``), each right
after the forward has written its last layer; the destination reads each group as soon as it is ready,
so what is left after the forward is the last group's read. ``layer_groups`` is the one rule for how a
request is cut, and ``LayerStream`` drives it from a forward's per-layer progress. Pure but for the
sends ``LayerStream`` makes.
"""

from __future__ import annotations

import logging
import time

from kvstage.errors import TransferFailed
from kvstage.protocol.request import State

log = logging.getLogger("kvstage")

#: a request of fewer tokens moves whole after the forward: its transfer is shorter than the host steps
#: each extra group costs (a ready, a launch or a read, a done), so streaming it only adds time
STREAM_MIN_TOKENS = 512
#: a streamed request is cut into this many groups at most: what is left after the forward is one group's
#: read, and each further group costs host steps of its own on both sides (swept: benchmarks/group_sweep.py)
MAX_GROUPS = 8

_logged: set = set()


def layer_groups(layers: int, tokens: int) -> tuple[range, ...]:
    """The layer groups a request of ``tokens`` tokens over ``layers`` layers is sent in: even groups of
    whole layers, or one group of every layer (the short-prompt bypass, ``STREAM_MIN_TOKENS``)."""
    if layers < 1 or tokens < 1:
        raise ValueError(f"layers={layers}, tokens={tokens}: both must be positive")
    if tokens < STREAM_MIN_TOKENS or layers < 2:
        groups: tuple[range, ...] = (range(0, layers),)
    else:
        n = min(MAX_GROUPS, layers)
        groups = tuple(range(i * layers // n, (i + 1) * layers // n) for i in range(n))
    rule = (layers, len(groups) > 1)
    if rule not in _logged and layers < 2:
        _logged.add(rule)
        log.info("streaming: a model of one layer: every request moves whole after the forward")
    elif rule not in _logged:
        _logged.add(rule)
        log.info(
            "streaming: requests of %s %d tokens over %d layers move %s",
            "fewer than" if not rule[1] else "at least",
            STREAM_MIN_TOKENS,
            layers,
            f"in {len(groups)} layer groups as the forward writes them"
            if rule[1]
            else "whole after the forward (their transfer is shorter than a group's host steps)",
        )
    return groups


def check_layers(layers, total: int) -> range | None:
    """``layers`` as a group of ``total`` layers: None for every layer; ``ValueError`` naming the rule."""
    if layers is None:
        return None
    if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start < layers.stop <= total:
        raise ValueError(f"layers={layers!r}: must be a range of consecutive layers within 0..{total}")
    return None if len(layers) == total else layers


def check_span(span, tokens: int, page_size: int) -> range | None:
    """``span`` as tokens of a request of ``tokens`` tokens: None for all; ``ValueError`` naming the rule."""
    if span is None:
        return None
    if (
        not isinstance(span, range)
        or span.step != 1
        or not 0 <= span.start < span.stop <= tokens
        or span.start % page_size
    ):
        raise ValueError(
            f"span={span!r}: must be a range of consecutive tokens within 0..{tokens} starting on a "
            f"page (page size {page_size})"
        )
    return None if len(span) == tokens else span


class LayerStream:
    """One request sent layer group by layer group as a forward writes it (``Source.stream``).

    ``written(n)`` says the forward has written layers ``0 .. n`` (queued on the caller's CUDA stream, or
    done on a CPU); every group whose layers all lie below ``n`` is sent then, on the caller's thread."""

    def __init__(self, send, req: str, layers: int, tokens: int, abort=None):
        self._send = send  # callable(layers: range | None) -> TransferHandle
        self._abort = abort  # callable(reason): drops the whole request at its destinations
        self.req = req
        self.groups = layer_groups(layers, tokens)
        self.handles: list = []
        self._aborted: str | None = None

    def written(self, layers: int) -> None:
        if self._aborted is not None:
            return
        while len(self.handles) < len(self.groups) and self.groups[len(self.handles)].stop <= layers:
            g = self.groups[len(self.handles)]
            self.handles.append(self._send(g if len(self.groups) > 1 else None))

    @property
    def sent(self) -> bool:
        """Every group is sent."""
        return len(self.handles) == len(self.groups)

    def done(self) -> bool:
        """Final: every group sent is done and either every group was sent or the stream was aborted, or a
        group failed (the request cannot complete)."""
        over = all(h.done() for h in self.handles)
        return (over and (self.sent or self._aborted is not None)) or self.failed() is not None

    def failed(self) -> TransferFailed | None:
        return next((h.error for h in self.handles if h.error is not None), None)

    @property
    def error(self) -> TransferFailed | None:
        """Why it failed, as a handle's ``error``: a group's failure, or the caller's abort."""
        got = self.failed()
        if got is None and self._aborted is not None:
            return TransferFailed(self.req, "local", "abort", self._aborted)
        return got

    @property
    def state(self) -> State:
        """As one handle's: DONE once every group is; FAILED once one failed or the stream was aborted."""
        if self.error is not None:
            return State.FAILED
        if self.sent and all(h.state is State.DONE for h in self.handles):
            return State.DONE
        return State.TRANSFERRING if any(h.state is not State.PENDING for h in self.handles) else State.PENDING

    def wait(self, timeout: float | None = None) -> LayerStream:
        """Block until every group is done; raises the first ``TransferFailed``, or ``TimeoutError``."""
        if self._aborted is not None and self.failed() is None:
            raise TransferFailed(self.req, "local", "abort", self._aborted)
        if not self.sent:
            raise ValueError(
                f"request {self.req!r}: layers from {self.groups[len(self.handles)].start} on are not "
                "written yet (written() sends them)"
            )
        deadline = None if timeout is None else time.perf_counter() + timeout
        for h in self.handles:
            h.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        return self

    def abort(self, reason: str = "aborted by caller") -> None:
        """Fail the request on both sides; groups not sent yet are never sent."""
        self._aborted = reason
        if self._abort is not None:
            self._abort(reason)
        else:
            for h in self.handles:
                h.abort(reason)
