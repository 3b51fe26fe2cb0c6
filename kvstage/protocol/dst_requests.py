"""An expected request's state on the destination: ``expect``'s record of it, the writers' readies
and chunks (kept early when they come first), its parts, the moves each part starts, and its end.
The functions take the ``Destination`` and run on its loop or in ``_here``, under its state lock."""

from __future__ import annotations

import logging
import time

import numpy as np

from kvstage.errors import KVStageError, ProtocolError
from kvstage.ids import ReqKey
from kvstage.protocol import dst_grants
from kvstage.protocol.common import b64, peer_label, rank_name, remember
from kvstage.protocol.incoming import Group, Incoming, SourceEngine, Writer, add_chunk, check_ready
from kvstage.protocol.messages import (
    Chunk,
    Done,
    Sums,
)
from kvstage.protocol.messages import Ready as ReadyMessage
from kvstage.protocol.outgoing import group_piece, overlaps, part_key
from kvstage.protocol.reads import ArenaMove, DirectMove, IpcMove
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.route import Path
from kvstage.staging.copy import upload_pages

log = logging.getLogger("kvstage")


#: requests this side was told are ready before it expected them, kept at most this many (the oldest go)
MAX_EARLY = 4096


def add(dst, handle: TransferHandle, pages: np.ndarray, engine: str, first: int) -> None:
    key = (engine, handle.req)
    if key in dst.requests:
        raise ValueError(
            f"request {handle.req!r} of engine {engine!r} is already in flight on destination rank {dst.rank}"
        )
    if dst._take_abort(key, handle):  # a writer aborted it already: the others hear of it now
        dst._early.pop(key, None)
        return
    inc = Incoming(handle, pages, engine, first, kernel_pages=upload_pages(dst.cache, pages, checked=True))
    dst.requests[key] = inc
    gone = dst._gone.get(engine)
    if gone is not None and engine not in dst.engines:
        dst._early.pop(key, None)
        return dst._fail(key, f"prefill engine {engine!r}", "waiting for writers", gone, tell=False)
    eng = dst.engines.get(engine)
    lost = [p.src_rank for p in eng.pieces(dst.rank) if p.src_rank in eng.lost] if eng is not None else []
    if lost:  # a rank it needs left (a dead prefill's ranks leave one by one): it fails now, not at a timeout
        assert eng is not None  # lost is empty without an engine
        dst._early.pop(key, None)  # the ranks still here hear the abort
        return dst._fail(
            key, f"source rank {lost[0]} of engine {engine}", "waiting for writers", eng.lost[lost[0]], tell=True
        )
    for rank, news in dst._early.pop(key, {}).items():
        w = dst.engines[engine].writers.get(rank) if engine in dst.engines else None
        for msg in news:
            if w is not None and not inc.handle.done():
                on_request_message(dst, w, inc, msg)
    refresh(dst, inc)


def group(dst, inc: Incoming, layers: range | None, span: range | None = None) -> Group:
    """The part of ``inc`` a message names (made at its first ``ready``): every layer and token, or a
    streamed part (a layer group, a token span, or both), which may not overlap another part of it."""
    key = part_key(layers, span)
    g = inc.groups.get(key)
    if g is not None:
        return g
    eng = dst.engines[inc.engine]
    total, tokens = eng.plan.geometry.layers, inc.first + inc.handle.tokens
    if layers is not None and layers.stop > total:
        raise ProtocolError(f"layers {layers.start}..{layers.stop} of {inc.handle.req!r}: the model has {total}")
    if span is not None and (span.stop > tokens or span.start % eng.plan.src.page.page_size):
        raise ProtocolError(
            f"tokens {span.start}..{span.stop} of {inc.handle.req!r}: must lie within its {tokens} tokens and "
            f"start on a page of the source (page size {eng.plan.src.page.page_size})"
        )
    g = Group(layers, (), span)
    clash = next((o for o in inc.groups.values() if overlaps(o.layers, layers) and overlaps(o.span, span)), None)
    if clash is not None:
        raise ProtocolError(
            f"{inc.handle.req!r}:{g.name or ' all of it'} overlaps the part{clash.name or ' of all of it'} "
            "another source rank (or this one) said ready for"
        )
    g.pieces = tuple(x for x in (group_piece(eng.plan, p, layers) for p in eng.pieces(dst.rank)) if x is not None)
    if span is None:
        g.first, g.count = inc.first, inc.handle.tokens
    else:  # the span's tokens this rank receives: those from ``first`` on
        lo, hi = max(span.start, inc.first), min(span.stop, tokens)
        g.first, g.count, g.dst_start = lo - span.start, max(0, hi - lo), lo - inc.first
    inc.groups[key] = g
    return g


def on_request_message(dst, w: Writer, inc: Incoming, msg: ReadyMessage | Chunk | Sums) -> None:
    """A writer's ``ready``, ``chunk`` or ``sums`` for an expected request, checked; a refused one fails the
    request."""
    p = dst.engines[w.engine].plan
    try:
        if isinstance(msg, ReadyMessage):
            g = group(dst, inc, msg.group, msg.tokens_span)
            if w.rank in g.readies:
                raise ProtocolError(f"ready for {msg.req!r}{g.name} said twice")
            piece = next((x for x in g.pieces if x.src_rank == w.rank), None)
            if piece is None:
                raise ProtocolError(f"ready for {msg.req!r}{g.name}: {w.name} holds none of these layers for this rank")
            if inc.first + inc.handle.tokens != msg.tokens:
                raise ProtocolError(
                    f"the source sends {msg.tokens} tokens of {msg.req!r}; this rank expects "
                    f"tokens {inc.first}..{inc.first + inc.handle.tokens}"
                )
            g.readies[w.rank] = check_ready(
                msg, w, dst.paths, p.piece_token_bytes(piece), p.direct, None if g.span is None else len(g.span)
            )
            log.debug("dst %d: %s%s ready from %s (%s)", dst.rank, msg.req, g.name, w.name, msg.path)
        elif isinstance(msg, Sums):
            sg = inc.groups.get(part_key(msg.group, msg.tokens_span))
            ready = sg.readies.get(w.rank) if sg is not None else None
            if ready is None or ready.path is Path.READ or not ready.checksum or ready.total is not None:
                raise ProtocolError(
                    f"sums for {msg.req!r} from a source that did not say a checksummed ready for the ipc, direct "
                    "or pages path, or said sums twice"
                )
            ready.total = msg.checksum
        else:
            cg = inc.groups.get(part_key(msg.group, msg.tokens_span))
            ready = cg.readies.get(w.rank) if cg is not None else None
            if cg is None or ready is None or ready.path is not Path.READ:
                raise ProtocolError(
                    f"chunk {msg.index} of {msg.req!r} from a source that did not say ready for the read path"
                )
            piece = next(x for x in cg.pieces if x.src_rank == w.rank)
            entry = [msg.index, msg.offset, b64(msg.ticket)]
            checked = entry if msg.checksum is None else [*entry, msg.checksum]
            add_chunk(ready, w, msg.req, checked, p.piece_token_bytes(piece))
    except ProtocolError as e:
        return dst._fail(inc.key, w.name, "ready", str(e), tell=True)
    inc.touched = time.monotonic()


def hold_early(dst, w: Writer, key: ReqKey, msg: ReadyMessage | Chunk | Sums) -> None:
    """A ``ready`` (or ``chunk``, ``sums``) for a request not expected yet: kept for ``expect``, at most
    ``MAX_EARLY`` requests (the oldest go)."""
    news = dst._early.get(key)
    if news is None:
        if not isinstance(msg, ReadyMessage):
            return  # the chunk of a request not expected here, nor announced: nothing to keep it for
        remember(dst._early, key, {}, MAX_EARLY)
        news = dst._early[key]
    news.setdefault(w.rank, []).append(msg)
    if len(news[w.rank]) > 1 + 2 * (msg.chunks if isinstance(msg, ReadyMessage) and msg.chunks else 1) + 4096:
        raise ProtocolError(f"too many messages for {msg.req!r}, which is not expected here")


def refresh(dst, inc: Incoming) -> None:
    """Start each group's moves once every writer it needs is connected and said ``ready`` for it."""
    eng = dst.engines.get(inc.engine)
    if inc.handle.done() or eng is None:
        return
    for g in list(inc.groups.values()):
        if not g.started and all(p.src_rank in g.readies for p in g.pieces):
            start_group(dst, inc, g, eng)
            if inc.handle.done():
                return
    finish(dst, inc)


def start_group(dst, inc: Incoming, g: Group, eng: SourceEngine) -> None:
    g.started = True
    if inc.announced is None:
        inc.announced = time.monotonic()
    inc.handle._move(State.TRANSFERRING)
    paths: dict = {}
    for p in g.pieces:
        w, ready = eng.writers.get(p.src_rank), g.readies[p.src_rank]
        if w is None:
            return dst._fail(inc.key, rank_name(inc.engine, "source", p.src_rank), "read", "not connected", tell=True)
        path = ready.path
        if g.count == 0 and path is not Path.READ:
            continue  # a span wholly before ``first`` (cached here): nothing of it to read
        if path is Path.DIRECT and (g.first % dst.spec.page.page_size or g.dst_start % dst.spec.page.page_size):
            path = Path.PAGES  # the tokens received start inside a page: read the head slices instead
        paths.setdefault(Path.READ if path is Path.PAGES else path, []).append((w, p, ready))
    try:
        if Path.IPC in paths:
            g.moves.append(IpcMove(inc, paths[Path.IPC], g))
        if Path.DIRECT in paths:
            g.moves.append(DirectMove(inc, paths[Path.DIRECT], g))
        if Path.READ in paths:
            move = ArenaMove(inc, paths[Path.READ], dst_grants.own_chunk_tokens(dst, eng, paths[Path.READ]), g)
            need = move.slot_bytes(move.per)
            if need > dst.arena.slot_bytes:
                raise ProtocolError(
                    f"a chunk of {move.per} tokens needs {need} bytes of a slot here, which holds "
                    f"{dst.arena.slot_bytes}; raise KVSTAGE_ARENA_MB on this rank"
                )
            g.moves.append(move)
            dst._order.append((inc.key, part_key(g.layers, g.span)))
        inc.handle.path = ",".join(sorted({m.path.value for m in inc.moves})) or inc.handle.path
        for m in g.moves:
            m.start(dst)
    except KVStageError as e:
        return dst._fail(inc.key, "local", "read", str(e), tell=True)
    except Exception as e:  # a bug must fail its request by name, not leave it waiting
        log.exception("dst %d: starting the reads of %s", dst.rank, inc.handle.req)
        return dst._fail(inc.key, "local", "read", f"{type(e).__name__}: {e}", tell=True)
    inc.stage = "read"
    log.debug("dst %d: %s%s reading (%s)", dst.rank, inc.handle.req, g.name, inc.handle.path)
    dst_grants.start_chunks(dst)
    for m in g.moves:  # a move may be done already (a small ipc read): it times itself first
        if not inc.handle.done():
            m.progress(dst)


def finish(dst, inc: Incoming) -> None:
    """A group is done once its moves are (its writers hear ``done``); the request once every layer is
    in this rank's pages."""
    eng = dst.engines.get(inc.engine)
    if inc.handle.done() or eng is None or not inc.groups:
        return
    for g in inc.groups.values():
        if g.done or not g.started or not all(m.done() for m in g.moves):
            continue
        g.done = True
        if g.layers is not None or g.span is not None:
            log.debug("dst %d: %s%s in", dst.rank, inc.handle.req, g.name)
            for p in g.pieces:
                w = eng.writers.get(p.src_rank)
                if w is not None:
                    dst._tell(w, Done(inc.handle.req, *g.wire))
    total = eng.plan.geometry.layers
    if inc.area_done(total) < total * inc.handle.tokens:
        return
    inc.handle.bytes = eng.plan.dst_token_bytes() * inc.handle.tokens
    inc.handle._move(State.DONE)
    dst.metrics.request_finished(
        peer_label(inc.engine), True, time.monotonic() - (inc.announced or inc.touched), inc.handle.bytes
    )
    del dst.requests[inc.key]
    if None in inc.groups:  # unstreamed: its writers hear ``done`` now (a streamed one's heard it per group)
        for p in eng.pieces(dst.rank):
            w = eng.writers.get(p.src_rank)
            if w is not None:
                dst._tell(w, Done(inc.handle.req))


def owes(dst, inc: Incoming, w: Writer) -> bool:
    """Whether ``inc`` still waits for something only ``w``'s process sends: a ``ready`` (of a part it holds
    layers of, or of the layers and tokens no part covers yet), or a chunk."""
    eng = dst.engines.get(inc.engine)
    if eng is None or not any(p.src_rank == w.rank for p in eng.pieces(dst.rank)):
        return False
    layers = eng.plan.geometry.layers
    if sum(g.area(layers) for g in inc.groups.values()) < layers * inc.handle.tokens:
        return True
    for g in inc.groups.values():
        ready = g.readies.get(w.rank)
        if ready is None and any(p.src_rank == w.rank for p in g.pieces):
            return True
        if ready is not None and ready.path is Path.READ and len(ready.gathered) < ready.chunks:
            return True
        if ready is not None and ready.path is not Path.READ and ready.checksum and ready.total is None:
            return True  # its ``sums``
    return False
