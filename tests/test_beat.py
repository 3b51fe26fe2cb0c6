"""The native pinger (``protocol.beat``): pings that a busy process's GIL cannot hold off,
never inside another frame, and a busy peer that is waited for, not failed."""

import json
import multiprocessing as mp
import socket
import struct
import threading
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.config import Settings
from kvstage.layout import pages_needed
from kvstage.protocol import beat
from kvstage.protocol.destination import Destination
from kvstage.protocol.wire import Connection
from kvstage.staging.cache import RankCache

CTX = mp.get_context("spawn")


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


def test_a_source_whose_gil_is_held_for_longer_than_every_timeout_is_waited_for():
    """The source's process holds its GIL for 8 s mid-transfer (its loop cannot run), past the
    destination's 3 s stall and silence timeouts. Its native pings go on, saying its loop does
    not turn: the destination reports the request slow and waits; it completes byte-exact."""
    big = 20_000
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, pages_needed(big, 4) + 8),
                      Settings(**(fr.SETTINGS | {"stall_timeout_s": 3.0, "peer_timeout_s": 3.0})))
    q = CTX.Queue()
    p = CTX.Process(target=fr.send_holding_the_gil, args=(dst.address, big, 9, 8, q))
    try:
        pages = np.random.default_rng(9).permutation(dst.cache.pages)[: pages_needed(big, 4)]
        h = dst.expect("r9", pages, big)
        p.start()
        assert q.get(timeout=120) == ("holding", 8)
        t0 = time.monotonic()
        h.wait(120)
        print(f"\nsource held its GIL for 8 s: the request completed {time.monotonic() - t0:.1f} s after the hold began")
        assert fr.check(dst.cache, 9, pages, big) == []
        kind, _, error = q.get(timeout=60)
        assert kind == "done", error
        assert dst.stats().slots_free == 4
    finally:
        p.join(30)
        dst.close()
