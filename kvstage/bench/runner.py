"""Start the rank processes of a sweep, drive them in lockstep, summarize.

Three ways to run, one protocol (``control``):

- local (default): this process coordinates on 127.0.0.1 and starts every
  rank process itself;
- ``role="dst"``: this process listens on ``--listen HOST:PORT``, starts the
  destination ranks here and has each source host's ``--role src`` process
  (``run_source_host``) start that host's share of the source ranks;
- ``run_source_host``: connects to a ``--role dst`` run, starts the source
  ranks it is told to, and gets the results at the end.

Each group (one TP pair, or one set of engines: ``--src-engines`` /
``--dst-engines``) runs in fresh rank processes; its points (token counts,
concurrencies) reuse them. A rank process is known by its role, its engine
(None in a one-engine group) and its rank. Wall time of one step is from the earliest
source start to the latest destination completion, on the coordinator's clock; its exposed time
from the latest source rank's forward end (``--prefill-ms``; without it, the step's start) to
the same completion.
"""

from __future__ import annotations

import os
import secrets
import statistics
import subprocess
import sys
import time

from kvstage.bench.control import BenchError, Coordinator, Link, Peer, rank_name, wildcard
from kvstage.bench.scenario import KVSTAGE_MODES, Group, Scenario, Sweep, engine_id
from kvstage.link.paths import LOW_FRACTION

WAIT_S = 600.0
JOIN_S = 120.0  # a started rank process must connect within this
KILL_GRACE_S = 5.0

__all__ = ["BenchError", "run", "run_sweep", "run_source_host", "summarize"]


def _child_stdout():
    """Rank processes print (NIXL, logs) to our stderr so stdout stays the table/JSON."""
    try:
        os.fstat(2)
        return 2
    except OSError:
        return subprocess.DEVNULL


class Children:
    """Rank processes started by this process (``log_level``: of their logs on stderr;
    ``clock_sync``: they measure their clock offset to the coordinator even on its kernel;
    ``token``: the auth token their endpoints use, ``KVSTAGE_AUTH_TOKEN`` in their environment)."""

    def __init__(self, coord: tuple[str, int], log_level: str = "WARNING", clock_sync: bool = False, token: str = ""):
        self.coord, self.log_level, self.clock_sync = coord, log_level, clock_sync
        self.env = dict(os.environ, KVSTAGE_AUTH_TOKEN=token) if token else None
        self.procs: dict[tuple[int, str, int | None, int], subprocess.Popen] = {}

    def start(self, group: int, role: str, ranks, engine: int | None = None) -> None:
        """Start ranks ``ranks`` of ``role`` (of engine ``engine`` in a multi-engine group)."""
        for r in ranks:
            cmd = (
                [
                    sys.executable,
                    "-m",
                    "kvstage.bench.worker",
                    "--coord",
                    f"{self.coord[0]}:{self.coord[1]}",
                    "--role",
                    role,
                    "--rank",
                    str(r),
                    "--group",
                    str(group),
                    "--parent",
                    str(os.getpid()),
                    "--log-level",
                    self.log_level,
                ]
                + (["--clock-sync"] if self.clock_sync else [])
                + (["--engine", str(engine)] if engine is not None else [])
            )
            # own session: a terminal's Ctrl-C reaches only us, and we end the ranks in order
            self.procs[(group, role, engine, r)] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=_child_stdout(), start_new_session=True, env=self.env
            )

    def failed(self) -> str | None:
        for (_g, role, engine, r), p in self.procs.items():
            rc = p.poll()
            if rc not in (None, 0):
                return f"{rank_name(role, r, engine)} exited with code {rc}"
        return None

    def reap(self, group: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for key in [k for k in self.procs if k[0] == group]:
            p = self.procs.pop(key)
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        """End every rank still running: they saw the coordinator close; then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + KILL_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


class Session:
    """The coordinator's side of a run: groups one after another."""

    def __init__(
        self,
        coord: Coordinator,
        children: Children,
        listen_host: str,
        agents: list[Peer] | None = None,
        progress=None,
        metrics: bool = False,
    ):
        self.coord, self.children, self.listen_host = coord, children, listen_host
        self.agents = agents or []  # source hosts; empty: source ranks are ours too
        self.progress = progress
        self.metrics = metrics  # each rank sends its metrics' exposition text with its bye
        self.expositions: list[tuple[str, str, int, str, str]] = []  # (group label, role, rank, engine, text)
        #: (role, engine, rank) -> its rank process; the key of a peer's hello, whose fields may be None
        self.group_peers: dict[tuple[str | None, int | None, int | None], Peer] = {}
        self.gi = -1
        self.clock_error_s = 0.0  # largest offset error of a rank on another clock
        self.synced_ranks = 0

    # -- events ---------------------------------------------------------------------
    def _next(self, what: str, timeout: float = WAIT_S):
        deadline = time.monotonic() + timeout
        while True:
            ev = self.coord.get(0.25)
            if ev is None:
                bad = self.children.failed()
                if bad:
                    raise BenchError(f"{bad} while waiting for {what}")
                if time.monotonic() > deadline:
                    raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
                continue
            kind, peer = ev[0], ev[1]
            if peer.kind == "rank" and peer.group != self.gi:
                continue  # a finished group's rank leaving
            if peer.kind == "agent" and peer not in self.agents:
                if kind == "joined":  # one source host too many: turn it away, keep running
                    try:
                        peer.send({"type": "abort", "reason": "this run already has all its source hosts"})
                    except BenchError:
                        pass
                continue
            if kind == "closed":
                if peer.said_bye:
                    continue
                raise BenchError(f"{peer.name} disconnected ({ev[2]}) while waiting for {what}")
            if kind == "msg" and ev[2]["type"] == "bye":
                peer.said_bye = True
            if kind == "msg" and ev[2]["type"] == "error":
                raise BenchError(f"{peer.name} failed:\n{ev[2].get('trace') or ev[2].get('reason')}")
            return ev

    def _gather(self, peers, kind: str, what: str) -> dict:
        """Wait for one ``kind`` message from each of ``peers``; return {peer: msg}."""
        got: dict[Peer, dict] = {}
        while len(got) < len(peers):
            ev = self._next(what)
            if ev[0] != "msg" or ev[1] not in peers:
                raise BenchError(f"unexpected {ev[0]} from {ev[1].name} while waiting for {what}")
            if ev[2]["type"] != kind:
                raise BenchError(f"{ev[1].name} sent {ev[2]['type']!r} while {what} was expected")
            got[ev[1]] = ev[2]
        return got

    # -- one group --------------------------------------------------------------------
    def run_group(self, gi: int, group: Group, done_steps: int, total_steps: int) -> list:
        self.gi = gi
        b = group.base
        self.group_peers = {}
        src_procs, dst_procs = group.processes("src"), group.processes("dst")
        self._tick(
            done_steps,
            total_steps,
            f"{group.label}: starting {len(src_procs) + len(dst_procs)} rank processes",
            phase=True,
        )
        for engine, ranks in _by_engine(dst_procs):
            self.children.start(gi, "dst", ranks, engine)
        if self.agents:
            share = _contiguous(len(src_procs), len(self.agents))
            for agent, idx in zip(self.agents, share, strict=True):  # one share per agent
                if not idx:
                    continue
                if b.multi:  # (engine, rank) of each
                    agent.send({"type": "spawn", "group": gi, "procs": [list(src_procs[i]) for i in idx]})
                else:
                    agent.send({"type": "spawn", "group": gi, "ranks": [src_procs[i][1] for i in idx]})
        else:
            for engine, ranks in _by_engine(src_procs):
                self.children.start(gi, "src", ranks, engine)
        want = {("dst", e, r) for e, r in dst_procs} | {("src", e, r) for e, r in src_procs}
        wire = group.to_wire()
        ready_dst: dict[tuple, dict] = {}
        while len(self.group_peers) < len(want) or len(ready_dst) < len(dst_procs):
            ev = self._next("rank processes to start", JOIN_S)
            peer = ev[1]
            if ev[0] == "joined":
                key = (peer.role, peer.engine, peer.rank)
                if peer.kind != "rank" or key not in want or key in self.group_peers:
                    raise BenchError(f"unexpected process joined: {peer.name} of group {peer.group}")
                self.group_peers[key] = peer
                peer.send({"type": "config", "group": wire, "listen_host": self.listen_host, "metrics": self.metrics})
            elif ev[2]["type"] == "ready" and peer.role == "dst":
                ready_dst[(peer.engine, peer.rank)] = ev[2]["info"]
                self._clock(peer, ev[2])
            else:
                raise BenchError(f"{peer.name} sent {ev[2]['type']!r} during start-up")
        srcs = [self.group_peers[("src", e, r)] for e, r in src_procs]
        dsts = [self.group_peers[("dst", e, r)] for e, r in dst_procs]
        if self.agents:  # two hosts: say where the destination ranks are (kvstage probe --peer can use them)
            where = ", ".join(
                f"{rank_name('dst', r, e)} at {d['address'][0]}:{d['address'][1]}" for (e, r), d in ready_dst.items()
            )
            print(f"kvstage bench: {group.label}: {where}", file=sys.stderr, flush=True)

        def seen_by(p: Peer, d: dict) -> dict:  # a wildcard listen address, as this source reaches it
            host, port = d["address"]
            return dict(d, address=[p.local_host if wildcard(host) else host, port])

        for p in srcs:
            if b.multi:  # every destination engine's ranks, in order
                p.send(
                    {
                        "type": "dsts",
                        "engines": [
                            [seen_by(p, ready_dst[(e, r)]) for r in range(tp)] for e, tp in enumerate(b.engines("dst"))
                        ],
                    }
                )
            else:
                p.send({"type": "dsts", "dsts": {r: seen_by(p, d) for (_, r), d in ready_dst.items()}})
        agents = {}  # source rank -> its baseline transport's id (two-sided destinations post receives for it)
        for p, msg in self._gather(set(srcs), "ready", "source ranks to connect").items():
            self._clock(p, msg)
            agents[str(p.rank)] = msg.get("agent")
        everyone = set(srcs) | set(dsts)
        reports = []
        steps = group.schedule()
        self._tick(done_steps, total_steps, f"{group.label}: measuring, {len(steps)} steps", phase=True)
        for i, (pi, mode, it) in enumerate(steps):
            sc = group.points[pi]
            self._tick(
                done_steps + i,
                total_steps,
                f"{group.label} {sc.tokens} tok{f' x{sc.concurrency}' if sc.concurrency > 1 else ''} {mode}",
            )
            for p in everyone:
                p.send({"type": "prep", "step": i} | ({"agents": agents} if p.role == "dst" else {}))
            armed = self._gather(everyone, "armed", f"step {i} to be armed")
            for p in everyone:
                go = {"type": "go", "step": i}
                if p.role == "src":  # receive tickets of two-sided transports, per destination rank
                    go["tickets"] = {
                        str(d.rank): m["tickets"][str(p.rank)]
                        for d, m in armed.items()
                        if d.role == "dst" and str(p.rank) in (m.get("tickets") or {})
                    }
                p.send(go)
            for p, msg in self._gather(everyone, "result", f"results of step {i} ({mode})").items():
                data = msg["data"] if p.engine is None else dict(msg["data"], engine=p.engine)
                reports.append((p.role, p.rank, pi, mode, it, data))
        for p in everyone:
            p.send({"type": "end"})
        byes = self._gather(everyone, "bye", "rank processes to finish")
        if self.metrics:
            for p in sorted(everyone, key=lambda p: (p.role != "dst", p.engine or 0, p.rank)):
                assert p.role is not None and p.rank is not None, "a rank process: its (role, engine, rank) was wanted"
                engine = "" if p.engine is None else engine_id(p.role, p.engine)
                self.expositions.append((group.label, p.role, p.rank, engine, byes[p].get("metrics") or ""))
        self.children.reap(gi)
        for agent in self.agents:
            agent.send({"type": "reap", "group": gi})
        self._tick(done_steps + len(steps), total_steps, f"{group.label}: done", phase=True)
        return reports

    def _clock(self, peer: Peer, msg: dict) -> None:
        err = msg.get("clock_error_s") or 0.0
        if peer.boot_id != self.coord.boot or err:
            self.clock_error_s = max(self.clock_error_s, float(err))
            self.synced_ranks += 1

    def _tick(self, done: int, total: int, what: str, phase: bool = False) -> None:
        if self.progress:
            self.progress(done, total, what, phase)


def _by_engine(procs: list[tuple]) -> list[tuple]:
    """``[(engine, rank), ...]`` -> ``[(engine, [ranks]), ...]``, engines in order."""
    out: dict = {}
    for e, r in procs:
        out.setdefault(e, []).append(r)
    return list(out.items())


def _contiguous(n: int, parts: int) -> list[list[int]]:
    """Ranks 0..n-1 split into ``parts`` contiguous shares, as even as can be."""
    out, at = [], 0
    for i in range(parts):
        k = n // parts + (1 if i < n % parts else 0)
        out.append(list(range(at, at + k)))
        at += k
    return out


def _sweep_of(target) -> Sweep:
    if isinstance(target, Sweep):
        return target
    if isinstance(target, Scenario):
        return Sweep([Group([target])])
    return Sweep([Group(list(g)) for g in target])


def run_sweep(
    target,
    progress=None,
    role: str = "local",
    listen: tuple[str, int] | None = None,
    src_hosts: int = 1,
    on_listen=None,
    log_level: str = "WARNING",
    clock_sync: bool = False,
    metrics: str | None = None,
) -> dict:
    """Run every group of ``target`` (a ``Sweep``, a ``Scenario`` or a list of
    point lists); return ``{"config", "results"}``. ``metrics``: a file to write
    every rank's Prometheus exposition text into at the end (``write_metrics``).

    ``role="dst"``: listen on ``listen`` and wait for ``src_hosts`` source hosts
    (``run_source_host``) before starting; ``on_listen(address)`` is called once
    listening. On any failure or interrupt every process started for the run
    is ended before this returns or raises."""
    from kvstage.config import Settings

    sweep = _sweep_of(target)
    token = Settings().auth_token
    if role == "local" and not token:  # its own ranks only: each run makes one, so its ports are never open
        token = secrets.token_hex(16)
    if role == "local":
        coord = Coordinator(("127.0.0.1", 0), token)
        listen_host = "127.0.0.1"
    elif role == "dst":
        from kvstage.protocol.gate import check_listen

        assert listen is not None, "role dst listens: its caller gives the address"
        check_listen(
            Settings(), listen, "kvstage bench --role dst"
        )  # before anything listens: the ranks would refuse it anyway
        coord = Coordinator(listen, token)
        listen_host = listen[0]
    else:
        raise ValueError(f"role={role!r}")
    children = Children(
        ("127.0.0.1", coord.address[1]) if wildcard(coord.address[0]) else coord.address, log_level, clock_sync, token
    )
    total = sum(len(g.schedule()) for g in sweep.groups)
    host = host_facts(sweep.groups[0].base.device)
    agents: list[Peer] = []
    ok = False
    try:
        if role == "dst":
            if on_listen:
                on_listen(coord.address)
            while len(agents) < src_hosts:
                ev = coord.get(WAIT_S)
                if ev is None:
                    raise BenchError(f"no source host connected within {WAIT_S:g} s ({len(agents)} of {src_hosts})")
                if ev[0] == "joined" and ev[1].kind == "agent":
                    agents.append(ev[1])
                    ev[1].send({"type": "welcome-run", "index": len(agents) - 1, "sweep": _sweep_summary(sweep)})
                elif ev[0] == "closed" and ev[1] in agents:
                    raise BenchError(f"{ev[1].name} disconnected before the run started ({ev[2]})")
                elif ev[0] == "joined":
                    raise BenchError(f"{ev[1].name} connected before any group started")
        session = Session(coord, children, listen_host, agents, progress, metrics=metrics is not None)
        reports, done = [], 0
        for gi, g in enumerate(sweep.groups):
            rep = session.run_group(gi, g, done, total)
            done += len(g.schedule())
            reports.append((g, rep))
        result = {
            "config": _config(sweep),
            "results": [r for g, rep in reports for r in summarize(g, rep)],
            "links": links_of(reports),
        }
        if sweep.skipped:
            result["skipped"] = sweep.skipped
        result["host"] = dict(host, load_end=_load())
        result["clock"] = {
            "hosts": len({p.boot_id for p in coord.peers}),
            "synced_ranks": session.synced_ranks,
            "max_offset_error_s": session.clock_error_s,
        }
        if metrics is not None:
            write_metrics(metrics, session.expositions)
        for agent in agents:
            agent.send({"type": "results", "result": result})
        ok = True
        return result
    finally:
        if not ok:
            coord.abort("the coordinator stopped the run")
        time.sleep(0.05 if agents else 0)
        coord.close()
        children.stop_all()


def write_metrics(path: str, expositions) -> None:
    """Every rank's exposition text into one file, each block headed by a comment naming its
    group, role, rank and engine (a block is one rank's whole exposition: split at those lines to parse)."""
    with open(path, "w") as f:
        for label, role, rank, engine, text in expositions:
            side = "source" if role == "src" else "destination"
            of = f" of engine {engine}" if engine else ""
            tags = f", engine={engine}" if engine else ""
            f.write(f"# kvstage bench: TP {label}, {side} rank {rank}{of} (role={role}, rank={rank}{tags})\n")
            f.write(text if text.endswith("\n") or not text else text + "\n")


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def host_facts(device: str = "cpu") -> dict:
    """What the numbers depend on, recorded with them (the coordinator's host)."""
    from importlib import metadata

    import kvstage

    facts = {
        "cpus": os.cpu_count(),
        "load_start": _load(),
        "python": sys.version.split()[0],
        "kvstage": getattr(kvstage, "__version__", None),
    }
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    if device == "cuda":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
            facts["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    for dist in ("torch", "nixl-cu13", "nixl-cu12", "nixl", "ucxx-cu13", "ucxx-cu12", "libucx-cu13", "libucx-cu12"):
        try:
            facts[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return facts


def run(target, progress=None) -> dict:
    """Run one scenario (or a sweep) on this host; ``{"config", "results"}``."""
    return run_sweep(target, progress)


def _sweep_summary(sweep: Sweep) -> dict:
    return {"groups": len(sweep.groups), "points": len(sweep.points)}


def _config(sweep: Sweep) -> dict:
    """The single point's config, or the common config plus the list of pairs/tokens/concurrencies.
    With several engines, ``src_engines`` and ``dst_engines`` (or ``engines``, per group, in a sweep)
    stand for the TP pair, and ``bytes`` of each result for ``payload_bytes``."""
    pts = sweep.points
    multi = pts[0].multi
    d = pts[0].to_dict()
    if multi:
        for k in ("src_tp", "dst_tp", "payload_bytes"):
            d.pop(k)
    if len(pts) == 1:
        return d
    for k in ("tokens", "concurrency") + (
        ("src_engines", "dst_engines") if multi else ("src_tp", "dst_tp", "payload_bytes")
    ):
        d.pop(k)
    if multi:
        d["engines"] = [[list(g.base.engines("src")), list(g.base.engines("dst"))] for g in sweep.groups]
    else:
        d["pairs"] = [[g.base.src_tp, g.base.dst_tp] for g in sweep.groups]
    d["tokens"] = sorted({p.tokens for p in pts})
    d["concurrency"] = sorted({p.concurrency for p in pts})
    d["points"] = len(pts)
    return d


# -- results ---------------------------------------------------------------------------
def percentile(values, q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least ``q`` % of samples at or below it."""
    s = sorted(values)
    k = max(1, -(-len(s) * q // 100))
    return s[int(k) - 1]


def _timing(payload: int, n: int, walls: list, lat: list) -> dict:
    """A result row's bytes and times: the median step's wall time over ``walls`` (``n`` requests of
    ``payload`` bytes each), every step's, and the latencies' nearest-rank p50 and p99."""
    wall = statistics.median(walls)
    return {
        "bytes": payload,
        "total_bytes": payload * n,
        "seconds": wall,
        "seconds_all": walls,
        "gbps": payload * n / wall / 1e9,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "latency_samples": len(lat),
    }


def _per_request(total: int, n: int):
    """A count over ``n`` requests in flight, per request (an int when it divides evenly)."""
    return total / n if total % n else total // n


def summarize(group: Group, reports: list) -> list[dict]:
    if group.base.multi:
        return summarize_engines(group, reports)
    by: dict = {}
    for role, rank, pi, mode, it, data in reports:
        by.setdefault((pi, mode, it), []).append((role, rank, data))
    results = []
    for pi, sc in enumerate(group.points):
        n = sc.concurrency
        payload = sc.payload_bytes()
        rows = []
        for mode in sc.run_modes:
            walls, descs, writes, stage_rows, lat, verified, errors, paths, arenas = (
                [],
                [],
                [],
                [],
                [],
                None,
                [],
                set(),
                set(),
            )
            copies, arena_bytes, exposed, layer_groups = set(), 0, [], None
            for it in range(sc.warmup, sc.warmup + sc.iters):
                got = by[(pi, mode, it)]
                srcs = [d for role, _, d in got if role == "src"]
                dsts = [d for role, _, d in got if role == "dst"]
                walls.append(max(d["t1"] for d in dsts) - min(d["t0"] for d in srcs))
                # the forward ends with the last source rank's last layer; what is left of the transfer then is exposed
                exposed.append(max(d["t1"] for d in dsts) - max(d["forward_end"] for d in srcs))
                layer_groups = next((d["layer_groups"] for d in srcs if d.get("layer_groups")), layer_groups)
                # the kvstage path's descriptors and transfers are the destination's reads; a baseline's,
                # the sources' writes
                moved = dsts if mode in KVSTAGE_MODES else srcs
                descs.append(sum(d["descriptors"] for d in moved))
                writes.append(sum(d["writes"] for d in moved))
                for k in range(n):
                    lat.append(max(d["done"][k] for d in dsts) - min(d["sent"][k] for d in srcs))
                st = {"gather": sum(d["stages"].get("gather", 0.0) for d in srcs)}
                st |= {k: sum(d["stages"].get(k, 0.0) for d in dsts) for k in ("read", "slot_wait", "scatter")}
                for stage, side in (("gather_gpu", srcs), ("read_gpu", dsts), ("scatter_gpu", dsts)):
                    if any(stage in d["stages"] for d in side):
                        st[stage] = sum(d["stages"].get(stage, 0.0) for d in side)
                # stages one after another: a source rank's gather, then a destination rank's reads and scatter
                # (each the mean over its side's ranks); over the wall time, >1 means they overlapped
                serial = st["gather"] / len(srcs) + (st["read"] + st["scatter"]) / len(dsts)
                # (after a forward the transfer's own time is the exposed time; a streamed transfer runs under
                # the forward, where stages one after another mean nothing)
                span = exposed[-1] if sc.prefill_ms else walls[-1]
                st["overlap"] = serial / span if span > 0 and mode != "streamed" else None
                arenas |= {d.get("arena") for d in srcs + dsts if d.get("arena")}
                copies |= {d.get("copier") for d in srcs + dsts if d.get("copier")}
                arena_bytes = max([arena_bytes] + [d.get("arena_bytes") or 0 for d in dsts])
                stage_rows.append(st)
                paths |= {d["path"] for d in dsts if d.get("path")}
                flags = [d["verified"] for d in dsts if d["verified"] is not None]
                if flags:
                    verified = all(flags)
                    errors += [e for d in dsts for e in d["errors"]]
            mid = walls.index(sorted(walls)[len(walls) // 2])
            row = {
                "mode": mode,
                "src_tp": sc.src_tp,
                "dst_tp": sc.dst_tp,
                "tokens": sc.tokens,
                "concurrency": n,
                **_timing(payload, n, walls, lat),
                "exposed_s": statistics.median(exposed),
                "exposed_s_all": exposed,
                "descriptors": _per_request(descs[mid], n),
                "writes": _per_request(writes[mid], n),
                "verified": verified,
                "arena_bytes": (arena_bytes or sc.arena_bytes()) if mode in KVSTAGE_MODES else None,
            }
            if mode == "streamed":
                row["layer_groups"] = layer_groups  # [start, stop) of each group, by the core's rule
            if mode in KVSTAGE_MODES:
                row["stages"] = stage_rows[mid]
                row["path"] = sorted(paths)
                row["arena"] = sorted(arenas)
                row["copier"] = sorted(copies)  # how the caches' gathers and scatters copied
            if errors:
                row["errors"] = errors[:10]
            rows.append(row)
        bulk = next((r for r in rows if r["mode"] == "bulk"), None)
        expected = expected_gbps(reports)
        for r in rows:
            r["ratio_to_bulk"] = r["gbps"] / bulk["gbps"] if bulk else None
            # bulk far below what the link should give: a ratio to it is no speed-up, and the table says so
            # (judged where one write is large enough to run at the link's speed, not its per-write cost)
            r["bulk_degraded"] = bool(
                bulk
                and expected
                and payload / max(1, bulk["writes"]) >= JUDGED_BYTES
                and bulk["gbps"] < LOW_FRACTION * expected
            )
        results += rows
    return results


def summarize_engines(group: Group, reports: list) -> list[dict]:
    """A multi-engine group's rows: one per point and (source engine, destination engine) pair.

    A pair's wall runs from its first send (the earliest of its source ranks) to its last
    completion (the latest of its destination ranks); ``step_*`` is the whole step (every
    pair's bytes over the earliest send to the latest completion of any pair). ``slot_wait_s``
    is the destination side's wait for arena slots, summed over the pair's requests and
    destination ranks; ``src_slot_wait_s`` the sources' own arena wait. Both in the pair's
    median iteration, as ``stages``."""
    by: dict = {}
    served: dict = {}  # (role, engine) -> peer engines its ranks' endpoints served, the least of its ranks
    for role, _rank, pi, mode, it, data in reports:
        by.setdefault((pi, mode, it), []).append((role, data))
        if data.get("endpoint"):
            key = (role, data["engine"])
            served[key] = min(served.get(key, data["endpoint"]["engines"]), data["endpoint"]["engines"])
    results = []
    for pi, sc in enumerate(group.points):
        n = sc.concurrency
        src_tps, dst_tps = sc.engines("src"), sc.engines("dst")
        step_bytes = n * sum(sc.payload_bytes(j) for _, j in sc.pairs())
        for mode in sc.run_modes:
            steps = []  # per measured iteration: source ranks by engine, destination ranks by engine
            for it in range(sc.warmup, sc.warmup + sc.iters):
                got = by[(pi, mode, it)]
                steps.append(
                    (
                        [[d for role, d in got if role == "src" and d["engine"] == e] for e in range(len(src_tps))],
                        [[d for role, d in got if role == "dst" and d["engine"] == e] for e in range(len(dst_tps))],
                    )
                )
            step_walls = [
                max(d["t1"] for e in dsts for d in e) - min(d["t0"] for e in srcs for d in e) for srcs, dsts in steps
            ]
            step_wall = statistics.median(step_walls)
            for i, j in sc.pairs():
                walls, lat, dst_wait, stage_rows, descs, writes = [], [], [], [], [], []
                verified, errors, paths, arenas, copies, arena_bytes = None, [], set(), set(), set(), 0
                for srcs, dsts in steps:
                    S, D = srcs[i], dsts[j]
                    walls.append(max(max(d["done"][i]) for d in D) - min(min(d["sent"][j]) for d in S))
                    for k in range(n):
                        lat.append(max(d["done"][i][k] for d in D) - min(d["sent"][j][k] for d in S))
                    dst_wait.append(sum(d["stages"][i].get("slot_wait", 0.0) for d in D))
                    st = {k: sum(d["stages"][j].get(k, 0.0) for d in S) for k in ("gather", "slot_wait")}
                    st |= {k: sum(d["stages"][i].get(k, 0.0) for d in D) for k in ("read", "scatter")}
                    for stage, side, e in (("gather_gpu", S, j), ("read_gpu", D, i), ("scatter_gpu", D, i)):
                        if any(stage in d["stages"][e] for d in side):
                            st[stage] = sum(d["stages"][e].get(stage, 0.0) for d in side)
                    stage_rows.append(st)
                    descs.append(sum(d["descriptors"][i] for d in D))
                    writes.append(sum(d["writes"][i] for d in D))
                    paths |= {d["path"][i] for d in D if d["path"][i]}
                    arenas |= {d.get("arena") for d in S + D if d.get("arena")}
                    copies |= {d.get("copier") for d in S + D if d.get("copier")}
                    arena_bytes = max([arena_bytes] + [d.get("arena_bytes") or 0 for d in D])
                    flags = [d["verified"][i] for d in D if d["verified"] is not None]
                    if flags:
                        verified = all(flags)
                        errors += [e for d in D for e in d["errors"][i]]
                mid = walls.index(sorted(walls)[len(walls) // 2])
                payload = sc.payload_bytes(j)
                row = {
                    "mode": mode,
                    "engines": group.label,
                    "src_engine": engine_id("src", i),
                    "dst_engine": engine_id("dst", j),
                    "src_tp": src_tps[i],
                    "dst_tp": dst_tps[j],
                    "tokens": sc.tokens,
                    "concurrency": n,
                    **_timing(payload, n, walls, lat),
                    "slot_wait_s": dst_wait[mid],
                    "src_slot_wait_s": stage_rows[mid]["slot_wait"],
                    "descriptors": _per_request(descs[mid], n),
                    "writes": _per_request(writes[mid], n),
                    "verified": verified,
                    "arena_bytes": arena_bytes or sc.arena_bytes("dst", j),
                    "stages": stage_rows[mid],
                    "path": sorted(paths),
                    "arena": sorted(arenas),
                    "copier": sorted(copies),
                    "step_bytes": step_bytes,
                    "step_seconds": step_wall,
                    "step_seconds_all": step_walls,
                    "step_gbps": step_bytes / step_wall / 1e9,
                    "src_peer_engines": served.get(("src", i)),
                    "dst_peer_engines": served.get(("dst", j)),
                    "ratio_to_bulk": None,
                    "bulk_degraded": False,
                }
                if errors:
                    row["errors"] = errors[:10]
                results.append(row)
    return results


#: a bulk write judged against its link's speed only from this size: one H200's cuda_ipc runs a 4 MiB
#: write at a few percent of its 1,470 GB/s (per-write cost), a 64 MiB one near it
JUDGED_BYTES = 64 << 20


def _rank_links(reports: list):
    for role, rank, _pi, _mode, _it, data in reports:
        for f in data.get("links") or []:
            yield role, rank, f if data.get("engine") is None else dict(f, engine=data["engine"])


def expected_gbps(reports: list) -> float | None:
    """The least a link of this group should give, by the ranks' connect-time findings (None: unknown)."""
    got = [f["expected_gbps"] for _, _, f in _rank_links(reports) if f.get("expected_gbps")]
    return min(got) if got else None


def links_of(reports) -> list[dict]:
    """Every rank's link findings, the same finding of several ranks once, naming them
    (``src1``, or ``s0.src1`` in a multi-engine group)."""
    by: dict = {}
    for _g, rep in reports:
        for role, rank, f in _rank_links(rep):
            key = (f["severity"], f["path"], f.get("cause"), f.get("fix"))
            entry = by.setdefault(key, {**{k: v for k, v in f.items() if k != "engine"}, "ranks": []})
            entry["ranks"].append(
                f"{role}{rank}" if f.get("engine") is None else f"{role[0]}{f['engine']}.{role}{rank}"
            )
    return list(by.values())


# -- the source host of a two-host run ---------------------------------------------------
def run_source_host(
    connect: tuple[str, int],
    on_event=None,
    connect_wait_s: float = 120.0,
    log_level: str = "WARNING",
    clock_sync: bool = False,
) -> dict:
    """Serve a ``--role dst`` run at ``connect``: start the source ranks it asks
    for, on this host; return the run's results when it ends. Retries a refused
    connection for ``connect_wait_s`` seconds (the dst side may start later)."""
    from kvstage.config import Settings

    deadline = time.monotonic() + connect_wait_s
    while True:  # the dst side may not be listening yet
        try:
            link = Link(connect, {"kind": "agent"}, token=Settings().auth_token, clock_sync=clock_sync)
            break
        except BenchError as e:
            if not isinstance(e.__cause__, ConnectionRefusedError) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    children = Children(connect, log_level, clock_sync, Settings().auth_token)
    try:
        while True:
            try:
                msg = link.recv(timeout=0.25)
            except TimeoutError:
                bad = children.failed()
                if bad:
                    link.send({"type": "error", "reason": f"{bad} on source host {link.local_host}"})
                    raise BenchError(bad) from None
                continue
            kind = msg["type"]
            if kind == "welcome-run":
                if on_event:
                    on_event("joined", msg)
            elif kind == "spawn" and "procs" in msg:  # a multi-engine group: (engine, rank) of each
                for engine, r in msg["procs"]:
                    children.start(int(msg["group"]), "src", [int(r)], int(engine))
            elif kind == "spawn":
                children.start(int(msg["group"]), "src", [int(r) for r in msg["ranks"]])
            elif kind == "reap":
                children.reap(int(msg["group"]))
            elif kind == "results":
                return msg["result"]
            else:
                raise BenchError(f"unexpected {kind!r} from the coordinator")
    finally:
        link.close()
        children.stop_all()
