"""The request protocol against hostile and broken peers (real sockets, real NIXL)."""

import json
import socket
import struct

import numpy as np
import pytest

from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.destination import Destination
from kvstage.protocol.endpoint import spec_to_wire
from kvstage.protocol.source import Source
from kvstage.protocol.wire import PROTOCOL_VERSION
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

GEO = KVGeometry(2, 4, 16, "bfloat16")
SRC = SideSpec(GEO, 2, PageLayout(4))
DST = SideSpec(GEO, 1, PageLayout(4))


@pytest.fixture
def dst():
    d = Destination(RankCache.allocate(DST, 0, 32), Settings(arena_mb=0.25, slot_mb=0.0625, auth_token="s3cret"))
    yield d
    d.close()


def raw(addr, payload: bytes) -> dict | None:
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(payload)
        try:
            n = struct.unpack("!I", s.recv(4))[0]
            return json.loads(s.recv(n))
        except (struct.error, OSError, ValueError):
            return None


def frame(msg) -> bytes:
    data = json.dumps(msg).encode() if not isinstance(msg, bytes) else msg
    return struct.pack("!I", len(data)) + data


def hello(**over):
    msg = {"type": "hello", "version": PROTOCOL_VERSION, "token": "s3cret", "spec": spec_to_wire(SRC), "rank": 0,
           "agent": "x", "metadata": "", "slot_bytes": 1 << 16}
    msg.update(over)
    return msg


@pytest.mark.parametrize("msg,needle", [
    (hello(token="wrong"), "auth token"),
    (hello(version=99), "version 99"),
    (hello(rank=7), "rank=7 is above 1"),
    (hello(spec=spec_to_wire(SideSpec(KVGeometry(2, 4, 16, "float16"), 2, PageLayout(4)))), "dtype differs"),
    (hello(spec=spec_to_wire(SideSpec(GEO, 3, PageLayout(4)))), "tp=3"),
    (hello(slot_bytes=10), "slot too small"),
    ({"type": "ready", "req": "a", "tokens": 4}, "before a successful hello"),
    ({"type": "nonsense"}, "before a successful hello"),
    (hello(rank="zero"), "rank"),
])
def test_hostile_hello_is_refused_with_a_clear_error(dst, msg, needle):
    reply = raw(dst.address, frame(msg))
    assert reply is not None and reply["type"] == "error"
    assert needle in reply["reason"]


@pytest.mark.parametrize("payload", [b"\x00\x00", frame(b"not json"), struct.pack("!I", 1 << 30), frame(b"[1,2]")])
def test_garbage_closes_only_that_connection(dst, payload):
    raw(dst.address, payload)
    # the destination still serves a real source afterwards
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, slot_mb=0.0625, auth_token="s3cret"))
    try:
        assert src.connect([dst.address]) == [0]
    finally:
        src.close()


def test_source_without_token_is_refused(dst):
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, slot_mb=0.0625, auth_token=""))
    try:
        with pytest.raises(TransferFailed, match="auth token"):
            src.connect([dst.address])
    finally:
        src.close()


def test_token_count_mismatch_fails_both_sides(dst):
    cache0 = RankCache.allocate(SRC, 0, 32)
    cache1 = RankCache.allocate(SRC, 1, 32)
    s0 = Source(cache0, Settings(arena_mb=0.25, slot_mb=0.0625, auth_token="s3cret"))
    s1 = Source(cache1, Settings(arena_mb=0.25, slot_mb=0.0625, auth_token="s3cret"))
    try:
        s0.connect([dst.address])
        s1.connect([dst.address])
        h = dst.expect("r", np.arange(3), 10)
        a = s0.send("r", np.arange(4), 13)
        s1.send("r", np.arange(4), 13)
        with pytest.raises(TransferFailed, match="announced 13 tokens, destination expects 10"):
            h.wait(10)
        with pytest.raises(TransferFailed, match="destination aborted"):
            a.wait(10)
        assert dst.slots_free() == 4
    finally:
        s0.close()
        s1.close()


def test_source_killed_mid_request_fails_destination_and_frees_slots(dst):
    s0 = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, slot_mb=0.0625, auth_token="s3cret"))
    s0.connect([dst.address])
    h = dst.expect("r", np.arange(3), 10)
    s0.send("r", np.arange(3), 10)
    s0.close()  # source rank 1 never comes, source rank 0 goes away
    with pytest.raises(TransferFailed, match="source rank 0"):
        h.wait(10)
    assert dst.slots_free() == 4


@pytest.mark.parametrize("tokens,pages,needle", [
    (0, [0], "tokens=0"),
    (9, [0, 1], "page size 4 need 3"),
    (4, [40], r"\[0, 32\)"),
    (8, [1, 1], "appears twice"),
])
def test_bad_request_arguments_are_refused_before_anything_moves(dst, tokens, pages, needle):
    with pytest.raises(ValueError, match=needle):
        dst.expect("bad", pages, tokens)


def test_each_side_logs_one_link_line_per_peer_and_no_warning(dst, caplog):
    caplog.set_level("DEBUG", logger="kvstage")
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, slot_mb=0.0625, auth_token="s3cret"))
    try:
        src.connect([dst.address])
        dst.slots_free()  # let the destination's loop finish the handshake
    finally:
        src.close()
    links = [r for r in caplog.records if "kvstage link to" in r.getMessage()]
    assert len(links) == 2, [r.getMessage() for r in links]  # one on each side
    assert {r.levelname for r in links} == {"INFO"}
    assert "shared memory" in links[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records if r.levelno >= 30]


def test_malformed_peer_facts_do_not_break_the_handshake(dst):
    reply = raw(dst.address, frame(hello(facts={"host": 5, "env": [1, 2]})))
    assert reply is not None and reply["type"] == "welcome", reply


def test_hostile_grants_are_refused_and_the_source_keeps_serving():
    """A fake destination (real NIXL agent, raw control socket) sends bad grants to a real Source."""
    import base64
    import threading
    import time

    import torch

    from kvstage.transports.nixl import NixlTransport

    dst_spec = SideSpec(GEO, 1, PageLayout(1))  # different paging: the staged path
    agent = NixlTransport("fake-dst")
    arena = torch.zeros(1 << 16, dtype=torch.uint8)
    region = agent.register(arena)
    server = socket.create_server(("127.0.0.1", 0))
    box = {}

    def serve():
        sock, _ = server.accept()
        from kvstage.protocol.wire import Connection

        c = Connection(sock, "fake")
        box["hello"] = c.recv()
        c.send({"type": "welcome", "version": PROTOCOL_VERSION, "spec": spec_to_wire(dst_spec), "rank": 0,
                "metadata": base64.b64encode(agent.metadata()).decode(), "arena": region.to_wire(), "kv": [], "facts": {}})
        box["conn"] = c

    t = threading.Thread(target=serve)
    t.start()
    # peer_timeout_s: the fake destination below does not ping like a real one
    src = Source(RankCache.allocate(SRC, 0, 32, fill=7), Settings(arena_mb=0.25, slot_mb=0.0625, peer_timeout_s=600))

    def recv(c):
        """The next message that is not the source's once-a-second ping."""
        while (m := c.recv())["type"] == "ping":
            pass
        return m

    try:
        src.connect([server.getsockname()])
        t.join(5)
        c = box["conn"]
        h = src.send("r", np.arange(3), 10)
        assert recv(c) == {"type": "ready", "req": "r", "tokens": 10}
        piece_bytes = 2 * 2 * 2 * 16 * 2 * 10  # buffers x heads x head_dim x 2 B x tokens
        good = {"type": "grant", "req": "r", "chunk": 0, "chunks": 1, "start": 0, "count": 10, "offset": 0}
        for bad, needle in [
            (good | {"req": "zzz"}, "not in flight"),
            (good | {"chunks": 0}, "chunks=0 is below 1"),
            (good | {"chunk": 1}, "chunk=1 is above 0"),
            (good | {"count": 11}, "count=11 is above 10"),
            (good | {"offset": (1 << 16) - piece_bytes + 1}, "exceed the destination arena"),
            (good | {"offset": -1}, "offset=-1 is below 0"),
            (good | {"start": "0"}, "is not int"),
            (good | {"ticket": "not base64!"}, "ticket is not base64"),
        ]:
            c.send(bad)
            reply = recv(c)
            assert reply["type"] == "error" and needle in reply["reason"], (bad, reply)
        assert not h.done()  # refused grants change nothing
        first = good | {"chunks": 2, "count": 5, "offset": 0}
        c.send(first)
        c.send(first)  # the same chunk twice while the request is in flight
        reply = recv(c)
        assert reply["type"] == "error" and "granted twice" in reply["reason"], reply
        c.send(first | {"chunk": 1, "start": 5, "offset": piece_bytes // 2})
        deadline = time.monotonic() + 10
        got = []
        while len(got) < 2 and time.monotonic() < deadline:
            got += agent.notifications()
        assert sorted(json.loads(m)["chunk"] for _, m in got) == [0, 1]
        h.wait(10)
        assert bool((arena[:piece_bytes] == 7).all()) and not arena[piece_bytes:].any()  # exactly the granted bytes
        c.send(good)  # a grant again, after the request finished
        assert "not in flight" in recv(c)["reason"]
    finally:
        src.close()
        server.close()
        agent.close()
