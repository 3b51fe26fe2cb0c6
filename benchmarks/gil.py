"""A small host request's latency alone and beside a Python thread that holds the GIL.

Two processes on this host: a source rank and a destination rank (Llama-3-8B KV geometry, prefill TP 1 ->
decode TP 1 unless --src-tp says otherwise, host memory, NIXL). In the destination's process (or the
source's: --busy src) a thread runs pure Python without pause, as an engine's own Python does; it
keeps the GIL for the interpreter's switch interval (5 ms) whenever a kvstage thread waits for it. Each
request is timed from the source's ``send`` to the destination's handle being done (one host:
CLOCK_MONOTONIC, which perf_counter reads), in two orders: the destination expects first and the ready arrives (``expect-first``),
or the ready is in when the destination expects (``ready-first``, vLLM's order: the prefill finished
before its decode asks), where the time runs from ``expect``.

    python benchmarks/gil.py                      # 16 tokens, 200 requests per case
    python benchmarks/gil.py --tokens 16,256 --requests 300 --busy dst,src

Prints one table and, with --json FILE, writes the figures (p50/p90 ms alone and beside, and the ratio).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time

TOKEN = "kvstage-gil-bench"


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():  # pure Python: holds the GIL until the switch interval makes it let go
        x += 1


def _cache(role: str, tp: int, rank: int, pages: int):
    from kvstage import KVGeometry, PageLayout, RankCache, SideSpec

    spec = SideSpec(KVGeometry(32, 8, 128), tp, PageLayout(16))
    return RankCache.allocate(spec, rank, pages, "cpu")


def _dst(conn, pages: int, busy: bool, path: str) -> None:
    os.environ["KVSTAGE_AUTH_TOKEN"] = TOKEN
    os.environ["KVSTAGE_PATH"] = path
    from kvstage import Destination

    dst = Destination(_cache("dst", 1, 0, pages))
    conn.send(("address", dst.address))
    stop = threading.Event()
    if busy:
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    while True:
        msg = conn.recv()
        if msg[0] == "end":
            break
        _, req, tokens, order = msg
        ids = list(range(-(-tokens // 16)))
        if order == "expect-first":
            h = dst.expect(req, ids, tokens)
            conn.send(("expecting",))
            h.wait(30)
            conn.send(("done", h.finished))
        else:  # the ready is in: the time runs from expect
            conn.send(("expecting",))
            conn.recv()  # the source sent, and its ready had time to arrive
            t0 = time.perf_counter()
            h = dst.expect(req, ids, tokens)
            h.wait(30)
            conn.send(("done", h.finished - t0))
    stop.set()
    dst.close()


def _src(conn, pages: int, busy: bool, path: str) -> None:
    os.environ["KVSTAGE_AUTH_TOKEN"] = TOKEN
    os.environ["KVSTAGE_PATH"] = path
    from kvstage import Source

    src = Source(_cache("src", 1, 0, pages))
    src.connect([conn.recv()[1]])
    stop = threading.Event()
    if busy:
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    conn.send(("connected",))
    while True:
        msg = conn.recv()
        if msg[0] == "end":
            break
        _, req, tokens = msg
        t0 = time.perf_counter()
        h = src.send(req, list(range(-(-tokens // 16))), tokens)
        conn.send(("sent", t0))
        h.wait(30)
    stop.set()
    src.close()


def run_case(tokens: int, requests: int, busy: str | None, order: str, path: str = "auto") -> list[float]:
    ctx = mp.get_context("spawn")
    pages = -(-tokens // 16) + 1
    dp, dc = ctx.Pipe()
    sp, sc = ctx.Pipe()
    d = ctx.Process(target=_dst, args=(dc, pages, busy == "dst", path), daemon=True)
    s = ctx.Process(target=_src, args=(sc, pages, busy == "src", path), daemon=True)
    d.start()
    s.start()
    sp.send(dp.recv())
    assert sp.recv()[0] == "connected"
    out = []
    for i in range(requests):
        req = f"{order}-{busy}-{tokens}-{i}"
        if order == "expect-first":
            dp.send(("request", req, tokens, order))
            dp.recv()
            sp.send(("send", req, tokens))
            t0 = sp.recv()[1]
            out.append(dp.recv()[1] - t0)
        else:
            dp.send(("request", req, tokens, order))
            dp.recv()
            sp.send(("send", req, tokens))
            sp.recv()
            time.sleep(0.01)
            dp.send(("go",))
            out.append(dp.recv()[1])
    for p in (dp, sp):
        p.send(("end",))
    d.join(30)
    s.join(30)
    return out[max(1, requests // 20):]  # the first requests warm up the connection


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gil.py")
    ap.add_argument("--tokens", default="16")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--busy", default="dst", help="dst, src or both, comma list: where the GIL-holding thread runs")
    ap.add_argument("--path", default="auto", help="the kvstage path setting of both ranks (auto: the route's choice)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    for tokens in [int(t) for t in a.tokens.split(",")]:
        for order in ("ready-first", "expect-first"):
            alone = run_case(tokens, a.requests, None, order, a.path)
            for busy in a.busy.split(","):
                beside = run_case(tokens, a.requests, busy, order, a.path)
                p50a, p50b = statistics.median(alone) * 1e3, statistics.median(beside) * 1e3
                rows.append({"tokens": tokens, "order": order, "busy": busy, "path": a.path, "alone_p50_ms": p50a,
                             "alone_p90_ms": statistics.quantiles(alone, n=10)[-1] * 1e3,
                             "beside_p50_ms": p50b, "beside_p90_ms": statistics.quantiles(beside, n=10)[-1] * 1e3,
                             "ratio_p50": p50b / p50a})
    print(f"{'tokens':>6} {'order':>12} {'busy':>4} {'alone p50':>10} {'beside p50':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['order']:>12} {r['busy']:>4} {r['alone_p50_ms']:>9.2f}m {r['beside_p50_ms']:>10.2f}m "
              f"{r['ratio_p50']:>5.1f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
