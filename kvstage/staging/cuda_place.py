"""The direct page-write kernel: a source rank stores its head slices of a chunk straight
into destination ranks' KV pages (their page size, their layout), one launch per chunk
covering every (layer, plane) buffer and every destination of the chunk (a 1->N source).

No region sits between the two caches: each thread reads a 16-byte word of the
source's page and stores it at the destination's address, both computed from the
two sides' page ids alone, dividing by its run-time divisors with a multiply and a
shift (``words.divider``), as ``words.place_index`` computes them in numpy. The
destination's buffers are mapped here through CUDA IPC (``shared_buffers``), on this
GPU or a peer GPU (NVLink or PCIe), or are this process's own;
``PlacedCopier.destination`` takes their addresses once and keeps their table on the
device. Every grant's page ids are checked on the host before a launch
(``placement.check_write``), so no grant can steer a store outside those buffers.
Page ids pass in the launch's own parameters when they fit (``INLINE_IDS``), else go
up through the upload ring of ``cuda_copy.DeviceKernels``, which also loads and
launches the kernel on the caller's torch stream.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import numpy as np
import torch

from kvstage.errors import ConfigError
from kvstage.staging import placement
from kvstage.staging.cuda_copy import (_PIECE_TABLES, _THREADS, _UNROLL, INLINE_PAGES, DeviceKernels, PreparedCopy,
                                       _ArgBlock)
from kvstage.staging.words import WordGeometry, divider
from kvstage.tp import Piece, SideSpec

#: source and destination page ids a launch may carry in its own parameters (the kernel is
#: compiled with the gather/scatter kernel's options: the same capacity)
INLINE_IDS = INLINE_PAGES

_SOURCE = r"""
// grid: x = words of the largest piece / (THREADS * UNROLL), y = buffer, z = piece.
// meta (device, int64): npieces x (source head_lo, destination head_lo, heads, destination table address,
// heads divider multiplier, heads divider shift); a destination's table holds the address of each of its
// buffers, in the source's buffer order. The chunk's source page ids are at src_pages; piece p's
// destination page ids at dst_pages + p * dst_stride, in device memory (kvstage_place_words) or in the
// launch's own parameters (kvstage_place_words_inline). Each run-time divisor d comes as a multiplier and
// a shift (n / d == (umulhi(n, m) + n) >> s, words.divider): no division instruction per word.
// Index arithmetic is 32-bit (the host checks a piece's words fit); the final word offsets are 64-bit.
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

__device__ __forceinline__ void place_words(
    const unsigned long long src_table_addr, const unsigned long long meta_addr,
    const long long* src_pages, const long long* dst_pages,
    const unsigned int count, const unsigned int src_first, const unsigned int dst_first,
    const unsigned int dst_stride, const unsigned int head_words, const unsigned int head_words_m,
    const unsigned int head_words_s,
    const unsigned int src_page_size, const unsigned int src_page_m, const unsigned int src_page_s,
    const unsigned int src_nheads, const int src_hnd,
    const unsigned int dst_page_size, const unsigned int dst_page_m, const unsigned int dst_page_s,
    const unsigned int dst_nheads, const int dst_hnd)
{
    const long long* meta = (const long long*)meta_addr + 6 * blockIdx.z;
    const int b = blockIdx.y;
    const unsigned int src_lo = (unsigned int)meta[0], dst_lo = (unsigned int)meta[1], heads = (unsigned int)meta[2];
    const unsigned int heads_m = (unsigned int)meta[4], heads_s = (unsigned int)meta[5];
    const uint4* src = (const uint4*)((const unsigned long long*)src_table_addr)[b];
    uint4* dst = (uint4*)((const unsigned long long*)meta[3])[b];
    const long long* dpages = dst_pages + (unsigned long long)blockIdx.z * dst_stride;
    const unsigned int words = count * heads * head_words;
    const unsigned int i0 = blockIdx.x * (THREADS * UNROLL) + threadIdx.x;
    uint4 v[UNROLL];
    long long at[UNROLL];
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        const unsigned int i = i0 + k * THREADS;
        at[k] = -1;
        if (i < words) {
            const unsigned int row = divide(i, head_words_m, head_words_s), w = i - row * head_words;
            const unsigned int t = divide(row, heads_m, heads_s), j = row - t * heads;
            const unsigned int us = src_first + t, qs = divide(us, src_page_m, src_page_s);
            const unsigned int ud = dst_first + t, qd = divide(ud, dst_page_m, dst_page_s);
            v[k] = src[slot_word(src_pages[qs], us - qs * src_page_size, src_lo + j, w, src_page_size, src_nheads,
                                 head_words, src_hnd)];
            at[k] = slot_word(dpages[qd], ud - qd * dst_page_size, dst_lo + j, w, dst_page_size, dst_nheads,
                              head_words, dst_hnd);
        }
    }
    #pragma unroll
    for (int k = 0; k < UNROLL; k++) {
        if (at[k] >= 0) dst[at[k]] = v[k];
    }
}

#define PLACE_PARAMS \
    const unsigned int count, const unsigned int src_first, const unsigned int dst_first, \
    const unsigned int dst_stride, const unsigned int head_words, const unsigned int head_words_m, \
    const unsigned int head_words_s, \
    const unsigned int src_page_size, const unsigned int src_page_m, const unsigned int src_page_s, \
    const unsigned int src_nheads, const int src_hnd, \
    const unsigned int dst_page_size, const unsigned int dst_page_m, const unsigned int dst_page_s, \
    const unsigned int dst_nheads, const int dst_hnd
#define PLACE_ARGS \
    count, src_first, dst_first, dst_stride, head_words, head_words_m, head_words_s, \
    src_page_size, src_page_m, src_page_s, src_nheads, src_hnd, dst_page_size, dst_page_m, dst_page_s, \
    dst_nheads, dst_hnd

extern "C" __global__ void kvstage_place_words(
    const unsigned long long src_table_addr, const unsigned long long meta_addr,
    const unsigned long long src_pages_addr, const unsigned long long dst_pages_addr, PLACE_PARAMS)
{
    place_words(src_table_addr, meta_addr, (const long long*)src_pages_addr, (const long long*)dst_pages_addr,
                PLACE_ARGS);
}

// the ids: the source's first, the destinations' from dst_at; read where the launch put them (__grid_constant__)
extern "C" __global__ void kvstage_place_words_inline(
    const unsigned long long src_table_addr, const unsigned long long meta_addr,
    const __grid_constant__ PageIds ids, const unsigned long long dst_at, PLACE_PARAMS)
{
    place_words(src_table_addr, meta_addr, ids.id, ids.id + dst_at, PLACE_ARGS);
}
"""

_U32 = ctypes.c_uint32
_PARAMS = [("src_table_addr", ctypes.c_uint64), ("meta_addr", ctypes.c_uint64),
           ("src_pages_addr", ctypes.c_uint64), ("dst_pages_addr", ctypes.c_uint64),
           ("count", _U32), ("src_first", _U32), ("dst_first", _U32), ("dst_stride", _U32),
           ("head_words", _U32), ("head_words_m", _U32), ("head_words_s", _U32),
           ("src_page_size", _U32), ("src_page_m", _U32), ("src_page_s", _U32), ("src_nheads", _U32),
           ("src_hnd", ctypes.c_int32),
           ("dst_page_size", _U32), ("dst_page_m", _U32), ("dst_page_s", _U32), ("dst_nheads", _U32),
           ("dst_hnd", ctypes.c_int32)]
#: the parameters fixed for a copier's life (its two sides' geometry), in ``_PARAMS`` order
_FIXED = ("head_words", "head_words_m", "head_words_s", "src_page_size", "src_page_m", "src_page_s", "src_nheads",
          "src_hnd", "dst_page_size", "dst_page_m", "dst_page_s", "dst_nheads", "dst_hnd")


class _PlaceArgs(ctypes.Structure):
    """Both entry points' parameters in order, and the inline kernel's page ids (its third
    parameter in place of ``src_pages_addr``; its fourth, ``dst_pages_addr``, then holds the
    index of the first destination id among them)."""

    _fields_ = [*_PARAMS, ("page_ids", ctypes.c_int64 * INLINE_IDS)]


_ARG_OFFSETS = tuple(getattr(_PlaceArgs, name).offset for name, _ in _PARAMS)
_INLINE_OFFSETS = tuple(_PlaceArgs.page_ids.offset if name == "src_pages_addr" else o
                        for (name, _), o in zip(_PARAMS, _ARG_OFFSETS))


class PlacedDestination:
    """One destination rank's KV buffers as the kernel writes them: their addresses in a
    table on the device (uploaded once) and the pages each holds. It holds no mapping: the
    caller keeps the buffers (or their ``OpenedBuffers``) alive while launches write them."""

    def __init__(self, table: torch.Tensor, pages: int, spans: list[tuple[int, int]]):
        self.table, self.pages, self.spans = table, pages, spans
        self.address = table.data_ptr()


class PlacedWrite(NamedTuple):
    """One destination's part of a chunk: ``piece`` (from ``tp.plan``) into ``destination``'s
    pages ``pages``, the grant's page ids holding the chunk's tokens, first to last."""

    destination: PlacedDestination
    piece: Piece
    pages: np.ndarray


class PlacedCopier(DeviceKernels):
    """Direct page writes from one source rank's CUDA cache into the pages of destination
    ranks of ``dst`` (one spec: one peer engine). Raises ``ConfigError`` where the two sides
    cannot use this path (``placement.refusal``), naming why."""

    SOURCE = _SOURCE
    ENTRIES = {"pointer": "kvstage_place_words", "inline": "kvstage_place_words_inline"}
    WHAT = "direct page-write"

    def __init__(self, cache, dst: SideSpec):
        why = placement.refusal(cache.spec, dst)
        if why:
            raise ConfigError(f"direct page writes from source rank {cache.rank}: {why}")
        if cache.device.type != "cuda":
            raise ConfigError(f"direct page writes from source rank {cache.rank}: its cache is on {cache.device}; "
                              "the kernel copies CUDA caches")
        placement.buffer_pages(cache.spec, [(b.data_ptr(), b.numel() * b.element_size()) for b in cache.buffers])
        super().__init__(cache.device)
        self.cache, self.dst_spec = cache, dst
        sw, dw = WordGeometry.of(cache.spec, placement.WORD), WordGeometry.of(dst, placement.WORD)
        self.head_words = sw.head_words
        self._fixed = (sw.head_words, *divider(sw.head_words), sw.page_size, *divider(sw.page_size), sw.heads,
                       int(sw.hnd), dw.page_size, *divider(dw.page_size), dw.heads, int(dw.hnd))
        self.table = torch.tensor([b.data_ptr() for b in cache.buffers], dtype=torch.int64, device=self.device)
        self.nbuf = len(cache.buffers)
        self._pieces: dict = {}
        self._blocks = threading.local()  # each launching thread's argument block (``launch``)

    def destination(self, spans) -> PlacedDestination:
        """A destination rank's buffers, as (address, bytes) per (layer, plane) in order
        (``OpenedBuffers.spans``, or ``shared_buffers.tensor_spans`` of this process's own):
        checked against the destination's spec (count, a whole number of pages, 16-byte
        boundaries; ``ValueError`` otherwise) and their table put on the device, once."""
        spans = [(int(a), int(n)) for a, n in spans]
        pages = placement.buffer_pages(self.dst_spec, spans)
        table = torch.tensor([a for a, _ in spans], dtype=torch.int64, device=self.device)
        return PlacedDestination(table, pages, spans)

    def prepare(self, idx, writes) -> PreparedCopy:
        """The launch writing the chunk ``idx`` (a ``staging.copy.TokenIndex`` of this cache)
        into every write's destination pages; nothing runs until it is called. The grants'
        page ids are checked now (``ProtocolError``)."""
        block = self._new_block()
        function, grid, params, keep = self._fill(block, idx, writes)
        return PreparedCopy(self, function, grid, params, (*keep, block))

    def launch(self, idx, writes) -> None:
        """``prepare(idx, writes)()`` at once, from this thread's own argument block. On the
        caller's current torch stream: the one the request's page ids were uploaded on
        (``staging.copy.copy_stream``)."""
        block = getattr(self._blocks, "block", None)
        if block is None:
            block = self._blocks.block = self._new_block()
        self._launch(*self._fill(block, idx, writes)[:3])

    def _new_block(self) -> _ArgBlock:
        """An argument block with this copier's fixed parameters (its two sides' geometry) in place."""
        block = _ArgBlock(_PlaceArgs, _ARG_OFFSETS, _INLINE_OFFSETS)
        for name, value in zip(_FIXED, self._fixed):
            setattr(block.args, name, value)
        return block

    def _fill(self, block: _ArgBlock, idx, writes):
        """Check every write and pack one launch's arguments into ``block``: the kernel to
        launch, its grid, its parameter array and the tensors it reads."""
        if not writes:
            raise ValueError("a direct write of no pieces")
        src, dst = self.cache.spec, self.dst_spec
        count = idx.count
        src_first, nsrc = placement.chunk_span(src.page.page_size, idx.start, count)
        dst_first, ndst = placement.chunk_span(dst.page.page_size, idx.start, count)
        dst_ids = []
        for w in writes:
            placement.check_piece(src, dst, w.piece)
            dst_ids.append(placement.check_write(dst, w.pages, w.destination.pages, idx.start, count,
                                                 w.piece.heads.count))
        if isinstance(idx.kernel_pages, torch.Tensor):  # the request's ids, uploaded once
            if idx.first_page + nsrc > len(idx.kernel_pages):
                raise ValueError(f"the request's {len(idx.kernel_pages)} page ids end before tokens "
                                 f"{idx.start}..{idx.start + count}")
            src_ids = None
        else:
            held = idx.chunk_pages if idx.kernel_pages is None else idx.kernel_pages[idx.first_page:
                                                                                     idx.first_page + nsrc]
            src_ids = np.asarray(held, dtype=np.int64)
            if len(src_ids) != nsrc:
                raise ValueError(f"{len(src_ids)} source page ids for tokens {idx.start}..{idx.start + count}; "
                                 f"they span {nsrc}")
        args = block.args
        inline = src_ids is not None and nsrc + ndst * len(writes) <= INLINE_IDS
        keep = None
        if inline:
            block.ids[:nsrc] = src_ids
            for k, ids in enumerate(dst_ids):
                block.ids[nsrc + k * ndst : nsrc + (k + 1) * ndst] = ids
            args.dst_pages_addr = nsrc
        else:
            ids = np.concatenate(([] if src_ids is None else [src_ids]) + dst_ids)
            keep = self._upload(ids)
            at = keep.data_ptr()
            if src_ids is None:
                args.src_pages_addr = idx.kernel_pages.data_ptr() + 8 * idx.first_page
            else:
                args.src_pages_addr = at
                at += 8 * nsrc
            args.dst_pages_addr = at
        key = tuple((w.piece.src_offset, w.piece.dst_offset, w.piece.heads.count, w.destination.address,
                     *divider(w.piece.heads.count)) for w in writes)
        meta = self._pieces.get(key)
        if meta is None:
            meta = self._upload(np.asarray(key, dtype=np.int64).reshape(-1))
            if len(self._pieces) >= _PIECE_TABLES:
                self._pieces.pop(next(iter(self._pieces)))
            self._pieces[key] = meta
        args.src_table_addr, args.meta_addr = self.table.data_ptr(), meta.data_ptr()
        args.count, args.src_first, args.dst_first, args.dst_stride = count, src_first, dst_first, ndst
        most = max(w.piece.heads.count for w in writes) * count * self.head_words
        grid = (-(-most // (_THREADS * _UNROLL)), self.nbuf, len(writes))
        tables = tuple(w.destination.table for w in writes)
        if inline:
            return "inline", grid, block.inline_pointers, (meta, tables)
        return "pointer", grid, block.pointers, (keep, idx.kernel_pages, meta, tables)
