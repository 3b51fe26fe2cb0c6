"""The work of a one-engine group's rank processes (``dst_main``, ``src_main``), and the
helpers every rank uses to time, wait for and report its steps.

Apart from ``worker`` (the process's entry: arguments, its link to the coordinator,
failures) so that what a rank measures reads in one place.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any, cast

import numpy as np

from kvstage.bench.control import Link
from kvstage.bench.scenario import KVSTAGE_MODES, Group
from kvstage.bench.steps import WAIT_S, content_seed, request_pages, tag


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


def _steps(link: Link, g: Group):
    """The group's steps in order, each once the coordinator's ``prep`` for it is in: (step, point index, mode,
    iteration, the point, the ``prep``), the head of every rank's loop."""
    for step, (pi, mode, it) in enumerate(g.schedule()):
        msg = link.recv("prep")
        assert msg["step"] == step, (msg, step)
        yield step, pi, mode, it, g.points[pi], msg


def _end(link: Link, want_metrics: bool, *endpoints) -> str | None:
    """A rank's end: the coordinator's ``end``, its metrics (taken before the endpoints close: their gauges and
    links are still there), then each endpoint closed."""
    link.recv("end")
    text = _exposition(want_metrics)
    for ep in endpoints:
        ep.close()
    return text


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
    for step, pi, mode, it, sc, msg in _steps(link, g):
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
    return _end(link, want_metrics, ep, base)


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
    # the baselines' transport connects only where a baseline runs: a connection's hello that no one
    # receives stays an open rendezvous, and UCX 1.21 can crash aborting one when the endpoint closes
    baselines = any(m not in KVSTAGE_MODES for p in g.points for m in p.run_modes)
    peers = (
        {p.dst_rank: base.connect(base64.b64decode(dsts[p.dst_rank]["metadata"])) for p in targets} if baselines else {}
    )
    kv = [base.register(t) for t in cache.buffers] if "per-slice" in b.run_modes else []
    dkv = {d: [Region.from_wire(r) for r in info["kv"]] for d, info in dsts.items()}
    mine_tok = sum(plan.piece_token_bytes(p) for p in targets)
    bulk, bulk_region = _bulk_buffer(g, mine_tok, dev, base)
    forward = SimulatedForward(b.geometry.layers, b.prefill_ms, dev)  # a GPU's is calibrated now, outside any step
    link.send({"type": "ready", "clock_error_s": link.sync_error, "agent": base.id})
    for step, pi, mode, it, sc, _ in _steps(link, g):
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
    return _end(link, want_metrics, ep, base)
