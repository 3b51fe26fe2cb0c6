"""Where a NIXL write's host time goes, per call: descriptors, initialize_xfer,
transfer (post), completion; against make_prepped_xfer on prepared lists and
re-posting one finished handle. Two processes, one GPU (cuda_ipc) or two.

    python benchmarks/nixl_post.py [--device cuda|cpu] [--sizes 4194304,67108864] [--n 200]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np


def _target(conn, device: str, nbytes: int) -> None:
    import torch

    from kvstage.transports.nixl import NixlTransport

    t = NixlTransport("post-dst")
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    region = t.register(buf)
    conn.send((t.metadata(), region.to_wire()))
    peer_md = conn.recv()
    t.connect(peer_md)
    while not conn.poll(0):
        t.notifications()  # the peer's writes complete only while this side progresses
    t.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="4194304,67108864")
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    import torch

    from kvstage.transports.base import Region, Spans, WriteState
    from kvstage.transports.nixl import NixlTransport, _descs, _mem_type

    sizes = [int(x) for x in a.sizes.split(",")]
    top = max(sizes)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_target, args=(there, a.device, top))
    p.start()
    md, rw = here.recv()
    me = NixlTransport("post-src")
    buf = torch.ones(top, dtype=torch.uint8, device=a.device)
    local = me.register(buf)
    here.send(me.metadata())
    peer = me.connect(md)
    remote = Region.from_wire(rw)
    ag = me._agent
    out = {}

    def wait(h):
        while me.poll(h) is WriteState.PENDING:
            pass

    for n in sizes:
        ls, rs = Spans.single(local, [0], [n]), Spans.single(remote, [0], [n])
        for _ in range(20):  # warm: connection, IPC handles
            h = me.write(peer, ls, rs, b"w")
            wait(h)
            me.release(h)
        t = {k: [] for k in ("descs", "initialize_xfer", "transfer", "complete", "prepped_make", "prepped_transfer",
                             "repost_transfer")}
        for i in range(a.n):
            t0 = time.perf_counter()
            lds = ag.get_xfer_descs(_descs(ls), _mem_type(a.device))
            rds = ag.get_xfer_descs(_descs(rs), _mem_type(a.device))
            t1 = time.perf_counter()
            h = ag.initialize_xfer("WRITE", lds, rds, peer, b"x")
            t2 = time.perf_counter()
            ag.transfer(h)
            t3 = time.perf_counter()
            wait(h)
            t4 = time.perf_counter()
            me.release(h)
            for k, v in zip(("descs", "initialize_xfer", "transfer", "complete"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                t[k].append(v)
        lp = me.prepare(None, ls)
        rp = me.prepare(peer, rs)
        idx = np.zeros(1, dtype=np.int32)
        for i in range(a.n):
            t0 = time.perf_counter()
            h = ag.make_prepped_xfer("WRITE", lp, idx, rp, idx, b"p")
            t1 = time.perf_counter()
            ag.transfer(h)
            t2 = time.perf_counter()
            wait(h)
            me.release(h)
            t["prepped_make"].append(t1 - t0)
            t["prepped_transfer"].append(t2 - t1)
        h = ag.initialize_xfer("WRITE", ag.get_xfer_descs(_descs(ls), _mem_type(a.device)),
                               ag.get_xfer_descs(_descs(rs), _mem_type(a.device)), peer, b"r")
        for i in range(a.n):
            t0 = time.perf_counter()
            ag.transfer(h)
            t1 = time.perf_counter()
            wait(h)
            t["repost_transfer"].append(t1 - t0)
        me.release(h)
        out[n] = {k: round(float(np.median(v)) * 1e6, 1) for k, v in t.items()}
        print(f"{n:>11} B  " + "  ".join(f"{k} {v:.1f} us" for k, v in out[n].items()), flush=True)
    here.send("stop")
    p.join(10)
    me.close()
    print(json.dumps({"device": a.device, "median_us": out}))


if __name__ == "__main__":
    main()
