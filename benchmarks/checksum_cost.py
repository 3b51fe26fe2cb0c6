"""What the chunk checksum costs on the staged path of ``kvstage bench``, its settings side by side.

    python benchmarks/checksum_cost.py                               # the bench's defaults (4 -> 1, 2,048 tokens)
    python benchmarks/checksum_cost.py --device cuda --tokens 8192 --rounds 5
    KVSTAGE_PATH=read python benchmarks/checksum_cost.py --device cuda --tokens 8192

``kvstage bench --mode staged`` with the same flags, its rank processes started with
``KVSTAGE_CHECKSUM`` set to each of ``--checksums`` in turn (the order rotated every round), for
``--rounds`` rounds; per setting the median of the rounds' median GB/s and p50 latency, and each
one's ratio to ``off``. The rank processes inherit every other variable (``KVSTAGE_PATH`` too).
Any ``kvstage bench`` flag is accepted and passed on (``--mode`` is always staged).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def staged(argv: list[str], settings: list[str], rounds: int) -> dict:
    """Per checksum setting: the medians of ``rounds`` bench runs' median GB/s and p50 seconds, and the paths."""
    from kvstage import cli
    from kvstage.bench.runner import run_sweep

    parser = argparse.ArgumentParser(prog="checksum_cost.py")
    cli._bench_args(parser)
    a = parser.parse_args(argv + ["--mode", "staged"])
    sweep = cli.sweep_from_args(a)
    got: dict = {s: {"gbps": [], "p50": [], "paths": set()} for s in settings}
    before = os.environ.get("KVSTAGE_CHECKSUM")
    try:
        for r in range(rounds):
            order = settings[r % len(settings) :] + settings[: r % len(settings)]
            for setting in order:
                os.environ["KVSTAGE_CHECKSUM"] = setting  # the rank processes inherit it
                result = run_sweep(sweep)
                rows = [row for row in result["results"] if row["mode"] == "staged"]
                assert all(row.get("verified", True) is not False for row in rows), rows
                got[setting]["gbps"].append(statistics.median(row["gbps"] for row in rows))
                got[setting]["p50"].append(statistics.median(row["latency_p50_s"] for row in rows))
                for row in rows:
                    got[setting]["paths"].update(row.get("path") or [])
                print(
                    f"  round {r + 1}: checksum {setting:7s} {got[setting]['gbps'][-1]:.3f} GB/s, "
                    f"p50 {got[setting]['p50'][-1] * 1e3:.3f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if before is None:
            os.environ.pop("KVSTAGE_CHECKSUM", None)
        else:
            os.environ["KVSTAGE_CHECKSUM"] = before
    b = sweep.groups[0].base
    out: dict = {
        "what": f"{b.src_tp} -> {b.dst_tp}, {b.tokens} tokens, {b.device}, {b.transport}, {b.iters} iters, "
        f"KVSTAGE_PATH={os.environ.get('KVSTAGE_PATH', 'auto')}",
        "rounds": rounds,
    }
    for s in settings:
        out[s] = {
            "gbps": statistics.median(got[s]["gbps"]),
            "p50_s": statistics.median(got[s]["p50"]),
            "paths": sorted(got[s]["paths"]),
            "runs_gbps": got[s]["gbps"],
        }
    if "off" in settings:
        for s in settings:
            out[s]["gbps_to_off"] = out[s]["gbps"] / out["off"]["gbps"]
            out[s]["p50_to_off"] = out[s]["p50_s"] / out["off"]["p50_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of one bench run per setting (default 3)")
    ap.add_argument("--checksums", default="off,all,sampled", help="the settings compared (default off,all,sampled)")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    own, rest = ap.parse_known_args()
    t = time.perf_counter()
    settings = own.checksums.split(",")
    s = staged(rest, settings, own.rounds)
    print(f"staged, checksum settings side by side: {s['what']}, medians of {own.rounds} rounds")
    for name in settings:
        row = s[name]
        ratio = f", {row['gbps_to_off']:.3f}x off's GB/s, p50 {row['p50_to_off']:.3f}x" if "gbps_to_off" in row else ""
        print(
            f"  {name:8s} {row['gbps']:.3f} GB/s, p50 {row['p50_s'] * 1e3:.3f} ms, path {','.join(row['paths'])}{ratio}"
        )
    if own.json:
        with open(own.json, "w") as f:
            json.dump(s, f, indent=2)
    print(f"({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
