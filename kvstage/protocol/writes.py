"""A source's ways to land a granted chunk at its destination, one small unit each.

Every path takes the head of the source's queue of granted jobs and starts it;
the source polls what it started (gathers by their fences, writes by the
transport) and reports each chunk written. Which path a job takes is decided
once per destination at connect (``Target.path``), except that a grant that
names the destination's pages is a direct one:

- ``DirectPageRuns``: whole pages straight into the destination's KV, one span
  per run of consecutive pages per buffer (equal paging, whole shards);
- ``StagedWrite``: gather the piece into a slot of this rank's arena, then one
  transport write into the granted slot, with a notice that lands after the bytes;
- ``MappedGather``: the destination's arena is mapped here (same host): gather
  straight into the granted slot and say ``landed`` on the control connection;
  one launch fills the pieces of a 1->N source's chunk for every mapped destination;
- ``FromPages``: a transport that walks many spans at the cost of one (cma) writes
  the chunk straight from this rank's pages into the granted slot;
- ``PlacedPages`` (direct-ipc): the destination's KV pages are opened here (same host,
  CUDA IPC): one kernel stores each head slice at its place in them, in the
  destination's page size and layout; the destination copies nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kvstage.errors import KVStageError, ProtocolError
from kvstage.protocol.endpoint import rank_name
from kvstage.protocol.wire import encode_notice
from kvstage.staging.copy import TokenIndex, gather, gather_pieces
from kvstage.staging.cuda_place import PlacedWrite
from kvstage.staging.fence import CopyFence
from kvstage.staging.spans import chunk_spans
from kvstage.transports.base import ReadyWrite, Spans

log = logging.getLogger("kvstage")


@dataclass
class Gathering:
    """A chunk whose gather is launched; its write, made ready while the gather
    runs, is posted once the fence passes. Gathered straight into mapped arenas
    (``slot`` None), one launch may fill several destinations' pieces of the same
    tokens: ``jobs`` and ``sizes`` list them (otherwise one job)."""

    fence: CopyFence
    out: object
    jobs: list
    slot: int | None
    sizes: list[int]
    started: float
    write: ReadyWrite | None = None


@dataclass
class InFlight:
    """A posted transport write and the slot of this arena it reads, if any."""

    handle: object
    job: object
    slot: int | None
    posted: float


class WritePath:
    """The contract: ``start`` takes the job at the head of ``src._jobs`` (and the
    ones it serves with it) and starts it; False leaves it queued (back-pressure)."""

    name = "path"

    def __init__(self, src):
        self.src = src

    def start(self, out, poll: bool = True) -> bool:
        raise NotImplementedError

    def _target(self, job):
        """The job's destination, or None once the request failed for its loss."""
        target = self.src.target_of(job)
        if target is None:
            self.src._fail((job.engine, job.req), rank_name(job.engine, "destination", job.dst), "write", "not connected",
                           tell=False)
        return target

    def _write(self, out, job, target, local: Spans, remote: Spans, offset: int | None, t: float) -> None:
        """One transport write of ``local`` into ``remote`` with its notice, made and posted now."""
        src = self.src
        nbytes = int(local.lengths.sum())
        try:
            write = src.transport.prepare_write(target.agent, local, remote,
                                                encode_notice(job.req, job.chunk, src.rank, offset, nbytes), job.ticket)
        except KVStageError as e:
            return src._fail(out.key, rank_name(job.engine, "destination", job.dst), "write", str(e), tell=True)
        src._post_write(out, job, None, write, nbytes, len(local), t)

    def _stamp(self, out, job, t: float) -> None:
        stages = out.handle.stages
        stages.setdefault("start", t - out.handle.created)  # send() to its first copy (see request.py)
        stages["queued"] += max(0.0, (job.blocked if job.blocked is not None else t) - job.queued)


class DirectPageRuns(WritePath):
    name = "direct"

    def start(self, out, poll: bool = True) -> bool:
        src = self.src
        job = src._jobs.popleft()
        target = self._target(job)
        if target is None:
            return True
        local, remote = page_run_spans(out.pages, job.pages, src.kv_regions(), target.kv,
                                       [b.nbytes // src.cache.pages for b in src.cache.buffers])
        t = time.perf_counter()
        out.handle.stages.setdefault("start", t - out.handle.created)
        self._write(out, job, target, local, remote, None, t)
        return True


def page_run_spans(src_pages: np.ndarray, dst_pages: np.ndarray, local_regions, remote_regions,
                   page_bytes: list[int]) -> tuple[Spans, Spans]:
    """Both sides' spans of a direct write: one per run of pages consecutive on both
    sides, per buffer (``page_bytes``: bytes of one page of each buffer)."""
    n = len(src_pages)
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    runs = np.diff(np.concatenate((starts, [n])))
    nbuf = len(local_regions)
    index = np.repeat(np.arange(nbuf), len(starts))
    pb = np.asarray(page_bytes, dtype=np.int64)[index]
    local = Spans(tuple(local_regions), index, np.tile(src_pages[starts], nbuf) * pb, np.tile(runs, nbuf) * pb)
    remote = Spans(tuple(remote_regions), index, np.tile(dst_pages[starts], nbuf) * pb, np.tile(runs, nbuf) * pb)
    return local, remote


class FromPages(WritePath):
    name = "staged"

    def start(self, out, poll: bool = True) -> bool:
        """The chunk's head slice straight from this rank's pages into the granted slot,
        laid out as a gather would have (``staging.spans``)."""
        src = self.src
        job = src._jobs.popleft()
        target = self._target(job)
        if target is None:
            return True
        t = time.perf_counter()
        self._stamp(out, job, t)
        index, offsets, lengths = chunk_spans(src.cache, out.pages, job.start, job.count, target.piece.src_offset,
                                              target.piece.heads.count)
        local = Spans(tuple(src.kv_regions()), index, offsets, lengths)
        remote = Spans((target.arena,), np.zeros_like(index), job.offset + np.cumsum(lengths) - lengths, lengths)
        self._write(out, job, target, local, remote, job.offset, t)
        return True


class StagedWrite(WritePath):
    name = "staged"

    def start(self, out, poll: bool = True) -> bool:
        """Gather the chunk into a free slot of this arena and make its write ready
        while the gather runs; no free slot: wait (back-pressure)."""
        src = self.src
        job = src._jobs[0]
        slot = src.arena.allocator.acquire()
        if slot is None:
            if job.blocked is None:
                job.blocked = time.perf_counter()
            return False
        src._jobs.popleft()
        if job.blocked is not None:
            waited = time.perf_counter() - job.blocked
            out.handle.stages["slot_wait"] += waited
            src.metrics.stage("slot_wait", waited)
        target = self._target(job)
        if target is None:
            src.arena.allocator.release(slot)
            return True
        size = target.plan.piece_token_bytes(target.piece) * job.count
        t0 = time.perf_counter()
        self._stamp(out, job, t0)
        try:
            fence = CopyFence(src.cache.device)
            idx = TokenIndex(src.cache, out.pages, job.start, job.count, out.kernel_pages)
            gather(src.cache, idx, target.piece.src_offset, target.piece.heads.count,
                   src.arena.view(src.arena.offset(slot), size))
            fence.close()
            log.debug("src %d: %s chunk %d gather launched", src.rank, job.req, job.chunk)
        except Exception as e:
            src.arena.allocator.release(slot)
            src._fail(out.key, "local", "gather", f"{type(e).__name__}: {e}", tell=True)
            return True
        out.inflight += 1  # the request is not forgotten while its gather may still run
        g = Gathering(fence, out, [job], slot, [size], t0)
        src._gathering.append(g)
        try:  # the write's descriptors and transfer request, made while the GPU gathers
            g.write = src.transport.prepare_write(
                target.agent, Spans.single(src.arena_region, [src.arena.offset(slot)], [size]),
                Spans.single(target.arena, [job.offset], [size]),
                encode_notice(job.req, job.chunk, src.rank, job.offset, size), job.ticket)
        except KVStageError as e:  # the slot is freed once the gather into it has finished
            src._fail(out.key, rank_name(job.engine, "destination", job.dst), "write", str(e), tell=True)
        src._poll_gathers()
        return True


class MappedGather(WritePath):
    name = "mapped"

    def start(self, out, poll: bool = True) -> bool:
        """Copy straight into the destinations' memory mapped here: the queue's head and the jobs
        right behind it for the same tokens of the same request (a 1->N source's pieces of one
        chunk, granted together), in one launch (``_launch``). ``poll`` False: the loop reports
        them landed, on its next turn."""
        src = self.src
        jobs = self._take()
        job = jobs[0]
        targets = [src.target_of(j) for j in jobs]
        if None in targets:
            gone = jobs[targets.index(None)].dst
            src._fail(out.key, rank_name(job.engine, "destination", gone), "write", "not connected", tell=False)
            return True
        sizes = [t.plan.piece_token_bytes(t.piece) * j.count for t, j in zip(targets, jobs)]
        t0 = time.perf_counter()
        self._stamp(out, job, t0)
        try:
            fence = CopyFence(src.cache.device)
            idx = TokenIndex(src.cache, out.pages, job.start, job.count, out.kernel_pages)
            self._launch(idx, targets, jobs, sizes)
            fence.close()
            log.debug("src %d: %s chunk %d %s launched%s", src.rank, job.req, job.chunk, self.name,
                      f" (one launch for destination ranks {','.join(str(j.dst) for j in jobs)})" if len(jobs) > 1 else "")
        except ProtocolError as e:  # a grant the checks refuse before any launch
            src._fail(out.key, rank_name(job.engine, "destination", job.dst), "grant", str(e), tell=True)
            return True
        except Exception as e:
            src._fail(out.key, "local", "gather", f"{type(e).__name__}: {e}", tell=True)
            return True
        out.inflight += 1
        src._gathering.append(Gathering(fence, out, jobs, None, sizes, t0))
        if poll:
            src._poll_gathers()
        return True

    def _launch(self, idx, targets, jobs, sizes) -> None:
        """Gather each job's piece into its granted slot of its destination's mapped arena."""
        gather_pieces(self.src.cache, idx, [(t.piece.src_offset, t.piece.heads.count, t.mapped.view(j.offset, n))
                                            for t, j, n in zip(targets, jobs, sizes)])

    def _take(self) -> list:
        """The queue's head and the jobs right behind it for the same tokens of the same request on
        this path, for distinct destinations: one launch serves them all."""
        src = self.src
        jobs = [src._jobs.popleft()]
        head = jobs[0]
        while src._jobs:
            job = src._jobs[0]
            if ((job.engine, job.req, job.start, job.count) != (head.engine, head.req, head.start, head.count)
                    or src._path_of(job) is not self
                    or any(j.dst == job.dst for j in jobs)):
                break
            jobs.append(src._jobs.popleft())
        return jobs


class PlacedPages(MappedGather):
    """direct-ipc: the request's head slices stored straight into the destinations' KV pages
    (opened here through CUDA IPC), in their page size and layout, one launch for a 1->N
    source's destinations. The grant's page ids are checked before anything is launched;
    ``landed`` follows the kernel's end (``Source._poll_gathers``); the destination copies nothing."""

    name = "direct-ipc"

    def _launch(self, idx, targets, jobs, sizes) -> None:
        targets[0].placed.copier.launch(idx, [PlacedWrite(t.placed.destination, t.piece, j.ipc_pages)
                                              for t, j in zip(targets, jobs)])
