"""The CUDA kernels compiled with NVRTC on a machine with no GPU: the gather/scatter
kernel (``cuda_copy``) and the one-host read kernel (``cuda_ipc``). Each source
compiles with the options the copier loads it with, and each entry point's
parameters match the argument block packed for it (a mismatch would move the wrong
bytes on a GPU, silently). The inline kernels read their page ids where the launch
put them, with no per-thread copy in local memory (``__grid_constant__`` asks for
that; NVRTC 13 does it even without). And the gather/scatter kernel's own source,
built for the host behind a small shim, run over its whole launch grid against the
independent reference (``support.regions``)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging import cuda_copy, cuda_ipc, words
from kvstage.staging.cache import RankCache
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import SideSpec
from support.regions import expected_cache, expected_region, host_buffers, random_bytes, same_buffers

def _ptx(source: str = cuda_copy._SOURCE) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="the test extra installs cuda-bindings")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"kvstage_copy.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = [o.encode() for o in (*cuda_copy.OPTIONS, "-arch=compute_90")]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    err_log, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    err, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.decode().rstrip("\0 ")


@pytest.fixture(scope="module")
def ptx() -> str:
    return _ptx()


def _entry(ptx: str, name: str) -> tuple[list[tuple[int, int]], str]:
    """An entry point's parameters as (bytes, alignment), and its body."""
    m = re.search(r"\.entry " + name + r"\((.*?)\)\s*\{(.*?)\n\}", ptx, re.S)
    assert m, f"no entry {name} in the PTX"
    params = []
    for line in m.group(1).split(","):
        scalar = re.search(r"\.param \.([usb])(\d+) ", line)
        array = re.search(r"\.param \.align (\d+) \.b8 \w+\[(\d+)\]", line)
        if array:
            params.append((int(array.group(2)), int(array.group(1))))
        else:
            assert scalar, line
            bits = int(scalar.group(2))
            params.append((bits // 8, bits // 8))
    return params, m.group(2)


def _packed(offsets, args=cuda_copy._KernelArgs) -> list[int]:
    """Each parameter's size in the argument block, from the field its pointer points at."""
    by_offset = {getattr(args, name).offset: getattr(args, name).size for name, _ in args._fields_}
    return [by_offset[o] for o in offsets]


def test_the_pointer_kernel_takes_the_packed_parameters(ptx):
    params, _ = _entry(ptx, "kvstage_copy_words")
    assert [size for size, _ in params] == _packed(cuda_copy._ARG_OFFSETS)
    assert [size for size, _ in params] == [ctypes.sizeof(t) for _, t in cuda_copy._PARAMS]


def test_the_inline_kernel_takes_its_page_ids_in_place_of_the_pointer(ptx):
    params, body = _entry(ptx, "kvstage_copy_words_inline")
    sizes = [size for size, _ in params]
    assert sizes == _packed(cuda_copy._INLINE_OFFSETS)
    assert sizes[3] == 8 * cuda_copy.INLINE_PAGES and params[3][1] == 8
    assert cuda_copy._KernelArgs.page_ids.offset % 8 == 0
    assert sum(sizes) <= 4096, "a launch passes at most 4 KiB of parameters on every GPU"
    assert ".local" not in body, "the page ids are copied to local memory per thread"
    assert re.search(r"ld\.param\.u64\s+%rd\d+, \[%rd\d+\]", body), "page ids not read from the parameters in place"


@pytest.fixture(scope="module")
def read_ptx() -> str:
    return _ptx(cuda_ipc._SOURCE)  # with the gather/scatter kernel's options, as the copier loads it


def test_the_read_pointer_kernel_takes_the_packed_parameters(read_ptx):
    params, body = _entry(read_ptx, "kvstage_ipc_read_words")
    assert [size for size, _ in params] == _packed(cuda_ipc._ARG_OFFSETS, cuda_ipc._ReadArgs)
    assert [size for size, _ in params] == [ctypes.sizeof(t) for _, t in cuda_ipc._PARAMS]
    assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body) and re.search(r"st\.global(\.wb)?\.v4\.u32", body), \
        "the copy is not in 16-byte words"
    assert not re.search(r"\b(div|rem)\.", body), "a division instruction per word (words.divider avoids them)"


def test_the_read_inline_kernel_takes_its_page_ids_in_place_of_the_ids_pointer(read_ptx):
    params, body = _entry(read_ptx, "kvstage_ipc_read_words_inline")
    sizes = [size for size, _ in params]
    assert sizes == _packed(cuda_ipc._INLINE_OFFSETS, cuda_ipc._ReadArgs)
    assert sizes[1] == 8 * cuda_ipc.INLINE_IDS and params[1][1] == 8
    assert cuda_ipc._ReadArgs.page_ids.offset % 8 == 0
    assert sum(sizes) <= 4096, "a launch passes at most 4 KiB of parameters on every GPU"
    assert ".local" not in body, "the page ids are copied to local memory per thread"
    assert re.search(r"ld\.param\.u64\s+%rd\d+, \[%rd\d+\]", body), "page ids not read from the parameters in place"
    assert not re.search(r"\b(div|rem)\.", body), "a division instruction per word (words.divider avoids them)"



def test_the_copy_kernel_reads_its_piece_table_as_the_numpy_mirror_does():
    assert f"#define META {words.META}\n" in cuda_copy._SOURCE
    assert len(words.piece_table([RegionPiece(0, 1, range(1), 0)])) == words.META


def test_the_copy_kernel_moves_16_byte_words(ptx):
    for name in ("kvstage_copy_words", "kvstage_copy_words_inline"):
        _, body = _entry(ptx, name)
        assert re.search(r"ld(\.global)?(\.nc)?\.v4\.u32", body) and re.search(r"st(\.global)?\.v4\.u32", body), name


# -- the copy kernel's own source, run on the host ----------------------------------------------
# A shim makes the CUDA source plain C++: each (block, thread) of the launch grid runs in turn,
# which is exact for this kernel (no shared memory, no synchronization, each thread moves its
# own words). So the kernel's 32-bit arithmetic and its reading of the piece table and the page
# ids are tested here on their bytes, beside the numpy mirror (words.word_index).
_SHIM = r"""
struct uint4 { unsigned int x, y, z, w; };
struct Index { unsigned int x, y, z; };
static Index blockIdx, threadIdx;
#define __device__
#define __forceinline__ inline
#define __global__
#define __grid_constant__
static inline unsigned int atomicAdd(unsigned int* at, unsigned int v) { unsigned int old = *at; *at = old + v; return old; }
"""

_GRID = r"""
extern "C" void run_grid(unsigned int gx, unsigned int gy, unsigned int gz, int inline_ids,
    unsigned long long table_addr, unsigned long long region_addr, unsigned long long meta_addr,
    unsigned long long pages_addr, unsigned int count, unsigned int first, unsigned int page_size,
    unsigned int nheads, unsigned int head_words, int hnd, int to_region, unsigned long long sums_addr)
{
    PageIds ids;
    if (inline_ids)
        for (int k = 0; k < INLINE; k++)
            ids.id[k] = ((const long long*)pages_addr)[k];
    for (unsigned int z = 0; z < gz; z++)
        for (unsigned int y = 0; y < gy; y++)
            for (unsigned int x = 0; x < gx; x++)
                for (unsigned int t = 0; t < THREADS; t++) {
                    blockIdx = {x, y, z};
                    threadIdx = {t, 0, 0};
                    if (inline_ids)
                        kvstage_copy_words_inline(table_addr, region_addr, meta_addr, ids, count, first, page_size,
                                                  nheads, head_words, hnd, to_region, sums_addr);
                    else
                        kvstage_copy_words(table_addr, region_addr, meta_addr, pages_addr, count, first, page_size,
                                           nheads, head_words, hnd, to_region, sums_addr);
                }
}
"""


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernel source for the host")
    folder = tmp_path_factory.mktemp("kernel")
    (folder / "kernel.cpp").write_text(_SHIM + cuda_copy._SOURCE + _GRID)
    lib = folder / "kernel.so"
    defines = [o for o in cuda_copy.OPTIONS if o.startswith("-D")]
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-std=c++17", "-Wno-unknown-pragmas", *defines,
                    str(folder / "kernel.cpp"), "-o", str(lib)], check=True)
    run = ctypes.CDLL(str(lib)).run_grid
    run.restype = None
    run.argtypes = [ctypes.c_uint32] * 3 + [ctypes.c_int32] + [ctypes.c_uint64] * 4 + [ctypes.c_uint32] * 5 + \
                   [ctypes.c_int32] * 2 + [ctypes.c_uint64]
    return run


def _host_launch(run, cache, ids, start, count, pieces, region: np.ndarray, to_region: bool, inline: bool,
                 sums: np.ndarray | None = None):
    """One launch of the kernel for a chunk, as ``WordCopier._fill`` sets it up, on host memory; ``sums``
    (uint32, zeroed) takes its checksum segments' sums."""
    wg = words.WordGeometry.of(cache.spec, 16)
    pages, first = words.chunk_pages(ids, wg.page_size, start, count)
    if inline:
        pages = np.concatenate([pages, np.zeros(cuda_copy.INLINE_PAGES - len(pages), dtype=np.int64)])
    pages = np.ascontiguousarray(pages, dtype=np.int64)
    table = np.array([b.data_ptr() for b in cache.buffers], dtype=np.uint64)
    meta = words.piece_table(pieces)
    grid = cuda_copy.launch_grid(pieces, count, wg.head_words)
    run(*grid, int(inline), table.ctypes.data, region.ctypes.data, meta.ctypes.data, pages.ctypes.data, count, first,
        wg.page_size, wg.heads, wg.head_words, int(wg.hnd), int(to_region), 0 if sums is None else sums.ctypes.data)


@pytest.mark.parametrize("page", [(1, "nhd"), (16, "nhd"), (64, "hnd"), (4, "hnd")])
@pytest.mark.parametrize("start,count", [(3, 37), (0, 64), (61, 5)])
@pytest.mark.parametrize("inline", [False, True])
def test_the_copy_kernel_source_run_on_the_host_moves_the_bytes_the_reference_says(host_kernel, page, start, count,
                                                                                   inline):
    """Pieces of both orders, buffer ranges of different lengths (blocks past a piece's own
    return), row windows, 16- and 32-byte heads of 1- and 4-byte elements, random pages."""
    for geo in (KVGeometry(3, 4, 16, "int8"), KVGeometry(2, 2, 8, "float32")):
        spec = SideSpec(geo, 1, PageLayout(*page))
        hb, nb, heads = geo.head_bytes(), geo.buffers, geo.kv_heads
        ids = np.random.default_rng(start).permutation(90)[: pages_needed(start + count, page[0])]
        cache = RankCache.allocate(spec, 0, 90, fill=None)
        random_bytes(cache, count)
        pieces = end_to_end([RegionPiece(0, heads // 2, range(0, nb - 1), 0, Order.HEADS, rows=count + 9, row_first=4),
                             RegionPiece(heads // 2, heads - heads // 2, range(nb), 0, Order.TOKENS),
                             RegionPiece(0, heads // 2, range(nb - 1, nb), 0, Order.TOKENS, rows=count + 1,
                                         row_first=1)], hb, count, offset=32)
        size = pieces[-1].offset + pieces[-1].nbytes(hb, count) + 48
        before = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        region = before.copy()
        _host_launch(host_kernel, cache, ids, start, count, pieces, region, True, inline)
        assert np.array_equal(region, expected_region(spec, host_buffers(cache), ids, start, count, pieces, before))
        dst = RankCache.allocate(spec, 0, 90, fill=0)
        zero = host_buffers(dst)
        _host_launch(host_kernel, dst, ids, start, count, pieces, before.copy(), False, inline)
        assert same_buffers(host_buffers(dst), expected_cache(spec, zero, ids, start, count, pieces, before))


@pytest.mark.parametrize("page", [(1, "nhd"), (16, "hnd")])
@pytest.mark.parametrize("inline", [False, True])
def test_the_copy_kernel_source_sums_each_checksum_segment_as_the_reference_does(host_kernel, page, inline):
    """Both directions add up every piece's segments (checksum.segments) as they move the words: a
    gather's sums are the reference's over the region it wrote, a scatter's over the region it read."""
    from kvstage.staging import checksum

    geo = KVGeometry(3, 4, 16, "int8")
    spec = SideSpec(geo, 1, PageLayout(*page))
    hb, nb, heads, start, count = geo.head_bytes(), geo.buffers, geo.kv_heads, 5, 40
    ids = np.random.default_rng(3).permutation(90)[: pages_needed(start + count, page[0])]
    cache = RankCache.allocate(spec, 0, 90, fill=None)
    random_bytes(cache, start + count)
    pieces = end_to_end([RegionPiece(0, 2, range(0, nb), 0, Order.HEADS),
                         RegionPiece(2, 2, range(1, nb), 0, Order.TOKENS),
                         RegionPiece(1, 1, range(nb - 1, nb), 0, Order.HEADS)], hb, count, offset=16)
    region = np.zeros(pieces[-1].offset + pieces[-1].nbytes(hb, count) + 16, dtype=np.uint8)
    want = checksum.ChunkSums.of(pieces, hb, count)
    for to_region in (True, False):
        sums = np.zeros(len(want.values), dtype=np.uint32)
        _host_launch(host_kernel, cache, ids, start, count, pieces, region, to_region, inline, sums)
        import torch
        checksum.region_sums(torch.from_numpy(region), pieces, hb, count, want)
        assert want.values.any() and np.array_equal(sums, want.values), (to_region, sums, want.values)
        region[pieces[1].offset + 7] ^= 1  # a flipped bit moves its segment's sum and no other
        flipped = np.zeros_like(sums)
        _host_launch(host_kernel, cache, ids, start, count, pieces, region, False, inline, flipped)
        moved = np.flatnonzero(flipped != sums)
        assert list(moved) == [checksum.segment_count(pieces[0])], moved
        random_bytes(cache, start + count)  # the scatter wrote the flipped bit; fresh bytes for the next turn


@pytest.mark.parametrize("page", [(1, "nhd"), (16, "hnd")])
@pytest.mark.parametrize("inline", [False, True])
def test_the_copy_kernel_source_sums_with_no_copy_as_its_gather_does(host_kernel, page, inline):
    """``SUM_ONLY``: the sums a gather of the pieces would add up, with the region neither read nor written
    (the source and the landed-pages sums of the paths that gather nothing)."""
    from kvstage.staging import checksum

    geo = KVGeometry(3, 4, 16, "int8")
    spec = SideSpec(geo, 1, PageLayout(*page))
    hb, nb, start, count = geo.head_bytes(), geo.buffers, 3, 41
    ids = np.random.default_rng(4).permutation(90)[: pages_needed(start + count, page[0])]
    cache = RankCache.allocate(spec, 0, 90, fill=None)
    random_bytes(cache, start + count)
    pieces = end_to_end([RegionPiece(0, 2, range(0, nb), 0, Order.HEADS),
                         RegionPiece(2, 2, range(1, nb), 0, Order.HEADS)], hb, count)
    region = np.zeros(pieces[-1].offset + pieces[-1].nbytes(hb, count), dtype=np.uint8)
    gathered = np.zeros(len(checksum.ChunkSums.of(pieces, hb, count).values), dtype=np.uint32)
    _host_launch(host_kernel, cache, ids, start, count, pieces, region, True, inline, gathered)
    region[:] = 0xA5
    summed = np.zeros_like(gathered)
    _host_launch(host_kernel, cache, ids, start, count, pieces, region, cuda_copy.SUM_ONLY, inline, summed)
    assert gathered.any() and np.array_equal(summed, gathered)
    assert (region == 0xA5).all(), "a sum with no copy wrote the region"
