"""The request protocol against hostile and broken peers (real sockets, real NIXL)."""

import json
import socket
import struct
import time

import numpy as np
import pytest

from support import fault_ranks as fr

from support.fake_peers import FakeDestination
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.destination import Destination
from kvstage.protocol.handshake import spec_to_wire
from kvstage.protocol.source import Source
from kvstage.protocol.wire import PROTOCOL_VERSION
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

GEO = KVGeometry(2, 4, 16, "bfloat16")
SRC = SideSpec(GEO, 2, PageLayout(4))
DST = SideSpec(GEO, 1, PageLayout(4))


@pytest.fixture
def dst():
    d = Destination(RankCache.allocate(DST, 0, 32), Settings(arena_mb=0.25, auth_token="s3cret"))
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
    msg = {"type": "hello", "version": PROTOCOL_VERSION, "token": "s3cret", "engine": "", "spec": spec_to_wire(SRC), "rank": 0,
           "agent": "x", "metadata": "", "slot_bytes": 1 << 16}
    msg.update(over)
    return msg


@pytest.mark.parametrize("msg,needle", [
    (hello(token="wrong"), "auth token"),
    (hello(version=99), "version 99"),
    (hello(rank=7), "rank=7 is above 1"),
    (hello(spec=spec_to_wire(SideSpec(KVGeometry(2, 4, 16, "float16"), 2, PageLayout(4)))), "dtype differs"),
    (hello(spec={**spec_to_wire(SRC), "tp": 3}), "tp=3"),
    (hello(slot_bytes=10), "slot too small"),
    (hello(rank="zero"), "rank"),
])
def test_hostile_hello_is_refused_with_a_clear_error(dst, msg, needle):
    reply = raw(dst.address, frame(msg))
    assert reply is not None and reply["type"] == "error"
    assert needle in reply["reason"]


@pytest.mark.parametrize("msg", [{"type": "ready", "req": "a", "tokens": 4}, {"type": "nonsense"}, {"type": "ping"}])
def test_anything_but_a_hello_or_probe_first_closes_the_connection_unanswered(dst, msg):
    assert raw(dst.address, frame(msg)) is None  # closed: no reply, nothing held


@pytest.mark.parametrize("payload", [b"\x00\x00", frame(b"not json"), struct.pack("!I", 1 << 30), frame(b"[1,2]")])
def test_garbage_closes_only_that_connection(dst, payload):
    raw(dst.address, payload)
    # the destination still serves a real source afterwards
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, auth_token="s3cret"))
    try:
        assert src.connect([dst.address]) == [0]
    finally:
        src.close()


def test_source_without_token_is_refused(dst):
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, auth_token=""))
    try:
        with pytest.raises(TransferFailed, match="auth token"):
            src.connect([dst.address])
    finally:
        src.close()


def test_a_source_serving_another_model_is_refused_by_name(caplog):
    """Two engines of the same shapes but other weights would exchange KV silently and decode wrong
    tokens: the hello carries the model identity the engine gives, and a mismatch is refused, naming
    both, with one line on each side. Where one side gives none, nothing is compared."""
    settings = Settings(arena_mb=0.25, auth_token="s3cret")
    d = Destination(RankCache.allocate(DST, 0, 32), settings, model="llama-a#1f2e")
    other = Source(RankCache.allocate(SRC, 0, 32), settings, model="llama-b#1f2e")
    same = Source(RankCache.allocate(SRC, 1, 32), settings, model="llama-a#1f2e")
    unnamed = Source(RankCache.allocate(SRC, 0, 32), settings, engine="x")
    try:
        with caplog.at_level("WARNING", logger="kvstage"):
            with pytest.raises(TransferFailed, match="model: the source serves 'llama-b#1f2e', this side 'llama-a#1f2e'"):
                other.connect([d.address])
        lines = [r.getMessage() for r in caplog.records if "llama-b#1f2e" in r.getMessage()]
        assert len(lines) == 2 and any(m.startswith("dst 0: refused") for m in lines) and \
            any(m.startswith("src 0: destination") for m in lines), lines
        assert same.connect([d.address]) == [0] and unnamed.connect([d.address]) == [0]
    finally:
        for ep in (other, same, unnamed, d):
            ep.close()


@pytest.mark.parametrize("early", [False, True])
def test_token_count_mismatch_fails_both_sides(early):
    """Early grants carry the destination's token count: the source refuses
    them at ``send``. Announced before the destination expects the request (no
    early grant yet), the destination refuses the announcement."""
    dst = Destination(RankCache.allocate(DST, 0, 32), Settings(arena_mb=0.25, auth_token="s3cret"))
    cache0 = RankCache.allocate(SRC, 0, 32)
    cache1 = RankCache.allocate(SRC, 1, 32)
    s0 = Source(cache0, Settings(arena_mb=0.25, auth_token="s3cret"))
    s1 = Source(cache1, Settings(arena_mb=0.25, auth_token="s3cret"))
    try:
        s0.connect([dst.address])
        s1.connect([dst.address])
        if early:
            h = dst.expect("r", np.arange(3), 10)
            time.sleep(0.2)  # let the early grant reach both sources first
        a = s0.send("r", np.arange(4), 13)
        s1.send("r", np.arange(4), 13)
        if not early:
            fr.until(lambda: dst.stats().unknown_announced == 1)
            h = dst.expect("r", np.arange(3), 10)
        with pytest.raises(TransferFailed, match="13 tokens, destination expects 10"):  # either side's words
            h.wait(10)
        with pytest.raises(TransferFailed, match="destination aborted" if not early else
                           "destination expects 10 tokens, this source sends 13"):
            a.wait(10)
        deadline = time.monotonic() + 5
        while (left := [(lambda st: (st.slots_free, st.requests, st.held_grants))(s.stats()) for s in (s0, s1)] + [dst.slots_free()]) != [(4, 0, 0), (4, 0, 0), 4]:
            assert time.monotonic() < deadline, f"left behind (free slots, requests, held grants): {left}"
            time.sleep(0.01)  # the abort reaches the other source, which confirms it; then the slots come back
    finally:
        s0.close()
        s1.close()
        dst.close()


def test_source_killed_mid_request_fails_destination_and_frees_slots(dst):
    s0 = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, auth_token="s3cret"))
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
    (4, [40], r"\[0, 32\); got 40\.\.40"),
    (8, [-1, 3], r"\[0, 32\); got -1\.\.3"),
    (8, [1, 1], "appears twice"),
    (12, [5, 2, 5], "appears twice"),
])
def test_bad_request_arguments_are_refused_before_anything_moves(dst, tokens, pages, needle):
    with pytest.raises(ValueError, match=needle):
        dst.expect("bad", pages, tokens)


def test_a_request_keeps_its_own_copy_of_the_page_list(dst):
    """Engines reuse their block-table arrays: a list changed after ``send`` or ``expect``
    returns must not change where the request's chunks are read or written later."""
    from kvstage.protocol.endpoint import check_pages

    ids = np.array([7, 3, 9], dtype=np.int64)
    kept = check_pages(dst.cache, ids, 10)
    ids[:] = [1, 2, 4]
    assert kept.tolist() == [7, 3, 9]


def test_each_side_logs_one_link_line_per_peer_and_no_warning(dst, caplog):
    caplog.set_level("DEBUG", logger="kvstage")
    src = Source(RankCache.allocate(SRC, 0, 32), Settings(arena_mb=0.25, auth_token="s3cret"))
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


@pytest.fixture
def fake_dst():
    f = FakeDestination(SRC)
    yield f
    f.close()


PIECE_BYTES = 2 * 2 * 2 * 16 * 2 * 10  # a source rank's bytes of 10 tokens: buffers x heads x head_dim x 2 B x tokens
GOOD = {"type": "grant", "req": "r", "tokens": 10, "chunk": 0, "chunks": 1, "start": 0, "count": 10, "offset": 0}


def test_hostile_grants_are_refused_and_the_source_keeps_serving(fake_dst):
    """A fake destination sends bad grants to a real Source."""
    f, good = fake_dst, GOOD
    h = f.src.send("r", np.arange(3), 10)
    assert f.recv() == {"type": "ready", "req": "r", "tokens": 10}
    for bad, needle in [
        (good | {"chunks": 0}, "chunks=0 is below 1"),
        (good | {"chunk": 1}, "chunk=1 is above 0"),
        (good | {"count": 11}, "count=11 is above 10"),
        (good | {"chunks": 11}, "chunks=11 is above 10"),
        ({k: v for k, v in good.items() if k != "tokens"}, "lacks field 'tokens'"),
        (good | {"offset": (1 << 16) - PIECE_BYTES + 1}, "exceed the destination arena"),
        (good | {"offset": -1}, "offset=-1 is below 0"),
        (good | {"start": "0"}, "is not int"),
        (good | {"ticket": "not base64!"}, "ticket is not base64"),
        (good | {"req": "zzz", "count": 0}, "count=0 is below 1"),  # checked before it is held
    ]:
        f.conn.send(bad)
        reply = f.recv()
        assert reply["type"] == "error" and needle in reply["reason"], (bad, reply)
    assert not h.done() and f.held() == 0  # refused grants change nothing
    first = good | {"chunks": 2, "count": 5, "offset": 0}
    f.conn.send(first)
    f.conn.send(first)  # the same chunk twice while the request is in flight
    reply = f.recv()
    assert reply["type"] == "error" and "granted twice" in reply["reason"], reply
    f.conn.send(first | {"chunk": 1, "start": 5, "offset": PIECE_BYTES // 2})
    assert f.landed(2) == [0, 1]
    h.wait(10)
    assert bool((f.arena[:PIECE_BYTES] == 7).all()) and not f.arena[PIECE_BYTES:].any()  # exactly the granted bytes
    f.conn.send(good)  # a grant again, after the request finished
    assert "grant for request 'r', which already done here" in f.recv()["reason"]
    assert f.held() == 0


def test_a_grant_naming_other_tokens_fails_the_request(fake_dst):
    f = fake_dst
    h = f.src.send("r", np.arange(3), 10)
    f.recv()  # ready
    f.conn.send(GOOD | {"tokens": 12, "chunks": 2, "count": 6})
    with pytest.raises(TransferFailed, match="destination expects 12 tokens, this source sends 10"):
        h.wait(10)
    m = f.recv()
    assert m["type"] == "abort" and "expects 12 tokens" in m["reason"], m
    assert f.recv() == {"type": "abort_ack", "req": "r"}  # nothing of it in flight


def test_early_grants_are_held_until_the_request_is_sent(fake_dst):
    """Grants that come before ``send`` are checked, kept, and written the moment
    the request is sent, with no further message from the destination."""
    f = fake_dst
    first = GOOD | {"req": "e", "chunks": 2, "count": 5}
    f.conn.send(first)
    f.conn.send(first)
    assert "chunk 0 of 'e' granted twice" in f.recv()["reason"]
    f.conn.send(first | {"chunk": 1, "chunks": 3})
    assert "grant says 3 chunks of 10 tokens for 'e'; an earlier grant said 2 of 10" in f.recv()["reason"]
    f.conn.send(first | {"chunk": 1, "start": 5, "offset": PIECE_BYTES // 2})
    assert f.held(2) == 2
    h = f.src.send("e", np.arange(3), 10)
    assert f.recv() == {"type": "ready", "req": "e", "tokens": 10}
    assert f.landed(2) == [0, 1]
    h.wait(10)
    assert bool((f.arena[:PIECE_BYTES] == 7).all()) and not f.arena[PIECE_BYTES:].any()
    assert f.held() == 0 and h.path == "staged"


def test_the_start_stage_runs_from_send_to_the_first_copy(fake_dst):
    """A source's ``start`` stage covers ``send`` up to its first copy, so a request
    whose first grant is late says so: here the grant comes 0.3 s after ``send``."""
    f = fake_dst
    h = f.src.send("s", np.arange(3), 10)
    assert f.recv() == {"type": "ready", "req": "s", "tokens": 10}
    time.sleep(0.3)
    f.conn.send(GOOD | {"req": "s"})
    assert f.landed(1) == [0]
    h.wait(10)
    assert 0.3 <= h.stages["start"] < h.seconds
    assert h.stages["gather"] < h.seconds - 0.3  # the wait is the start's, not the gather's


@pytest.mark.parametrize("arena_mb", [0.25, 4096 / 2**20])  # four slots; one slot of one page
def test_slot_wait_counts_only_a_full_arena_and_queued_the_chunks_ahead(arena_mb):
    """Two chunks granted before ``send`` are queued together. With four slots the
    second waits only behind the first (``queued``) and ``slot_wait`` stays zero;
    with one slot it also waits for the first's write to free the slot."""
    f = FakeDestination(SRC, arena_mb=arena_mb)
    try:
        first = GOOD | {"req": "w", "chunks": 2, "count": 5}
        f.conn.send(first)
        f.conn.send(first | {"chunk": 1, "start": 5, "offset": PIECE_BYTES // 2})
        assert f.held(2) == 2
        h = f.src.send("w", np.arange(3), 10)
        assert f.landed(2) == [0, 1]
        h.wait(10)
        assert h.stages["queued"] > 0
        if arena_mb == 0.25:
            assert h.stages["slot_wait"] == 0.0
        else:
            assert h.stages["slot_wait"] > 0
        assert bool((f.arena[:PIECE_BYTES] == 7).all())
    finally:
        f.close()


def test_held_grants_end_with_an_abort_or_a_disconnect_and_are_bounded(monkeypatch):
    """An abort voids a held grant and is acknowledged at once (nothing of the
    request can land); a destination that goes away takes its grants along;
    at most ``MAX_HELD`` are kept. (They never expire on their own: the
    destination's ``ready_timeout_s`` ends the request with an abort.)"""
    import kvstage.protocol.source as source

    f = FakeDestination(SRC)
    try:
        f.conn.send(GOOD | {"req": "x"})
        f.conn.send({"type": "abort", "req": "x", "reason": "decode gave up"})
        assert f.recv() == {"type": "abort_ack", "req": "x"}
        assert f.held() == 0
        with pytest.raises(TransferFailed, match="destination aborted: decode gave up"):
            f.src.send("x", np.arange(3), 10).wait(1)
        assert f.recv() == {"type": "abort", "req": "x", "reason": "destination aborted: decode gave up"}
        assert f.recv() == {"type": "abort_ack", "req": "x"}

        monkeypatch.setattr(source, "MAX_HELD", 2)
        for i in range(2):
            f.conn.send(GOOD | {"req": f"h{i}"})
        f.held(2)
        f.conn.send(GOOD | {"req": "h2"})
        assert "more than 2 grants held" in f.recv()["reason"]
        assert f.held() == 2
        f.conn.close()  # the destination goes away
        assert f.held(0) == 0
    finally:
        f.close()


def test_feed_frames_messages_however_the_bytes_arrive():
    """The loop reads a readable socket once per turn: a frame may arrive split
    across reads, several in one read, and a malformed one after whole ones
    (those are handled first, then the error names the broken frame)."""
    from kvstage.errors import ProtocolError
    from kvstage.protocol.wire import Connection

    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname()[:2])
        b, _ = server.accept()
    conn = Connection(b, "test")
    b.settimeout(5)  # a read that waits for bytes never sent fails the test instead of hanging it

    def frame(obj) -> bytes:
        data = json.dumps(obj).encode()
        return struct.pack("!I", len(data)) + data

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
