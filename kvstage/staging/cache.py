"""One rank's KV cache as kvstage sees it: a list of per-(layer, plane) buffers,
and the copier that moves its chunks (chosen once, on first use)."""

from __future__ import annotations

import logging
import numbers
import threading

import torch

from kvstage.errors import ConfigError
from kvstage.layout import buffer_shape
from kvstage.tp import SideSpec

log = logging.getLogger("kvstage")
_CHOOSING = threading.Lock()  # a cache's copier is chosen (and logged) once, whichever thread asks first


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class RankCache:
    """The buffers of rank ``rank`` of ``spec``, ordered layer-major: L0.K, L0.V, L1.K, ...

    Buffers may live anywhere (separate allocations per layer, views of one pool).
    ``copier``: "cuda", "native" or "torch" to force how chunks are copied (a
    diagnostic, or a test of one implementation); None: ``staging.copier.choose_copier``'s
    rule. A name that cannot run here is refused when the copier is first used."""

    def __init__(self, spec: SideSpec, rank: int, buffers: list[torch.Tensor], copier: str | None = None):
        self.spec, self.rank, self.buffers = spec, rank, buffers
        self.copier_name = copier  # the copier asked for by name, None for the rule's choice
        self._chosen = None  # the Copier, once chosen
        geo = spec.geometry
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or not 0 <= rank < spec.tp:
            raise ConfigError(f"rank={rank!r}: must be an integer in [0, {spec.tp}) (tp={spec.tp})")
        if len(self.buffers) != geo.buffers:
            raise ConfigError(
                f"buffers: got {len(self.buffers)}, need layers*planes = {geo.layers}*{geo.planes} = {geo.buffers}"
            )
        pages = self.buffers[0].shape[0]
        want = buffer_shape(geo, spec.page, spec.local_heads(), pages)
        dtype = torch_dtype(geo.dtype)
        for i, b in enumerate(self.buffers):
            if tuple(b.shape) != want or b.dtype != dtype or not b.is_contiguous():
                raise ConfigError(
                    f"buffer {i}: shape {tuple(b.shape)} dtype {b.dtype} contiguous={b.is_contiguous()}; "
                    f"need contiguous {want} of {dtype} ({spec.page.order})"
                )
            if b.device != self.buffers[0].device:
                raise ConfigError(
                    f"buffer {i} is on {b.device}, buffer 0 on {self.buffers[0].device}: one device per rank"
                )

    @property
    def pages(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def copier(self):
        """How this cache's chunks are copied (``staging.copier.choose_copier``): chosen at
        first use and kept, since every chunk's copy goes through it; logged in one line."""
        chosen = self._chosen
        if chosen is None:
            with _CHOOSING:
                if self._chosen is None:
                    from kvstage.staging.copier import choose_copier

                    self._chosen = choose_copier(self, self.copier_name)
                    log.info("rank %d copies: %s (%s)", self.rank, self._chosen.name, self._chosen.why)
                chosen = self._chosen
        return chosen

    @classmethod
    def allocate(
        cls, spec: SideSpec, rank: int, pages: int, device="cpu", fill: float | None = 0, copier: str | None = None
    ) -> RankCache:
        """Allocate a fresh cache (tests, the benchmark)."""
        shape = buffer_shape(spec.geometry, spec.page, spec.local_heads(), pages)
        dt = torch_dtype(spec.geometry.dtype)
        bufs = [torch.empty(shape, dtype=dt, device=device) for _ in range(spec.geometry.buffers)]
        if fill is not None:
            for b in bufs:
                b.view(torch.uint8).fill_(int(fill))
        return cls(spec, rank, bufs, copier)
