"""The handshake and the wire against hostile and broken peers (real sockets, real NIXL):
every refusal names its field, and a refused peer takes nothing with it."""

import json
import socket
import struct

import numpy as np
import pytest

from support import fault_ranks as fr
from support.fake_peers import TOKEN, FakeSource, OneWelcome, welcome_of
from kvstage.config import Settings
from kvstage.errors import ProtocolError, TransferFailed
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.destination import Destination
from kvstage.protocol.handshake import spec_to_wire
from kvstage.protocol.messages import PROTOCOL_VERSION
from kvstage.protocol.source import Source
from kvstage.protocol.wire import Connection
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

GEO = KVGeometry(2, 4, 16, "bfloat16")
SRC = SideSpec(GEO, 2, PageLayout(4))
DST = SideSpec(GEO, 1, PageLayout(4))
SETTINGS = dict(arena_mb=0.25, auth_token=TOKEN)


@pytest.fixture
def dst():
    d = Destination(RankCache.allocate(DST, 0, 32), Settings(**SETTINGS))
    yield d
    d.close()


def raw(addr, payload: bytes) -> dict | None:
    """Send ``payload`` on a new connection: the one reply, or None when the peer closed it unanswered."""
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(payload)
        try:
            head = s.recv(4, socket.MSG_WAITALL)
            return json.loads(s.recv(struct.unpack("!I", head)[0], socket.MSG_WAITALL))
        except (struct.error, OSError, ValueError):
            return None


def frame(msg) -> bytes:
    data = json.dumps(msg).encode() if not isinstance(msg, bytes) else msg
    return struct.pack("!I", len(data)) + data


def hello(**over):
    msg = {"type": "hello", "version": PROTOCOL_VERSION, "token": TOKEN, "engine": "", "model": "", "uid": 0,
           "spec": spec_to_wire(SRC), "rank": 0, "agent": "x", "transport": "nixl", "metadata": "", "slot_bytes": 1 << 16,
           "facts": {}, "kv_facts": {}, "paths": ["read"], "nonce": "n"}
    msg.update(over)
    return {k: v for k, v in msg.items() if v is not None}


@pytest.mark.parametrize("msg,needle", [
    (hello(token="wrong"), "authentication failed"),
    (hello(version=99), f"version: the peer speaks protocol version 99, this side {PROTOCOL_VERSION}"),
    (hello(rank=7), "hello: rank=7 is past the source's tp=2"),
    (hello(spec=spec_to_wire(SideSpec(KVGeometry(2, 4, 16, "float16"), 2, PageLayout(4)))), "dtype differs"),
    (hello(spec={**spec_to_wire(SRC), "layers": 3}), "layers differs: source layers=3, destination layers=2"),
    (hello(spec={**spec_to_wire(SRC), "tp": 3}), "tp=3 with kv_heads=4"),
    (hello(transport="ucx"), "transport: the source uses 'ucx', the destination 'nixl'"),
    (hello(rank="zero"), "hello field rank='zero': must be int"),
    (hello(nonce=None), "hello message lacks field 'nonce'"),
    (hello(metadata="%%"), "hello field metadata='%%': not base64"),
    (hello(engine="a\nb"), "hello field engine="),
    (hello(paths="read"), "hello field paths='read': must be list"),
    (hello(metadata="bm90IG5peGw="), "NIXL rejected a peer's metadata"),
])
def test_hostile_hello_is_refused_with_a_clear_error(dst, msg, needle):
    reply = raw(dst.address, frame(msg))
    assert reply is not None and reply["type"] == "error" and reply["about"] == "hello", reply
    assert needle in reply["reason"], reply


def test_a_hello_of_the_last_version_is_refused_by_its_version():
    """A version-8 source sends the hello of its day (no nonce, no paths): it hears the version, not the
    first field this version added."""
    d = Destination(RankCache.allocate(DST, 0, 32), Settings(**SETTINGS))
    try:
        v8 = {"type": "hello", "version": 8, "token": TOKEN, "engine": "", "model": "", "uid": 0, "kv_ipc": False,
              "spec": spec_to_wire(SRC), "rank": 0, "agent": "x", "transport": "nixl", "metadata": "",
              "slot_bytes": 1 << 16, "facts": {}, "kv_facts": {}}
        reply = raw(d.address, frame(v8))
        want = f"version: the peer speaks protocol version 8, this side {PROTOCOL_VERSION}"
        assert reply["type"] == "error" and want in reply["reason"]
    finally:
        d.close()


@pytest.mark.parametrize("msg", [{"type": "ready", "req": "a", "tokens": 4, "path": "read"}, {"type": "nonsense"},
                                 {"type": "ping"}, {"type": "offer", "arena": {}, "kv": []}])
def test_anything_but_a_hello_or_probe_first_closes_the_connection_unanswered(dst, msg):
    assert raw(dst.address, frame(msg)) is None  # closed: no reply, nothing held


@pytest.mark.parametrize("payload", [b"\x00\x00", frame(b"not json"), struct.pack("!I", 1 << 30), frame(b"[1,2]")])
def test_garbage_closes_only_that_connection(dst, payload):
    raw(dst.address, payload)
    # the destination still serves a real source afterwards
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(**SETTINGS))
    try:
        assert src.connect([dst.address]) == [0]
    finally:
        src.close()


def test_source_without_token_is_refused(dst):
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, auth_token=""))
    try:
        with pytest.raises(TransferFailed, match="authentication failed"):
            src.connect([dst.address])
        assert dst.stats().peers == 0
    finally:
        src.close()


def test_a_destination_of_another_version_is_refused_by_name():
    """The source checks the welcome's version first, and offers nothing to a destination of another."""
    w = OneWelcome(lambda hello: welcome_of(DST, hello, version=PROTOCOL_VERSION + 1))
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(**SETTINGS))
    try:
        with pytest.raises(TransferFailed, match=f"version: the peer speaks protocol version {PROTOCOL_VERSION + 1}, "
                                                 f"this side {PROTOCOL_VERSION}"):
            src.connect([w.address])
        assert w.closed() and w.after == [] and src.stats().peers == 0
    finally:
        src.close()
        w.close()


def test_a_source_serving_another_model_is_refused_by_name(caplog):
    """Two engines of the same shapes but other weights would exchange KV silently and decode wrong
    tokens: the hello carries the model identity the engine gives, and a mismatch is refused, naming
    both, with one line on each side. Where one side gives none, nothing is compared."""
    settings = Settings(**SETTINGS)
    d = Destination(RankCache.allocate(DST, 0, 32), settings, model="llama-a#1f2e")
    other = Source(RankCache.allocate(SRC, 0, 32), settings, model="llama-b#1f2e")
    same = Source(RankCache.allocate(SRC, 1, 32), settings, model="llama-a#1f2e")
    unnamed = Source(RankCache.allocate(SRC, 0, 32), settings, engine="x")
    try:
        with caplog.at_level("WARNING", logger="kvstage"):
            with pytest.raises(TransferFailed, match="model: the source serves 'llama-b#1f2e', the destination 'llama-a#1f2e'"):
                other.connect([d.address])
            def lines():
                return [r.getMessage() for r in caplog.records if "llama-b#1f2e" in r.getMessage()]

            fr.until(lambda: len(lines()) >= 2, 5)  # the destination logs once its answer is out
        lines = lines()
        assert len(lines) == 2 and any(m.startswith("dst 0: refused") for m in lines) and \
            any(m.startswith("destination ") for m in lines), lines
        assert same.connect([d.address]) == [0] and unnamed.connect([d.address]) == [0]
    finally:
        for ep in (other, same, unnamed, d):
            ep.close()


def test_a_source_closed_mid_request_fails_the_destination_and_frees_slots(dst):
    """Source rank 0 of two says ready and closes before rank 1 ever comes: the destination fails the
    request at once, naming the rank and why, and holds nothing of it."""
    s0 = Source(RankCache.allocate(SRC, 0, 32), Settings(**SETTINGS))
    s0.connect([dst.address])
    h = dst.expect("r", np.arange(3), 10)
    s0.send("r", np.arange(3), 10)
    s0.close()
    with pytest.raises(TransferFailed) as err:
        h.wait(10)
    assert (err.value.peer, err.value.stage, err.value.cause) == ("source rank 0", "abort", "source aborted: source "
                                                                                         "closed"), str(err.value)
    assert dst.slots_free() == 4 and dst.stats().requests == 0


@pytest.mark.parametrize("tokens,pages,needle", [
    (0, [0], "tokens=0"),
    (9, [0, 1], "page size 4 need 3"),
    (4, [40], r"\[0, 32\); got 40\.\.40"),
    (8, [-1, 3], r"\[0, 32\); got -1\.\.3"),
    (8, [1, 1], "appears twice"),
    (12, [5, 2, 5], "appears twice"),
])
def test_bad_request_arguments_are_refused_before_anything_moves(dst, tokens, pages, needle):
    with pytest.raises(ValueError, match=needle):
        dst.expect("bad", pages, tokens)
    assert dst.stats().requests == 0


@pytest.mark.parametrize("kw,needle", [
    (dict(req=""), "req='': must be a non-empty printable string"),
    (dict(req="a\nb"), "must be a non-empty printable string"),
    (dict(req="x" * 257), "of at most 256 characters"),
    (dict(engine=7), "engine='7': must be a string"),
    (dict(first=-1), "first=-1: must be a non-negative integer"),
    (dict(first=True), "first=True: must be a non-negative integer"),
])
def test_bad_names_are_refused_where_they_are_given(dst, kw, needle):
    args = dict(req="r", page_ids=[0, 1], tokens=8) | kw
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("*", r"\*")):
        dst.expect(**args)


def test_a_request_keeps_its_own_copy_of_the_page_list(dst):
    """Engines reuse their block-table arrays: a list changed after ``send`` or ``expect``
    returns must not change where the request's chunks are read or written later."""
    from kvstage.protocol.common import check_pages

    ids = np.array([7, 3, 9], dtype=np.int64)
    kept = check_pages(dst.cache, ids, 10)
    ids[:] = [1, 2, 4]
    assert kept.tolist() == [7, 3, 9]


def test_each_side_logs_one_link_line_per_peer_and_memory_and_no_warning(dst, caplog):
    """The source judges the arenas' link; the destination the arenas' and, where a page path may read
    the source's KV buffers, theirs too: each once, at INFO on one healthy host."""
    caplog.set_level("DEBUG", logger="kvstage")
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(**SETTINGS))
    try:
        src.connect([dst.address])
        dst.slots_free()  # let the destination's loop finish the handshake
    finally:
        src.close()
    links = [r.getMessage() for r in caplog.records if "kvstage link to" in r.getMessage()]
    assert sum("link to destination rank 0" in m for m in links) == 1, links
    assert sum("link to source rank 0" in m for m in links) == 2, links  # its arena, its KV pages
    assert sum("KV pages: " in m for m in links) == 1, links
    assert {r.levelname for r in caplog.records if "kvstage link to" in r.getMessage()} == {"INFO"}
    assert all("shared memory" in m for m in links), links
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records if r.levelno >= 30]


def test_malformed_peer_facts_do_not_break_the_handshake(dst):
    """Facts are the peer's own account, for the link's judgement: unreadable ones are not assessed,
    and the source is admitted, offered and opened all the same."""
    fake = FakeSource(dst.address, spec=SRC, engine="", facts={"host": 5, "env": [1, 2]})
    try:
        assert fake.opened["type"] == "opened" and dst.connected() is False  # rank 1 is not connected
        assert dst.stats().peers == 1
    finally:
        fake.close()


def test_feed_frames_messages_however_the_bytes_arrive():
    """The loop reads a readable socket once per turn: a frame may arrive split
    across reads, several in one read, and a malformed one after whole ones
    (those are handled first, then the error names the broken frame)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname()[:2])
        b, _ = server.accept()
    conn = Connection(b, "test")
    b.settimeout(5)  # a read that waits for bytes never sent fails the test instead of hanging it

    def until(n: int, got=None) -> list:  # reads as the loop does, until n messages (TCP may split a send)
        got = [] if got is None else got
        for _ in range(50):
            got.extend(conn.feed())
            if len(got) >= n:
                break
        return got

    one, two = frame({"type": "ready", "req": "r", "tokens": 3}), frame({"type": "ping"})
    a.sendall(one[:3])
    assert list(conn.feed()) == []
    a.sendall(one[3:] + two + frame({"type": "done", "req": "r"})[:6])
    assert until(2) == [{"type": "ready", "req": "r", "tokens": 3}, {"type": "ping"}]
    a.sendall(frame({"type": "done", "req": "r"})[6:] + frame({"type": "x"}) + frame([1, 2]))
    got = []
    with pytest.raises(ProtocolError, match="frame is not a JSON object"):
        until(3, got)
    assert got == [{"type": "done", "req": "r"}, {"type": "x"}]
    a.sendall(struct.pack("!I", (16 << 20) + 1))
    with pytest.raises(ProtocolError, match="exceeds the 16777216-byte limit"):
        list(conn.feed())
    a.close()
    with pytest.raises(ConnectionError, match="peer closed"):
        list(conn.feed())
    conn.close()
