"""The source's read path, chunk by chunk: a request cut into chunks, each gathered into a slot of
its arena and announced to its readers, the offers of a two-sided transport, and a slot's return
once every reader has read it. The functions take the ``Source``, under its state lock."""

from __future__ import annotations

import logging
import time

from kvstage.errors import KVStageError
from kvstage.protocol.checksums import expected
from kvstage.protocol.common import b64, unb64
from kvstage.protocol.messages import (
    Chunk,
)
from kvstage.protocol.outgoing import (
    Outgoing,
    SrcChunk,
    Target,
    plan_chunks,
    region_box,
)
from kvstage.protocol.route import Path
from kvstage.staging.checksum import ChunkSums
from kvstage.staging.copy import TokenIndex, gather, upload_pages
from kvstage.staging.fence import CopyFence
from kvstage.transports.base import Spans, WriteState

log = logging.getLogger("kvstage")


#: on CUDA, a ``send`` whose gathers are launched waits this long on the caller's thread for them and
#: announces them from there: the loop would first have to wake, which takes longer on a GPU host
SEND_WAIT_S = 200e-6


def plan_read(src, out: Outgoing, reads: list) -> None:
    """Cut ``out`` into chunks for the read path. A request sent to any engine gathers this rank's whole
    shard, which every engine's pieces lie in."""
    pieces = [p for p in (out.piece_of(t) for t in reads) if p is not None] if out.engine is not None else None
    assert pieces is None or len(pieces) == len(reads)  # every read target was routed: it has a piece
    out.box = region_box(pieces, src.spec, out.buffers(reads[0].plan))
    capacity = min(t.capacity for t in reads)
    out.chunks = plan_chunks(
        out.handle.tokens,
        src.slot_bytes // out.box.token_bytes,
        capacity,
        src.spec.page.page_size,
        [t.plan.dst.page.page_size for t in reads],
    )
    if src.cache.device.type == "cuda" and out.kernel_pages is None:
        out.kernel_pages = upload_pages(src.cache, out.pages, checked=True)


def gather_chunk(src, out: Outgoing, c: SrcChunk) -> bool:
    """Gather chunk ``c`` into a free slot; False where none is free (it waits for one)."""
    slot = src.arena.allocator.acquire()
    if slot is None:
        return False
    assert out.box is not None  # plan_read made it with the chunks
    c.slot, c.offset = slot, src.arena.offset(slot)
    t0 = time.perf_counter()
    idx = TokenIndex(src.cache, out.pages, c.start, c.count, out.kernel_pages)
    region = src.arena.view(c.offset, out.box.nbytes(c.count))
    try:
        fence = CopyFence(src.cache.device)
        piece = out.box.piece()
        if out.checksum:
            c.sums = ChunkSums.of([piece], src.spec.geometry.head_bytes(), c.count)
        gather(src.cache, idx, [piece], region, c.sums)
        c.fence = fence.close()
    except Exception as e:
        src.arena.allocator.release(slot)
        c.slot = None
        src._fail(out.key, "local", "gather", f"{type(e).__name__}: {e}", tell=True)
        return True
    took = time.perf_counter() - t0
    out.handle.stages["gather"] += took
    src.metrics.stage("gather", took)
    if c.fence.done():
        c.gathered = True
    else:
        src._gathering.append((out, c))
    log.debug(
        "src %d: %s chunk %d gathered into slot %d%s",
        src.rank,
        out.handle.req,
        c.index,
        slot,
        "" if c.gathered else " (launched)",
    )
    return True


def announce_chunk(src, out: Outgoing, c: SrcChunk) -> None:
    """Tell every read destination rank told of ``out`` (and not passed over) that chunk ``c`` is gathered."""
    for t in read_targets(src, out):
        if (t.engine, t.rank) in out.told and (out.bound is None or out.bound == t.engine):
            index, offset, ticket, *checksum = listing(src, out, c, t)
            src._tell(
                t,
                Chunk(
                    out.handle.req,
                    index,
                    offset,
                    unb64(ticket) or None,
                    out.layers_wire,
                    out.span_wire,
                    checksum[0] if checksum else None,
                ),
            )


def read_targets(src, out: Outgoing) -> list:
    return [t for t in src._targets.values() if out.targets.get((t.engine, t.rank)) is Path.READ]


def listing(src, out: Outgoing, c: SrcChunk, t: Target) -> list:
    """[index, offset, ticket] of ``t``'s piece of gathered chunk ``c``: where it lies in this arena, and
    for a two-sided transport the offer its receive matches."""
    piece = out.piece_of(t)
    assert out.box is not None and piece is not None  # a read target's chunk: planned, and it has a piece
    offset, nbytes = out.box.piece_span(piece, c.count)
    ticket = b""
    if src.transport.reads_offered:
        ticket, handle = src.transport.offer(t.agent, Spans.single(src.arena_region, [c.offset + offset], [nbytes]))
        c.offers.append(handle)
    c.readers.setdefault(t.engine, set()).add(t.rank)
    if c.sums is None:
        return [c.index, c.offset + offset, b64(ticket)]
    return [c.index, c.offset + offset, b64(ticket), expected(c.sums, out.box, piece, c.count)]


def finish_here(src, out: Outgoing) -> None:
    """On CUDA: wait up to ``SEND_WAIT_S`` on the caller's thread for ``out``'s gathers that started on
    the device, and announce them from here (the loop does it otherwise)."""
    mine = [c for o, c in src._gathering if o is out]
    if not mine or not all(c.fence.started() for c in mine):
        return
    deadline = time.perf_counter() + SEND_WAIT_S
    while not all(c.fence.done() for c in mine) and time.perf_counter() < deadline:
        pass
    poll_gathers(src)


def poll_gathers(src) -> None:
    """Announce every chunk whose gather has passed its fence to the destination ranks told of its request."""
    still = []
    for out, c in src._gathering:
        if not c.fence.done():
            still.append((out, c))
            continue
        c.gathered = True
        gpu = c.fence.gpu_seconds()
        if gpu is not None:
            out.handle.stages["gather_gpu"] = out.handle.stages.get("gather_gpu", 0.0) + gpu
        if not out.handle.done():
            announce_chunk(src, out, c)
    src._gathering = still


def poll_offers(src) -> None:
    """Two-sided transports: an offer is over once its reader took the bytes; a chunk's slot returns once
    every reader said ``read`` and every offer of it is over (a done request's too: its ``done`` may come
    before this side saw its offers end)."""
    for out in list(src.requests.values()) + src._draining:
        for c in out.chunks:
            if not c.offers:
                continue
            pending = []
            for h in c.offers:
                try:
                    over = src.transport.poll(h) is not WriteState.PENDING
                except KVStageError:
                    over = True  # a failed offer: its reader's read fails too, and says so
                if over:
                    src.transport.release(h)
                else:
                    pending.append(h)
            c.offers = pending
            maybe_free(src, out, c)
    for out in src._draining:  # done: every reader has read every chunk; a slot returns with its offers
        for c in out.chunks:
            if c.slot is not None and not c.offers:
                src.arena.allocator.release(c.slot)
                c.slot = None
    src._draining = [out for out in src._draining if any(c.slot is not None for c in out.chunks)]


def maybe_free(src, out: Outgoing, c: SrcChunk) -> None:
    """Return chunk ``c``'s slot once the engine that reads it has (every rank's ``read``, every offer over)."""
    if c.slot is None or c.offers or not c.gathered or out.bound is None or c.readers.get(out.bound):
        return
    if (out.bound, c.index) in out.freed:
        return
    src.arena.allocator.release(c.slot)
    c.slot = None
    out.freed.add((out.bound, c.index))
    log.debug("src %d: %s chunk %d read: slot free", src.rank, out.handle.req, c.index)


def gather_waiting(src) -> None:
    """Gather the chunks that found no free slot (``src._waiting``), oldest first, while slots are free."""
    while src._waiting:
        out, c = src._waiting[0]
        if out.handle.done():
            src._waiting.popleft()
            continue
        if not gather_chunk(src, out, c):
            return  # back-pressure: wait for the destination to read a slot
        src._waiting.popleft()
        waited = time.perf_counter() - c.blocked
        out.handle.stages["slot_wait"] += waited
        src.metrics.stage("slot_wait", waited)
        if c.gathered:
            announce_chunk(src, out, c)
