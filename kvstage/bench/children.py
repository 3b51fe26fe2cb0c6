"""The rank processes this process starts: start, watch, reap and end them.

Kept apart from the coordinator's protocol (``session``) so that how a rank process
comes to exist is one place, the same for a local run and a source host's share: each
is forked by a warm launcher (``launcher``) that imported torch and kvstage once.
A run's launcher ends with the run, unless the caller keeps one for several runs of
this process (``keep_launcher``: the test suite's runs share one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

from kvstage.bench.control import rank_name
from kvstage.bench.launcher import Forked, Launcher
from kvstage.bench.scenario import engine_id

KILL_GRACE_S = 5.0


def _child_stdout():
    """Rank processes print (NIXL, logs) to our stderr so stdout stays the table/JSON."""
    try:
        os.fstat(2)
        return 2
    except OSError:
        return subprocess.DEVNULL


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class _Kept:
    """A launcher kept for the runs inside one ``keep_launcher()``, and what it was started with."""

    def __init__(self, ignore_env: tuple[str, ...]) -> None:
        self.launcher: Launcher | None = None
        self.key: tuple | None = None
        self.ignore_env = ignore_env


_KEPT: list[_Kept] = []  # the keep_launcher() calls in effect, innermost last


@contextlib.contextmanager
def keep_launcher(ignore_env: tuple[str, ...] = ()):
    """Within, the runs of this process share one launcher instead of one each (a launcher
    costs its imports, about 1.6 s of CPU). It is replaced when a run's ranks would get
    another environment (but for the variables in ``ignore_env``), stderr or starting thread
    than it has (it dies with the thread that started it), and ended on leaving. Every rank
    runs in the environment of its own start, whatever the launcher's."""
    kept = _Kept(ignore_env)
    _KEPT.append(kept)
    try:
        yield
    finally:
        _KEPT.remove(kept)
        if kept.launcher is not None:
            kept.launcher.close()


def _stderr_identity(stdout) -> tuple:
    """What the ranks' stdout and stderr are: a launcher passes its own on to every rank it forks."""
    try:
        st = os.fstat(2)
        return (stdout, st.st_dev, st.st_ino)
    except OSError:
        return (stdout,)


class Children:
    """Rank processes started by this process (``log_level``: of their logs on stderr;
    ``clock_sync``: they measure their clock offset to the coordinator even on its kernel;
    ``token``: the auth token their endpoints use, ``KVSTAGE_AUTH_TOKEN`` in their environment)."""

    def __init__(self, coord: tuple[str, int], log_level: str = "WARNING", clock_sync: bool = False, token: str = ""):
        self.coord, self.log_level, self.clock_sync = coord, log_level, clock_sync
        self.env = dict(os.environ, KVSTAGE_AUTH_TOKEN=token) if token else None
        self.procs: dict[tuple[int, str, int | None, int], Forked] = {}
        self.launcher: Launcher | None = None  # started (or taken from keep_launcher) with the first rank
        self._owns_launcher = False  # this run's own: stop_all ends it

    def start(self, group: int, role: str, ranks, engine: int | None = None) -> None:
        """Start ranks ``ranks`` of ``role`` (of engine ``engine`` in a multi-engine group), each
        forked by this process's launcher (``launcher``: a rank process without a fresh Python's
        imports), as ``python -m kvstage.bench.worker`` with these arguments would run it."""
        if self.launcher is None:
            self.launcher = self._launcher()
        for r in ranks:
            args = (
                [
                    "--coord",
                    f"{self.coord[0]}:{self.coord[1]}",
                    "--role",
                    role,
                    "--rank",
                    str(r),
                    "--group",
                    str(group),
                    "--parent",
                    str(os.getpid()),
                    "--log-level",
                    self.log_level,
                ]
                + (["--clock-sync"] if self.clock_sync else [])
                + (["--engine", str(engine)] if engine is not None else [])
            )
            name = f"{role}{r}" + (f"@{engine_id(role, engine)}" if engine is not None else "")
            env = self.env if self.env is not None else dict(os.environ)
            self.procs[(group, role, engine, r)] = self.launcher.start(args, name, env)

    def _launcher(self) -> Launcher:
        stdout = _child_stdout()
        if not _KEPT:
            self._owns_launcher = True
            return Launcher(self.env, stdout)
        kept = _KEPT[-1]
        env = self.env if self.env is not None else dict(os.environ)
        env = {k: v for k, v in env.items() if k not in kept.ignore_env}
        key = (env, _stderr_identity(stdout), threading.get_ident())
        if kept.launcher is not None and (kept.key != key or not kept.launcher.alive()):
            kept.launcher.close()
            kept.launcher = None
        if kept.launcher is None:
            kept.launcher, kept.key = Launcher(self.env, stdout), key
        return kept.launcher

    def failed(self) -> str | None:
        for (_g, role, engine, r), p in self.procs.items():
            rc = p.poll()
            if rc not in (None, 0):
                how = f"was killed by {_signal_name(-rc)}" if rc < 0 else f"exited with code {rc}"
                return f"{rank_name(role, r, engine)} {how}"
        return None

    def reap(self, group: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for key in [k for k in self.procs if k[0] == group]:
            p = self.procs.pop(key)
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        """End every rank still running: they saw the coordinator close; then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + KILL_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        if self.launcher is not None and self._owns_launcher:
            self.launcher.close()
        self.launcher, self._owns_launcher = None, False
