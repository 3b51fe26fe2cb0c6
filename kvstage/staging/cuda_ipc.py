"""The one-host read kernel: a destination rank reads every source rank's head slices of a
request straight out of the sources' KV pages and writes its own pages (its page size, its
layout), one launch covering every source rank, every piece and every (layer, plane)
buffer of the pieces.

No region sits between the caches: each thread loads a 16-byte word of a source's page
and stores it at the destination's address, both computed from the two sides' page ids
alone, dividing by its run-time divisors with a multiply and a shift (``words.divider``),
as ``words.place_index`` computes them in numpy. Each source rank's buffers are mapped
here through CUDA IPC (``shared_buffers.open_buffers``), on this GPU or a peer GPU
(NVLink or PCIe); ``IpcReadCopier.source`` takes their addresses once and keeps their
table on the device. A source's page ids come in its ready message, so every read's ids
are checked on the host before a launch (``ipc_read.check_pages``): no message can steer
a load outside that source's buffers. Page ids pass in the launch's own parameters when
they fit (``INLINE_IDS``), else go up through the upload ring of
``cuda_copy.DeviceKernels``, which also loads the kernel and launches it on the caller's
torch stream; that stream waits for the sources' writes first (``shared_buffers.OpenedEvent``).
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import numpy as np
import torch

from kvstage.errors import ConfigError
from kvstage.staging import ipc_read
from kvstage.staging.cuda_copy import (
    _PIECE_TABLES,
    _THREADS,
    _UNROLL,
    CHECKSUM_SOURCE,
    INLINE_PAGES,
    DeviceKernels,
    PreparedCopy,
    _ArgBlock,
)
from kvstage.staging.shared_buffers import tensor_spans
from kvstage.staging.words import WordGeometry, divider
from kvstage.tp import Piece, SideSpec

#: page ids (every read's and the destination's) a launch may carry in its own parameters
#: (the kernel is compiled with the gather/scatter kernel's options: the same capacity)
INLINE_IDS = INLINE_PAGES
#: a grid's y and z extents: buffers of a piece, reads of a launch
_MAX_GRID_YZ = 65535

_SOURCE = (
    CHECKSUM_SOURCE
    + r"""
// grid: x = words of the largest piece / (THREADS * UNROLL), y = buffer inside a piece's range, z = read (piece).
// meta (device, int64): nreads x (source table address, source head_lo, destination head_lo, heads,
// heads divider multiplier, heads divider shift, buffer_lo, nbuffers); a source's table holds the address of each
// of its buffers, a block past its piece's nbuffers returns at once. ids (device memory for kvstage_ipc_read_words,
// the launch's own parameters for kvstage_ipc_read_words_inline): nreads x (index in ids of the read's first source
// page id, the offset of the read's first token in that page), then each read's source page ids. The destination's
// page ids (shared by every read) at dst_pages. The sources' pages are read through the read-only cache (__ldg):
// nothing writes them while a read runs (the launch waits for each source's ready event). Each run-time divisor
// d comes as a multiplier and a shift (n / d == (umulhi(n, m) + n) >> s, words.divider): no division instruction
// per word.
// Index arithmetic is 32-bit (the host checks a piece's words fit); the final word offsets are 64-bit.
// A read covers skip + count tokens of its source: the first skip are read and summed but not written (a
// checksummed part whose first tokens this rank has cached), token skip + t lands on this rank's token t.
// sums: 0, or one uint32 per read (zeroed): the checksum (staging.checksum) of every word it read, as a
// head-major gather of its piece would sum it (a segment per (head, buffer), its tokens from the read's first).
struct PageIds { long long id[INLINE]; };

__device__ __forceinline__ unsigned int divide(const unsigned int n, const unsigned int m, const unsigned int s)
{
    return (unsigned int)(((unsigned long long)__umulhi(n, m) + n) >> s);
}

__device__ __forceinline__ long long slot_word(
    const long long page, const unsigned int off, const unsigned int h, const unsigned int w,
    const unsigned int page_size, const unsigned int nheads, const unsigned int head_words, const int hnd)
{
    return hnd ? ((page * nheads + h) * page_size + off) * head_words + w
               : ((page * page_size + off) * nheads + h) * head_words + w;
}

__device__ __forceinline__ void read_words(
    const unsigned long long meta_addr, const long long* ids, const long long* dst_pages,
    const unsigned long long dst_table_addr, const unsigned int count, const unsigned int dst_first,
    const unsigned int head_words, const unsigned int head_words_m, const unsigned int head_words_s,
    const unsigned int src_page_size, const unsigned int src_page_m, const unsigned int src_page_s,
    const unsigned int src_nheads, const int src_hnd,
    const unsigned int dst_page_size, const unsigned int dst_page_m, const unsigned int dst_page_s,
    const unsigned int dst_nheads, const int dst_hnd, const unsigned int skip, const unsigned long long sums_addr)
{
    const long long* meta = (const long long*)meta_addr + 8 * blockIdx.z;
    if (blockIdx.y >= (unsigned int)meta[7]) return;  // past this piece's buffers
    const unsigned int b = (unsigned int)meta[6] + blockIdx.y;
    const unsigned int src_lo = (unsigned int)meta[1], dst_lo = (unsigned int)meta[2], heads = (unsigned int)meta[3];
    const unsigned int heads_m = (unsigned int)meta[4], heads_s = (unsigned int)meta[5];
    const uint4* src = (const uint4*)((const unsigned long long*)meta[0])[b];
    uint4* dst = (uint4*)((const unsigned long long*)dst_table_addr)[b];
    const long long* src_pages = ids + ids[2 * blockIdx.z];
    const unsigned int src_first = (unsigned int)ids[2 * blockIdx.z + 1];
    const unsigned int words = (skip + count) * heads * head_words;
    const unsigned int i0 = blockIdx.x * (THREADS * UNROLL) + threadIdx.x;
    uint4 v[UNROLL];
    long long at[UNROLL];  // where the word lands; -1: no word, -2: read and summed, not written
    unsigned int p16[UNROLL];
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        const unsigned int i = i0 + k * THREADS;
        at[k] = -1;
        if (i < words) {
            const unsigned int row = divide(i, head_words_m, head_words_s), w = i - row * head_words;
            const unsigned int t = divide(row, heads_m, heads_s), j = row - t * heads;
            const unsigned int us = src_first + t, qs = divide(us, src_page_m, src_page_s);
            v[k] = __ldg(src + slot_word(src_pages[qs], us - qs * src_page_size, src_lo + j, w, src_page_size,
                                         src_nheads, head_words, src_hnd));
            p16[k] = t * head_words + w;
            at[k] = -2;
            if (t >= skip) {
                const unsigned int ud = dst_first + t - skip, qd = divide(ud, dst_page_m, dst_page_s);
                at[k] = slot_word(dst_pages[qd], ud - qd * dst_page_size, dst_lo + j, w, dst_page_size, dst_nheads,
                                  head_words, dst_hnd);
            }
        }
    }
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        if (at[k] >= 0) __stwb(dst + at[k], v[k]);  // global, 16 bytes: the sums' atomics hide the space
    }
    if (sums_addr) {  // every block lies in one read: one atomic per block
        unsigned int total = 0;
        #pragma unroll
        for (int k = 0; k < UNROLL; k++)
            total += at[k] != -1 ? checksum_terms(v[k], p16[k]) : 0u;
        checksum_block_add((unsigned int*)sums_addr + blockIdx.z, total);
    }
}

#define READ_PARAMS \
    const unsigned long long dst_table_addr, const unsigned int count, const unsigned int dst_first, \
    const unsigned int head_words, const unsigned int head_words_m, const unsigned int head_words_s, \
    const unsigned int src_page_size, const unsigned int src_page_m, const unsigned int src_page_s, \
    const unsigned int src_nheads, const int src_hnd, \
    const unsigned int dst_page_size, const unsigned int dst_page_m, const unsigned int dst_page_s, \
    const unsigned int dst_nheads, const int dst_hnd, const unsigned int skip, const unsigned long long sums_addr
#define READ_ARGS \
    dst_table_addr, count, dst_first, head_words, head_words_m, head_words_s, \
    src_page_size, src_page_m, src_page_s, src_nheads, src_hnd, dst_page_size, dst_page_m, dst_page_s, \
    dst_nheads, dst_hnd, skip, sums_addr

extern "C" __global__ void kvstage_ipc_read_words(
    const unsigned long long meta_addr, const unsigned long long ids_addr, const unsigned long long dst_pages_addr,
    READ_PARAMS)
{
    read_words(meta_addr, (const long long*)ids_addr, (const long long*)dst_pages_addr, READ_ARGS);
}

// every id in the launch: the reads' from the start, the destination's from dst_at; read where the launch put them
// (__grid_constant__)
extern "C" __global__ void kvstage_ipc_read_words_inline(
    const unsigned long long meta_addr, const __grid_constant__ PageIds ids, const unsigned long long dst_at,
    READ_PARAMS)
{
    read_words(meta_addr, ids.id, ids.id + dst_at, READ_ARGS);
}
"""
)

_U32 = ctypes.c_uint32
_PARAMS = [
    ("meta_addr", ctypes.c_uint64),
    ("ids_addr", ctypes.c_uint64),
    ("dst_pages_addr", ctypes.c_uint64),
    ("dst_table_addr", ctypes.c_uint64),
    ("count", _U32),
    ("dst_first", _U32),
    ("head_words", _U32),
    ("head_words_m", _U32),
    ("head_words_s", _U32),
    ("src_page_size", _U32),
    ("src_page_m", _U32),
    ("src_page_s", _U32),
    ("src_nheads", _U32),
    ("src_hnd", ctypes.c_int32),
    ("dst_page_size", _U32),
    ("dst_page_m", _U32),
    ("dst_page_s", _U32),
    ("dst_nheads", _U32),
    ("dst_hnd", ctypes.c_int32),
    ("skip", _U32),
    ("sums_addr", ctypes.c_uint64),
]
#: the parameters fixed for a copier's life (its own buffers, the two sides' geometry), in ``_PARAMS`` order
_FIXED = (
    "dst_table_addr",
    "head_words",
    "head_words_m",
    "head_words_s",
    "src_page_size",
    "src_page_m",
    "src_page_s",
    "src_nheads",
    "src_hnd",
    "dst_page_size",
    "dst_page_m",
    "dst_page_s",
    "dst_nheads",
    "dst_hnd",
)


class _ReadArgs(ctypes.Structure):
    """Both entry points' parameters in order, and the inline kernel's page ids (its second
    parameter in place of ``ids_addr``; its third, ``dst_pages_addr``, then holds the index
    of the first destination id among them)."""

    _fields_ = [*_PARAMS, ("page_ids", ctypes.c_int64 * INLINE_IDS)]


_ARG_OFFSETS = tuple(getattr(_ReadArgs, name).offset for name, _ in _PARAMS)
_INLINE_OFFSETS = tuple(
    _ReadArgs.page_ids.offset if name == "ids_addr" else o for (name, _), o in zip(_PARAMS, _ARG_OFFSETS, strict=True)
)


class SourcePages:
    """One source rank's opened buffers as the kernel reads them: their addresses in a table
    on the device (uploaded once) and the pages each holds. It holds no mapping: the caller
    keeps the ``OpenedBuffers`` (and this) alive while launches read them."""

    def __init__(self, table: torch.Tensor, pages: int, spans: list[tuple[int, int]]):
        self.table, self.pages, self.spans = table, pages, spans
        self.address = table.data_ptr()


class IpcRead(NamedTuple):
    """One source rank's part of a read: ``piece`` (from ``tp.plan``; its ``dst_rank`` is this
    rank) out of ``source``'s pages ``pages``, the source's page ids of the request first to
    last, as its ready message named them, from its token ``src_start`` on."""

    source: SourcePages
    piece: Piece
    pages: np.ndarray
    src_start: int


class IpcReadCopier(DeviceKernels):
    """Reads from the source ranks of one peer engine (``src``: its spec) into this destination
    rank's own CUDA cache. Raises ``ConfigError`` where the two sides cannot use this path
    (``ipc_read.refusal``) or the cache cannot be written by it, naming why."""

    SOURCE = _SOURCE
    ENTRIES = {"pointer": "kvstage_ipc_read_words", "inline": "kvstage_ipc_read_words_inline"}
    WHAT = "IPC read"

    def __init__(self, cache, src: SideSpec):
        dst = cache.spec
        what = f"reads from source pages into destination rank {cache.rank}"
        why = ipc_read.refusal(src, dst)
        if why:
            raise ConfigError(f"{what}: {why}")
        if cache.device.type != "cuda":
            raise ConfigError(f"{what}: its cache is on {cache.device}; the kernel copies into CUDA caches")
        if dst.geometry.buffers > _MAX_GRID_YZ:
            raise ConfigError(f"{what}: {dst.geometry.buffers} buffers, past the {_MAX_GRID_YZ} one launch covers")
        sw, dw = WordGeometry.exact(src, ipc_read.WORD), WordGeometry.exact(dst, ipc_read.WORD)
        try:
            ipc_read.buffer_pages(dst, tensor_spans(cache.buffers))
            dividers = (*divider(sw.head_words), *divider(sw.page_size), *divider(dw.page_size))
        except ValueError as e:
            raise ConfigError(f"{what}: {e}") from None
        super().__init__(cache.device)
        self.cache, self.src_spec = cache, src
        self.head_words = sw.head_words
        self.table = torch.tensor([b.data_ptr() for b in cache.buffers], dtype=torch.int64, device=self.device)
        hw_m, hw_s, sp_m, sp_s, dp_m, dp_s = dividers
        self._fixed = (
            self.table.data_ptr(),
            sw.head_words,
            hw_m,
            hw_s,
            sw.page_size,
            sp_m,
            sp_s,
            sw.heads,
            int(sw.hnd),
            dw.page_size,
            dp_m,
            dp_s,
            dw.heads,
            int(dw.hnd),
        )
        self._pieces: dict = {}
        self._blocks = threading.local()  # each launching thread's argument block (``launch``)

    def source(self, spans) -> SourcePages:
        """A source rank's buffers, as (address, bytes) per (layer, plane) in order
        (``OpenedBuffers.spans``): checked against the source's spec (count, a whole number of
        pages, 16-byte boundaries; ``ValueError`` otherwise) and their table put on the
        device, once."""
        spans = [(int(a), int(n)) for a, n in spans]
        pages = ipc_read.buffer_pages(self.src_spec, spans)
        table = torch.tensor([a for a, _ in spans], dtype=torch.int64, device=self.device)
        return SourcePages(table, pages, spans)

    def prepare(self, idx, reads: list[IpcRead], skip: int = 0, sums_addr: int = 0) -> PreparedCopy:
        """The launch reading every read's piece into this rank's tokens ``idx`` (a
        ``staging.copy.TokenIndex`` of its cache); nothing runs until it is called. Every
        read's page ids are checked now (``ProtocolError``). ``sums_addr``: zeroed device sums,
        one per read, that the launch adds the checksum of every word it reads into (or 0); ``skip``:
        tokens each read reads (and sums) before those it writes to ``idx``."""
        block = self._new_block()
        function, grid, params, keep = self._fill(block, idx, reads, skip, sums_addr)
        return PreparedCopy(self, function, grid, params, (*keep, block))

    def launch(self, idx, reads: list[IpcRead], skip: int = 0, sums_addr: int = 0) -> None:
        """``prepare(idx, reads, skip, sums_addr)()`` at once, from this thread's own argument block. On
        the caller's current torch stream: the one this rank's request page ids were uploaded on
        (``staging.copy.copy_stream``), made to wait for the sources' writes first."""
        block = getattr(self._blocks, "block", None)
        if block is None:
            block = self._blocks.block = self._new_block()
        self._launch(*self._fill(block, idx, reads, skip, sums_addr)[:3])

    def _new_block(self) -> _ArgBlock:
        """An argument block with this copier's fixed parameters in place."""
        block = _ArgBlock(_ReadArgs, _ARG_OFFSETS, _INLINE_OFFSETS)
        for name, value in zip(_FIXED, self._fixed, strict=True):
            setattr(block.args, name, value)
        return block

    def _dst_ids(self, idx, pages: int) -> np.ndarray | None:
        """This rank's page ids of the indexed tokens on the host, or None where the request's
        are on the device (``idx.kernel_pages``)."""
        if isinstance(idx.kernel_pages, torch.Tensor):
            if idx.first_page + pages > len(idx.kernel_pages):
                raise ValueError(
                    f"the request's {len(idx.kernel_pages)} page ids end before tokens "
                    f"{idx.start}..{idx.start + idx.count}"
                )
            return None
        held = (
            idx.chunk_pages if idx.kernel_pages is None else idx.kernel_pages[idx.first_page : idx.first_page + pages]
        )
        ids = np.asarray(held, dtype=np.int64)
        if len(ids) != pages:
            raise ValueError(
                f"{len(ids)} destination page ids for tokens {idx.start}..{idx.start + idx.count}; they span {pages}"
            )
        return ids

    def _fill(self, block: _ArgBlock, idx, reads, skip: int = 0, sums_addr: int = 0):
        """Check every read and pack one launch's arguments into ``block``: the kernel to
        launch, its grid, its parameter array and the tensors it reads."""
        if not reads:
            raise ValueError("an IPC read of no pieces")
        if len(reads) > _MAX_GRID_YZ:
            raise ValueError(f"{len(reads)} reads in one launch; at most {_MAX_GRID_YZ}")
        src, dst = self.src_spec, self.cache.spec
        count = idx.count
        if skip < 0 or (skip and not sums_addr):
            raise ValueError(f"skip={skip}: tokens read and not written are for a checksum (sums_addr), >= 0")
        n = len(reads)
        header = np.empty(2 * n, dtype=np.int64)
        src_ids = []
        for z, r in enumerate(reads):
            ipc_read.check_piece(src, dst, r.piece)
            if r.piece.dst_rank != self.cache.rank:
                raise ValueError(
                    f"piece {r.piece} lands on destination rank {r.piece.dst_rank}; this copier writes "
                    f"rank {self.cache.rank}"
                )
            src_ids.append(
                ipc_read.check_pages(
                    src,
                    r.pages,
                    r.source.pages,
                    r.src_start,
                    skip + count,
                    f"source rank {r.piece.src_rank}'s page ids",
                )
            )
            header[2 * z + 1] = r.src_start % src.page.page_size
        dst_first, ndst = ipc_read.chunk_span(dst.page.page_size, idx.start, count)
        dst_ids = self._dst_ids(idx, ndst)
        at = 2 * n + (0 if dst_ids is None else ndst)
        for z, ids in enumerate(src_ids):
            header[2 * z] = at
            at += len(ids)
        ids = np.concatenate([header, *([] if dst_ids is None else [dst_ids]), *src_ids])
        args = block.args
        inline = dst_ids is not None and len(ids) <= INLINE_IDS
        keep = None
        if inline:
            block.ids[: len(ids)] = ids
            args.dst_pages_addr = 2 * n
        else:
            keep = self._upload(ids)
            args.ids_addr = keep.data_ptr()
            args.dst_pages_addr = (
                idx.kernel_pages.data_ptr() + 8 * idx.first_page if dst_ids is None else keep.data_ptr() + 8 * 2 * n
            )
        key = tuple(
            (
                r.source.address,
                r.piece.src_offset,
                r.piece.dst_offset,
                r.piece.heads.count,
                *divider(r.piece.heads.count),
                r.piece.buffers.start,
                len(r.piece.buffers),
            )
            for r in reads
        )
        meta = self._pieces.get(key)
        if meta is None:
            meta = self._upload(np.asarray(key, dtype=np.int64).reshape(-1))
            if len(self._pieces) >= _PIECE_TABLES:
                self._pieces.pop(next(iter(self._pieces)))
            self._pieces[key] = meta
        args.meta_addr, args.count, args.dst_first = meta.data_ptr(), count, dst_first
        args.skip, args.sums_addr = skip, sums_addr
        most = max(r.piece.heads.count for r in reads) * (skip + count) * self.head_words
        grid = (-(-most // (_THREADS * _UNROLL)), max(len(r.piece.buffers) for r in reads), n)
        tables = tuple(r.source.table for r in reads)
        if inline:
            return "inline", grid, block.inline_pointers, (meta, tables)
        return "pointer", grid, block.pointers, (keep, idx.kernel_pages, meta, tables)
