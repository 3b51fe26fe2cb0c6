"""Settings: every knob kvstage reads, with its environment variable and default.

docs/configuration.md lists the same table for users; keep the two in step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

from kvstage.errors import ConfigError


def _env(name: str, default, kind):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: must be a {kind.__name__}") from None


def _number_in(v, lo: float, hi: float) -> bool:
    """``v`` is a number (not a bool) in ``[lo, hi]`` (NaN never is)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi


def _whole_in(v, lo: float, hi: float) -> bool:
    """``v`` is an integer (not a bool) in ``[lo, hi]``."""
    return isinstance(v, int) and _number_in(v, lo, hi)


ARENA_LOCATIONS = ("auto", "device", "host")
MAPPED = ("auto", "on", "off")
#: how a host cache's gathers and scatters copy: auto (native streaming span copies where built, else
#: numpy/torch), native (refuse to start where not built), numpy (numpy/torch always)
HOST_COPIES = ("auto", "native", "numpy")
PING_INTERVAL_S = 1.0  # every endpoint pings each peer this often; silence past peer_timeout_s fails its requests
#: transports ``Settings.transport`` may name; the one-sided ones support the direct path
TRANSPORTS = ("nixl", "ucx", "cma")
ONE_SIDED = ("nixl", "cma")
MAX_SEND_WAIT_US = 10_000  # a send that holds its caller longer than this is no longer a send
MAX_POLL_US = 1_000_000  # a loop that polls a whole second after each event would hardly ever sleep
#: ``poll_us`` when unset: a GPU host has cores to spare and wakes a sleeping thread slowly (0.1-0.2 ms,
#: docs/benchmarks.md, session 16); on a host cache the cores do the copies
DEFAULT_POLL_US = {"cuda": 50000.0, "cpu": 0.0}
MAX_SCATTER_THREADS = 64
#: ``switch_interval_us``'s range: below 10 µs the interpreter would spend its time handing the GIL round
SWITCH_INTERVAL_US = (10, 1_000_000)


@dataclass
class Settings:
    """Per-endpoint settings. Defaults come from ``KVSTAGE_*`` variables."""

    arena_mb: float = field(default_factory=lambda: _env("KVSTAGE_ARENA_MB", 512.0, float))
    slot_mb: float = field(default_factory=lambda: _env("KVSTAGE_SLOT_MB", 64.0, float))
    auth_token: str = field(default_factory=lambda: _env("KVSTAGE_AUTH_TOKEN", "", str))
    handshake_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_HANDSHAKE_TIMEOUT_S", 5.0, float))
    ready_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_READY_TIMEOUT_S", 120.0, float))
    stall_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_STALL_TIMEOUT_S", 5.0, float))
    peer_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_PEER_TIMEOUT_S", 5.0, float))
    #: a destination keeps the slots granted to a writer lost before they landed out of use this long,
    #: unless the late writes' notices arrive first: bytes queued on a cut link can land once it is back
    late_write_hold_s: float = field(default_factory=lambda: _env("KVSTAGE_LATE_WRITE_HOLD_S", 60.0, float))
    transport: str = field(default_factory=lambda: _env("KVSTAGE_TRANSPORT", "nixl", str))
    #: None: on for one-sided transports (nixl, cma), off for two-sided ones (ucx)
    direct: bool | None = field(default_factory=lambda: _env("KVSTAGE_DIRECT", None, bool))
    arena: str = field(default_factory=lambda: _env("KVSTAGE_ARENA", "auto", str))
    #: chunks a destination grants a request before every source announced it (0: grant only after)
    early_chunks: int = field(default_factory=lambda: _env("KVSTAGE_EARLY_CHUNKS", 2, int))
    #: a source on its destination's host gathers straight into the destination's mapped arena:
    #: auto (CUDA arenas, through CUDA IPC), on (also host arenas, through a memfd; refuse a
    #: destination that cannot share), off (always a transport write)
    mapped: str = field(default_factory=lambda: _env("KVSTAGE_MAPPED", "auto", str))
    #: a destination queues each mapped writer's piece scatter on the GPU behind a wait on a word the
    #: writer's stream sets after its gather (``staging.landing``); off (the default): launched when
    #: ``landed`` is read. Off by default: no gain measured yet, and a queued wait holds back device-wide
    #: synchronizations in the decode process (docs/architecture.md, step 5)
    prearm: bool = field(default_factory=lambda: _env("KVSTAGE_PREARM", False, bool))
    #: a CUDA source whose ``send`` gathered a whole request into mapped arenas (a small request
    #: granted early) waits up to this long on the caller's thread for the gathers to end, and
    #: tells the destinations from there: the loop would first have to wake. 0: never wait
    send_wait_us: float = field(default_factory=lambda: _env("KVSTAGE_SEND_WAIT_US", 200.0, float))
    #: while an endpoint holds a request in flight, its loop polls its sockets (every 20 µs on a GPU
    #: host) for this long after each event (a message other than a ping, a call, a send), instead
    #: of sleeping until the next message. None: ``DEFAULT_POLL_US`` for the cache's device. 0: always sleep
    poll_us: float | None = field(default_factory=lambda: _env("KVSTAGE_POLL_US", None, float))
    #: the interpreter's switch interval while this endpoint is open (``protocol.switch_interval``):
    #: how long a thread running pure Python keeps the GIL from the endpoint's loop. None: left alone
    switch_interval_us: float | None = field(default_factory=lambda: _env("KVSTAGE_SWITCH_INTERVAL_US", None, float))
    #: threads a destination with a host cache scatters each chunk on (its loop thread is one of them).
    #: None: 2 with a transport that gathers (cma: the sources leave a core free) on a host of 2+ cores,
    #: else 1. A GPU cache's kernel ignores it
    scatter_threads: int | None = field(default_factory=lambda: _env("KVSTAGE_SCATTER_THREADS", None, int))
    #: how a host cache's gathers and scatters copy (``HOST_COPIES``; ``staging.hostcopy``)
    host_copy: str = field(default_factory=lambda: _env("KVSTAGE_HOST_COPY", "auto", str))

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("arena_mb", "slot_mb") and not (isinstance(v, (int, float)) and v * (1 << 20) >= 4096):
                raise ConfigError(f"{f.name}={v!r}: must be at least 4 KiB (0.00390625 MiB)")
            if f.name.endswith("_s") and not v > 0:
                raise ConfigError(f"{f.name}={v!r}: must be > 0 seconds")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport={self.transport!r}: must be one of {', '.join(TRANSPORTS)}")
        if self.direct is None:
            self.direct = self.transport in ONE_SIDED
        elif self.direct and self.transport not in ONE_SIDED:
            raise ConfigError(
                f"direct={self.direct!r} with transport={self.transport!r}: the direct path writes into the "
                f"destination's KV pages one-sidedly, which {self.transport} (two-sided) cannot do; "
                "set KVSTAGE_DIRECT=0 (equal TP then goes staged) or KVSTAGE_TRANSPORT=nixl"
            )
        if self.peer_timeout_s < 2 * PING_INTERVAL_S:
            raise ConfigError(f"peer_timeout_s={self.peer_timeout_s!r}: must be >= {2 * PING_INTERVAL_S:g} s "
                              f"(peers ping every {PING_INTERVAL_S:g} s)")
        if not _whole_in(self.early_chunks, 0, math.inf):
            raise ConfigError(f"early_chunks={self.early_chunks!r}: must be an integer >= 0")
        if not _number_in(self.send_wait_us, 0, MAX_SEND_WAIT_US):
            raise ConfigError(f"send_wait_us={self.send_wait_us!r}: must be a number of microseconds in "
                              f"[0, {MAX_SEND_WAIT_US}]")
        if self.poll_us is not None and not _number_in(self.poll_us, 0, MAX_POLL_US):
            raise ConfigError(f"poll_us={self.poll_us!r}: must be a number of microseconds in [0, {MAX_POLL_US}], "
                              "or unset for the device's default")
        if self.scatter_threads is not None and not _whole_in(self.scatter_threads, 1, MAX_SCATTER_THREADS):
            raise ConfigError(f"scatter_threads={self.scatter_threads!r}: must be a whole number in [1, {MAX_SCATTER_THREADS}]")
        lo, hi = SWITCH_INTERVAL_US
        if self.switch_interval_us is not None and not _number_in(self.switch_interval_us, lo, hi):
            raise ConfigError(f"switch_interval_us={self.switch_interval_us!r}: must be a number of microseconds in "
                              f"[{lo}, {hi}], or unset to leave the interpreter's switch interval alone")
        if self.mapped not in MAPPED:
            raise ConfigError(f"mapped={self.mapped!r}: must be one of {', '.join(MAPPED)}")
        if self.mapped == "on" and self.transport not in ONE_SIDED:
            raise ConfigError(
                f"mapped='on' with transport={self.transport!r}: a mapped arena replaces one-sided writes; "
                f"{self.transport} is two-sided (its receives are posted per chunk); set KVSTAGE_MAPPED=auto or off"
            )
        if self.host_copy not in HOST_COPIES:
            raise ConfigError(f"host_copy={self.host_copy!r}: must be one of {', '.join(HOST_COPIES)}")
        if self.arena not in ARENA_LOCATIONS:
            raise ConfigError(f"arena={self.arena!r}: must be one of {', '.join(ARENA_LOCATIONS)}")
        if self.slot_mb > self.arena_mb:
            raise ConfigError(f"slot_mb={self.slot_mb} > arena_mb={self.arena_mb}: a slot must fit in the arena")

    def poll_seconds(self, device_type: str) -> float:
        """How long a loop polls after each event, for a cache on ``device_type``."""
        us = self.poll_us if self.poll_us is not None else DEFAULT_POLL_US.get(device_type, 0.0)
        return us * 1e-6

    @property
    def slot_bytes(self) -> int:
        """Slot size, rounded down to 4 KiB so every slot starts aligned."""
        return int(self.slot_mb * (1 << 20)) // 4096 * 4096

    @property
    def slots(self) -> int:
        return int(self.arena_mb * (1 << 20)) // self.slot_bytes
