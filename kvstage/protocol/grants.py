"""A destination's grant order: which waiting request gets the next free slot.

Pure: it sees each waiting request as a ``Waiting`` record and the allocator's
counts, and answers with the requests to serve, in order. Announced requests
(every writer said ``ready``: their bytes are coming) are served first, in
arrival order; then early grants, at most ``EARLY_CHUNKS`` per request, and
only while at least half the slots stay free, so requests whose prefill is
done never wait behind ones still computing. One pass gives each waiting
request one chunk while slots last; a slot that frees later goes to the
earliest request still waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: chunks a destination grants a request before every source announced it: a source that holds its
#: grant gathers the moment its ``send`` is called, with no round trip; two cover a small request whole
EARLY_CHUNKS = 2


@dataclass
class Waiting:
    """What the order needs to know of one request."""

    req: str
    announced: bool
    next_chunk: int
    chunks: int
    direct: bool  # its one chunk needs no slot


def early_room(free: int, count: int) -> bool:
    """An early grant may take a slot only if at least half the slots stay free after it."""
    return free - 1 >= -(-count // 2)


def grant_order(waiting: list[Waiting], free: int, count: int) -> list[str]:
    """The chunks to grant now, as request ids in grant order (a request once per chunk).

    Passes over the waiting requests, announced ones first, each in arrival order,
    give each request one chunk per pass while slots last (a direct request's one
    chunk needs none); the first request that finds no slot ends the order."""
    out: list[str] = []
    left = {w.req: w.next_chunk for w in waiting}
    progressed = True
    while progressed:
        progressed = False
        for w in sorted(waiting, key=lambda w: not w.announced):  # stable: arrival order within each class
            nxt = left[w.req]
            if nxt >= w.chunks:
                continue
            if not w.announced and (nxt >= EARLY_CHUNKS or not (w.direct or early_room(free, count))):
                continue
            if not w.direct:
                if free < 1:
                    return out
                free -= 1
            left[w.req] = nxt + 1
            out.append(w.req)
            progressed = True
    return out


def chunk_tokens(tokens: int, fit: int, src_page: int, dst_page: int) -> int:
    """Tokens per chunk: as many as fit every writer's slot and the destination's (``fit``),
    cut to whole pages of both sides where a chunk holds that many, so gather and
    scatter move whole pages."""
    step = math.lcm(src_page, dst_page)
    return fit // step * step if fit >= step else fit
