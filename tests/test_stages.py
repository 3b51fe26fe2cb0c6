"""Per-stage timeouts and aborts, from either side, at every stage (real NIXL,
real sockets; a frozen peer is a real process stopped with SIGSTOP).

Every failure names the peer, the stage and the cause, reaches both sides, and
leaves every slot free once no read of the request can still touch it. A source
that owes its destination nothing more (its request readable whole) is not
needed at all: stopped, its request lands all the same.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from support.fake_peers import TOKEN, OneWelcome, welcome_of
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.handshake import HANDSHAKE_TIMEOUT_S
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache

from support.procs import CTX  # forked from a warm server, as spawned children were
BIG = 40_000  # tokens: over a thousand 32-token chunks through 4 slots, seconds in flight


def _dst(pages: int = pages_needed(BIG, 4) + 8, **over) -> Destination:
    return Destination(RankCache.allocate(fr.dst_spec(), 0, pages), Settings(**(fr.SETTINGS | over)))


def _src(tp: int = 1, rank: int = 0, **over) -> Source:
    return Source(RankCache.allocate(fr.src_spec(tp), rank, pages_needed(BIG, 16) + 4), Settings(**(fr.SETTINGS | over)))


def _fails(h, peer: str, stage: str | tuple, cause: str, within: float = 5.0):
    with pytest.raises(TransferFailed) as err:
        h.wait(within)
    e = err.value
    stages = (stage,) if isinstance(stage, str) else stage
    assert e.peer == peer and e.stage in stages and cause in e.cause, str(e)
    return e


def _free(ep) -> tuple:
    st = ep.stats()
    return st.slots_free, st.requests


# -- timeouts ------------------------------------------------------------------------------------

def test_handshake_timeout_drops_a_silent_client_and_fails_a_silent_server():
    dst = _dst(64)
    try:
        s = socket.create_connection(dst.address)
        s.settimeout(HANDSHAKE_TIMEOUT_S + 5)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the destination: nothing arrived within HANDSHAKE_TIMEOUT_S
        assert HANDSHAKE_TIMEOUT_S - 0.1 < time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 2.0
        s.close()
    finally:
        dst.close()
    server = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does) and never answers
    src = _src()
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferFailed) as err:
            src.connect([server.getsockname()])
        assert err.value.stage == "handshake" and "no welcome within 5 s" in err.value.cause
        assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 2.0
        assert src.stats().peers == 0
    finally:
        src.close()
        server.close()


def test_a_destination_that_welcomes_and_never_opens_fails_the_handshake():
    """The source waits for ``opened`` (the destination's first read of its arena, then its answer) no
    longer than the handshake's deadline, and keeps nothing of that destination."""
    w = OneWelcome(lambda hello: welcome_of(fr.dst_spec(), hello))  # it reads the offer, and answers nothing
    src = _src(auth_token=TOKEN)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferFailed) as err:
            src.connect([w.address])
        e = err.value
        assert e.stage == "handshake" and "no opened within 5 s" in e.cause, str(e)
        assert HANDSHAKE_TIMEOUT_S - 0.1 < time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 2.0
        assert w.closed() and w.after == ["offer"] and src.stats().peers == 0
    finally:
        src.close()
        w.close()


def test_ready_timeout_on_both_sides():
    """A request one side expects and the other never sends fails after ``ready_timeout_s`` on the side
    that waits: the destination for its writers' ``ready``, the source for a destination to read it."""
    dst = _dst(64, ready_timeout_s=0.5)
    src = _src(ready_timeout_s=0.5)
    try:
        src.connect([dst.address])
        t0 = time.monotonic()
        hd = dst.expect("only-dst", np.arange(4), 16)
        hs = src.send("only-src", np.arange(1), 16)
        _fails(hd, "source ranks 0", "waiting for writers", "not ready within 0.5 s")
        _fails(hs, "destination", "waiting for a reader", "no destination started reading it within 0.5 s")
        assert time.monotonic() - t0 < 3.0
        # the source's gathered chunk is held a moment (a read may have been posted), then every slot is free
        fr.until(lambda: dst.slots_free() == 4 and _free(src) == (4, 0) and dst.stats().requests == 0)
        assert dst.stats().unknown_announced == 0  # the source's abort took its ready along
    finally:
        src.close()
        dst.close()


def test_a_request_read_by_a_running_destination_is_not_timed_out_by_the_ready_timeout():
    """The ready timeout bounds the wait for a reader, not the read: a request longer than
    ``ready_timeout_s`` in flight, read chunk by chunk, completes."""
    dst = _dst(ready_timeout_s=0.3)
    src = _src(ready_timeout_s=0.3, path="read")
    try:
        src.connect([dst.address])
        sp = np.arange(pages_needed(BIG, 16))
        from kvstage.bench.reference import fill_shard

        fill_shard(src.cache, 9, sp, BIG)
        dp = np.arange(pages_needed(BIG, 4))
        t0 = time.monotonic()
        hd = dst.expect("long", dp, BIG)
        hs = src.send("long", sp, BIG)
        hd.wait(60), hs.wait(60)
        assert time.monotonic() - t0 > 0.3, "too short to tell"
        assert fr.check(dst.cache, 9, dp, BIG) == []
    finally:
        src.close()
        dst.close()


def _stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def test_a_frozen_source_that_owes_chunks_fails_by_its_silence():
    """SIGSTOP the source mid-transfer on the read path, with chunks it has not gathered yet: its kernel
    keeps answering TCP, but its pinger stops with it, so ``peer_timeout_s`` of silence tells (a peer that
    does not ping is not known to run: ``stall_timeout_s`` alone fails nothing). The destination fails the
    request naming the source; resumed, the source hears why, and every slot is free."""
    dst = _dst(stall_timeout_s=1.0, peer_timeout_s=2.0)
    q = CTX.Queue()
    p = CTX.Process(target=fr.send_one, args=(dst.address, 0, 1, BIG, 4, q, {"path": "read"}))
    try:
        pages = np.arange(pages_needed(BIG, 4))
        h = dst.expect("r4", pages, BIG)
        p.start()
        assert q.get(timeout=60)[0] == "sending"
        fr.until(lambda: h.state is State.TRANSFERRING, 30)
        time.sleep(0.1)
        t_stop = time.monotonic()
        _stopped(p.pid)
        e = _fails(h, "source rank 0", ("read", "scatter"), "no control message", within=10)
        detect = time.monotonic() - t_stop
        print(f"\nsource frozen (SIGSTOP): detected in {detect * 1e3:.0f} ms: {e}")
        assert 1.0 < detect < 2.0 + 2.0  # at least one missed ping, at most the timeout plus slack
        assert "stopped or hung" in e.cause
        os.kill(p.pid, signal.SIGCONT)
        kind, rank, error = q.get(timeout=30)
        assert kind == "failed" and "destination aborted" in error and "no control message" in error, error
        fr.until(lambda: _free(dst) == (4, 0), 10)
    finally:
        if p.pid:
            os.kill(p.pid, signal.SIGCONT)
        p.join(10)
        dst.close()


def test_a_frozen_source_that_owes_nothing_more_is_read_all_the_same():
    """The decode moves the bytes: once a source made its request readable whole (the pages path: at its
    ``ready``), its process is not on the request's path. SIGSTOP it right then: the destination reads
    every byte, seconds of it, and the silence of a source that owes nothing fails nothing."""
    dst = _dst(stall_timeout_s=1.0, peer_timeout_s=2.0)
    q = CTX.Queue()
    p = CTX.Process(target=fr.send_one, args=(dst.address, 0, 1, BIG, 6, q, {"path": "pages"}))
    try:
        pages = np.random.default_rng(7).permutation(dst.cache.pages)[: pages_needed(BIG, 4)]
        h = dst.expect("r6", pages, BIG)
        p.start()
        assert q.get(timeout=60)[0] == "sending"
        fr.until(lambda: h.state is not State.PENDING, 30)  # its ready is in
        _stopped(p.pid)
        t0 = time.monotonic()
        try:
            h.wait(60)
            assert h.path == "pages" and fr.check(dst.cache, 6, pages, BIG) == []
            time.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))  # the source's silence is past peer_timeout_s
            assert dst.stats().peers == 1 and p.is_alive()
        finally:
            os.kill(p.pid, signal.SIGCONT)
        assert q.get(timeout=30) == ("done", 0, None)
    finally:
        if p.pid:
            os.kill(p.pid, signal.SIGCONT)
        p.join(10)
        dst.close()


def test_a_frozen_destination_fails_the_source_by_its_silence():
    """SIGSTOP the destination mid-transfer: its kernel keeps answering TCP, so only the missing pings
    (one a second from every live process) tell. The source fails the request after ``peer_timeout_s``
    of silence, naming the peer; its gathered slots come back once no read of them can still run."""
    q, commands = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=fr.receive_one, args=(BIG, 5, q, commands))
    p.start()
    src = None
    try:
        kind, address = q.get(timeout=60)
        src = _src(peer_timeout_s=2.0, path="read")
        src.connect([tuple(address)])
        h = src.send("r5", np.arange(pages_needed(BIG, 16)), BIG)
        fr.until(lambda: h.state is State.TRANSFERRING, 30)  # the destination reads it
        t_stop = time.monotonic()
        _stopped(p.pid)
        with pytest.raises(TransferFailed) as err:
            h.wait(15)
        detect = time.monotonic() - t_stop
        e = err.value
        print(f"\ndestination frozen (SIGSTOP): detected in {detect * 1e3:.0f} ms: {e}")
        assert e.peer == "destination rank 0" and "stopped or hung" in e.cause, str(e)
        assert 1.0 < detect < 2.0 + 3.0  # at least one missed ping, at most the timeout plus slack
        os.kill(p.pid, signal.SIGCONT)
        fr.until(lambda: _free(src) == (4, 0), 15)  # every slot free, the request forgotten
    finally:
        if p.pid:
            os.kill(p.pid, signal.SIGCONT)
        if src is not None:
            src.close()
        p.terminate()
        p.join(10)


def test_peer_timeout_must_leave_room_for_two_pings():
    from kvstage.errors import ConfigError

    with pytest.raises(ConfigError, match=r"peer_timeout_s=1\.5: must be >= 2 s \(peers ping every 1 s\)"):
        Settings(peer_timeout_s=1.5)
    assert Settings(peer_timeout_s=2).peer_timeout_s == 2


# -- aborts ----------------------------------------------------------------------------------------

@pytest.fixture
def linked():
    dst = _dst()
    src = _src(path="read")
    src.connect([dst.address])
    yield dst, src
    src.close()
    dst.close()


def _big_pair(dst, src, req):
    from kvstage.bench.reference import fill_shard

    sp = np.arange(pages_needed(BIG, 16))
    fill_shard(src.cache, 1, sp, BIG)
    return dst.expect(req, np.arange(pages_needed(BIG, 4)), BIG), src.send(req, sp, BIG)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_abort_mid_transfer_fails_both_sides_and_frees_every_slot(linked, side):
    dst, src = linked
    hd, hs = _big_pair(dst, src, "r")
    fr.until(lambda: hs.state is State.TRANSFERRING)  # the destination has read a chunk
    assert hd.state is State.TRANSFERRING
    (hs if side == "src" else hd).abort("operator said so")
    if side == "src":
        _fails(hs, "local", "abort", "operator said so")
        _fails(hd, "source rank 0", "abort", "source aborted: operator said so")
    else:
        _fails(hd, "local", "abort", "operator said so")
        _fails(hs, "destination rank 0", "abort", "destination aborted: operator said so")
    fr.until(lambda: _free(dst) == (4, 0) and _free(src) == (4, 0))
    # both keep serving
    hd2, hs2 = _big_pair(dst, src, "next")
    hd2.wait(60), hs2.wait(60)
    assert fr.check(dst.cache, 1, np.arange(pages_needed(BIG, 4)), BIG) == []


def test_abort_before_the_other_side_knows_the_request(linked):
    """Aborted while pending, before the peer was told of the request: the peer fails it the moment it
    is told, instead of waiting for a timeout."""
    dst, src = linked
    hs = src.send("a1", np.arange(2), 20)  # said ready; the destination does not expect it yet
    fr.until(lambda: dst.stats().unknown_announced == 1)
    hs.abort("changed my mind")
    _fails(hs, "local", "abort", "changed my mind")
    fr.until(lambda: dst.stats().aborts_remembered == 1 and dst.stats().unknown_announced == 0)
    _fails(dst.expect("a1", np.arange(5), 20), "source rank 0", "abort", "source aborted: changed my mind", within=1)

    hd = dst.expect("a2", np.arange(5), 20)  # expected; the source has not sent it yet
    hd.abort("not needed")
    _fails(hd, "local", "abort", "not needed")
    fr.until(lambda: src.stats().aborts_remembered == 1)
    _fails(src.send("a2", np.arange(2), 20), "destination rank 0", "abort", "destination aborted: not needed", within=1)
    fr.until(lambda: _free(dst) == (4, 0) and _free(src) == (4, 0))


def test_abort_while_the_destination_waits_for_a_second_writer():
    """Prefill TP 2: rank 0 said ready, rank 1 not yet, and the destination reads nothing until both
    are. Either side aborts; the other rank hears it and fails the request the moment it sends it, and
    every slot comes back."""
    dst = _dst(64)
    s0, s1 = _src(2, 0, path="read"), _src(2, 1, path="read")
    tokens = 4 * 32  # four chunks: the source's four slots, gathered at send
    try:
        s0.connect([dst.address])
        s1.connect([dst.address])
        hd = dst.expect("p1", np.arange(32), tokens)
        h0 = s0.send("p1", np.arange(8), tokens)
        time.sleep(0.2)
        assert hd.state is State.PENDING and h0.state is State.PENDING and _free(s0) == (0, 1)
        h0.abort("rank 0 gives up")
        _fails(hd, "source rank 0", "abort", "rank 0 gives up")
        fr.until(lambda: s1.stats().aborts_remembered == 1)
        _fails(s1.send("p1", np.arange(8), tokens), "destination rank 0", "abort", "rank 0 gives up", within=1)

        hd = dst.expect("p2", np.arange(32), tokens)
        h0 = s0.send("p2", np.arange(8), tokens)
        time.sleep(0.2)
        hd.abort("decode gives up")
        _fails(h0, "destination rank 0", "abort", "destination aborted: decode gives up")
        fr.until(lambda: _free(dst) == (4, 0) and _free(s0) == (4, 0) and _free(s1) == (4, 0))
    finally:
        s0.close()
        s1.close()
        dst.close()
