"""Benchmark rank processes: one per source rank and one per destination rank.

Every rank walks the same schedule of (mode, iteration) steps in lockstep with
the others (a barrier before and after each step) and reports timestamps and
verification to the parent. Page ids and cache contents change every
iteration and come from seeds, so any rank can derive the other side's page ids
(the per-slice baseline writes straight into destination pages) and so stale
bytes from an earlier iteration can never pass verification.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import numpy as np
import torch

from kvstage.bench.baselines import slice_spans
from kvstage.bench.reference import check_shard, fill_shard
from kvstage.bench.scenario import Scenario
from kvstage.layout import pages_needed
from kvstage.staging.cache import RankCache
from kvstage.transports.base import Region, Spans, WriteState

WAIT_S = 600.0


def schedule(sc: Scenario) -> list[tuple[str, int]]:
    return [(m, i) for m in sc.modes for i in range(sc.warmup + sc.iters)]


def page_ids(sc: Scenario, side: str, rank: int, it: int, pages: int, page_size: int) -> np.ndarray:
    rng = np.random.default_rng([sc.seed, it, 0 if side == "src" else 1, rank])
    return rng.permutation(pages)[: pages_needed(sc.tokens, page_size)]


def content_seed(sc: Scenario, mode: str, it: int) -> int:
    return sc.seed * 7919 + it * 31 + sc.modes.index(mode)


def _setup(rank_label: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 2) // 2)))
    logging.basicConfig(level=os.environ.get("KVSTAGE_LOG_LEVEL", "WARNING"), format=f"%(levelname)s {rank_label} %(message)s")


def _device(sc: Scenario) -> torch.device:
    return torch.device("cuda", 0) if sc.device == "cuda" else torch.device("cpu")


def _wait_writes(transport, handles) -> None:
    deadline = time.monotonic() + WAIT_S
    pending = list(handles)
    while pending:
        pending = [h for h in pending if transport.poll(h) is WriteState.PENDING]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} writes not done after {WAIT_S} s")
    for h in handles:
        transport.release(h)


def dst_main(sc: Scenario, rank: int, barrier, out, listen) -> None:
    _setup(f"dst{rank}")
    try:
        from kvstage.protocol.destination import Destination
        from kvstage.transports.nixl import NixlTransport

        dev = _device(sc)
        cache = RankCache.allocate(sc.dst, rank, sc.pages(sc.dst), dev)
        ep = Destination(cache, sc.settings(), listen=listen)
        base = NixlTransport(f"kvstage-bench-dst{rank}")
        plan = sc.plan
        writers = plan.writers_of(rank)
        kv = [base.register(b) for b in cache.buffers] if "per-slice" in sc.modes else []
        bulk = torch.empty(plan.dst_token_bytes() * sc.tokens, dtype=torch.uint8, device=dev) if "bulk" in sc.modes else None
        bulk_region = base.register(bulk) if bulk is not None else None
        out.put(("dst-ready", rank, {
            "address": ep.address, "metadata": base.metadata(), "kv": [r.to_wire() for r in kv],
            "bulk": bulk_region.to_wire() if bulk_region else None,
        }))
        for mode, it in schedule(sc):
            last = it == sc.warmup + sc.iters - 1
            if mode != "bulk":
                for b in cache.buffers:
                    b.view(torch.uint8).zero_()
            pages = page_ids(sc, "dst", rank, it, cache.pages, sc.dst_page.page_size)
            tag = f"{mode}-{it}"
            handle = ep.expect(tag, pages, sc.tokens) if mode == "staged" else None
            if dev.type == "cuda":
                torch.cuda.synchronize()
            barrier.wait(WAIT_S)
            path = None
            if handle is not None:
                handle.wait(WAIT_S)
                stages, path = handle.stages, handle.path
            else:
                want = {f"{tag}-{p.src_rank}".encode() for p in writers}
                deadline = time.monotonic() + WAIT_S
                while want:
                    for _, msg in base.notifications():
                        want.discard(msg)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{mode}: notices {sorted(want)} missing after {WAIT_S} s")
                stages = {}
            t1 = time.perf_counter()
            verified, errors = None, []
            if sc.verify and mode != "bulk" and last:
                errors = check_shard(cache, content_seed(sc, mode, it), pages, sc.tokens)
                verified = not errors
            out.put(("result", "dst", rank, mode, it, {"t1": t1, "verified": verified, "errors": errors[:5], "stages": stages, "path": path}))
            barrier.wait(WAIT_S)
        ep.close()
        base.close()
        out.put(("exit", "dst", rank, None))
    except BaseException:
        out.put(("error", "dst", rank, traceback.format_exc()))


def src_main(sc: Scenario, rank: int, barrier, out, dsts: dict) -> None:
    _setup(f"src{rank}")
    try:
        from kvstage.protocol.source import Source
        from kvstage.transports.nixl import NixlTransport

        dev = _device(sc)
        cache = RankCache.allocate(sc.src, rank, sc.pages(sc.src), dev)
        ep = Source(cache, sc.settings())
        ep.connect([tuple(dsts[d]["address"]) for d in sorted(dsts)])
        plan = sc.plan
        targets = plan.targets_of(rank)
        base = NixlTransport(f"kvstage-bench-src{rank}")
        peers = {p.dst_rank: base.connect(dsts[p.dst_rank]["metadata"]) for p in targets}
        kv = [base.register(b) for b in cache.buffers] if "per-slice" in sc.modes else []
        mine = sum(plan.piece_token_bytes(p) for p in targets) * sc.tokens
        bulk = torch.empty(max(mine, 1), dtype=torch.uint8, device=dev) if "bulk" in sc.modes else None
        bulk_region = base.register(bulk) if bulk is not None else None
        out.put(("src-ready", rank, None))
        for mode, it in schedule(sc):
            pages = page_ids(sc, "src", rank, it, cache.pages, sc.src_page.page_size)
            if mode != "bulk":
                fill_shard(cache, content_seed(sc, mode, it), pages, sc.tokens)
            tag = f"{mode}-{it}"
            prepared = []
            if mode == "per-slice":
                for p in targets:
                    dpages = page_ids(sc, "dst", p.dst_rank, it, sc.pages(sc.dst), sc.dst_page.page_size)
                    dkv = [Region.from_wire(r) for r in dsts[p.dst_rank]["kv"]]
                    local, remote = slice_spans(p, sc.src, sc.dst, pages, dpages, sc.tokens, kv, dkv)
                    idx = np.arange(len(local), dtype=np.int32)
                    prepared.append((p, base.prepare(None, local), base.prepare(peers[p.dst_rank], remote), idx))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            barrier.wait(WAIT_S)
            t0 = time.perf_counter()
            stages, descriptors = {}, 0
            if mode == "staged":
                h = ep.send(tag, pages, sc.tokens)
                h.wait(WAIT_S)
                stages, descriptors = h.stages, h.descriptors
            elif mode == "bulk":
                handles, at = [], 0
                for p in targets:
                    n = plan.piece_token_bytes(p) * sc.tokens
                    off = plan.writer_offsets(p.dst_rank, sc.tokens)[rank]
                    remote = Region.from_wire(dsts[p.dst_rank]["bulk"])
                    handles.append(base.write(peers[p.dst_rank], Spans.single(bulk_region, [at], [n]),
                                              Spans.single(remote, [off], [n]), f"{tag}-{rank}".encode()))
                    at += n
                    descriptors += 1
                _wait_writes(base, handles)
            else:
                handles = []
                for p, lp, rp, idx in prepared:
                    handles.append(base.write_prepared(peers[p.dst_rank], lp, idx, rp, idx, f"{tag}-{rank}".encode()))
                    descriptors += len(idx)
                _wait_writes(base, handles)
            t_end = time.perf_counter()
            out.put(("result", "src", rank, mode, it, {"t0": t0, "t_end": t_end, "descriptors": descriptors, "stages": stages}))
            barrier.wait(WAIT_S)
        ep.close()
        base.close()
        out.put(("exit", "src", rank, None))
    except BaseException:
        out.put(("error", "src", rank, traceback.format_exc()))
