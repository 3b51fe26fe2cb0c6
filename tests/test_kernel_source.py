"""The CUDA kernels compiled with NVRTC on a machine with no GPU: the gather/scatter
kernel (``cuda_copy``) and the direct page-write kernel (``cuda_place``). Each source
compiles with the options the copier loads it with, and each entry point's
parameters match the argument block packed for it (a mismatch would move the wrong
bytes on a GPU, silently). The inline kernels read their page ids where the launch
put them, with no per-thread copy in local memory (``__grid_constant__`` asks for
that; NVRTC 13 does it even without)."""

from __future__ import annotations

import ctypes
import re

import pytest

from kvstage.staging import cuda_copy, cuda_place

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="the test extra installs cuda-bindings")


def _ptx(source: str = cuda_copy._SOURCE) -> str:
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
def place_ptx() -> str:
    return _ptx(cuda_place._SOURCE)  # with the gather/scatter kernel's options, as the copier loads it


def test_the_direct_write_pointer_kernel_takes_the_packed_parameters(place_ptx):
    params, body = _entry(place_ptx, "kvstage_place_words")
    assert [size for size, _ in params] == _packed(cuda_place._ARG_OFFSETS, cuda_place._PlaceArgs)
    assert [size for size, _ in params] == [ctypes.sizeof(t) for _, t in cuda_place._PARAMS]
    assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body) and re.search(r"st\.global\.v4\.u32", body), \
        "the copy is not in 16-byte words"
    assert not re.search(r"\b(div|rem)\.", body), "a division instruction per word (words.divider avoids them)"


def test_the_direct_write_inline_kernel_takes_its_page_ids_in_place_of_the_source_pointer(place_ptx):
    params, body = _entry(place_ptx, "kvstage_place_words_inline")
    sizes = [size for size, _ in params]
    assert sizes == _packed(cuda_place._INLINE_OFFSETS, cuda_place._PlaceArgs)
    assert sizes[2] == 8 * cuda_place.INLINE_IDS and params[2][1] == 8
    assert cuda_place._PlaceArgs.page_ids.offset % 8 == 0
    assert sum(sizes) <= 4096, "a launch passes at most 4 KiB of parameters on every GPU"
    assert ".local" not in body, "the page ids are copied to local memory per thread"
    assert re.search(r"ld\.param\.u64\s+%rd\d+, \[%rd\d+\]", body), "page ids not read from the parameters in place"
