"""The native copier: a host cache's chunk as byte spans, copied in one native call
per chunk and piece (``hostcopy.SpanCopy``: ``_spans.c``, with streaming stores,
which skip the read of each destination line that ordinary stores make).

A region this copier cannot address (not host memory, not contiguous: ``supports``)
is copied the torch way, exactly as the torch copier copies it.
"""

from __future__ import annotations

import numpy as np

from kvstage.staging import hostcopy
from kvstage.staging.copier_torch import TorchCopier
from kvstage.staging.spans import buffer_spans


class NativeCopier(TorchCopier):
    name = "native"

    def supports(self, region, pieces=None, count: int = 0) -> bool:
        return region.device.type == "cpu" and region.is_contiguous()

    def gather(self, idx, head_lo: int, heads: int, region) -> None:
        """Each buffer's spans laid end to end in its part of the region, one native call."""
        if not self.supports(region):
            return super().gather(idx, head_lo, heads, region)
        cache = self.cache
        offsets, lengths = buffer_spans(cache, idx.page_ids, idx.start, idx.count, head_lo, heads)
        copy = hostcopy.SpanCopy(np.cumsum(lengths) - lengths, offsets, lengths)
        per, base, room = copy.nbytes, region.data_ptr(), region.nbytes
        copy.run([(base + b * per, max(0, min(per, room - b * per))) for b in range(len(cache.buffers))],
                 [(buf.data_ptr(), buf.nbytes) for buf in cache.buffers])

    def scatter(self, idx, head_lo: int, heads: int, region) -> None:
        """The region's spans to their places in every buffer, one native call."""
        if not self.supports(region):
            return super().scatter(idx, head_lo, heads, region)
        self._prepared(idx, [(head_lo, heads, 0)], region, None)()

    def scatter_chunk(self, idx, pieces, region, threads=None) -> None:
        """Each piece's spans, one native call per piece; ``threads`` take a share of the buffers."""
        if not self.supports(region):
            return super().scatter_chunk(idx, pieces, region, threads)
        self._prepared(idx, pieces, region, threads)()

    def prepare_scatter(self, idx, pieces, region, threads=None):
        """The spans are found and checked now; the call only copies."""
        if not self.supports(region):
            return super().prepare_scatter(idx, pieces, region, threads)
        return self._prepared(idx, pieces, region, threads)

    def _prepared(self, idx, pieces, region, threads):
        """A chunk's scatter set up now: each share's (copy, its buffers, their parts of the
        region), so running it only copies; ``threads`` take a share of the buffers each."""
        cache = self.cache
        copies = []
        for lo, n, base in pieces:
            offsets, lengths = buffer_spans(cache, idx.page_ids, idx.start, idx.count, lo, n)
            copy = hostcopy.SpanCopy(offsets, np.cumsum(lengths) - lengths, lengths)
            copies.append((copy, base, copy.nbytes))
        dst = [(b.data_ptr(), b.nbytes) for b in cache.buffers]
        at, room = region.data_ptr(), region.nbytes
        B = len(dst)
        n = 1 if threads is None else threads.threads
        shares = [([(copy, [dst[i] for i in range(k, B, n)],
                     [(at + base + i * per, max(0, min(per, room - base - i * per))) for i in range(k, B, n)])
                    for copy, base, per in copies],) for k in range(n)]

        def run_share(share) -> None:
            for copy, to, frm in share:
                copy.run(to, frm)

        if threads is None:
            return lambda: run_share(shares[0][0])
        return lambda: threads.run(run_share, shares)
