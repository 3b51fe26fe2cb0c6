"""Pings from a native thread, so a busy engine is not taken for a dead one.

An endpoint's loop is a Python thread inside an engine's process. While the
engine's own threads hold the GIL, the loop cannot run; pings it sent itself
would stop, and its peers would fail its requests after ``peer_timeout_s``
of silence. ``_beat.c`` pings every watched control connection from a thread
that needs no GIL, once per ``PING_INTERVAL_S``, and each ping carries
``loop_s``: how long before it this endpoint's loop last turned. A peer thus
tells a live but busy endpoint (pings arrive, ``loop_s`` large) from a
stopped process, a hung host or a cut link (no pings) and from a broken data
path (pings arrive, ``loop_s`` small, no progress).

Messages from Python go through the same library (``send``), under the same
per-socket lock as the pings, so a ping never lands inside another frame.
Where ``_beat`` was not built (no C compiler at install), ``available()`` is
False and each endpoint's loop pings itself, as its one log line says.
"""

from __future__ import annotations

import ctypes
import os
import threading

from kvstage.config import PING_INTERVAL_S
from kvstage.native import load as load_native

_lib: ctypes.CDLL | None = None
_why_not = ""
_lock = threading.Lock()
_clocks: list = []  # every loop clock handed to the pinger: kept for the process's life (it may read any)


def _load() -> None:
    global _lib, _why_not
    if _lib is not None or _why_not:
        return
    with _lock:
        if _lib is not None or _why_not:
            return
        lib, _why_not = load_native("kvstage.protocol._beat")
        if lib is None:
            return
        lib.kvstage_beat_send.restype = ctypes.c_int
        lib.kvstage_beat_send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.kvstage_beat_start.restype = ctypes.c_int
        lib.kvstage_beat_start.argtypes = [ctypes.c_double]
        lib.kvstage_beat_watch.restype = ctypes.c_int
        lib.kvstage_beat_watch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        lib.kvstage_beat_forget.restype = None
        lib.kvstage_beat_forget.argtypes = [ctypes.c_int]
        lib.kvstage_beat_count.restype = ctypes.c_int
        lib.kvstage_beat_count.argtypes = []
        rc = lib.kvstage_beat_start(PING_INTERVAL_S)
        if rc:
            _why_not = f"the pinger thread did not start: {os.strerror(rc)}"
            return
        _lib = lib


def available() -> bool:
    _load()
    return _lib is not None


def why_unavailable() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    _load()
    return _why_not


def _loaded() -> ctypes.CDLL:
    """The native pinger, which the caller found ``available()``."""
    if _lib is None:
        raise RuntimeError(f"the native pinger is not loaded: {_why_not or 'available() was not asked'}")
    return _lib


def send(fd: int, data: bytes) -> None:
    """Send one whole frame on socket ``fd`` (without the GIL); never interleaved with a ping."""
    rc = _loaded().kvstage_beat_send(fd, data, len(data))
    if rc:
        raise OSError(-rc, os.strerror(-rc))


class LoopClock:
    """One endpoint loop's clock as the pinger reads it: ``turned`` is called at each turn."""

    def __init__(self):
        self._value = ctypes.c_double(0.0)
        with _lock:
            _clocks.append(self._value)

    def turned(self, now: float) -> None:
        self._value.value = now

    def watch(self, fd: int) -> None:
        """Ping ``fd`` from now on, with this clock's age."""
        lib = _loaded()
        if lib.kvstage_beat_watch(fd, ctypes.byref(self._value)):
            raise OSError(f"the pinger watches {lib.kvstage_beat_count()} sockets already")


def forget(fd: int) -> None:
    """Stop pinging ``fd``; once this returns, the pinger does not touch it (it may be closed)."""
    if _lib is not None:
        _lib.kvstage_beat_forget(fd)


def watched() -> int:
    """Sockets the pinger pings now (tests)."""
    return _lib.kvstage_beat_count() if _lib is not None else 0
