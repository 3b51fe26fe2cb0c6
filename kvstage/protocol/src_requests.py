"""A sent request's state on the source: its routes and ``ready`` to each destination rank, the
messages that name it (``read``, ``done``), the engine that takes it and its end. The functions
take the ``Source`` and run on its loop or in ``_here``, under its state lock."""

from __future__ import annotations

import logging
import time

import numpy as np

from kvstage.errors import ProtocolError, TransferFailed
from kvstage.protocol import route, src_chunks, src_sums
from kvstage.protocol.checksums import checksummed
from kvstage.protocol.common import peer_label, remember
from kvstage.protocol.messages import (
    Abort,
    Ready,
)
from kvstage.protocol.outgoing import (
    Outgoing,
    Target,
    group_piece,
    overlaps,
    part_key,
    region_box,
)
from kvstage.protocol.request import State, TransferHandle
from kvstage.protocol.route import Path
from kvstage.tp import Piece

log = logging.getLogger("kvstage")

#: destination addresses remembered that this rank reads nothing to (another source rank covers them),
#: so a later ``connect`` to them needs no handshake (``src_connect``); routes logged are kept as many
MAX_IDLE_ADDRESSES = 1024


def add(
    src,
    handle: TransferHandle,
    pages: np.ndarray,
    engine: str | None,
    caller=None,
    group: range | None = None,
    span: range | None = None,
    total: int = 0,
) -> None:
    """A sent request or part of one (caller's thread, state lock held): route it to each destination rank,
    gather what the read path needs into free slots, record the ready event, say ``ready``."""
    key = (engine, handle.req, part_key(group, span))
    for k, other in src.requests.items():
        if (
            k[1] == handle.req
            and (engine is None or k[0] in (engine, None))
            and overlaps(other.layers, group)
            and overlaps(other.span, span)
        ):
            what = "" if group is None else f"layers {group.start}..{group.stop} of "
            what += "" if span is None else f"tokens {span.start}..{span.stop} of "
            raise ValueError(f"{what}request {handle.req!r} already in flight on source rank {src.rank}")
    if engine is not None:
        eng = src.engines.get(engine)
        if eng is None:
            known = ", ".join(repr(e) for e in src.engines) or "none"
            raise TransferFailed(
                handle.req,
                "-",
                "send",
                f"not connected to any destination rank of engine "
                f"{engine!r} (engines connected: {known}); call connect() first",
            )
        want = [x.dst_rank for x in eng.plan.targets_of(src.rank) if group_piece(eng.plan, x, group) is not None]
        missing = [d for d in want if d not in eng.targets]
        if missing:
            raise TransferFailed(
                handle.req,
                f"destination ranks {missing}" + (f" of engine {engine}" if engine else ""),
                "send",
                "not connected",
            )
        if not want:  # replicas or layer shares: other source ranks serve this engine (or these layers)
            handle._move(State.DONE)
            return
        targets = [eng.targets[d] for d in want]
    else:
        targets = [t for t in src._targets.values() if group_piece(t.plan, t.piece, group) is not None]
    src._finished.pop(key, None)
    out = Outgoing(
        handle,
        pages,
        engine,
        layers=group,
        span=span,
        total=total,
        checksum=checksummed(src.settings.checksum, handle.req),
    )
    last = out.final(src.spec.geometry.layers)  # else a later part still needs the abort
    if src._take_abort(key[:2], handle, keep=not last):  # every destination hears of it
        assert handle.error is not None  # a new handle, failed by _take_abort just now
        for t in targets:
            src._tell(t, Abort(handle.req, handle.error.cause))
        return
    src.requests[key] = out
    if caller is not None:
        order_after_caller(src, out, caller)
    announce(src, out, targets)
    if not out.targets and engine is not None:
        src._maybe_forget(out)


def order_after_caller(src, out: Outgoing, caller) -> None:
    """On CUDA, what reads the pages follows the work queued on the caller's stream (the forward that
    wrote them): the gathers (on the copies' stream, current here) wait on it, and the ready event is
    recorded on it."""
    import torch

    copies = torch.cuda.current_stream(src.cache.device)
    if copies != caller:
        copies.wait_stream(caller)
    out.caller_stream = caller


def announce(src, out: Outgoing, targets: list) -> None:
    """Route ``out`` to each of ``targets`` it has a piece for, gather what its read routes need, and say
    ``ready``."""
    routed = []
    for t in targets:
        if out.piece_of(t) is None:  # a layer group this rank holds none of for ``t`` (layer shares)
            continue
        r = choose_route(src, out, t)
        if r.path is None:
            return src._fail(out.key, t.name, "route", r.reason, tell=True)
        out.targets[(t.engine, t.rank)] = r.path
        routed.append((t, r.path))
    reads = [t for t, path in routed if path is Path.READ]
    gather = bool(reads) and not out.chunks
    if gather:
        src_chunks.plan_read(src, out, reads)
    if any(path is Path.IPC for _, path in routed) and not out.event_recorded:
        src._ipc["event"].record(out.caller_stream)
        out.event_recorded = True
    for t, path in routed:
        src._tell(t, ready_message(src, out, t, path))
        out.told.add((t.engine, t.rank))
    paged = [t for t, path in routed if path is not Path.READ]
    if out.checksum and paged:  # after the readies: the destinations read while this rank sums
        src_sums.start(src, out, paged)
    if gather:  # each chunk is announced as it is gathered: the destination reads the first meanwhile
        for c in out.chunks:
            if not src_chunks.gather_chunk(src, out, c):
                c.blocked = time.perf_counter()
                src._waiting.append((out, c))
            elif c.gathered:
                src_chunks.announce_chunk(src, out, c)
    if src._gathering:
        src_chunks.finish_here(src, out)
    out.touched = time.monotonic()
    if out.handle.state is State.PENDING and routed:
        out.handle.path = ",".join(sorted({p.value for _, p in routed}))


def choose_route(src, out: Outgoing, t: Target) -> route.Route:
    """``route.choose`` for this request to ``t``, logged once per destination rank and path."""
    memory = "cuda" if src.cache.device.type == "cuda" else "cpu"
    piece, spec = out.piece_of(t), src.spec
    assert piece is not None  # _announce routes only the targets it has a piece for
    nbytes = t.plan.piece_token_bytes(piece) * out.handle.tokens
    runs = route.page_runs(out.pages) * len(piece.buffers)
    page_spans = _page_span_count(spec, out.pages, out.handle.tokens, piece) if memory == "cpu" else 0
    box = region_box([piece] if out.engine is not None else None, spec, out.buffers(t.plan))
    per = min(src.slot_bytes // box.token_bytes, t.capacity)
    fits = per > 0 and -(-out.handle.tokens // per) <= src.arena.allocator.free
    link = route.Link(
        memory,
        t.ipc,
        bool(src._kv_regions),
        t.plan.direct,
        src.transport.read_span_cost_s.get(memory, 0.0),
        t.paths,
    )
    if not t.paths:
        return route.Route(
            None,
            f"path={src.settings.path} is not allowed to this destination rank: a page path "
            "needs KVSTAGE_AUTH_TOKEN on both sides (its KV pages are read only by a peer that "
            "presented the token), and both sides' path settings must allow it",
        )
    r = route.choose(link, route.Request(nbytes, runs, page_spans, fits))
    key = (t.engine, t.rank, r.path)
    if r.path is not None and key not in src._routes:
        remember(src._routes, key, True, MAX_IDLE_ADDRESSES)
        log.info("src %d: requests to %s go %s: %s (first: %s)", src.rank, t.name, r.path, r.reason, out.handle.req)
    return r


def ready_message(src, out: Outgoing, t: Target, path: Path) -> Ready:
    """The ``ready`` for destination rank ``t``: its path and what that path reads."""
    if path is not Path.READ:
        return Ready(
            out.handle.req,
            out.total or out.handle.tokens,
            path.value,
            out.pages.tolist(),
            layers=out.layers_wire,
            span=out.span_wire,
            checksum=out.checksum or None,
        )
    listed = [src_chunks.listing(src, out, c, t) for c in out.chunks if c.gathered]
    assert out.box is not None  # a read-path request: plan_read made its box
    return Ready(
        out.handle.req,
        out.total or out.handle.tokens,
        path.value,
        None,
        out.chunks[0].count if out.chunks else None,
        len(out.chunks),
        listed,
        out.box.order.value,
        out.layers_wire,
        out.span_wire,
        out.checksum or None,
    )


def lookup(src, engine: str, req: str, group: range | None = None, span: range | None = None) -> Outgoing | None:
    g = part_key(group, span)
    return src.requests.get((engine, req, g)) or src.requests.get((None, req, g))


def groups_of(src, engine: str, req: str) -> list[Outgoing]:
    """Every part of ``req`` in flight to ``engine`` (or to any engine), in token then layer order."""
    outs = [o for k, o in src.requests.items() if k[1] == req and k[0] in (engine, None)]
    return sorted(
        outs, key=lambda o: (-1 if o.span is None else o.span.start, -1 if o.layers is None else o.layers.start)
    )


def request_of(
    src, target: Target, req: str, group: range | None = None, span: range | None = None, take: bool = True
) -> Outgoing:
    """The in-flight request ``req`` (its part: layer group ``group``, token span ``span``) a message of
    ``target`` names, with ``take`` taken by its engine (``take_request``)."""
    out = lookup(src, target.engine, req, group, span)
    if out is None:
        g = part_key(group, span)
        what = f"request {req!r}" + ("" if group is None else f" layers {group.start}..{group.stop}")
        what += "" if span is None else f" tokens {span.start}..{span.stop}"
        if (target.engine, req, g) in src._finished or (None, req, g) in src._finished:
            raise ProtocolError(f"{what} already {src._finished.get((target.engine, req, g), 'finished')} here")
        raise ProtocolError(f"{what} is not in flight here")
    if (target.engine, target.rank) not in out.told:
        raise ProtocolError(f"request {req!r} was not offered to {target.name}")
    if out.bound not in (None, target.engine):
        raise ProtocolError(f"request {req!r} was taken by engine {out.bound!r}")
    if take:
        take_request(src, out, target)
    return out


def take_request(src, out: Outgoing, target: Target) -> None:
    """``target``'s engine reads ``out``: one sent to any engine is taken by it (the others hear
    ``abort``), and the request is under way."""
    req = out.handle.req
    if out.bound is None:
        out.bound = target.engine
        log.debug("src %d: %s taken by engine %r", src.rank, req, target.engine)
        for t in src._targets.values():
            if t.engine != target.engine and (t.engine, t.rank) in out.told:
                src._tell(t, Abort(req, f"taken by engine {target.engine!r}"))
                out.targets.pop((t.engine, t.rank), None)
        for c in out.chunks:
            for e in [e for e in c.readers if e != target.engine]:
                del c.readers[e]
            src_chunks.maybe_free(src, out, c)
    if out.handle.state is State.PENDING:
        out.handle._move(State.TRANSFERRING)


def maybe_done(src, out: Outgoing) -> None:
    want = {d for (e, d) in out.targets if e == out.bound}
    if out.handle.done() or not want or not want <= out.done:
        return
    for c in out.chunks:  # every reader reported every chunk it read (``done`` follows its last ``read``)
        if c.slot is not None and not c.offers:
            src.arena.allocator.release(c.slot)
            c.slot = None
    if any(c.slot is not None for c in out.chunks):  # offers not over yet (``_poll_offers``)
        src._draining.append(out)
    out.handle.bytes = sum(out_bytes(out, t) for t in src._targets.values() if (t.engine, t.rank) in out.targets)
    out.handle._move(State.DONE)
    seconds = out.handle.seconds
    assert seconds is not None  # DONE just now: its end time is set
    src.metrics.request_finished(peer_label(out.bound), True, seconds, out.handle.bytes)
    src._maybe_forget(out)


def drop_target(src, out: Outgoing, t: Target) -> None:
    """An engine that did not take a request sent to any engine lets it go (aborted there, or gone)."""
    out.targets.pop((t.engine, t.rank), None)
    out.told.discard((t.engine, t.rank))
    for c in out.chunks:
        readers = c.readers.get(t.engine)
        if readers is not None:
            readers.discard(t.rank)


def _page_span_count(spec, pages: np.ndarray, tokens: int, piece: Piece) -> int:
    """Spans a destination's pages read of ``piece`` would post (the route's estimate)."""
    from kvstage.staging.region import RegionPiece
    from kvstage.staging.spans import cheapest_order, piece_spans

    order = cheapest_order(spec, piece.heads.count)
    rp = RegionPiece(piece.src_offset, piece.heads.count, piece.buffers, 0, order)
    return len(piece_spans(spec, pages, 0, tokens, rp)[0])


def out_bytes(out: Outgoing, t: Target) -> int:
    piece = out.piece_of(t)
    return 0 if piece is None else t.plan.piece_token_bytes(piece) * out.handle.tokens
