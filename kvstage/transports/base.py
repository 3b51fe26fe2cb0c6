"""The transport contract: move bytes between registered regions of two peers.

A transport knows nothing of KV, heads or TP. It registers memory, exchanges
opaque metadata with peers, writes local spans into a peer's registered spans
with a notification that arrives after the data, reports completion, and
hands over notifications it received.

One-sided transports (NIXL) write into any registered span. Two-sided ones
(UCX tag messages) can only land bytes where the receiver posted a receive:
the receiving side calls ``expect(peer, spans)`` before the peer writes there,
and hands the ticket it returns to the writer (the request protocol carries it
in the grant); the writer passes it to ``write``. For a one-sided transport
``expect`` checks nothing, posts nothing and returns an empty ticket.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Region:
    """A registered memory region, as a peer needs to address it."""

    addr: int
    nbytes: int
    device: str  # "cpu" or "cuda"
    device_id: int

    def to_wire(self) -> dict:
        return {"addr": self.addr, "nbytes": self.nbytes, "device": self.device, "device_id": self.device_id}

    @classmethod
    def from_wire(cls, d: dict) -> "Region":
        r = cls(int(d["addr"]), int(d["nbytes"]), str(d["device"]), int(d["device_id"]))
        if r.device not in ("cpu", "cuda") or r.nbytes < 0 or r.addr < 0 or r.device_id < 0:
            raise ValueError(f"region {d!r}: device must be cpu|cuda and numbers non-negative")
        return r


@dataclass(frozen=True)
class Spans:
    """Byte spans in registered regions: span ``i`` is ``lengths[i]`` bytes at
    ``regions[index[i]].addr + offsets[i]``. All regions share one device."""

    regions: tuple[Region, ...]
    index: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def single(cls, region: Region, offsets, lengths) -> "Spans":
        off = np.asarray(offsets, dtype=np.int64).reshape(-1)
        return cls((region,), np.zeros(len(off), dtype=np.int64), off, np.asarray(lengths, dtype=np.int64).reshape(-1))

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def device(self) -> tuple[str, int]:
        kinds = {(r.device, r.device_id) for r in self.regions}
        if len(kinds) != 1:
            raise ValueError(f"spans cover regions on several devices: {sorted(kinds)}")
        return kinds.pop()

    def check(self, what: str) -> None:
        """Raise ValueError unless every span is non-empty and inside its region."""
        if not (len(self.index) == len(self.offsets) == len(self.lengths)):
            raise ValueError(f"{what}: index, offsets and lengths differ in length")
        if not len(self):
            raise ValueError(f"{what}: no spans")
        sizes = np.array([r.nbytes for r in self.regions], dtype=np.int64)
        if self.index.min() < 0 or self.index.max() >= len(sizes):
            raise ValueError(f"{what}: a span names a region that does not exist")
        if self.lengths.min() <= 0 or self.offsets.min() < 0 or np.any(self.offsets + self.lengths > sizes[self.index]):
            raise ValueError(f"{what}: a span falls outside its registered region or is empty")

    @staticmethod
    def check_pair(local: "Spans", remote: "Spans") -> None:
        """Raise ValueError unless a write's two sides are valid spans pairing up byte for byte."""
        if len(local) != len(remote) or np.any(local.lengths != remote.lengths):
            raise ValueError("local and remote spans differ in count or lengths")
        local.check("local spans")
        remote.check("remote spans")

    def addresses(self) -> np.ndarray:
        base = np.array([r.addr for r in self.regions], dtype=np.uint64)
        return base[self.index] + self.offsets.astype(np.uint64)


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"


class ReadyWrite:
    """A write made ahead of its post (``Transport.prepare_write``): ``post()``
    starts it and returns the handle for ``poll``; ``drop()`` discards it unposted."""

    def __init__(self, post, drop=lambda: None):
        self.post, self.drop = post, drop


class Transport(abc.ABC):
    """One endpoint of a transport. Not thread-safe: one thread drives it."""

    name: str
    #: True: ``write`` may target any registered span (``expect`` is a no-op).
    #: False: only spans the receiver ``expect``-ed, with the ticket it returned.
    one_sided: bool = True
    #: True: a write of many local spans costs about what one span of their bytes costs (the
    #: transport walks them in the copy itself), so a writer need not gather them into one first
    gathers: bool = False
    #: True: host memory only (``register`` refuses device memory)
    host_only: bool = False
    #: seconds one span of a write costs whatever its size, by memory ("cuda", "cpu"): what the direct
    #: path's page runs are charged (``protocol.route``). NIXL posts one UCX request per span: ~12 us
    #: over cuda_ipc on one H200, ~3.6 us over cma on the 2-core CPU machine (512-byte spans)
    span_cost_s: dict = {"cuda": 12e-6, "cpu": 3.6e-6}

    def expect(self, peer: str, spans: Spans) -> bytes:
        """Receiver side: ``peer`` will write into ``spans`` (registered here) in
        one ``write`` whose spans match these one for one. Returns the ticket
        that write must carry. One-sided transports: a no-op, ``b""``."""
        return b""

    @abc.abstractmethod
    def register(self, tensor) -> Region:
        """Register a contiguous tensor for remote writes; keep it alive while registered."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``connect`` to reach this endpoint."""

    @abc.abstractmethod
    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata; return the peer's id for ``write``."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget a peer (its metadata and connection)."""

    @property
    @abc.abstractmethod
    def id(self) -> str:
        """This endpoint's id as peers see it (``connect``'s result, notification sender)."""

    @abc.abstractmethod
    def write(self, peer: str, local: Spans, remote: Spans, notification: bytes, ticket: bytes = b"") -> object:
        """Start writing each local span to the matching remote span of ``peer``;
        ``notification`` reaches the peer after all of them. ``ticket``: what the
        peer's ``expect`` returned for ``remote`` (two-sided transports). Returns
        a handle for ``poll``."""

    def prepare_write(self, peer: str, local: Spans, remote: Spans, notification: bytes,
                      ticket: bytes = b"") -> ReadyWrite:
        """``write`` in two steps: what needs no bytes in place (checks,
        descriptors, the transfer request) now, while the bytes are still being
        made; the post when ``post()`` is called. Default: all at ``post()``."""
        return ReadyWrite(lambda: self.write(peer, local, remote, notification, ticket))

    @abc.abstractmethod
    def prepare(self, peer: str | None, spans: Spans) -> object:
        """Prepare spans once (``peer=None``: local spans) so that
        ``write_prepared`` can pick from them by index without re-validating."""

    @abc.abstractmethod
    def write_prepared(
        self, peer: str, local: object, local_index: np.ndarray, remote: object, remote_index: np.ndarray, notification: bytes,
        ticket: bytes = b"",
    ) -> object:
        """Like ``write``, for spans chosen by index from two prepared lists."""

    @abc.abstractmethod
    def poll(self, handle: object) -> WriteState:
        """State of a write; raises ``TransportError`` if it failed."""

    @abc.abstractmethod
    def release(self, handle: object) -> None:
        """Free a finished write's resources."""

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (peer id, bytes)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister everything and drop all peers."""
