"""A source rank's process for the two-process read tests, run as a script, and
``SourcePeer``, which drives one from a test.

It allocates a source rank's cache the way engines do (torch's caching allocator, one big
tensor per plane viewed per layer, the first view past a small offset), holds its shard of
the reference cache at the tokens the test names and shares the buffers with
``share_buffers``; the test's process is the destination that opens and reads them. One
JSON object per line each way on stdin and stdout:

- ``{"cmd": "allocate", "case": name, "rank": r, "pages": n, "ids": [...], "shift": s, "seed": k,
  "tokens": t, "device": "cuda:0", "filled": true}`` -> ``{"desc": ...}`` or ``{"refused": reason}``
  (``filled`` false: the pages hold ``SOURCE_FILL`` only, for ``write_after``);
- ``{"cmd": "event"}`` -> ``{"handle": base64}``: this process's ``ReadyEvent`` on the cache's device;
- ``{"cmd": "write_after", "flag": desc, "seed": k, "tokens": t, "ids": [...], "shift": s}`` ->
  ``{"recorded": true}``: on a stream of its own it queues a kernel that waits until the
  4-byte ``flag`` (the test's memory, shared with ``share_buffers``) is not zero, then the
  writes of its shard of the request, then a record of the ready event, and answers at once,
  its writes still queued;
- ``{"cmd": "quit"}`` -> ``{"quit": true}``, once its queued work has ended.

Each process holds one source rank at a time (a new ``allocate`` replaces it): real source
ranks are processes of their own, and a process opens each of a peer's allocations once.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder, when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvstage.staging.shared_buffers import NotShareable, ReadyEvent, open_buffers, share_buffers  # noqa: E402
from support.ipc_reads import SourceRequest, case_plan, fill_shifted, source_cache  # noqa: E402

#: the test's wait on the flag, in the GPU's own clock (%globaltimer): a failed test's flag never set
#: ends the wait, so no kernel holds the GPU past it
SPIN_LIMIT_NS = 30 * 10**9
_SPIN = r"""
extern "C" __global__ void kvstage_test_wait_flag(const unsigned long long flag, const long long limit_ns)
{
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (atomicAdd((int*)flag, 0) == 0 && t - t0 < limit_ns);
}
"""


class SourcePeer:
    """A source process (this file as a script), driven one JSON line at a time."""

    def __init__(self, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})

    def send(self, **msg) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def answer(self, cmd: str, timeout: float = 120.0) -> dict:
        """The answer to the last ``cmd`` sent (lines that are not JSON skipped)."""
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            assert ready, f"the source process did not answer {cmd} in {timeout} s"
            line = self.proc.stdout.readline()
            assert line, f"the source process exited ({self.proc.poll()}) on {cmd}"
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, timeout: float = 120.0, **msg) -> dict:
        self.send(**msg)
        return self.answer(msg["cmd"], timeout)

    def send_allocate(self, case: str, rank: int, req: SourceRequest, seed: int, tokens: int, device: str,
                      filled: bool = True) -> None:
        """Ask for source rank ``rank``'s cache holding ``req`` (its answer: ``answer("allocate")``)."""
        self.send(cmd="allocate", case=case, rank=rank, pages=req.pages, ids=req.ids.tolist(), shift=req.shift,
                  seed=seed, tokens=tokens, device=device, filled=filled)

    def allocate(self, case: str, rank: int, req: SourceRequest, seed: int, tokens: int, device: str,
                 filled: bool = True) -> dict:
        self.send_allocate(case, rank, req, seed, tokens, device, filled)
        return self.answer("allocate")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(cmd="quit", timeout=60)
            except (AssertionError, BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _request(msg: dict) -> SourceRequest:
    return SourceRequest(msg["pages"], np.asarray(msg["ids"], dtype=np.int64), msg["shift"])


class _Source:
    """This process's state: the source rank it holds, its ready event, the test's flag mapped here."""

    def __init__(self):
        self.cache = None
        self.ready = None
        self.held: list = []  # what queued work still reads: kept until the next command that replaces it

    def release(self) -> None:
        """Once the queued work has ended, drop what it read (the flag's mapping closed)."""
        if self.cache is not None:
            torch.cuda.synchronize(self.cache.device)
        held, self.held = self.held, []
        for h in held:
            if hasattr(h, "close"):
                h.close()

    def allocate(self, msg: dict) -> dict:
        self.release()
        self.cache = None
        p = case_plan(msg["case"])
        self.cache = source_cache(p, msg["rank"], _request(msg), msg["seed"], msg["tokens"], msg["device"],
                                  msg.get("filled", True))
        torch.cuda.synchronize(self.cache.device)
        try:
            return {"desc": share_buffers(self.cache.buffers)}
        except NotShareable as e:
            return {"refused": str(e)}

    def event(self, msg: dict) -> dict:
        if self.ready is None:
            self.ready = ReadyEvent(self.cache.device)
        return {"handle": base64.b64encode(self.ready.handle()).decode()}

    def write_after(self, msg: dict) -> dict:
        import cupy

        self.release()
        device = self.cache.device
        if self.ready is None:
            self.ready = ReadyEvent(device)
        staged = [b.clone() for b in self.cache.buffers]
        shard = type(self.cache)(self.cache.spec, self.cache.rank, staged)
        fill_shifted(shard, msg["seed"], np.asarray(msg["ids"], dtype=np.int64), msg["tokens"], msg["shift"])
        flag = open_buffers(msg["flag"], device)
        wait_flag = cupy.RawKernel(_SPIN, "kvstage_test_wait_flag")
        torch.cuda.synchronize(device)  # the shard is ready on the device: nothing below waits on the host
        stream = torch.cuda.Stream(device)
        with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
            wait_flag((1,), (1,), (np.uint64(flag.spans[0][0]), np.int64(SPIN_LIMIT_NS)))
        with torch.cuda.stream(stream):
            for b, s in zip(self.cache.buffers, staged):
                b.copy_(s)
            self.ready.record(stream)
        self.held = [staged, flag, stream]
        return {"recorded": True}

    def quit(self, msg: dict) -> dict:
        self.release()
        return {"quit": True}


def main() -> None:
    source = _Source()
    commands = {"allocate": source.allocate, "event": source.event, "write_after": source.write_after,
                "quit": source.quit}
    for line in sys.stdin:
        msg = json.loads(line)
        print(json.dumps(commands[msg["cmd"]](msg)), flush=True)
        if msg["cmd"] == "quit":
            break


if __name__ == "__main__":
    main()
