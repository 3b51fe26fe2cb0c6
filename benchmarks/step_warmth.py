"""How long a destination's per-chunk host steps take on a thread that ran them
back to back, slept, polled its sockets every 20 µs, spun on them (select with
no timeout), or polled and touched the CUDA driver just before: is ``poll_us``'s
polling enough to keep a loop warm?

    python3 benchmarks/step_warmth.py [--json PATH]

Steps, each timed alone (medians in µs): a ``CopyFence`` made and closed (two CUDA
event records), one record of an event made without timing (torch, and the driver's
``cuEventRecord`` through ctypes), a one-element CUDA add (a launch), a control
message read and decoded (``Connection.feed``). Before each sample the thread
runs the same step ("hot") or waits 30 ms in one of five ways: asleep, polling its
socket every 20 µs, spinning on it, or polling with one cheap driver call after each poll (``cuStreamQuery`` of
the default stream, or ``cuCtxGetCurrent``): does touching the driver keep its
first call after the wait warm? Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import select
import socket
import statistics
import time

import torch

from kvstage.cudart import driver
from kvstage.protocol.wire import Connection
from kvstage.staging.fence import CopyFence

SAMPLES = 60
PAUSE_S = 0.03


def _pair() -> tuple[Connection, Connection]:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    return Connection(a, "a"), Connection(b, "b")


def _touches() -> dict:
    drv = driver()
    ctx = ctypes.c_void_p()
    return {"poll": None, "spin": None,
            "query": lambda: drv.cuStreamQuery(None),
            "ctx": lambda: drv.cuCtxGetCurrent(ctypes.byref(ctx))}


def _pause(how: str, sock, touches: dict) -> None:
    end = time.perf_counter() + PAUSE_S
    if how == "sleep":
        time.sleep(PAUSE_S)
        return
    timeout = 0 if how == "spin" else 20e-6
    touch = touches[how]
    while time.perf_counter() < end:
        select.select([sock], [], [], timeout)
        if touch is not None:
            touch()


def measure() -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(1, device=dev)
    tx, rx = _pair()
    msg = {"type": "landed", "req": "staged-p0-i50-r0", "chunk": 0, "writer": 0, "offset": 0, "bytes": 16777216}

    def fence():
        CopyFence(dev).close().release()

    plain = torch.cuda.Event(enable_timing=False)
    stream = torch.cuda.current_stream(dev)

    def record():
        plain.record(stream)

    drv = driver()
    raw = ctypes.c_void_p()
    assert drv.cuEventCreate(ctypes.byref(raw), 0x2) == 0  # CU_EVENT_DISABLE_TIMING

    def record_raw():
        drv.cuEventRecord(raw, None)

    def launch():
        x.add_(1)

    def feed():
        for _ in rx.feed():
            pass

    def send():  # before the pause: over loopback the bytes are queued by the time send returns
        tx.send(msg)

    touches = _touches()
    out = {}
    for how in ("hot", "sleep", "poll", "spin", "query", "ctx"):
        for name, step, before in (("fence", fence, None), ("record", record, None), ("record_raw", record_raw, None),
                                   ("launch", launch, None), ("feed", feed, send)):
            xs = []
            for _ in range(SAMPLES):
                if before is not None:
                    before()
                if how == "hot":
                    step()  # the same step just before: as warm as it gets
                    if before is not None:
                        before()
                else:
                    _pause(how, rx.sock if before is None else tx.sock, touches)
                t = time.perf_counter()
                step()
                xs.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            out[f"{name}_{how}_us"] = statistics.median(xs[5:]) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    text = json.dumps(measure(), indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
