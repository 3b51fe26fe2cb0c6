"""Rank processes for the fault suite (imported by the tests' child processes, ``support.procs``).

A rank process here is one endpoint (a ``Source`` or a ``Destination``) in a
spawned process, driven by the test over a pipe (``Rank``): it answers each
command once, and can stop itself right after a command (``send`` then
SIGSTOP: a prefill rank that stops right after ``Source.send`` returned).
Every request's bytes are the reference cache of a seed (``fill_shard``), so
the test checks every byte it receives (``check``).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import torch

from kvstage.bench.reference import check_shard, fill_shard
from kvstage.config import Settings
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec
from support.procs import CTX

GEO = KVGeometry(2, 4, 16, "bfloat16")
SETTINGS = dict(arena_mb=1 / 16, stall_timeout_s=5.0)  # 4 slots of 16 KiB: 32 tokens at TP 1


def src_spec(tp: int, geo: KVGeometry = GEO, page: int = 16) -> SideSpec:
    return SideSpec(geo, tp, PageLayout(page))


def dst_spec(tp: int = 1, geo: KVGeometry = GEO, page: int = 4) -> SideSpec:
    return SideSpec(geo, tp, PageLayout(page))


def until(cond, limit: float = 10.0) -> None:
    """Poll ``cond`` until it holds; fail the test after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def request_tokens(seed: int, i: int, most: int) -> int:
    return int(np.random.default_rng([seed, i]).integers(1, most + 1))


class PagePool:
    """Free page ids of one cache; requests take random ones and give them back."""

    def __init__(self, pages: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(pages))

    def take(self, n: int):
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return np.asarray(out)

    def give(self, ids) -> None:
        self.free.extend(int(x) for x in ids)
        self.rng.shuffle(self.free)


def check(cache, seed: int, ids, tokens: int) -> list[str]:
    return check_shard(cache, seed, ids, tokens, untouched_fill=None)


def flip_page(cache, page: int) -> None:
    """One bit of the first token's second byte of ``page`` in ``cache``'s first buffer (on its device)."""
    buf = cache.buffers[0]
    buf.view(torch.uint8).reshape(buf.shape[0], -1)[int(page), 1] ^= 0x20


def free(st) -> bool:
    """An endpoint's stats say nothing is held: every slot free, no request in flight, no late read."""
    return st.slots_free == st.slots_total and st.requests == 0 and st.late_holds == 0


def free_dict(st: dict) -> bool:
    """``free`` of a rank process's stats (``stats_dict``)."""
    return st["slots_free"] == st["slots_total"] and st["requests"] == 0 and st["late_holds"] == 0


def stats_dict(st) -> dict:
    return {"slots_free": st.slots_free, "slots_total": st.slots_total, "requests": st.requests, "peers": st.peers,
            "engines": st.engines, "late_holds": st.late_holds}


# -- a rank process driven over a pipe ------------------------------------------------------------

class Rank:
    """The test's side of a rank process (``source_rank`` or ``destination_rank``): ``call`` sends one
    command and returns the answer; an ``error`` answer fails the test with the child's message."""

    def __init__(self, target, *args):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        self.recv(120, "start")

    def call(self, *msg, timeout: float = 60.0):
        self.conn.send(msg)
        return self.recv(timeout, msg[0])

    def post(self, *msg) -> None:
        """Send a command whose answer ``recv`` takes later."""
        self.conn.send(msg)

    def recv(self, timeout: float = 60.0, what: str = "an answer"):
        if not self.conn.poll(timeout):
            raise AssertionError(f"rank process {self.pid} gave no answer to {what} within {timeout} s "
                                 f"(exit code {self.proc.exitcode})")
        got = self.conn.recv()
        if got[0] == "error":
            raise AssertionError(f"rank process {self.pid} failed at {what}: {got[1]}")
        return got[1] if len(got) == 2 else got[1:]

    def state(self) -> str:
        """The process's state letter (R, S, T: stopped, Z, ...)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"

    def wait_stopped(self, timeout: float = 10.0) -> None:
        until(lambda: self.state() == "T", timeout)

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.wait_stopped()

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> float:
        """SIGKILL; the monotonic time it was sent."""
        t = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        return t

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.conn.send(("close",))
                self.conn.poll(30)
            except OSError:
                pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class _Answered:
    """A handler's result when it answered on the pipe itself (before stopping its process)."""


_ANSWERED = _Answered()


def _serve(conn, commands: dict) -> None:
    """A rank process's command loop: each command's handler answers it (an exception is its error), unless
    it answered on the pipe itself (``_ANSWERED``: before it stopped its process)."""
    conn.send(("up", os.getpid()))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "close":
                commands["close"]()
                conn.send(("closed", None))
                return
            got = commands[cmd](*args)
            if got is not _ANSWERED:
                conn.send((cmd, got))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def source_rank(conn, tp: int, rank: int, pages: int, settings: dict, engine: str = "", geo=GEO,
                page: int = 16, device: str = "cpu") -> None:
    """Child: source rank ``rank`` of TP ``tp`` (engine ``engine``) in this process. Commands:

    - ``connect`` [addresses] -> the destination ranks it sends to;
    - ``send`` [(req, tokens, seed)], then, dst_engine -> {req: the route's path}: every request's pages filled,
      then sent back to back; with ``then="stop"`` this process stops itself (SIGSTOP) right after the last
      ``send`` returned, its answer already on the pipe;
    - ``wait`` timeout -> {req: (state, error text or None)} of every request sent and not reported yet;
    - ``stream`` req, tokens, seed, written -> the layer groups sent so far (``Source.stream``);
    - ``flip`` req -> None: once ``req`` was routed (its ``ready`` said, its sum pass queued) and this process's
      device work is over, one bit of its first page changes (a page reused before the destination read it);
    - ``stats`` -> its endpoint's stats; ``close``."""
    from kvstage.protocol.request import State
    from kvstage.protocol.source import Source

    cache = RankCache.allocate(src_spec(tp, geo, page), rank, pages, device)
    src = Source(cache, Settings(**settings), engine=engine)
    pool = PagePool(cache.pages, 1000 + rank)
    handles: dict = {}

    def send(reqs, then=None, dst_engine=""):
        taken = []
        for req, tokens, seed in reqs:
            ids = pool.take(pages_needed(tokens, page))
            assert ids is not None, f"source rank {rank}: no free pages for {req}"
            fill_shard(cache, seed, ids, tokens)
            taken.append((req, tokens, ids))
        paths = {}
        for req, tokens, ids in taken:
            h = src.send(req, ids, tokens, engine=dst_engine)
            handles[req] = (h, ids)
            paths[req] = h.path
        if then == "stop":
            conn.send(("send", paths))
            os.kill(os.getpid(), signal.SIGSTOP)
            return _ANSWERED
        return paths

    def wait(timeout):
        out, deadline = {}, time.monotonic() + timeout
        for req, (h, ids) in list(handles.items()):
            try:
                h.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                out[req] = (h.state.value, "not final")
                continue
            except Exception:
                pass
            out[req] = (h.state.value, None if h.state is State.DONE else str(h.error))
            del handles[req]
            pool.give(ids)
        return out

    streams: dict = {}

    def stream(req, tokens, seed, written):
        """Fill ``req``'s pages and stream it, its forward having written ``written`` layers so far (the
        groups those cover are sent); called again with more layers, it sends the next groups."""
        if req not in streams:
            ids = pool.take(pages_needed(tokens, page))
            assert ids is not None, f"source rank {rank}: no free pages for {req}"
            fill_shard(cache, seed, ids, tokens)
            streams[req] = (src.stream(req, ids, tokens), ids)
        st = streams[req][0]
        st.written(written)
        return [[g.start, g.stop] for g in st.groups[:len(st.handles)]]

    def flip(req):
        h, ids = handles[req]
        until(lambda: h.path is not None)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        flip_page(cache, ids[0])

    commands = {"connect": lambda addresses: src.connect([tuple(a) for a in addresses]), "send": send, "wait": wait,
                "stream": stream, "flip": flip, "stats": lambda: stats_dict(src.stats()), "close": src.close}
    _serve(conn, commands)


def destination_rank(conn, tp: int, rank: int, pages: int, settings: dict, engine: str = "", geo=GEO,
                     page: int = 4) -> None:
    """Child: destination rank ``rank`` of TP ``tp`` in this process. Commands: ``address``; ``expect``
    [(req, tokens, seed)], src_engine -> None; ``reading`` timeout -> once a request is being read (every
    writer ready and a chunk holding a slot, or its page-run reads posted); ``wait`` timeout ->
    {req: (state, error, corrupt)}; ``stats``; ``close``."""
    from kvstage.protocol.destination import Destination
    from kvstage.protocol.request import State

    cache = RankCache.allocate(dst_spec(tp, geo, page), rank, pages)
    dst = Destination(cache, Settings(**settings), engine=engine)
    pool = PagePool(cache.pages, 2000 + rank)
    handles: dict = {}

    def expect(reqs, src_engine=""):
        for req, tokens, seed in reqs:
            ids = pool.take(pages_needed(tokens, page))
            assert ids is not None, f"destination rank {rank}: no free pages for {req}"
            handles[req] = (dst.expect(req, ids, tokens, engine=src_engine), ids, tokens, seed)

    def reading(timeout):
        def now_reading():
            st = dst.stats()
            return any(h.state is State.TRANSFERRING for h, *_ in handles.values()) and st.slots_free < st.slots_total
        until(now_reading, timeout)

    def wait(timeout):
        out, deadline = {}, time.monotonic() + timeout
        for req, (h, ids, tokens, seed) in list(handles.items()):
            try:
                h.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                out[req] = (h.state.value, "not final", [])
                continue
            except Exception:
                pass
            ok = h.state is State.DONE
            out[req] = (h.state.value, None if ok else str(h.error), check(cache, seed, ids, tokens) if ok else [])
            del handles[req]
            pool.give(ids)
        return out

    commands = {"address": lambda: list(dst.address), "expect": expect, "reading": reading, "wait": wait,
                "stats": lambda: stats_dict(dst.stats()), "close": dst.close}
    _serve(conn, commands)


def send_one(address, rank: int, tp: int, tokens: int, seed: int, report, over: dict | None = None) -> None:
    """Connect as source ``rank`` of ``tp``, send one request ``r{seed}``, report the outcome.
    ``over``: settings that differ from ``SETTINGS``."""
    from kvstage.protocol.source import Source

    cache = RankCache.allocate(src_spec(tp), rank, pages_needed(tokens, 16) + 3)
    pages = np.random.default_rng(seed).permutation(cache.pages)[: pages_needed(tokens, 16)]
    fill_shard(cache, seed, pages, tokens)
    src = Source(cache, Settings(**(SETTINGS | (over or {}))))
    src.connect([tuple(address)])
    report.put(("sending", rank))
    h = src.send(f"r{seed}", pages, tokens)
    try:
        h.wait(60)
        report.put(("done", rank, None))
    except Exception as e:
        report.put(("failed", rank, str(e)))
    time.sleep(0.5)
    src.close()


def receive_one(tokens: int, seed: int, report, commands) -> None:
    """A destination that expects one request ``r{seed}`` and reports its address and outcome."""
    from kvstage.protocol.destination import Destination

    cache = RankCache.allocate(dst_spec(), 0, pages_needed(tokens, 4) + 3)
    dst = Destination(cache, Settings(**SETTINGS))
    pages = np.random.default_rng(seed + 1).permutation(cache.pages)[: pages_needed(tokens, 4)]
    h = dst.expect(f"r{seed}", pages, tokens)
    report.put(("address", dst.address))
    commands.get()
    h.wait(60)


def receive_cuda(tokens: int, seed: int, report, commands) -> None:
    """A destination on GPU 0 (its arena shared with sources on that GPU) that expects one
    request ``r{seed}``, reports its address, then whether every byte of it arrived."""
    from kvstage.protocol.destination import Destination

    cache = RankCache.allocate(dst_spec(), 0, pages_needed(tokens, 4) + 3, "cuda:0")
    dst = Destination(cache, Settings(**SETTINGS))
    pages = np.random.default_rng(seed + 1).permutation(cache.pages)[: pages_needed(tokens, 4)]
    h = dst.expect(f"r{seed}", pages, tokens)
    report.put(("address", dst.address))
    try:
        h.wait(60)
        report.put(("checked", h.path, check(cache, seed, pages, tokens)))
    except Exception as e:
        report.put(("failed", str(e), []))
    commands.get(timeout=60)
    dst.close()


def load_source(address, rank: int, tp: int, n: int, most: int, conc: int, seed: int, report,
                over: dict | None = None) -> None:
    """Send requests 0..n-1 (sizes from the shared schedule), ``conc`` in flight at most; report how many were
    sent, the failures, the requests left in flight, the endpoint's stats at the end and the paths taken."""
    from kvstage.protocol.source import Source

    cache = RankCache.allocate(src_spec(tp), rank, conc * pages_needed(most, 16) + 8)
    pool = PagePool(cache.pages, seed + 100 + rank)
    src = Source(cache, Settings(**(SETTINGS | (over or {}))))
    src.connect([tuple(address)])
    inflight, failed, i, paths = {}, [], 0, {}
    deadline = time.monotonic() + 600
    while (i < n or inflight) and time.monotonic() < deadline:
        for k, (h, ids) in list(inflight.items()):
            if h.done():
                del inflight[k]
                pool.give(ids)
                if h.error is not None:
                    failed.append(f"{k}: {h.error}")
        if i < n and len(inflight) < conc:
            tokens = request_tokens(seed, i, most)
            ids = pool.take(pages_needed(tokens, 16))
            if ids is not None:
                fill_shard(cache, seed * 100_000 + i, ids, tokens)
                inflight[i] = (src.send(f"q{i}", ids, tokens), ids)
                paths[inflight[i][0].path] = paths.get(inflight[i][0].path, 0) + 1
                i += 1
                continue
        time.sleep(0.0005)
    # every request final here: what the source still holds once the destination's last messages are in
    settle = time.monotonic() + 10
    while not free(src.stats()) and time.monotonic() < settle:
        time.sleep(0.01)
    report.put(("load", rank, i, failed, len(inflight), stats_dict(src.stats()), paths))
    time.sleep(0.5)
    src.close()


def two_to_one(
    settings: Settings, n: int, tokens: int, seed: int, content: int, copier: str | None = None, device: str = "cpu"
):
    """A destination (TP 1, page 4) and two sources (TP 2, page 16) connected to it, in
    this process, with random pages for ``n`` requests of ``tokens`` tokens on each side;
    each source's pages of request k hold the reference content of seed ``content + k``.
    Returns (destination, sources, destination pages, each source's pages), one row per
    request; ``copier`` names every cache's copier (None: the rule's), ``device`` where the caches are. The
    caller closes the endpoints."""
    return connected(settings, n, tokens, seed, content, copier, device)


def connected(
    settings: Settings,
    n: int,
    tokens: int,
    seed: int,
    content: int,
    copier: str | None = None,
    device: str = "cpu",
    src_tp: int = 2,
    dst_page: int = 4,
):
    """``two_to_one`` with ``src_tp`` sources (page 16) and a destination of page ``dst_page``: TP 1 to TP 1 at
    page 16 is a pair the direct path can carry (whole shards, equal paging)."""
    from kvstage.protocol.destination import Destination
    from kvstage.protocol.source import Source

    dcache = RankCache.allocate(
        dst_spec(page=dst_page), 0, n * pages_needed(tokens, dst_page) + 4, device, copier=copier
    )
    dst = Destination(dcache, settings)
    srcs = []
    for rank in range(src_tp):
        cache = RankCache.allocate(src_spec(src_tp), rank, n * pages_needed(tokens, 16) + 2, device, copier=copier)
        srcs.append(Source(cache, settings))
        srcs[-1].connect([dst.address])
    rng = np.random.default_rng(seed)
    dpages = rng.permutation(dcache.pages)[: n * pages_needed(tokens, dst_page)].reshape(n, -1)
    spages = [rng.permutation(s.cache.pages)[: n * pages_needed(tokens, 16)].reshape(n, -1) for s in srcs]
    for k in range(n):
        for s, p in zip(srcs, spages):
            fill_shard(s.cache, content + k, p[k], tokens)
    return dst, srcs, dpages, spages


def send_holding_the_gil(address, tokens: int, seed: int, hold_s: int, report) -> None:
    """Send one request ``r{seed}`` as source rank 0 of TP 1 on the read path, larger than this rank's arena:
    its later chunks are gathered by this process's loop as the destination's reads free slots. Once the
    destination has read one, hold this process's GIL for ``hold_s`` seconds (a C call made through
    ``ctypes.PyDLL``, which keeps the GIL): what a busy engine does to its endpoint's loop. Reports the
    outcome."""
    import ctypes

    from kvstage.protocol.request import State
    from kvstage.protocol.source import Source

    cache = RankCache.allocate(src_spec(1), 0, pages_needed(tokens, 16) + 3)
    pages = np.random.default_rng(seed).permutation(cache.pages)[: pages_needed(tokens, 16)]
    fill_shard(cache, seed, pages, tokens)
    src = Source(cache, Settings(**(SETTINGS | {"path": "read"})))
    src.connect([tuple(address)])
    h = src.send(f"r{seed}", pages, tokens)
    until(lambda: h.state is not State.PENDING, 60)  # the destination said ``read`` for a chunk
    report.put(("holding", hold_s, time.monotonic()))  # sent by the queue's thread only once the hold is over
    ctypes.PyDLL(None).sleep(hold_s)  # no Python thread of this process runs meanwhile
    try:
        h.wait(120)
        report.put(("done", 0, h.path))
    except Exception as e:
        report.put(("failed", 0, str(e)))
    time.sleep(0.5)
    src.close()


def check_suffix(cache, seed: int, pages, first: int, tokens: int) -> None:
    """``pages`` hold tokens ``first .. first + tokens`` of the reference cache, exactly (plain indexing
    of a TP-1 NHD cache): a destination that had the first ``first`` tokens cached received the rest."""
    import torch

    from kvstage.bench.reference import full_buffer
    from kvstage.layout import token_positions

    g, size = cache.spec.geometry, cache.spec.page.page_size
    pid, off = token_positions(np.asarray(pages), size, 0, tokens)
    for b, buf in enumerate(cache.buffers):
        want = full_buffer(seed, b, first + tokens, g.kv_heads, g.head_bytes())[first:]
        got = buf.view(torch.uint8).view(cache.pages, size, g.kv_heads, g.head_bytes())[pid, off]
        assert bool((got == want).all()), f"buffer {b}: not the tokens {first}..{first + tokens}"
