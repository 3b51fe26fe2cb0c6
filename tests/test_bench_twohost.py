"""Two-host ``kvstage bench`` (``--role dst --listen`` / ``--role src --connect``)
between two network namespaces joined by a veth pair, and the rendezvous itself.

The namespace test uses the ``netns_pair`` fixture of tests/support/netns.py (root and
``ip netns``; it skips and says why where either is missing).
"""

import json
import os
import subprocess
import sys
import threading

import pytest

from kvstage.bench.control import BenchError, Coordinator, Link
from support.netns import DST_IP, netns_pair  # noqa: F401  (netns_pair is a fixture)

TINY = ["--layers", "2", "--head-dim", "32", "--arena-mb", "4"]


def test_two_hosts_across_network_namespaces(netns_pair, tmp_path):
    dst_ns, src_ns = netns_pair.dst, netns_pair.src
    out_dst, out_src = tmp_path / "dst.json", tmp_path / "src.json"
    env = dict(os.environ, KVSTAGE_AUTH_TOKEN="netns-test")
    cmd = [sys.executable, "-m", "kvstage.cli", "bench"]
    dst = subprocess.Popen(["ip", "netns", "exec", dst_ns, *cmd, "--role", "dst", "--listen", f"{DST_IP}:7710",
                            *TINY, "--clock-sync", "--src-tp", "2", "--dst-tp", "1,2", "--tokens", "64", "--concurrency", "2",
                            "--iters", "1", "--warmup", "0", "--json", str(out_dst)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        src = subprocess.run(["ip", "netns", "exec", src_ns, *cmd, "--role", "src", "--connect", f"{DST_IP}:7710", "--clock-sync",
                              "--json", str(out_src)], capture_output=True, text=True, timeout=180, env=env)
        d_out, d_err = dst.communicate(timeout=60)
    finally:
        if dst.poll() is None:
            dst.kill()
            dst.wait()
    assert (dst.returncode, src.returncode) == (0, 0), f"dst side:\n{d_err}\nsrc side:\n{src.stderr}"
    data = json.loads(out_dst.read_text())
    assert json.loads(out_src.read_text()) == data  # the source side gets the same results
    rows = data["results"]
    assert {(r["src_tp"], r["dst_tp"]) for r in rows} == {(2, 1), (2, 2)}
    for r in rows:
        assert r["verified"] is (None if r["mode"] == "bulk" else True), r.get("errors")
        assert r["concurrency"] == 2 and r["latency_samples"] == 2
        if r["mode"] == "staged":  # the destination read it, by the route's path (host memory: no ipc)
            assert r["path"] and set(r["path"]) <= {"read", "pages", "direct"}, r["path"]
            assert r["writes"] >= 1
    assert data["clock"]["synced_ranks"] > 0  # offsets were measured (forced: one kernel, one clock)
    assert data["clock"]["max_offset_error_s"] < 0.05
    assert "clocks:" in d_out


def test_two_hosts_with_several_engines_split_over_two_source_hosts(netns_pair, tmp_path):
    """Source engines s0 (TP 2) and s1 (TP 1) on the other host, their three rank processes split over
    two source hosts; each host starts the (engine, rank) it is told to."""
    out = tmp_path / "dst.json"
    env = dict(os.environ, KVSTAGE_AUTH_TOKEN="netns-test")
    cmd = [sys.executable, "-m", "kvstage.cli", "bench"]
    dst = subprocess.Popen(["ip", "netns", "exec", netns_pair.dst, *cmd, "--role", "dst", "--listen", f"{DST_IP}:7711",
                            *TINY, "--src-engines", "2,1", "--dst-tp", "2", "--tokens", "64", "--src-hosts", "2",
                            "--iters", "1", "--warmup", "0", "--json", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    srcs = [subprocess.Popen(["ip", "netns", "exec", netns_pair.src, *cmd, "--role", "src", "--connect", f"{DST_IP}:7711"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        errs = [p.communicate(timeout=240)[1] for p in srcs]
        _, d_err = dst.communicate(timeout=60)
    finally:
        for p in (dst, *srcs):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in (dst, *srcs)] == [0, 0, 0], f"dst side:\n{d_err}\nsrc sides:\n" + "\n".join(errs)
    rows = json.loads(out.read_text())["results"]
    assert [(r["src_engine"], r["dst_engine"], r["src_tp"], r["dst_tp"]) for r in rows] == [("s0", "d0", 2, 2),
                                                                                             ("s1", "d0", 1, 2)]
    assert all(r["verified"] is True for r in rows), rows
    assert all(r["path"] and set(r["path"]) <= {"read", "pages", "direct"} for r in rows), rows
    assert "destination rank 1 of engine d0 at" in d_err  # where the destination ranks are, by engine


def test_rendezvous_refuses_a_wrong_token():
    coord = Coordinator(("127.0.0.1", 0), token="right")
    try:
        with pytest.raises(BenchError, match="auth token"):
            Link(coord.address, {"kind": "agent"}, token="wrong")
        link = Link(coord.address, {"kind": "agent"}, token="right")
        ev = coord.get(5)
        assert ev[0] == "joined" and ev[1].kind == "agent"
        link.close()
    finally:
        coord.close()


def test_clock_offset_measurement():
    coord = Coordinator(("127.0.0.1", 0))
    try:
        link = Link(coord.address, {"kind": "agent"}, clock_sync=True)
        # one clock here: the measured offset is within the error bound it reports (plus scheduling slack)
        assert abs(link.offset) <= link.sync_error + 1e-3
        assert 0 < link.sync_error < 0.05
        lost = threading.Event()
        link._on_lost = lost.set
        coord.close()
        assert lost.wait(5)  # a rank notices the coordinator going away
    finally:
        coord.close()
