"""A destination's grant order: which waiting request gets the next free slot.

Pure: it sees each waiting request as a ``Waiting`` record, the allocator's
counts and the slots each peer engine holds, and answers with the requests to
serve, in order. Announced requests (every writer said ``ready``: their bytes
are coming) are served first, in arrival order; then early grants, at most
``EARLY_CHUNKS`` per request, and only while at least half the slots stay
free, so requests whose prefill is done never wait behind ones still
computing. One pass gives each waiting request one chunk while slots last; a
slot that frees later goes to the earliest request still waiting.

Slots are shared among peer engines: while several engines wait, none is
granted a slot beyond its share (the slots divided by the engines waiting),
and however long one engine waits alone, it leaves one slot for each other
connected engine. One engine's backlog therefore never takes every slot, and
an engine that stalls while holding its slots leaves the others a slot to go on
with. A lone engine uses every slot.
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
    peer: str = ""  # the peer engine whose writers send it


def eligible(w: Waiting, free: int, count: int) -> bool:
    """Whether ``w`` may be granted its next chunk at all (before fairness)."""
    if w.next_chunk >= w.chunks:
        return False
    return w.announced or (w.next_chunk < EARLY_CHUNKS and (w.direct or early_room(free, count)))


def early_room(free: int, count: int) -> bool:
    """An early grant may take a slot only if at least half the slots stay free after it."""
    return free - 1 >= -(-count // 2)


def engine_limit(count: int, waiting: int, connected: int) -> int:
    """The slots one engine may hold: its share of ``count`` while ``waiting`` engines wait for
    slots, and never more than leaves one slot to each of the other ``connected`` engines."""
    share = -(-count // waiting) if waiting > 1 else count
    return max(1, min(share, count - max(0, connected - 1)))


def grant_order(waiting: list[Waiting], free: int, count: int, held: dict | None = None, connected: int = 1) -> list:
    """The chunks to grant now, as request keys in grant order (a request once per chunk).

    Passes over the waiting requests, announced ones first, each in arrival order,
    give each request one chunk per pass while slots last (a direct request's one
    chunk needs none). ``held``: slots each peer engine holds now; ``connected``:
    peer engines connected. An engine at its ``engine_limit`` is passed over. The
    first request that finds no slot ends the order."""
    out: list = []
    held = dict(held or {})
    left = {w.req: w.next_chunk for w in waiting}
    waiting_engines = {w.peer for w in waiting if eligible(w, free, count) and not w.direct}
    limit = engine_limit(count, len(waiting_engines), max(connected, len(waiting_engines)))
    progressed = True
    while progressed:
        progressed = False
        for w in sorted(waiting, key=lambda w: not w.announced):  # stable: arrival order within each class
            nxt = left[w.req]
            if not eligible(Waiting(w.req, w.announced, nxt, w.chunks, w.direct, w.peer), free, count):
                continue
            if not w.direct:
                if held.get(w.peer, 0) >= limit:
                    continue  # its engine holds its share (``engine_limit``)
                if free < 1:
                    return out
                free -= 1
                held[w.peer] = held.get(w.peer, 0) + 1
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
