"""A host scatter shared among threads (``staging.copy.CopyThreads``, ``Settings.scatter_threads``):
the same bytes as one thread, a failed share raised, and who gets how many threads."""

import logging

import numpy as np
import pytest
import torch

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.protocol.destination import Destination
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import CopyThreads, TokenIndex, region_bytes, scatter_chunk
from kvstage.tp import SideSpec

pytestmark = pytest.mark.usefixtures("host_copy")  # every host copy both ways: native and numpy

GEO = KVGeometry(5, 4, 8, "bfloat16")  # 10 buffers: shares of 4, 3 and 3 on three threads


@pytest.mark.parametrize("threads", [2, 3, 16])
@pytest.mark.parametrize("start,count", [(0, 64), (5, 20), (16, 40)])
def test_a_shared_scatter_writes_what_one_thread_writes(threads, start, count):
    d = SideSpec(GEO, 1, PageLayout(16, "nhd"))
    ids = np.random.default_rng(3).permutation(40)[: pages_needed(start + count, 16)]
    parts = [(0, 2, 0), (2, 2, region_bytes(RankCache.allocate(d, 0, 1), count, 2))]
    slot = torch.randint(0, 256, (2 * parts[1][2] + 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    one, shared = RankCache.allocate(d, 0, 40, fill=0), RankCache.allocate(d, 0, 40, fill=0)
    scatter_chunk(one, TokenIndex(one, ids, start, count), parts, slot)
    pool = CopyThreads(threads)
    try:
        scatter_chunk(shared, TokenIndex(shared, ids, start, count), parts, slot, pool)
    finally:
        pool.close()
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(one.buffers, shared.buffers))
    assert all(x.view(torch.uint8).any() for x in shared.buffers)  # every buffer got its share


def test_a_failed_share_is_raised_after_every_share_stopped():
    done = []

    def place(i):
        if i == 3:
            raise RuntimeError("share of item 3")
        done.append(i)

    pool = CopyThreads(2)
    try:
        with pytest.raises(RuntimeError, match="item 3"):
            pool.run(place, [(i,) for i in range(8)])
        assert sorted(done) == [0, 1, 2, 4, 6]  # the caller's share (0, 2, 4, 6) ran whole; the other stopped at 3
    finally:
        pool.close()


@pytest.mark.parametrize("value", [0, -1, 65, 1.5, True, "2"])
def test_the_setting_is_a_whole_number_of_threads(value):
    with pytest.raises(ConfigError, match=r"scatter_threads=.*must be a whole number in \[1, 64\]"):
        Settings(scatter_threads=value)


def test_the_environment_sets_it(monkeypatch):
    monkeypatch.setenv("KVSTAGE_SCATTER_THREADS", "3")
    assert Settings().scatter_threads == 3


def _threads(caplog, **settings):
    spec = SideSpec(KVGeometry(2, 4, 32, "bfloat16"), 1, PageLayout(16, "nhd"))
    with caplog.at_level(logging.INFO, logger="kvstage"):
        dst = Destination(RankCache.allocate(spec, 0, 8), Settings(arena_mb=1, slot_mb=0.25, **settings))
    try:
        return None if dst._scatter_threads is None else dst._scatter_threads.threads
    finally:
        dst.close()


def test_two_threads_by_default_with_cma_one_with_nixl_or_when_told(caplog, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert _threads(caplog, transport="cma") == 2
    assert "host scatters on 2 threads (cma: the sources write from their pages" in caplog.text
    caplog.clear()
    assert _threads(caplog, transport="nixl") is None
    assert "host scatters" not in caplog.text
    assert _threads(caplog, transport="cma", scatter_threads=1) is None
    assert _threads(caplog, transport="nixl", scatter_threads=3) == 3
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert _threads(caplog, transport="cma") is None  # no second core to give
