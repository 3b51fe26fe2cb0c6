"""Reads against writes over one transport, in real separate processes: what a span of a READ costs,
and one process reading from (or written into by) several peers at once.

The hub (this process) plays the decode: it reads every peer's bytes, or receives every peer's
write. Each peer is its own process with its own endpoint, as a prefill rank is.

    python benchmarks/transport_reads.py --transport nixl spans
    python benchmarks/transport_reads.py --transport cma bulk --peers 1 --mib 256
    python benchmarks/transport_reads.py --transport ucx bulk --peers 4 --mib 64 --ops write

Only ``write``/``expect``/``poll``/``notifications`` are used for writes, so the write rows also
run against a tree from before reads existed. Prints one JSON object per row.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np


def _peer(name: str, conn, nbytes: int) -> None:
    """A source: registers ``nbytes`` of random bytes and does what the hub asks, progressing between asks."""
    import torch

    from kvstage.transports import make_transport
    from kvstage.transports.base import Region, Spans, WriteState

    tr = make_transport(name, "peer")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    region = tr.register(src)
    conn.send((tr.metadata(), region.to_wire()))
    hub = tr.connect(conn.recv())
    offers = []
    while True:
        if not conn.poll(0.0002):
            tr.notifications()
            for h in [h for h in offers if tr.poll(h) is WriteState.DONE]:
                offers.remove(h)
                tr.release(h)
            continue
        cmd, *args = conn.recv()
        if cmd == "write":
            ticket, remote, offset, n = args
            h = tr.write(hub, Spans.single(region, [0], [n]), Spans.single(Region.from_wire(remote), [offset], [n]),
                         b"written", ticket)
            while tr.poll(h) is not WriteState.DONE:
                pass
            tr.release(h)
        elif cmd == "offer":
            offsets, lengths = args
            ticket, h = tr.offer(hub, Spans.single(region, offsets, lengths))
            if h is not None:
                offers.append(h)
            conn.send(ticket)
        elif cmd == "bye":
            break
    tr.close()


class Hub:
    def __init__(self, name: str, peers: int, peer_bytes: int, hub_bytes: int):
        import torch

        from kvstage.transports import make_transport
        from kvstage.transports.base import Region

        ctx = mp.get_context("spawn")
        self.tr = make_transport(name, "hub")
        self.dst = torch.zeros(hub_bytes, dtype=torch.uint8)
        self.region = self.tr.register(self.dst)
        self.conns, self.procs, self.peers, self.remotes = [], [], [], []
        for _ in range(peers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_peer, args=(name, child, peer_bytes), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            md, region = conn.recv()
            self.peers.append(self.tr.connect(md))
            self.remotes.append(Region.from_wire(region))
            conn.send(self.tr.metadata())
        self.progress(0.5)  # every endpoint's first messages

    def progress(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tr.notifications()

    def ask(self, conn, *msg):
        conn.send(msg)
        while not conn.poll(0):
            self.tr.notifications()
        return conn.recv()

    def read(self, spans_of) -> float:
        """Seconds for one read from every peer at once, posted together; ``spans_of(i)`` gives peer
        ``i``'s (local offsets, remote offsets, lengths)."""
        from kvstage.transports.base import Spans, WriteState

        plans = [spans_of(i) for i in range(len(self.peers))]
        tickets = [self.ask(c, "offer", list(r), list(n)) for c, (_, r, n) in zip(self.conns, plans)]
        t0 = time.perf_counter()
        handles = [self.tr.read(p, Spans.single(self.region, lo, n), Spans.single(rem, ro, n), t)
                   for p, rem, (lo, ro, n), t in zip(self.peers, self.remotes, plans, tickets)]
        pending = list(handles)
        while pending:
            pending = [h for h in pending if self.tr.poll(h) is not WriteState.DONE]
        elapsed = time.perf_counter() - t0
        for h in handles:
            self.tr.release(h)
        return elapsed

    def write(self, nbytes: int) -> float:
        """Seconds from asking every peer to write ``nbytes`` into its own slot to the last notification."""
        from kvstage.transports.base import Spans

        slots = [Spans.single(self.region, [i * nbytes], [nbytes]) for i in range(len(self.peers))]
        tickets = [self.tr.expect(p, slot) for p, slot in zip(self.peers, slots)]
        t0 = time.perf_counter()
        for i, (conn, ticket) in enumerate(zip(self.conns, tickets)):
            conn.send(("write", ticket, self.region.to_wire(), i * nbytes, nbytes))
        notes = 0
        while notes < len(self.peers):
            notes += len(self.tr.notifications())
        return time.perf_counter() - t0

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("bye",))
        for proc in self.procs:
            proc.join(30)
        self.tr.close()


def spans_rows(name: str, sizes: list[int], total: int, repeat: int) -> list[dict]:
    """Per-span cost of a READ from one peer: ``total`` bytes in spans of each size, a gap after each
    (nothing merges), into local spans laid out the other way round."""
    hub = Hub(name, 1, 2 * total, 2 * total)
    rows = []
    try:
        for size in sizes:
            n = total // size
            remote = np.arange(n, dtype=np.int64) * 2 * size
            local = remote[::-1].copy()
            lengths = np.full(n, size, dtype=np.int64)
            best = min(hub.read(lambda i: (local, remote, lengths)) for _ in range(repeat))
            rows.append({"transport": name, "op": "read", "span_bytes": size, "spans": n, "s": round(best, 6),
                         "us_per_span": round(best / n * 1e6, 3), "GBps": round(n * size / best / 1e9, 3)})
    finally:
        hub.close()
    return rows


def bulk_rows(name: str, peers: int, nbytes: int, ops: list[str], repeat: int) -> list[dict]:
    """One span of ``nbytes`` per peer, every peer at once: the hub reads them, or they write into it."""
    hub = Hub(name, peers, nbytes, peers * nbytes)
    rows = []
    try:
        for op in ops:
            if op == "read":
                times = [hub.read(lambda i: ([i * nbytes], [0], [nbytes])) for _ in range(repeat)]
            else:
                times = [hub.write(nbytes) for _ in range(repeat)]
            best = min(times)
            rows.append({"transport": name, "op": op, "peers": peers, "bytes_each": nbytes, "s": round(best, 6),
                         "GBps": round(peers * nbytes / best / 1e9, 3), "median_s": round(float(np.median(times)), 6)})
    finally:
        hub.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="nixl", choices=["nixl", "ucx", "cma"])
    ap.add_argument("--repeat", type=int, default=5)
    sub = ap.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("spans", help="per-span cost of a READ")
    sp.add_argument("--sizes", default="512,4096,32768")
    sp.add_argument("--mib", type=int, default=16, help="bytes read per size")
    bp = sub.add_parser("bulk", help="one span per peer, every peer at once")
    bp.add_argument("--peers", type=int, default=1)
    bp.add_argument("--mib", type=int, default=256, help="bytes per peer")
    bp.add_argument("--ops", default="read,write")
    a = ap.parse_args()
    if a.what == "spans":
        rows = spans_rows(a.transport, [int(s) for s in a.sizes.split(",")], a.mib << 20, a.repeat)
    else:
        rows = bulk_rows(a.transport, a.peers, a.mib << 20, a.ops.split(","), a.repeat)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
