"""The link between two "hosts" cut mid-read: two network namespaces joined
by a veth pair (tests/support/netns.py), a destination rank in one, a source rank in
the other, and ``ip link set <veth> down`` while the destination reads.

The data path must really cross the veth for the cut to mean anything. On one
machine UCX reaches a peer in another network namespace through shared memory
(the namespaces share the kernel, /dev/shm and the PID space), so by default
the bytes would never touch the link. The ranks here run with ``UCX_TLS=tcp``
and the test checks the veth's byte counters: the request's bytes crossed the
link, and the cut stops both the control connection and the data path. Over
tcp a NIXL read completes only as the source's UCX answers, so the source's
loop drives its transport while the destination may read it.

Figures are printed with ``-s`` and recorded in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.netns import DST_IP, netns_pair  # noqa: F401  (netns_pair is a fixture)
from support.netns_ranks import PREFIX

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PORT = 7720
HEAVY = os.environ.get("KVSTAGE_FAULTS_HEAVY") == "1"


class Rank:
    """A rank process inside a namespace, driven through tests/support/netns_ranks.py."""

    def __init__(self, pair, ns: str, role: str, pages: int, env: dict):
        self.role = role
        self.events: queue.Queue = queue.Queue()
        self.log: list[dict] = []
        cmd = [*pair.exec(ns), sys.executable, str(TESTS / "support" / "netns_ranks.py"), role, DST_IP, str(PORT), str(pages)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.p.stderr), daemon=True).start()
        ready = self.wait("ready", timeout=60)
        assert Path(ready["kvstage"]).resolve().is_relative_to(ROOT), f"{role} imported {ready['kvstage']}, not this tree's"

    def _read(self):
        for line in self.p.stdout:
            if line.startswith(PREFIX):
                self.events.put(json.loads(line[len(PREFIX):]))
            else:
                self.stderr.append(line)

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def wait(self, ev: str | tuple, timeout: float, req: str | None = None) -> dict:
        """The next event ``ev`` (one of them, given a tuple) for ``req``; other events are kept in ``log``."""
        evs = ev if isinstance(ev, tuple) else (ev,)
        for e in self.log:
            if e["ev"] in evs and (req is None or e.get("req") == req):
                self.log.remove(e)
                return e
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.p.poll() is not None and self.events.empty():
                raise AssertionError(f"{self.role}: no {ev} event for {req} within {timeout} s; "
                                     f"exit {self.p.poll()}; stderr:\n{''.join(self.stderr)[-3000:]}")
            try:
                e = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if e["ev"] in evs and (req is None or e.get("req") == req):
                return e
            self.log.append(e)

    def slots(self) -> tuple[int, int]:
        self.send(cmd="slots")
        e = self.wait("slots", 10)
        return e["free"], e["total"]

    def close(self):
        if self.p.poll() is None:
            try:
                self.send(cmd="quit")
                self.p.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def _env(tls: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
    return env


TOKEN_BYTES = 512  # destination bytes per token: 2 layers x 4 heads x 16 x bf16 x (K, V)
BIG = 20_000  # tokens, ~10 MB in 16 KiB chunks: seconds over the veth, so the cut lands mid-read
DETECT_LIMIT = 4.0 + 3.0  # TCP keepalive / TCP_USER_TIMEOUT (~4 s) plus slack for a loaded machine
SETTLE_S = 30.0  # after the link is back: reads of the failed requests that could not be cancelled end


def _final(rank: Rank, req: str, timeout: float) -> dict:
    e = rank.wait("final", timeout, req)
    print(f"  {rank.role} {req}: {e['state']}" + (f": {e['error']['text']}" if e["error"] else ""))
    return e


def _slots(rank: Rank, within: float, settled) -> dict:
    """The rank's ``slots`` event once ``settled(event)`` holds, or the last one after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        rank.send(cmd="slots")
        e = rank.wait("slots", 10)
        if settled(e) or time.monotonic() > deadline:
            return e
        time.sleep(0.1)


def _all_free(rank: Rank, within: float) -> tuple[int, int, int, int]:
    e = _slots(rank, within, lambda e: e["free"] == e["total"] and e["requests"] == 0 and e["held"] == 0)
    return e["free"], e["total"], e["requests"], e["held"]


def _transfer(dst: Rank, src: Rank, req: str, tokens: int, seed: int, path: str) -> None:
    dst.send(cmd="expect", req=req, tokens=tokens, seed=seed)
    src.send(cmd="send", req=req, tokens=tokens, seed=seed)
    fd, fs = _final(dst, req, 60), _final(src, req, 60)
    assert (fd["state"], fs["state"]) == ("done", "done"), (fd, fs)
    assert fd["corrupt"] == [], fd["corrupt"]
    assert fd["path"] == fs["path"] == path, (fd["path"], fs["path"])


SIDES = ["src", "dst"] if HEAVY else ["src"]
ROUNDS = 3 if HEAVY else 1
INFLIGHT = 4 if HEAVY else 2


@pytest.mark.parametrize("path", ["read", "pages"])
@pytest.mark.parametrize("side", SIDES)
def test_link_cut_mid_read_fails_both_sides_then_recovers(netns_pair, side, path):
    """Cut the veth (``ip link set <end> down``) while the destination reads; both sides fail
    every request in flight within TCP's ~4 s, naming peer, stage and cause; the source's
    slots all come back at once, the destination's once no read of a failed request can still
    land; with the link up again, a new connection transfers byte-exact and nothing is held."""
    env = _env("tcp") | {"KVSTAGE_PATH": path}  # see the module docstring: without tcp the bytes would not cross the veth
    dst = Rank(netns_pair, netns_pair.dst, "dst", INFLIGHT * 5000 + 1500, env)
    src = Rank(netns_pair, netns_pair.src, "src", INFLIGHT * 1250 + 400, env)
    try:
        src.send(cmd="connect", ip=DST_IP, port=PORT)
        assert src.wait("connected", 30)["ranks"] == [0]

        # the data path is the veth: a request's bytes show in its counters
        rx0 = netns_pair.rx_bytes("dst")
        _transfer(dst, src, "warm", 2000, 1, path)
        crossed = netns_pair.rx_bytes("dst") - rx0
        print(f"\nveth carried {crossed} B for a request of {2000 * TOKEN_BYTES} B ({path} path)")
        assert crossed >= 2000 * TOKEN_BYTES

        for n in range(ROUNDS):
            reqs = [f"cut{n}.{i}" for i in range(INFLIGHT)]
            for i, req in enumerate(reqs):
                dst.send(cmd="expect", req=req, tokens=BIG, seed=10 + i)
                src.send(cmd="send", req=req, tokens=BIG, seed=10 + i)
            for req in reqs:  # the destination reads them: every writer ready, chunks holding its slots
                dst.wait("progress", 60, req)
            t_cut = time.monotonic()
            netns_pair.link(up=False, side=side)
            for req in reqs:
                fd, fs = _final(dst, req, 30), _final(src, req, 30)  # no hang: both final well within 30 s
                assert (fd["state"], fs["state"]) == ("failed", "failed"), "nothing partial is reported done"
                ed, es = fd["error"], fs["error"]
                assert ed["peer"] == "source rank 0" and ed["stage"] in ("read", "scatter"), ed
                assert es["peer"] == "destination rank 0" and es["stage"] in ("read", "abort"), es
                for e in (ed, es):
                    assert any(c in e["cause"] for c in ("connection lost", "no control message", "no progress")), e
                if req == reqs[0]:
                    print(f"link cut ({side} end, {path} path) round {n}: destination failed after "
                          f"{(fd['t'] - t_cut) * 1e3:.0f} ms, source after {(fs['t'] - t_cut) * 1e3:.0f} ms")
                    assert fd["t"] - t_cut < DETECT_LIMIT and fs["t"] - t_cut < DETECT_LIMIT
            # while the link is down: the source holds nothing; the destination's slots are free or held by a
            # read of a failed request that could not be cancelled (its bytes may still land)
            e = _slots(dst, 5, lambda e: e["free"] + e["held"] >= e["total"] and e["requests"] <= INFLIGHT)
            print(f"  while down: destination {e['free']} of {e['total']} slots free, {e['held']} reads held, "
                  f"{e['requests']} failed requests held")
            assert e["free"] + e["held"] >= e["total"] == 4 and e["requests"] <= INFLIGHT, e
            assert _all_free(src, 5) == (4, 4, 0, 0)

            netns_pair.link(up=True, side=side)
            t_up = time.monotonic()
            while True:  # the device is up at once; the neighbour entry marked failed during the cut can
                src.send(cmd="connect", ip=DST_IP, port=PORT)  # answer "no route" for a few seconds more
                e = src.wait(("connected", "connect_failed"), 30)
                unreachable = "No route to host" in e.get("error", "") or "Network is unreachable" in e.get("error", "")
                if not unreachable or time.monotonic() - t_up > 15:
                    break
                time.sleep(0.5)
            assert e.get("ranks") == [0], e
            print(f"  connected again {time.monotonic() - t_up:.1f} s after the link came up")
            _transfer(dst, src, f"after{n}", 3000, 99 + n, path)  # byte-exact
            t_settle = time.monotonic()
            assert _all_free(dst, SETTLE_S) == (4, 4, 0, 0) and _all_free(src, 5) == (4, 4, 0, 0)
            print(f"  nothing held {time.monotonic() - t_settle:.1f} s after the next request")
    finally:
        src.close()
        dst.close()
