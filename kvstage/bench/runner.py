"""Start the rank processes of a scenario, collect their reports, summarize.

Wall time of one step is from the earliest source start to the latest
destination completion (CLOCK_MONOTONIC is shared by processes on one host).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time

from kvstage.bench.scenario import Scenario
from kvstage.bench.worker import WAIT_S, dst_main, schedule, src_main
from kvstage.errors import KVStageError


class BenchError(KVStageError):
    """A rank process failed; the message carries its traceback."""


def _collect(q, procs, want: int, kind: str, timeout: float = WAIT_S, also: tuple = ()) -> list:
    """Wait for ``want`` reports of ``kind``; reports of the kinds in ``also``
    (which rank processes may send in any order) are kept too."""
    got, deadline = [], time.monotonic() + timeout
    while sum(m[0] == kind for m in got) < want:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise BenchError(f"rank process {dead[0].name} died with exit code {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise BenchError(f"timed out waiting for {want - len(got)} {kind} reports") from None
            continue
        if msg[0] == "error":
            raise BenchError(f"{msg[1]} rank {msg[2]} failed:\n{msg[3]}")
        if msg[0] != kind and msg[0] not in also:
            raise BenchError(f"expected a {kind} report, got {msg[0]}")
        got.append(msg)
    return got


def run(sc: Scenario, progress=None) -> dict:
    """Run ``sc`` in fresh processes; return ``{"config", "results"}``."""
    ctx = mp.get_context("spawn")
    n = sc.src_tp + sc.dst_tp
    barrier = ctx.Barrier(n)
    q = ctx.Queue()
    procs = []
    try:
        for r in range(sc.dst_tp):
            procs.append(ctx.Process(target=dst_main, args=(sc, r, barrier, q, ("127.0.0.1", 0)), name=f"dst{r}", daemon=True))
            procs[-1].start()
        dsts = {m[1]: m[2] for m in _collect(q, procs, sc.dst_tp, "dst-ready")}
        for r in range(sc.src_tp):
            procs.append(ctx.Process(target=src_main, args=(sc, r, barrier, q, dsts), name=f"src{r}", daemon=True))
            procs[-1].start()
        _collect(q, procs, sc.src_tp, "src-ready")
        steps = schedule(sc)
        got = []
        for i, _ in enumerate(steps):
            got += _collect(q, procs, n * (i + 1) - sum(m[0] == "result" for m in got), "result", also=("exit",))
            if progress:
                progress(i + 1, len(steps))
        exits = sum(m[0] == "exit" for m in got)
        _collect(q, procs, n - exits, "exit")
        reports = [m for m in got if m[0] == "result"]
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
    return {"config": sc.to_dict(), "results": summarize(sc, reports)}


def summarize(sc: Scenario, reports: list) -> list[dict]:
    by = {}
    for _, role, rank, mode, it, data in reports:
        by.setdefault((mode, it), []).append((role, rank, data))
    results = []
    payload = sc.payload_bytes()
    for mode in sc.modes:
        walls, descs, stage_rows, verified, errors = [], [], [], None, []
        for it in range(sc.warmup, sc.warmup + sc.iters):
            rows = by[(mode, it)]
            srcs = [d for role, _, d in rows if role == "src"]
            dsts = [d for role, _, d in rows if role == "dst"]
            walls.append(max(d["t1"] for d in dsts) - min(d["t0"] for d in srcs))
            descs.append(sum(d["descriptors"] for d in srcs))
            st = {k: 0.0 for k in ("gather", "write", "slot_wait")}
            for d in srcs:
                for k in st:
                    st[k] += d["stages"].get(k, 0.0)
            st["scatter"] = sum(d["stages"].get("scatter", 0.0) for d in dsts)
            stage_rows.append(st)
            flags = [d["verified"] for d in dsts if d["verified"] is not None]
            if flags:
                verified = all(flags)
                errors += [e for d in dsts for e in d["errors"]]
        wall = statistics.median(walls)
        mid = walls.index(sorted(walls)[len(walls) // 2])
        row = {
            "mode": mode, "src_tp": sc.src_tp, "dst_tp": sc.dst_tp, "tokens": sc.tokens, "bytes": payload,
            "seconds": wall, "seconds_all": walls, "gbps": payload / wall / 1e9, "descriptors": descs[mid],
            "verified": verified, "arena_bytes": sc.settings().slot_bytes * sc.settings().slots,
        }
        if mode == "staged":
            row["stages"] = stage_rows[mid]
            row["path"] = sorted({d["path"] for _, _, d in by[(mode, sc.warmup)] if d.get("path")})
        if errors:
            row["errors"] = errors[:10]
        results.append(row)
    bulk = next((r for r in results if r["mode"] == "bulk"), None)
    for r in results:
        r["ratio_to_bulk"] = r["gbps"] / bulk["gbps"] if bulk else None
    return results
