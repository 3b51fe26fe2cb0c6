"""Where a request's time goes, step by step, without debug logging.

Reads the stamps that a tree patched with ``benchmarks/stamps.patch`` writes
(``KVSTAGE_STAMPS=DIR kvstage bench ...``: one JSON file per process, each a
list of ``(step, request, perf_counter, thread)``). For every case directory
under the given root it prints, per step, the median time after the bench's
``send`` of the staged requests (warm-up requests left out). Steps a request
passes several times (one ``landed`` per destination, a loop's wake-ups) are
numbered in order. perf_counter is CLOCK_MONOTONIC, one clock for every
process of a host. Run by ``gpu_run.sh`` part ``stamps``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path


def _role(stamps: list) -> str:
    names = {s[0] for s in stamps}
    return "src" if "b.send" in names or any(n.startswith("s.") for n in names) else "dst"


def case_steps(case: Path, warmup: int) -> tuple[int, list[tuple[float, int, str]]]:
    """(requests, [(median ms after send, requests that passed it, 'process step')])."""
    procs = {p.stem: json.loads(p.read_text()) for p in sorted(case.glob("*.json")) if p.name != "bench.json"}
    names, counts = {}, collections.Counter()
    for pid, stamps in procs.items():  # src0, dst0, dst1, ... in the order the files sort
        role = _role(stamps)
        names[pid] = f"{role}{counts[role]}"
        counts[role] += 1
    sends = {}
    for stamps in procs.values():
        for step, req, t, _ in stamps:
            if step == "b.send" and "staged" in req:
                sends.setdefault(req, t)
    reqs = sorted(sends, key=sends.get)[warmup:]
    after = collections.defaultdict(list)
    for req in reqs:
        t0 = sends[req]
        ends = [t for s in procs.values() for step, r, t, _ in s if step == "d.done" and r == req]
        if not ends:
            continue
        t1 = max(ends)
        for pid, stamps in procs.items():
            seen = collections.Counter()
            for step, r, t, _ in stamps:
                if r == req or (r is None and t0 <= t <= t1):  # a loop's own steps: those inside the request
                    seen[step] += 1
                    key = step if seen[step] == 1 else f"{step}#{seen[step]}"
                    after[f"{names[pid]} {key}"].append((t - t0) * 1e3)
    rows = [(statistics.median(v), len(v), k) for k, v in after.items() if len(v) >= len(reqs) / 2]
    return len(reqs), sorted(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="a directory of case directories, each with the stamps of one bench run")
    ap.add_argument("--warmup", type=int, default=5, help="first staged requests of each case to leave out")
    args = ap.parse_args()
    for case in sorted(p for p in args.root.iterdir() if p.is_dir()):
        n, rows = case_steps(case, args.warmup)
        print(f"== {case.name}: {n} staged requests; median ms after send (steps at least half of them passed)")
        for ms, count, key in rows:
            print(f"  {ms:7.3f}  n={count:4d}  {key}")


if __name__ == "__main__":
    main()
