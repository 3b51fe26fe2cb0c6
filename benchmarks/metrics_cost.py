"""What kvstage's metrics cost: per call, and on the staged path of ``kvstage bench``.

    python benchmarks/metrics_cost.py                      # both parts, the bench's defaults (4 -> 1, 2,048 tokens)
    python benchmarks/metrics_cost.py --tokens 8192 --rounds 5
    python benchmarks/metrics_cost.py --micro-only

1. Per call: each ``EndpointMetrics`` method's CPU time over many calls, in a process
   (prometheus_client's in-memory values), in a process with ``PROMETHEUS_MULTIPROC_DIR``
   set (every value written to its mmap file: what runs inside SGLang with
   ``--enable-metrics`` or vLLM with a multiprocess directory), and for the object a
   process with ``KVSTAGE_METRICS=off`` gets.
2. Staged GB/s with metrics on and off, in one run: ``kvstage bench --mode staged`` with
   the same flags, its rank processes started with ``KVSTAGE_METRICS=off`` and ``on`` in
   turn for ``--rounds`` rounds; the medians and their ratio.

Any ``kvstage bench`` flag is accepted and passed on (``--mode`` is always staged).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MICRO = r"""
import json, sys, time
from kvstage import metrics

n = int(sys.argv[1])
m = metrics.endpoint_metrics("dst", 0, "bench")
calls = {
    "request_finished": lambda i: m.request_finished("pre/0", True, 0.01, 1 << 20),
    "stage": lambda i: m.stage("scatter", 0.0004),
    "slots (a change)": lambda i: m.slots(i & 7, 8),
    "in_flight (a change)": lambda i: m.in_flight(i & 3),
    "slots (no change)": lambda i: m.slots(3, 8),
    "failure": lambda i: m.failure("pre/0", "write", "write not complete after 5 s"),
}
out = {"mode": "off" if not metrics.available() else
       "multiprocess" if metrics._families().multiprocess else "in-memory"}
for name, call in calls.items():
    for i in range(1000):
        call(i)
    t = time.thread_time()  # this thread's CPU time: what a call costs, whatever else runs on the host
    for i in range(n):
        call(i)
    out[name] = (time.thread_time() - t) / n * 1e9
t = time.thread_time()
for i in range(n):
    pass
loop = (time.thread_time() - t) / n * 1e9
out = {k: (round(v - loop) if isinstance(v, float) else v) for k, v in out.items()}
print(json.dumps(out))
"""


def micro(calls: int) -> list[dict]:
    """ns per call of each method, in the three modes (each in a fresh process)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstage-metrics-") as mp:
        for env in ({}, {"PROMETHEUS_MULTIPROC_DIR": mp}, {"KVSTAGE_METRICS": "off"}):
            full = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "KVSTAGE_METRICS")}
            out = subprocess.run([sys.executable, "-c", MICRO, str(calls)], capture_output=True, text=True,
                                 env={**full, **env}, check=True)
            rows.append(json.loads(out.stdout))
    return rows


def staged(argv: list[str], rounds: int) -> dict:
    """Staged GB/s of ``kvstage bench`` with the rank processes' metrics off and on, alternately."""
    from kvstage import cli
    from kvstage.bench.runner import run_sweep

    parser = argparse.ArgumentParser(prog="metrics_cost.py")
    cli._bench_args(parser)
    a = parser.parse_args(argv + ["--mode", "staged"])
    sweep = cli.sweep_from_args(a)
    got: dict = {"off": [], "on": []}
    before = os.environ.get("KVSTAGE_METRICS")
    try:
        for r in range(rounds):
            for switch in ("off", "on") if r % 2 == 0 else ("on", "off"):
                os.environ["KVSTAGE_METRICS"] = switch  # the rank processes inherit it
                result = run_sweep(sweep)
                gbps = [row["gbps"] for row in result["results"] if row["mode"] == "staged"]
                got[switch].append(statistics.median(gbps))
                print(f"  round {r + 1}: metrics {switch:3s} {got[switch][-1]:.3f} GB/s", file=sys.stderr, flush=True)
    finally:
        if before is None:
            os.environ.pop("KVSTAGE_METRICS", None)
        else:
            os.environ["KVSTAGE_METRICS"] = before
    b = sweep.groups[0].base
    return {"what": f"{b.src_tp} -> {b.dst_tp}, {b.tokens} tokens, {b.device}, {b.transport}, {b.iters} iters",
            "off": got["off"], "on": got["on"],
            "median_off": statistics.median(got["off"]), "median_on": statistics.median(got["on"]),
            "ratio_on_to_off": statistics.median(got["on"]) / statistics.median(got["off"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    ap.add_argument("--rounds", type=int, default=3, help="on/off pairs of bench runs (default 3)")
    ap.add_argument("--calls", type=int, default=200_000, help="calls per method in the per-call part")
    ap.add_argument("--micro-only", action="store_true", help="only the per-call part")
    ap.add_argument("--json", metavar="PATH", help="also write both parts as JSON")
    own, rest = ap.parse_known_args()
    t = time.perf_counter()
    rows = micro(own.calls)
    names = [k for k in rows[0] if k != "mode"]
    print(f"ns of CPU time per call ({own.calls} calls each, the loop's own time taken off)")
    print(f"  {'method':22s}" + "".join(f"{r['mode']:>14s}" for r in rows))
    for name in names:
        print(f"  {name:22s}" + "".join(f"{r[name]:>14d}" for r in rows))
    out = {"per_call_ns": rows}
    if not own.micro_only:
        print("staged GB/s, metrics off and on (kvstage bench --mode staged)", flush=True)
        s = staged(rest, own.rounds)
        out["staged"] = s
        print(f"  {s['what']}: off {s['median_off']:.3f}, on {s['median_on']:.3f} GB/s (medians of {own.rounds}); "
              f"on / off = {s['ratio_on_to_off']:.3f}")
    if own.json:
        with open(own.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
