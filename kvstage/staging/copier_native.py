"""The native copier: a host cache's chunk as byte spans, copied in one native call
per piece (``hostcopy.SpanCopy``: ``_spans.c``, with streaming stores, which skip
the read of each destination line that ordinary stores make).

A piece's spans are the same in each of its buffers (``spans.spans_per_buffer``),
only shifted in the region from one buffer to the next, so one span list serves
every buffer of the piece.
A region this copier cannot address (not host memory, not contiguous: ``supports``)
is copied the torch way, exactly as the torch copier copies it.

With ``sums`` the same native call adds up each piece's checksum as it copies
(``hostcopy.SpanSums``: each span summed from the copy's source right after it is
copied, so the bytes are read from memory once); a row window is summed by a pass.
"""

from __future__ import annotations

from kvstage.staging import hostcopy
from kvstage.staging.checksum import segments
from kvstage.staging.copier_torch import TorchCopier
from kvstage.staging.spans import spans_per_buffer


class NativeCopier(TorchCopier):
    name = "native"

    def supports(self, region, pieces=None, count: int = 0) -> bool:
        return region.device.type == "cpu" and region.is_contiguous()

    def _parts(self, idx, piece, region) -> list[tuple[int, int]]:
        """(address, bytes from there to the region's end) of each buffer's part of ``piece``
        in ``region``: where that buffer's spans' region offsets start from."""
        stride = piece.buffer_stride(self.cache.spec.geometry.head_bytes(), idx.count)
        at, room = region.data_ptr(), region.nbytes
        return [(at + i * stride, max(0, room - i * stride)) for i in range(len(piece.buffers))]

    def _buffers(self, piece) -> list[tuple[int, int]]:
        return [(self.cache.buffers[b].data_ptr(), self.cache.buffers[b].nbytes) for b in piece.buffers]

    def _span_sums(self, idx, pieces, region, sums, region_is_dst: bool) -> list:
        """Each piece's ``hostcopy.SpanSums`` where its copy sums it, else None (no sums, or a row window)."""
        if sums is None or not self._fuses(idx, pieces):
            return [None] * len(pieces)
        hb = self.cache.spec.geometry.head_bytes()
        return [
            hostcopy.SpanSums(region_is_dst, region.data_ptr() + p.offset, segments(p, hb, idx.count)[1], sums.piece(k))
            for k, p in enumerate(pieces)
        ]

    def _gather(self, idx, pieces, region, sums=None) -> None:
        """Each piece's spans from every one of its buffers, one native call per piece."""
        if not self.supports(region):
            return super()._gather(idx, pieces, region, sums)
        spec = self.cache.spec
        summed = self._span_sums(idx, pieces, region, sums, True)
        for piece, checksum in zip(pieces, summed, strict=True):
            at_buffer, at_region, lengths = spans_per_buffer(spec, idx.page_ids, idx.start, idx.count, piece)
            hostcopy.SpanCopy(at_region, at_buffer, lengths).run(
                self._parts(idx, piece, region), self._buffers(piece), checksum
            )
        if summed[0] is None:
            self._sum(idx, pieces, region, sums)

    def _sum_cache(self, idx, pieces, sums, extent: int) -> None:
        """Each piece's spans read from its buffers and summed where a gather would put them, one native
        call per piece and no copy (``hostcopy.SpanCopy.sum_only``)."""
        spec, hb = self.cache.spec, self.cache.spec.geometry.head_bytes()
        for k, piece in enumerate(pieces):
            at_buffer, at_region, lengths = spans_per_buffer(spec, idx.page_ids, idx.start, idx.count, piece)
            stride = piece.buffer_stride(hb, idx.count)
            places = [i * stride for i in range(len(piece.buffers))]  # as ``_parts`` with the region at 0
            sink = hostcopy.SpanSums(True, piece.offset, segments(piece, hb, idx.count)[1], sums.piece(k))
            hostcopy.SpanCopy(at_region, at_buffer, lengths).sum_only(places, self._buffers(piece), sink)

    def _scatter(self, idx, pieces, region, threads=None, sums=None) -> None:
        """Each piece's spans, one native call per piece; ``threads`` take a share of the buffers."""
        if not self.supports(region):
            return super()._scatter(idx, pieces, region, threads, sums)
        self._prepared(idx, pieces, region, threads, sums)()

    def _prepare_scatter(self, idx, pieces, region, threads=None, sums=None):
        """The spans are found and checked now; the call only copies (and sums)."""
        if not self.supports(region):
            return super()._prepare_scatter(idx, pieces, region, threads, sums)
        return self._prepared(idx, pieces, region, threads, sums)

    def _prepared(self, idx, pieces, region, threads, sums=None):
        """A chunk's scatter set up now: each share's (copy, its buffers, their parts of the
        region), so running it only copies; ``threads`` take a share of each piece's buffers. The
        callable holds ``region``, whose addresses it copies from."""
        spec = self.cache.spec
        n = 1 if threads is None else threads.threads
        shares = [[] for _ in range(n)]
        summed = self._span_sums(idx, pieces, region, sums, False)
        for piece, checksum in zip(pieces, summed, strict=True):
            at_buffer, at_region, lengths = spans_per_buffer(spec, idx.page_ids, idx.start, idx.count, piece)
            copy = hostcopy.SpanCopy(at_buffer, at_region, lengths)
            to, frm = self._buffers(piece), self._parts(idx, piece, region)
            for k in range(n):  # by buffer: a segment lies in one buffer, so no two shares add to one sum
                if to[k::n]:
                    shares[k].append((copy, to[k::n], frm[k::n], checksum))

        def run_share(share, keep=region) -> None:
            for copy, to, frm, checksum in share:
                copy.run(to, frm, checksum)

        def run() -> None:
            if summed[0] is None:
                self._sum(idx, pieces, region, sums)
            if threads is None:
                run_share(shares[0])
            else:
                threads.run(run_share, [(share,) for share in shares])

        return run
