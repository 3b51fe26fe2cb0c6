"""One rank's KV cache as kvstage sees it: a list of per-(layer, plane) buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstage.errors import ConfigError
from kvstage.layout import buffer_shape
from kvstage.tp import SideSpec


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass
class RankCache:
    """The buffers of rank ``rank`` of ``spec``, ordered layer-major: L0.K, L0.V, L1.K, ...

    Buffers may live anywhere (separate allocations per layer, views of one pool)."""

    spec: SideSpec
    rank: int
    buffers: list[torch.Tensor]

    def __post_init__(self) -> None:
        geo = self.spec.geometry
        if len(self.buffers) != geo.buffers:
            raise ConfigError(
                f"buffers: got {len(self.buffers)}, need layers*planes = {geo.layers}*{geo.planes} = {geo.buffers}"
            )
        pages = self.buffers[0].shape[0]
        want = buffer_shape(geo, self.spec.page, self.spec.local_heads(), pages)
        dtype = torch_dtype(geo.dtype)
        for i, b in enumerate(self.buffers):
            if tuple(b.shape) != want or b.dtype != dtype or not b.is_contiguous():
                raise ConfigError(
                    f"buffer {i}: shape {tuple(b.shape)} dtype {b.dtype} contiguous={b.is_contiguous()}; "
                    f"need contiguous {want} of {dtype} ({self.spec.page.order})"
                )
            if b.device != self.buffers[0].device:
                raise ConfigError(f"buffer {i} is on {b.device}, buffer 0 on {self.buffers[0].device}: one device per rank")

    @property
    def pages(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @classmethod
    def allocate(cls, spec: SideSpec, rank: int, pages: int, device="cpu", fill: float | None = 0) -> "RankCache":
        """Allocate a fresh cache (tests, the benchmark)."""
        shape = buffer_shape(spec.geometry, spec.page, spec.local_heads(), pages)
        dt = torch_dtype(spec.geometry.dtype)
        bufs = [torch.empty(shape, dtype=dt, device=device) for _ in range(spec.geometry.buffers)]
        if fill is not None:
            for b in bufs:
                b.view(torch.uint8).fill_(int(fill))
        return cls(spec, rank, bufs)
