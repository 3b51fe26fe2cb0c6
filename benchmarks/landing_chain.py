"""The hop from a 1->4 source's gather to its four destinations' scatters, on one GPU
shared by five processes: as kvstage takes it today, and through a word in shared
host memory that the source's stream sets after its gather.

The 1->4 128-token staged request spends ~1.2 ms of host steps between the caller's
``send`` and the destinations' scatter launches (docs/benchmarks.md, session 13's
trace). Part of that is a chain after the gather ends on the GPU: the source's loop
sees its fence, sends one ``landed`` message per destination, and each destination
wakes, reads it and launches its scatter. This times that chain alone, with no
kvstage code: the parent is the source, four worker processes are the destinations.
Each round the parent launches a 16 MB copy (the gather of four 4 MB pieces) and then

- ``message``: waits for it (an event), writes one byte to each worker's pipe; each
  worker, blocked in its read (``asleep``) or spinning on the pipe (``spinning``),
  then runs its 4 MB copy (the scatter) and synchronizes;
- ``word``: queues ``cuStreamWriteValue32`` of the round's number to a word in shared
  host memory (registered and mapped for the GPU) behind the copy and returns; each
  worker spins on the word, then runs its copy and synchronizes.

Reported: the median over rounds of (last worker done - the parent's launch), in ms,
and the same for one worker (no other context waiting for the GPU).
Run on the GPU machine: ``python3 benchmarks/landing_chain.py`` (part ``chain`` of gpu_run.sh).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory

MB = 4  # a 1->4 128-token decode rank's piece: 4.2 MB
_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_STOP = 0xFFFFFFFF  # the word's value that ends a worker


def _worker(conn, mode: str, shm_name: str) -> None:
    import numpy as np
    import torch

    shm = shared_memory.SharedMemory(name=shm_name)
    word = np.frombuffer(shm.buf, dtype=np.uint32, count=1)
    src = torch.ones(MB << 18, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):  # load the kernel, warm the copy path
        torch.add(src, 0, out=dst)
    torch.cuda.synchronize()
    conn.send("ready")
    rnd = 0
    while True:
        rnd += 1
        if mode == "word":
            while (w := int(word[0])) != rnd and w != _STOP:
                pass
            stop = w == _STOP
        else:
            while mode == "spinning" and not conn.poll(0):
                pass
            stop = conn.recv_bytes() == b"stop"
        if stop:
            del word
            shm.close()
            return
        torch.add(src, 0, out=dst)
        torch.cuda.synchronize()
        conn.send(time.perf_counter())


def _mapped_word(host: int, size: int) -> int:
    """The device address of the shared page at ``host`` (registered and mapped here)."""
    from kvstage.cudart import runtime

    rt = runtime()
    rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    rt.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    err = rt.cudaHostRegister(ctypes.c_void_p(host), size, _REGISTER_PORTABLE_MAPPED)
    if err:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {err}")
    dev = ctypes.c_void_p()
    err = rt.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(host), 0)
    if err:
        raise RuntimeError(f"cudaHostGetDevicePointer failed with CUDA error {err}")
    return dev.value


def _chain(n: int, mode: str, rounds: int) -> float:
    import torch

    from kvstage.cudart import driver, driver_error

    torch.zeros(1, device="cuda")  # the primary context, current on this thread, before any ctypes call
    shm = shared_memory.SharedMemory(create=True, size=4096)
    shm.buf[:4] = b"\0\0\0\0"
    page = ctypes.c_char.from_buffer(shm.buf)  # dropped before the close: it pins the buffer
    host = ctypes.addressof(page)
    dev_word = _mapped_word(host, shm.size) if mode == "word" else None
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(n):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(b, mode, shm.name), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    for a in pipes:
        assert a.recv() == "ready"
    src = torch.ones(MB * n << 18, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    done_ev = torch.cuda.Event()
    stream = torch.cuda.current_stream().cuda_stream
    spans = []
    for r in range(1, rounds + 1):
        time.sleep(0.002)  # workers that read their pipe fall asleep again
        t0 = time.perf_counter()
        torch.add(src, 0, out=dst)  # the gather
        if mode == "word":
            err = driver().kvstage_cuStreamWriteValue32(stream, dev_word, r, 0)
            if err:
                raise RuntimeError(f"cuStreamWriteValue32 failed: {driver_error(err)}")
        else:
            done_ev.record()
            done_ev.synchronize()
            for a in pipes:
                a.send_bytes(b"x")
        ends = [a.recv() for a in pipes]
        spans.append(max(ends) - t0)
    if mode == "word":
        shm.buf[:4] = _STOP.to_bytes(4, "little")
    else:
        for a in pipes:
            a.send_bytes(b"stop")
    for p in procs:
        p.join(10)
    if mode == "word":
        from kvstage.cudart import runtime

        runtime().cudaHostUnregister(ctypes.c_void_p(host))
    del page
    shm.close()
    shm.unlink()
    return statistics.median(spans[5:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    rows = {}
    for n in (1, 4):
        for mode in ("asleep", "spinning", "word"):
            rows[f"{mode}-{n}"] = _chain(n, mode, a.rounds)
            print(f"{n} worker(s), {mode:8s}: {rows[f'{mode}-{n}']:.3f} ms from the gather's launch to the last scatter done")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
