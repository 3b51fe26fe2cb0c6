"""What waking up costs on this host: the numbers behind docs/benchmarks.md
"Session 10" (a rank's host steps run 10-20x slower in place than alone).

    python3 benchmarks/host_wakeup.py [--json PATH]

- pipe ping-pong between two processes, one way: the reader blocked in read(2)
  (its thread sleeps) against the reader spinning on a non-blocking read;
- a hand-off between two threads through ``queue.Queue`` (one way);
- a tiny numpy step (store 8 ids, sum 64) right after a sleep of 0, 0.1, 1 and
  10 ms, alone and in 4 and 8 processes at once.

Medians in microseconds. No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time

import numpy as np

N = 2000


def _us(xs) -> float:
    return statistics.median(xs) * 1e6


def _echo(r: int, w: int, spin: bool) -> None:
    if spin:
        os.set_blocking(r, False)
    while True:
        while True:
            try:
                b = os.read(r, 1)
                break
            except BlockingIOError:
                pass
        if b == b"q":
            return
        os.write(w, b)


def pipe_one_way(spin: bool) -> float:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    p = mp.Process(target=_echo, args=(r1, w2, spin))
    p.start()
    os.set_blocking(r2, not spin)
    xs = []
    for _ in range(N):
        t = time.perf_counter()
        os.write(w1, b"x")
        while True:
            try:
                os.read(r2, 1)
                break
            except BlockingIOError:
                pass
        xs.append(time.perf_counter() - t)
        if not spin:
            time.sleep(0.0005)  # the next message comes later, as a request does
    os.write(w1, b"q")
    p.join()
    return _us(xs[100:]) / 2


def thread_one_way() -> float:
    there, back = queue.Queue(), queue.Queue()

    def run():
        while (x := there.get()) is not None:
            back.put(x)

    t = threading.Thread(target=run)
    t.start()
    xs = []
    for _ in range(N):
        s = time.perf_counter()
        there.put(1)
        back.get()
        xs.append(time.perf_counter() - s)
        time.sleep(0.0005)
    there.put(None)
    t.join()
    return _us(xs[100:]) / 2


def step_after_sleep(sleep_s: float) -> float:
    a, ids = np.zeros(64, dtype=np.int64), np.arange(8)
    xs = []
    for _ in range(400):
        if sleep_s:
            time.sleep(sleep_s)
        t = time.perf_counter()
        a[:8] = ids
        a.sum()
        xs.append(time.perf_counter() - t)
    return _us(xs[20:])


def _step_into(q, sleep_s: float) -> None:
    q.put(step_after_sleep(sleep_s))


def steps_in_processes(k: int, sleep_s: float) -> list[float]:
    q = mp.Queue()
    ps = [mp.Process(target=_step_into, args=(q, sleep_s)) for _ in range(k)]
    for p in ps:
        p.start()
    got = sorted(q.get() for _ in ps)
    for p in ps:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    out = {
        "pipe_one_way_blocking_us": pipe_one_way(False),
        "pipe_one_way_spinning_us": pipe_one_way(True),
        "thread_hand_off_us": thread_one_way(),
        **{f"step_after_{s * 1e3:g}_ms_sleep_us": step_after_sleep(s) for s in (0, 0.0001, 0.001, 0.01)},
        **{f"step_after_1_ms_sleep_{k}_processes_us": steps_in_processes(k, 0.001) for k in (4, 8)},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
