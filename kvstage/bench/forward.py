"""A simulated prefill forward for ``kvstage bench --prefill-ms MS``.

A source rank's forward writes its layers one after another; a streamed source sends each layer
group as soon as the layers below it are written. The simulation finishes ``layers`` layers evenly
over ``MS`` milliseconds: on a GPU one kernel per layer on the caller's stream (``torch.cuda._sleep``,
calibrated once per process), so the transfer's work really queues behind it; on a CPU a timed wait
per layer (until ``start + (i + 1) * MS / layers``, absolute, so a late layer does not push the later
ones back). After each layer the caller's ``on_layer(i + 1)`` runs (``LayerStream.written``).

``end`` is when the last layer was done, on this process's ``time.perf_counter`` clock: on a CPU when
its wait ended; on a GPU when its kernel ended, seen by a helper thread that waits on a CUDA event
recorded after it (the thread lets the caller go on queueing sends meanwhile).
"""

from __future__ import annotations

import threading
import time

#: ``torch.cuda._sleep`` cycles per millisecond of this process's GPU, measured once (``_cycles_per_ms``)
_CALIBRATED: dict[int, float] = {}


def _cycles_per_ms(device) -> float:
    """How many ``torch.cuda._sleep`` cycles one millisecond holds on ``device``: timed with CUDA
    events over a ~50 ms sleep, after one warm-up launch."""
    import torch

    index = torch.device(device).index or 0
    if index not in _CALIBRATED:
        with torch.cuda.device(index):
            cycles = 50_000_000
            torch.cuda._sleep(1000)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            stop.record()
            stop.synchronize()
            _CALIBRATED[index] = cycles / start.elapsed_time(stop)
    return _CALIBRATED[index]


class SimulatedForward:
    """One simulated prefill forward per step: ``run`` it, then read ``end``.

    ``prefill_ms`` 0 is a forward that takes no time: every ``on_layer`` call comes at once and
    ``end`` is when ``run`` began."""

    def __init__(self, layers: int, prefill_ms: float, device):
        import torch

        self.layers, self.prefill_ms = int(layers), float(prefill_ms)
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self._layer_cycles = 0
        if self.on_gpu and self.prefill_ms > 0:
            self._layer_cycles = max(1, round(_cycles_per_ms(self.device) * self.prefill_ms / self.layers))
        self._end: float | None = None
        self._waiter: threading.Thread | None = None

    def run(self, on_layer=None) -> None:
        """Run the forward's layers, calling ``on_layer(i + 1)`` once layer ``i`` is written (on a GPU:
        queued on the current stream). Returns when the last layer is queued (GPU) or done (CPU)."""
        self._end, self._waiter = None, None
        start = time.perf_counter()
        if self.prefill_ms <= 0:
            self._end = start
            for i in range(self.layers):
                if on_layer is not None:
                    on_layer(i + 1)
            return
        if self.on_gpu:
            self._run_gpu(on_layer)
            return
        per_layer_s = self.prefill_ms / 1e3 / self.layers
        for i in range(self.layers):
            deadline = start + (i + 1) * per_layer_s
            while (left := deadline - time.perf_counter()) > 0:
                time.sleep(left)
            if i == self.layers - 1:
                self._end = time.perf_counter()
            if on_layer is not None:
                on_layer(i + 1)

    def _run_gpu(self, on_layer) -> None:
        import torch

        for i in range(self.layers):
            torch.cuda._sleep(self._layer_cycles)
            if i == self.layers - 1:
                last = torch.cuda.Event()
                last.record()
                self._waiter = threading.Thread(
                    target=self._see_end, args=(last,), name="kvstage-bench-forward", daemon=True
                )
                self._waiter.start()
            if on_layer is not None:
                on_layer(i + 1)

    def _see_end(self, last) -> None:
        last.synchronize()  # torch lets the GIL go while it waits
        self._end = time.perf_counter()

    def wait(self) -> None:
        """Until the last layer is done (a CPU forward already is when ``run`` returns)."""
        if self._waiter is not None:
            self._waiter.join()
            self._waiter = None

    @property
    def end(self) -> float:
        """When the last layer was done (``time.perf_counter``); waits for it on a GPU."""
        self.wait()
        assert self._end is not None, "run() first"
        return self._end
