"""The end of a gather or scatter launched on the caller's CUDA stream.

The endpoint's loop polls a fence while it has other work (post the next
chunk's reads while this one scatters) and waits on it, without the GIL, when
it has none. The two CUDA events also time the copy on the GPU itself, which
the stage profile reports beside the wall time the loop saw. On the CPU a copy
has finished when it returns (``CopyFence``), or runs on a thread of its own
(``HostFence``), so the loop's own thread goes on reading meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstage.staging.cuda_copy import current_stream

_SPARE: dict = {}  # CUDA device -> event pairs of released fences, recorded again by the next ones


class CopyFence:
    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._start: Any = None  # torch.cuda.Event pair on a CUDA device
        self._end: Any = None
        if self._cuda:
            spare = _SPARE.get(device)
            if spare:  # a new pair of events costs two driver calls on every chunk
                self._start, self._end = spare.pop()
            else:
                self._start = torch.cuda.Event(enable_timing=True)
                self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(current_stream(device))
        self._device = device

    def close(self) -> CopyFence:
        """Mark the end of the copies launched since the fence was made."""
        if self._cuda:
            self._end.record(current_stream(self._device))
        return self

    def started(self) -> bool:
        """Whether the stream has reached the fence's start: nothing queued before the
        copies is still running (``Source`` waits on a copy only then)."""
        return not self._cuda or self._start.query()

    def done(self) -> bool:
        return not self._cuda or self._end.query()

    def wait(self) -> None:
        if self._cuda:
            self._end.synchronize()

    def gpu_seconds(self) -> float | None:
        """Time the copies took on the GPU (after ``done``), None on the CPU."""
        return self._start.elapsed_time(self._end) / 1e3 if self._cuda else None

    def release(self) -> None:
        """Hand the events to the next fence on this device (after ``done`` and
        ``gpu_seconds``); the fence is not used again."""
        if self._cuda and self._start is not None:
            _SPARE.setdefault(self._device, []).append((self._start, self._end))
            self._start = self._end = None


class HostFence:
    """The end of a host copy running on a thread (a ``concurrent.futures.Future``): the same
    questions as ``CopyFence``; ``wait`` re-raises the copy's error."""

    def __init__(self, future):
        self._future = future

    def started(self) -> bool:
        return True

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()

    def gpu_seconds(self) -> None:
        return None

    def release(self) -> None:
        pass
