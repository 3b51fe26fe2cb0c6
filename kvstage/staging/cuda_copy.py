"""The CUDA gather/scatter kernel: one launch per chunk covers every piece of a
region (``staging.region``) and every (layer, plane) buffer of each piece, with
16-byte vector loads and stores.

Each thread finds its word's token, head and page from its index, its piece's
row of the piece table and the chunk's page ids (``words.word_index`` is the
same arithmetic in numpy). A request's page ids are uploaded once, when the
request is posted (``upload_pages``), or, for a request on at most
``INLINE_PAGES`` pages, passed in each launch's own parameters (a second entry
point of the same kernel), so a small request's path has no upload at all; a
piece table is uploaded once per distinct piece list. A chunk's copy is then
one launch on the caller's torch stream with no upload and no host
synchronization; ``prepare`` builds that launch ahead of time (the destination
does it at grant time, before the chunk's bytes land).
Compiled at first use with CuPy's NVRTC (RawModule, both entry points): the copy is a pure byte
move, so explicit ``uint4`` loads and stores are the whole kernel. Launched
with the driver's ``cuLaunchKernel`` on arguments packed once per prepared
copy (a copy launched at once, a source's gather, fills its thread's own
argument block instead): CuPy's own call converts every argument and enters
a device and a stream context each time, which is most of a small chunk's
copy. The region may be device memory or pinned host memory (mapped into the
GPU's address space: the pinned-host arena). ``staging.copier_cuda`` is the
copier built on it. ``DeviceKernels`` (the loading, the launch, the upload
ring) also runs the direct page-write kernel (``cuda_place``).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch

from kvstage.cudart import driver, driver_error
from kvstage.staging.words import WordGeometry, piece_table

_UNROLL = 4
_THREADS = 256
#: a chunk on at most this many pages passes its page ids in the launch's own parameters (2 KiB of
#: the 4 KiB a launch may pass): no upload on its path (a 128-token request at page size 1 fits)
INLINE_PAGES = 256
#: the kernel's ``to_region`` for a sum with no copy (1 is a gather, 0 a scatter): the cache's words are
#: read and summed, no region is touched (the ipc, direct and pages paths' checksums, ``Copier.sum_cache``)
SUM_ONLY = 2

#: the chunk checksum on the device (``staging.checksum``), shared by this kernel and ``cuda_ipc``'s
CHECKSUM_SOURCE = r"""
#define CHECKSUM_MULTIPLIER 0x9E3779B1u
#define CHECKSUM_INCREMENT 0x7F4A7C15u

// staging.checksum's term of the four 32-bit words of 16-byte word p16 of a segment
__device__ __forceinline__ unsigned int checksum_terms(const uint4 v, const unsigned int p16)
{
    unsigned int key = 4u * p16 * CHECKSUM_MULTIPLIER + CHECKSUM_INCREMENT;
    unsigned int s = (v.x ^ key) * (key | 1u);
    key += CHECKSUM_MULTIPLIER;
    s += (v.y ^ key) * (key | 1u);
    key += CHECKSUM_MULTIPLIER;
    s += (v.z ^ key) * (key | 1u);
    key += CHECKSUM_MULTIPLIER;
    return s + (v.w ^ key) * (key | 1u);
}

// add one word's term to its segment's sum (segment -1: this thread has no word)
__device__ __forceinline__ void checksum_add(unsigned int* sums, const int segment, unsigned int term)
{
#ifdef __CUDA_ARCH__
    const unsigned int all = 0xffffffffu;
    if (!__any_sync(all, segment >= 0))
        return;
    const int first = __shfl_sync(all, segment, 0);  // lane 0 has a word when any lane has one
    if (__all_sync(all, segment == first || segment < 0)) {
        for (int d = 16; d > 0; d >>= 1)
            term += __shfl_down_sync(all, term, d);
        if ((threadIdx.x & 31) == 0)
            atomicAdd(sums + first, term);
    } else if (segment >= 0) {
        atomicAdd(sums + segment, term);
    }
#else
    if (segment >= 0)
        atomicAdd(sums + segment, term);
#endif
}
// add a block's words' terms (``total``: this thread's) to one sum: one atomic per block. Every thread
// of the block calls it.
__device__ __forceinline__ void checksum_block_add(unsigned int* sum, unsigned int total)
{
#ifdef __CUDA_ARCH__
    __shared__ unsigned int warp_totals[THREADS / 32];
    for (int d = 16; d > 0; d >>= 1)
        total += __shfl_down_sync(0xffffffffu, total, d);
    if ((threadIdx.x & 31) == 0)
        warp_totals[threadIdx.x >> 5] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int block_total = 0;
        for (int w = 0; w < THREADS / 32; w++)
            block_total += warp_totals[w];
        atomicAdd(sum, block_total);
    }
#else
    atomicAdd(sum, total);
#endif
}
"""

_SOURCE = (
    r"""
// grid: x = words of one buffer of the largest piece / (THREADS * UNROLL), y = buffer of a piece (as many as
// the piece with the most; a block past its own piece's buffers returns), z = piece.
// meta (device, int64): npieces x META (head_lo, heads, buffer_lo, nbuffers, order, rows, row_first, offset,
// first checksum segment);
// order 0: the piece's bytes are [heads][buffers][rows][head_words], 1: [buffers][rows][heads][head_words];
// rows 0: the chunk's count. pages: the chunk's page ids, in device memory (kvstage_copy_words) or in the
// launch's own parameters (kvstage_copy_words_inline). to_region: 1 a gather, 0 a scatter, 2 a sum with no copy
// (the cache is read and summed into sums; the region is neither read nor written).
// sums: 0, or one uint32 per checksum segment of every piece (staging.checksum: a segment is a (head,
// buffer) of order 0, a buffer of order 1), zeroed before the launch; each word's term is added to its
// segment's sum, one atomic per block where the block's words share a segment, else per warp.
// Index arithmetic is 32-bit (the host checks a piece's words fit); only the final
// word offset inside a buffer is 64-bit.
#define META 9
"""
    + CHECKSUM_SOURCE
    + r"""
struct PageIds { long long id[INLINE]; };

__device__ __forceinline__ void copy_words(
    const unsigned long long table_addr, const unsigned long long region_addr,
    const unsigned long long meta_addr, const long long* pages,
    const unsigned int count, const unsigned int first,
    const unsigned int page_size, const unsigned int nheads, const unsigned int head_words, const int hnd,
    const int to_region, const unsigned long long sums_addr)
{
    const unsigned long long* table = (const unsigned long long*)table_addr;
    const long long* meta = (const long long*)meta_addr + META * blockIdx.z;
    const unsigned int bi = blockIdx.y, nbuffers = (unsigned int)meta[3];
    if (bi >= nbuffers)
        return;
    const unsigned int head_lo = (unsigned int)meta[0], heads = (unsigned int)meta[1];
    const unsigned int by_token = (unsigned int)meta[4];
    const unsigned int rows = meta[5] ? (unsigned int)meta[5] : count, row_first = (unsigned int)meta[6];
    const unsigned int per_head = count * head_words, per_token = heads * head_words;
    const unsigned int words = count * per_token;
    uint4* kv = (uint4*)table[meta[2] + bi];
    uint4* rg = (uint4*)(region_addr + (unsigned long long)meta[7]);
    const unsigned int i0 = blockIdx.x * (THREADS * UNROLL) + threadIdx.x;
    uint4 v[UNROLL];
    long long at[UNROLL];
    unsigned int in_region[UNROLL];
    int segment[UNROLL];
    unsigned int p16[UNROLL];
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        const unsigned int i = i0 + k * THREADS;
        at[k] = -1;
        if (i < words) {
            unsigned int t, j, w;
            if (by_token) {  // i walks [count][heads][words]
                t = i / per_token;
                const unsigned int r = i - t * per_token;
                j = r / head_words;
                w = r - j * head_words;
                in_region[k] = ((bi * rows + row_first + t) * heads + j) * head_words + w;
                segment[k] = bi;
                p16[k] = ((row_first + t) * heads + j) * head_words + w;
            } else {  // i walks [heads][count][words]: the region's rows in order
                j = i / per_head;
                const unsigned int r = i - j * per_head;
                t = r / head_words;
                w = r - t * head_words;
                in_region[k] = ((j * nbuffers + bi) * rows + row_first + t) * head_words + w;
                segment[k] = j * nbuffers + bi;
                p16[k] = (row_first + t) * head_words + w;
            }
            const unsigned int u = first + t;
            const unsigned int q = u / page_size, off = u - q * page_size;
            const long long page = pages[q];
            const unsigned int h = head_lo + j;
            at[k] = hnd ? ((page * nheads + h) * page_size + off) * head_words + w
                        : ((page * page_size + off) * nheads + h) * head_words + w;
            v[k] = to_region ? kv[at[k]] : rg[in_region[k]];
        }
    }
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        if (at[k] >= 0) {
            if (to_region == 1) rg[in_region[k]] = v[k];
            else if (to_region == 0) kv[at[k]] = v[k];
        }
    }
    if (sums_addr) {
        unsigned int* sums = (unsigned int*)sums_addr + (unsigned int)meta[8];
        unsigned int term[UNROLL];
        int own = -1, mixed = 0;  // the segment of all this thread's words, or mixed
        unsigned int total = 0;
        #pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            term[k] = at[k] >= 0 ? checksum_terms(v[k], p16[k]) : 0u;
            if (at[k] >= 0) {
                mixed |= own >= 0 && own != segment[k];
                own = own < 0 ? segment[k] : own;
                total += term[k];
            }
        }
#ifdef __CUDA_ARCH__
        // most blocks lie in one segment (always in order 1: a block is one buffer of a piece): one atomic
        // per block then, as one per warp would queue every block of a buffer on one address
        __shared__ int block_segment;
        if (threadIdx.x == 0)
            block_segment = own;  // -1: thread 0 has no word, so no thread of the block has one
        __syncthreads();
        const int first = block_segment;
        if (first < 0)
            return;
        if (__syncthreads_and(!mixed && (own < 0 || own == first))) {
            checksum_block_add(sums + first, total);
            return;
        }
#endif
        #pragma unroll
        for (int k = 0; k < UNROLL; k++)
            checksum_add(sums, at[k] >= 0 ? segment[k] : -1, term[k]);
    }
}

extern "C" __global__ void kvstage_copy_words(
    const unsigned long long table_addr, const unsigned long long region_addr,
    const unsigned long long meta_addr, const unsigned long long pages_addr,
    const unsigned int count, const unsigned int first,
    const unsigned int page_size, const unsigned int nheads, const unsigned int head_words, const int hnd,
    const int to_region, const unsigned long long sums_addr)
{
    copy_words(table_addr, region_addr, meta_addr, (const long long*)pages_addr, count, first, page_size, nheads,
               head_words, hnd, to_region, sums_addr);
}

// __grid_constant__: the ids are read where the launch put them (the constant bank), not copied per thread
extern "C" __global__ void kvstage_copy_words_inline(
    const unsigned long long table_addr, const unsigned long long region_addr,
    const unsigned long long meta_addr, const __grid_constant__ PageIds pages,
    const unsigned int count, const unsigned int first,
    const unsigned int page_size, const unsigned int nheads, const unsigned int head_words, const int hnd,
    const int to_region, const unsigned long long sums_addr)
{
    copy_words(table_addr, region_addr, meta_addr, pages.id, count, first, page_size, nheads, head_words, hnd,
               to_region, sums_addr);
}
"""
)


_PARAMS = [
    ("table_addr", ctypes.c_uint64),
    ("region_addr", ctypes.c_uint64),
    ("meta_addr", ctypes.c_uint64),
    ("pages_addr", ctypes.c_uint64),
    ("count", ctypes.c_uint32),
    ("first", ctypes.c_uint32),
    ("page_size", ctypes.c_uint32),
    ("nheads", ctypes.c_uint32),
    ("head_words", ctypes.c_uint32),
    ("hnd", ctypes.c_int32),
    ("to_region", ctypes.c_int32),
    ("sums_addr", ctypes.c_uint64),
]


class _KernelArgs(ctypes.Structure):
    """Both kernels' parameters in order, and the inline kernel's page ids (its fourth
    parameter in place of ``pages_addr``); ``cuLaunchKernel`` reads each through a pointer."""

    _fields_ = [*_PARAMS, ("page_ids", ctypes.c_int64 * INLINE_PAGES)]


_ARG_OFFSETS = tuple(getattr(_KernelArgs, name).offset for name, _ in _PARAMS)
_INLINE_OFFSETS = tuple(
    _KernelArgs.page_ids.offset if name == "pages_addr" else o
    for (name, _), o in zip(_PARAMS, _ARG_OFFSETS, strict=True)
)


class _ArgBlock:
    """One launch's argument storage: the packed parameters, ``cuLaunchKernel``'s pointer
    array for each kernel, and the inline page ids as numpy (filled without a Python loop).
    Any kernel pair of this shape (a pointer entry point and an inline one reading its ids
    from a ``page_ids`` field) can use it with its own structure and offsets."""

    def __init__(self, args_type=None, offsets=_ARG_OFFSETS, inline_offsets=_INLINE_OFFSETS):
        self.args = (args_type or _KernelArgs)()
        at = ctypes.addressof(self.args)
        pointers = ctypes.c_void_p * len(offsets)
        self.pointers = pointers(*(at + o for o in offsets))
        self.inline_pointers = pointers(*(at + o for o in inline_offsets))
        self.ids = np.frombuffer(self.args.page_ids, dtype=np.int64)


_modules: dict = {}  # kernel source -> its CuPy RawModule, compiled at first use
_RING = 4  # pinned upload buffers in flight per copier
_PIECE_TABLES = 64  # distinct piece lists kept on the device per copier
_EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING
_GRID_YZ = 65535  # the most blocks a launch's grid takes in y and in z


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def raw_stream(device: torch.device) -> int:
    """The handle of the caller's current torch stream on ``device``: torch's raw
    getter where it has one (a pointer, no Stream object built per launch)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(_index(device))
    return torch.cuda.current_stream(device).cuda_stream


_DEFAULT_STREAMS: dict = {}  # CUDA device index -> its default torch stream, built once


def default_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's default torch stream: where every endpoint copy goes (``copy.copy_stream``)."""
    index = _index(device)
    stream = _DEFAULT_STREAMS.get(index)
    if stream is None:
        stream = _DEFAULT_STREAMS[index] = torch.cuda.default_stream(index)
    return stream


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The caller's current torch stream on ``device``. When that is the default stream
    (an endpoint's copies always are), the one built once: ``torch.cuda.current_stream``
    builds a new Stream object per call, two of them per fenced copy."""
    stream = default_stream(device)
    return stream if raw_stream(device) == stream.cuda_stream else torch.cuda.current_stream(device)


def available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


#: the compile options the kernel source needs (its block shape and the inline ids' capacity)
OPTIONS = (f"-DTHREADS={_THREADS}", f"-DUNROLL={_UNROLL}", f"-DINLINE={INLINE_PAGES}")


def compiled(source: str, options: tuple = OPTIONS):
    """``source`` as a CuPy RawModule, built once per process (NVRTC, or CuPy's disk cache)."""
    module = _modules.get(source)
    if module is None:
        import cupy

        module = _modules[source] = cupy.RawModule(code=source, options=options)
    return module


class DeviceKernels:
    """The kernels of one source, loaded in a device's primary context and launched with the
    driver's ``cuLaunchKernel`` on the caller's torch stream; their small inputs (page ids,
    piece tables) go up through a ring of pinned buffers. A subclass names its entry points
    (``ENTRIES``: key -> kernel name), its source (``SOURCE``) and what its launch errors call
    it (``WHAT``)."""

    SOURCE = ""
    ENTRIES: dict = {}
    WHAT = "kernel"

    def __init__(self, device: torch.device):
        self.device = device
        self._ring = [_Upload() for _ in range(_RING)]
        self._next = 0
        # the kernels' CUfunctions and their context, at the first launch
        self._functions: Any = None
        self._context: int | None = None

    def _module(self):
        return compiled(self.SOURCE)

    def _launch(self, function: str, grid, params) -> None:
        """The kernel ``function`` (a key of ``ENTRIES``) on the caller's current torch stream."""
        self.load()  # its functions and the bound driver calls exist from here on
        err = self._in_context(
            self._launch_kernel,
            self._functions[function],
            grid[0],
            grid[1],
            grid[2],
            _THREADS,
            1,
            1,
            0,
            raw_stream(self.device),
            params,
            None,
        )
        if err:
            raise RuntimeError(f"{self.WHAT} kernel launch on {self.device} failed: {driver_error(err)}")

    def _in_context(self, call, *args):
        """``call(*args)`` (a driver call) in this device's context: made current for the
        call if the thread's is another, then restored. The caller has called ``load``."""
        current = ctypes.c_void_p()
        self._get_context(ctypes.byref(current))
        switch = current.value != self._context
        if switch:
            self._set_context(self._context)
        try:
            return call(*args)
        finally:
            if switch and current.value:
                self._set_context(current.value)

    def load(self) -> None:
        """Compile (or take from CuPy's cache) the kernels for this device, loaded in the
        device's primary context: torch's and CuPy's, made current here if no context is.
        Once; every launch calls it."""
        if self._functions is not None:
            return
        import cupy

        drv = driver()
        index = _index(self.device)
        dev, context, before = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        err = drv.cuDeviceGet(ctypes.byref(dev), index) or drv.cuDevicePrimaryCtxRetain(ctypes.byref(context), dev)
        if err:
            raise RuntimeError(f"no primary CUDA context for {self.device}: {driver_error(err)}")
        drv.cuCtxGetCurrent(ctypes.byref(before))
        drv.cuCtxSetCurrent(context)
        try:
            with cupy.cuda.Device(index):
                module = self._module()
                functions = {key: module.get_function(name).kernel.ptr for key, name in self.ENTRIES.items()}
        finally:
            if before.value and before.value != context.value:
                drv.cuCtxSetCurrent(before)
        # bound once: the launch is on every chunk's critical path
        self._get_context, self._set_context = drv.cuCtxGetCurrent, drv.cuCtxSetCurrent
        self._launch_kernel = drv.cuLaunchKernel
        self._functions, self._context = functions, context.value

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """``values`` on the device, through the next pinned buffer of the ring, copied on
        the caller's current stream. Driver calls, not torch's: torch's stream object,
        ``copy_`` and event record were about half of a request's upload."""
        up = self._ring[self._next]
        self._next = (self._next + 1) % _RING
        dev = torch.empty(len(values), dtype=torch.int64, device=self.device)
        self.load()
        err = self._in_context(up.load, values, dev.data_ptr(), raw_stream(self.device))
        if err:
            raise RuntimeError(f"page id upload to {self.device} failed: {driver_error(err)}")
        return dev


class WordCopier(DeviceKernels):
    """Runs chunk copies between one rank's CUDA cache and a region (device or pinned host)."""

    SOURCE = _SOURCE
    ENTRIES = {"pointer": "kvstage_copy_words", "inline": "kvstage_copy_words_inline"}
    WHAT = "gather/scatter"

    def __init__(self, spec, buffers: list[torch.Tensor]):
        super().__init__(buffers[0].device)
        # None: heads are not whole 16-byte words, and ``supports`` sends every call the torch way
        self.geometry = WordGeometry.of(spec, 16)
        self.table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=self.device)
        self._table_addr = self.table.data_ptr()
        self._blocks = threading.local()  # each launching thread's argument block (``launch``)
        self.nbuf = len(buffers)
        self.aligned = all(b.data_ptr() % 16 == 0 for b in buffers)
        self._pieces: dict = {}
        g = self.geometry
        self._fixed = (g.page_size, g.heads, g.head_words, int(g.hnd)) if g is not None else (0, 0, 0, 0)

    def supports(self, region: torch.Tensor | None, pieces, count: int) -> bool:
        """16-byte words everywhere, a region the GPU can reach, a grid the device takes, and
        32-bit word indices: every piece's words in the region (its whole rows) fit."""
        g = self.geometry
        if g is None or not self.aligned or not pieces or count < 1:
            return False
        reachable = region is None or region.is_cuda or region.is_pinned()  # None: a sum, no region
        return (
            reachable
            and (region is None or region.data_ptr() % 16 == 0)
            and len(pieces) <= _GRID_YZ
            and all(
                p.offset % 16 == 0
                and len(p.buffers) <= _GRID_YZ
                and p.heads * len(p.buffers) * p.row_tokens(count) * g.head_words < 2**31
                for p in pieces
            )
        )

    def upload_pages(self, page_ids: np.ndarray) -> torch.Tensor | np.ndarray:
        """A request's page ids where its copies read them: on the device, copied on the
        caller's stream (so before any copy launched after it there); a request on at most
        ``INLINE_PAGES`` pages keeps a copy of them on the host (int64 numpy), and each of its
        copies passes its chunk's ids in the launch itself, so nothing is uploaded."""
        ids = np.array(page_ids, dtype=np.int64)
        return ids if len(ids) <= INLINE_PAGES else self._upload(ids)

    def prepare(self, pages, first: int, count: int, pieces, region, to_region: int, page_offset=0, sums_addr=0):
        """The launch copying tokens ``first .. first+count`` of the chunk's pages for every
        piece (``region.RegionPiece``, checked, and ``supports``); nothing runs until it is
        called. ``pages``: the chunk's page ids on the host (passed in the launch, or uploaded
        now past ``INLINE_PAGES``), or a request's from ``upload_pages`` with the chunk's first
        page at ``page_offset``. ``sums_addr``: zeroed device sums (``checksum.on_device``) the copy
        adds each piece's checksum terms into, or 0."""
        block = _ArgBlock()
        function, grid, params, keep = self._fill(
            block, pages, first, count, pieces, region, to_region, page_offset, sums_addr
        )
        return PreparedCopy(self, function, grid, params, (*keep, block))

    def launch(self, pages, first: int, count: int, pieces, region, to_region: int, page_offset=0, sums_addr=0):
        """``prepare(...)()`` for a copy launched at once (a source's gather): the arguments
        go in this thread's own block, which ``cuLaunchKernel`` copies when called, so no
        argument block or ``PreparedCopy`` is built per chunk. The tensors it reads need
        no keeping: an upload made here is freed into torch's pool for this stream,
        reused only by work queued after the kernel."""
        block = getattr(self._blocks, "block", None)
        if block is None:
            block = self._blocks.block = _ArgBlock()
        self._launch(*self._fill(block, pages, first, count, pieces, region, to_region, page_offset, sums_addr)[:3])

    def device_table(self, pieces) -> torch.Tensor:
        """The pieces' rows of the kernel's table on the device, uploaded once per distinct
        piece list (a request's chunks share their pieces)."""
        key = tuple(pieces)
        meta = self._pieces.get(key)
        if meta is None:
            meta = self._upload(piece_table(key))
            if len(self._pieces) >= _PIECE_TABLES:
                self._pieces.pop(next(iter(self._pieces)))
            self._pieces[key] = meta
        return meta

    def _fill(self, block: _ArgBlock, pages, first, count, pieces, region, to_region, page_offset, sums_addr=0):
        """Write one copy's arguments into ``block``: the kernel to launch, its grid, its
        parameter array and the tensors it reads."""
        args = block.args
        g = self.geometry
        assert g is not None  # ``supports``: a call of heads not whole words never reaches the kernel
        inline = False
        if not isinstance(pages, torch.Tensor):  # ids on the host: in the launch if they fit
            need = (first + count - 1) // g.page_size + 1
            ids = np.asarray(pages[page_offset : page_offset + need], dtype=np.int64)
            page_offset = 0
            inline = need <= INLINE_PAGES
            if inline:
                block.ids[:need] = ids
            else:
                pages = self._upload(ids)
        meta = self.device_table(pieces)
        region_addr = 0 if region is None else region.data_ptr()  # None: SUM_ONLY reads no region
        args.table_addr, args.meta_addr, args.region_addr = self._table_addr, meta.data_ptr(), region_addr
        args.pages_addr = 0 if inline else pages.data_ptr() + 8 * page_offset
        args.count, args.first, args.to_region, args.sums_addr = count, first, int(to_region), sums_addr
        args.page_size, args.nheads, args.head_words, args.hnd = self._fixed
        grid = launch_grid(pieces, count, g.head_words)
        if inline:
            return "inline", grid, block.inline_pointers, (None, meta, region)
        return "pointer", grid, block.pointers, (pages, meta, region)


def launch_grid(pieces, count: int, head_words: int) -> tuple[int, int, int]:
    """The blocks of one launch copying ``count`` tokens of ``pieces``: x covers one buffer of
    the piece with the most heads, y the most buffers of a piece, z the pieces."""
    most = max(p.heads for p in pieces) * count * head_words
    return -(-most // (_THREADS * _UNROLL)), max(len(p.buffers) for p in pieces), len(pieces)


class PreparedCopy:
    """One chunk's copy, ready to launch: calling it launches the kernel on the
    current stream. Holds the tensors and the packed arguments its parameters point into."""

    def __init__(self, copier: DeviceKernels, function: str, grid, params, keep):
        self._copier, self._function, self._grid, self._params, self._keep = copier, function, grid, params, keep

    def __call__(self) -> None:
        self._copier._launch(self._function, self._grid, self._params)


class _Upload:
    """One slot of the upload ring: a pinned host buffer and an event after the
    copy that read it. A slot is refilled only once that copy is done (with four
    slots, in practice never a wait); pinned memory is allocated only to grow.
    ``load`` runs in the copier's context (the event is made there at first use)."""

    def __init__(self):
        self.host: torch.Tensor | None = None
        self._view: np.ndarray | None = None  # the pinned buffer as numpy, made once per buffer
        self._event: Any = None  # CUevent
        self._recorded = False

    def load(self, values: np.ndarray, dst: int, stream: int) -> int:
        """Copy ``values`` to device address ``dst`` on ``stream``; the driver's result code."""
        drv = driver()
        n = len(values)
        if self._event is None:
            event = ctypes.c_void_p()
            err = drv.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING)
            if err:
                return err
            self._event = event
        elif self._recorded:
            err = drv.cuEventSynchronize(self._event)
            if err:
                return err
        if self.host is None or self.host.numel() < n:
            self.host = torch.empty(max(n, 4096), dtype=torch.int64).pin_memory()
            self._view = self.host.numpy()
        assert self._view is not None  # made with ``host``
        self._view[:n] = values
        err = drv.cuMemcpyHtoDAsync_v2(dst, self.host.data_ptr(), 8 * n, stream) or drv.cuEventRecord(
            self._event, stream
        )
        self._recorded = not err
        return err

    def __del__(self):
        if self._event is not None:
            try:
                driver().cuEventDestroy_v2(self._event)
            except Exception:  # the driver may be gone at interpreter exit
                pass
