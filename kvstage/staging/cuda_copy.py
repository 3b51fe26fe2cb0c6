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
// One warp per run. Each warp walks its run once and, for every 16-byte word,
// moves it in all buffers of its buffer group: four independent loads are in
// flight before their stores, which hides memory latency on short runs.
// Addresses arrive as integers so the launch needs no array wrappers.
extern "C" __global__ void kvstage_copy_runs(
    const unsigned long long table_addr,   // device array: base address of each KV buffer
    const unsigned long long region_addr,
    const unsigned long long runs_addr,    // device array [4, n]: kv, reg, stride, length
    const int n, const int nbuf, const int group, const int to_region)
{
    const unsigned long long* table = (const unsigned long long*)table_addr;
    const long long* runs = (const long long*)runs_addr;
    unsigned char* region = (unsigned char*)region_addr;
    const int run = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (run >= n) return;
    const long long kvo = runs[run], rgo = runs[n + run], stride = runs[2 * n + run];
    const long long words = runs[3 * n + run] >> 4;
    const int b0 = blockIdx.y * group;
    const int b1 = min(nbuf, b0 + group);
    for (long long i = lane; i < words; i += 32) {
        for (int b = b0; b < b1; b += 4) {
            uint4 v[4];
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                if (b + k < b1) {
                    const unsigned char* kv = (const unsigned char*)table[b + k] + kvo;
                    const unsigned char* rg = region + rgo + (long long)(b + k) * stride;
                    v[k] = ((const uint4*)(to_region ? kv : rg))[i];
                }
            }
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                if (b + k < b1) {
                    unsigned char* kv = (unsigned char*)table[b + k] + kvo;
                    unsigned char* rg = region + rgo + (long long)(b + k) * stride;
                    ((uint4*)(to_region ? rg : kv))[i] = v[k];
                }
            }
        }
    }
}
"""

_WARPS_PER_BLOCK = 8
_GROUP = 16  # buffers per block row: 64 buffers (32 layers x K/V) -> 4 rows
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
        self._stream_key, self._stream = None, None
        self._uploaded: torch.cuda.Event | None = None
        import cupy

        self._cupy_device = cupy.cuda.Device(self.device.index or 0)

    def supports(self, runs: Runs, region: torch.Tensor) -> bool:
        return self.aligned and region.data_ptr() % 16 == 0 and runs.alignment() == 16

    def run(self, runs: Runs, region: torch.Tensor, to_region: bool) -> None:
        import cupy

        n = len(runs.kv)
        if n == 0:
            return
        # One pinned buffer, reused once the previous upload from it has finished.
        if self._uploaded is not None:
            self._uploaded.synchronize()
        if self._pinned is None or self._pinned.numel() < 4 * n:
            self._pinned = torch.empty(4 * max(n, 4096), dtype=torch.int64).pin_memory()
        host = self._pinned[: 4 * n].view(4, n)
        host.copy_(torch.from_numpy(np.stack([runs.kv, runs.reg, runs.stride, runs.length])))
        stream = torch.cuda.current_stream(self.device)
        dev = host.to(self.device, non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record(stream)
        group = _GROUP if self.nbuf > _GROUP else self.nbuf
        blocks = (-(-n // _WARPS_PER_BLOCK), -(-self.nbuf // group))
        if self._stream_key != stream.cuda_stream:
            self._stream_key, self._stream = stream.cuda_stream, cupy.cuda.ExternalStream(stream.cuda_stream)
        with self._cupy_device, self._stream:
            _get_kernel()(
                blocks, (32 * _WARPS_PER_BLOCK,),
                (np.uint64(self.table.data_ptr()), np.uint64(region.data_ptr()), np.uint64(dev.data_ptr()),
                 np.int32(n), np.int32(self.nbuf), np.int32(group), np.int32(int(to_region))),
            )
        dev.record_stream(stream)
