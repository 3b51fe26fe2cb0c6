"""The native pinger (``protocol.beat``): pings that a busy process's GIL cannot hold off,
never inside another frame, and a busy peer that is waited for, not failed."""

import json
import socket
import struct
import threading
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol import beat
from kvstage.protocol.destination import Destination
from kvstage.protocol.wire import Connection
from kvstage.staging.cache import RankCache

from support.procs import CTX  # forked from a warm server, as spawned children were


def test_the_pinger_is_built():
    """The install compiles it; a failed build must not pass as green (pings would come from the loop)."""
    assert beat.available(), beat.why_unavailable()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def _frames(sock: socket.socket, until: float) -> list[dict]:
    """Every frame read from ``sock`` until the deadline, parsed (a torn frame fails to parse)."""
    buf, out = bytearray(), []
    sock.settimeout(0.2)
    while time.monotonic() < until:
        try:
            part = sock.recv(1 << 20)
        except socket.timeout:
            continue
        if not part:
            break
        buf += part
        while len(buf) >= 4:
            (n,) = struct.unpack_from("!I", buf)
            if len(buf) < 4 + n:
                break
            out.append(json.loads(bytes(buf[4:4 + n])))
            del buf[:4 + n]
    return out


def test_pings_never_land_inside_another_frame_and_say_the_loops_age():
    a, b = _tcp_pair()
    conn = Connection(a, "test")
    clock = beat.LoopClock()
    clock.turned(time.monotonic() - 7.0)  # the loop last turned 7 s ago
    clock.watch(a.fileno())
    conn.native = True
    big = "x" * 300_000  # frames much larger than a socket buffer: a ping mid-frame would tear them

    def sender():
        for i in range(40):
            conn.send({"type": "data", "i": i, "pad": big})
            time.sleep(0.05)

    t = threading.Thread(target=sender)
    t.start()
    try:
        frames = _frames(b, time.monotonic() + 4.0)
    finally:
        t.join()
        conn.close()
        b.close()
    data = [f["i"] for f in frames if f["type"] == "data"]
    pings = [f for f in frames if f["type"] == "ping"]
    assert data == list(range(40))
    assert pings and all(6.5 < p["loop_s"] < 12.0 for p in pings), pings


def test_a_closed_connection_is_pinged_no_more():
    a, b = _tcp_pair()
    conn = Connection(a, "test")
    clock = beat.LoopClock()
    clock.turned(time.monotonic())
    before = beat.watched()
    clock.watch(a.fileno())
    conn.native = True
    assert beat.watched() == before + 1
    conn.close()
    assert beat.watched() == before
    b.close()


def test_a_source_whose_gil_is_held_for_longer_than_every_timeout_is_waited_for(caplog):
    """The source's process holds its GIL for 8 s mid-transfer (its loop cannot run), past the
    destination's 3 s stall and silence timeouts, while the destination waits for chunks only that
    loop can gather (a read request larger than the source's arena). Its native pings go on, saying
    its loop does not turn: the destination reports the request slow and waits; it completes byte-exact."""
    big = 20_000
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, pages_needed(big, 4) + 8),
                      Settings(**(fr.SETTINGS | {"stall_timeout_s": 3.0, "peer_timeout_s": 3.0})))
    q = CTX.Queue()
    p = CTX.Process(target=fr.send_holding_the_gil, args=(dst.address, big, 9, 8, q))
    try:
        pages = np.random.default_rng(9).permutation(dst.cache.pages)[: pages_needed(big, 4)]
        h = dst.expect("r9", pages, big)
        p.start()
        kind, hold, t0 = q.get(timeout=120)
        assert (kind, hold) == ("holding", 8)
        h.wait(120)
        took = time.monotonic() - t0
        print(f"\nsource held its GIL for 8 s: the request completed {took:.1f} s after the hold began")
        assert took >= 8.0  # it needed the busy source's loop, waited past every timeout, and did not fail
        assert fr.check(dst.cache, 9, pages, big) == []
        kind, _, detail = q.get(timeout=60)
        assert (kind, detail) == ("done", "read"), detail
        assert any("request r9 is slow" in r.getMessage() and "alive, busy: its loop does not turn" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        fr.until(lambda: fr.free(dst.stats()), 5)
    finally:
        p.join(30)
        dst.close()


SILENT = {"peer_timeout_s": 2.0, "stall_timeout_s": 2.0}


def _stopped_source(dst: Destination, path: str, reqs: list) -> fr.Rank:
    """Source rank 0 (TP 1) in its own process: connected, ``reqs`` sent, then stopped (SIGSTOP) by itself."""
    src = fr.Rank(fr.source_rank, 1, 0, pages_needed(2000, 16) + 8, fr.SETTINGS | {"path": path})
    assert src.call("connect", [dst.address]) == [0]
    fr.until(lambda: dst.connected(), 30)
    src.post("send", reqs, "stop")
    assert set(src.recv(60, "send").values()) == {path}
    src.wait_stopped()
    return src


@pytest.mark.parametrize("path", ["read", "pages"])
def test_a_silent_source_that_owes_nothing_fails_nothing(path):
    """A stopped source sends no ping; past ``peer_timeout_s`` of its silence a request it made readable whole
    (every chunk gathered, or its pages) still completes: it owes the destination nothing more."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 128), Settings(**(fr.SETTINGS | SILENT)))
    src = None
    try:
        src = _stopped_source(dst, path, [("fits", 100, 4)])  # 4 chunks of 32 tokens: the source's 4 slots
        time.sleep(3.0)  # silent past peer_timeout_s
        assert src.state() == "T"
        pages = np.arange(pages_needed(100, 4))
        dst.expect("fits", pages, 100).wait(30)
        assert fr.check(dst.cache, 4, pages, 100) == []
        src.resume()
        assert src.call("wait", 30) == {"fits": ("done", None)}
    finally:
        if src is not None:
            src.close()
        dst.close()


def test_a_silent_source_that_still_owes_chunks_fails_after_peer_timeout():
    """A stopped source whose read request still has chunks to gather (larger than its arena) owes them: past
    ``peer_timeout_s`` of its silence the request fails, naming the source, and nothing is held."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 512), Settings(**(fr.SETTINGS | SILENT)))
    src = None
    try:
        src = _stopped_source(dst, "read", [("owes", 1000, 5)])  # 32 chunks through 4 slots
        t_stop = time.monotonic()
        h = dst.expect("owes", np.arange(pages_needed(1000, 4)), 1000)
        with pytest.raises(TransferFailed) as err:
            h.wait(30)
        took = time.monotonic() - t_stop
        print(f"\na silent source that owes chunks: failed {took:.1f} s after it stopped: {err.value}")
        assert err.value.peer == "source rank 0" and "no control message for" in err.value.cause, err.value
        # its last ping came at most a ping interval before it stopped; 5 s of slack for a loaded host
        assert 2.0 - 1.0 <= took < 2.0 + 5.0
        fr.until(lambda: fr.free(dst.stats()), 5)
        src.resume()
        got = src.call("wait", 30)
        assert got["owes"][0] == "failed" and "destination aborted" in got["owes"][1], got
    finally:
        if src is not None:
            src.close()
        dst.close()
