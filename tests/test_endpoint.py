"""The endpoint loop: it reads every control connection itself and waits with
select(2), or with epoll once its sockets sit past descriptor 1023 (real
sockets, real NIXL, a real transfer checked byte for byte)."""

from __future__ import annotations

import logging
import os

import numpy as np

import fault_ranks as fr
from kvstage.bench.reference import check_shard, fill_shard
from kvstage.config import Settings
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
            assert ep._call(lambda ep=ep: not ep._low and max(s.fileno() for s in ep._socks) >= _SELECT_LIMIT)
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
        assert dst._call(lambda: dst._low and len(dst._socks) == 2)  # the wake-up socket and the source's
        src.close()
    finally:
        dst.close()
