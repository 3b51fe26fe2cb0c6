"""The work of a multi-engine group's rank processes: staged only, every source engine
to every destination engine, one endpoint per rank for all its peer engines.

Apart from the one-engine ranks (``ranks``) because a rank here holds requests of
several peer engines in one step, and reports per peer engine.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from kvstage.bench.control import Link
from kvstage.bench.ranks import _end, _links, _stages, _steps, _sync
from kvstage.bench.scenario import Group, engine_id
from kvstage.bench.steps import WAIT_S, content_seed, request_index, request_pages, tag


def _rank_cache(g: Group, side: str, rank: int, engine: int):
    """(device, cache) of rank ``rank`` of engine ``engine`` on ``side``, its device made current."""
    import torch

    from kvstage.staging.cache import RankCache

    b = g.base
    spec = b.side(side, engine)
    dev = b.torch_device(side)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev, RankCache.allocate(spec, rank, g.pages(spec, side), dev, copier=b.copier)


def _endpoint(ep, step: int, g: Group) -> dict:
    """What the endpoint served, with the last step's result: one endpoint for every peer engine."""
    if step != len(g.schedule()) - 1:
        return {}
    st = ep.stats()
    return {"endpoint": {"engines": st.engines, "peers": st.peers, "slots_total": st.slots_total}}


def dst_engines_main(
    link: Link, g: Group, rank: int, engine: int, listen_host: str, want_metrics: bool = False
) -> str | None:
    """Rank ``rank`` of destination engine ``d{engine}``: one ``Destination`` expects every source
    engine's requests; results per source engine (``done[i][k]``, ``stages[i]``, ``verified[i]``)."""
    import torch

    from kvstage.bench.reference import check_shard
    from kvstage.protocol.destination import Destination

    b = g.base
    dev, cache = _rank_cache(g, "dst", rank, engine)
    ep = Destination(cache, b.settings(), listen=(listen_host, 0), engine=engine_id("dst", engine))
    sources = len(b.engines("src"))
    link.send({"type": "ready", "clock_error_s": link.sync_error, "info": {"address": list(ep.address)}})
    dirty = np.zeros(0, dtype=np.int64)
    for step, pi, mode, it, sc, _ in _steps(link, g):
        n, tokens = sc.concurrency, sc.tokens
        last = it == sc.warmup + sc.iters - 1
        reqs = request_pages(g, pi, "dst", rank, it, engine)
        if len(dirty):
            idx = torch.from_numpy(dirty).to(dev)
            for t in cache.buffers:
                t.view(torch.uint8)[idx] = 0
        handles = [
            [
                ep.expect(tag(pi, mode, it, k), reqs[request_index(sc, i, k)], tokens, engine=engine_id("src", i))
                for k in range(n)
            ]
            for i in range(sources)
        ]
        _sync(dev)
        link.send({"type": "armed", "step": step, "tickets": {}})
        link.recv("go")
        for row in handles:
            for h in row:
                h.wait(WAIT_S)
        done = [[link.to_coord(h.finished) for h in row] for row in handles]
        _sync(dev)
        errors: list[list[str]]  # per source engine
        verified, errors = None, [[] for _ in range(sources)]
        if sc.verify and last:
            written = np.concatenate(reqs)
            for i in range(sources):
                for k in range(n):
                    errs = check_shard(
                        cache,
                        content_seed(g, pi, mode, it, k, (i, engine)),
                        reqs[request_index(sc, i, k)],
                        tokens,
                        untouched_fill=0 if (i, k) == (0, 0) else None,
                        written=written,
                    )
                    errors[i] += [f"request {k} from engine s{i}: {e}" for e in errs]
            verified = [not e for e in errors]
        dirty = np.concatenate(reqs)
        link.send(
            {
                "type": "result",
                "step": step,
                "data": {
                    # each handle waited for above: its end is set
                    "t1": max(max(row) for row in cast("list[list[float]]", done)),
                    "done": done,
                    "verified": verified,
                    "errors": [e[:5] for e in errors],
                    "stages": [_stages(row) for row in handles],
                    "path": [row[0].path for row in handles],
                    "descriptors": [sum(h.descriptors for h in row) for row in handles],
                    "writes": [sum(h.writes for h in row) for row in handles],
                    "arena": ep.arena_location,
                    "arena_bytes": ep.arena.buffer.nbytes,
                    "copier": ep.copier.name,
                }
                | _links(ep, step, g)
                | _endpoint(ep, step, g),
            }
        )
    return _end(link, want_metrics, ep)


def src_engines_main(link: Link, g: Group, rank: int, engine: int, want_metrics: bool = False) -> str | None:
    """Rank ``rank`` of source engine ``s{engine}``: one ``Source`` connected to every destination
    engine's ranks sends ``concurrency`` requests to each, interleaved (request k to d0, d1, ...,
    then k+1); results per destination engine (``sent[j][k]``, ``stages[j]``)."""

    from kvstage.bench.reference import fill_shard
    from kvstage.protocol.source import Source

    b = g.base
    dev, cache = _rank_cache(g, "src", rank, engine)
    ep = Source(cache, b.settings(), engine=engine_id("src", engine))
    engines = link.recv("dsts", timeout=WAIT_S)["engines"]  # [destination engine][its rank] -> its info
    ep.connect([tuple(info["address"]) for ranks in engines for info in ranks])
    dests = len(b.engines("dst"))
    link.send({"type": "ready", "clock_error_s": link.sync_error})
    for step, pi, mode, it, sc, _ in _steps(link, g):
        n, tokens = sc.concurrency, sc.tokens
        reqs = request_pages(g, pi, "src", rank, it, engine)
        for j in range(dests):
            for k in range(n):
                fill_shard(cache, content_seed(g, pi, mode, it, k, (engine, j)), reqs[request_index(sc, j, k)], tokens)
        _sync(dev)
        link.send({"type": "armed", "step": step})
        link.recv("go")
        t0 = link.now()
        sent = [[0.0] * n for _ in range(dests)]
        hs: list[list[Any]] = [[None] * n for _ in range(dests)]  # [destination][request]: its TransferHandle
        for k in range(n):
            for j in range(dests):
                sent[j][k] = link.now()
                hs[j][k] = ep.send(
                    tag(pi, mode, it, k), reqs[request_index(sc, j, k)], tokens, engine=engine_id("dst", j)
                )
        for row in hs:
            for h in row:
                h.wait(WAIT_S)
        _sync(dev)
        link.send(
            {
                "type": "result",
                "step": step,
                "data": {
                    "t0": t0,
                    "sent": sent,
                    "t_end": link.now(),
                    "stages": [_stages(row) for row in hs],
                    "descriptors": [sum(h.descriptors for h in row) for row in hs],
                    "writes": [sum(h.writes for h in row) for row in hs],
                    "arena": ep.arena_location,
                    "copier": ep.copier.name,
                }
                | _links(ep, step, g)
                | _endpoint(ep, step, g),
            }
        )
    return _end(link, want_metrics, ep)
