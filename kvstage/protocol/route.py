"""Which way a request's bytes go: page runs in place (direct) or staged.

Pure: a small cost model, its constants measured on the project's machines
(docs/benchmarks.md, "Known limits"). A write of page runs costs the
transport's per-span price for every run of consecutive pages in every
buffer, plus the bytes at bulk speed; staging costs the bytes at staged
speed, whatever the pages. The direct path is taken only where it is
expected to be at least as fast.

The destination decides, from its own page ids: the source's pages can only
split the runs further, so a request whose destination pages are too
fragmented for the direct path is never sent that way. Where the source's
pages are more fragmented than the destination's, the direct write posts more
spans than estimated; the bench's ``desc/req`` column shows the real count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: bytes per second of one large write (the bulk baseline), by memory: NIXL over cuda_ipc on one H200,
#: and NIXL over cma on the 2-core CPU machine
BULK_BPS = {"cuda": 1.4e12, "cpu": 5.0e9}
#: staged over bulk, measured side by side: a staged byte also crosses memory in the gather and the
#: scatter (one GPU: 0.45-0.51 at 8k tokens; the CPU machine's default run: about 0.4)
STAGED_SHARE = {"cuda": 0.45, "cpu": 0.40}


@dataclass(frozen=True)
class Route:
    """The path of one request and why (the reason is logged once per peer and path)."""

    direct: bool
    spans: int  # the direct write's spans, as estimated from the destination's pages
    direct_s: float
    staged_s: float
    reason: str


def page_runs(page_ids: np.ndarray) -> int:
    """Runs of consecutive page ids (a run moves as one span per buffer)."""
    ids = np.asarray(page_ids, dtype=np.int64)
    if len(ids) == 0:
        return 0
    return int(np.count_nonzero(np.diff(ids) != 1)) + 1


def choose(page_ids: np.ndarray, buffers: int, page_bytes: int, span_cost_s: float, memory: str,
           forced: bool | None = None) -> Route:
    """The route of a request on ``page_ids`` (this side's pages) of ``buffers`` buffers
    whose pages hold ``page_bytes`` each, over a transport charging ``span_cost_s`` per
    span, in ``memory`` ("cuda" or "cpu"). ``forced`` True: direct whatever it costs."""
    if memory not in BULK_BPS:
        raise ValueError(f"memory={memory!r}: must be one of {', '.join(BULK_BPS)}")
    runs = page_runs(page_ids)
    spans = runs * buffers
    nbytes = len(page_ids) * buffers * page_bytes
    bulk = BULK_BPS[memory]
    direct_s = spans * span_cost_s + nbytes / bulk
    staged_s = nbytes / (bulk * STAGED_SHARE[memory])
    est = (f"{runs} page runs x {buffers} buffers = {spans} spans of ~{nbytes // max(spans, 1)} B at "
           f"{span_cost_s * 1e6:g} us each: direct ~{direct_s * 1e3:.3g} ms, staged ~{staged_s * 1e3:.3g} ms")
    if forced:
        return Route(True, spans, direct_s, staged_s, f"direct=True ({est})")
    if direct_s <= staged_s:
        return Route(True, spans, direct_s, staged_s, f"direct is expected to be as fast ({est})")
    return Route(False, spans, direct_s, staged_s, f"staging is expected to be faster ({est})")
