"""One request's path through every rank, from the endpoints' debug lines.

Run the benchmark with ``kvstage bench --log-level DEBUG`` (each worker stamps its
lines with the host clock), keep its stderr, then:

    python benchmarks/timeline.py bench.err [REQUEST]

prints every event of REQUEST (default: the last request of the log) in time
order, in milliseconds from its first event, one line each.
"""

from __future__ import annotations

import re
import sys

LINE = re.compile(r"^(\d+\.\d+) DEBUG (\S+) (?:src|dst) (?:\d+: )?(\S+?):? (.*)$")


def events(path: str):
    for raw in open(path, errors="replace"):
        m = LINE.match(raw.strip())
        if m:
            yield float(m.group(1)), m.group(2), m.group(3), m.group(4)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    evs = [e for e in events(sys.argv[1]) if re.match(r"^[\w.-]+-i\d+-r\d+$", e[2])]
    if not evs:
        sys.exit(f"{sys.argv[1]}: no request events (was kvstage bench run with --log-level DEBUG?)")
    req = sys.argv[2] if len(sys.argv) > 2 else evs[-1][2]
    mine = sorted(e for e in evs if e[2] == req)
    if not mine:
        sys.exit(f"no events for request {req!r}")
    t0 = mine[0][0]
    print(f"request {req}: {len(mine)} events over {(mine[-1][0] - t0) * 1e3:.3f} ms")
    for t, who, _, what in mine:
        print(f"{(t - t0) * 1e3:9.3f} ms  {who:5s} {what}")


if __name__ == "__main__":
    main()
