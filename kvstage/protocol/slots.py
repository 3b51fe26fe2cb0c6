"""A destination's slot order: which reading request's next chunk gets the next free slot.

Pure: it sees each request that has a chunk ready to read as a ``Waiting``
record, the allocator's counts and the slots each peer engine holds, and
answers with the requests to serve, in order: arrival order, one chunk per
request per pass while slots last, so a long request does not hold every slot
while a short one waits behind it.

Slots are shared among peer engines: while several engines wait, none is
given a slot beyond its share (the slots divided by the engines waiting),
and however long one engine waits alone, it leaves one slot for each other
connected engine. One engine's backlog therefore never takes every slot, and
an engine that stalls while holding its slots leaves the others a slot to go on
with. A lone engine uses every slot.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstage.ids import EngineId

#: what a waiting request is keyed by: a ``ReqKey``, or a destination's (``ReqKey``, layer group key)
K = TypeVar("K", bound=Hashable)


@dataclass
class Waiting(Generic[K]):
    """What the order needs to know of one request: how many of its chunks can be read now."""

    req: K  # the request's key (a ``ReqKey``, or a destination's (``ReqKey``, layer group key))
    ready: int  # chunks whose bytes are readable now and have no slot yet
    peer: EngineId = ""  # the peer engine whose sources it reads


def engine_limit(count: int, waiting: int, connected: int) -> int:
    """The slots one engine may hold: its share of ``count`` while ``waiting`` engines wait for
    slots, and never more than leaves one slot to each of the other ``connected`` engines."""
    share = -(-count // waiting) if waiting > 1 else count
    return max(1, min(share, count - max(0, connected - 1)))


def slot_order(
    waiting: list[Waiting[K]], free: int, count: int, held: dict[EngineId, int] | None = None, connected: int = 1
) -> list[K]:
    """The chunks to start now, as request keys in order (a request once per chunk).

    Passes over the waiting requests in arrival order give each one chunk per pass
    while slots last. ``held``: slots each peer engine holds now; ``connected``: peer
    engines connected. An engine at its ``engine_limit`` is passed over."""
    out: list[K] = []
    held = dict(held or {})
    left = {w.req: w.ready for w in waiting}
    engines = {w.peer for w in waiting if w.ready}
    limit = engine_limit(count, len(engines), max(connected, len(engines)))
    progressed = True
    while progressed and free > 0:
        progressed = False
        for w in waiting:
            if not left[w.req] or held.get(w.peer, 0) >= limit:
                continue
            if free < 1:
                return out
            free -= 1
            held[w.peer] = held.get(w.peer, 0) + 1
            left[w.req] -= 1
            out.append(w.req)
            progressed = True
    return out
