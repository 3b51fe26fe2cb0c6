"""Engines of several ranks for the multi-peer suite (imported by spawned children).

An engine here is one process holding every rank of one TP size as its own
``Source`` endpoint, all with the same engine id, as a prefill engine's workers
would. Requests follow a schedule both sides compute (``schedule``), so a
destination can expect them with its own pages and check every byte.
"""

from __future__ import annotations

import time

import numpy as np

from kvstage.bench.reference import fill_shard
from kvstage.config import Settings
from kvstage.layout import pages_needed
from kvstage.staging.cache import RankCache
from support.fault_ranks import GEO, PagePool, request_tokens, src_spec

SETTINGS = dict(arena_mb=1 / 16, stall_timeout_s=5.0)  # 4 slots of 16 KiB: 32 tokens at TP 1


def content(engine_seed: int, i: int) -> int:
    """The reference content's seed of request ``i`` of an engine."""
    return engine_seed * 1000 + i


def schedule(engine_seed: int, n: int, most: int, targets: int = 1) -> list[tuple[str, int, int]]:
    """Request ``i`` of an engine: (name, tokens, index of the destination engine it goes to).
    A negative ``most`` makes every request exactly ``-most`` tokens long."""
    size = (lambda i: -most) if most < 0 else (lambda i: request_tokens(engine_seed, i, most))
    return [(f"q{i}", size(i), i % targets) for i in range(n)]


def source_engine(engine: str, tp: int, targets: list, n: int, most: int, seed: int, conc: int, report, commands,
                  over: dict | None = None) -> None:
    """Prefill engine ``engine`` at TP ``tp`` in this process: connect each rank to every
    destination engine of ``targets`` [(engine id, addresses)], say ``ready``, wait for ``go``,
    then send the schedule's requests (``conc`` in flight per rank), request i to destination
    engine i % len(targets). Reports ``("done", engine, sent, failures)``."""
    from kvstage.protocol.source import Source

    settings = Settings(**(SETTINGS | (over or {})))
    srcs = []
    for rank in range(tp):
        cache = RankCache.allocate(src_spec(tp), rank, conc * pages_needed(abs(most), 16) + 8)
        src = Source(cache, settings, engine=engine)
        for _, addresses in targets:
            src.connect([tuple(a) for a in addresses])
        srcs.append((src, PagePool(cache.pages, seed + 100 + rank)))
    report.put(("ready", engine))
    assert commands.get(timeout=120) == "go"
    plan = schedule(seed, n, most, len(targets))
    inflight: list[dict] = [{} for _ in srcs]
    failures, i = [], 0
    deadline = time.monotonic() + 300
    while (i < n or any(inflight)) and time.monotonic() < deadline:
        for (src, pool), mine in zip(srcs, inflight):
            for k, (h, ids) in list(mine.items()):
                if h.done():
                    del mine[k]
                    pool.give(ids)
                    if h.error is not None:
                        failures.append(f"{k} rank {src.rank}: {h.error}")
        if i < n and all(len(m) < conc for m in inflight):
            name, tokens, t = plan[i]
            taken = [pool.take(pages_needed(tokens, 16)) for _, pool in srcs]
            if all(ids is not None for ids in taken):
                for (src, _), ids, mine in zip(srcs, taken, inflight):
                    fill_shard(src.cache, content(seed, i), ids, tokens)
                    mine[name] = (src.send(name, ids, tokens, engine=targets[t][0]), ids)
                i += 1
                continue
            for (_, pool), ids in zip(srcs, taken):
                if ids is not None:
                    pool.give(ids)
        time.sleep(0.0005)
    report.put(("done", engine, i, failures))
    commands.get(timeout=120)  # "close": the test has checked what it needed while this engine was up
    for src, _ in srcs:
        src.close()
