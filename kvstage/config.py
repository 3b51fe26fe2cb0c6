"""Settings: the choices a user makes, each with its environment variable and default.

Everything else (chunk sizes, poll windows, early grants, copy threads) is a
constant or an automatic rule beside the code it drives, with its reason, and
the endpoint logs the value it chose once. docs/configuration.md lists the
same table for users; keep the two in step.
"""

from __future__ import annotations

import importlib.util
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


ARENA_LOCATIONS = ("auto", "device", "host")
MAPPED = ("auto", "on", "off")
SHARE_KV = ("auto", "off")
PING_INTERVAL_S = 1.0  # every endpoint pings each peer this often; silence past peer_timeout_s fails its requests
#: transports ``Settings.transport`` may name; the one-sided ones support the direct path
TRANSPORTS = ("nixl", "ucx", "cma")
ONE_SIDED = ("nixl", "cma")
MIN_ARENA_BYTES = 4096  # one page: the smallest arena that holds a slot


@dataclass
class Settings:
    """Per-endpoint settings. Defaults come from ``KVSTAGE_*`` variables."""

    #: nixl (one-sided NIXL writes), ucx (two-sided UCX through UCXX), cma (one host, host memory)
    transport: str = field(default_factory=lambda: _env("KVSTAGE_TRANSPORT", "nixl", str))
    #: the shared secret every source presents in its hello; empty: none
    auth_token: str = field(default_factory=lambda: _env("KVSTAGE_AUTH_TOKEN", "", str))
    #: staging memory per rank, in MiB. None: sized from the model and the device (``staging.arena.arena_size``)
    arena_mb: float | None = field(default_factory=lambda: _env("KVSTAGE_ARENA_MB", None, float))
    #: where the arena lives: auto (a CUDA cache's GPU when UCX can move device memory, else pinned host
    #: memory), device, host
    arena: str = field(default_factory=lambda: _env("KVSTAGE_ARENA", "auto", str))
    #: whole shards with equal paging write their page runs in place. None: when that is expected to be
    #: at least as fast as staging (``route``); True: always where possible; False: never
    direct: bool | None = field(default_factory=lambda: _env("KVSTAGE_DIRECT", None, bool))
    #: a source on its destination's host gathers straight into the destination's arena: auto (CUDA
    #: arenas on the source's own GPU, through CUDA IPC), on (also another GPU's arena, and host arenas
    #: through a memfd; refuse a destination that cannot share), off (always a transport write)
    mapped: str = field(default_factory=lambda: _env("KVSTAGE_MAPPED", "auto", str))
    #: a destination whose KV pages are CUDA memory shares them with authenticated sources of its host and
    #: user that ask (CUDA IPC), which then write their head slices straight into its pages: auto (where the
    #: memory can be shared) or off (never: they go through the arena)
    share_kv: str = field(default_factory=lambda: _env("KVSTAGE_SHARE_KV", "auto", str))
    #: a request waits this long for its other side to announce it
    ready_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_READY_TIMEOUT_S", 120.0, float))
    #: a granted chunk not landed (a write not complete) this long after its grant fails its request, if
    #: the peer it waits for runs (its pings say its loop turns); a busy peer's request is only slow
    stall_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_STALL_TIMEOUT_S", 30.0, float))
    #: a peer silent (no ping) this long is taken for stopped or hung, and its requests fail
    peer_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_PEER_TIMEOUT_S", 30.0, float))
    #: a destination keeps the slots granted to a writer lost before they landed out of use this long,
    #: unless the late writes' notices arrive first: bytes queued on a cut link can land once it is back
    late_write_hold_s: float = field(default_factory=lambda: _env("KVSTAGE_LATE_WRITE_HOLD_S", 60.0, float))
    #: a destination with no ``auth_token`` may listen on an address other than loopback, open to anyone
    #: who reaches it (who then may take staging slots, not KV pages: the direct path needs the token)
    allow_unauthenticated: bool = field(default_factory=lambda: _env("KVSTAGE_ALLOW_UNAUTHENTICATED", False, bool))
    #: serve this process's Prometheus metrics over HTTP on this port plus the endpoint's rank (``metrics.serve``);
    #: None: no port of kvstage's own (an engine's /metrics may still show them, docs/metrics.md)
    metrics_port: int | None = field(default_factory=lambda: _env("KVSTAGE_METRICS_PORT", None, int))

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and not (_is_number(v) and v > 0):
                raise ConfigError(f"{f.name}={v!r}: must be a number of seconds > 0")
        if self.arena_mb is not None and not (_is_number(self.arena_mb) and self.arena_mb * (1 << 20) >= MIN_ARENA_BYTES):
            raise ConfigError(f"arena_mb={self.arena_mb!r}: must be at least 4 KiB (0.00390625 MiB), or unset to size "
                              "the arena from the model and the device")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport={self.transport!r}: must be one of {', '.join(TRANSPORTS)}")
        if self.direct and self.transport not in ONE_SIDED:
            raise ConfigError(
                f"direct={self.direct!r} with transport={self.transport!r}: the direct path writes into the "
                f"destination's KV pages one-sidedly, which {self.transport} (two-sided) cannot do; "
                "unset KVSTAGE_DIRECT (equal TP then goes staged) or set KVSTAGE_TRANSPORT=nixl"
            )
        if self.peer_timeout_s < 2 * PING_INTERVAL_S:
            raise ConfigError(f"peer_timeout_s={self.peer_timeout_s!r}: must be >= {2 * PING_INTERVAL_S:g} s "
                              f"(peers ping every {PING_INTERVAL_S:g} s)")
        if self.share_kv not in SHARE_KV:
            raise ConfigError(f"share_kv={self.share_kv!r}: must be one of {', '.join(SHARE_KV)}")
        if self.mapped not in MAPPED:
            raise ConfigError(f"mapped={self.mapped!r}: must be one of {', '.join(MAPPED)}")
        if self.mapped == "on" and self.transport not in ONE_SIDED:
            raise ConfigError(
                f"mapped='on' with transport={self.transport!r}: a mapped arena replaces one-sided writes; "
                f"{self.transport} is two-sided (its receives are posted per chunk); set KVSTAGE_MAPPED=auto or off"
            )
        if self.arena not in ARENA_LOCATIONS:
            raise ConfigError(f"arena={self.arena!r}: must be one of {', '.join(ARENA_LOCATIONS)}")
        if not isinstance(self.allow_unauthenticated, bool):
            raise ConfigError(f"allow_unauthenticated={self.allow_unauthenticated!r}: must be true or false")
        if not isinstance(self.auth_token, str):
            raise ConfigError(f"auth_token={self.auth_token!r}: must be a string")
        if self.metrics_port is not None:
            if not (isinstance(self.metrics_port, int) and not isinstance(self.metrics_port, bool)
                    and 1 <= self.metrics_port <= 65535):
                raise ConfigError(f"metrics_port={self.metrics_port!r}: must be a port number in 1..65535, or unset")
            if importlib.util.find_spec("prometheus_client") is None:
                raise ConfigError(f"metrics_port={self.metrics_port}: needs prometheus_client; "
                                  "pip install 'kvstage[metrics]', or unset metrics_port")
        if self.direct and not self.auth_token:
            raise ConfigError(
                "direct=True without auth_token: the direct path lets a peer write into this rank's KV pages, "
                "which only a peer presenting the token may; set KVSTAGE_AUTH_TOKEN (the same on every rank)"
            )

    @property
    def may_go_direct(self) -> bool:
        """Whether the direct path is allowed at all (auto or on): a one-sided transport, and a token
        (a peer is given the KV pages' regions only when it presented one)."""
        return self.direct is not False and self.transport in ONE_SIDED and bool(self.auth_token)

    @property
    def arena_bytes(self) -> int | None:
        """The arena asked for, in bytes, or None for the automatic size."""
        return None if self.arena_mb is None else int(self.arena_mb * (1 << 20))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
