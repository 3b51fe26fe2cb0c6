"""How a destination grants its arena's free slots to the readable chunks of its arena moves (in
``slots.slot_order``), and how many tokens a chunk it cuts itself holds: the arena's side of the
read and pages paths, apart from the per-request state that feeds it."""

from __future__ import annotations

import logging

from kvstage.errors import KVStageError
from kvstage.protocol import slots
from kvstage.protocol.incoming import SourceEngine
from kvstage.protocol.reads import ArenaMove

log = logging.getLogger("kvstage")


def start_chunks(dst) -> None:
    """Hand free slots to the arena moves' readable chunks in ``slots.slot_order``."""
    waiting, moves = [], {}
    for key in list(dst._order):  # (request key, group key)
        inc = dst.requests.get(key[0])
        g = inc.groups.get(key[1]) if inc is not None else None
        move = next((m for m in g.moves if isinstance(m, ArenaMove)), None) if g is not None else None
        if inc is None or move is None or inc.handle.done() or move.done():  # no inc: no move
            dst._order.remove(key)
            continue
        move.skip_unwanted(dst)
        ready = move.readable(dst.arena.allocator.free)
        if ready:
            waiting.append(slots.Waiting(key, len(ready), inc.engine))
            moves[key] = (move, ready)
    a = dst.arena.allocator
    if not waiting or not a.free:
        return
    held = slots_held(dst) if len(dst.engines) > 1 or len({w.peer for w in waiting}) > 1 else None
    for key in slots.slot_order(waiting, a.free, a.count, held, len(dst.engines)):
        move, ready = moves[key]
        slot = a.acquire()
        if slot is None:
            return
        chunk = ready.pop(0)
        try:
            move.begin(dst, chunk, slot)
        except KVStageError as e:  # the chunk holds its slot: the failure's ``stop`` returns it
            dst._fail(key[0], "local", "read", str(e), tell=True)


def slots_held(dst) -> dict[str, int]:
    """Arena slots each source engine's requests hold now (``slots.slot_order`` shares them by it)."""
    held: dict[str, int] = {}
    for inc in dst.requests.values():
        n = sum(m.slots() for m in inc.moves if isinstance(m, ArenaMove))
        if n:
            held[inc.engine] = held.get(inc.engine, 0) + n
    return held


def own_chunk_tokens(dst, eng: SourceEngine, writers: list) -> int:
    """Tokens of a chunk this rank cuts itself (every writer on the pages path): what fits a slot,
    on whole pages of both sides where that many fit."""
    per_token = sum(eng.plan.piece_token_bytes(p) for _, p, _ in writers)
    fit = max(1, dst.arena.slot_bytes // per_token)
    import math

    step = math.lcm(eng.plan.src.page.page_size, dst.spec.page.page_size)
    return fit // step * step if fit >= step else fit
