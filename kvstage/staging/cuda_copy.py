"""The CUDA gather/scatter kernel: one launch per chunk for every buffer
(layers x K/V) and every writer, 16-byte vector copies, one warp per run.

Written as CUDA C and compiled at first use with CuPy's NVRTC (RawKernel):
the copy is a pure byte move, so explicit ``uint4`` loads/stores are the
whole kernel. Per-call set-up is one pinned host buffer holding the run list,
one async upload, and one launch on the caller's current torch stream.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstage.staging.runs import Runs

_SOURCE = r"""
extern "C" __global__ void kvstage_copy_runs(
    const unsigned long long* __restrict__ table,  // base address of each KV buffer
    unsigned char* __restrict__ region,
    const long long* __restrict__ runs,            // [4, n]: kv, reg, stride, length
    const int n, const int to_region)
{
    const int run = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (run >= n) return;
    const long long b = blockIdx.y;
    unsigned char* kv = (unsigned char*)table[b] + runs[run];
    unsigned char* rg = region + runs[n + run] + b * runs[2 * n + run];
    const long long words = runs[3 * n + run] >> 4;
    const uint4* src = (const uint4*)(to_region ? kv : rg);
    uint4* dst = (uint4*)(to_region ? rg : kv);
    for (long long i = lane; i < words; i += 32) dst[i] = src[i];
}
"""

_WARPS_PER_BLOCK = 8
_kernel = None


def available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _get_kernel():
    global _kernel
    if _kernel is None:
        import cupy

        _kernel = cupy.RawKernel(_SOURCE, "kvstage_copy_runs")
    return _kernel


class RunCopier:
    """Runs a chunk's run list against one rank's cache on its CUDA device."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.device = buffers[0].device
        self.table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=self.device)
        self.nbuf = len(buffers)
        self.aligned = all(b.data_ptr() % 16 == 0 for b in buffers)
        self._pinned: torch.Tensor | None = None

    def supports(self, runs: Runs, region: torch.Tensor) -> bool:
        return self.aligned and region.data_ptr() % 16 == 0 and runs.alignment() == 16

    def run(self, runs: Runs, region: torch.Tensor, to_region: bool) -> None:
        import cupy

        n = len(runs.kv)
        if n == 0:
            return
        # The pinned buffer is reused: callers synchronize the stream after each
        # chunk before the next call (the write or the slot release waits for it).
        if self._pinned is None or self._pinned.shape[1] < n:
            self._pinned = torch.empty((4, max(n, 4096)), dtype=torch.int64).pin_memory()
        host = self._pinned[:, :n]
        host.copy_(torch.from_numpy(np.stack([runs.kv, runs.reg, runs.stride, runs.length])))
        dev = host.to(self.device, non_blocking=True)
        stream = torch.cuda.current_stream(self.device)
        blocks = (-(-n // _WARPS_PER_BLOCK), self.nbuf)
        with cupy.cuda.Device(self.device.index or 0), cupy.cuda.ExternalStream(stream.cuda_stream):
            _get_kernel()(
                blocks, (32 * _WARPS_PER_BLOCK,),
                (cupy.asarray(self.table), cupy.asarray(region), cupy.asarray(dev), np.int32(n), np.int32(int(to_region))),
            )
        dev.record_stream(stream)
