"""The control port's gate: what a connection may do before it is authenticated.

Everything a stranger can make a destination hold is bounded here, in time,
size and count: a connection has ``HANDSHAKE_TIMEOUT_S`` to authenticate, its
frames are at most ``PRE_AUTH_MAX_FRAME`` bytes until then (checked from the
length prefix, before the body is read), it may send only a hello or a probe
request, and at most ``MAX_UNAUTHENTICATED`` such connections are held (the
oldest is dropped for a new one). Refusals are logged once per peer address
and cause, with a count of the repeats in the same interval.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
import socket
from dataclasses import dataclass, field

from kvstage.errors import ConfigError

#: a hello carries the spec, the agent's metadata and the link facts: tens of KiB; 1 MiB leaves
#: room and bounds what 64 strangers can make a destination buffer to 64 MiB
PRE_AUTH_MAX_FRAME = 1 << 20
#: connections held before authentication: an engine has a few peers per rank, a flood gets this many,
#: and never more than a quarter of the descriptors the process has left (``pending_cap``): the
#: transport's own sockets (UCX's listener) must not meet EMFILE
MAX_UNAUTHENTICATED = 64
MIN_UNAUTHENTICATED = 4
#: the only messages a connection may send before it is authenticated
PRE_AUTH_TYPES = ("hello", "probe")
#: repeats of one refusal (address, cause) within this many seconds are counted, not logged
REFUSAL_INTERVAL_S = 10.0
#: refusal keys remembered at once; past this the oldest interval is flushed early
MAX_REFUSAL_KEYS = 1024


@dataclass
class _Refusals:
    first: float
    count: int = 0


@dataclass
class RefusalLog:
    """One log line per refused peer address and cause; repeats inside ``REFUSAL_INTERVAL_S``
    are counted and reported in one line when the interval ends (``flush``) or the cause recurs
    after it. ``now``: the caller's monotonic seconds, so the rule is tested without sleeping.
    Keys are kept in order of age (insertion order): the oldest goes first past ``MAX_REFUSAL_KEYS``."""

    log: logging.Logger
    prefix: str
    _seen: dict = field(default_factory=dict)

    def refuse(self, address: str, cause: str, now: float) -> None:
        key = (address, cause)
        got = self._seen.get(key)
        if got is not None and now - got.first < REFUSAL_INTERVAL_S:
            got.count += 1
            return
        if got is not None:
            self._report(key, self._seen.pop(key))
        elif len(self._seen) >= MAX_REFUSAL_KEYS:
            oldest = next(iter(self._seen))
            self._report(oldest, self._seen.pop(oldest))
        self._seen[key] = _Refusals(now)
        self.log.warning("%s: refused %s: %s", self.prefix, address, cause)

    def flush(self, now: float) -> None:
        """Report the repeats of every interval that has ended."""
        for key, got in list(self._seen.items()):
            if now - got.first >= REFUSAL_INTERVAL_S:
                self._report(key, self._seen.pop(key))

    def _report(self, key, got: _Refusals) -> None:
        if got.count:
            self.log.warning(
                "%s: refused %s %d more times in %.0f s: %s", self.prefix, key[0], got.count, REFUSAL_INTERVAL_S, key[1]
            )


def pending_cap() -> int:
    """How many unauthenticated connections to hold now: ``MAX_UNAUTHENTICATED``, or a quarter of
    the descriptors left under ``RLIMIT_NOFILE`` when that is fewer (at least ``MIN_UNAUTHENTICATED``)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_UNAUTHENTICATED
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: the limit alone
        used = 0
    return max(MIN_UNAUTHENTICATED, min(MAX_UNAUTHENTICATED, (soft - used) // 4))


def host_of(peer: str) -> str:
    """The address part of ``host:port`` (IPv6 hosts keep their colons): repeats from one host
    on new ports are one peer address for the refusal log."""
    return peer.rsplit(":", 1)[0] if ":" in peer else peer


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (``""`` is every interface: no)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_listen(settings, listen: tuple, who: str) -> None:
    """A control port without an auth token listens on loopback only, unless the operator says
    otherwise by name (``Settings.allow_unauthenticated``). ``who``: the port's owner, for the error."""
    if settings.auth_token or settings.allow_unauthenticated or is_loopback(listen[0]):
        return
    raise ConfigError(
        f"{who}: listen address {listen[0]!r} is not loopback and no auth token is set: anyone who reaches it "
        "could connect; set KVSTAGE_AUTH_TOKEN (the same on every rank), or KVSTAGE_ALLOW_UNAUTHENTICATED=1 to "
        "accept that"
    )
