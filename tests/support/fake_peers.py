"""Peers that speak the control protocol by hand, around a real NIXL agent:
``FakeSource`` talks to a real ``Destination``, ``FakeDestination`` to a real
``Source``. Both run the real handshake (hello with a nonce, welcome with its
proof, offer, the destination's first read, opened); tests use them to send
what a real peer never would (hostile ``ready``, ``chunk``, ``read``, ``done``
and ``abort`` messages) and to hold a protocol step still (a chunk not
announced, a read not reported).

Bytes are the reference cache's (``bench.reference``): a fake source writes
a chunk's reference bytes into its arena by plain indexing, not through the
copiers under test, and a fake destination checks what it reads against them.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import threading
import time

import numpy as np
import torch

from support import fault_ranks as fr
from kvstage.bench.reference import fill_shard, full_buffer
from kvstage.config import Settings
from kvstage.errors import ProtocolError
from kvstage.layout import PageLayout, pages_needed
from kvstage.protocol.handshake import proof, spec_from_wire, spec_to_wire
from kvstage.protocol.messages import (PROTOCOL_VERSION, Hello, Message, Offer, Opened, Welcome, decode)
from kvstage.protocol.source import Source
from kvstage.protocol.wire import Connection
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec, plan
from kvstage.transports.base import Region, Spans, WriteState
from kvstage.transports.nixl import NixlTransport

TOKEN = "s3cret"
#: a fake source's arena: four 16 KiB slots of chunks (32 tokens of a TP-1 shard of ``fr.GEO``)
ARENA_BYTES = 1 << 16


def reference_chunk(seed: int, spec: SideSpec, start: int, count: int, order: str = "tokens",
                    rank: int = 0) -> torch.Tensor:
    """The bytes of tokens ``start .. start + count`` of rank ``rank``'s whole shard of the reference cache, as a
    read-path chunk holds them (``staging.region``): ``tokens`` [buffers][rows][heads][head bytes], ``heads``
    [heads][buffers][rows][head bytes]. Plain indexing of ``bench.reference``, independent of the copiers."""
    g, rank_heads = spec.geometry, spec.heads_of(rank)
    cols = torch.stack([full_buffer(seed, b, start + count, rank_heads.stop, g.head_bytes(), rank_heads.start)[start:]
                        for b in range(g.buffers)])  # [buffers][rows][heads][head bytes]
    if order == "heads":
        cols = cols.permute(2, 0, 1, 3)
    return cols.contiguous().reshape(-1)


def _wait_read(agent, handle, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while agent.poll(handle) is not WriteState.DONE:
        assert time.monotonic() < deadline, f"{what} did not complete"
    agent.release(handle)


class _Peer:
    """A raw control connection and a NIXL agent: messages in and out, by hand."""

    conn: Connection
    agent: NixlTransport

    def send(self, msg) -> None:
        """Send a typed message or a raw dict (what a real peer never would)."""
        self.conn.send(msg.to_wire() if isinstance(msg, Message) else msg)

    def message(self, match=lambda m: True, timeout: float = 10.0) -> dict:
        """The first control message ``match`` accepts within ``timeout`` seconds (pings are skipped;
        ``TimeoutError`` after), as the raw dict the peer sent. The agent is driven meanwhile, as a
        real endpoint's loop drives its transport (a peer's first read of this agent needs it)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching message within {timeout} s")
            if not select.select([self.conn.sock], [], [], min(left, 0.001))[0]:
                self.agent.notifications()
                continue
            self.conn.sock.settimeout(max(left, 1e-3))
            m = self.conn.recv()
            if m["type"] != "ping" and match(m):
                return m

    def about(self, req: str, timeout: float = 10.0) -> dict:
        """The next message (an error, an abort, a read...) naming request ``req``."""
        return self.message(lambda m: m.get("req") == req, timeout)

    def error(self, timeout: float = 10.0) -> dict:
        return self.message(lambda m: m["type"] == "error", timeout)

    def quiet(self, seconds: float = 0.3) -> list:
        """Every message but pings that arrives within ``seconds``."""
        got = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                got.append(self.message(timeout=max(end - time.monotonic(), 1e-3)))
            except TimeoutError:
                break
        return got


class OneWelcome:
    """A listener that answers one source's hello with ``welcome(hello)`` (a wire dict) and then, with
    ``opened``, its offer with an ``opened`` (else it stays silent); ``after`` lists the types of the
    messages that came after the welcome, until the source closed the connection."""

    def __init__(self, welcome, opened: bool = False):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()
        self.after: list = []
        self.hello: dict | None = None
        self._done = threading.Event()
        threading.Thread(target=self._serve, args=(welcome, opened), daemon=True).start()

    def _serve(self, welcome, opened: bool) -> None:
        try:
            sock, _ = self.server.accept()
        except OSError:  # closed before any source came
            self._done.set()
            return
        conn = Connection(sock, "source")
        sock.settimeout(30)
        try:
            self.hello = conn.recv()
            conn.send(welcome(self.hello))
            while True:
                kind = conn.recv()["type"]
                self.after.append(kind)
                if kind == "offer" and opened:
                    conn.send(Opened(False, "").to_wire())
        except (ConnectionError, OSError, ProtocolError):
            pass
        finally:
            conn.close()
            self._done.set()

    def closed(self, timeout: float = 10.0) -> bool:
        """Whether the source closed the connection within ``timeout``."""
        return self._done.wait(timeout)

    def close(self) -> None:
        self.server.close()


def welcome_of(spec: SideSpec, hello: dict, token: str = TOKEN, **over) -> dict:
    """A destination's welcome (rank 0 of ``spec``, transport nixl, the read path) to ``hello``, with its proof
    of ``token``; ``over``: wire fields replaced."""
    w = Welcome(PROTOCOL_VERSION, "", "", spec_to_wire(spec), 0, "nixl", b"", 16384, {}, ["read"], True,
                proof(token, hello["nonce"]) if token else None).to_wire()
    return {**w, **over}


class FakeSource(_Peer):
    """Source rank ``rank`` of ``spec`` (default TP 1, page size 16) of prefill engine ``engine``, spoken
    by hand to a real destination at ``address``: a real NIXL agent whose arena (``ARENA_BYTES``) and KV
    buffers (``offer_kv``) it offers, and which the destination reads; ``facts``: its hello's, as it likes."""

    def __init__(self, address, *, token: str = TOKEN, spec: SideSpec | None = None, rank: int = 0,
                 engine: str = "hostile", paths=("read", "pages", "direct"), offer_kv: bool = True, pages: int = 64,
                 facts: dict | None = None):
        self.spec = spec or fr.src_spec(1)
        self.cache = RankCache.allocate(self.spec, rank, pages)
        self.agent = NixlTransport(f"fake-src-{engine}{rank}")
        try:
            self.arena = torch.zeros(ARENA_BYTES, dtype=torch.uint8)
            self.arena_region = self.agent.register(self.arena)
            self.kv = [self.agent.register(b) for b in self.cache.buffers] if offer_kv else []
            self.conn = Connection(socket.create_connection(address, timeout=10), "destination")
            nonce = secrets.token_hex(16)
            self.send(Hello(PROTOCOL_VERSION, token, engine, "", os.getuid(), spec_to_wire(self.spec), rank,
                            self.agent.id, "nixl", self.agent.metadata(), 16384, facts or {}, {}, list(paths), nonce))
            welcome = decode(self.message(timeout=10))
            assert isinstance(welcome, Welcome), welcome
            assert welcome.proof == (proof(token, nonce) if token else None), "the destination's proof is wrong"
            self.welcome = welcome  # NIXL is one-sided: the destination reads, the source never loads its metadata
            self.send(Offer(self.arena_region.to_wire(), [r.to_wire() for r in self.kv], None))
            self.opened = self.message(lambda m: m["type"] in ("opened", "error"), timeout=10)
            assert self.opened["type"] == "opened", self.opened
        except BaseException:
            self.close()
            raise
        self.dst = spec_from_wire(welcome.spec)
        (self.piece,) = [p for p in plan(self.spec, self.dst).writers_of(welcome.rank) if p.src_rank == rank]

    @property
    def paths(self) -> list:
        """The paths the destination allows this source (its welcome's)."""
        return self.welcome.paths

    def fill(self, seed: int, tokens: int, first_page: int = 0) -> list[int]:
        """Write ``tokens`` tokens of the reference cache into consecutive pages from ``first_page`` of
        this rank's cache (what the pages path reads); their ids."""
        ids = np.arange(first_page, first_page + pages_needed(tokens, self.spec.page.page_size))
        fill_shard(self.cache, seed, ids, tokens)
        return ids.tolist()

    def stage(self, seed: int, start: int, count: int, offset: int, order: str = "tokens") -> int:
        """Write the reference bytes of tokens ``start .. start + count`` into this rank's arena at
        ``offset``, as a gathered chunk; their size."""
        data = reference_chunk(seed, self.spec, start, count, order, self.cache.rank)
        self.arena[offset: offset + len(data)] = data
        return len(data)

    def ready(self, req: str, tokens: int, path: str, **fields) -> None:
        self.send({"type": "ready", "req": req, "tokens": tokens, "path": path, **fields})

    def chunk(self, req: str, index: int, offset: int, **fields) -> None:
        self.send({"type": "chunk", "req": req, "index": index, "offset": offset, **fields})

    def close(self) -> None:
        if getattr(self, "conn", None) is not None:
            self.conn.close()
        self.agent.close()


class FakeDestination(_Peer):
    """Destination rank 0 of TP 1 with page size 1 (never the direct path), spoken by hand: a real NIXL
    agent behind a raw control socket, with a real ``Source`` (rank 0 of ``src_spec``, its pages filled
    with the reference cache of ``seed``, ``path`` read by default) connected to it."""

    def __init__(self, src_spec: SideSpec | None = None, *, token: str = TOKEN, seed: int = 7, paths=("read",),
                 **settings):
        src_spec = src_spec or fr.src_spec(1)
        self.seed, self.spec = seed, SideSpec(src_spec.geometry, 1, PageLayout(1))
        self.agent = NixlTransport("fake-dst")
        self.buf = torch.zeros(ARENA_BYTES, dtype=torch.uint8)
        self.region = self.agent.register(self.buf)
        self.server = socket.create_server(("127.0.0.1", 0))
        box: dict = {}

        def serve():
            try:
                sock, _ = self.server.accept()
                self.conn = Connection(sock, "source")
                sock.settimeout(10)
                hello = decode(self.conn.recv())
                self.hello = hello
                self.send(Welcome(PROTOCOL_VERSION, "", "", spec_to_wire(self.spec), 0, "nixl", self.agent.metadata(),
                                  16384, {}, list(paths), True, proof(token, hello.nonce) if token else None))
                offer = decode(self.conn.recv())
                self.offer = offer
                self.peer = self.agent.connect(hello.metadata)
                self.arena = Region.from_wire(offer.arena)
                # the first read, as a real destination's: the source drives its transport until ``opened``
                h = self.agent.read(self.peer, Spans.single(self.region, [0], [16]), Spans.single(self.arena, [0], [16]))
                _wait_read(self.agent, h, "the first read of the source's arena")
                self.send(Opened(False, "a fake destination opens nothing"))
            except BaseException as e:  # handed to the constructor's thread
                box["error"] = e

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        base = {"arena_mb": 0.25, "auth_token": token, "path": "read", "peer_timeout_s": 600}
        try:
            self.src = Source(RankCache.allocate(src_spec, 0, 32), Settings(**(base | settings)))
        except BaseException:
            self.server.close()
            self.agent.close()
            raise
        try:
            self.src.connect([self.server.getsockname()])
            t.join(10)
            assert "error" not in box, box.get("error")
        except BaseException:
            self.close()
            raise
        (self.piece,) = plan(src_spec, self.spec).targets_of(0)

    def send_request(self, req: str, tokens: int, first_page: int = 0):
        """``Source.send`` of ``tokens`` tokens of the reference cache (written into consecutive pages from
        ``first_page`` first): the source's handle."""
        ids = np.arange(first_page, first_page + pages_needed(tokens, self.src.spec.page.page_size))
        fill_shard(self.src.cache, self.seed, ids, tokens)
        return self.src.send(req, ids, tokens)

    def read_chunk(self, index: int, offset: int, ready: dict) -> bool:
        """Read chunk ``index`` (at ``offset`` of the source's arena) of a read-path ``ready`` and say
        whether its bytes are the reference's."""
        start = index * ready["chunk_tokens"]
        want = reference_chunk(self.seed, self.src.spec, start, min(ready["chunk_tokens"], ready["tokens"] - start),
                               ready["order"])
        h = self.agent.read(self.peer, Spans.single(self.region, [0], [len(want)]),
                            Spans.single(self.arena, [offset], [len(want)]))
        _wait_read(self.agent, h, f"the read of chunk {index}")
        return bool(torch.equal(self.buf[: len(want)], want))

    def close(self) -> None:
        if getattr(self, "src", None) is not None:
            self.src.close()
        if getattr(self, "conn", None) is not None:
            self.conn.close()
        self.server.close()
        self.agent.close()
