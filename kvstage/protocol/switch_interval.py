"""The interpreter's switch interval, set while endpoints that ask for it are open.

An endpoint's loop is a Python thread: each time it wakes it needs the GIL, and
a thread of the same process running pure Python keeps the GIL until the switch
interval (``sys.getswitchinterval()``, 5 ms by default) makes it let go. Beside
such a thread a 1 ms request took 22-33 ms (``benchmarks/gil_share.py``). The
interval belongs to the whole interpreter, so it changes only when a setting
asks (``switch_interval_us``), and is put back when the last endpoint that asked
closes, unless someone else changed it meanwhile.
"""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger("kvstage")

_lock = threading.Lock()
_holders = 0
_saved: float | None = None  # the interval before the first claim
_ours: float | None = None  # the interval the last claim set


def claim(us: float, who: str) -> None:
    """Set the interval to ``us`` microseconds for as long as this claim is held."""
    global _holders, _saved, _ours
    with _lock:
        now = sys.getswitchinterval()
        if _holders == 0:
            _saved = now
        _holders += 1
        sys.setswitchinterval(us * 1e-6)
        _ours = sys.getswitchinterval()  # as the interpreter keeps it (whole microseconds)
        if _ours != now:
            log.info("%s: the interpreter's switch interval is now %g µs (was %g µs), for every thread of this "
                     "process, until the last endpoint that set switch_interval_us closes", who, us, now * 1e6)


def release(who: str) -> None:
    """Give a claim back; the last one puts the interval back as it was before the first."""
    global _holders, _saved, _ours
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders:
            return
        now, saved, ours = sys.getswitchinterval(), _saved, _ours
        _saved = _ours = None
        if now != ours:
            log.info("%s: the interpreter's switch interval was changed to %g µs outside kvstage; left as it is",
                     who, now * 1e6)
        elif now != saved:
            sys.setswitchinterval(saved)
            log.info("%s: the interpreter's switch interval is back to %g µs", who, saved * 1e6)


def holders() -> int:
    """How many open endpoints hold a claim (for tests)."""
    return _holders
