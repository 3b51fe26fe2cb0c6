"""The destination's ways to read a request, one small unit per path.

Once every writer of a request said ``ready``, the destination groups its
writers by the path each one named and starts one move per group; the request
is done when every move is. Each move reads with this rank's own transport or
kernel, so no source process is on the request's path from here on:

- ``IpcMove`` (ipc): one kernel launch reads every ipc writer's head slices
  straight out of its pages (opened over CUDA IPC at the handshake), after its
  ready event, and writes this rank's pages, page size and layout converted;
- ``DirectMove`` (direct): one transport read per writer of the page runs of
  its KV buffers straight into this rank's pages;
- ``ArenaMove`` (read, pages): chunk by chunk through this rank's arena: each
  writer's piece is read into a slot (from the writer's arena, one span; or from
  its pages, the spans ``staging.spans.piece_spans`` gives), then scattered into
  this rank's pages; a ``read`` message frees the writer's slot as soon as its
  bytes are here. A checksummed request's scatter sums the slot as it reads it,
  and each writer's piece is checked against the total its source sent
  (``protocol.checksums``) before the chunk counts as placed.

A checksummed writer on the other paths sends its piece's total in ``sums``: the
ipc kernel sums every word it reads, the direct and pages moves sum the pages
their pieces landed in once they are in (``Landed``), and a move is done only
once each total is in and equal.

``stop`` (a failed request) waits for this rank's own kernels and gives up the
transport reads; a read that may still land is handed back as a ``Leftover``,
whose memory (a slot, or the request's pages) stays out of use until it is over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from kvstage.errors import KVStageError, ProtocolError
from kvstage.protocol.checksums import mismatches, page_sums
from kvstage.protocol.incoming import Group, Incoming, Ready, page_bytes
from kvstage.protocol.messages import Read
from kvstage.protocol.route import Path
from kvstage.staging.checksum import ChunkSums
from kvstage.staging.copy import TokenIndex, prepare_scatter
from kvstage.staging.fence import CopyFence
from kvstage.staging.region import RegionPiece
from kvstage.transports.base import Spans, WriteState

log = logging.getLogger("kvstage")


@dataclass
class Leftover:
    """A read of a failed request that may still land: ``slot`` (or, None, the request's pages) is not
    reused until ``poll`` says it is over."""

    handle: object
    slot: int | None


class Move:
    """The contract: ``start`` once, ``progress`` each loop turn until ``done``; ``stop`` on failure."""

    path: Path

    def __init__(self, inc: Incoming, writers: list, group: Group):
        self.inc, self.writers = inc, writers  # [(Writer, Piece, Ready)] in the slot order
        self.group = group  # the part of the request it reads (every layer and token, or a streamed part)

    def start(self, dst) -> None:
        raise NotImplementedError

    def progress(self, dst) -> None:
        """Poll what is under way and move it on; a failure fails the request (``dst._fail``)."""

    def done(self) -> bool:
        raise NotImplementedError

    def busy(self) -> bool:
        """Whether the transport should be polled often (a read is under way)."""
        return False

    def fence(self) -> CopyFence | None:
        """A device copy still running, which the loop may block on."""
        return None

    def stop(self, dst) -> list:
        """A failed request: wait for this rank's kernels into its pages, give up its reads; the reads
        that may still land (``Leftover``)."""
        return []


def _poll(transport, handle) -> bool:
    """Whether a read is over (True) or still running; raises ``KVStageError`` where it failed."""
    return transport.poll(handle) is not WriteState.PENDING


def _reap(dst, inc: Incoming, reads: list, done) -> list | None:
    """Poll each ``(writer, read handle)`` of ``reads``: release the finished ones (``done(writer)`` for each)
    and return those still running. None where one failed: the failed read is released, ``reads`` keeps only
    the reads still to give up, and the request is failed (``dst._fail``, whose ``Move.stop`` gives them up)."""
    still: list = []
    for i, (w, h) in enumerate(reads):
        try:
            over = _poll(dst.transport, h)
        except KVStageError as e:
            dst.transport.release(h)
            reads[:] = still + reads[i + 1 :]
            dst._fail(inc.key, w.name, "read", str(e), tell=True)
            return None
        if over:
            dst.transport.release(h)
            done(w)
        else:
            still.append((w, h))
    return still


def _give_up(transport, handles: list, slot: int | None = None) -> list:
    """Abandon these reads: those that cannot be cancelled come back as leftovers."""
    left = []
    for h in handles:
        try:
            if transport.abandon(h):
                transport.release(h)
            else:
                left.append(Leftover(h, slot))
        except KVStageError:
            transport.release(h)
    return left


def fail_checksum(dst, inc: Incoming, w, what: str, want: int, got: int) -> None:
    """``what`` of ``w``'s piece landed with checksum ``got`` where its source summed ``want``: counted, logged
    once per peer, and the request fails at stage ``checksum`` naming the writer."""
    dst.metrics.checksum_failure(w.name)
    dst.warned_checksums.once(dst.rank, w.name, inc.handle.req, what, want, got)
    dst._fail(
        inc.key,
        w.name,
        "checksum",
        f"{what} landed with checksum {got:#010x}, its source summed {want:#010x}",
        tell=True,
    )


class Landed:
    """The check of a direct or pages move's checksummed writers: once their pieces are in this rank's
    pages, a pass sums them there (``checksums.page_sums``) and each is compared with the total its writer
    sent in ``sums``. A part this rank holds a cached prefix of is not checked (the source summed every
    token of it, and these paths read only the rest): said once per peer."""

    def __init__(self, writers: list):
        self.writers = [
            (w, piece, ready) for w, piece, ready in writers if ready.checksum and ready.path is not Path.READ
        ]
        self.over = not self.writers
        self._sums: ChunkSums | None = None
        self._fence: CopyFence | None = None

    def poll(self, dst, inc: Incoming, group: Group) -> None:
        """Sum, then compare once the pass and every writer's ``sums`` are in; ``over`` once checked."""
        if self.over:
            return
        if self._fence is None:
            if group.first:
                self.over = True
                for w, _, _ in self.writers:
                    if dst.unchecked_prefixes.first(w.name):
                        log.info(
                            "dst %d: checksums from %s of parts whose first tokens are cached here are not "
                            "checked on the direct and pages paths (first: %s%s, tokens 0..%d cached)",
                            dst.rank,
                            w.name,
                            inc.handle.req,
                            group.name,
                            group.first,
                        )
                return
            fence = CopyFence(dst.cache.device)
            self._sums = page_sums(
                dst.cache,
                inc.pages,
                inc.kernel_pages,
                group.count,
                [piece for _, piece, _ in self.writers],
                "destination",
                group.dst_start,
            )
            self._fence = fence.close()
        if not self._fence.done() or any(ready.total is None for _, _, ready in self.writers):
            return
        assert self._sums is not None  # made with the fence
        for k, want, got in mismatches(self._sums, [ready.total for _, _, ready in self.writers])[:1]:
            return fail_checksum(dst, inc, self.writers[k][0], "its piece", want, got)
        self.over = True

    def fence(self):
        return self._fence if self._fence is not None and not self._fence.done() else None


class IpcMove(Move):
    """Every ipc writer's pieces in one kernel launch, after each writer's ready event."""

    path = Path.IPC

    def __init__(self, inc, writers, group):
        super().__init__(inc, writers, group)
        self._fence: CopyFence | None = None
        self._started = 0.0
        self._timed = False
        # checksummed: the kernel's sum of each writer's piece, checked once the fence and its ``sums`` are in
        self._sums = ChunkSums(tuple(range(len(writers))), np.zeros(len(writers), dtype=np.uint32))
        self._to_check = any(ready.checksum for _, _, ready in writers)

    def start(self, dst) -> None:
        from kvstage.staging import checksum
        from kvstage.staging.cuda_ipc import IpcRead

        inc = self.inc
        copier = dst._ipc_copier(inc.engine)
        g = self.group
        # a checksum covers the writers' whole part: tokens before ``first`` (cached here) are read and summed
        skip = g.first if self._to_check else 0
        reads = [IpcRead(w.ipc, piece, ready.pages, g.first - skip) for w, piece, ready in self.writers]
        idx = TokenIndex(dst.cache, inc.pages, g.dst_start, g.count, inc.kernel_pages)
        fence = CopyFence(dst.cache.device)
        for w, _, _ in self.writers:
            w.event.wait()  # the copy stream waits for the work the source queued before its ready
        self._started = time.perf_counter()
        if self._to_check:
            copier.launch(idx, reads, skip, checksum.on_device(self._sums, dst.cache.device))
            checksum.to_host(self._sums)
        else:
            copier.launch(idx, reads)
        self._fence = fence.close()
        log.debug(
            "dst %d: %s ipc read launched (%d source ranks, one launch)", dst.rank, inc.handle.req, len(self.writers)
        )

    def progress(self, dst) -> None:
        """The launch's time once it is done: ``read`` (launch to seen done) and ``read_gpu`` (the kernel's own);
        a checksummed writer's piece checked once its ``sums`` is in."""
        if self._fence is None or not self._fence.done():
            return
        if self._to_check and all(not r.checksum or r.total is not None for _, _, r in self.writers):
            expect = [r.total if r.checksum else None for _, _, r in self.writers]
            for k, want, got in mismatches(self._sums, expect)[:1]:
                return fail_checksum(dst, self.inc, self.writers[k][0], "its piece", want, got)
            self._to_check = False
        if self._timed:
            return
        self._timed = True
        took = time.perf_counter() - self._started
        stages = self.inc.handle.stages
        stages["read"] += took
        dst.metrics.stage("read", took)
        assert self._fence is not None  # done(): the launch's fence exists
        gpu = self._fence.gpu_seconds()
        if gpu is not None:
            stages["read_gpu"] = stages.get("read_gpu", 0.0) + gpu

    def done(self) -> bool:
        return self._fence is not None and self._fence.done() and not self._to_check

    def fence(self):
        return self._fence if self._fence is not None and not self._fence.done() else None

    def stop(self, dst) -> list:
        if self._fence is not None:
            self._fence.wait()
        return []


def page_run_spans(
    src_pages: np.ndarray, dst_pages: np.ndarray, remote_regions, local_regions, nbytes: int, buffers: range
) -> tuple[Spans, Spans]:
    """Both sides' spans of a direct read: one per run of pages consecutive on both sides, per buffer of
    ``buffers`` (``nbytes``: bytes of one page of one buffer, the same on both sides)."""
    n = len(src_pages)
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    runs = np.diff(np.concatenate((starts, [n])))
    index = np.repeat(np.arange(len(buffers), dtype=np.int64), len(starts))
    lengths = np.tile(runs, len(buffers)) * nbytes
    remote = Spans(
        tuple(remote_regions[b] for b in buffers), index, np.tile(src_pages[starts], len(buffers)) * nbytes, lengths
    )
    local = Spans(
        tuple(local_regions[b] for b in buffers), index, np.tile(dst_pages[starts], len(buffers)) * nbytes, lengths
    )
    return local, remote


class DirectMove(Move):
    """Page runs of each direct writer's KV buffers read straight into this rank's pages."""

    path = Path.DIRECT

    def __init__(self, inc, writers, group):
        super().__init__(inc, writers, group)
        self._reads: list = []  # (writer, handle)
        self._over = 0
        self._landed = Landed(writers)

    def start(self, dst) -> None:
        inc = self.inc
        size = dst.spec.page.page_size  # equal paging, and both starts on a page boundary (``_start_group``)
        first, here = self.group.first // size, inc.pages[self.group.dst_start // size :]
        here = here[: -(-self.group.count // size)]
        for w, piece, ready in self.writers:
            src_pages = ready.pages[first : first + len(here)]
            local, remote = page_run_spans(src_pages, here, w.kv, dst.kv_regions(), page_bytes(dst.spec), piece.buffers)
            self._reads.append((w, dst.transport.read(w.agent, local, remote)))
            inc.handle.descriptors += len(local)
        inc.handle.writes += len(self._reads)
        self.progress(dst)  # a host read is often over when posted: the request may be done in this same turn

    def progress(self, dst) -> None:
        still = _reap(dst, self.inc, self._reads, self._read_over)
        if still is None:
            return
        self._reads = still
        if self._over == len(self.writers):
            self._landed.poll(dst, self.inc, self.group)

    def _read_over(self, _writer) -> None:
        self._over += 1
        self.inc.touched = time.monotonic()

    def done(self) -> bool:
        return self._over == len(self.writers) and self._landed.over

    def fence(self):
        return self._landed.fence()

    def busy(self) -> bool:
        return bool(self._reads)

    def stop(self, dst) -> list:
        left = _give_up(dst.transport, [h for _, h in self._reads])
        self._reads = []
        return left


@dataclass
class DstChunk:
    """One chunk of an arena move: source tokens ``start .. start + count``, of which this rank receives
    ``want_start .. want_start + want`` (all of them unless the request starts inside it)."""

    index: int
    start: int
    count: int
    want_start: int
    want: int
    slot: int | None = None
    reads: list = field(default_factory=list)  # (writer, handle) under way
    scatter: object = None  # the prepared scatter, run once every read is in
    fence: CopyFence | None = None
    done: bool = False
    told: set = field(default_factory=set)  # writer ranks sent ``read`` for it
    posted: set = field(default_factory=set)  # writer ranks whose piece's read is posted
    layout: list = field(default_factory=list)  # each writer's piece's byte offset in the slot, in writer order
    started: float = 0.0
    sums: ChunkSums | None = None  # a checksummed request's: what its scatter finds in each writer's piece


class ArenaMove(Move):
    """The read and pages writers' pieces, chunk by chunk through this rank's arena."""

    def __init__(self, inc, writers, own_tokens: int, group):
        super().__init__(inc, writers, group)
        read = [r for _, _, r in writers if r.path is Path.READ]
        per = read[0].chunk_tokens if read else own_tokens
        if any(r.chunk_tokens != per for r in read):
            raise ProtocolError(
                f"the source ranks of {inc.handle.req!r} cut it into chunks of "
                f"{sorted({r.chunk_tokens for r in read})} tokens; they must agree"
            )
        total = writers[0][2].tokens
        lo, hi = group.first, group.first + group.count
        self.chunks = []
        for i, s in enumerate(range(0, total, per)):
            n = min(per, total - s)
            a, b = max(s, lo), min(s + n, hi)
            self.chunks.append(DstChunk(i, s, n, a, max(0, b - a), done=b <= a))
        self.per = per
        # what each loop turn looks at, so a request of many chunks costs a turn no more than one of few:
        # the chunks holding a slot, the first chunk that may want one, the unwanted ones not told yet
        self._active: list[DstChunk] = []
        self._lo = 0
        self._unwanted = [c for c in self.chunks if c.want == 0]
        self._left = sum(not c.done for c in self.chunks)
        self._starved: float | None = None  # since when its next chunk was readable and the arena had no slot
        self._landed = Landed(writers)  # the pages writers' checksums, once every chunk is in

    @property
    def path(self):
        return Path.READ if any(r.path is Path.READ for _, _, r in self.writers) else Path.PAGES

    def slot_bytes(self, count: int) -> int:
        return sum(self._piece_bytes(piece, count) for _, piece, _ in self.writers)

    def _piece_bytes(self, piece, count: int) -> int:
        return piece.heads.count * len(piece.buffers) * count * self.writers[0][0].spec.geometry.head_bytes()

    def _readable_by(self, c: DstChunk, ready: Ready) -> bool:
        return ready.path is not Path.READ or c.index in ready.gathered

    def readable(self, most: int) -> list[DstChunk]:
        """Up to ``most`` chunks with no slot yet that some writer has made readable, in order: a slot is
        taken with the first, and each writer's piece is read as soon as that writer has gathered it.
        Writers gather in order, so the scan stops at the first chunk no writer made readable."""
        chunks = self.chunks
        while self._lo < len(chunks) and (chunks[self._lo].done or chunks[self._lo].slot is not None):
            self._lo += 1
        out: list = []
        for i in range(self._lo, len(chunks)):
            c = chunks[i]
            if c.done or c.slot is not None:
                continue
            if len(out) >= most or not any(self._readable_by(c, r) for _, _, r in self.writers):
                break
            out.append(c)
        if (
            self._starved is None
            and self._lo < len(chunks)
            and not out
            and most == 0
            and any(self._readable_by(chunks[self._lo], r) for _, _, r in self.writers)
        ):
            self._starved = time.perf_counter()
        return out

    def start(self, dst) -> None:
        self.progress(dst)

    def skip_unwanted(self, dst) -> None:
        """Chunks this rank does not receive (the request starts past them): their writers hear ``read``
        as soon as they are gathered, so their slots come back."""
        for c in list(self._unwanted):
            self._tell_read(dst, c)
            if len(c.told) == sum(r.path is Path.READ for _, _, r in self.writers):
                self._unwanted.remove(c)

    def begin(self, dst, c: DstChunk, slot: int) -> None:
        """Take ``slot`` for chunk ``c``: lay its writers' pieces out in it, make its scatter ready, and read
        the pieces already readable (``_post``; the others as their writers gather them)."""
        inc = self.inc
        c.slot, c.started = slot, time.perf_counter()
        self._active.append(c)
        # one interval per wait (so the stage never exceeds the request's time), observed for every chunk
        # (0 where a slot was free): the histogram counts chunks, as the source's does
        waited = 0.0 if self._starved is None else c.started - self._starved
        self._starved = None
        inc.handle.stages["slot_wait"] += waited
        dst.metrics.stage("slot_wait", waited)
        pieces, at = [], 0
        c.layout = []
        for w, piece, ready in self.writers:
            if ready.path is Path.READ:
                nbytes = self._piece_bytes(piece, c.count)
                rp = RegionPiece(
                    piece.dst_offset, piece.heads.count, piece.buffers, at, ready.order, c.count, c.want_start - c.start
                )
            else:
                from kvstage.staging.spans import cheapest_order

                nbytes = self._piece_bytes(piece, c.want)
                rp = RegionPiece(
                    piece.dst_offset, piece.heads.count, piece.buffers, at, cheapest_order(w.spec, piece.heads.count)
                )
            c.layout.append(at)
            pieces.append(rp)
            at += nbytes
        g = self.group
        idx = TokenIndex(dst.cache, inc.pages, c.want_start - g.first + g.dst_start, c.want, inc.kernel_pages)
        if any(ready.checksum and ready.path is Path.READ for _, _, ready in self.writers):
            c.sums = ChunkSums.of(pieces, self.writers[0][0].spec.geometry.head_bytes(), c.want)
        c.scatter = prepare_scatter(
            dst.cache, idx, pieces, dst.arena.view(dst.arena.offset(slot), at), dst._scatter_threads, c.sums
        )
        log.debug("dst %d: %s chunk %d takes slot %d", dst.rank, inc.handle.req, c.index, slot)
        self._post(dst, c)

    def _post(self, dst, c: DstChunk) -> None:
        """Post the reads of chunk ``c``'s pieces whose writers made them readable and that are not posted yet."""
        inc = self.inc
        base = dst.arena.offset(c.slot)
        for k, (w, piece, ready) in enumerate(self.writers):
            if w.rank in c.posted or not self._readable_by(c, ready):
                continue
            at = c.layout[k]
            if ready.path is Path.READ:
                offset, ticket, _ = ready.gathered[c.index]
                nbytes = self._piece_bytes(piece, c.count)
                remote = Spans.single(w.arena, [offset], [nbytes])
                local = Spans.single(dst.arena_region, [base + at], [nbytes])
            else:
                from kvstage.staging.spans import cheapest_order, piece_spans

                src = RegionPiece(
                    piece.src_offset, piece.heads.count, piece.buffers, 0, cheapest_order(w.spec, piece.heads.count)
                )
                bidx, offs, lens, roff = piece_spans(w.spec, ready.pages, c.want_start, c.want, src)
                remote = Spans(tuple(w.kv[b] for b in piece.buffers), bidx - piece.buffers.start, offs, lens)
                local = Spans.single(dst.arena_region, base + at + roff, lens)
                ticket = b""
            c.posted.add(w.rank)
            c.reads.append((w, dst.transport.read(w.agent, local, remote, ticket)))
            inc.handle.descriptors += len(local)
            inc.handle.writes += 1
            log.debug("dst %d: %s chunk %d read posted to source rank %d", dst.rank, inc.handle.req, c.index, w.rank)

    def progress(self, dst) -> None:
        inc = self.inc
        for c in list(self._active):
            if c.slot is None or c.done:
                continue
            if c.fence is None:
                if len(c.posted) < len(self.writers):
                    self._post(dst, c)
                still = _reap(
                    dst,
                    inc,
                    c.reads,
                    lambda w, c=c: log.debug(
                        "dst %d: %s chunk %d read from source rank %d", dst.rank, inc.handle.req, c.index, w.rank
                    ),
                )
                if still is None:
                    return
                c.reads = still
                if c.reads or len(c.posted) < len(self.writers):
                    continue
                inc.touched = time.monotonic()
                took = time.perf_counter() - c.started
                inc.handle.stages["read"] = inc.handle.stages.get("read", 0.0) + took
                dst.metrics.stage("read", took)
                self._tell_read(dst, c)  # the writers' slots are free: their bytes are here
                c.started = time.perf_counter()
                c.fence = dst.launch_copy(c.scatter)
                inc.stage = "scatter"
                log.debug("dst %d: %s chunk %d scatter launched", dst.rank, inc.handle.req, c.index)
            if c.fence is not None and c.fence.done():
                try:
                    c.fence.wait()  # a host copy's error comes out here
                except Exception as e:
                    c.fence = None
                    return dst._fail(inc.key, "local", "scatter", f"{type(e).__name__}: {e}", tell=True)
                took = time.perf_counter() - c.started
                inc.handle.stages["scatter"] += took
                dst.metrics.stage("scatter", took)
                gpu = c.fence.gpu_seconds()
                if gpu is not None:
                    inc.handle.stages["scatter_gpu"] = inc.handle.stages.get("scatter_gpu", 0.0) + gpu
                c.fence.release()
                c.fence = None
                if c.sums is not None and self._corrupt(dst, c):
                    return
                c.done = True
                self._left -= 1
                self._active.remove(c)
                inc.touched = time.monotonic()
                dst.arena.allocator.release(c.slot)
                c.slot = None
                log.debug("dst %d: %s chunk %d scattered", dst.rank, inc.handle.req, c.index)
        if self._left == 0:
            self._landed.poll(dst, inc, self.group)

    def _corrupt(self, dst, c: DstChunk) -> bool:
        """Whether a writer's piece of chunk ``c`` landed with another checksum than its source summed; the
        request then fails at stage ``checksum``, naming the writer and the chunk."""
        assert c.sums is not None
        expect = [r.gathered[c.index][2] if r.path is Path.READ else None for _, _, r in self.writers]
        bad = mismatches(c.sums, expect)
        if not bad:
            return False
        k, want, got = bad[0]
        fail_checksum(dst, self.inc, self.writers[k][0], f"chunk {c.index}", want, got)
        return True

    def _tell_read(self, dst, c: DstChunk) -> None:
        for w, _, ready in self.writers:
            if ready.path is Path.READ and w.rank not in c.told and c.index in ready.gathered:
                c.told.add(w.rank)
                dst._tell(w, Read(self.inc.handle.req, c.index, *self.group.wire))

    def done(self) -> bool:
        return self._left == 0 and self._landed.over

    def busy(self) -> bool:
        return any(c.reads or len(c.posted) < len(self.writers) for c in self._active)

    def fence(self):
        running = (c.fence for c in self._active if c.fence is not None and not c.fence.done())
        return next(running, None) or self._landed.fence()

    def slots(self) -> int:
        return len(self._active)

    def stop(self, dst) -> list:
        left = []
        for c in self._active:
            if c.fence is not None:
                try:
                    c.fence.wait()
                except Exception:  # a failed scatter: the request fails anyway; its slot comes back
                    pass
                c.fence.release()
                c.fence = None
            kept = _give_up(dst.transport, [h for _, h in c.reads], c.slot)
            c.reads = []
            if c.slot is not None and not kept:  # else the slot returns with its last leftover
                dst.arena.allocator.release(c.slot)
            c.slot = None
            left += kept
        self._active = []
        return left
