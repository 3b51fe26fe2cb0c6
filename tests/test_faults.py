"""Fault suite: killed peers, a restarted peer, and load — real processes, real NIXL (and cma).

Figures (detection time per fault, leaked slots, corrupt bytes) are printed
with ``-s`` and recorded in docs/reliability.md.
"""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache

CTX = mp.get_context("spawn")
BIG = 20_000  # tokens: ~10 MB through 16 KiB slots, several hundred chunks


def _destination(tokens_pages: int) -> Destination:
    return Destination(RankCache.allocate(fr.dst_spec(), 0, tokens_pages), Settings(**fr.SETTINGS))


# "on": the sources gather straight into the destination's arena (a memfd mapped into them), with
# no transport write; "cma": the sources write from their pages with process_vm_writev. The spawned
# ranks read KVSTAGE_MAPPED and KVSTAGE_TRANSPORT from the environment they inherit
MAPPED = ["auto", "on", "cma"]


def _variant(monkeypatch, mapped: str) -> None:
    if mapped == "cma":
        monkeypatch.setenv("KVSTAGE_TRANSPORT", "cma")
    else:
        monkeypatch.setenv("KVSTAGE_MAPPED", mapped)


@pytest.mark.parametrize("mapped", MAPPED)
def test_source_killed_mid_transfer_then_restarted_under_the_same_rank(mapped, monkeypatch):
    _variant(monkeypatch, mapped)
    dst = _destination(pages_needed(BIG, 4) + 8)
    try:
        pages = np.random.default_rng(0).permutation(dst.cache.pages)[: pages_needed(BIG, 4)]
        h = dst.expect(f"r{1}", pages, BIG)
        q = CTX.Queue()
        p = CTX.Process(target=fr.send_one, args=(dst.address, 0, 1, BIG, 1, q))
        p.start()
        assert q.get(timeout=60)[0] == "sending"
        fr.until(lambda: h.bytes > 0, 30)  # chunks are landing: mid-transfer
        assert h.state is State.TRANSFERRING
        t_kill = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(TransferFailed) as err:
            h.wait(10)
        detect = time.monotonic() - t_kill
        p.join(5)
        print(f"\nsource kill -9: detected in {detect * 1e3:.0f} ms: {err.value}")
        assert detect < 5.0
        assert err.value.peer == "source rank 0" and "connection lost" in err.value.cause
        fr.until(lambda: dst.slots_free() == 4, 5)  # no leaked slot

        # the same rank comes back (new process, new NIXL agent, same address) and transfers again
        tokens = 300
        pages2 = np.random.default_rng(2).permutation(dst.cache.pages)[: pages_needed(tokens, 4)]
        h2 = dst.expect("r7", pages2, tokens)
        p2 = CTX.Process(target=fr.send_one, args=(dst.address, 0, 1, tokens, 7, q))
        p2.start()
        h2.wait(60)
        assert h2.path == ("mapped" if mapped == "on" else "staged")
        assert fr.check(dst.cache, 7, pages2, tokens) == []
        p2.join(30)
        assert dst.slots_free() == 4
    finally:
        dst.close()


@pytest.mark.parametrize("mapped", MAPPED)
def test_destination_killed_mid_transfer_fails_the_source_fast(mapped, monkeypatch):
    _variant(monkeypatch, mapped)
    q, commands = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=fr.receive_one, args=(BIG, 3, q, commands))
    p.start()
    kind, address = q.get(timeout=60)
    cache = RankCache.allocate(fr.src_spec(1), 0, pages_needed(BIG, 16) + 2)
    src = Source(cache, Settings(**fr.SETTINGS))
    try:
        src.connect([tuple(address)])
        h = src.send("r3", np.arange(pages_needed(BIG, 16)), BIG)
        fr.until(lambda: h.bytes > 0, 30)
        assert h.path == ("mapped" if mapped == "on" else "staged")
        t_kill = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(TransferFailed) as err:
            h.wait(10)
        detect = time.monotonic() - t_kill
        print(f"\ndestination kill -9: detected in {detect * 1e3:.0f} ms: {err.value}")
        assert detect < 5.0
        assert err.value.peer == "destination rank 0"
        fr.until(lambda: (st := src.stats()).slots_free == st.slots_total, 5)  # all free
    finally:
        src.close()
        p.join(5)


LOAD_N = int(os.environ.get("KVSTAGE_LOAD_REQUESTS", "1000"))


def test_load_random_requests_byte_exact_and_nothing_leaked():
    """LOAD_N requests from 1 token to 4x the arena, 32 in flight, prefill TP 2 -> decode TP 1."""
    conc, seed = 32, 11
    most = 4 * 4 * 32  # four arenas of 4 slots x 32 tokens
    dst = _destination(conc * pages_needed(most, 4) + 16)
    pool = fr.PagePool(dst.cache.pages, seed)
    q = CTX.Queue()
    procs = [CTX.Process(target=fr.load_source, args=(dst.address, r, 2, LOAD_N, most, conc, seed, q)) for r in range(2)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    inflight, corrupt, failed, done, i = {}, [], [], 0, 0
    try:
        deadline = time.monotonic() + 600
        while (i < LOAD_N or inflight) and time.monotonic() < deadline:
            for k, (h, ids, tokens) in list(inflight.items()):
                if h.done():
                    del inflight[k]
                    if h.error is not None:
                        failed.append(f"{k}: {h.error}")
                    else:
                        corrupt += [f"q{k}: {e}" for e in fr.check(dst.cache, seed * 100_000 + k, ids, tokens)]
                        done += 1
                    pool.give(ids)
            if i < LOAD_N and len(inflight) < conc:
                tokens = fr.request_tokens(seed, i, most)
                ids = pool.take(pages_needed(tokens, 4))
                if ids is not None:
                    inflight[i] = (dst.expect(f"q{i}", ids, tokens), ids, tokens)
                    i += 1
                    continue
            time.sleep(0.0005)
        reports = [q.get(timeout=60) for _ in procs]
        elapsed = time.monotonic() - t0
        leaked = 4 - dst.slots_free()
        print(f"\nload: {done}/{LOAD_N} requests byte-exact in {elapsed:.1f} s, corrupt {len(corrupt)}, "
              f"failed {len(failed)}, hung {len(inflight)}, leaked slots {leaked}")
        assert not inflight, "hung requests"
        assert corrupt == [] and failed == []
        assert done == LOAD_N
        assert all(r[2] == LOAD_N and r[3] == [] and r[4] == 0 for r in reports), reports
        assert leaked == 0
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        dst.close()
