"""The copier contract: how one rank's cache copies a chunk to and from a staging region.

A region holds, for ``count`` tokens and ``heads`` heads, the bytes of every
(layer, plane) buffer in order: ``[buffers, count, heads, head_dim]``. The
source gathers with its own page size and layout; the destination scatters
with its own, which is how page size and NHD/HND conversion happen.

Three implementations, one per file, chosen once per cache by ``choose_copier``
(``RankCache.copier``, which logs the choice in one line):

- ``cuda`` (``copier_cuda``): one fused kernel launch per chunk and piece list;
- ``native`` (``copier_native``): a host cache's spans in one native call per chunk
  and piece, with streaming stores;
- ``torch`` (``copier_torch``): torch and numpy indexed copies, on any device.

``pieces`` are ``(head_lo, heads, byte offset in the region)``, one per writer of
a chunk; ``idx`` is a ``staging.copy.TokenIndex``, built once per chunk.
"""

from __future__ import annotations

import abc

from kvstage.errors import ConfigError
from kvstage.staging.copy import TokenIndex

COPIERS = ("cuda", "native", "torch")


class Copier(abc.ABC):
    """One cache's copies. ``name`` says which implementation, ``why`` why it was chosen
    (the one log line)."""

    name: str = ""
    #: whether ``upload_pages`` moves the ids somewhere a copy reads them unchecked (the kernel),
    #: so they are bounds-checked first; a copier that indexes on the host checks each chunk's own
    uploads: bool = False

    def __init__(self, cache, why: str = ""):
        self.cache, self.why = cache, why

    def upload_pages(self, page_ids):
        """A request's page ids where this copier reads them, once when the request is posted,
        so no chunk's copy waits for an upload; None where the copies index on the host."""
        return None

    def supports(self, region, pieces, count: int) -> bool:
        """Whether this copier runs these pieces of ``region`` itself, so a caller can tell
        its own path from a fallback (the kernel cannot reach every region)."""
        return True

    @abc.abstractmethod
    def gather(self, idx: TokenIndex, head_lo: int, heads: int, region) -> None:
        """Copy local heads ``[head_lo, head_lo+heads)`` of the indexed tokens into ``region``:
        a source's chunk, laid out for one write."""

    def gather_pieces(self, idx: TokenIndex, pieces) -> None:
        """Gather several head slices of the same tokens, each into its own region,
        ``pieces`` = [(head_lo, heads, region)]: a 1->N source's chunk, one piece per
        destination's mapped arena, which an implementation may fill in one pass."""
        for lo, n, region in pieces:
            self.gather(idx, lo, n, region)

    @abc.abstractmethod
    def scatter(self, idx: TokenIndex, head_lo: int, heads: int, region) -> None:
        """Copy ``region`` into local heads ``[head_lo, head_lo+heads)`` of the indexed tokens:
        one writer's part of a slot."""

    @abc.abstractmethod
    def scatter_chunk(self, idx: TokenIndex, pieces, region, threads=None) -> None:
        """Scatter every writer's part of a slot in one call, so an implementation can place
        them together; ``threads`` (``staging.copy.CopyThreads``) may take a share of a host scatter."""

    def prepare_scatter(self, idx: TokenIndex, pieces, region, threads=None):
        """``scatter_chunk`` made ready when the chunk is granted, a callable that runs it, so
        the set-up is off the path between the last writer landing and the pages being written."""
        return lambda: self.scatter_chunk(idx, pieces, region, threads)

    def prepare_piece_scatters(self, idx: TokenIndex, pieces, region) -> list | None:
        """One prepared scatter per piece, so each writer's piece can go to the pages the moment
        it lands; None where a chunk's pieces scatter in one pass (``prepare_scatter``)."""
        return None

    def load(self) -> None:
        """Load what the copies run on (a kernel) now, since loading at the first copy may
        wait for work already queued on the device."""


def choose_copier(cache, want: str | None = None) -> Copier:
    """The copier for ``cache``, by the rule: a CUDA cache copies with the fused kernel where
    CuPy/NVRTC can build it, else with torch; a host cache with the native span copies where
    ``_spans`` was built, else with torch. ``want`` names one ("cuda", "native", "torch");
    one that cannot run here raises ``ConfigError`` naming the field, the value and why."""
    from kvstage.staging import cuda_copy, hostcopy
    from kvstage.staging.copier_cuda import CudaCopier
    from kvstage.staging.copier_native import NativeCopier
    from kvstage.staging.copier_torch import TorchCopier

    if want is not None and want not in COPIERS:
        raise ConfigError(f"copier={want!r}: must be one of {', '.join(COPIERS)}, or unset for the rule's choice")
    on_gpu = cache.device.type == "cuda"
    if want == "torch":
        return TorchCopier(cache, "torch indexed copies, forced: copier='torch'")
    if want == "cuda" and not on_gpu:
        raise ConfigError(f"copier='cuda': this rank's cache is on {cache.device}; the kernel copies CUDA caches")
    if want == "native" and on_gpu:
        raise ConfigError(f"copier='native': this rank's cache is on {cache.device}; native span copies are for "
                          "host caches")
    if on_gpu:
        if cuda_copy.available():
            return CudaCopier(cache, "one fused kernel launch per chunk, CuPy/NVRTC")
        if want == "cuda":
            raise ConfigError("copier='cuda': the fused kernel needs CuPy with a CUDA device, and it is not importable "
                              "here (install the CuPy build for this CUDA version)")
        return TorchCopier(cache, "torch indexed copies: the fused kernel needs CuPy, which is not importable here")
    if hostcopy.available():
        return NativeCopier(cache, "streaming span copies, kvstage.staging._spans")
    if want == "native":
        raise ConfigError(f"copier='native': {hostcopy.why_unavailable()}")
    return TorchCopier(cache, f"torch/numpy indexed copies: {hostcopy.why_unavailable()}")
