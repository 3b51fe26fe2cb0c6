"""The staging arena: one region per rank, registered once, cut into equal slots.

Equal slots keep the allocator trivial and fragmentation-free; a request that
needs more room than the arena streams through it chunk by chunk. A full arena
is back-pressure (``acquire`` returns None and the caller waits), never growth.
"""

from __future__ import annotations

import collections
import logging

import torch

log = logging.getLogger(__name__)


class SlotAllocator:
    """Bounded FIFO allocator over ``count`` slot indices."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"slot count={count}: must be >= 1")
        self.count = count
        self._free = collections.deque(range(count))
        self._used: set[int] = set()

    def acquire(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.popleft()
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

    @property
    def in_use(self) -> int:
        return len(self._used)


def allocate_arena(nbytes: int, device: torch.device) -> torch.Tensor:
    """A contiguous byte buffer for the arena.

    On CUDA the caching allocator's expandable segments give VMM memory that UCX
    cannot share over legacy IPC (it silently drops to a ~0.4 GB/s path), so
    the arena is refused there rather than made slow: see docs/configuration.md.
    """
    if device.type == "cuda":
        import os

        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:true" in conf.replace(" ", "").lower():
            # A private pool without expandable segments gives cudaMalloc'd memory.
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            t._kvstage_pool = pool  # keep the pool alive with the tensor
            return t
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class StagingArena:
    """``slots`` slots of ``slot_bytes`` in one registered buffer."""

    def __init__(self, slot_bytes: int, slots: int, device: torch.device):
        self.slot_bytes = slot_bytes
        self.allocator = SlotAllocator(slots)
        self.buffer = allocate_arena(slot_bytes * slots, device)
        log.debug("arena: %d slots of %d bytes on %s", slots, slot_bytes, device)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]
