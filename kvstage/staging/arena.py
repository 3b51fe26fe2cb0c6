"""The staging arena: one region per rank, registered once, cut into equal slots.

Equal slots keep the allocator trivial and fragmentation-free; a request that
needs more room than the arena streams through it chunk by chunk. A full arena
is back-pressure (``acquire`` returns None and the caller waits), never growth.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.cudart import runtime

if TYPE_CHECKING:
    # imported where memory is allocated: sizing an arena (``arena_size``) needs no torch, so the
    # bench's coordinator, which only sizes them, starts without loading it
    import torch

log = logging.getLogger(__name__)


class SlotAllocator:
    """Bounded allocator over ``count`` slot indices; hands out the most
    recently freed slot first, whose memory is most likely still in cache."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"slot count={count}: must be >= 1")
        self.count = count
        self._free = collections.deque(range(count))
        self._used: set[int] = set()

    def acquire(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} released twice or never acquired")
        self._used.remove(slot)
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


class _DeviceAllocation:
    """Memory from ``cudaMalloc`` itself, exposed through the CUDA array interface.

    PyTorch's caching allocator may hand out CUDA VMM memory (expandable
    segments), which UCX cannot share over legacy CUDA IPC: it then falls back,
    silently, to a path near 0.4 GB/s. A dedicated cudaMalloc keeps the arena
    reachable at full speed whatever the allocator settings are."""

    def __init__(self, nbytes: int, device: torch.device):
        import ctypes

        import torch

        torch.cuda.init()
        self._rt = runtime()
        with torch.cuda.device(device):
            ptr = ctypes.c_void_p()
            err = self._rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        if err != 0:
            raise MemoryError(f"cudaMalloc of {nbytes} bytes on {device} failed with CUDA error {err}")
        self.ptr, self.device = ptr.value, device
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def __del__(self):
        try:
            self._rt.cudaFree(__import__("ctypes").c_void_p(self.ptr))
        except Exception:  # interpreter shutdown: the driver frees it with the process
            pass


_CUDA_TLS = ("cuda", "cuda_copy", "cuda_ipc")


def _tls_moves_device_memory(tls: str) -> bool:
    """Whether a UCX_TLS value leaves UCX a CUDA transport ("^a,b" excludes a and b)."""
    names = {t.strip() for t in tls.lstrip("^").split(",") if t.strip()}
    if tls.startswith("^"):
        return not ("cuda" in names or {"cuda_copy", "cuda_ipc"} <= names)
    return "all" in names or bool(names & set(_CUDA_TLS))


def choose_arena(setting: str, device: torch.device, ucx_modules: list[str] | None, env) -> tuple[str, str]:
    """Where a rank's arena lives, "device" or "host", and why (logged once per endpoint).

    "auto" keeps a CUDA rank's arena on its GPU when this process's UCX can move
    device memory (a CUDA transport module is bundled and UCX_TLS allows one),
    and otherwise stages through pinned host memory: GPU -> pinned host arena ->
    transfer -> pinned host arena -> GPU, with the copies done by the same kernels."""
    if device.type != "cuda":
        return "host", "the KV cache is in host memory"
    if setting in ("device", "host"):
        return setting, f"arena={setting} was asked for"
    if setting != "auto":
        raise ValueError(f"arena={setting!r}: must be auto, device or host")
    if ucx_modules is not None and not any(m.startswith("cuda") for m in ucx_modules):
        return "host", "arena=auto: the UCX bundled with NIXL has no CUDA transport module (libuct_cuda*)"
    tls = env.get("UCX_TLS")
    if tls and not _tls_moves_device_memory(tls):
        return "host", f"arena=auto: UCX_TLS={tls} leaves out the CUDA transports"
    return "device", "arena=auto: UCX has a CUDA transport for device memory"


def allocate_arena(nbytes: int, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """A contiguous byte buffer for the arena: host memory (pinned for a CUDA rank's
    host arena, so its kernels reach it), or cudaMalloc'd device memory."""
    import torch

    if device.type != "cuda":
        # touch every page now: a first write into untouched memory page-faults,
        # which would land inside the first transfers' timings
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(0)
    owner = _DeviceAllocation(nbytes, device)
    t = torch.as_tensor(owner, device=device)
    t._kvstage_owner = owner  # type: ignore[attr-defined]  # the allocation lives as long as the tensor
    return t


#: chunk sizes by where the arena lives. On a GPU a chunk's fixed cost (messages, launches, a hop
#: between processes) is a few hundred microseconds, so chunks of 4,096 tokens keep it small next to
#: the copies, and a request of 8k tokens still pipelines over two chunks (measured best at 8k: 2-4
#: chunks of 256 MiB-1 GiB against 64 MiB). On the host the copies are the cores' work: 64 MiB slots
#: are the measured default of the CPU machine, and its request of 2,048 tokens moves in four chunks.
CHUNK_TOKENS_DEVICE = 4096
SLOT_BYTES_HOST = 64 << 20
#: slots per arena by rule: a chunk lands while the next is written, with room for a second request
SLOTS = {"device": 4, "host": 8}
#: an asked arena too small for the rule's slots is cut into this many: still one landing while one is written
MIN_SLOTS = 4
#: a device arena takes at most this share of the GPU memory free when it is made
DEVICE_SHARE = 1 / 16
PAGE = 4096


@dataclass(frozen=True)
class ArenaSize:
    """An arena's slots and the reason for their size (logged once per endpoint)."""

    slot_bytes: int
    slots: int
    why: str

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots


def arena_size(
    asked_bytes: int | None, token_bytes: int, where: str, free_bytes: int | None = None, pool_bytes: int | None = None
) -> ArenaSize:
    """The arena of one rank, sized by rule (pure).

    ``token_bytes``: this rank's bytes per token (its whole shard, all layers, K and V);
    ``where``: "device" or "host"; ``free_bytes``: free GPU memory (device arenas);
    ``pool_bytes``: the rank's whole KV cache (an arena larger than it stages nothing more);
    ``asked_bytes``: ``Settings.arena_mb`` in bytes, or None. A device slot holds
    ``CHUNK_TOKENS_DEVICE`` tokens, a host slot ``SLOT_BYTES_HOST``, and the rule's arena
    holds at most the KV cache (in slots of at least a page and one token); an asked arena
    keeps the rule's slot if ``SLOTS`` of them fit, else is cut into ``MIN_SLOTS`` slots."""
    if where not in SLOTS:
        raise ValueError(f"where={where!r}: must be device or host")
    count = SLOTS[where]
    if where == "device":
        slot = _pages(token_bytes * CHUNK_TOKENS_DEVICE)
        why = f"{CHUNK_TOKENS_DEVICE} tokens of {token_bytes} B per slot"
    else:
        slot, why = SLOT_BYTES_HOST, f"{SLOT_BYTES_HOST >> 20} MiB per slot"
    if asked_bytes is not None:
        if asked_bytes < PAGE:
            raise ValueError(f"asked_bytes={asked_bytes}: an arena holds at least one {PAGE}-byte slot")
        if slot * count > asked_bytes:
            slot = max(PAGE, asked_bytes // MIN_SLOTS // PAGE * PAGE)
            why = f"arena_mb={asked_bytes / (1 << 20):g} cut into {MIN_SLOTS} slots"
        else:
            why += f", as many as arena_mb={asked_bytes / (1 << 20):g} holds"
        return ArenaSize(slot, max(1, asked_bytes // slot), why)
    if where == "device" and free_bytes is not None and slot * count > free_bytes * DEVICE_SHARE:
        slot = max(PAGE, int(free_bytes * DEVICE_SHARE) // count // PAGE * PAGE)
        why = f"{count} slots in 1/{round(1 / DEVICE_SHARE)} of the {free_bytes / 2**30:.1f} GiB free on the GPU"
    if pool_bytes is not None and slot * count > pool_bytes:
        least = _pages(token_bytes)
        slot = max(least, _pages(pool_bytes // count))
        why = f"{count} slots of the {pool_bytes / 2**20:.4g} MiB KV cache (an arena holds no more than the cache)"
    return ArenaSize(slot, count, why + f", {count} slots")


def _pages(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


class StagingArena:
    """``slots`` slots of ``slot_bytes`` in one registered buffer."""

    def __init__(self, slot_bytes: int, slots: int, device: torch.device, pinned: bool = False):
        self.slot_bytes = slot_bytes
        self.allocator = SlotAllocator(slots)
        self.buffer = allocate_arena(slot_bytes * slots, device, pinned)
        log.debug("arena: %d slots of %d bytes on %s%s", slots, slot_bytes, device, " (pinned)" if pinned else "")

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]
