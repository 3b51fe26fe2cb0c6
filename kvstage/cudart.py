"""The CUDA runtime library, through ctypes: for the few calls torch does not
expose (a dedicated cudaMalloc, CUDA IPC handles)."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def runtime() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (by soname), or the first one found."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no CUDA runtime library (libcudart) found")
