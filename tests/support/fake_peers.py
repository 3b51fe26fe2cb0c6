"""Peers that speak the control protocol by hand, around a real NIXL agent:
``FakeSource`` talks to a real ``Destination``, ``FakeDestination`` to a real
``Source``. Tests use them to send what a real peer never would (hostile
notices and grants) and to hold a protocol step still (grants not yet written).
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import numpy as np
import torch

from support import fault_ranks as fr
from kvstage.bench.reference import fill_shard
from kvstage.config import Settings
from kvstage.layout import PageLayout, pages_needed
from kvstage.protocol.handshake import md_from_wire, md_to_wire, spec_from_wire, spec_to_wire
from kvstage.protocol.source import Source
from kvstage.protocol.wire import PROTOCOL_VERSION, Connection, encode_notice
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather
from kvstage.tp import SideSpec, plan
from kvstage.transports.base import Region, Spans, WriteState
from kvstage.transports.nixl import NixlTransport

def expect_reversed(dst, req: str, tokens: int, first_page: int):
    """``dst.expect`` of ``tokens`` into pages ``first_page..`` in reverse order (not a trivial mapping)."""
    ids = np.arange(first_page, first_page + pages_needed(tokens, 4))[::-1].copy()
    return dst.expect(req, ids, tokens), ids


class FakeSource:
    """Source rank 0 of TP 1 speaking the protocol by hand (``spec``: another TP 1
    layout, e.g. the destination's own paging for the direct path)."""

    def __init__(self, address, token: str, spec=None):
        self.spec = spec or fr.src_spec(1)
        self.cache = RankCache.allocate(self.spec, 0, 64)
        self.agent = NixlTransport("hostile-src")
        self.buf = torch.zeros(1 << 16, dtype=torch.uint8)
        self.local = self.agent.register(self.buf)
        self.conn = Connection(socket.create_connection(address, timeout=10), "destination")
        self.conn.send({"type": "hello", "version": PROTOCOL_VERSION, "token": token, "engine": "", "spec": spec_to_wire(self.spec),
                        "rank": 0, "agent": self.agent.id, "metadata": md_to_wire(self.agent.metadata()),
                        "slot_bytes": 16384})
        welcome = self.conn.recv()
        assert welcome["type"] == "welcome", welcome
        self.welcome = welcome
        self.peer = self.agent.connect(md_from_wire(welcome["metadata"]))
        self.arena = Region.from_wire(welcome["arena"])
        p = plan(self.spec, spec_from_wire(welcome["spec"]))
        (self.piece,) = p.targets_of(0)
        self.token_bytes = p.piece_token_bytes(self.piece)
        self.stash: list[dict] = []
        self.pages: dict[str, np.ndarray] = {}
        self.next_page = 0

    def announce(self, req: str, tokens: int, seed: int, say: bool = True) -> None:
        """Fill the request's pages and (``say``) send its ``ready``."""
        n = pages_needed(tokens, self.spec.page.page_size)
        self.pages[req] = np.arange(self.next_page, self.next_page + n)
        self.next_page = (self.next_page + n) % (self.cache.pages - n)
        fill_shard(self.cache, seed, self.pages[req], tokens)
        if say:
            self.conn.send({"type": "ready", "req": req, "tokens": tokens})

    def ping(self) -> None:
        """A ping saying this source's loop just turned, as a running source's pinger sends each second."""
        self.conn.send({"type": "ping", "loop_s": 0.0})

    def message(self, match, timeout: float = 10) -> dict:
        """The first control message ``match`` accepts within ``timeout`` seconds
        (``TimeoutError`` after); others are kept for later."""
        for m in self.stash:
            if match(m):
                self.stash.remove(m)
                return m
        deadline = time.monotonic() + timeout
        while True:  # a deadline, not a per-read timeout: the destination's pings never stop
            self.conn.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            m = self.conn.recv()
            if match(m):
                return m
            self.stash.append(m)

    def grant(self, req: str, chunk: int, timeout: float = 10) -> dict:
        return self.message(lambda m: m["type"] == "grant" and m["req"] == req and m["chunk"] == chunk, timeout)

    def error(self) -> str:
        m = self.message(lambda m: m["type"] == "error" and m.get("about") == "landed")
        return m["reason"]

    def write(self, req: str, grant: dict, notice: bytes | None = None, *, offset: int | None = None,
              nbytes: int | None = None, chunk: int | None = None) -> None:
        """Gather the granted tokens and write them: at ``offset`` (default: the grant's),
        ``nbytes`` of them (default: all), with ``notice`` (default: the honest one)."""
        offset = grant["offset"] if offset is None else offset
        nbytes = grant["count"] * self.token_bytes if nbytes is None else nbytes
        idx = TokenIndex(self.cache, self.pages[req], grant["start"], grant["count"])
        gather(self.cache, idx, self.piece.src_offset, self.piece.heads.count, self.buf[: grant["count"] * self.token_bytes])
        if notice is None:
            notice = encode_notice(req, grant["chunk"] if chunk is None else chunk, 0, offset, nbytes)
        h = self.agent.write(self.peer, Spans.single(self.local, [0], [nbytes]), Spans.single(self.arena, [offset], [nbytes]), notice)
        deadline = time.monotonic() + 10
        while self.agent.poll(h) is not WriteState.DONE:
            assert time.monotonic() < deadline, "write did not complete"
        self.agent.release(h)

    def close(self) -> None:
        self.conn.close()
        self.agent.close()


class FakeDestination:
    """Destination rank 0 of TP 1 spoken by hand: a real NIXL agent and arena
    behind a raw control socket, with a real ``Source`` (rank 0 of ``src_spec``) connected to it."""

    def __init__(self, src_spec: SideSpec, **settings):
        dst_spec = SideSpec(src_spec.geometry, 1, PageLayout(1))  # different paging: the staged path
        self.agent = NixlTransport("fake-dst")
        self.arena = torch.zeros(1 << 16, dtype=torch.uint8)
        region = self.agent.register(self.arena)
        self.server = socket.create_server(("127.0.0.1", 0))
        box = {}

        def serve():
            sock, _ = self.server.accept()
            c = Connection(sock, "fake")
            box["hello"] = c.recv()
            c.send({"type": "welcome", "version": PROTOCOL_VERSION, "engine": "", "spec": spec_to_wire(dst_spec), "rank": 0,
                    "metadata": base64.b64encode(self.agent.metadata()).decode(), "arena": region.to_wire(), "kv": [],
                    "facts": {}})
            box["conn"] = c

        t = threading.Thread(target=serve)
        t.start()
        # peer_timeout_s: this fake destination does not ping like a real one
        self.src = Source(RankCache.allocate(src_spec, 0, 32, fill=7),
                          Settings(**({"arena_mb": 0.25, "peer_timeout_s": 600} | settings)))
        self.src.connect([self.server.getsockname()])
        t.join(5)
        self.conn = box["conn"]

    def recv(self) -> dict:
        """The next message that is not the source's once-a-second ping."""
        while (m := self.conn.recv())["type"] == "ping":
            pass
        return m

    def landed(self, n: int) -> list[int]:
        """The chunks of the next ``n`` landing notices."""
        deadline = time.monotonic() + 10
        got = []
        while len(got) < n and time.monotonic() < deadline:
            got += self.agent.notifications()
        return sorted(json.loads(m)["chunk"] for _, m in got)

    def held(self, want: int | None = None) -> int:
        """Grants the source holds; with ``want``, once it holds that many (messages take a moment)."""
        deadline = time.monotonic() + 5
        while (n := self.src.stats().held_grants) != want and want is not None:
            assert time.monotonic() < deadline, f"source holds {n} grants, not {want}"
            time.sleep(0.01)
        return n

    def close(self) -> None:
        self.src.close()
        self.server.close()
        self.agent.close()
