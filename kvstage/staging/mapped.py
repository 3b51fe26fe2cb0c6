"""A peer's arena mapped into this process, for two ranks on one host.

A source on its destination's host can gather a chunk straight into the
granted slot of the destination's arena: the gather's own stores are the
transfer, one pass over the bytes instead of two (gather into its own arena,
then a transport write of it). CUDA arenas are shared through CUDA IPC (the
arena is its own ``cudaMalloc`` allocation, so the handle covers exactly it);
host arenas through an anonymous memory file (``memfd_create``) that peers
open as ``/proc/PID/fd/FD``, created only when asked (``mapped="on"``: tests,
or a CPU deployment that wants it). Neither outlives its processes: a
destination killed outright leaves nothing in /dev/shm.

Like every transport module this one moves bytes and knows nothing of KV:
``share`` describes a buffer for a peer, ``open_shared`` maps that description.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import mmap
import os

import torch

from kvstage.cudart import runtime as _cudart

log = logging.getLogger("kvstage")

_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess: a GPU other than the owner maps it over NVLink/PCIe
_MEMFD_NAME = "kvstage-arena"


class MappingError(Exception):
    """A peer's arena cannot be mapped here (the reason says why)."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def shared_host_buffer(nbytes: int) -> torch.Tensor:
    """Host memory in an anonymous memory file, mapped here. Its descriptor stays
    open (peers on this host open it through /proc) until ``unshare``."""
    fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    owner = _SharedFile(fd, m)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t._kvstage_owner = owner
    return t


class _SharedFile:
    def __init__(self, fd: int, m: mmap.mmap):
        self.fd, self.map = fd, m

    def close(self) -> None:
        """No new peer can open it; the memory lives while any mapping of it does."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    __del__ = close


def share(buffer: torch.Tensor) -> dict | None:
    """What a peer on this host needs to map ``buffer`` (an arena made by
    ``allocate_arena``), or None when it is not shareable: device memory is
    shared when it is its own cudaMalloc allocation, host memory when it lives
    in a memfd (``shared_host_buffer``) still offered."""
    owner = getattr(buffer, "_kvstage_owner", None)
    if isinstance(owner, _SharedFile):
        if owner.fd is None:
            return None
        return {"kind": "memfd", "pid": os.getpid(), "fd": owner.fd, "nbytes": buffer.numel()}
    if buffer.is_cuda and owner is not None and getattr(owner, "ptr", None) == buffer.data_ptr():
        h = _IpcHandle()
        with torch.cuda.device(buffer.device):
            err = _cudart().cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(buffer.data_ptr()))
        if err != 0:
            log.info("arena not shared with sources on this host: cudaIpcGetMemHandle failed with CUDA error %d", err)
            return None
        # all 64 bytes (the field itself reads as a C string, cut at the first zero byte)
        raw = ctypes.string_at(ctypes.addressof(h), ctypes.sizeof(h))
        desc = {"kind": "cuda_ipc", "handle": base64.b64encode(raw).decode(), "nbytes": buffer.numel(),
                "gpu": gpu_uuid(buffer.device)}
        return desc
    return None


def unshare(buffer: torch.Tensor) -> None:
    """Stop offering a shared host buffer to new peers (its memory stays mapped
    where it is); nothing for other buffers. CUDA IPC needs nothing: the
    allocation's end ends it."""
    owner = getattr(buffer, "_kvstage_owner", None)
    if isinstance(owner, _SharedFile):
        owner.close()


def gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (the same in every process, whatever each one's device numbering), or None
    where torch does not report it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


class MappedArena:
    """A peer's arena mapped into this process: ``view`` gives byte ranges of it.
    ``gpu``: the UUID of the GPU a CUDA arena lives on, as its owner reported it."""

    def __init__(self, tensor: torch.Tensor, kind: str, closer, gpu: str | None = None):
        self.tensor, self.kind, self._closer, self.gpu = tensor, kind, closer, gpu

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]

    def on(self, device: torch.device) -> bool:
        """Whether the mapped memory lives on ``device``. A CUDA arena is compared by its owner's
        GPU UUID: the tensor over an IPC mapping reports this process's current device, not the
        GPU holding the memory. No UUID on either side: False (not known to be local)."""
        if self.tensor.device.type != device.type:
            return False
        if device.type != "cuda":
            return True
        return self.gpu is not None and self.gpu == gpu_uuid(device)

    def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            self.tensor = None
            closer()


def open_shared(desc: dict, nbytes: int, device: torch.device) -> MappedArena:
    """Map a peer's ``share`` description of ``nbytes`` bytes for copies run on ``device``."""
    if not isinstance(desc, dict) or desc.get("nbytes") != nbytes:
        raise MappingError(f"the shared arena's description does not match its {nbytes}-byte registration")
    kind = desc.get("kind")
    if kind == "memfd":
        return _open_memfd(desc.get("pid"), desc.get("fd"), nbytes, device)
    if kind == "cuda_ipc":
        return _open_ipc(desc.get("handle"), nbytes, device, desc.get("gpu"))
    raise MappingError(f"unknown shared arena kind {str(kind)[:32]!r}")


def _open_memfd(pid, fd, nbytes: int, device: torch.device) -> MappedArena:
    if device.type != "cpu":
        raise MappingError("a host arena in shared memory; this rank copies with CUDA kernels from its own device")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (pid, fd)):
        raise MappingError(f"shared arena pid={pid!r} fd={fd!r}: must be positive integers")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{_MEMFD_NAME}"):
            raise MappingError(f"{path} is not a kvstage arena")
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise MappingError(f"cannot open {path}: {e.strerror} (another host or PID namespace, or the "
                           "destination closed)") from e
    try:
        if os.fstat(fd).st_size != nbytes:
            raise MappingError(f"{path} holds {os.fstat(fd).st_size} bytes, the arena {nbytes}")
        m = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    # no explicit munmap: torch's views do not pin the map, so closing it under a live view would
    # leave that view pointing at unmapped memory; the map goes with the last tensor that holds it
    return MappedArena(torch.frombuffer(m, dtype=torch.uint8), "memfd", lambda: None)


class _DevicePointer:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _open_ipc(handle, nbytes: int, device: torch.device, gpu) -> MappedArena:
    if device.type != "cuda":
        raise MappingError("a CUDA arena; this rank's cache is in host memory")
    try:
        raw = base64.b64decode(str(handle), validate=True)
    except ValueError:
        raw = b""
    if len(raw) != 64:
        raise MappingError("CUDA IPC handle is not 64 bytes of base64")
    h = _IpcHandle()
    ctypes.memmove(ctypes.byref(h), raw, 64)
    rt = _cudart()
    ptr = ctypes.c_void_p()
    with torch.cuda.device(device):
        err = rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, ctypes.c_uint(_IPC_LAZY_PEER_ACCESS))
    if err != 0:
        rt.cudaGetLastError()  # clear it: a failed open must not fail this process's next CUDA call
        raise MappingError(f"cudaIpcOpenMemHandle failed with CUDA error {err} (another host or container, "
                           "or no peer access between the two GPUs)")
    # the kernels only take its address; the tensor's device says nothing of where the memory is (``on``)
    tensor = torch.as_tensor(_DevicePointer(ptr.value, nbytes))

    def close():
        with torch.cuda.device(device):
            rt.cudaIpcCloseMemHandle(ptr)

    return MappedArena(tensor, "cuda_ipc", close, gpu if isinstance(gpu, str) else None)
