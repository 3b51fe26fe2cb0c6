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
from kvstage.protocol.endpoint import _SELECT_LIMIT
from kvstage.staging.cache import RankCache


def test_sockets_past_descriptor_1023_are_served_by_epoll_byte_exact(caplog):
    """An engine process with many files open gets sockets select(2) cannot see:
    the loop waits with epoll instead (and says so once), and a 2->1 transfer of
    several chunks (grants, notices, done: every message over those sockets)
    completes exactly."""
    caplog.set_level(logging.INFO, logger="kvstage")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(_SELECT_LIMIT + 16)]
    tokens, seed = 150, 41  # 32-token slots at the destination: 5 chunks
    try:
        dcache = RankCache.allocate(fr.dst_spec(), 0, pages_needed(tokens, 4) + 6)
        dst = Destination(dcache, Settings(**fr.SETTINGS))
        srcs = []
        for rank in range(2):
            cache = RankCache.allocate(fr.src_spec(2), rank, pages_needed(tokens, 16) + 3)
            pages = np.random.default_rng([seed, rank]).permutation(cache.pages)[: pages_needed(tokens, 16)]
            fill_shard(cache, seed, pages, tokens)
            src = Source(cache, Settings(**fr.SETTINGS))
            src.connect([dst.address])
            srcs.append((src, pages))
        for ep in [dst] + [s for s, _ in srcs]:
            assert ep.stats().wait == "epoll"
        dpages = np.random.default_rng(seed).permutation(dcache.pages)[: pages_needed(tokens, 4)]
        hd = dst.expect("r", dpages, tokens)
        hs = [s.send("r", p, tokens) for s, p in srcs]
        for h in hs + [hd]:
            h.wait(30)
        assert check_shard(dcache, seed, dpages, tokens) == []
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


def test_send_runs_on_the_callers_thread_holding_the_state_lock(monkeypatch):
    """``send`` does a request's first steps on the caller's thread (awake already),
    not by a hand-off to the loop, and only while the loop is not handling anything:
    while a loop call holds the state lock, ``send`` waits for it."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS))
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), Settings(**fr.SETTINGS))
    try:
        src.connect([dst.address])
        ran_on, add = [], Source._add
        monkeypatch.setattr(Source, "_add", lambda self, *a: (ran_on.append(threading.get_ident()), add(self, *a))[1])
        inside, release = threading.Event(), threading.Event()
        src._post("call", lambda: (inside.set(), release.wait(10)))  # the loop holds the lock until released
        assert inside.wait(10)
        sent = []
        caller = threading.Thread(target=lambda: sent.append(src.send("r", [0], 4)))
        caller.start()
        caller.join(0.3)
        assert caller.is_alive() and not sent, "send ran while the loop held the state lock"
        release.set()
        caller.join(10)
        assert sent and ran_on == [caller.ident]
        sent[0].abort("test over")
    finally:
        src.close()
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
    the loops handle grants and notices: every request lands exactly."""
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
def test_a_send_from_a_side_stream_copies_on_the_default_stream():
    """An engine may call ``send`` with its own stream current. The request's page ids
    are uploaded there on the caller's thread and read by copies the loop launches
    later, on its thread's default stream: both must be on the same stream."""
    import torch

    from kvstage.staging.cuda_copy import raw_stream

    dev = torch.device("cuda", 0)
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8, dev), Settings(**fr.SETTINGS))
    try:
        default, side = torch.cuda.default_stream(dev).cuda_stream, torch.cuda.Stream(dev)
        assert src._here(lambda: raw_stream(dev)) == default
        with torch.cuda.stream(side):
            assert raw_stream(dev) == side.cuda_stream != default
            assert src._here(lambda: raw_stream(dev)) == default
            assert raw_stream(dev) == side.cuda_stream  # the caller's stream is its own again
    finally:
        src.close()
