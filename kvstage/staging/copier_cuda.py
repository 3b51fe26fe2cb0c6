"""The CUDA copier: one fused kernel launch per chunk (``cuda_copy.WordCopier``), into
device memory or a pinned host arena, its page ids uploaded once per request.

A call the kernel cannot run (words not 16-byte aligned, a region the GPU cannot
reach, indices past 32 bits: ``supports``) is copied the torch way, exactly as the
torch copier copies it.

The kernel adds up a chunk's checksum as it moves the words where it moves every row
of every piece (``_fuses``); a scatter of a row window (a request that starts inside
the chunk) sums the slot in a pass after the copy, on the same stream. Either way the
sums reach pinned host memory on the copy's stream, before its fence.
"""

from __future__ import annotations

from kvstage.staging import checksum, cuda_copy
from kvstage.staging.copier_torch import TorchCopier


class CudaCopier(TorchCopier):
    name = "cuda"
    uploads = True

    def __init__(self, cache, why: str = ""):
        super().__init__(cache, why)
        self.kernel = cuda_copy.WordCopier(cache.spec, cache.buffers)

    def upload_pages(self, page_ids):
        """On the device, or for a request on at most ``cuda_copy.INLINE_PAGES`` pages kept on the
        host and passed in each launch, so a small request's path has no upload at all."""
        return self.kernel.upload_pages(page_ids)

    def load(self) -> None:
        self.kernel.load()

    def supports(self, region, pieces, count: int) -> bool:
        return self.kernel.supports(region, pieces, count)

    def prepare(self, idx, pieces, region, to_region: int, sums_addr: int = 0) -> cuda_copy.PreparedCopy:
        """The chunk's kernel launch for pieces already checked (``Copier.check``), built now
        and launched by calling it: the set-up leaves the path of the copy."""
        if idx.kernel_pages is None:
            return self.kernel.prepare(
                idx.chunk_pages, idx.first, idx.count, pieces, region, to_region, sums_addr=sums_addr
            )
        return self.kernel.prepare(
            idx.kernel_pages, idx.first, idx.count, pieces, region, to_region, idx.first_page, sums_addr
        )

    def launch(self, idx, pieces, region, to_region: int, sums_addr: int = 0) -> None:
        """The chunk's kernel launch, at once, from this thread's own argument block, so no
        launch object is built per chunk on a source's path."""
        if idx.kernel_pages is None:
            return self.kernel.launch(
                idx.chunk_pages, idx.first, idx.count, pieces, region, to_region, sums_addr=sums_addr
            )
        return self.kernel.launch(
            idx.kernel_pages, idx.first, idx.count, pieces, region, to_region, idx.first_page, sums_addr
        )

    def _sums_at(self, idx, pieces, sums) -> int:
        """Zeroed device sums for the kernel to add into where it sums these pieces itself, else 0."""
        if sums is None or not self._fuses(idx, pieces):
            return 0
        return checksum.on_device(sums, self.cache.device)

    def _after(self, idx, pieces, region, sums, fused: bool) -> None:
        """The sums' way to the host after the copy: the kernel's own, or a pass over the region."""
        if sums is None:
            return
        if fused:
            checksum.to_host(sums)
        else:
            self._sum(idx, pieces, region, sums)

    def _gather(self, idx, pieces, region, sums=None) -> None:
        if not self.supports(region, pieces, idx.count):
            return super()._gather(idx, pieces, region, sums)
        at = self._sums_at(idx, pieces, sums)
        self.launch(idx, pieces, region, True, at)
        self._after(idx, pieces, region, sums, bool(at))

    def _scatter(self, idx, pieces, region, threads=None, sums=None) -> None:
        if not self.supports(region, pieces, idx.count):
            return super()._scatter(idx, pieces, region, threads, sums)
        at = self._sums_at(idx, pieces, sums)
        self.launch(idx, pieces, region, False, at)
        self._after(idx, pieces, region, sums, bool(at))

    def _prepare_scatter(self, idx, pieces, region, threads=None, sums=None):
        """All set-up now; the call is one kernel launch (and, with ``sums``, their copy to the host)."""
        if not self.supports(region, pieces, idx.count):
            return super()._prepare_scatter(idx, pieces, region, threads, sums)
        at = self._sums_at(idx, pieces, sums)
        launch = self.prepare(idx, pieces, region, False, at)
        if sums is None:
            return launch

        def run() -> None:
            launch()
            self._after(idx, pieces, region, sums, bool(at))

        return run

    def _sum_cache(self, idx, pieces, sums, extent: int) -> None:
        """The kernel reading the cache and adding up the sums, with no region (``cuda_copy.SUM_ONLY``)."""
        if not self.kernel.supports(None, pieces, idx.count):
            return super()._sum_cache(idx, pieces, sums, extent)
        at = checksum.on_device(sums, self.cache.device)
        self.launch(idx, pieces, None, cuda_copy.SUM_ONLY, at)
        checksum.to_host(sums)

    def _prepare_piece_scatters(self, idx, pieces, region) -> list | None:
        if not self.supports(region, pieces, idx.count):
            return None
        return [self.prepare(idx, [piece], region, to_region=False) for piece in pieces]
