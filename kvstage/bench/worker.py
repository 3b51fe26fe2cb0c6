"""Benchmark rank processes: one per source rank and one per destination rank.

Started as ``python -m kvstage.bench.worker --coord HOST:PORT --role dst|src
--rank R --group G --parent PID [--engine E]``. A rank connects to the coordinator
(``control.Link``), receives its group of points, and walks the group's
schedule of (point, mode, iteration) steps in lockstep with every other rank:

    prep   -> set up the step (page ids, cache contents, expected requests)
    armed  -> (coordinator waits for every rank)
    go     -> run the step: ``concurrency`` requests at once
    result -> timestamps, descriptors, verification

Page ids and cache contents change every step and come from seeds, so any
rank can derive another rank's page ids (the per-slice baseline writes
straight into destination pages) and stale bytes from an earlier step can
never pass verification.

In a multi-engine group (``--engine E``: rank R of source engine ``sE`` or
destination engine ``dE``), a rank holds ``concurrency`` requests of every
peer engine in a step, on disjoint pages, each filled from a seed of its own
(source engine, destination engine, k): a request that lands in another's
pages fails verification.

A rank ends itself when the coordinator goes away or aborts, and (Linux) when
the process that started it dies.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any, cast

import numpy as np

from kvstage.bench.control import Aborted, BenchError, Link, parse_hostport
from kvstage.bench.scenario import KVSTAGE_MODES, MAX_ENGINES, MODES, Group, engine_id
from kvstage.layout import pages_needed

WAIT_S = 600.0


def request_pages(g: Group, pi: int, side: str, rank: int, it: int, engine: int | None = None) -> list[np.ndarray]:
    """Page ids of each of the point's concurrent requests on one rank: disjoint, scattered.

    ``engine``: the rank's engine in a multi-engine group; then every request the rank holds in
    the step, request k of peer engine e at index ``e * concurrency + k`` (``request_index``)."""
    sc = g.points[pi]
    if engine is None:
        spec = sc.src if side == "src" else sc.dst
        need = pages_needed(sc.tokens, spec.page.page_size)
        rng = np.random.default_rng([sc.seed, pi, it, 0 if side == "src" else 1, rank])
        perm = rng.permutation(g.pages(spec))
        return [perm[k * need : (k + 1) * need] for k in range(sc.concurrency)]
    spec = sc.side(side, engine)
    need = pages_needed(sc.tokens, spec.page.page_size)
    rng = np.random.default_rng([sc.seed, pi, it, 0 if side == "src" else 1, rank, engine])
    perm = rng.permutation(g.pages(spec, side))
    return [perm[k * need : (k + 1) * need] for k in range(sc.requests_per_rank(side))]


def request_index(sc, peer: int, k: int) -> int:
    """Where request ``k`` to or from peer engine ``peer`` is in ``request_pages`` of a multi-engine rank."""
    return peer * sc.concurrency + k


def content_seed(g: Group, pi: int, mode: str, it: int, k: int, pair: tuple[int, int] | None = None) -> int:
    """The seed of request ``k``'s bytes in one step; ``pair``: (source engine, destination
    engine) of a multi-engine group, each pair's request k with a seed of its own."""
    sc = g.points[pi]
    seed = (((sc.seed * 1009 + pi) * 7 + MODES.index(mode)) * 1009 + it) * 4099 + k
    if pair is None:
        return seed
    i, j = pair
    return (seed * MAX_ENGINES + i) * MAX_ENGINES + j


def tag(pi: int, mode: str, it: int, k: int) -> str:
    return f"{mode}-p{pi}-i{it}-r{k}"


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when ``parent`` dies (no orphan ranks)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:
        os._exit(1)


class _NotLinkLines(logging.Filter):
    """The connect-time link lines go to the coordinator with the results, which prints each
    WARNING once above the table: a rank does not print them too."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            isinstance(record.msg, str)
            and isinstance(record.args, tuple)  # a lone mapping argument makes args that mapping
            and bool(record.args)
            and str(record.args[0]).startswith(
                ("INFO kvstage link to", "WARNING kvstage link to", "ERROR kvstage link to")
            )
        )


def _setup(label: str, level: str) -> None:
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 2) // 2)))
    logging.basicConfig(level=level, format=f"%(created).6f %(levelname)s {label} %(message)s")
    for h in logging.getLogger().handlers:
        h.addFilter(_NotLinkLines())


def _sync(dev) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _wait_writes(transport, handles) -> None:
    from kvstage.transports.base import WriteState

    deadline = time.monotonic() + WAIT_S
    pending = list(handles)
    while pending:
        pending = [h for h in pending if transport.poll(h) is WriteState.PENDING]
        if pending:
            os.sched_yield()
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} writes not done after {WAIT_S} s")
    for h in handles:
        transport.release(h)


def _stages(handles) -> dict:
    out: dict[str, float] = {}
    for h in handles:
        for k, v in h.stages.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _links(ep, step: int, g: Group) -> dict:
    """The endpoint's connect-time link findings, with the last step's result (all peers connected by then)."""
    if step != len(g.schedule()) - 1:
        return {}
    return {
        "links": [
            {k: f[k] for k in ("severity", "peer", "path", "cause", "fix", "line")}
            | {"expected_gbps": f["details"].get("expected_gbps")}
            for f in ep.stats().links
        ]
    }


def _bulk_buffer(g: Group, token_bytes: int, dev, base) -> tuple:
    """The registered buffer bulk writes leave from or land in, sized for the largest bulk point.
    Written now, as the arena and the KV caches are: untouched host memory is not real memory
    yet. A source reading it reads the kernel's one shared zero page, which stays in cache
    (a 64 MiB copy: ~27 GB/s against ~17.5 from real pages), and a first write into it
    page-faults inside bulk's first timed step."""
    nbytes = max((p.concurrency * p.tokens for p in g.points if "bulk" in p.run_modes), default=0) * token_bytes
    if not nbytes:
        return None, None
    import torch

    bulk = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=dev)
    return bulk, base.register(bulk)


def _exposition(want: bool) -> str | None:
    """This rank's metrics as Prometheus text, taken at the end of its run (``kvstage bench --metrics``)."""
    if not want:
        return None
    from kvstage import metrics

    return metrics.exposition().decode()


def dst_main(link: Link, g: Group, rank: int, listen_host: str, want_metrics: bool = False) -> str | None:
    import torch

    from kvstage.bench.baselines import slice_spans
    from kvstage.bench.reference import check_shard
    from kvstage.protocol.destination import Destination
    from kvstage.staging.cache import RankCache
    from kvstage.transports import make_transport
    from kvstage.transports.base import Spans

    b = g.base
    dev = b.torch_device("dst")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cache = RankCache.allocate(b.dst, rank, g.pages(b.dst), dev, copier=b.copier)
    ep = Destination(cache, b.settings(), listen=(listen_host, 0))
    base = make_transport(b.transport, f"kvstage-bench-dst{rank}")
    plan = b.plan
    writers = plan.writers_of(rank)
    kv = [base.register(t) for t in cache.buffers] if "per-slice" in b.run_modes else []
    bulk, bulk_region = _bulk_buffer(g, plan.dst_token_bytes(), dev, base)
    link.send(
        {
            "type": "ready",
            "clock_error_s": link.sync_error,
            "info": {
                "address": list(ep.address),
                "metadata": base64.b64encode(base.metadata()).decode(),
                "kv": [r.to_wire() for r in kv],
                "bulk": bulk_region.to_wire() if bulk_region else None,
            },
        }
    )
    dirty = np.zeros(0, dtype=np.int64)
    for step, (pi, mode, it) in enumerate(g.schedule()):
        msg = link.recv("prep")
        assert msg["step"] == step, (msg, step)
        sc = g.points[pi]
        n, tokens = sc.concurrency, sc.tokens
        last = it == sc.warmup + sc.iters - 1
        reqs = request_pages(g, pi, "dst", rank, it)
        if mode != "bulk" and len(dirty):
            idx = torch.from_numpy(dirty).to(dev)
            for t in cache.buffers:
                t.view(torch.uint8)[idx] = 0
        handles = [ep.expect(tag(pi, mode, it, k), reqs[k], tokens) for k in range(n)] if mode in KVSTAGE_MODES else []
        tickets = {}
        if mode not in KVSTAGE_MODES and not base.one_sided:  # post the receives of this step's baseline writes
            agents = msg["agents"]
            for p in writers:
                ts = []
                for k in range(n):
                    if mode == "bulk":
                        off = k * plan.dst_token_bytes() * tokens + plan.writer_offsets(rank, tokens)[p.src_rank]
                        spans = Spans.single(bulk_region, [off], [plan.piece_token_bytes(p) * tokens])
                    else:
                        src_pages = request_pages(g, pi, "src", p.src_rank, it)[k]
                        spans = slice_spans(p, sc.src, sc.dst, src_pages, reqs[k], tokens, kv, kv)[1]
                    ts.append(base64.b64encode(base.expect(agents[str(p.src_rank)], spans)).decode())
                tickets[str(p.src_rank)] = ts
        _sync(dev)
        link.send({"type": "armed", "step": step, "tickets": tickets})
        link.recv("go")
        done: list[float | None]
        path, stages, done = None, {}, [None] * n
        if handles:
            for h in handles:
                h.wait(WAIT_S)
            done = [link.to_coord(h.finished) for h in handles]
            stages, path = _stages(handles), handles[0].path
        else:
            want: dict[bytes, int] = {}  # notice -> its request
            for k in range(n):
                for p in writers:
                    want[f"{tag(pi, mode, it, k)}-{p.src_rank}".encode()] = k
            left = [len(writers)] * n
            deadline = time.monotonic() + WAIT_S
            while want:
                for _, note in base.notifications():
                    which = want.pop(note, None)
                    if which is not None:
                        left[which] -= 1
                        if not left[which]:
                            done[which] = link.now()
                if want:
                    os.sched_yield()
                if want and time.monotonic() > deadline:
                    raise TimeoutError(f"{mode}: notices {sorted(want)[:4]} missing after {WAIT_S} s")
        _sync(dev)
        t1 = max(cast("list[float]", done))  # every request's end by now: each waited for, or a TimeoutError
        verified, errors = None, []
        if sc.verify and mode != "bulk" and last:
            written = np.concatenate(reqs)
            for k in range(n):
                errs = check_shard(
                    cache,
                    content_seed(g, pi, mode, it, k),
                    reqs[k],
                    tokens,
                    untouched_fill=0 if k == 0 else None,
                    written=written,
                )
                errors += [f"request {k}: {e}" if n > 1 else e for e in errs]
            verified = not errors
        if mode != "bulk":
            dirty = np.concatenate(reqs)
        link.send(
            {
                "type": "result",
                "step": step,
                "data": {
                    "t1": t1,
                    "done": done,
                    "verified": verified,
                    "errors": errors[:5],
                    "stages": stages,
                    "path": path,
                    "descriptors": sum(h.descriptors for h in handles),
                    "writes": sum(h.writes for h in handles),
                    "arena": ep.arena_location,
                    "arena_bytes": ep.arena.buffer.nbytes,
                    "copier": ep.copier.name,
                }
                | _links(ep, step, g),
            }
        )
    link.recv("end")
    text = _exposition(want_metrics)  # before the endpoint closes: its gauges and links are still there
    ep.close()
    base.close()
    return text


def src_main(link: Link, g: Group, rank: int, want_metrics: bool = False) -> str | None:
    import torch

    from kvstage.bench.baselines import slice_spans
    from kvstage.bench.forward import SimulatedForward
    from kvstage.bench.reference import fill_shard
    from kvstage.protocol.source import Source
    from kvstage.staging.cache import RankCache
    from kvstage.transports import make_transport
    from kvstage.transports.base import Region, Spans

    b = g.base
    dev = b.torch_device("src")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cache = RankCache.allocate(b.src, rank, g.pages(b.src), dev, copier=b.copier)
    ep = Source(cache, b.settings())
    base = make_transport(b.transport, f"kvstage-bench-src{rank}")
    dsts = {int(d): info for d, info in link.recv("dsts", timeout=WAIT_S)["dsts"].items()}
    ep.connect([tuple(dsts[d]["address"]) for d in sorted(dsts)])
    plan = b.plan
    targets = plan.targets_of(rank)
    peers = {p.dst_rank: base.connect(base64.b64decode(dsts[p.dst_rank]["metadata"])) for p in targets}
    kv = [base.register(t) for t in cache.buffers] if "per-slice" in b.run_modes else []
    dkv = {d: [Region.from_wire(r) for r in info["kv"]] for d, info in dsts.items()}
    mine_tok = sum(plan.piece_token_bytes(p) for p in targets)
    bulk, bulk_region = _bulk_buffer(g, mine_tok, dev, base)
    forward = SimulatedForward(b.geometry.layers, b.prefill_ms, dev)  # a GPU's is calibrated now, outside any step
    link.send({"type": "ready", "clock_error_s": link.sync_error, "agent": base.id})
    for step, (pi, mode, it) in enumerate(g.schedule()):
        msg = link.recv("prep")
        assert msg["step"] == step, (msg, step)
        sc = g.points[pi]
        n, tokens = sc.concurrency, sc.tokens
        reqs = request_pages(g, pi, "src", rank, it)
        if mode != "bulk":
            for k in range(n):
                fill_shard(cache, content_seed(g, pi, mode, it, k), reqs[k], tokens)
        prepared: list[list[tuple[Any, int]]] = [[] for _ in range(n)]  # per request: (prepared write, its span count)
        if mode == "per-slice" and base.one_sided:  # a two-sided transport's receives are posted after "armed"
            for p in targets:
                dreqs = request_pages(g, pi, "dst", p.dst_rank, it)
                for k in range(n):
                    local, remote = slice_spans(p, sc.src, sc.dst, reqs[k], dreqs[k], tokens, kv, dkv[p.dst_rank])
                    note = f"{tag(pi, mode, it, k)}-{rank}".encode()
                    # descriptors and the transfer request made now, outside the timed step; posted in it
                    prepared[k].append((base.prepare_write(peers[p.dst_rank], local, remote, note), len(local)))
        _sync(dev)
        link.send({"type": "armed", "step": step})
        tickets = link.recv("go").get("tickets") or {}

        def ticket(d: int, k: int, tickets=tickets) -> bytes:  # from the destination's expect() (two-sided transports)
            return base64.b64decode(tickets[str(d)][k]) if str(d) in tickets else b""

        if mode == "per-slice" and not base.one_sided:  # the receives are posted only now: prepare against them
            for k in range(n):
                for w, _ in prepared[k]:
                    w.drop()
                prepared[k] = []
                for p in targets:
                    dreqs = request_pages(g, pi, "dst", p.dst_rank, it)
                    local, remote = slice_spans(p, sc.src, sc.dst, reqs[k], dreqs[k], tokens, kv, dkv[p.dst_rank])
                    prepared[k].append(
                        (
                            base.prepare_write(
                                peers[p.dst_rank],
                                local,
                                remote,
                                f"{tag(pi, mode, it, k)}-{rank}".encode(),
                                ticket(p.dst_rank, k),
                            ),
                            len(local),
                        )
                    )

        t0 = link.now()
        sent, stages, descriptors, writes, groups = [], {}, 0, 0, None
        if mode == "streamed":  # each layer group is sent as the forward writes it
            streams = [ep.stream(tag(pi, mode, it, k), reqs[k], tokens) for k in range(n)]
            sent = [t0] * n
            forward.run(lambda layers_written, streams=streams: [s.written(layers_written) for s in streams])
            forward.wait()
            for s in streams:
                s.wait(WAIT_S)
            hs = [h for s in streams for h in s.handles]
            groups = [[r.start, r.stop] for r in streams[0].groups]
            stages, descriptors, writes = _stages(hs), sum(h.descriptors for h in hs), sum(h.writes for h in hs)
        elif mode == "staged":  # the forward first, then the whole request
            forward.run()
            hs = []
            for k in range(n):
                sent.append(t0 if b.prefill_ms else link.now())
                hs.append(ep.send(tag(pi, mode, it, k), reqs[k], tokens))
            forward.wait()
            for h in hs:
                h.wait(WAIT_S)
            stages, descriptors, writes = _stages(hs), sum(h.descriptors for h in hs), sum(h.writes for h in hs)
        elif mode == "bulk":
            forward.run()
            forward.wait()  # a baseline's writes do not follow the forward's stream: they leave after it
            handles = []
            mine = mine_tok * tokens
            for k in range(n):
                sent.append(t0 if b.prefill_ms else link.now())
                at = k * mine
                for p in targets:
                    size = plan.piece_token_bytes(p) * tokens
                    off = k * plan.dst_token_bytes() * tokens + plan.writer_offsets(p.dst_rank, tokens)[rank]
                    dst_region = Region.from_wire(dsts[p.dst_rank]["bulk"])
                    handles.append(
                        base.write(
                            peers[p.dst_rank],
                            Spans.single(bulk_region, [at], [size]),
                            Spans.single(dst_region, [off], [size]),
                            f"{tag(pi, mode, it, k)}-{rank}".encode(),
                            ticket(p.dst_rank, k),
                        )
                    )
                    at += size
                    descriptors += 1
            writes = len(handles)
            _wait_writes(base, handles)
        else:
            forward.run()
            forward.wait()
            handles = []
            for k in range(n):
                sent.append(t0 if b.prefill_ms else link.now())
                for w, spans in prepared[k]:
                    handles.append(w.post())
                    descriptors += spans
            writes = len(handles)
            _wait_writes(base, handles)
        _sync(dev)
        t_end = link.now()
        link.send(
            {
                "type": "result",
                "step": step,
                "data": {
                    "t0": t0,
                    "sent": sent,
                    "t_end": t_end,
                    "forward_end": link.to_coord(forward.end),
                    "descriptors": descriptors,
                    "writes": writes,
                    "stages": stages,
                    "layer_groups": groups,
                    "arena": ep.arena_location,
                    "copier": ep.copier.name,
                }
                | _links(ep, step, g),
            }
        )
        del prepared
    link.recv("end")
    text = _exposition(want_metrics)  # before the endpoint closes: its gauges and links are still there
    ep.close()
    base.close()
    return text


# -- multi-engine groups: staged only, every source engine to every destination engine -------------
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
    from kvstage.staging.cache import RankCache

    b = g.base
    spec = b.side("dst", engine)
    dev = b.torch_device("dst")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cache = RankCache.allocate(spec, rank, g.pages(spec, "dst"), dev, copier=b.copier)
    ep = Destination(cache, b.settings(), listen=(listen_host, 0), engine=engine_id("dst", engine))
    sources = len(b.engines("src"))
    link.send({"type": "ready", "clock_error_s": link.sync_error, "info": {"address": list(ep.address)}})
    dirty = np.zeros(0, dtype=np.int64)
    for step, (pi, mode, it) in enumerate(g.schedule()):
        msg = link.recv("prep")
        assert msg["step"] == step, (msg, step)
        sc = g.points[pi]
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
    link.recv("end")
    text = _exposition(want_metrics)  # before the endpoint closes: its gauges and links are still there
    ep.close()
    return text


def src_engines_main(link: Link, g: Group, rank: int, engine: int, want_metrics: bool = False) -> str | None:
    """Rank ``rank`` of source engine ``s{engine}``: one ``Source`` connected to every destination
    engine's ranks sends ``concurrency`` requests to each, interleaved (request k to d0, d1, ...,
    then k+1); results per destination engine (``sent[j][k]``, ``stages[j]``)."""
    import torch

    from kvstage.bench.reference import fill_shard
    from kvstage.protocol.source import Source
    from kvstage.staging.cache import RankCache

    b = g.base
    spec = b.side("src", engine)
    dev = b.torch_device("src")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cache = RankCache.allocate(spec, rank, g.pages(spec, "src"), dev, copier=b.copier)
    ep = Source(cache, b.settings(), engine=engine_id("src", engine))
    engines = link.recv("dsts", timeout=WAIT_S)["engines"]  # [destination engine][its rank] -> its info
    ep.connect([tuple(info["address"]) for ranks in engines for info in ranks])
    dests = len(b.engines("dst"))
    link.send({"type": "ready", "clock_error_s": link.sync_error})
    for step, (pi, mode, it) in enumerate(g.schedule()):
        msg = link.recv("prep")
        assert msg["step"] == step, (msg, step)
        sc = g.points[pi]
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
    link.recv("end")
    text = _exposition(want_metrics)  # before the endpoint closes: its gauges and links are still there
    ep.close()
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvstage.bench.worker")
    ap.add_argument("--coord", required=True)
    ap.add_argument("--role", choices=("dst", "src"), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--engine", type=int, default=None, help="the rank's engine in a multi-engine group (s0, d1, ...)")
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument(
        "--clock-sync", action="store_true", help="measure the clock offset even on the coordinator's kernel"
    )
    a = ap.parse_args(argv)
    _die_with_parent(a.parent)
    _setup(f"{a.role}{a.rank}" + (f"@{engine_id(a.role, a.engine)}" if a.engine is not None else ""), a.log_level)
    from kvstage.config import Settings

    def lost():  # the coordinator is gone or aborted: nothing left to do here
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        hello = {"kind": "rank", "role": a.role, "rank": a.rank, "group": a.group}
        if a.engine is not None:
            hello["engine"] = a.engine
        link = Link(
            parse_hostport(a.coord, "--coord"),
            hello,
            token=Settings().auth_token,
            on_lost=lost,
            clock_sync=a.clock_sync,
        )
    except BenchError as e:  # the run ended (or failed) before this rank joined
        of = f" of engine {engine_id(a.role, a.engine)}" if a.engine is not None else ""
        print(f"kvstage bench {a.role} rank {a.rank}{of}: {e}", file=sys.stderr)
        return 1
    try:
        cfg = link.recv("config", timeout=WAIT_S)
        g = Group.from_wire(cfg["group"])
        want = bool(cfg.get("metrics"))
        if a.engine is not None and a.role == "dst":
            exposition = dst_engines_main(link, g, a.rank, a.engine, cfg["listen_host"], want)
        elif a.engine is not None:
            exposition = src_engines_main(link, g, a.rank, a.engine, want)
        elif a.role == "dst":
            exposition = dst_main(link, g, a.rank, cfg["listen_host"], want)
        else:
            exposition = src_main(link, g, a.rank, want)
    except Aborted:
        link.close()
        return 1
    except BaseException as e:
        from kvstage.errors import KVStageError

        # a failure kvstage names itself (a transfer that failed, with peer, stage and cause) needs no traceback
        known = isinstance(e, (KVStageError, TimeoutError))
        try:
            link.send(
                {"type": "error", "reason": f"{type(e).__name__}: {e}"}
                if known
                else {"type": "error", "trace": traceback.format_exc()}
            )
        except Exception:
            pass
        link.close()
        return 1
    link.finished = True
    link.send({"type": "bye"} | ({"metrics": exposition} if exposition is not None else {}))
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
