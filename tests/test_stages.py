"""Per-stage timeouts and aborts, from either side, at every stage (real NIXL,
real sockets; a frozen source is a real process stopped with SIGSTOP).

Every failure names the peer, the stage and the cause, reaches both sides, and
leaves every slot free once no write of the request can still land.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.handshake import HANDSHAKE_TIMEOUT_S
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache

CTX = mp.get_context("spawn")
BIG = 20_000  # tokens: hundreds of 32-token chunks, a second or more in flight


def _dst(pages: int = pages_needed(BIG, 4) + 8, **over) -> Destination:
    return Destination(RankCache.allocate(fr.dst_spec(), 0, pages), Settings(**(fr.SETTINGS | over)))


def _src(tp: int = 1, rank: int = 0, **over) -> Source:
    return Source(RankCache.allocate(fr.src_spec(tp), rank, pages_needed(BIG, 16) + 4), Settings(**(fr.SETTINGS | over)))


def _fails(h, peer: str, stage: str, cause: str, within: float = 5.0):
    with pytest.raises(TransferFailed) as err:
        h.wait(within)
    e = err.value
    assert (e.peer, e.stage) == (peer, stage) and cause in e.cause, str(e)
    return e


def _src_free(src: Source) -> int:
    st = src.stats()
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
        assert err.value.stage == "handshake" and "no welcome" in err.value.cause and "timed out" in err.value.cause
        assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 2.0
    finally:
        src.close()
        server.close()


def test_ready_timeout_on_both_sides():
    """A request one side announces and the other never does fails after ``ready_timeout_s``."""
    dst = _dst(64, ready_timeout_s=0.5)
    src = _src(ready_timeout_s=0.5)
    try:
        src.connect([dst.address])
        t0 = time.monotonic()
        hd = dst.expect("only-dst", np.arange(4), 16)
        hs = src.send("only-src", np.arange(1), 16)
        _fails(hd, "source ranks 0", "waiting for writers", "not announced within 0.5 s")
        _fails(hs, "destination", "waiting for grant", "no grant within 0.5 s")
        assert time.monotonic() - t0 < 4.0
        # the slot granted early to "only-dst" comes back once the source confirms the abort
        fr.until(lambda: dst.slots_free() == 4 and _src_free(src) == (4, 0) and src.stats().held_grants == 0)
    finally:
        src.close()
        dst.close()


def test_a_frozen_source_fails_by_its_silence_and_its_slots_wait_for_it():
    """SIGSTOP the source mid-transfer: its kernel keeps answering TCP, but its pinger
    stops with it, so ``peer_timeout_s`` of silence tells. Its granted chunk is late past
    ``stall_timeout_s`` too, but a peer that does not ping is not known to run: that alone
    fails nothing. The destination fails the request; the slots granted to the frozen
    writer stay out of use (it could still write into them) until it resumes, hears the
    abort and confirms."""
    dst = _dst(stall_timeout_s=1.0, peer_timeout_s=2.0)
    q = CTX.Queue()
    p = CTX.Process(target=fr.send_one, args=(dst.address, 0, 1, BIG, 4, q))
    try:
        pages = np.arange(pages_needed(BIG, 4))
        h = dst.expect("r4", pages, BIG)
        p.start()
        assert q.get(timeout=60)[0] == "sending"
        fr.until(lambda: h.bytes > 0, 30)
        t_stop = time.monotonic()
        os.kill(p.pid, signal.SIGSTOP)
        e = _fails(h, "source rank 0", "write", "no control message", within=10)
        detect = time.monotonic() - t_stop
        print(f"\nsource frozen (SIGSTOP): detected in {detect * 1e3:.0f} ms: {e}")
        assert 1.0 < detect < 2.0 + 2.0  # at least one missed ping, at most the timeout plus slack
        time.sleep(0.5)
        assert dst.slots_free() < 4  # quarantined while the writer could still write
        os.kill(p.pid, signal.SIGCONT)
        fr.until(lambda: dst.slots_free() == 4, 10)
        kind, rank, error = q.get(timeout=30)
        assert kind == "failed" and "destination aborted" in error and "no control message" in error, error
        assert dst.stats().requests == 0
    finally:
        if p.pid:
            os.kill(p.pid, signal.SIGCONT)
        p.join(10)
        dst.close()


def test_a_frozen_destination_fails_the_source_by_its_silence():
    """SIGSTOP the destination mid-transfer: its kernel keeps answering TCP and the
    source's one-sided writes still complete, so only the missing pings (one a
    second from every live loop) tell. The source fails the request after
    ``peer_timeout_s`` of silence, naming the peer; a write still in flight keeps
    its slot until it completes (the destination resumes), then the arena is free."""
    q, commands = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=fr.receive_one, args=(BIG, 5, q, commands))
    p.start()
    src = None
    try:
        kind, address = q.get(timeout=60)
        src = _src(peer_timeout_s=2.0)
        src.connect([tuple(address)])
        h = src.send("r5", np.arange(pages_needed(BIG, 16)), BIG)
        fr.until(lambda: h.bytes > 0, 30)
        t_stop = time.monotonic()
        os.kill(p.pid, signal.SIGSTOP)
        with pytest.raises(TransferFailed) as err:
            h.wait(15)
        detect = time.monotonic() - t_stop
        e = err.value
        print(f"\ndestination frozen (SIGSTOP): detected in {detect * 1e3:.0f} ms: {e}")
        assert e.peer == "destination rank 0" and "stopped or hung" in e.cause, str(e)
        assert 1.0 < detect < 2.0 + 3.0  # at least one missed ping, at most the timeout plus slack
        os.kill(p.pid, signal.SIGCONT)
        fr.until(lambda: _src_free(src) == (4, 0), 15)  # every slot free, the request forgotten
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
    src = _src()
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
    fr.until(lambda: hd.bytes > 0)
    assert hd.state is State.TRANSFERRING and hs.state is State.TRANSFERRING
    (hs if side == "src" else hd).abort("operator said so")
    if side == "src":
        _fails(hs, "local", "abort", "operator said so")
        _fails(hd, "source rank 0", "abort", "source aborted: operator said so")
    else:
        _fails(hd, "local", "abort", "operator said so")
        _fails(hs, "destination rank 0", "abort", "destination aborted: operator said so")
    fr.until(lambda: dst.slots_free() == 4 and _src_free(src) == (4, 0))
    assert dst.stats().requests == 0
    # both keep serving
    hd2, hs2 = _big_pair(dst, src, "next")
    hd2.wait(60), hs2.wait(60)
    assert fr.check(dst.cache, 1, np.arange(pages_needed(BIG, 4)), BIG) == []


def test_abort_before_the_other_side_knows_the_request(linked):
    """Aborted while pending, before the peer was told of the request: the peer
    fails it the moment it is told, instead of waiting for a timeout."""
    dst, src = linked
    hs = src.send("a1", np.arange(2), 20)  # announced; the destination does not expect it yet
    fr.until(lambda: dst.stats().unknown_announced == 1)
    hs.abort("changed my mind")
    _fails(hs, "local", "abort", "changed my mind")
    fr.until(lambda: dst.stats().aborts_remembered == 1)
    _fails(dst.expect("a1", np.arange(5), 20), "source rank 0", "abort", "source aborted: changed my mind", within=1)
    # the destination tells every writer of a1 that it failed; the source, done with a1, remembers it
    fr.until(lambda: src.stats().aborts_remembered == 1)

    hd = dst.expect("a2", np.arange(5), 20)  # expected; the source has not announced it yet
    hd.abort("not needed")
    _fails(hd, "local", "abort", "not needed")
    fr.until(lambda: src.stats().aborts_remembered == 2)
    _fails(src.send("a2", np.arange(2), 20), "destination rank 0", "abort", "destination aborted: not needed", within=1)
    # a2 took an early grant: its slot comes back when the source's abort_ack (sent after "a2" entered its
    # _aborted) reaches the destination, which may be a moment after the check above
    fr.until(lambda: dst.slots_free() == 4 and _src_free(src) == (4, 0))


def test_abort_while_the_destination_waits_for_a_second_writer():
    """Prefill TP 2: rank 0 announced, rank 1 not yet. Rank 0 writes the chunks
    granted early and waits for the rest; the destination waits for rank 1.
    Either side aborts; every slot comes back (rank 1 confirms the abort of a
    request it never sent: nothing of it can land)."""
    dst = _dst(64)
    s0, s1 = _src(2, 0), _src(2, 1)
    tokens = 4 * 32  # four chunks, two of them granted early
    try:
        s0.connect([dst.address])
        s1.connect([dst.address])
        hd = dst.expect("p1", np.arange(32), tokens)
        h0 = s0.send("p1", np.arange(8), tokens)
        time.sleep(0.2)
        assert hd.state is State.PENDING and h0.state is State.TRANSFERRING
        h0.abort("rank 0 gives up")
        _fails(hd, "source rank 0", "abort", "rank 0 gives up")
        fr.until(lambda: s1.stats().aborts_remembered == 1)
        _fails(s1.send("p1", np.arange(8), tokens), "destination rank 0", "abort", "rank 0 gives up", within=1)

        hd = dst.expect("p2", np.arange(32), tokens)
        h0 = s0.send("p2", np.arange(8), tokens)
        time.sleep(0.2)
        hd.abort("decode gives up")
        _fails(h0, "destination rank 0", "abort", "destination aborted: decode gives up")
        fr.until(lambda: dst.slots_free() == 4 and _src_free(s0) == (4, 0) and _src_free(s1) == (4, 0))
    finally:
        s0.close()
        s1.close()
        dst.close()
