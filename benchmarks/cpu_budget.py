"""CPU seconds per request of each rank process, for the default CPU scenario.

On a 2-core host the staged path is bound by the cores, not by memory
bandwidth: this says where their time goes. One destination (TP 1) and four
source processes (TP 4), Llama-3-8B KV geometry, 2,048-token requests, page 16
NHD, the bench's default arena (512 MiB, 64 MiB slots), the same pages every
request (no per-request set-up, unlike `kvstage bench`). Each rank's CPU time
is read (getrusage) after SHORT and after LONG requests; the difference over
LONG - SHORT requests is the per-request cost, set-up excluded.

Usage: python benchmarks/cpu_budget.py [--mapped auto|on|off] [--short 10] [--long 60]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

import numpy as np
import torch

TOKENS = 2048
PAGES = 256


def _specs():
    from kvstage.layout import KVGeometry, PageLayout
    from kvstage.tp import SideSpec

    g = KVGeometry(32, 8, 128, "bfloat16")
    return SideSpec(g, 4, PageLayout(16, "nhd")), SideSpec(g, 1, PageLayout(16, "nhd"))


def _settings(mapped: str):
    from kvstage.config import Settings

    return Settings(arena_mb=512, slot_mb=64, mapped=mapped)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def destination(a, addresses, go, out):
    from kvstage.protocol.destination import Destination
    from kvstage.staging.cache import RankCache

    torch.set_num_threads(1)
    ep = Destination(RankCache.allocate(_specs()[1], 0, PAGES, torch.device("cpu")), _settings(a.mapped))
    for _ in range(4):
        addresses.put(ep.address)
    ids = np.random.default_rng(0).permutation(PAGES)[: TOKENS // 16]
    walls, marks = [], {}
    for i in range(a.long):
        if i == a.short:
            marks["short"] = _cpu()
        h = ep.expect(f"r{i}", ids, TOKENS)
        for q in go:
            q.put(i)
        t = time.perf_counter()
        h.wait(60)
        walls.append(time.perf_counter() - t)
    marks["long"] = _cpu()
    out.put(("dst", marks, sorted(walls[a.short :])))
    for q in go:
        q.put(None)
    ep.close()


def source(a, rank, addresses, go, out):
    from kvstage.protocol.source import Source
    from kvstage.staging.cache import RankCache

    torch.set_num_threads(1)
    cache = RankCache.allocate(_specs()[0], rank, PAGES, torch.device("cpu"))
    for b in cache.buffers:
        b.view(torch.uint8).random_(0, 255)
    ep = Source(cache, _settings(a.mapped))
    ep.connect([addresses.get()])
    ids = np.random.default_rng(rank + 1).permutation(PAGES)[: TOKENS // 16]
    marks = {}
    while (i := go[rank].get()) is not None:
        if i == a.short:
            marks["short"] = _cpu()
        ep.send(f"r{i}", ids, TOKENS).wait(60)
    marks["long"] = _cpu()
    out.put((f"src{rank}", marks, None))
    ep.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mapped", default="off", choices=("auto", "on", "off"))
    ap.add_argument("--short", type=int, default=10)
    ap.add_argument("--long", type=int, default=60)
    a = ap.parse_args()
    mp.set_start_method("spawn")
    addresses, out = mp.Queue(), mp.Queue()
    go = [mp.Queue() for _ in range(4)]
    procs = [mp.Process(target=destination, args=(a, addresses, go, out))]
    procs += [mp.Process(target=source, args=(a, r, addresses, go, out)) for r in range(4)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    n = a.long - a.short
    total = 0.0
    print(f"mapped={a.mapped}: CPU ms per request over {n} requests (after {a.short}), 4 -> 1, {TOKENS} tokens")
    for who, marks, walls in sorted(rows):
        user = (marks["long"][0] - marks["short"][0]) / n * 1e3
        sys_ = (marks["long"][1] - marks["short"][1]) / n * 1e3
        total += user + sys_
        print(f"  {who:5s} user {user:6.1f}  sys {sys_:6.1f}")
        if walls:
            p50 = walls[len(walls) // 2]
            print(f"  wall p50 {p50 * 1e3:.1f} ms ({268.435456e6 / p50 / 1e9:.2f} GB/s)")
    print(f"  all ranks {total:.1f} ms of CPU per request: at least {total / 2:.1f} ms of wall on 2 cores")


if __name__ == "__main__":
    main()
