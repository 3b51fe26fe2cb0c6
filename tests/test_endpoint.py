"""The endpoint loop: it reads every control connection itself and waits with
select(2), or with epoll once its sockets sit past descriptor 1023 (real
sockets, real NIXL, a real transfer checked byte for byte)."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.bench.reference import check_shard, fill_shard
from kvstage.config import Settings
from kvstage.errors import TransferFailed, TransportError
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.source import Source
from kvstage.protocol.waiting import SELECT_LIMIT
from kvstage.staging.cache import RankCache


def test_sockets_past_descriptor_1023_are_served_by_epoll_byte_exact(caplog):
    """An engine process with many files open gets sockets select(2) cannot see:
    the loop waits with epoll instead (and says so once), and a 2->1 transfer of
    several chunks on the read path (the handshake, readies, chunks, reads, done:
    every message over those sockets) completes exactly."""
    caplog.set_level(logging.INFO, logger="kvstage")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(SELECT_LIMIT + 16)]
    tokens, seed = 150, 41  # 32-token slots at the destination: 5 chunks
    try:
        dcache = RankCache.allocate(fr.dst_spec(), 0, pages_needed(tokens, 4) + 6)
        dst = Destination(dcache, Settings(**fr.SETTINGS))
        srcs = []
        read = Settings(**fr.SETTINGS, path="read")
        for rank in range(2):
            cache = RankCache.allocate(fr.src_spec(2), rank, pages_needed(tokens, 16) + 3)
            pages = np.random.default_rng([seed, rank]).permutation(cache.pages)[: pages_needed(tokens, 16)]
            fill_shard(cache, seed, pages, tokens)
            src = Source(cache, read)
            src.connect([dst.address])
            srcs.append((src, pages))
        for ep in [dst] + [s for s, _ in srcs]:
            assert ep.stats().wait == "epoll"
        dpages = np.random.default_rng(seed).permutation(dcache.pages)[: pages_needed(tokens, 4)]
        hd = dst.expect("r", dpages, tokens)
        hs = [s.send("r", p, tokens) for s, p in srcs]
        for h in hs + [hd]:
            h.wait(30)
        assert hd.path == "read" and check_shard(dcache, seed, dpages, tokens) == []
        said = [r.getMessage() for r in caplog.records if "the loop waits with epoll" in r.getMessage()]
        assert len(said) == 3 and said[0].startswith("dst 0: control sockets past descriptor 1023"), said
        for s, _ in srcs:
            s.close()
        dst.close()
    finally:
        for fd in held:
            os.close(fd)


def test_below_descriptor_1024_the_loop_waits_with_select():
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS))
    try:
        src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), Settings(**fr.SETTINGS))
        src.connect([dst.address])
        assert (dst.stats().wait, dst.stats().peers) == ("select", 1)
        src.close()
    finally:
        dst.close()


class _Gate(logging.Handler):
    """A log handler that holds the thread logging a line containing ``hold`` until ``release`` is set,
    and notes which thread logged each line."""

    def __init__(self, hold: str):
        super().__init__(logging.DEBUG)
        self.hold, self.inside, self.release, self.lines = hold, threading.Event(), threading.Event(), []

    def handle(self, record) -> bool:  # no handler lock: the other threads' lines go on meanwhile
        msg = record.getMessage()
        self.lines.append((record.threadName, msg))
        if self.hold in msg and not self.inside.is_set():
            self.inside.set()
            self.release.wait(10)
        return True


def test_send_runs_on_the_callers_thread_holding_the_state_lock():
    """``send`` does a request's first steps (route, gather, ready) on the caller's thread, awake
    already, not by a hand-off to the loop, and only while the loop is not handling anything: while
    the loop is inside a handler (held here in its log line for a peer that left), ``send`` waits."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS))
    other = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS), engine="other")
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), Settings(**fr.SETTINGS))
    gate = _Gate("of engine other disconnected")
    logger = logging.getLogger("kvstage")
    level = logger.level
    logger.addHandler(gate)
    logger.setLevel(logging.INFO)
    try:
        src.connect([dst.address, other.address])
        other.close()  # the source's loop handles the lost connection and logs it, holding the state lock
        assert gate.inside.wait(10)
        sent = []
        caller = threading.Thread(target=lambda: sent.append(src.send("r", [0], 4)), name="the-caller")
        caller.start()
        caller.join(0.3)
        assert caller.is_alive() and not sent, "send ran while the loop held the state lock"
        gate.release.set()
        caller.join(10)
        assert sent
        routed = [who for who, msg in gate.lines if "src 0: requests to destination rank 0 go" in msg]
        assert routed == ["the-caller"], gate.lines
        sent[0].abort("test over")
    finally:
        gate.release.set()
        logger.removeHandler(gate)
        logger.setLevel(level)
        src.close()
        other.close()
        dst.close()


def test_calls_after_close_are_refused_at_once():
    """``send`` (caller's thread) and ``expect``, ``slots_free`` (handed to the loop) on a
    closed endpoint fail with a clear error, not after the loop's 30 s timeout."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS))
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), Settings(**fr.SETTINGS))
    src.connect([dst.address])
    address = dst.address
    src.close()
    dst.close()
    t = time.monotonic()
    with pytest.raises(TransportError, match="src rank 0: the endpoint is closed"):
        src.send("r", [0], 4)
    with pytest.raises(TransportError, match="dst rank 0: the endpoint is closed"):
        dst.expect("r", [0], 4)
    with pytest.raises(TransportError, match="dst rank 0: the endpoint is closed"):
        dst.slots_free()
    assert time.monotonic() - t < 1


def test_a_destination_tracks_a_request_until_nothing_of_it_can_land():
    """``tracks`` (what the vLLM connector asks before it lets a failed request's pages
    go): an expected request is held; one failed with no writer owing it is not."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS))
    try:
        h = dst.expect("r", [0], 4)
        assert dst.tracks("r") and not dst.tracks("other")
        h.abort("test over")
        with pytest.raises(TransferFailed, match="test over"):
            h.wait(10)
        assert not dst.tracks("r")
    finally:
        dst.close()


def test_sends_from_many_threads_at_once_are_byte_exact():
    """Eight callers per source send their own requests at the same moment while
    the loops handle readies, chunks and reads: every request lands exactly."""
    n, tokens = 8, 40
    dst, srcs, dpages, spages = fr.two_to_one(Settings(**fr.SETTINGS), n, tokens, seed=7, content=100)
    dcache = dst.cache
    try:
        hd = [dst.expect(f"r{k}", dpages[k], tokens) for k in range(n)]
        go, hs, errors = threading.Barrier(2 * n), [], []

        def caller(s, p, k):
            go.wait(10)
            try:
                hs.append(s.send(f"r{k}", p[k], tokens))
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=caller, args=(s, p, k)) for s, p in zip(srcs, spages) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and len(hs) == 2 * n
        for h in hs + hd:
            h.wait(30)
        for k in range(n):
            assert check_shard(dcache, 100 + k, dpages[k], tokens, written=dpages) == [], f"request r{k}"
    finally:
        for s in srcs:
            s.close()
        dst.close()


@pytest.mark.gpu
def test_a_send_from_a_side_stream_is_gathered_after_the_work_queued_there():
    """An engine calls ``send`` with its own stream current, right after the forward that wrote the
    pages was queued there: the gathers (on the copies' stream) follow that work, and the pages'
    ids uploaded for them are on the stream that reads them. A request written on a side stream
    lands byte-exact on the read path."""
    import torch

    dev = torch.device("cuda", 0)
    tokens, seed = 150, 43
    dcache = RankCache.allocate(fr.dst_spec(), 0, pages_needed(tokens, 4) + 4, dev)
    dst = Destination(dcache, Settings(**fr.SETTINGS))
    src = Source(RankCache.allocate(fr.src_spec(1), 0, pages_needed(tokens, 16) + 4, dev),
                 Settings(**fr.SETTINGS, path="read"))
    try:
        src.connect([dst.address])
        pages = np.arange(pages_needed(tokens, 16))
        dpages = np.arange(pages_needed(tokens, 4))[::-1].copy()
        hd = dst.expect("r", dpages, tokens)
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the "forward" is still running on the side stream when send is called
            fill_shard(src.cache, seed, pages, tokens)
            hs = src.send("r", pages, tokens)
        hs.wait(30), hd.wait(30)
        assert hd.path == "read" and check_shard(dcache, seed, dpages, tokens) == []
    finally:
        src.close()
        dst.close()
