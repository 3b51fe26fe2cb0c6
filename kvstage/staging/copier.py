"""The copier contract: how one rank's cache copies a chunk to and from a staging region.

A region holds pieces (``staging.region.RegionPiece``): each some local heads of
some (layer, plane) buffers of the chunk's tokens, at its own byte offset, in one
of two orders (``Order.HEADS``: a head's rows contiguous; ``Order.TOKENS``: a
token's heads contiguous), with rows that may be longer than the chunk (a window
of a region sized for a whole request). The source gathers with its own page size
and layout; the destination scatters with its own, which is how page size and
NHD/HND conversion happen.

Three implementations, one per file, chosen once per cache by ``choose_copier``
(``RankCache.copier``, which logs the choice in one line):

- ``cuda`` (``copier_cuda``): one fused kernel launch per chunk and piece list;
- ``native`` (``copier_native``): a host cache's spans in one native call per piece,
  with streaming stores;
- ``torch`` (``copier_torch``): torch and numpy indexed copies, on any device.

Every call checks its pieces against the rank and the region once, here, before
anything moves (``region.check_pieces``); an implementation's ``_gather``,
``_scatter`` and ``_prepare_*`` take pieces already checked. ``idx`` is a
``staging.copy.TokenIndex``, built once per chunk.

``sums`` (a ``staging.checksum.ChunkSums``, or None): the chunk checksum of every
piece's whole rows in the region, filled by the same call (the kernel adds it up as it
moves the words; elsewhere a pass over the region after the copy), readable once the
copy's fence has passed. ``sum_cache`` fills the same sums with no region and no copy:
the paths that gather nothing (ipc, direct, pages) sum a request's pages that way.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from kvstage.errors import ConfigError
from kvstage.staging.checksum import ChunkSums, region_sums
from kvstage.staging.copy import TokenIndex
from kvstage.staging.region import RegionPiece, check_pieces

COPIERS = ("cuda", "native", "torch")


def _nothing() -> None:
    return None


class _Extent:
    """The size of a region that ``sum_cache`` never touches, for the pieces' checks."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


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

    def check(self, idx: TokenIndex, pieces: Sequence[RegionPiece], region) -> tuple[RegionPiece, ...]:
        """``pieces`` checked against this rank and ``region`` (``region.check_pieces``)."""
        spec = self.cache.spec
        geo = spec.geometry
        return check_pieces(
            pieces,
            local_heads=1 if geo.mla else spec.local_heads(),
            buffers=geo.buffers,
            head_bytes=geo.head_bytes(),
            count=idx.count,
            region_bytes=region.nbytes,
        )

    # -- the contract: checked once here, run by the implementation ---------------------------
    def gather(self, idx: TokenIndex, pieces: Sequence[RegionPiece], region, sums: ChunkSums | None = None) -> None:
        """Copy every piece of the indexed tokens from the cache into ``region``: a source's
        chunk, laid out for one write (or one read by its destination)."""
        pieces = self.check(idx, pieces, region)
        if pieces and idx.count:
            self._gather(idx, pieces, region, sums)

    def scatter_chunk(
        self, idx: TokenIndex, pieces: Sequence[RegionPiece], region, threads=None, sums: ChunkSums | None = None
    ) -> None:
        """Copy every piece from ``region`` into the cache in one call, so an implementation can
        place them together; ``threads`` (``staging.copy.CopyThreads``) may take a share of a
        host scatter."""
        pieces = self.check(idx, pieces, region)
        if pieces and idx.count:
            self._scatter(idx, pieces, region, threads, sums)

    def prepare_scatter(
        self, idx: TokenIndex, pieces: Sequence[RegionPiece], region, threads=None, sums: ChunkSums | None = None
    ):
        """``scatter_chunk`` made ready when the chunk is granted, a callable that runs it, so
        the set-up is off the path between the last piece landing and the pages being written."""
        pieces = self.check(idx, pieces, region)
        if not (pieces and idx.count):
            return _nothing
        return self._prepare_scatter(idx, pieces, region, threads, sums)

    def prepare_piece_scatters(self, idx: TokenIndex, pieces: Sequence[RegionPiece], region) -> list | None:
        """One prepared scatter per piece, so each piece can go to the pages the moment it
        lands; None where a chunk's pieces scatter in one pass (``prepare_scatter``)."""
        pieces = self.check(idx, pieces, region)
        if not idx.count:
            return None
        return self._prepare_piece_scatters(idx, pieces, region)

    def sum_cache(self, idx: TokenIndex, pieces: Sequence[RegionPiece], sums: ChunkSums) -> None:
        """``sums`` of every piece of the indexed tokens as they lie in the cache: what a gather of them
        into a region of ``pieces`` would sum, but nothing is copied (the kernel and the native copier
        only read the cache; torch gathers into a temporary region). Readable once a fence closed after
        this call has passed."""
        extent = max((p.offset + p.nbytes(self.cache.spec.geometry.head_bytes(), idx.count) for p in pieces), default=0)
        pieces = self.check(idx, pieces, _Extent(extent))
        if pieces and idx.count:
            self._sum_cache(idx, pieces, sums, extent)

    def load(self) -> None:  # noqa: B027 - a default: a copier with no kernel loads nothing
        """Load what the copies run on (a kernel) now, since loading at the first copy may
        wait for work already queued on the device."""

    @staticmethod
    def _fuses(idx: TokenIndex, pieces) -> bool:
        """Whether a copy that sums as it goes covers the pieces' whole rows: it moves every row of each
        (a row window, a request starting inside the chunk, is summed by a pass instead)."""
        return all(p.rows is None or (p.rows == idx.count and p.row_first == 0) for p in pieces)

    def _sum(self, idx: TokenIndex, pieces: tuple[RegionPiece, ...], region, sums: ChunkSums | None) -> None:
        """``sums`` of the pieces' whole rows by a pass over ``region`` (``checksum.region_sums``), for an
        implementation whose copy does not add them up itself."""
        if sums is not None:
            region_sums(region, pieces, self.cache.spec.geometry.head_bytes(), idx.count, sums)

    # -- what an implementation provides (pieces already checked, at least one, count >= 1) ----
    @abc.abstractmethod
    def _gather(self, idx: TokenIndex, pieces: tuple[RegionPiece, ...], region, sums=None) -> None:
        """``gather``'s copy, and ``sums`` of what it read."""

    @abc.abstractmethod
    def _scatter(self, idx: TokenIndex, pieces: tuple[RegionPiece, ...], region, threads=None, sums=None) -> None:
        """``scatter_chunk``'s copy, and ``sums`` of the region's pieces."""

    def _sum_cache(self, idx: TokenIndex, pieces: tuple[RegionPiece, ...], sums: ChunkSums, extent: int) -> None:
        """``sum_cache``'s sums by a gather into a temporary region on the cache's device."""
        import torch

        self._gather(idx, pieces, torch.empty(extent, dtype=torch.uint8, device=self.cache.device), sums)

    def _prepare_scatter(self, idx: TokenIndex, pieces: tuple[RegionPiece, ...], region, threads=None, sums=None):
        return lambda: self._scatter(idx, pieces, region, threads, sums)

    def _prepare_piece_scatters(self, idx: TokenIndex, pieces: tuple[RegionPiece, ...], region) -> list | None:
        return None


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
        raise ConfigError(
            f"copier='native': this rank's cache is on {cache.device}; native span copies are for host caches"
        )
    if on_gpu:
        if cuda_copy.available():
            return CudaCopier(cache, "one fused kernel launch per chunk, CuPy/NVRTC")
        if want == "cuda":
            raise ConfigError(
                "copier='cuda': the fused kernel needs CuPy with a CUDA device, and it is not importable "
                "here (install the CuPy build for this CUDA version)"
            )
        return TorchCopier(cache, "torch indexed copies: the fused kernel needs CuPy, which is not importable here")
    if hostcopy.available():
        return NativeCopier(cache, "streaming span copies, kvstage.staging._spans")
    if want == "native":
        raise ConfigError(f"copier='native': {hostcopy.why_unavailable()}")
    return TorchCopier(cache, f"torch/numpy indexed copies: {hostcopy.why_unavailable()}")
