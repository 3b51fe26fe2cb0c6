"""A warm launcher: one process that imports what a rank needs once, then forks each rank.

A fresh Python per rank process spent about 1.6 s of CPU importing torch and kvstage
before it did anything, and 0.4 s more tearing the interpreter down at exit: most of a
small run, and most of the test suite's time on a 2-core machine. ``Children`` starts
one launcher (``python -m kvstage.bench.launcher --parent PID``) at a run's first rank
(or keeps one for several runs of its process: ``children.keep_launcher``); the launcher
imports ``PRELOAD``, freezes those objects out of the garbage collector, and forks every
rank from that state. Each rank is a process of its own as before: its own session,
stdin on /dev/null, stdout and stderr the coordinator's stderr, the coordinator's
environment as of the rank's start, SIGKILLed when the launcher dies (as the launcher is
when its coordinator dies); it runs ``worker.main`` and leaves with ``os._exit``.

What is forked must hold no threads, no transport and no device context: the launcher
imports modules only, never NIXL, UCX(X) or a CUDA context (``check_forkable`` refuses
to fork otherwise; numpy's OpenBLAS threads stop themselves around a fork). Everything a
rank starts, its transport and endpoints included, it starts after the fork, as a fresh
process did.

The coordinator's side, ``Launcher``, gives each rank a ``Forked``: the part of
``subprocess.Popen`` that ``Children`` uses (poll, wait, terminate, kill), answered by
the launcher, which reaps its ranks and reports their exit codes. A rank's command line
is the launcher's (``ps``: ``kvstage.bench.launcher --parent PID``); its name
(``/proc/PID/comm``, ``kvstage-src0``) says which rank it is.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

#: what a rank imports, imported once by the launcher before any fork
PRELOAD = (
    "kvstage.bench.worker",
    "kvstage.bench.baselines",
    "kvstage.bench.forward",
    "kvstage.bench.reference",
    "kvstage.config",
    "kvstage.protocol.destination",
    "kvstage.protocol.source",
    "kvstage.staging.cache",
    "kvstage.transports.cma",
    "kvstage.transports.nixl",
    "kvstage.transports.ucx",
)
#: never imported by the launcher: their threads, sockets and contexts belong to one process
#: (importing ucxx also sets UCX_* variables every rank would inherit)
UNFORKABLE = ("nixl", "nixl_cu13", "nixl_cu12", "ucxx", "ucp", "cupy")
POLL_S = 0.02  # how often the launcher looks for a rank that ended
CLOSE_S = 5.0  # how long the coordinator waits for the launcher to end once told to


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when ``parent`` dies (no orphan ranks)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:
        os._exit(1)


# -- the coordinator's side ---------------------------------------------------------------
class Forked:
    """A rank the launcher forked, as ``Children`` sees it (``returncode`` as Popen's)."""

    def __init__(self, launcher: Launcher, key: int):
        self.launcher, self.key = launcher, key
        self.pid: int | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.launcher.drain(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 0.25 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.key}", timeout or 0)
            self.launcher.drain(min(left, 0.25))
        return self.returncode

    def terminate(self) -> None:
        self.launcher.signal(self, signal.SIGTERM)

    def kill(self) -> None:
        self.launcher.signal(self, signal.SIGKILL)


class Launcher:
    """One launcher process, started now, and the ranks it forked for this process.

    Requests go to its stdin (one JSON object a line); it answers on a pipe of its own
    (a rank's pid once forked, its exit code once reaped). ``env`` and ``stdout`` are
    every rank's, as ``subprocess.Popen``'s."""

    def __init__(self, env: dict | None, stdout):
        # own session, here and for each rank: a terminal's Ctrl-C reaches only the coordinator,
        # which ends the ranks in order
        replies, theirs = os.pipe()
        cmd = [sys.executable, "-m", "kvstage.bench.launcher", "--parent", str(os.getpid()), "--replies", str(theirs)]
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=stdout,
                pass_fds=(theirs,),
                start_new_session=True,
                env=env,
            )
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(theirs)
        self._replies = replies
        self._buf = b""
        self._ranks: dict[int, Forked] = {}  # those not reported ended yet
        self._started = 0
        self._open = True

    def start(self, args: list[str], name: str, env: dict[str, str]) -> Forked:
        """Fork one rank that runs ``worker.main(args)`` in environment ``env`` (what a Popen'd
        rank would inherit now, which may have changed since the launcher started); ``name``:
        its process name (``src0``)."""
        rank = Forked(self, self._started)
        self._started += 1
        if not self._open:  # it ended already: so did this rank, at once
            rank.returncode = -signal.SIGKILL
            return rank
        self._ranks[rank.key] = rank
        self._send({"start": rank.key, "args": args, "name": name, "env": env})
        return rank

    def alive(self) -> bool:
        """Whether it still forks ranks (it dies with the coordinator's thread that started it)."""
        self.drain(0)
        return self._open and self.proc.poll() is None

    def signal(self, rank: Forked, sig: int) -> None:
        if rank.returncode is None:
            self._send({"signal": rank.key, "sig": int(sig)})

    def _send(self, msg: dict) -> None:
        assert self.proc.stdin is not None, "Popen(stdin=PIPE)"
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it ended (drain says so) or it was closed
            pass

    def drain(self, timeout: float) -> None:
        """Take the launcher's answers that come within ``timeout`` seconds (0: those there now)."""
        if not self._open:
            return
        ready, _, _ = select.select([self._replies], [], [], timeout)
        if not ready:
            return
        data = os.read(self._replies, 1 << 16)
        if not data:  # the launcher ended: a rank it had not reported ended with it (PDEATHSIG)
            self._open = False
            os.close(self._replies)
            try:
                code = self.proc.wait(CLOSE_S)
            except subprocess.TimeoutExpired:
                code = -signal.SIGKILL
            for rank in self._ranks.values():
                rank.returncode = code or -signal.SIGKILL
            self._ranks.clear()
            return
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if "pid" in msg:
                self._ranks[msg["key"]].pid = msg["pid"]
            else:
                self._ranks.pop(msg["key"]).returncode = msg["code"]

    def close(self) -> None:
        """Tell the launcher to end (it SIGKILLs any rank still running), and wait for it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        deadline = time.monotonic() + CLOSE_S
        while self._open and time.monotonic() < deadline:
            self.drain(0.25)
        if self._open:
            self.proc.kill()
            self.drain(CLOSE_S)
        self.proc.wait()


# -- the launcher process -------------------------------------------------------------------
def check_forkable() -> None:
    """Refuse to fork from a process that started what must not be shared with a child."""
    import threading

    import torch

    bad = [m for m in UNFORKABLE if m in sys.modules]
    if bad:
        raise RuntimeError(f"kvstage bench launcher: imported {', '.join(bad)} before forking its ranks")
    if torch.cuda.is_initialized():
        raise RuntimeError("kvstage bench launcher: CUDA was initialized before forking its ranks")
    if threading.active_count() != 1:
        raise RuntimeError(f"kvstage bench launcher: {threading.active_count()} Python threads before forking")


def _rank(args: list[str], name: str, env: dict[str, str], launcher: int, replies: int) -> None:
    """In the forked child: become a rank process of its own, run it, leave."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        os.setsid()
        os.close(replies)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # not the launcher's requests
        os.close(null)
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(15, f"kvstage-{name}".encode()[:15])  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
        from kvstage.bench import worker

        code = worker.main(args, launcher=launcher)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        # the interpreter's own teardown (torch's modules) costs 0.5 s of CPU a process: skipped, as a
        # multiprocessing child does; what must be flushed is flushed here
        try:
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(replies: int) -> None:
    """Fork a rank per request on stdin until it closes; report each rank's pid and exit code."""
    me = os.getpid()
    pids: dict[int, int] = {}  # pid -> key
    buf = b""
    requests = True

    def reply(msg: dict) -> None:
        try:
            os.write(replies, json.dumps(msg).encode() + b"\n")
        except BrokenPipeError:  # the coordinator is gone; its death ends us too
            pass

    while requests or pids:
        ready, _, _ = select.select([0] if requests else [], [], [], POLL_S)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:  # the coordinator is done with us (or gone): no rank outlives it
                requests = False
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
            *lines, buf = (buf + data).split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if "start" in msg:
                    check_forkable()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        _rank(msg["args"], msg["name"], msg["env"], me, replies)
                    pids[pid] = msg["start"]
                    reply({"key": msg["start"], "pid": pid})
                else:
                    pid = next((p for p, k in pids.items() if k == msg["signal"]), 0)
                    if pid:  # not reaped yet: the pid is still that rank's
                        os.kill(pid, msg["sig"])
        while pids:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            reply({"key": pids.pop(pid), "code": os.waitstatus_to_exitcode(status)})


def main(argv=None) -> int:
    import argparse
    import gc
    import importlib

    ap = argparse.ArgumentParser(prog="python -m kvstage.bench.launcher")
    ap.add_argument("--parent", type=int, required=True, help="the coordinator: this process ends with it")
    ap.add_argument("--replies", type=int, required=True, help="the pipe to report each rank's pid and exit on")
    a = ap.parse_args(argv)
    die_with_parent(a.parent)
    for name in PRELOAD:
        importlib.import_module(name)
    check_forkable()
    # what every rank inherits (torch's 180,000 objects) is never collected: a rank's full collection
    # (a transport's close runs one) then takes microseconds, not 0.1 s, and touches none of those
    # pages, which stay shared with the launcher (gc.freeze's purpose, before a fork)
    gc.freeze()
    serve(a.replies)
    return 0


if __name__ == "__main__":
    # run as the module ``kvstage.bench.launcher``, the one its ranks import, not a second copy
    # named __main__ (where Python 3.12's warning about forking beside numpy's BLAS threads,
    # which stop themselves around a fork, would show)
    from kvstage.bench.launcher import main as _main

    code = _main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as a rank: no interpreter teardown to wait for
