"""The CUDA gather/scatter kernel: one launch per chunk covers every (layer,
plane) buffer and every writer's piece, with 16-byte vector loads and stores.

Each thread finds its word's token, head and page from its index and the
chunk's page ids (``words.word_index`` is the same arithmetic in numpy), so
per-call set-up is one small upload (piece descriptors and page ids, from a
ring of pinned buffers) and one launch on the caller's torch stream, with no
host synchronization. Compiled at first use with CuPy's NVRTC (RawKernel):
the copy is a pure byte move, so explicit ``uint4`` loads and stores are the
whole kernel. The region may be device memory or pinned host memory (mapped
into the GPU's address space: the pinned-host arena).
"""

from __future__ import annotations

import numpy as np
import torch

from kvstage.staging.words import WordGeometry

_UNROLL = 4
_THREADS = 256

_SOURCE = r"""
// grid: x = words of the largest piece / (THREADS * UNROLL), y = buffer, z = piece.
// meta (device, int64): npieces x (head_lo, heads, region byte offset), then the chunk's page ids.
// Index arithmetic is 32-bit (the host checks a piece's words fit); only the final
// word offset inside a buffer is 64-bit.
extern "C" __global__ void kvstage_copy_words(
    const unsigned long long table_addr, const unsigned long long region_addr,
    const unsigned long long meta_addr, const int npieces, const unsigned int count, const unsigned int first,
    const unsigned int page_size, const unsigned int nheads, const unsigned int head_words, const int hnd,
    const int to_region)
{
    const unsigned long long* table = (const unsigned long long*)table_addr;
    const long long* meta = (const long long*)meta_addr;
    const long long* pages = meta + 3 * npieces;
    const int p = blockIdx.z, b = blockIdx.y;
    const unsigned int head_lo = (unsigned int)meta[3 * p], heads = (unsigned int)meta[3 * p + 1];
    const long long base = meta[3 * p + 2];
    const unsigned int per_token = heads * head_words;
    const unsigned int words = count * per_token;
    uint4* kv = (uint4*)table[b];
    uint4* rg = (uint4*)(region_addr + base) + (unsigned long long)b * words;
    const unsigned int i0 = blockIdx.x * (THREADS * UNROLL) + threadIdx.x;
    uint4 v[UNROLL];
    long long at[UNROLL];
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        const unsigned int i = i0 + k * THREADS;
        at[k] = -1;
        if (i < words) {
            const unsigned int t = i / per_token, r = i - t * per_token;
            const unsigned int j = r / head_words, w = r - j * head_words;
            const unsigned int u = first + t;
            const unsigned int q = u / page_size, off = u - q * page_size;
            const long long page = pages[q];
            const unsigned int h = head_lo + j;
            at[k] = hnd ? ((page * nheads + h) * page_size + off) * head_words + w
                        : ((page * page_size + off) * nheads + h) * head_words + w;
            v[k] = to_region ? kv[at[k]] : rg[i];
        }
    }
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        if (at[k] >= 0) {
            if (to_region) rg[i0 + k * THREADS] = v[k];
            else kv[at[k]] = v[k];
        }
    }
}
"""

_kernel = None
_RING = 4  # pinned upload buffers in flight per copier


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

        opts = (f"-DTHREADS={_THREADS}", f"-DUNROLL={_UNROLL}")
        _kernel = cupy.RawKernel(_SOURCE, "kvstage_copy_words", options=opts)
    return _kernel


class WordCopier:
    """Runs chunk copies between one rank's CUDA cache and a region (device or pinned host)."""

    def __init__(self, spec, buffers: list[torch.Tensor]):
        self.device = buffers[0].device
        self.geometry = WordGeometry.of(spec, 16)
        self.table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=self.device)
        self.nbuf = len(buffers)
        self.aligned = all(b.data_ptr() % 16 == 0 for b in buffers)
        self._ring = [_Upload() for _ in range(_RING)]
        self._next = 0
        self._stream_key, self._stream = None, None
        g = self.geometry
        self._table = np.uint64(self.table.data_ptr())
        self._fixed = None if g is None else (np.uint32(g.page_size), np.uint32(g.heads), np.uint32(g.head_words),
                                              np.int32(int(g.hnd)))
        import cupy

        self._cupy_device = cupy.cuda.Device(self.device.index or 0)

    def supports(self, region: torch.Tensor, pieces, count: int) -> bool:
        """16-byte words everywhere, a region the GPU can reach, and 32-bit word indices."""
        reachable = region.is_cuda or region.is_pinned()
        g = self.geometry
        return (g is not None and self.aligned and reachable and region.data_ptr() % 16 == 0
                and all(base % 16 == 0 for _, _, base in pieces)
                and count * max(n for _, n, _ in pieces) * g.head_words < 2**31)

    def run(self, pages: np.ndarray, first: int, count: int, pieces, region: torch.Tensor, to_region: bool) -> None:
        """Copy tokens ``first .. first+count`` of ``pages`` for every ``(head_lo, heads, base)`` piece."""
        import cupy

        meta = np.concatenate([np.asarray(pieces, dtype=np.int64).reshape(-1), pages.astype(np.int64, copy=False)])
        stream = torch.cuda.current_stream(self.device)
        up = self._ring[self._next]
        self._next = (self._next + 1) % _RING
        dev = up.load(meta, self.device)
        most = max(n for _, n, _ in pieces) * count * self.geometry.head_words
        grid = (-(-most // (_THREADS * _UNROLL)), self.nbuf, len(pieces))
        if self._stream_key != stream.cuda_stream:
            self._stream_key, self._stream = stream.cuda_stream, cupy.cuda.ExternalStream(stream.cuda_stream)
        with self._cupy_device, self._stream:
            _get_kernel()(
                grid, (_THREADS,),
                (self._table, np.uint64(region.data_ptr()), np.uint64(dev.data_ptr()),
                 np.int32(len(pieces)), np.uint32(count), np.uint32(first), *self._fixed, np.int32(int(to_region))),
            )
        up.used.record(stream)


class _Upload:
    """One slot of the upload ring: a pinned host buffer, its device twin, and an
    event after the kernel that read it. A slot is refilled only once that kernel
    is done (with four slots, in practice never a wait); nothing is allocated per call."""

    def __init__(self):
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.used = torch.cuda.Event()
        self._recorded = False

    def load(self, meta: np.ndarray, device: torch.device) -> torch.Tensor:
        n = len(meta)
        if self._recorded:
            self.used.synchronize()
        self._recorded = True  # the caller records ``used`` after its launch
        if self.host is None or self.host.numel() < n:
            size = max(n, 4096)
            self.host = torch.empty(size, dtype=torch.int64).pin_memory()
            self.dev = torch.empty(size, dtype=torch.int64, device=device)
        self.host.numpy()[:n] = meta
        dev = self.dev[:n]
        dev.copy_(self.host[:n], non_blocking=True)
        return dev
