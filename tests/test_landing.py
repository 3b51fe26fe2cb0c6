"""Landing words: a mapped writer's piece scatter queued on the GPU before the piece lands.

First the mechanism on one GPU (a queued copy waits for its word's value, an
older value does not release it, the destination's own release does), then a
real CUDA ``Destination`` with a source spoken by hand: the grant names a word,
the scatter is queued once the source announces, the ``landed`` message alone
(no word written by the source) completes the request byte for byte, and a
source that goes away releases the queued scatters instead of leaving them
waiting. Byte-exact runs with real source processes are in test_transfer.py.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

import fault_ranks as fr
from fake_peers import FakeSource
from kvstage.bench.reference import check_shard
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.staging import landing
from kvstage.staging.arena import StagingArena
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather

pytestmark = pytest.mark.gpu

TOKEN = "landing-test"
CHUNK = 32  # tokens per 16 KiB slot at 512 B a token (fault_ranks geometry, source TP 1)


@pytest.fixture(autouse=True)
def _nothing_device_wide_while_waiting():
    """Whatever synchronizes the whole device waits for a queued scatter too, and here the
    release comes from this very thread (or the destination's loop): so garbage arenas of
    earlier tests are freed now (cudaFree), not by a collection while a wait is queued, and
    torch's stream pool and the kernels the tests queue are loaded before any wait."""
    gc.collect()
    torch.cuda.Stream()  # the pool's creation blocked on a queued wait (H200, CUDA 13)
    a = torch.ones(16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a), b.fill_(1), float(b.abs().sum())
    x = torch.arange(8, dtype=torch.int32, device="cuda")
    torch.zeros_like(x).copy_(x), int(x.abs().sum())
    torch.cuda.synchronize()
    yield


def _words(count: int = 8) -> landing.LandingWords:
    arena = StagingArena(4096, 2, torch.device("cuda", 0), words=count)
    assert arena.words is not None and int(arena.words.abs().sum()) == 0  # zeroed: no value is 0
    words = landing.LandingWords(arena.words)
    words.arena = arena  # freed with the words, after the test's waits
    return words


def _pending(fence, seconds: float = 0.05) -> bool:
    time.sleep(seconds)
    return not fence.done()


def _finished(fence, seconds: float = 5.0) -> bool:
    """Polled, never a blocking wait: a wait that is never released fails the test, not hangs it."""
    deadline = time.monotonic() + seconds
    while not fence.done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_queued_copy_waits_for_its_word_and_runs_on_its_value():
    words = _words()
    src = torch.arange(1 << 16, dtype=torch.int32, device="cuda")
    out = torch.zeros_like(src)
    value = words.next_value(3)
    fence = words.arm(0, 3, value, lambda: out.copy_(src))
    assert _pending(fence) and int(out.abs().sum()) == 0
    writer = torch.cuda.Stream()  # the writer's side: the word set on its own stream, after its work
    with torch.cuda.stream(writer):
        landing.signal(torch.device("cuda", 0), words.addr(3), value)
    assert _finished(fence) and torch.equal(out, src)


def test_an_older_value_does_not_release_a_newer_wait():
    words = _words()
    old = words.next_value(1)
    new = words.next_value(1)
    assert new == old + 1
    out = torch.zeros(16, device="cuda")
    fence = words.arm(0, 1, new, lambda: out.fill_(1))
    words.release(1, old)  # a late write of the previous grant's value
    assert _pending(fence) and float(out.sum()) == 0
    words.release(1, new)  # the destination's own release (landed message read, or the request failed)
    assert _finished(fence) and float(out.sum()) == 16


def test_each_writer_queues_on_its_own_stream():
    """A piece waiting for a slow writer does not hold back another writer's."""
    words = _words()
    a, b = torch.zeros(8, device="cuda"), torch.zeros(8, device="cuda")
    va, vb = words.next_value(0), words.next_value(1)
    fa = words.arm(0, 0, va, lambda: a.fill_(1))
    fb = words.arm(1, 1, vb, lambda: b.fill_(1))
    words.release(1, vb)
    assert _finished(fb) and float(b.sum()) == 8 and _pending(fa)
    words.release(0, va)
    assert _finished(fa) and float(a.sum()) == 8


def test_values_wrap_past_zero():
    words = _words()
    words._last[2] = 0xFFFFFFFF - 1
    assert [words.next_value(2) for _ in range(3)] == [0xFFFFFFFF, 1, 2]


def _destination(prearm: bool = True) -> Destination:
    cache = RankCache.allocate(fr.dst_spec(), 0, 256, torch.device("cuda", 0))
    return Destination(cache, Settings(**fr.SETTINGS, auth_token=TOKEN, peer_timeout_s=600, arena="device",
                                       prearm=prearm))


def _mapped_source(dst: Destination) -> FakeSource:
    src = FakeSource(dst.address, TOKEN)
    assert src.welcome["mapped"]["kind"] == "cuda_ipc"
    src.conn.send({"type": "mapped"})  # as a source that mapped the arena says
    return src


def _armed(dst: Destination, req: str, want: int) -> None:
    deadline = time.monotonic() + 5
    while dst._call(lambda: sum(len(c.armed) for c in dst.requests[req].open.values())) < want:
        assert time.monotonic() < deadline, f"{req}: {want} piece scatters not queued"
        time.sleep(0.01)


def _land(dst: Destination, src: FakeSource, req: str, grant: dict) -> None:
    """What a mapped source does, less the word: gather into the granted slot, say ``landed``."""
    nbytes = grant["count"] * src.token_bytes
    idx = TokenIndex(src.cache, src.pages[req], grant["start"], grant["count"])
    gather(src.cache, idx, src.piece.src_offset, src.piece.heads.count, dst.arena.view(grant["offset"], nbytes))
    torch.cuda.current_stream().synchronize()  # this stream only: the device has a scatter queued
    src.conn.send({"type": "landed", "req": req, "chunk": grant["chunk"], "writer": 0, "offset": grant["offset"],
                   "bytes": nbytes})


def test_scatters_are_queued_once_the_writer_announces_and_landed_completes_them():
    dst = _destination()
    src = _mapped_source(dst)
    try:
        tokens = 2 * CHUNK - 3
        ids = np.random.default_rng(5).permutation(dst.cache.pages)[: pages_needed(tokens, 4)]
        h = dst.expect("r", ids, tokens)
        grants = [src.grant("r", c) for c in range(2)]  # early grants, before the source announced
        assert all(isinstance(g["word"], int) and g["value"] >= 1 for g in grants)
        assert len({g["word"] for g in grants}) == 2  # one word per slot and writer
        assert dst._call(lambda: sum(len(c.armed) for c in dst.requests["r"].open.values())) == 0
        src.announce("r", tokens, 17)
        _armed(dst, "r", 2)
        fences = dst._call(lambda: [f for c in dst.requests["r"].open.values() for f in c.fences])
        assert len(fences) == 2 and _pending(fences[0])  # queued, waiting for a word nobody set yet
        for g in grants:
            _land(dst, src, "r", g)
        h.wait(10)
        assert h.state is State.DONE and h.queued_scatters == 2 and h.path == "mapped"
        assert check_shard(dst.cache, 17, ids, tokens) == []
        assert dst.slots_free() == dst.arena.allocator.count
    finally:
        src.close()
        dst.close()


def test_a_writer_gone_releases_its_queued_scatters():
    dst = _destination()
    src = _mapped_source(dst)
    try:
        ids = np.arange(pages_needed(CHUNK, 4))
        h = dst.expect("r", ids, CHUNK)
        src.announce("r", CHUNK, 3)
        src.grant("r", 0)
        _armed(dst, "r", 1)
        src.close()  # never sets the word, never says landed
        with pytest.raises(TransferFailed, match="connection lost"):
            h.wait(10)
        deadline = time.monotonic() + 5
        while dst.slots_free() != dst.arena.allocator.count:
            assert time.monotonic() < deadline, "the slot of the failed request was not freed"
            time.sleep(0.01)
    finally:
        dst.close()


def test_prearm_off_the_default_names_no_word_and_launches_on_landed():
    assert Settings().prearm is False
    dst = _destination(prearm=False)
    src = _mapped_source(dst)
    try:
        assert dst.arena.words is None and "words" not in src.welcome["mapped"]
        ids = np.arange(pages_needed(CHUNK, 4))
        h = dst.expect("r", ids, CHUNK)
        src.announce("r", CHUNK, 9)
        g = src.grant("r", 0)
        assert "word" not in g
        _land(dst, src, "r", g)
        h.wait(10)
        assert h.queued_scatters == 0 and check_shard(dst.cache, 9, ids, CHUNK) == []
    finally:
        src.close()
        dst.close()
