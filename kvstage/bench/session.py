"""The coordinator's side of one group: start its ranks, walk its steps in lockstep.

Apart from ``runner`` (which sets a run up and ends it) because this is the protocol
every rank process follows (``control`` messages), step by step.
"""

from __future__ import annotations

import sys
import time

from kvstage.bench.children import Children
from kvstage.bench.control import BenchError, Coordinator, Peer, rank_name, wildcard
from kvstage.bench.scenario import Group, engine_id

#: how long the coordinator waits for the next event of a group's ranks
WAIT_S = 600.0
JOIN_S = 120.0  # a started rank process must connect within this


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
                raise BenchError(f"{peer.name} disconnected ({ev[2]}) while waiting for {what}{self._exit_of_ranks()}")
            if kind == "msg" and ev[2]["type"] == "bye":
                peer.said_bye = True
            if kind == "msg" and ev[2]["type"] == "error":
                raise BenchError(f"{peer.name} failed:\n{ev[2].get('trace') or ev[2].get('reason')}")
            return ev

    def _exit_of_ranks(self, wait_s: float = 2.0) -> str:
        """A rank that crashed closes its connection before its launcher reports its exit: wait for that."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            bad = self.children.failed()
            if bad:
                return f"; {bad}"
            time.sleep(0.05)
        return ""

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
