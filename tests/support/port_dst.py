"""A destination rank in its own process, for attacks on its control port
(tests/test_control_port.py): its descriptor limit can be lowered and its memory read.

    python tests/support/port_dst.py '{"spare_fds": 16}'

Prints one JSON line (after ``PREFIX``) ``{"port", "pid"}`` once listening, then answers commands
on stdin, one JSON line each: ``{"cmd": "expect", "tokens", "seed"}`` (waits for
the request, then checks every byte), ``{"cmd": "rss"}``, ``{"cmd": "quit"}``.
Its log goes to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder, when run as a script
from support import fault_ranks as fr  # noqa: E402

from kvstage.config import Settings  # noqa: E402
from kvstage.layout import pages_needed  # noqa: E402
from kvstage.protocol.destination import Destination  # noqa: E402
from kvstage.staging.cache import RankCache  # noqa: E402

MOST_TOKENS = 2048
PREFIX = "@port_dst "  # its answers; a library may print on stdout too


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _say(obj: dict) -> None:
    print(PREFIX + json.dumps(obj), flush=True)


def main(cfg: dict) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    cache = RankCache.allocate(fr.dst_spec(), 0, pages_needed(MOST_TOKENS, 4) + 3)
    dst = Destination(cache, Settings(**fr.SETTINGS))
    if "spare_fds" in cfg:  # descriptors open now plus a few: a flood of connections runs out of them
        limit = len(os.listdir("/proc/self/fd")) + cfg["spare_fds"]
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    _say({"port": dst.address[1], "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "expect":
            tokens, seed = cmd["tokens"], cmd["seed"]
            pages = np.random.default_rng(seed + 1).permutation(cache.pages)[: pages_needed(tokens, 4)]
            h = dst.expect(f"r{seed}", pages, tokens)
            try:
                h.wait(60)
                out = {"ok": True, "wrong": fr.check(cache, seed, pages, tokens)}
            except Exception as e:
                out = {"ok": False, "error": str(e)}
        elif cmd["cmd"] == "rss":
            out = {"rss": _rss_bytes()}
        else:
            break
        _say(out)
    dst.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
