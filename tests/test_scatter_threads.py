"""A host scatter shared among threads (``staging.copy.CopyThreads``, ``destination.scatter_threads``):
the same bytes as one thread, a failed share raised, and who gets how many threads."""

import logging

import numpy as np
import pytest
import torch

from kvstage.config import Settings
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.protocol.destination import Destination, scatter_threads
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import CopyThreads, TokenIndex, scatter_chunk
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import SideSpec

pytestmark = pytest.mark.usefixtures("host_copy")  # every host copy both ways: native and numpy

GEO = KVGeometry(5, 4, 8, "bfloat16")  # 10 buffers: shares of 4, 3 and 3 on three threads


PIECES = {  # writers' pieces of a slot: token order over adjacent heads (the torch copier's tiling), head order
    "tokens": [RegionPiece(0, 2, range(GEO.buffers), 0, Order.TOKENS),
               RegionPiece(2, 2, range(GEO.buffers), 0, Order.TOKENS)],
    "heads": [RegionPiece(0, 2, range(GEO.buffers), 0), RegionPiece(2, 2, range(GEO.buffers), 0)],
    "shares": [RegionPiece(0, 4, range(0, 3), 0),
               RegionPiece(0, 4, range(3, 10), 0, Order.TOKENS, rows=70, row_first=2)],
}


@pytest.mark.parametrize("threads", [2, 3, 16])
@pytest.mark.parametrize("start,count", [(0, 64), (5, 20), (16, 40)])
@pytest.mark.parametrize("kind", list(PIECES))
def test_a_shared_scatter_writes_what_one_thread_writes(threads, start, count, kind):
    d = SideSpec(GEO, 1, PageLayout(16, "nhd"))
    ids = np.random.default_rng(3).permutation(40)[: pages_needed(start + count, 16)]
    parts = end_to_end(PIECES[kind], GEO.head_bytes(), count)
    size = parts[-1].offset + parts[-1].nbytes(GEO.head_bytes(), count) + 16
    slot = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
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


def test_two_threads_where_there_is_a_second_core_else_one():
    # the destination does every writer's reads and scatters, whatever the transport
    assert scatter_threads(cores=2) == 2
    assert scatter_threads(cores=16) == 2
    assert scatter_threads(cores=1) == 1  # no second core to give


@pytest.mark.parametrize("cores,logged", [(2, True), (1, False)])
@pytest.mark.parametrize("transport", ["cma", "nixl"])
def test_a_destination_says_when_it_scatters_on_more_threads(caplog, monkeypatch, transport, cores, logged):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    spec = SideSpec(KVGeometry(2, 4, 32, "bfloat16"), 1, PageLayout(16, "nhd"))
    with caplog.at_level(logging.INFO, logger="kvstage"):
        dst = Destination(RankCache.allocate(spec, 0, 8), Settings(arena_mb=1, transport=transport))
    dst.close()
    assert ("host scatters on 2 threads" in caplog.text) is logged
