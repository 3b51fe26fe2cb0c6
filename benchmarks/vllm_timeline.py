"""One request's path through the engines, from their kvstage DEBUG lines.

Run ``python -m benchmarks.vllm_xpyd --trace``: every engine then logs kvstage's endpoint events, the
connector's and the load clock's, stamped with the host clock (``%(created)`` and the engine's
name). Then:

    python benchmarks/vllm_timeline.py LOGDIR REQUEST [REQUEST ...]

prints every event of each REQUEST (the id the router gave it, e.g. ``kvstage-r0-5``: the decode
and prefill engines' ids for it both start with it) from every ``*.log`` in LOGDIR, in time order,
in milliseconds from its first event. ``--slowest N`` instead picks the N requests whose load took
longest by the decode engine's clock lines.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

LINE = re.compile(r"^(\d{9,}\.\d+) (DEBUG|INFO|WARNING|ERROR) (\S+) (.*)$")
CLOCK = re.compile(r"clock: (\S+)-[0-9a-f]{8} load reported \(step\) after ([\d.]+) ms")


def events(logdir: str):
    for path in sorted(glob.glob(os.path.join(logdir, "*.log"))):
        for raw in open(path, errors="replace"):
            m = LINE.match(raw.strip())
            if m:
                yield float(m.group(1)), m.group(3), m.group(2), m.group(4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logdir")
    ap.add_argument("requests", nargs="*")
    ap.add_argument("--slowest", type=int, default=0)
    ap.add_argument("--only", default="", help="with --slowest: request ids starting with this (e.g. kvstage-r)")
    args = ap.parse_args()
    evs = sorted(events(args.logdir))
    if not evs:
        raise SystemExit(f"{args.logdir}: no timestamped lines (run python -m benchmarks.vllm_xpyd with --trace)")
    reqs = list(args.requests)
    if args.slowest:
        loads = [(float(m.group(2)), m.group(1)) for _, _, _, msg in evs if (m := CLOCK.search(msg))]
        reqs += [r for _, r in sorted((x for x in loads if x[1].startswith(args.only)), reverse=True)[:args.slowest]]
    for req in reqs:
        pat = re.compile(re.escape(req) + r"-[0-9a-f]{8}\b")
        mine = [e for e in evs if pat.search(e[3])]
        if not mine:
            print(f"no events for {req!r}\n")
            continue
        t0 = mine[0][0]
        print(f"request {req}: {len(mine)} events over {(mine[-1][0] - t0) * 1e3:.1f} ms")
        for t, who, level, what in mine:
            print(f"{(t - t0) * 1e3:10.1f} ms  {who:12s} {level[0]} {what[:200]}")
        print()


if __name__ == "__main__":
    main()
