"""The CUDA runtime and driver libraries, through ctypes: for the few calls
torch does not expose (a dedicated cudaMalloc, CUDA IPC handles, a kernel
launch with its arguments packed once) or exposes at a cost on a request's
critical path (a page-id upload: torch's stream, copy and event calls)."""

from __future__ import annotations

import ctypes
import functools


def _load(names: tuple[str, ...], what: str, kind=ctypes.CDLL) -> ctypes.CDLL:
    for name in names:
        try:
            return kind(name)
        except OSError:
            continue
    raise OSError(f"no {what} found (tried {', '.join(names)})")


@functools.cache
def runtime() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (by soname), or the first one found."""
    return _load(("libcudart.so.13", "libcudart.so.12", "libcudart.so"), "CUDA runtime library (libcudart)")


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library, with the signatures of the calls used here declared.
    Its calls keep the GIL (``PyDLL``): each takes microseconds, and releasing the GIL
    around a launch would hand it to another thread and wait to get it back."""
    lib = _load(("libcuda.so.1", "libcuda.so"), "CUDA driver library (libcuda)", ctypes.PyDLL)
    p, u = ctypes.c_void_p, ctypes.c_uint
    lib.cuLaunchKernel.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(p)]
    lib.cuCtxSetCurrent.argtypes = [p]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(p), ctypes.c_int]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, p, ctypes.c_size_t, p]
    lib.cuEventCreate.argtypes = [ctypes.POINTER(p), u]
    lib.cuEventRecord.argtypes = [p, p]
    lib.cuEventSynchronize.argtypes = [p]
    lib.cuEventDestroy_v2.argtypes = [p]
    lib.cuCtxPushCurrent_v2.argtypes = [p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(p)]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):  # the v2 calls: on by default since CUDA 11.7
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name, None)
        if fn is not None:  # bound as kvstage_<name>; absent from a driver without them
            fn.argtypes = [p, ctypes.c_uint64, ctypes.c_uint32, u]
            setattr(lib, "kvstage_" + name, fn)
    return lib


def runtime_error(code: int) -> str:
    """``cudaError...`` for a runtime call's result."""
    fn = runtime().cudaGetErrorName
    fn.restype = ctypes.c_char_p
    name = fn(code)
    return f"{name.decode()} ({code})" if name else f"CUDA runtime error {code}"


def driver_error(code: int) -> str:
    """``CUDA_ERROR_...`` for a driver call's result."""
    name = ctypes.c_char_p()
    if driver().cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
        return f"CUDA driver error {code}"
    return f"{name.value.decode()} ({code})"
