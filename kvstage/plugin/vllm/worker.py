"""The connector's worker side: one TP rank's kvstage endpoints, for the engine's life.

A producer rank holds one ``Source``: right after the forward that computed a
remote-decode request's prompt (``after_forward``, from vLLM's
``wait_for_save``), it sends the request to whichever decode engine reads it
(``Source.send(engine=None)``); the blocks stay until that decode has read them,
it released them, or ``lease_s`` passed. A consumer rank holds one
``Destination``: ``start_load`` expects each request and reads it; a prefill
engine not connected to it yet is asked to connect, once, through its ranks'
connect ports (``pull``), and the requests it sent before are read as soon as it
has. Every prefill is then off the decode's path: the decode reads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from kvstage import metrics as kvmetrics
from kvstage.errors import ConfigError, KVStageError
from kvstage.plugin.vllm.layout import VllmKVLayout, describe
from kvstage.plugin.vllm.meta import (KVStageHandshake, KVStageMeta, Recv, decode_settings, kvreq_of, model_identity,
                                      prefill_settings)
from kvstage.plugin.vllm.pull import PullError, PullServer, pull
from kvstage.plugin.vllm.stats import KVStageStats
from kvstage.protocol.gate import check_listen
from kvstage.protocol.request import State

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.kvstage.plugin.vllm")


def _on_every_cpu() -> None:
    """Let the calling thread run on every CPU this process may use. vLLM pins a CPU worker's
    main thread to its cores, and threads inherit the pin; between steps that thread (or another
    engine's on the same core) spins, and kvstage's threads there would get no CPU until a peer's
    timeout ends the spin. Control threads need little CPU, but they need it on time."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or a cpuset that refuses: keep the inherited mask
        pass


@contextlib.contextmanager
def _threads_on_every_cpu():
    """Threads started inside (the endpoint's loop and pinger, its transport's, the connect port's)
    run on every CPU; the calling thread keeps its own pin afterwards."""
    try:
        saved = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        yield
        return
    _on_every_cpu()
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


@dataclass
class _Produced:
    """A prefill request's blocks on this rank, sent (once its prompt is computed) to whichever decode reads it."""

    blocks: list[int]
    handle: Any = None  # kvstage TransferHandle, once sent
    freed: bool = False  # the scheduler delays freeing its blocks until we report it


@dataclass
class _Loading:
    handle: Any
    engine: str  # the prefill engine it comes from
    kvreq: str
    started: float
    error: str | None = None  # failed before kvstage took it


class Worker:
    """One TP rank. A producer rank sends with its one kvstage ``Source``; a consumer rank reads
    with its one ``Destination``; each serves every peer engine."""

    def __init__(self, vllm_config: "VllmConfig", extra: dict):
        self.vllm_config = vllm_config
        self.extra = extra
        cfg = vllm_config.kv_transfer_config
        self.producer = cfg.kv_role in ("kv_producer", "kv_both")
        self.consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = cfg.engine_id
        self.settings = decode_settings(extra)
        self.rank, self.tp = 0, 1
        self.layout: VllmKVLayout | None = None
        self.cache = None
        self.server: PullServer | None = None
        self.src = None  # kvstage Source (producer), for every decode engine
        self.dst = None  # kvstage Destination (consumer), for every prefill engine
        self._connect_lock = threading.Lock()  # one connect at a time on the Source
        self._lock = threading.Lock()
        self._produced: dict[str, _Produced] = {}
        self._finished: set[str] = set()  # finished_req_ids seen (send reports must name one)
        self._loading: dict[str, _Loading] = {}
        self._asked: dict[str, float] = {}  # prefill engine -> when this rank last asked its ranks to connect
        # asks to connect (one per prefill rank; a hung prefill holds one for pull_timeout_s), releases
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvstage",
                                                           initializer=_on_every_cpu)
        self.recent: list[dict] = []  # the last receives on this rank (tests, benchmarks)
        self.policy = getattr(cfg, "kv_load_failure_policy", "fail")  # what vLLM does after a failed load
        self.stats = KVStageStats()  # this step's loads, for vLLM's connector stats
        self.summary = kvmetrics.LoadSummary("kvstage: rank 0")  # the once-a-minute INFO line of loads

    # -- setup ---------------------------------------------------------------------------------
    def register(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from kvstage.staging.cache import RankCache

        vc = self.vllm_config
        self.rank = get_tensor_model_parallel_rank()
        self.tp = vc.parallel_config.tensor_parallel_size
        self.summary.what = f"kvstage: rank {self.rank}"
        self.layout = describe(kv_caches, vc.model_config.get_total_num_kv_heads(), vc.cache_config.block_size,
                               getattr(vc.cache_config, "kv_cache_layout", None))
        spec = self.layout.spec(self.tp)
        self.cache = RankCache(spec, self.rank, self.layout.buffers(kv_caches))
        with _threads_on_every_cpu():
            self._open_endpoints(vc)
        logger.info("kvstage: rank %d/%d (%s): %d layers as kvstage %s, %d heads here, pages of %d %s%s; its "
                    "threads run on every CPU, not on the worker's pinned cores",
                    self.rank, self.tp, _role(self), self.layout.layers, spec.geometry, spec.local_heads(),
                    self.layout.page_size, self.layout.order,
                    f", connect port {self.server.address[0]}:{self.server.address[1]}" if self.server else "")

    def _open_endpoints(self, vc) -> None:
        """This rank's one Source (prefill) and one Destination (decode) for the engine's life."""
        if self.producer:
            check_listen(self.settings, (self.extra["host"], 0), f"kvstage prefill rank {self.rank}'s connect port")
            from kvstage.protocol.source import Source

            self.src = Source(self.cache, prefill_settings(self.extra), engine=self.engine_id, model=model_identity(vc))
            self.server = PullServer(self.extra["host"], self._on_connect, token=self.settings.auth_token)
        if self.consumer:
            from kvstage.protocol.destination import Destination

            self.dst = Destination(self.cache, self.settings, listen=(self.extra["host"], 0), engine=self.engine_id,
                                   model=model_identity(vc))

    def handshake(self) -> KVStageHandshake | None:
        if self.layout is None:
            return None
        return KVStageHandshake(self.rank, tuple(self.server.address) if self.server else None, self.layout.to_wire())

    # -- decode: receiving ---------------------------------------------------------------------
    def start_load(self, meta: KVStageMeta) -> None:
        for req_id in meta.cancel:
            ld = self._loading.get(req_id)
            if ld is not None and ld.handle is not None:
                ld.handle.abort("the decode request finished while its KV was loading")
        for r in meta.recv:
            self._start_recv(r)
        for params in meta.release:
            self._release(params)

    def _start_recv(self, r: Recv) -> None:
        p = r.params
        engine = str(p.get("remote_engine_id"))
        kvreq = kvreq_of(engine, str(p.get("remote_request_id")))
        try:
            if not self.consumer:
                raise ConfigError("this engine does not receive KV (kv_role must be kv_consumer or kv_both)")
            self.layout.check_peer(p.get("remote_layout"))
            handle = self.dst.expect(kvreq, self.layout.pages(r.blocks), self.layout.tokens(len(r.blocks)),
                                     engine=engine, first=self.layout.tokens(r.skip))
        except (KVStageError, ValueError, KeyError) as e:
            logger.warning("kvstage: rank %d cannot receive %s (%s): %s", self.rank, r.req_id, kvreq, e)
            self._loading[r.req_id] = _Loading(None, engine, kvreq, time.perf_counter(), str(e))
            return
        self._loading[r.req_id] = _Loading(handle, engine, kvreq, time.perf_counter())
        if not self.dst.connected(engine):
            self._ask_to_connect(engine, p.get("remote_ranks") or (), handle)

    def _ask_to_connect(self, engine: str, addresses, handle) -> None:
        """A prefill engine not connected here (its first request, or a rank that came back): ask each of
        its ranks to connect to this rank; what it sent before is read once it has. Asked at most once
        per ``pull_timeout_s`` while it is not connected."""
        now = time.monotonic()
        if now - self._asked.get(engine, -1e9) < self.extra["pull_timeout_s"]:
            return
        self._asked[engine] = now
        msg = {"type": "connect", "address": list(self.dst.address), "engine": self.engine_id, "rank": self.rank}
        for addr in addresses:
            self._pool.submit(self._connect_me, handle, addr, msg)

    def _connect_me(self, handle, addr, msg: dict) -> None:
        try:
            pull(addr, msg, self.settings.auth_token, self.extra["pull_timeout_s"])
        except PullError as e:
            handle.abort(str(e))

    def _release(self, params: dict) -> None:
        """The decode will not read a prefilled request (cached here, or aborted): its prefill ranks hear
        ``abort`` from this rank's Destination, where they are connected, and free its blocks; otherwise
        they free them after ``lease_s``."""
        engine = str(params.get("remote_engine_id"))
        try:
            self.dst.release(kvreq_of(engine, str(params.get("remote_request_id"))), engine=engine,
                             reason="released: the decode will not read it")
        except (KVStageError, KeyError) as e:
            logger.info("kvstage: release of %s not delivered (%s); the prefill frees it after its lease",
                        params.get("remote_request_id"), e)

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        for req_id, ld in list(self._loading.items()):
            if ld.handle is None:
                failed = ld.error
            elif not ld.handle.done() or self._still_landing(ld):
                continue
            else:
                failed = None if ld.handle.state is State.DONE else str(ld.handle.error)
            del self._loading[req_id]
            out.finished_recving.add(req_id)
            seconds = time.perf_counter() - ld.started
            nbytes = ld.handle.bytes if ld.handle else 0
            if failed:
                out.failed_recving.add(req_id)
                err = ld.handle.error if ld.handle is not None else None
                stage, peer, cause = (err.stage, err.peer, err.cause) if err is not None else ("start", "its prefill engine", failed)
                logger.warning("kvstage: rank %d: KV load of request %s (%s) failed after %.3f s at stage %s with "
                               "%s: %s; vLLM %s (kv_load_failure_policy=%s)", self.rank, req_id, ld.kvreq, seconds,
                               stage, peer, cause, "recomputes its prompt" if self.policy == "recompute"
                               else "fails the request", self.policy)
                self.stats.record_load(False, seconds, nbytes, kvmetrics.classify(cause, stage))
            else:
                logger.debug("kvstage: rank %d: KV of %s received in %.3f s (%d bytes, %s)", self.rank, req_id,
                             seconds, ld.handle.bytes, ld.handle.path)
                self.stats.record_load(True, seconds, nbytes)
            self.summary.add(not failed, seconds, nbytes)
            self.recent = (self.recent + [{"req": req_id, "seconds": seconds, "ok": not failed, "error": failed,
                                           "bytes": ld.handle.bytes if ld.handle else 0,
                                           "path": ld.handle.path if ld.handle else None}])[-64:]
        line = self.summary.due()
        if line:
            logger.info("%s", line)
        if self.producer:
            out.finished_sending = self._finished_sending(finished_req_ids)
        return out

    def _still_landing(self, ld: _Loading) -> bool:
        """A failed request may still have reads in flight into its pages: vLLM must not reuse
        them before the destination forgot it."""
        return ld.handle.state is State.FAILED and self.dst.tracks(ld.kvreq, engine=ld.engine)

    # -- prefill: sending ----------------------------------------------------------------------
    def after_forward(self, meta: KVStageMeta) -> None:
        """After the step's forward: prompts computed in it are sent now, to whichever decode reads them.
        On a GPU nothing waits here: kvstage orders its reads after the work queued on this stream."""
        with self._lock:
            for req_id, (blocks, done, prompt) in meta.produce.items():
                e = self._produced.setdefault(req_id, _Produced(blocks))
                if e.handle is None:
                    e.blocks = blocks
                if done and e.handle is None and self.src is not None:
                    self._send(req_id, e, prompt)
            for req_id in meta.preempted:
                e = self._produced.get(req_id)
                if e is not None and e.handle is not None and not e.handle.done():
                    e.handle.abort("the prefill request was preempted")
                    e.handle = None
            for req_id in meta.drop:
                e = self._produced.pop(req_id, None)
                if e is not None and e.handle is not None:
                    e.handle.abort("the prefill request was aborted")
            for req_id in meta.delay_freed:
                self._produced.setdefault(req_id, _Produced([])).freed = True

    def _send(self, req_id: str, e: _Produced, prompt: int) -> None:
        nblocks = -(-prompt // self.layout.block_size)
        blocks = e.blocks[:nblocks]
        try:
            e.handle = self.src.send(kvreq_of(self.engine_id, req_id), self.layout.pages(blocks),
                                     self.layout.tokens(len(blocks)), engine=None)
        except (KVStageError, ValueError) as err:
            logger.warning("kvstage: rank %d cannot send %s: %s; its decode recomputes or fails it", self.rank,
                           req_id, err)

    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Prefill requests whose blocks vLLM may free now: read by their decode (or failed, released, or
        given up after ``lease_s``). vLLM only accepts ids it has reported finished (``finished_req_ids``,
        this step or before)."""
        self._finished |= set(finished_req_ids)
        done = set()
        with self._lock:
            for req_id in [r for r in self._finished if r in self._produced]:
                e = self._produced[req_id]
                if not e.freed or (e.handle is not None and not e.handle.done()):
                    continue
                if e.handle is not None and e.handle.state is State.FAILED:
                    logger.info("kvstage: %s not read by a decode (%s); freeing its blocks", req_id, e.handle.error)
                del self._produced[req_id]
                done.add(req_id)
            self._finished &= set(self._produced)
        return done

    def _on_connect(self, msg: dict) -> dict:
        """A decode rank asks this prefill rank to connect to it (connect port thread)."""
        addr = msg.get("address")
        if msg.get("type") != "connect" or not (isinstance(addr, list) and len(addr) == 2
                                                 and isinstance(addr[0], str) and type(addr[1]) is int):
            raise PullError(f"malformed {str(msg.get('type'))[:32]} message (expected connect with an address)")
        try:
            with self._connect_lock:
                self.src.connect([(addr[0], addr[1])])
        except KVStageError as err:
            raise PullError(f"prefill rank {self.rank}: {err}") from err
        return {"type": "ok"}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ep in (self.src, self.dst):
            if ep is not None:
                ep.close()


def _role(w: Worker) -> str:
    return "prefill and decode" if w.producer and w.consumer else "prefill" if w.producer else "decode"
