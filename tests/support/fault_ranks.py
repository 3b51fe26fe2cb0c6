"""Rank processes for the fault suite (imported by spawned children)."""

from __future__ import annotations

import time

import numpy as np

from kvstage.bench.reference import check_shard, fill_shard
from kvstage.config import Settings
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

GEO = KVGeometry(2, 4, 16, "bfloat16")
SETTINGS = dict(arena_mb=1 / 16, stall_timeout_s=5.0)  # 4 slots of 16 KiB: 32 tokens at TP 1


def src_spec(tp: int) -> SideSpec:
    return SideSpec(GEO, tp, PageLayout(16))


def dst_spec() -> SideSpec:
    return SideSpec(GEO, 1, PageLayout(4))


def until(cond, limit: float = 10.0) -> None:
    """Poll ``cond`` until it holds; fail the test after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def request_tokens(seed: int, i: int, most: int) -> int:
    return int(np.random.default_rng([seed, i]).integers(1, most + 1))


class PagePool:
    """Free page ids of one cache; requests take random ones and give them back."""

    def __init__(self, pages: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(pages))

    def take(self, n: int):
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return np.asarray(out)

    def give(self, ids) -> None:
        self.free.extend(int(x) for x in ids)
        self.rng.shuffle(self.free)


def send_one(address, rank: int, tp: int, tokens: int, seed: int, report, over: dict | None = None) -> None:
    """Connect as source ``rank`` of ``tp``, send one request ``r{seed}``, report the outcome.
    ``over``: settings that differ from ``SETTINGS``."""
    from kvstage.protocol.source import Source

    cache = RankCache.allocate(src_spec(tp), rank, pages_needed(tokens, 16) + 3)
    pages = np.random.default_rng(seed).permutation(cache.pages)[: pages_needed(tokens, 16)]
    fill_shard(cache, seed, pages, tokens)
    src = Source(cache, Settings(**(SETTINGS | (over or {}))))
    src.connect([tuple(address)])
    report.put(("sending", rank))
    h = src.send(f"r{seed}", pages, tokens)
    try:
        h.wait(60)
        report.put(("done", rank, None))
    except Exception as e:
        report.put(("failed", rank, str(e)))
    time.sleep(0.5)
    src.close()


def receive_one(tokens: int, seed: int, report, commands) -> None:
    """A destination that expects one request ``r{seed}`` and reports its address and outcome."""
    from kvstage.protocol.destination import Destination

    cache = RankCache.allocate(dst_spec(), 0, pages_needed(tokens, 4) + 3)
    dst = Destination(cache, Settings(**SETTINGS))
    pages = np.random.default_rng(seed + 1).permutation(cache.pages)[: pages_needed(tokens, 4)]
    h = dst.expect(f"r{seed}", pages, tokens)
    report.put(("address", dst.address))
    commands.get()
    h.wait(60)


def receive_cuda(tokens: int, seed: int, report, commands) -> None:
    """A destination on GPU 0 (its arena shared with sources on that GPU) that expects one
    request ``r{seed}``, reports its address, then whether every byte of it arrived."""
    from kvstage.protocol.destination import Destination

    cache = RankCache.allocate(dst_spec(), 0, pages_needed(tokens, 4) + 3, "cuda:0")
    dst = Destination(cache, Settings(**SETTINGS))
    pages = np.random.default_rng(seed + 1).permutation(cache.pages)[: pages_needed(tokens, 4)]
    h = dst.expect(f"r{seed}", pages, tokens)
    report.put(("address", dst.address))
    try:
        h.wait(60)
        report.put(("checked", h.path, check(cache, seed, pages, tokens)))
    except Exception as e:
        report.put(("failed", str(e), []))
    commands.get(timeout=60)
    dst.close()


def load_source(address, rank: int, tp: int, n: int, most: int, conc: int, seed: int, report) -> None:
    """Send requests 0..n-1 (sizes from the shared schedule), ``conc`` in flight at most."""
    from kvstage.protocol.source import Source

    cache = RankCache.allocate(src_spec(tp), rank, conc * pages_needed(most, 16) + 8)
    pool = PagePool(cache.pages, seed + 100 + rank)
    src = Source(cache, Settings(**SETTINGS))
    src.connect([tuple(address)])
    inflight, failed, i = {}, [], 0
    deadline = time.monotonic() + 600
    while (i < n or inflight) and time.monotonic() < deadline:
        for k, (h, ids) in list(inflight.items()):
            if h.done():
                del inflight[k]
                pool.give(ids)
                if h.error is not None:
                    failed.append(f"{k}: {h.error}")
        if i < n and len(inflight) < conc:
            tokens = request_tokens(seed, i, most)
            ids = pool.take(pages_needed(tokens, 16))
            if ids is not None:
                fill_shard(cache, seed * 100_000 + i, ids, tokens)
                inflight[i] = (src.send(f"q{i}", ids, tokens), ids)
                i += 1
                continue
        time.sleep(0.0005)
    report.put(("load", rank, i, failed, len(inflight)))
    time.sleep(0.5)
    src.close()


def two_to_one(settings: Settings, n: int, tokens: int, seed: int, content: int):
    """A destination (TP 1, page 4) and two sources (TP 2, page 16) connected to it, in
    this process, with random pages for ``n`` requests of ``tokens`` tokens on each side;
    each source's pages of request k hold the reference content of seed ``content + k``.
    Returns (destination, sources, destination pages, each source's pages), one row per
    request; the caller closes the endpoints."""
    from kvstage.protocol.destination import Destination
    from kvstage.protocol.source import Source

    dcache = RankCache.allocate(dst_spec(), 0, n * pages_needed(tokens, 4) + 4)
    dst = Destination(dcache, settings)
    srcs = []
    for rank in range(2):
        cache = RankCache.allocate(src_spec(2), rank, n * pages_needed(tokens, 16) + 2)
        srcs.append(Source(cache, settings))
        srcs[-1].connect([dst.address])
    rng = np.random.default_rng(seed)
    dpages = rng.permutation(dcache.pages)[: n * pages_needed(tokens, 4)].reshape(n, -1)
    spages = [rng.permutation(s.cache.pages)[: n * pages_needed(tokens, 16)].reshape(n, -1) for s in srcs]
    for k in range(n):
        for s, p in zip(srcs, spages):
            fill_shard(s.cache, content + k, p[k], tokens)
    return dst, srcs, dpages, spages


def check(cache, seed: int, ids, tokens: int) -> list[str]:
    return check_shard(cache, seed, ids, tokens, untouched_fill=None)


def send_holding_the_gil(address, tokens: int, seed: int, hold_s: int, report) -> None:
    """Send one request ``r{seed}`` as source rank 0 of TP 1 and, once its first chunk is written,
    hold this process's GIL for ``hold_s`` seconds (a C call made through ``ctypes.PyDLL``, which
    keeps the GIL): what a busy engine does to its endpoint's loop. Reports the outcome."""
    import ctypes

    from kvstage.protocol.source import Source

    cache = RankCache.allocate(src_spec(1), 0, pages_needed(tokens, 16) + 3)
    pages = np.random.default_rng(seed).permutation(cache.pages)[: pages_needed(tokens, 16)]
    fill_shard(cache, seed, pages, tokens)
    src = Source(cache, Settings(**SETTINGS))
    src.connect([tuple(address)])
    h = src.send(f"r{seed}", pages, tokens)
    until(lambda: h.bytes > 0, 60)
    report.put(("holding", hold_s))
    ctypes.PyDLL(None).sleep(hold_s)  # no Python thread of this process runs meanwhile
    try:
        h.wait(120)
        report.put(("done", 0, None))
    except Exception as e:
        report.put(("failed", 0, str(e)))
    time.sleep(0.5)
    src.close()
