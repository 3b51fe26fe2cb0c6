"""The CUDA copier: one fused kernel launch per chunk (``cuda_copy.WordCopier``), into
device memory or a pinned host arena, its page ids uploaded once per request.

A call the kernel cannot run (words not 16-byte aligned, a region the GPU cannot
reach, indices past 32 bits: ``supports``) is copied the torch way, exactly as the
torch copier copies it.
"""

from __future__ import annotations

from kvstage.staging import cuda_copy
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

    def prepare(self, idx, pieces, region, to_region: bool) -> cuda_copy.PreparedCopy:
        """The chunk's kernel launch for pieces already checked (``Copier.check``), built now
        and launched by calling it: the set-up leaves the path of the copy."""
        if idx.kernel_pages is None:
            return self.kernel.prepare(idx.chunk_pages, idx.first, idx.count, pieces, region, to_region)
        return self.kernel.prepare(idx.kernel_pages, idx.first, idx.count, pieces, region, to_region, idx.first_page)

    def launch(self, idx, pieces, region, to_region: bool) -> None:
        """The chunk's kernel launch, at once, from this thread's own argument block, so no
        launch object is built per chunk on a source's path."""
        if idx.kernel_pages is None:
            return self.kernel.launch(idx.chunk_pages, idx.first, idx.count, pieces, region, to_region)
        return self.kernel.launch(idx.kernel_pages, idx.first, idx.count, pieces, region, to_region, idx.first_page)

    def _gather(self, idx, pieces, region) -> None:
        if not self.supports(region, pieces, idx.count):
            return super()._gather(idx, pieces, region)
        self.launch(idx, pieces, region, to_region=True)

    def _scatter(self, idx, pieces, region, threads=None) -> None:
        if not self.supports(region, pieces, idx.count):
            return super()._scatter(idx, pieces, region, threads)
        self.launch(idx, pieces, region, to_region=False)

    def _prepare_scatter(self, idx, pieces, region, threads=None):
        """All set-up now; the call is one kernel launch."""
        if not self.supports(region, pieces, idx.count):
            return super()._prepare_scatter(idx, pieces, region, threads)
        return self.prepare(idx, pieces, region, to_region=False)

    def _prepare_piece_scatters(self, idx, pieces, region) -> list | None:
        if not self.supports(region, pieces, idx.count):
            return None
        return [self.prepare(idx, [piece], region, to_region=False) for piece in pieces]
