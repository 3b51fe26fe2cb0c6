"""The streaming rule's group count, swept: what ``stream.MAX_GROUPS`` (the most layer groups a
streamed request is cut into) does to the exposed time, each count beside the unstreamed transfer
in the same bench run.

    python benchmarks/group_sweep.py --device cuda --tokens 8192 --prefill-ms 40
    python benchmarks/group_sweep.py --groups 2,4,8 --tokens 2048 --prefill-ms 500   # the CPU machine

For each count, ``kvstage bench --mode staged,streamed`` with the same flags runs with its rank
processes' ``MAX_GROUPS`` set to it (a ``sitecustomize`` on their ``PYTHONPATH``, made for this run
in a temporary folder: a benchmark's lever, not a setting). Prints streamed and staged exposed time
and their ratio per count; any ``kvstage bench`` flag is passed on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

SITE = """
import os
_n = os.environ.get("KVSTAGE_SWEEP_MAX_GROUPS")
if _n:
    import kvstage.protocol.stream as _stream
    _stream.MAX_GROUPS = int(_n)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="1,2,4,8,16", help="the counts swept (default 1,2,4,8,16)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    own, rest = ap.parse_known_args()
    from kvstage import cli
    from kvstage.bench.runner import run_sweep

    parser = argparse.ArgumentParser(prog="group_sweep.py")
    cli._bench_args(parser)
    a = parser.parse_args(rest + ["--mode", "staged,streamed"])
    sweep = cli.sweep_from_args(a)
    t0, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="kvstage-groups-") as site, mock.patch.dict(os.environ):
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(SITE)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
        for n in [int(x) for x in own.groups.split(",")]:
            os.environ["KVSTAGE_SWEEP_MAX_GROUPS"] = str(n)  # the rank processes inherit it
            result = run_sweep(sweep)
            by = {r["mode"]: r for r in result["results"]}
            st, sm = by["staged"], by["streamed"]
            row = {
                "max_groups": n,
                "groups": len(sm.get("layer_groups") or []),
                "staged_exposed_s": st.get("exposed_s"),
                "streamed_exposed_s": sm.get("exposed_s"),
                "staged_p50_s": st.get("latency_p50_s"),
                "streamed_p50_s": sm.get("latency_p50_s"),
                "path": sorted(set(st.get("path") or []) | set(sm.get("path") or [])),
                "verified": all(r.get("verified", True) is not False for r in (st, sm)),
            }
            rows.append(row)
            print(
                f"  MAX_GROUPS {n:3d}: {row['groups']} groups, streamed exposed "
                f"{_ms(row['streamed_exposed_s'])} ms, staged {_ms(row['staged_exposed_s'])} ms, "
                f"ratio {_ratio(row)}, path {','.join(row['path'])}, verified {row['verified']}",
                flush=True,
            )
    best = min(rows, key=lambda r: r["streamed_exposed_s"] if r["streamed_exposed_s"] is not None else 1e9)
    print(f"lowest streamed exposed: MAX_GROUPS {best['max_groups']} ({_ms(best['streamed_exposed_s'])} ms); "
          f"median staged exposed {_ms(statistics.median(r['staged_exposed_s'] or 0 for r in rows))} ms")
    if own.json:
        with open(own.json, "w") as f:
            json.dump(rows, f, indent=2)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _ratio(row) -> str:
    a, b = row["streamed_exposed_s"], row["staged_exposed_s"]
    return "-" if not a or not b else f"{a / b:.3f}x"


if __name__ == "__main__":
    sys.exit(main())
