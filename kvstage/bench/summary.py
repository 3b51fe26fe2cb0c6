"""From the ranks' step reports to result rows: wall times, latencies, stages, links.

Pure functions of the reports (no process, no socket), so a result can be checked
from made-up reports (tests/test_bench_sweep.py) and the table, CSV and plot only
ever present what is computed here.
"""

from __future__ import annotations

import statistics

from kvstage.bench.scenario import KVSTAGE_MODES, Group, engine_id
from kvstage.link.paths import LOW_FRACTION


def percentile(values, q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least ``q`` % of samples at or below it."""
    s = sorted(values)
    k = max(1, -(-len(s) * q // 100))
    return s[int(k) - 1]


def _timing(payload: int, n: int, walls: list, lat: list) -> dict:
    """A result row's bytes and times: the median step's wall time over ``walls`` (``n`` requests of
    ``payload`` bytes each), every step's, and the latencies' nearest-rank p50 and p99."""
    wall = statistics.median(walls)
    return {
        "bytes": payload,
        "total_bytes": payload * n,
        "seconds": wall,
        "seconds_all": walls,
        "gbps": payload * n / wall / 1e9,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "latency_samples": len(lat),
    }


def _per_request(total: int, n: int):
    """A count over ``n`` requests in flight, per request (an int when it divides evenly)."""
    return total / n if total % n else total // n


def summarize(group: Group, reports: list) -> list[dict]:
    if group.base.multi:
        return summarize_engines(group, reports)
    by: dict = {}
    for role, rank, pi, mode, it, data in reports:
        by.setdefault((pi, mode, it), []).append((role, rank, data))
    results = []
    for pi, sc in enumerate(group.points):
        n = sc.concurrency
        payload = sc.payload_bytes()
        rows = []
        for mode in sc.run_modes:
            walls, descs, writes, stage_rows, lat, verified, errors, paths, arenas = (
                [],
                [],
                [],
                [],
                [],
                None,
                [],
                set(),
                set(),
            )
            copies, arena_bytes, exposed, layer_groups = set(), 0, [], None
            for it in range(sc.warmup, sc.warmup + sc.iters):
                got = by[(pi, mode, it)]
                srcs = [d for role, _, d in got if role == "src"]
                dsts = [d for role, _, d in got if role == "dst"]
                walls.append(max(d["t1"] for d in dsts) - min(d["t0"] for d in srcs))
                # the forward ends with the last source rank's last layer; what is left of the transfer then is exposed
                exposed.append(max(d["t1"] for d in dsts) - max(d["forward_end"] for d in srcs))
                layer_groups = next((d["layer_groups"] for d in srcs if d.get("layer_groups")), layer_groups)
                # the kvstage path's descriptors and transfers are the destination's reads; a baseline's,
                # the sources' writes
                moved = dsts if mode in KVSTAGE_MODES else srcs
                descs.append(sum(d["descriptors"] for d in moved))
                writes.append(sum(d["writes"] for d in moved))
                for k in range(n):
                    lat.append(max(d["done"][k] for d in dsts) - min(d["sent"][k] for d in srcs))
                st = {"gather": sum(d["stages"].get("gather", 0.0) for d in srcs)}
                st |= {k: sum(d["stages"].get(k, 0.0) for d in dsts) for k in ("read", "slot_wait", "scatter")}
                for stage, side in (("gather_gpu", srcs), ("read_gpu", dsts), ("scatter_gpu", dsts)):
                    if any(stage in d["stages"] for d in side):
                        st[stage] = sum(d["stages"].get(stage, 0.0) for d in side)
                # stages one after another: a source rank's gather, then a destination rank's reads and scatter
                # (each the mean over its side's ranks); over the wall time, >1 means they overlapped
                serial = st["gather"] / len(srcs) + (st["read"] + st["scatter"]) / len(dsts)
                # (after a forward the transfer's own time is the exposed time; a streamed transfer runs under
                # the forward, where stages one after another mean nothing)
                span = exposed[-1] if sc.prefill_ms else walls[-1]
                st["overlap"] = serial / span if span > 0 and mode != "streamed" else None
                arenas |= {d.get("arena") for d in srcs + dsts if d.get("arena")}
                copies |= {d.get("copier") for d in srcs + dsts if d.get("copier")}
                arena_bytes = max([arena_bytes] + [d.get("arena_bytes") or 0 for d in dsts])
                stage_rows.append(st)
                paths |= {d["path"] for d in dsts if d.get("path")}
                flags = [d["verified"] for d in dsts if d["verified"] is not None]
                if flags:
                    verified = all(flags)
                    errors += [e for d in dsts for e in d["errors"]]
            mid = walls.index(sorted(walls)[len(walls) // 2])
            row = {
                "mode": mode,
                "src_tp": sc.src_tp,
                "dst_tp": sc.dst_tp,
                "tokens": sc.tokens,
                "concurrency": n,
                **_timing(payload, n, walls, lat),
                "exposed_s": statistics.median(exposed),
                "exposed_s_all": exposed,
                "descriptors": _per_request(descs[mid], n),
                "writes": _per_request(writes[mid], n),
                "verified": verified,
                "arena_bytes": (arena_bytes or sc.arena_bytes()) if mode in KVSTAGE_MODES else None,
            }
            if mode == "streamed":
                row["layer_groups"] = layer_groups  # [start, stop) of each group, by the core's rule
            if mode in KVSTAGE_MODES:
                row["stages"] = stage_rows[mid]
                row["path"] = sorted(paths)
                row["arena"] = sorted(arenas)
                row["copier"] = sorted(copies)  # how the caches' gathers and scatters copied
            if errors:
                row["errors"] = errors[:10]
            rows.append(row)
        bulk = next((r for r in rows if r["mode"] == "bulk"), None)
        expected = expected_gbps(reports)
        for r in rows:
            r["ratio_to_bulk"] = r["gbps"] / bulk["gbps"] if bulk else None
            # bulk far below what the link should give: a ratio to it is no speed-up, and the table says so
            # (judged where one write is large enough to run at the link's speed, not its per-write cost)
            r["bulk_degraded"] = bool(
                bulk
                and expected
                and payload / max(1, bulk["writes"]) >= JUDGED_BYTES
                and bulk["gbps"] < LOW_FRACTION * expected
            )
        results += rows
    return results


def summarize_engines(group: Group, reports: list) -> list[dict]:
    """A multi-engine group's rows: one per point and (source engine, destination engine) pair.

    A pair's wall runs from its first send (the earliest of its source ranks) to its last
    completion (the latest of its destination ranks); ``step_*`` is the whole step (every
    pair's bytes over the earliest send to the latest completion of any pair). ``slot_wait_s``
    is the destination side's wait for arena slots, summed over the pair's requests and
    destination ranks; ``src_slot_wait_s`` the sources' own arena wait. Both in the pair's
    median iteration, as ``stages``."""
    by: dict = {}
    served: dict = {}  # (role, engine) -> peer engines its ranks' endpoints served, the least of its ranks
    for role, _rank, pi, mode, it, data in reports:
        by.setdefault((pi, mode, it), []).append((role, data))
        if data.get("endpoint"):
            key = (role, data["engine"])
            served[key] = min(served.get(key, data["endpoint"]["engines"]), data["endpoint"]["engines"])
    results = []
    for pi, sc in enumerate(group.points):
        n = sc.concurrency
        src_tps, dst_tps = sc.engines("src"), sc.engines("dst")
        step_bytes = n * sum(sc.payload_bytes(j) for _, j in sc.pairs())
        for mode in sc.run_modes:
            steps = []  # per measured iteration: source ranks by engine, destination ranks by engine
            for it in range(sc.warmup, sc.warmup + sc.iters):
                got = by[(pi, mode, it)]
                steps.append(
                    (
                        [[d for role, d in got if role == "src" and d["engine"] == e] for e in range(len(src_tps))],
                        [[d for role, d in got if role == "dst" and d["engine"] == e] for e in range(len(dst_tps))],
                    )
                )
            step_walls = [
                max(d["t1"] for e in dsts for d in e) - min(d["t0"] for e in srcs for d in e) for srcs, dsts in steps
            ]
            step_wall = statistics.median(step_walls)
            for i, j in sc.pairs():
                walls, lat, dst_wait, stage_rows, descs, writes = [], [], [], [], [], []
                verified, errors, paths, arenas, copies, arena_bytes = None, [], set(), set(), set(), 0
                for srcs, dsts in steps:
                    S, D = srcs[i], dsts[j]
                    walls.append(max(max(d["done"][i]) for d in D) - min(min(d["sent"][j]) for d in S))
                    for k in range(n):
                        lat.append(max(d["done"][i][k] for d in D) - min(d["sent"][j][k] for d in S))
                    dst_wait.append(sum(d["stages"][i].get("slot_wait", 0.0) for d in D))
                    st = {k: sum(d["stages"][j].get(k, 0.0) for d in S) for k in ("gather", "slot_wait")}
                    st |= {k: sum(d["stages"][i].get(k, 0.0) for d in D) for k in ("read", "scatter")}
                    for stage, side, e in (("gather_gpu", S, j), ("read_gpu", D, i), ("scatter_gpu", D, i)):
                        if any(stage in d["stages"][e] for d in side):
                            st[stage] = sum(d["stages"][e].get(stage, 0.0) for d in side)
                    stage_rows.append(st)
                    descs.append(sum(d["descriptors"][i] for d in D))
                    writes.append(sum(d["writes"][i] for d in D))
                    paths |= {d["path"][i] for d in D if d["path"][i]}
                    arenas |= {d.get("arena") for d in S + D if d.get("arena")}
                    copies |= {d.get("copier") for d in S + D if d.get("copier")}
                    arena_bytes = max([arena_bytes] + [d.get("arena_bytes") or 0 for d in D])
                    flags = [d["verified"][i] for d in D if d["verified"] is not None]
                    if flags:
                        verified = all(flags)
                        errors += [e for d in D for e in d["errors"][i]]
                mid = walls.index(sorted(walls)[len(walls) // 2])
                payload = sc.payload_bytes(j)
                row = {
                    "mode": mode,
                    "engines": group.label,
                    "src_engine": engine_id("src", i),
                    "dst_engine": engine_id("dst", j),
                    "src_tp": src_tps[i],
                    "dst_tp": dst_tps[j],
                    "tokens": sc.tokens,
                    "concurrency": n,
                    **_timing(payload, n, walls, lat),
                    "slot_wait_s": dst_wait[mid],
                    "src_slot_wait_s": stage_rows[mid]["slot_wait"],
                    "descriptors": _per_request(descs[mid], n),
                    "writes": _per_request(writes[mid], n),
                    "verified": verified,
                    "arena_bytes": arena_bytes or sc.arena_bytes("dst", j),
                    "stages": stage_rows[mid],
                    "path": sorted(paths),
                    "arena": sorted(arenas),
                    "copier": sorted(copies),
                    "step_bytes": step_bytes,
                    "step_seconds": step_wall,
                    "step_seconds_all": step_walls,
                    "step_gbps": step_bytes / step_wall / 1e9,
                    "src_peer_engines": served.get(("src", i)),
                    "dst_peer_engines": served.get(("dst", j)),
                    "ratio_to_bulk": None,
                    "bulk_degraded": False,
                }
                if errors:
                    row["errors"] = errors[:10]
                results.append(row)
    return results


#: a bulk write judged against its link's speed only from this size: one H200's cuda_ipc runs a 4 MiB
#: write at a few percent of its 1,470 GB/s (per-write cost), a 64 MiB one near it
JUDGED_BYTES = 64 << 20


def _rank_links(reports: list):
    for role, rank, _pi, _mode, _it, data in reports:
        for f in data.get("links") or []:
            yield role, rank, f if data.get("engine") is None else dict(f, engine=data["engine"])


def expected_gbps(reports: list) -> float | None:
    """The least a link of this group should give, by the ranks' connect-time findings (None: unknown)."""
    got = [f["expected_gbps"] for _, _, f in _rank_links(reports) if f.get("expected_gbps")]
    return min(got) if got else None


def links_of(reports) -> list[dict]:
    """Every rank's link findings, the same finding of several ranks once, naming them
    (``src1``, or ``s0.src1`` in a multi-engine group)."""
    by: dict = {}
    for _g, rep in reports:
        for role, rank, f in _rank_links(rep):
            key = (f["severity"], f["path"], f.get("cause"), f.get("fix"))
            entry = by.setdefault(key, {**{k: v for k, v in f.items() if k != "engine"}, "ranks": []})
            entry["ranks"].append(
                f"{role}{rank}" if f.get("engine") is None else f"{role[0]}{f['engine']}.{role}{rank}"
            )
    return list(by.values())
