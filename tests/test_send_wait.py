"""A small request that ``send`` gathers whole into a mapped CUDA arena is reported
from the caller's thread (``source.SEND_WAIT_S``): its ``landed`` goes out before
``send`` returns, and the bytes are exact (real processes, real CUDA IPC, on a GPU)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.bench.reference import fill_shard
from kvstage.config import Settings
from kvstage.layout import pages_needed
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache

CTX = mp.get_context("spawn")
TOKENS = 20  # one 32-token chunk: granted early, so send gathers all of it


@pytest.mark.gpu
@pytest.mark.parametrize("share_kv,path", [("auto", "direct-ipc"), ("off", "mapped")])
@pytest.mark.parametrize("busy", [False, True])
def test_a_small_mapped_request_is_done_when_send_returns(busy, share_kv, path, monkeypatch):
    """Waited for on an idle GPU; not behind ~7 ms of work queued before the gather (a send
    that waited that long would be no send). Into the destination's pages (direct-ipc, the
    default) or into its mapped arena."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("KVSTAGE_SHARE_KV", share_kv)  # both processes read it
    seed = 31
    q, commands = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=fr.receive_cuda, args=(TOKENS, seed, q, commands))
    p.start()
    src = None
    try:
        kind, address = q.get(timeout=120)
        cache = RankCache.allocate(fr.src_spec(1), 0, pages_needed(TOKENS, 16) + 5, "cuda:0")
        pages = np.random.default_rng(seed).permutation(cache.pages)[: pages_needed(TOKENS, 16)]
        fill_shard(cache, seed, pages, TOKENS)
        src = Source(cache, Settings(**fr.SETTINGS))
        src.connect([tuple(address)])
        fr.until(lambda: src.stats().held_grants > 0, 30)  # the early grant is here
        cache.copier.load()  # loading the kernel at the first launch could wait for the queued work
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(14_000_000)  # ~7 ms at the H200's clock, on the stream the gather goes to
        h = src.send(f"r{seed}", pages, TOKENS)
        if not busy:  # the GPU is idle: a 20-token gather ends within the wait
            assert h.state is State.DONE and h.path == path, (h.state, h.path)
        if busy:
            assert h.state is not State.DONE, "send waited for a gather queued behind other work"
        h.wait(30)
        kind, got, errors = q.get(timeout=60)
        assert (kind, got, errors) == ("checked", path, []), (kind, got, errors)
    finally:
        commands.put("stop")
        if src is not None:
            src.close()
        p.join(30)
