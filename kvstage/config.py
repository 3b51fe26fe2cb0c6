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
#: ``Settings.path``: "auto", or one path forced (``protocol.route.Path``; kept here, below the protocol)
PATHS = ("auto", "ipc", "direct", "pages", "read")
#: the paths that read a source's KV pages themselves (not its arena): they need a one-sided transport
PAGE_PATHS = ("ipc", "direct", "pages")
PING_INTERVAL_S = 1.0  # every endpoint pings each peer this often; silence past peer_timeout_s fails its requests
#: transports ``Settings.transport`` may name; the one-sided ones read a peer's pages without its offer
TRANSPORTS = ("nixl", "ucx", "cma")
ONE_SIDED = ("nixl", "cma")
MIN_ARENA_BYTES = 4096
#: ``Settings.checksum``: which requests a source checksums (``protocol.checksums``)
CHECKSUMS = ("off", "sampled", "all")  # one page: the smallest arena that holds a slot


@dataclass
class Settings:
    """Per-endpoint settings. Defaults come from ``KVSTAGE_*`` variables."""

    #: nixl (one-sided NIXL reads), ucx (two-sided UCX through UCXX), cma (one host, host memory)
    transport: str = field(default_factory=lambda: _env("KVSTAGE_TRANSPORT", "nixl", str))
    #: the deployment's shared secret every source presents in its hello; empty: each destination makes a secret
    #: of its own and hands it out in its address (``protocol.address``)
    auth_token: str = field(default_factory=lambda: _env("KVSTAGE_AUTH_TOKEN", "", str))
    #: staging memory per rank, in MiB. None: sized from the model and the device (``staging.arena.arena_size``)
    arena_mb: float | None = field(default_factory=lambda: _env("KVSTAGE_ARENA_MB", None, float))
    #: where the arena lives: auto (a CUDA cache's GPU when UCX can move device memory, else pinned host
    #: memory), device, host
    arena: str = field(default_factory=lambda: _env("KVSTAGE_ARENA", "auto", str))
    #: which way requests go: auto (by the route's rule, per request: ``protocol.route``), or one of ipc,
    #: direct, pages, read, forced (a request that cannot take it fails, naming why)
    path: str = field(default_factory=lambda: _env("KVSTAGE_PATH", "auto", str))
    #: which requests carry a checksum of their bytes, summed on the source and checked where they land (a
    #: mismatch fails the request), on every path: off, sampled (a fixed share of requests), all. Set on the
    #: source (the prefill); a destination checks every request that carries one
    checksum: str = field(default_factory=lambda: _env("KVSTAGE_CHECKSUM", "sampled", str))
    #: a request waits this long for its other side: a destination for its sources' ``ready``, a source for a
    #: destination to start reading it
    ready_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_READY_TIMEOUT_S", 120.0, float))
    #: a request that makes no progress this long (a read not complete, a chunk not gathered, a read not
    #: reported) fails, if the peer it waits for runs (its pings say its loop turns); a busy peer's is only slow
    stall_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_STALL_TIMEOUT_S", 30.0, float))
    #: a peer silent (no ping) this long is taken for stopped or hung, and its requests fail
    peer_timeout_s: float = field(default_factory=lambda: _env("KVSTAGE_PEER_TIMEOUT_S", 30.0, float))
    #: the opt-out of authentication, by name: a destination with no ``auth_token`` makes no secret and admits
    #: anyone who reaches it (who then may read staging slots, not KV pages: the page paths need the token)
    allow_unauthenticated: bool = field(default_factory=lambda: _env("KVSTAGE_ALLOW_UNAUTHENTICATED", False, bool))
    #: serve this process's Prometheus metrics over HTTP on this port plus the endpoint's rank (``metrics.serve``);
    #: None: no port of kvstage's own (an engine's /metrics may still show them, docs/metrics.md)
    metrics_port: int | None = field(default_factory=lambda: _env("KVSTAGE_METRICS_PORT", None, int))

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and not (_is_number(v) and v > 0):
                raise ConfigError(f"{f.name}={v!r}: must be a number of seconds > 0")
        if self.arena_mb is not None and not (
            _is_number(self.arena_mb) and self.arena_mb * (1 << 20) >= MIN_ARENA_BYTES
        ):
            raise ConfigError(
                f"arena_mb={self.arena_mb!r}: must be at least 4 KiB (0.00390625 MiB), or unset to size "
                "the arena from the model and the device"
            )
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport={self.transport!r}: must be one of {', '.join(TRANSPORTS)}")
        if self.path not in PATHS:
            raise ConfigError(f"path={self.path!r}: must be one of {', '.join(PATHS)}")
        if self.path in PAGE_PATHS and self.path != "ipc" and self.transport not in ONE_SIDED:
            raise ConfigError(
                f"path={self.path!r} with transport={self.transport!r}: the {self.path} path reads the source's KV "
                f"pages one-sidedly, which {self.transport} (two-sided) cannot do; set KVSTAGE_PATH=auto or read, "
                "or KVSTAGE_TRANSPORT=nixl"
            )
        if self.peer_timeout_s < 2 * PING_INTERVAL_S:
            raise ConfigError(
                f"peer_timeout_s={self.peer_timeout_s!r}: must be >= {2 * PING_INTERVAL_S:g} s "
                f"(peers ping every {PING_INTERVAL_S:g} s)"
            )
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"checksum={self.checksum!r}: must be one of {', '.join(CHECKSUMS)}")
        if self.arena not in ARENA_LOCATIONS:
            raise ConfigError(f"arena={self.arena!r}: must be one of {', '.join(ARENA_LOCATIONS)}")
        if not isinstance(self.allow_unauthenticated, bool):
            raise ConfigError(f"allow_unauthenticated={self.allow_unauthenticated!r}: must be true or false")
        if not isinstance(self.auth_token, str):
            raise ConfigError(f"auth_token={self.auth_token!r}: must be a string")
        if self.metrics_port is not None:
            if not (
                isinstance(self.metrics_port, int)
                and not isinstance(self.metrics_port, bool)
                and 1 <= self.metrics_port <= 65535
            ):
                raise ConfigError(f"metrics_port={self.metrics_port!r}: must be a port number in 1..65535, or unset")
            if importlib.util.find_spec("prometheus_client") is None:
                raise ConfigError(
                    f"metrics_port={self.metrics_port}: needs prometheus_client; "
                    "pip install 'kvstage[metrics]', or unset metrics_port"
                )

    @property
    def offers_pages(self) -> bool:
        """Whether this rank's KV pages may be read by peers at all (a path other than read allowed, and a
        token: a peer is given the pages only when it presented one)."""
        return self.path != "read" and bool(self.auth_token)

    @property
    def arena_bytes(self) -> int | None:
        """The arena asked for, in bytes, or None for the automatic size."""
        return None if self.arena_mb is None else int(self.arena_mb * (1 << 20))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
