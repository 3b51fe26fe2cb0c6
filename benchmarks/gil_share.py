"""A small request's latency when the endpoint's process also runs Python on
another thread, as an engine's worker does (its model runner, its scheduler).

    python3 benchmarks/gil_share.py [--side dst|src] [--requests 60] [--json PATH]

The endpoint under test (``--side``) lives in this process beside one busy
thread; its peer lives in a child process with nothing else to do. Each
request is 16 tokens of a tiny geometry on host caches, so its time is the
endpoints' host steps alone. The busy thread runs, in turn:

- nothing (no busy thread);
- pure Python (a loop of integer arithmetic), which holds the GIL until the
  interpreter's switch interval forces it off (``sys.getswitchinterval()``,
  5 ms unless changed), with the default interval, then 1 ms and 0.1 ms;
- small torch CPU ops back to back, which release the GIL inside each op.

(kvstage's setting ``switch_interval_us`` sets the same interval while its
endpoints are open; here it is set directly, around each case.)

Latency: from the source's ``send`` to the request DONE on the side under
test (stamped by its loop), median and max over the requests after 5. No GPU
needed; the mechanism is the same with CUDA caches.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time

import torch

TOKENS = 16


def _endpoint(role: str):
    from kvstage.config import Settings
    from kvstage.layout import KVGeometry, PageLayout
    from kvstage.protocol.destination import Destination
    from kvstage.protocol.source import Source
    from kvstage.staging.cache import RankCache
    from kvstage.tp import SideSpec

    cache = RankCache.allocate(SideSpec(KVGeometry(2, 2, 64, "bfloat16"), 1, PageLayout(16, "nhd")), 0, 64,
                               torch.device("cpu"))
    settings = Settings(arena_mb=1, slot_mb=0.25)
    return Destination(cache, settings) if role == "dst" else Source(cache, settings)


def _peer(role: str, conn) -> None:
    """The other side, in a child process: obeys ``conn`` until told to stop."""
    ep = _endpoint(role)
    if role == "dst":
        conn.send(ep.address)
    else:
        ep.connect([conn.recv()])
    handles = {}
    while (msg := conn.recv()) is not None:
        verb, req, page = msg
        if verb == "expect":
            handles[req] = ep.expect(req, [page], TOKENS)
            conn.send("ok")
        else:  # send: report when it was called
            t = time.perf_counter()
            ep.send(req, [page], TOKENS)
            conn.send(t)
    for h in handles.values():
        h.wait(10)
    ep.close()


class Busy:
    """A thread doing ``kind`` work until stopped."""

    def __init__(self, kind: str):
        self.kind, self._stop = kind, False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = torch.ones(16)
        while not self._stop:
            if self.kind == "python":
                s = 0
                for i in range(1000):
                    s += i * i % 7
            else:
                for _ in range(20):
                    x.add_(1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def _requests(side: str, ep, conn, tag: str, n: int) -> list[float]:
    lat = []
    for k in range(n):
        req, page = f"{tag}-{k}", k % 64
        if side == "dst":
            h = ep.expect(req, [page], TOKENS)
            time.sleep(0.002)
            conn.send(("send", req, page))
            h.wait(30)  # this thread waits without the GIL; the peer's send time comes after
            t = conn.recv()
        else:
            conn.send(("expect", req, page))
            conn.recv()
            time.sleep(0.002)
            t = time.perf_counter()
            h = ep.send(req, [page], TOKENS)
        h.wait(30)
        lat.append(h.finished - t)
    return lat[5:]


def measure(side: str, n: int) -> dict:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_peer, args=("src" if side == "dst" else "dst", theirs))
    child.start()
    ep = _endpoint(side)
    if side == "dst":
        mine.send(ep.address)
    else:
        ep.connect([mine.recv()])
    default = sys.getswitchinterval()
    cases = [("none", None, default), ("python", "python", default), ("python, 1 ms switch", "python", 1e-3),
             ("python, 0.1 ms switch", "python", 1e-4), ("torch ops", "torch", default)]
    out = {"side": side, "default_switch_interval_s": default, "cases": []}
    try:
        for name, kind, interval in cases:
            sys.setswitchinterval(interval)
            row = {"busy": name}
            if kind is None:
                lat = _requests(side, ep, mine, "r0", n)
            else:
                with Busy(kind):
                    lat = _requests(side, ep, mine, f"r{len(out['cases'])}", n)
            row["p50_ms"], row["max_ms"] = statistics.median(lat) * 1e3, max(lat) * 1e3
            out["cases"].append(row)
    finally:
        sys.setswitchinterval(default)
        mine.send(None)
        child.join(30)
        ep.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=("dst", "src"), default="dst", help="the endpoint sharing its process")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    res = measure(a.side, a.requests)
    for row in res["cases"]:
        print(f"{a.side}, busy thread {row['busy']:22s} p50 {row['p50_ms']:7.3f} ms  max {row['max_ms']:7.3f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
