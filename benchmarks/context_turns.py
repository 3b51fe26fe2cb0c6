"""How long a small copy takes when several processes share one GPU, and
whether it matters that the copy runs on the SMs (a kernel) or on a copy
engine (a device-to-device memcpy).

The 1->4 128-token staged request ends with four decode processes each
running one ~5 us scatter kernel; in the bench each takes ~0.4 ms from launch
to done (docs/benchmarks.md, sessions 10-11). This times that step alone: N
worker processes wait on a pipe; the parent writes a byte to every pipe at
once; each worker then runs its copy and synchronizes. Reported: the median
over rounds of (last worker done - signal), for N = 1 and N = 4, with the copy
as a kernel (``torch.add(src, 0, out=dst)``), as a memcpy (``dst.copy_(src)``)
or absent (the wake-up and reply alone), and with the workers asleep in their
read or spinning on the pipe. One process doing all N copies in turn is the
reference with no context switch. Run on the GPU machine: ``python3 benchmarks/context_turns.py``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

MB = 4  # a 1->4 128-token decode rank's piece: 4.2 MB


def _worker(conn, how: str, spin: bool) -> None:
    import torch

    src = torch.ones(MB << 18, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):  # load the kernel, warm the copy path
        _copy(how, src, dst)
    torch.cuda.synchronize()
    conn.send("ready")
    while True:
        while spin and not conn.poll(0):
            pass
        msg = conn.recv_bytes()
        if msg == b"stop":
            return
        _copy(how, src, dst)
        torch.cuda.synchronize()
        conn.send(time.perf_counter())


def _copy(how: str, src, dst) -> None:
    import torch

    if how == "kernel":
        torch.add(src, 0, out=dst)
    elif how == "memcpy":
        dst.copy_(src)


def _spread(n: int, how: str, rounds: int, spin: bool = False) -> float:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(n):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(b, how, spin), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    for a in pipes:
        assert a.recv() == "ready"
    spans = []
    for _ in range(rounds):
        time.sleep(0.002)  # every worker asleep in its read, as a decode loop waits in select
        t0 = time.perf_counter()
        for a in pipes:
            a.send_bytes(b"go")
        spans.append(max(a.recv() for a in pipes) - t0)
    for a in pipes:
        a.send_bytes(b"stop")
    for p in procs:
        p.join(10)
    return statistics.median(spans) * 1e3


def _alone(n: int, how: str, rounds: int) -> float:
    import torch

    bufs = [(torch.ones(MB << 18, device="cuda"), torch.empty(MB << 18, device="cuda")) for _ in range(n)]
    for _ in range(20):
        for s, d in bufs:
            _copy(how, s, d)
    torch.cuda.synchronize()
    spans = []
    for _ in range(rounds):
        time.sleep(0.002)
        t0 = time.perf_counter()
        for s, d in bufs:
            _copy(how, s, d)
        torch.cuda.synchronize()
        spans.append(time.perf_counter() - t0)
    return statistics.median(spans) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for how in ("kernel", "memcpy", "none"):
        if how != "none":
            rows.append({"copy": how, "processes": 1, "copies": 4, "wait": "-", "ms": _alone(4, how, args.rounds)})
        for n in (1, 4):
            for spin in (False, True):
                rows.append({"copy": how, "processes": n, "copies": n, "wait": "spin" if spin else "sleep",
                             "ms": _spread(n, how, args.rounds, spin)})
    for r in rows:
        print(f"{r['copy']:6s} {r['copies']} copies of {MB} MB in {r['processes']} process(es), waiting {r['wait']:5s}: "
              f"signal -> last done, median {r['ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
