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

Here a run is set up and ended; ``session`` drives one group's ranks step by step,
``children`` starts and ends their processes, ``summary`` turns their reports into rows.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

from kvstage.bench.children import Children
from kvstage.bench.control import BenchError, Coordinator, Link, Peer, wildcard
from kvstage.bench.scenario import Group, Scenario, Sweep
from kvstage.bench.session import WAIT_S, Session
from kvstage.bench.summary import links_of, summarize

__all__ = ["BenchError", "run", "run_sweep", "run_source_host", "summarize"]


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
