"""One endpoint per rank serves every peer engine (xPyD): real processes, real NIXL and UCX.

Each prefill engine is a process of its own holding all its ranks' ``Source``
endpoints under one engine id; the decode engines' ``Destination`` endpoints
live in the test process. Every request is checked byte for byte against the
full cache sharded by the destination's TP.
"""

import os
import signal
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from support import multi_peer_ranks as mr
from support.marks import over
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import PageLayout, pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

from support.procs import CTX  # forked from a warm server, as spawned children were
BIG = 20_000  # tokens: hundreds of chunks through 16 KiB slots (a schedule's most=-BIG: exactly that many)


class DecodeEngine:
    """A decode engine's ranks in this process, with a pool of pages per rank."""

    def __init__(self, name: str, tp: int, pages: int, **settings):
        spec = SideSpec(fr.GEO, tp, PageLayout(4))
        self.name = name
        self.ranks = [Destination(RankCache.allocate(spec, r, pages), Settings(**(mr.SETTINGS | settings)), engine=name)
                      for r in range(tp)]
        self.pools = [fr.PagePool(pages, 7 + r) for r in range(tp)]

    @property
    def addresses(self) -> list:
        return [d.address for d in self.ranks]

    def expect(self, src_engine: str, req: str, tokens: int, seed: int) -> list:
        """Expect ``req`` of prefill engine ``src_engine`` on every rank: [(rank, handle, pages, tokens, seed)]."""
        out = []
        for d, pool in zip(self.ranks, self.pools):
            ids = pool.take(pages_needed(tokens, 4))
            assert ids is not None, "the test's page pool is too small"
            out.append((d, d.expect(req, ids, tokens, engine=src_engine), ids, tokens, seed))
        return out

    def close(self) -> None:
        for d in self.ranks:
            d.close()


def _start(engine: str, tp: int, targets: list[DecodeEngine], n: int, most: int, seed: int, conc: int = 2,
           over: dict | None = None):
    report, commands = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=mr.source_engine, args=(engine, tp, [(t.name, t.addresses) for t in targets], n, most,
                                                   seed, conc, report, commands, over))
    p.start()
    return p, report, commands


def _expect_schedule(src_engine: str, seed: int, n: int, most: int, targets: list[DecodeEngine]) -> list:
    out = []
    for i, (name, tokens, t) in enumerate(mr.schedule(seed, n, most, len(targets))):
        out += targets[t].expect(src_engine, name, tokens, mr.content(seed, i))
    return out


def _ready(report, engine: str) -> None:
    got = report.get(timeout=120)
    assert got == ("ready", engine), got


def _check_all(expected: list, within: float = 120) -> None:
    """Every expected request done and byte-exact on every rank."""
    for d, h, ids, tokens, seed in expected:
        h.wait(within)
        assert fr.check(d.cache, seed, ids, tokens) == [], f"{h.req} on {d.rank}"


def _done(report, engine: str, n: int) -> None:
    got = report.get(timeout=180)
    assert got[:2] == ("done", engine) and got[2] == n and got[3] == [], got


def _stop(*procs) -> None:
    for p, _, commands in procs:
        commands.put("close")
    for p, _, _ in procs:
        p.join(30)
        if p.is_alive():
            p.kill()


@pytest.mark.parametrize("transport", [over("nixl"), over("ucx")])
def test_two_prefill_engines_of_different_tp_into_one_decode_rank(transport):
    """Prefill engines at TP 2 and TP 4 send interleaved random requests to one decode rank
    (TP 1) at once: one endpoint, two plans, one arena shared, every byte right."""
    dec = DecodeEngine("dec", 1, 400, transport=transport)
    procs = []
    try:
        expected = _expect_schedule("a", 11, 12, 48, [dec]) + _expect_schedule("b", 12, 12, 48, [dec])
        procs = [_start("a", 2, [dec], 12, 48, 11, over={"transport": transport}),
                 _start("b", 4, [dec], 12, 48, 12, over={"transport": transport})]
        for (_, report, _), name in zip(procs, "ab"):
            _ready(report, name)
        for _, _, commands in procs:
            commands.put("go")
        for (_, report, _), name in zip(procs, "ab"):
            _done(report, name, 12)
        _check_all(expected)
        st = dec.ranks[0].stats()
        assert (st.engines, st.peers, st.slots_free, st.requests) == (2, 6, st.slots_total, 0)
    finally:
        _stop(*procs)
        dec.close()


@pytest.mark.parametrize("transport", [over("nixl"), over("ucx")])
def test_one_prefill_engine_into_decode_engines_of_different_tp(transport):
    """A prefill rank (TP 1) sends interleaved requests to a decode engine at TP 1 and one at
    TP 2 through one ``Source``: the same rank, two plans."""
    d1, d2 = DecodeEngine("d1", 1, 300, transport=transport), DecodeEngine("d2", 2, 300, transport=transport)
    procs = []
    try:
        expected = _expect_schedule("p", 21, 12, 48, [d1, d2])
        procs = [_start("p", 1, [d1, d2], 12, 48, 21, over={"transport": transport})]
        _ready(procs[0][1], "p")
        procs[0][2].put("go")
        _done(procs[0][1], "p", 12)
        _check_all(expected)
        assert [d.stats().engines for d in d1.ranks + d2.ranks] == [1, 1, 1]
    finally:
        _stop(*procs)
        d1.close()
        d2.close()


def _reading(dec: DecodeEngine, h) -> bool:
    """The destination rank reads ``h``: every writer ready, and a chunk of it holds a slot."""
    st = dec.ranks[0].stats()
    return h.state is State.TRANSFERRING and st.slots_free < st.slots_total


def test_a_killed_prefill_engine_fails_only_its_own_requests_and_comes_back():
    """Prefill engine a (TP 2) is killed while its long request is read and engine b (TP 4) keeps sending:
    a's request fails within 1 s, naming its rank and engine, and so does a request of a expected only
    after it is gone, at once; b's all complete byte-exact, every slot comes back; then a restarts under
    the same engine id and transfers again."""
    dec = DecodeEngine("dec", 1, pages_needed(BIG, 4) + 800)
    procs = []
    try:
        (_, big, _, _, _), = dec.expect("a", "q0", BIG, mr.content(31, 0))
        (_, unsent, _, _, _), = dec.expect("a", "q9", 64, mr.content(31, 9))  # a never sends it
        expected_b = _expect_schedule("b", 32, 40, 64, [dec])
        a = _start("a", 2, [dec], 1, -BIG, 31, conc=1)  # one request of exactly BIG tokens
        b = _start("b", 4, [dec], 40, 64, 32)
        procs = [a, b]
        _ready(a[1], "a")
        _ready(b[1], "b")
        a[2].put("go")
        fr.until(lambda: _reading(dec, big), 60)
        b[2].put("go")
        time.sleep(0.2)
        assert big.state is State.TRANSFERRING
        t_kill = time.monotonic()
        os.kill(a[0].pid, signal.SIGKILL)
        with pytest.raises(TransferFailed) as err:
            big.wait(10)
        detect = time.monotonic() - t_kill
        print(f"\nengine a killed: its request failed in {detect * 1e3:.0f} ms: {err.value}")
        assert "of engine a" in str(err.value) and detect < 1.0, err.value
        with pytest.raises(TransferFailed, match="of engine a"):  # expected, not sent yet: it fails with a's ranks
            unsent.wait(1.0)
        a[0].join(10)
        fr.until(lambda: dec.ranks[0].stats().engines == 1, 5)  # every rank of a is gone
        (_, late, _, _, _), = dec.expect("a", "q1", 64, mr.content(31, 1))  # a request of a, expected after
        assert late.done() and late.state is State.FAILED  # at once, in ``expect``
        assert late.error.peer == "prefill engine 'a'" and "every rank of prefill engine 'a' left" in late.error.cause
        _done(b[1], "b", 40)
        _check_all(expected_b)
        fr.until(lambda: fr.free(dec.ranks[0].stats()), 10)  # nothing leaked to the lost engine

        # engine a comes back: a new process, new agents, the same engine id and ranks; its requests are
        # expected once it is connected (until then a request naming a fails at once, as ``late`` did)
        again = _start("a", 2, [dec], 6, 48, 33)
        procs.append(again)
        _ready(again[1], "a")
        assert dec.ranks[0].connected("a")
        expected_a = _expect_schedule("a", 33, 6, 48, [dec])
        again[2].put("go")
        _done(again[1], "a", 6)
        _check_all(expected_a)
        st = dec.ranks[0].stats()
        assert (st.engines, st.slots_free, st.requests) == (2, 4, 0)
    finally:
        _stop(*procs)
        dec.close()


def test_a_stalled_prefill_engine_does_not_stall_the_others():
    """Engine a (TP 1) is stopped (SIGSTOP) in the middle of a long request on the read path, larger than its
    arena: its later chunks need a's own loop. Engine b's requests, sent after, complete byte-exact while a
    is stopped, and a's request waits, neither done nor failed. Resumed, a completes too: slow is not failed."""
    patient = {"peer_timeout_s": 120.0, "stall_timeout_s": 120.0}
    dec = DecodeEngine("dec", 1, pages_needed(BIG, 4) + 400, **patient)
    procs = []
    try:
        (_, big, big_ids, _, _), = dec.expect("a", "q0", BIG, mr.content(41, 0))
        expected_b = _expect_schedule("b", 42, 8, 48, [dec])
        a = _start("a", 1, [dec], 1, -BIG, 41, conc=1, over=patient | {"path": "read"})
        b = _start("b", 1, [dec], 8, 48, 42, over=patient)
        procs = [a, b]
        _ready(a[1], "a")
        _ready(b[1], "b")
        a[2].put("go")
        fr.until(lambda: _reading(dec, big), 60)
        os.kill(a[0].pid, signal.SIGSTOP)
        try:
            time.sleep(0.5)  # what a had gathered is read; the rest of its request waits for a's loop
            t0 = time.monotonic()
            b[2].put("go")
            _done(b[1], "b", 8)
            took = time.monotonic() - t0
            print(f"\nengine b's 8 requests beside a stopped engine a: {took:.2f} s")
            _check_all(expected_b, within=1)
            assert big.state is State.TRANSFERRING
        finally:
            os.kill(a[0].pid, signal.SIGCONT)
        _done(a[1], "a", 1)
        big.wait(120)
        assert fr.check(dec.ranks[0].cache, mr.content(41, 0), big_ids, BIG) == []
        fr.until(lambda: fr.free(dec.ranks[0].stats()), 10)
    finally:
        _stop(*procs)
        dec.close()
