"""A source rank's KV buffers shared with the destination on its host, and the event
that says when a request's KV in them is written.

On one host the destination reads every source rank's head slices straight out of
the sources' own pages (``cuda_ipc``) once those pages are mapped into its address
space. Engines allocate their KV buffers through torch's caching allocator, which
sub-allocates: a buffer may sit at an offset inside a larger ``cudaMalloc`` segment,
and one segment may hold many buffers (one big tensor viewed per layer). So
``share_buffers`` finds each buffer's allocation (``cuMemGetAddressRange``), exports
one CUDA IPC handle per distinct allocation and describes each buffer as
(allocation, offset, bytes); ``open_buffers`` maps each allocation once and gives
each buffer's address here.

Only legacy-IPC memory (``cudaMalloc``) is shared. Memory made through CUDA's
virtual memory API (torch's expandable segments, ``cuMemCreate``) or taken from
a stream-ordered pool (``cudaMallocAsync``) has no CUDA IPC handle, and host
memory is not for this path: ``share_buffers`` refuses them (``NotShareable``)
and says what to change. A handle maps its whole allocation, so a peer that
opens it can reach every byte of those allocations, not only the buffers
(``exposed_bytes`` says how many lie outside them).

The source's GPU work that writes a request's KV is still queued when the source
says the request is ready, so the destination's read waits for it on the GPU, not
on the host: the source records a ``ReadyEvent`` after that work, and the
destination's stream waits on it through an ``OpenedEvent`` before its launch.

This module moves no bytes and knows nothing of KV. What comes from a peer (a
description, an event handle) is checked as hostile input: ``parse`` checks every
field, ``open_buffers`` each mapping's size against it.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import uuid
from dataclasses import dataclass

import torch

from kvstage.cudart import driver, driver_error, runtime, runtime_error
from kvstage.errors import KVStageError, MappingError

KIND = "cuda_ipc_buffers"
#: bounds on a peer's description: buffers (layers x planes of one rank, with room to spare) and bytes
MAX_BUFFERS = 1 << 14
MAX_BYTES = 1 << 50
_MAX_TEXT = 128  # characters of the owner and GPU fields
_HANDLE_BYTES = 64  # cudaIpcMemHandle_t
_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess: a GPU other than the owner maps it over NVLink/PCIe
_EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
_WHY_FOR_VMM = (
    "allocated through CUDA's virtual memory API (torch's expandable segments, cuMemCreate) or from a "
    "stream-ordered pool (cudaMallocAsync): cudaIpcGetMemHandle cannot export it, and kvstage shares KV "
    "buffers through CUDA IPC only; start the engine with PYTORCH_CUDA_ALLOC_CONF without "
    "expandable_segments:True and without backend:cudaMallocAsync for reads straight from its pages "
    "(the staged and mapped paths work either way)"
)


class NotShareable(KVStageError):
    """These buffers (or this device's event) cannot be shared with a peer; the message names the cause
    and the fix."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


_owners: dict = {}  # pid -> this process's random id, made at first use


def _owner() -> str:
    """A random id of this process (per pid, so a forked child has its own): a description
    names its owner, so a process never opens its own handles (CUDA refuses that)."""
    pid = os.getpid()
    if pid not in _owners:
        _owners[pid] = uuid.uuid4().hex
    return _owners[pid]


@dataclass(frozen=True)
class Description:
    """A checked description: ``allocations`` (handle bytes, size), ``buffers`` (allocation
    index, offset in it, size), the owner's process id and GPU UUID."""

    owner: str
    gpu: str | None
    allocations: tuple[tuple[bytes, int], ...]
    buffers: tuple[tuple[int, int, int], ...]


@contextlib.contextmanager
def _primary_context(device: torch.device):
    """The device's primary context (torch's) current on this thread for the driver calls inside."""
    drv = driver()
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev, context, popped = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    err = drv.cuDeviceGet(ctypes.byref(dev), index) or drv.cuDevicePrimaryCtxRetain(ctypes.byref(context), dev)
    if err:
        raise MappingError(f"no primary CUDA context for {device}: {driver_error(err)}")
    drv.cuCtxPushCurrent_v2(context)
    try:
        with torch.cuda.device(device):
            yield
    finally:
        drv.cuCtxPopCurrent_v2(ctypes.byref(popped))
        drv.cuDevicePrimaryCtxRelease_v2(dev)


def gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (the same in every process, whatever each one's device numbering), or None
    where torch does not report it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


def _address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding device address ``ptr``, in the current context."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if err:
        raise RuntimeError(f"cuMemGetAddressRange failed: {driver_error(err)}")
    return base.value, size.value


def share_buffers(buffers: list[torch.Tensor]) -> dict:
    """What a peer on this host needs to map ``buffers`` (CUDA tensors of one device, from any
    allocator that uses ``cudaMalloc``): one CUDA IPC handle per distinct allocation, and each
    buffer as (allocation index, offset, bytes). JSON-ready. Raises ``NotShareable`` naming the
    cause and the fix for host memory, VMM memory and other memory CUDA IPC cannot export."""
    from kvstage.link.gpu import pointer_ipc

    if not buffers:
        raise NotShareable("no buffers to share")
    if len(buffers) > MAX_BUFFERS:
        raise NotShareable(f"{len(buffers)} buffers; at most {MAX_BUFFERS} are shared")
    device = buffers[0].device
    for i, b in enumerate(buffers):
        if not b.is_cuda:
            raise NotShareable(
                f"buffer {i} is in host memory ({b.device}): only CUDA buffers are shared with "
                "peers; host caches use the staged or mapped path"
            )
        if b.device != device:
            raise NotShareable(f"buffer {i} is on {b.device}, buffer 0 on {device}: one device per rank")
        if not b.is_contiguous() or b.numel() == 0:
            raise NotShareable(
                f"buffer {i} is {'empty' if b.numel() == 0 else 'not contiguous'}: a shared buffer is one run of bytes"
            )
    allocations: dict[int, int] = {}  # base -> index
    sizes: list[int] = []
    handles: list[str] = []
    described = []
    rt = runtime()
    with _primary_context(device):
        for i, b in enumerate(buffers):
            ptr, nbytes = b.data_ptr(), b.numel() * b.element_size()
            ipc = pointer_ipc(ptr)["value"]["ipc"]
            if ipc == "vmm":
                raise NotShareable(f"buffer {i} is {_WHY_FOR_VMM}")
            if ipc != "legacy-ipc":
                raise NotShareable(f"buffer {i}: whether CUDA IPC can export it is {ipc}")
            try:
                base, size = _address_range(ptr)
            except RuntimeError as e:
                raise NotShareable(f"buffer {i}: {e}") from None
            if base not in allocations:
                h = _IpcHandle()
                err = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base))
                if err:
                    rt.cudaGetLastError()  # clear it: this process's next CUDA call must not fail for it
                    raise NotShareable(f"buffer {i}: cudaIpcGetMemHandle failed with {runtime_error(err)}")
                allocations[base] = len(sizes)
                sizes.append(size)
                # all 64 bytes (the field itself reads as a C string, cut at the first zero byte)
                handles.append(base64.b64encode(ctypes.string_at(ctypes.addressof(h), _HANDLE_BYTES)).decode())
            described.append([allocations[base], ptr - base, nbytes])
    return {
        "kind": KIND,
        "owner": _owner(),
        "gpu": gpu_uuid(device),
        "allocations": [{"handle": h, "nbytes": n} for h, n in zip(handles, sizes, strict=True)],
        "buffers": described,
    }


def _count(value, field: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise MappingError(f"shared buffers: {field}={str(value)[:32]!r} must be an integer in [{lo}, {hi}]")
    return value


def _text(value, field: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_TEXT:
        raise MappingError(f"shared buffers: {field} must be a string of 1 to {_MAX_TEXT} characters")
    return value


def parse(desc) -> Description:
    """``desc`` (a peer's ``share_buffers``) checked field by field: types, counts, bounds, each
    handle 64 bytes of base64 and used once, each buffer inside its allocation and every
    allocation used. Raises ``MappingError`` naming the first field that fails."""
    if not isinstance(desc, dict) or desc.get("kind") != KIND:
        raise MappingError(f"not a description of shared KV buffers (kind must be {KIND!r})")
    owner = _text(desc.get("owner"), "owner")
    assert owner is not None  # not optional: _text refused anything but a string
    gpu = _text(desc.get("gpu"), "gpu", optional=True)
    allocs, bufs = desc.get("allocations"), desc.get("buffers")
    if not isinstance(bufs, list) or not 0 < len(bufs) <= MAX_BUFFERS:
        raise MappingError(f"shared buffers: buffers must be a list of 1 to {MAX_BUFFERS}")
    if not isinstance(allocs, list) or not 0 < len(allocs) <= len(bufs):
        raise MappingError("shared buffers: allocations must be a list of 1 to one per buffer")
    allocations = []
    for k, a in enumerate(allocs):
        if not isinstance(a, dict):
            raise MappingError(f"shared buffers: allocation {k} must be an object")
        try:
            raw = base64.b64decode(str(a.get("handle"))[: 4 * _HANDLE_BYTES], validate=True)
        except ValueError:
            raw = b""
        if len(raw) != _HANDLE_BYTES:
            raise MappingError(f"shared buffers: allocation {k}'s handle is not {_HANDLE_BYTES} bytes of base64")
        allocations.append((raw, _count(a.get("nbytes"), f"allocation {k} nbytes", 1, MAX_BYTES)))
    if len({raw for raw, _ in allocations}) != len(allocations):
        raise MappingError("shared buffers: an allocation's handle appears twice")
    buffers = []
    for i, b in enumerate(bufs):
        if not isinstance(b, list) or len(b) != 3:
            raise MappingError(f"shared buffers: buffer {i} must be [allocation, offset, nbytes]")
        k = _count(b[0], f"buffer {i} allocation", 0, len(allocations) - 1)
        size = allocations[k][1]
        offset = _count(b[1], f"buffer {i} offset", 0, size - 1)
        nbytes = _count(b[2], f"buffer {i} nbytes", 1, size - offset)
        buffers.append((k, offset, nbytes))
    if len({k for k, _, _ in buffers}) != len(allocations):
        raise MappingError("shared buffers: an allocation holds no buffer")
    return Description(owner, gpu, tuple(allocations), tuple(buffers))


def exposed_bytes(desc) -> int:
    """Bytes of the shared allocations outside every buffer: what a peer that opens the
    handles can reach beyond the KV buffers (0 when each buffer is a whole allocation)."""
    d = parse(desc)
    covered = 0
    for k in range(len(d.allocations)):
        end = 0
        for _, offset, nbytes in sorted(b for b in d.buffers if b[0] == k):
            covered += max(0, offset + nbytes - max(offset, end))
            end = max(end, offset + nbytes)
    return sum(size for _, size in d.allocations) - covered


class OpenedBuffers:
    """A peer's buffers mapped into this process: ``spans`` gives each buffer's (address,
    bytes) here, in the order shared; ``gpu`` the UUID of the GPU holding them, as the owner
    reported it. ``close`` unmaps them: only once every kernel reading or writing them has ended."""

    def __init__(self, bases: list[int], desc: Description, device: torch.device):
        self._bases, self.device, self.gpu = bases, device, desc.gpu
        self.spans = [(bases[k] + offset, nbytes) for k, offset, nbytes in desc.buffers]

    def on(self, device: torch.device) -> bool:
        """Whether the buffers live on ``device`` (compared by GPU UUID; unknown: False)."""
        return device.type == "cuda" and self.gpu is not None and self.gpu == gpu_uuid(device)

    def close(self) -> None:
        bases, self._bases = self._bases, []
        if bases:
            _close(bases, self.device)
        self.spans = []

    def __enter__(self) -> OpenedBuffers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close(bases: list[int], device: torch.device) -> None:
    rt = runtime()
    with _primary_context(device):
        for base in bases:
            rt.cudaIpcCloseMemHandle(ctypes.c_void_p(base))


def open_buffers(desc, device: torch.device) -> OpenedBuffers:
    """Map a peer's ``share_buffers`` description for kernels run on ``device``: each
    allocation once (peer access enabled on demand where the owner's GPU is another), each
    mapping's size checked against the description. Raises ``MappingError`` with the cause."""
    d = parse(desc)
    if device.type != "cuda":
        raise MappingError(f"shared CUDA buffers; this rank runs on {device}")
    if d.owner == _owner():
        raise MappingError(
            "the description is of this process's own buffers (CUDA cannot open its own IPC "
            "handles): use the buffers themselves"
        )
    rt = runtime()
    bases: list[int] = []
    try:
        with _primary_context(device):
            for k, (raw, nbytes) in enumerate(d.allocations):
                h = _IpcHandle()
                ctypes.memmove(ctypes.byref(h), raw, _HANDLE_BYTES)
                ptr = ctypes.c_void_p()
                err = rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, ctypes.c_uint(_IPC_LAZY_PEER_ACCESS))
                if err:
                    rt.cudaGetLastError()  # clear it: a failed open must not fail this process's next CUDA call
                    raise MappingError(
                        f"cudaIpcOpenMemHandle of allocation {k} failed with {runtime_error(err)} "
                        "(another host or container, the owner freed it, or no peer access between "
                        "the two GPUs)"
                    )
                opened = ptr.value or 0  # a successful open gives a mapping's address, never null
                bases.append(opened)
                try:
                    base, size = _address_range(opened)
                except RuntimeError as e:
                    raise MappingError(f"allocation {k} mapped, but its size cannot be checked: {e}") from None
                if base != ptr.value or size < nbytes:
                    raise MappingError(
                        f"allocation {k} maps {size} bytes here, the description says {nbytes}: the sizes do not match"
                    )
    except BaseException:
        if bases:
            _close(bases, device)
        raise
    return OpenedBuffers(bases, d, device)


def tensor_spans(buffers: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each tensor's (address, bytes): a rank's buffers in this very process, in the form
    ``OpenedBuffers.spans`` gives a peer's."""
    return [(b.data_ptr(), b.numel() * b.element_size()) for b in buffers]


class ReadyEvent:
    """A source rank's mark, on its GPU, that the KV it announced is written: one interprocess
    CUDA event for the device, its handle shared once at the handshake; ``record`` after the
    work that wrote a request's KV, before saying the request is ready.

    One event serves every request and every destination: a destination's wait covers the
    event's latest record at the time it waits, which is the announced record or a later one,
    and a later record on the same stream completes only after all the work queued before it
    (at worst the wait also covers a later request's work). So a source records on the one
    stream its forward writes the KV on."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise NotShareable(f"a ready event is a CUDA event; this rank runs on {device}")
        self.device = device
        self.event = torch.cuda.Event(enable_timing=False, interprocess=True)
        with torch.cuda.device(device):
            self._handle = bytes(self.event.ipc_handle())  # creates the event on ``device``

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        """Mark the work queued so far on ``stream`` (default: the current stream of this device)."""
        self.event.record(torch.cuda.current_stream(self.device) if stream is None else stream)

    def handle(self) -> bytes:
        """The event's CUDA IPC handle, for ``OpenedEvent`` in a peer process on this host."""
        return self._handle


class OpenedEvent:
    """A source's ``ReadyEvent`` opened in the destination's process, from its handle (a peer's
    bytes: checked first, ``MappingError`` naming what is wrong). ``wait`` queues a wait for the
    event's latest record on a stream: no host synchronization."""

    def __init__(self, handle, device: torch.device):
        if not isinstance(handle, (bytes, bytearray)) or len(handle) != _EVENT_HANDLE_BYTES:
            got = f"{len(handle)} bytes" if isinstance(handle, (bytes, bytearray)) else type(handle).__name__
            raise MappingError(
                f"event handle: must be the {_EVENT_HANDLE_BYTES} bytes of a CUDA IPC event handle; got {got}"
            )
        if device.type != "cuda":
            raise MappingError(f"a CUDA event; this rank runs on {device}")
        self.device = device
        try:
            self.event = torch.cuda.Event.from_ipc_handle(device, bytes(handle))
        except RuntimeError as e:
            raise MappingError(
                f"cudaIpcOpenEventHandle failed ({str(e).splitlines()[0][:200]}): another host or "
                "container, the owner's process ended, or this process's own event"
            ) from None

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make work queued later on ``stream`` (default: the current stream of this device) wait
        for the event's latest record."""
        self.event.wait(torch.cuda.current_stream(self.device) if stream is None else stream)
