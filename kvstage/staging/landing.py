"""Landing words: a piece's scatter queued on the GPU before its bytes land.

A destination whose writers gather straight into its arena (mapped) keeps a
small array of 32-bit words in the same device allocation, shared with them.
Each grant to such a writer names a word and a value. Right after its gather
the writer's stream sets that word to that value (a stream memory write,
ordered after the kernel's stores by its own fence); the destination has
already queued, on a stream kept for that writer (one of eight, all made
before any wait), a wait for the value and the piece's scatter behind it. The
scatter then starts on the GPU the moment the gather ends: no message, no host
hop and no kernel launch on the critical path.
The ``landed`` message still comes and is still checked; it releases the word
too, so no wait outlives it, and a failing request releases its words before
it waits for its scatters (those then copy whatever the slot holds into the
failed request's own pages).

Waits compare for equality: a slot's word serves every grant of that slot in
turn, and a late write of an older grant's value must not release a newer wait.
While a wait is queued, whatever synchronizes the whole device in this process
waits for it too: ``torch.cuda.synchronize()`` and ``cudaFree`` by definition;
the first ``torch.cuda.Stream()`` of a process (its pool being created) was
seen blocking on one (H200, CUDA 13); loading a kernel under CUDA's lazy
loading may synchronize too (not isolated here). A piece is therefore
queued only once its writer has announced the request (its bytes are then on
their way), never for early grants to a prefill still running, and its kernel
is loaded before the wait is queued. A thread that holds the GIL in such a call
while a dead writer's wait is queued would keep the loop from releasing it:
this is why the setting (``prearm``) is off by default.
"""

from __future__ import annotations

import ctypes

import torch

from kvstage.cudart import driver, driver_error, runtime
from kvstage.staging.cuda_copy import raw_stream
from kvstage.staging.fence import CopyFence

WORD_BYTES = 4
WORDS_PER_SLOT = 64  # a slot's writers past the 64th are not armed (their scatters launch on ``landed``)
STREAMS = 8  # writers' queued scatters go on stream ``writer % STREAMS``, all created before any wait
_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write


def supported() -> str | None:
    """None when the driver has the stream memory operations, else why not."""
    try:
        drv = driver()
    except OSError as e:
        return str(e)
    missing = [n for n in ("cuStreamWaitValue32", "cuStreamWriteValue32") if not hasattr(drv, "kvstage_" + n)]
    return f"the CUDA driver has no {', '.join(missing)}" if missing else None


def signal(device: torch.device, addr: int, value: int) -> None:
    """Set the word at device address ``addr`` to ``value`` once the work queued so far on the
    current torch stream of ``device`` is done (the writer's side, after its gather)."""
    err = driver().kvstage_cuStreamWriteValue32(raw_stream(device), addr, value, _WRITE_DEFAULT)
    if err:
        raise RuntimeError(f"cuStreamWriteValue32 at {addr:#x} failed: {driver_error(err)}")


def _own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A non-blocking stream of this module's own. Not ``torch.cuda.Stream()``: that hands
    out streams round robin from a pool of 32 per device shared by all code in the process,
    so an engine's work could land on a stream parked behind a wait here."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        err = runtime().cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(1))  # cudaStreamNonBlocking
    if err:
        raise RuntimeError(f"cudaStreamCreateWithFlags on {device} failed with CUDA error {err}")
    return torch.cuda.ExternalStream(handle.value, device=device)


class LandingWords:
    """The destination's words (an int32 device tensor, zeroed) and a value counter per word."""

    def __init__(self, words: torch.Tensor):
        self.words = words
        self.count = words.numel()
        self.device = words.device
        self._last = [0] * self.count
        # created now, while nothing waits: creating a stream behind a queued wait may block on it
        self._streams = [_own_stream(self.device) for _ in range(STREAMS)]
        self._release = _own_stream(self.device)

    def addr(self, index: int) -> int:
        return self.words.data_ptr() + WORD_BYTES * index

    def next_value(self, index: int) -> int:
        """A value word ``index`` has not held since it was zeroed (1 .. 2**32-1, then around again)."""
        v = self._last[index] % 0xFFFFFFFF + 1
        self._last[index] = v
        return v

    def arm(self, writer: int, index: int, value: int, launch) -> CopyFence:
        """Queue ``launch`` (a prepared scatter) behind a wait for word ``index`` to equal
        ``value``, on writer rank ``writer``'s stream (shared past ``STREAMS`` writers); the
        fence ends after it. Work queued before on the caller's stream (the scatter's uploads)
        comes first."""
        stream = self._streams[writer % STREAMS]
        load = getattr(launch, "load", None)
        if load is not None:  # never load a module behind a queued wait (it may synchronize the device)
            load()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            err = driver().kvstage_cuStreamWaitValue32(stream.cuda_stream, self.addr(index), value, _WAIT_EQ)
            if err:
                raise RuntimeError(f"cuStreamWaitValue32 on {self.device} failed: {driver_error(err)}")
            fence = CopyFence(self.device)  # started after the wait: its time is the scatter's own
            launch()
            return fence.close()

    def release(self, index: int, value: int) -> None:
        """Set word ``index`` to ``value`` from this side (its writer said it landed, or its
        request failed): the armed wait passes whatever the writer did."""
        err = driver().kvstage_cuStreamWriteValue32(self._release.cuda_stream, self.addr(index), value, _WRITE_DEFAULT)
        if err:
            raise RuntimeError(f"cuStreamWriteValue32 on {self.device} failed: {driver_error(err)}")

    def close(self) -> None:
        """Give the streams back (their queued work, if any, still runs to its end)."""
        for stream in [*self._streams, self._release]:
            runtime().cudaStreamDestroy(ctypes.c_void_p(stream.cuda_stream))
        self._streams = []
