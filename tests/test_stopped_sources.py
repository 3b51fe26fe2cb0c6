"""The decode moves the bytes: a prefill rank's process is not needed after ``Source.send`` returns.

Real rank processes, real transports (nixl, ucx, cma), no mock: source ranks
(4 -> 1 and 1 -> 2) fill requests of 40 to 6,000 tokens from the reference
cache and send them, each fitting its 16 MiB arena, and each source process
stops itself (SIGSTOP) right after its last ``send`` returned. Only then does
the destination ``expect`` them, and every request completes byte-exact while
every source is still stopped, on the read path (gathered into the sources'
arenas at ``send``) and on the pages path (read straight from their pages).
Resumed, each source hears what it missed and its handles end DONE, with every
slot free on both sides.

A request larger than a source's free arena on the read path is not part of
that promise: its later chunks wait for slots, which the source's loop gathers
as the destination's reads free them. It stays unfinished while the source is
stopped and completes byte-exact once it resumes.
"""

import time

import pytest

from support import fault_ranks as fr
from support.marks import over
from kvstage.config import Settings
from kvstage.layout import KVGeometry, pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.staging.cache import RankCache

GEO = KVGeometry(2, 8, 32, "bfloat16")  # 2 KiB a token at TP 1: 6,000 tokens are 12 MB of a 16 MiB arena
ARENA_MB = 16  # 4 slots of 4 MiB on every rank: a chunk is 2,048 tokens (a TP-1 destination's slot)
TOPOLOGIES = {"4to1": (4, 1), "1to2": (1, 2)}
PATHS = {"nixl": ["read", "pages"], "ucx": ["read"], "cma": ["read", "pages"]}  # ucx is two-sided: no page path
#: requests sent together before the sources stop: each round's chunks fit a source's 4 free slots
ROUNDS = [[40, 333, 1777], [6000]]
BIG = 10_000  # 5 chunks of 2,048 tokens: one more than a source's arena holds
SRC_PAGES = pages_needed(BIG, 16) + 16
DST_PAGES = pages_needed(BIG, 4) + 64


def _settings(transport: str, path: str) -> dict:
    return dict(arena_mb=ARENA_MB, transport=transport, path=path)


class Pair:
    """Destination ranks in this process, source ranks each in a process of its own (engine "p")."""

    def __init__(self, topology: str, transport: str, path: str):
        self.src_tp, self.dst_tp = TOPOLOGIES[topology]
        settings = _settings(transport, path)
        self.dsts, self.srcs = [], []
        try:
            self.dsts = [Destination(RankCache.allocate(fr.dst_spec(self.dst_tp, GEO), r, DST_PAGES), Settings(**settings))
                         for r in range(self.dst_tp)]
            self.pools = [fr.PagePool(DST_PAGES, 50 + r) for r in range(self.dst_tp)]
            self.srcs = [fr.Rank(fr.source_rank, self.src_tp, r, SRC_PAGES, settings, "p", GEO) for r in range(self.src_tp)]
            for s in self.srcs:
                assert s.call("connect", [d.address for d in self.dsts]), "a source rank sends to no destination rank"
            fr.until(lambda: all(d.connected("p") for d in self.dsts), 30)
        except BaseException:
            self.close()
            raise

    def send_and_stop(self, reqs: list) -> dict:
        """Every source rank sends ``reqs`` [(req, tokens, seed)] and stops itself right after; the paths."""
        for s in self.srcs:
            s.post("send", reqs, "stop")
        paths = {}
        for s in self.srcs:
            paths.update({(s.pid, req): p for req, p in s.recv(120, "send").items()})
        for s in self.srcs:
            s.wait_stopped()
        return paths

    def expect(self, reqs: list) -> list:
        out = []
        for d, pool in zip(self.dsts, self.pools):
            for req, tokens, seed in reqs:
                ids = pool.take(pages_needed(tokens, 4))
                out.append((d, d.expect(req, ids, tokens, engine="p"), ids, tokens, seed))
        return out

    def give(self, expected: list) -> None:
        for d, _, ids, _, _ in expected:
            self.pools[d.rank].give(ids)

    def resume_and_finish(self) -> dict:
        """Resume every source; each one's report of its requests (every one final)."""
        for s in self.srcs:
            s.resume()
        return {s.pid: s.call("wait", 60) for s in self.srcs}

    def all_free(self) -> None:
        """Nothing held anywhere: every slot back, no request in flight, on every rank."""
        fr.until(lambda: all(fr.free(d.stats()) for d in self.dsts), 10)
        fr.until(lambda: all(not st["requests"] and st["slots_free"] == st["slots_total"]
                             for st in (s.call("stats") for s in self.srcs)), 10)

    def close(self) -> None:
        for s in self.srcs:
            s.close()
        for d in self.dsts:
            d.close()


def _byte_exact(expected: list, within: float) -> None:
    for d, h, ids, tokens, seed in expected:
        h.wait(within)
        assert h.state is State.DONE
        assert fr.check(d.cache, seed, ids, tokens) == [], f"{h.req} on destination rank {d.rank}"


def _cases():
    return [over(t, top, p, id=f"{t}-{p}-{top}") for t in PATHS for p in PATHS[t] for top in TOPOLOGIES]


@pytest.mark.parametrize("transport,topology,path", _cases())
def test_requests_of_stopped_sources_complete_byte_exact(transport, topology, path):
    """Each source stops right after ``send``; the destination expects only then, and reads every byte while
    the sources stay stopped. Resumed, the sources' handles end DONE."""
    pair = Pair(topology, transport, path)
    try:
        for n, sizes in enumerate(ROUNDS):
            reqs = [(f"{path}{n}.{i}", tokens, 100 * n + i) for i, tokens in enumerate(sizes)]
            paths = pair.send_and_stop(reqs)
            assert set(paths.values()) == {path}, paths  # the route took the path the setting forces
            t0 = time.monotonic()
            expected = pair.expect(reqs)
            _byte_exact(expected, 60)
            took = time.monotonic() - t0
            assert [s.state() for s in pair.srcs] == ["T"] * pair.src_tp, "a source ran while it was read"
            print(f"\n{transport} {path} {topology}: {sizes} tokens read from {pair.src_tp} stopped sources in "
                  f"{took * 1e3:.0f} ms")
            reports = pair.resume_and_finish()
            for pid, got in reports.items():
                assert got == {req: ("done", None) for req, _, _ in reqs}, (pid, got)
            pair.give(expected)
            pair.all_free()
    finally:
        pair.close()


@pytest.mark.parametrize("transport", [over(t) for t in PATHS])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_a_read_request_larger_than_the_free_arena_completes_once_the_sources_resume(transport, topology):
    """On the read path a request of more chunks than a source's arena has slots gathers what fits at ``send``;
    the rest waits for the slots the destination's reads free, gathered by the source's loop. While the
    sources are stopped it cannot finish; resumed, it completes byte-exact."""
    pair = Pair(topology, transport, "read")
    try:
        reqs = [("big", BIG, 7)]
        assert set(pair.send_and_stop(reqs).values()) == {"read"}
        expected = pair.expect(reqs)
        time.sleep(1.5)  # the destination reads what was gathered; the rest needs the sources
        assert all(h.state is State.TRANSFERRING for _, h, *_ in expected), [h.state for _, h, *_ in expected]
        assert [s.state() for s in pair.srcs] == ["T"] * pair.src_tp
        t0 = time.monotonic()
        for s in pair.srcs:
            s.resume()
        _byte_exact(expected, 60)
        print(f"\n{transport} {topology}: {BIG} tokens through 4 slots completed {time.monotonic() - t0:.2f} s after "
              "the sources resumed")
        for s in pair.srcs:
            assert s.call("wait", 60) == {"big": ("done", None)}
        pair.give(expected)
        pair.all_free()
    finally:
        pair.close()
