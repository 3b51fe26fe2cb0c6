"""The transport contract: move bytes between registered regions of two peers.

A transport knows nothing of KV, heads or TP. It registers memory, exchanges
opaque metadata with peers, reads a peer's registered spans into local ones,
writes local spans into a peer's registered spans with a notification that
arrives after the data, reports completion, and hands over notifications it
received.

Reads are how the decode side moves the bytes: a source makes its bytes
available (registered memory; for a two-sided transport also ``offer``) and
from then on its process may be stopped or busy while the reader completes.

One-sided transports (nixl, cma) read and write any registered span. Two-sided
ones (UCX tag messages) move bytes only where the other side posted the
matching operation: a writer needs the receiver's ``expect`` ticket, a reader
the sender's ``offer`` ticket, each carried by the request protocol. For a
one-sided transport both are no-ops returning an empty ticket.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from kvstage.errors import TransportError
from kvstage.ids import PeerId


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
    def from_wire(cls, d: dict) -> Region:
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
    def single(cls, region: Region, offsets, lengths) -> Spans:
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
    def check_pair(local: Spans, remote: Spans) -> None:
        """Raise ValueError unless a write's two sides are valid spans pairing up byte for byte."""
        if len(local) != len(remote) or np.any(local.lengths != remote.lengths):
            raise ValueError("local and remote spans differ in count or lengths")
        local.check("local spans")
        remote.check("remote spans")

    def addresses(self) -> np.ndarray:
        base = np.array([r.addr for r in self.regions], dtype=np.uint64)
        return base[self.index] + self.offsets.astype(np.uint64)


class WriteState(enum.Enum):
    """The state of a write, a read or an offer (``Transport.poll``)."""

    PENDING = "pending"
    DONE = "done"


class Failed:
    """A transfer that was accepted but failed before it could start (the peer gone): ``poll`` raises
    ``cause``, so a caller learns of every failure in one place."""

    __slots__ = ("cause",)

    def __init__(self, cause: str):
        self.cause = cause


class ReadyWrite:
    """A write made ahead of its post (``Transport.prepare_write``): ``post()``
    starts it and returns the handle for ``poll``; ``drop()`` discards it unposted."""

    def __init__(self, post, drop=lambda: None):
        self.post, self.drop = post, drop


#: what a transport's ``read``, ``write`` and ``offer`` return and ``poll``, ``abandon`` and ``release`` take:
#: each transport's own handle type (``NixlTransport(Transport[...])``), opaque to its callers
Handle = TypeVar("Handle")


class Transport(abc.ABC, Generic[Handle]):
    """One endpoint of a transport. Not thread-safe: one thread drives it."""

    name: str
    #: True: ``write`` may target any registered span (``expect`` is a no-op).
    #: False: only spans the receiver ``expect``-ed, with the ticket it returned.
    one_sided: bool = True
    #: True: ``read`` needs the peer's ``offer`` of the spans first, and its ticket (two-sided: ucx)
    reads_offered: bool = False
    #: True: host memory only (``register`` refuses device memory)
    host_only: bool = False
    #: seconds one span of a write costs whatever its size, by memory ("cuda", "cpu"): what the direct
    #: path's page runs are charged (``protocol.route``). NIXL posts one UCX request per span: ~12 us
    #: over cuda_ipc on one H200, ~3.6 us over cma on the 2-core CPU machine (512-byte spans)
    span_cost_s: dict = {"cuda": 12e-6, "cpu": 3.6e-6}
    #: seconds one span of a read costs whatever its size, by memory: what the route charges a read of
    #: many page runs (each transport sets its own)
    read_span_cost_s: dict = {"cuda": 12e-6, "cpu": 3.6e-6}

    def expect(self, peer: PeerId, spans: Spans) -> bytes:
        """Receiver side: ``peer`` will write into ``spans`` (registered here) in
        one ``write`` whose spans match these one for one. Returns the ticket
        that write must carry. One-sided transports: a no-op, ``b""``."""
        return b""

    def offer(self, peer: PeerId, local: Spans) -> tuple[bytes, Handle | None]:
        """Make ``local`` (registered here) readable by ``peer``'s next ``read`` of the same spans; returns
        (ticket, handle). One-sided transports: (b"", None), registered memory is readable as it is.
        Two-sided (ucx): one tag send per span, receiver-driven (the reader pulls the bytes; this side's
        progress is needed only to complete the handle); ``poll(handle)`` is DONE once the reader took them."""
        try:
            local.check("offered spans")
        except ValueError as e:
            raise TransportError(f"{self.name} offer to {peer}: {e}") from e
        return b"", None

    @abc.abstractmethod
    def register(self, tensor) -> Region:
        """Register a contiguous tensor for remote reads and writes; keep it alive while registered."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``connect`` to reach this endpoint."""

    @abc.abstractmethod
    def connect(self, peer_metadata: bytes) -> PeerId:
        """Load a peer's metadata; return the peer's id for ``read`` and ``write``."""

    @abc.abstractmethod
    def disconnect(self, peer: PeerId) -> None:
        """Forget a peer (its metadata and connection); its reads, writes and offers not done fail."""

    @property
    @abc.abstractmethod
    def id(self) -> PeerId:
        """This endpoint's id as peers see it (``connect``'s result, notification sender)."""

    @abc.abstractmethod
    def read(self, peer: PeerId, local: Spans, remote: Spans, ticket: bytes = b"") -> Handle:
        """Start reading each remote span of ``peer`` (registered there) into the matching local span
        (registered here); ``ticket``: the peer's ``offer`` (two-sided). A handle for ``poll``/``release``;
        DONE means every byte is in ``local``; a failure raises TransportError from ``poll``. Spans that
        do not pair up, or lie outside what the peer registered (two-sided: outside their regions; the
        source's ``offer`` checked its own), raise TransportError here, before anything moves."""

    @abc.abstractmethod
    def write(self, peer: PeerId, local: Spans, remote: Spans, notification: bytes, ticket: bytes = b"") -> Handle:
        """Start writing each local span to the matching remote span of ``peer``;
        ``notification`` reaches the peer after all of them. ``ticket``: what the
        peer's ``expect`` returned for ``remote`` (two-sided transports). Returns
        a handle for ``poll``."""

    def prepare_write(
        self, peer: PeerId, local: Spans, remote: Spans, notification: bytes, ticket: bytes = b""
    ) -> ReadyWrite:
        """``write`` in two steps: what needs no bytes in place (checks,
        descriptors, the transfer request) now, while the bytes are still being
        made; the post when ``post()`` is called. Default: all at ``post()``."""
        return ReadyWrite(lambda: self.write(peer, local, remote, notification, ticket))

    @abc.abstractmethod
    def poll(self, handle: Handle) -> WriteState:
        """State of a write, read or offer; raises ``TransportError`` if it failed."""

    @abc.abstractmethod
    def abandon(self, handle: Handle) -> bool:
        """Give up a read or an offer not DONE: cancel what can be cancelled. True when nothing of it can
        land (or be taken) any more, False when bytes may still arrive (the caller keeps that memory out of
        use until ``poll`` says it is over). Either way ``release`` it once it is over."""

    @abc.abstractmethod
    def release(self, handle: Handle) -> None:
        """Free a finished transfer's resources."""

    @abc.abstractmethod
    def notifications(self) -> list[tuple[PeerId, bytes]]:
        """Notifications received since the last call, as (peer id, bytes)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister everything and drop all peers."""
