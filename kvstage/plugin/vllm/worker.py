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
from kvstage.plugin.vllm.meta import (
    KVStageHandshake,
    KVStageMeta,
    Recv,
    decode_settings,
    kvreq_of,
    model_identity,
    prefill_settings,
    pull_secret,
)
from kvstage.plugin.vllm.pull import PullError, PullServer, pull
from kvstage.plugin.vllm.stats import KVStageStats
from kvstage.protocol.address import Address, new_secret
from kvstage.protocol.request import State

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvstage.protocol.destination import Destination
    from kvstage.protocol.source import Source
    from kvstage.staging.cache import RankCache

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
    handle: Any = None  # kvstage TransferHandle (or LayerStream, streamed), once sent
    freed: bool = False  # the scheduler delays freeing its blocks until we report it
    streaming: bool = False  # its stream is sending layer groups during this step's forward


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

    def __init__(self, vllm_config: VllmConfig, extra: dict):
        self.vllm_config = vllm_config
        self.extra = extra
        cfg = vllm_config.kv_transfer_config
        self.producer = cfg.kv_role in ("kv_producer", "kv_both")
        self.consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = cfg.engine_id
        self.settings = decode_settings(extra)
        self.rank, self.tp = 0, 1
        self.layout: VllmKVLayout | None = None
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> its index among the KV buffers' layers
        self.cache: RankCache | None = None
        self.server: PullServer | None = None
        self.src: Source | None = None  # kvstage Source (producer), for every decode engine
        self.dst: Destination | None = None  # kvstage Destination (consumer), for every prefill engine
        self._connect_lock = threading.Lock()  # one connect at a time on the Source
        self._lock = threading.Lock()
        self._produced: dict[str, _Produced] = {}
        self._finished: set[str] = set()  # finished_req_ids seen (send reports must name one)
        self._loading: dict[str, _Loading] = {}
        self._asked: dict[str, float] = {}  # prefill engine -> when this rank last asked its ranks to connect
        # asks to connect (one per prefill rank; a hung prefill holds one for pull_timeout_s), releases
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=16, thread_name_prefix="kvstage", initializer=_on_every_cpu
        )
        self.recent: list[dict] = []  # the last receives on this rank (tests, benchmarks)
        self.policy = getattr(cfg, "kv_load_failure_policy", "fail")  # what vLLM does after a failed load
        self.stats = KVStageStats()  # this step's loads, for vLLM's connector stats
        self.summary = kvmetrics.LoadSummary("kvstage: rank 0")  # the once-a-minute INFO line of loads
        #: a producer rank's own secret: its connect port admits whoever holds a request's transfer params,
        #: which carry an HMAC of the request's id under it (``meta.pull_secret``)
        self.secret = new_secret()

    # -- the rank's handles ---------------------------------------------------------------------
    # ``register`` makes them, before vLLM's first step; the Source only on a producer rank, the
    # Destination only on a consumer rank. Each is asked for only on its own role's path.
    @property
    def _layout(self) -> VllmKVLayout:
        assert self.layout is not None, "vLLM registers the KV caches before any step"
        return self.layout

    @property
    def _cache(self) -> RankCache:
        assert self.cache is not None, "vLLM registers the KV caches before any step"
        return self.cache

    @property
    def _source(self) -> Source:
        assert self.src is not None, "only a producer rank sends, and register made its Source"
        return self.src

    @property
    def _dest(self) -> Destination:
        assert self.dst is not None, "only a consumer rank receives, and register made its Destination"
        return self.dst

    # -- setup ---------------------------------------------------------------------------------
    def register(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from kvstage.staging.cache import RankCache

        vc = self.vllm_config
        self.rank = get_tensor_model_parallel_rank()
        self.tp = vc.parallel_config.tensor_parallel_size
        self.summary.what = f"kvstage: rank {self.rank}"
        self.layout = describe(
            kv_caches,
            vc.model_config.get_total_num_kv_heads(),
            vc.cache_config.block_size,
            getattr(vc.cache_config, "kv_cache_layout", None),
        )
        spec = self.layout.spec(self.tp)
        self._layer_index = {name: i for i, name in enumerate(self.layout.names)}
        self.cache = RankCache(spec, self.rank, self.layout.buffers(kv_caches))
        with _threads_on_every_cpu():
            self._open_endpoints(vc)
        logger.info(
            "kvstage: rank %d/%d (%s): %d layers as kvstage %s, %d heads here, pages of %d %s%s; its "
            "threads run on every CPU, not on the worker's pinned cores",
            self.rank,
            self.tp,
            _role(self),
            self.layout.layers,
            spec.geometry,
            spec.local_heads(),
            self.layout.page_size,
            self.layout.order,
            f", connect port {self.server.address[0]}:{self.server.address[1]}" if self.server else "",
        )

    def _open_endpoints(self, vc) -> None:
        """This rank's one Source (prefill) and one Destination (decode) for the engine's life."""
        model = model_identity(vc)  # once, at load: it fingerprints the checkpoint's weights
        if self.producer:
            from kvstage.protocol.source import Source

            self.src = Source(self._cache, prefill_settings(self.extra), engine=self.engine_id, model=model)
            self.server = PullServer(
                self.extra["host"],
                self._on_connect,
                token=self.settings.auth_token,
                secret_of=lambda req: pull_secret(self.secret, req),
                open_to_all=self.settings.allow_unauthenticated,
            )
        if self.consumer:
            from kvstage.protocol.destination import Destination

            self.dst = Destination(
                self._cache, self.settings, listen=(self.extra["host"], 0), engine=self.engine_id, model=model
            )

    def handshake(self) -> KVStageHandshake | None:
        if self.layout is None:
            return None
        return KVStageHandshake(
            self.rank,
            tuple(self.server.address) if self.server else None,
            self.layout.to_wire(),
            self.secret if self.server else "",
        )

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
            self._layout.check_peer(p.get("remote_layout"))
            handle = self._dest.expect(
                kvreq,
                self._layout.pages(r.blocks),
                self._layout.tokens(len(r.blocks)),
                engine=engine,
                first=self._layout.tokens(r.skip),
            )
        except (KVStageError, ValueError, KeyError) as e:
            logger.debug("kvstage: rank %d cannot receive %s (%s): %s", self.rank, r.req_id, kvreq, e)
            self._loading[r.req_id] = _Loading(None, engine, kvreq, time.perf_counter(), str(e))
            return
        self._loading[r.req_id] = _Loading(handle, engine, kvreq, time.perf_counter())
        if not self._dest.connected(engine):
            self._ask_to_connect(engine, p.get("remote_ranks") or (), handle, p)

    def _ask_to_connect(self, engine: str, addresses, handle, params: dict) -> None:
        """A prefill engine not connected here (its first request, or a rank that came back): ask each of
        its ranks to connect to this rank; what it sent before is read once it has. Asked at most once
        per ``pull_timeout_s`` while it is not connected."""
        now = time.monotonic()
        if now - self._asked.get(engine, -1e9) < self.extra["pull_timeout_s"]:
            return
        self._asked[engine] = now
        msg = {
            "type": "connect",
            "address": self._dest.address.url,
            "engine": self.engine_id,
            "rank": self.rank,
            "req": str(params.get("remote_request_id")),
        }
        secrets = params.get("remote_secrets") or [None] * len(addresses)
        for addr, secret in zip(addresses, secrets, strict=False):  # params of an older prefill may lack them
            self._pool.submit(self._connect_me, handle, addr, msg, secret if isinstance(secret, str) else None)

    def _connect_me(self, handle, addr, msg: dict, secret: str | None) -> None:
        try:  # the request's secret for this rank, or the deployment's token where there is one
            pull(addr, msg, secret or self.settings.auth_token, self.extra["pull_timeout_s"])
        except PullError as e:
            handle.abort(str(e))

    def _release(self, params: dict) -> None:
        """The decode will not read a prefilled request (cached here, or aborted): its prefill ranks hear
        ``abort`` from this rank's Destination, where they are connected, and free its blocks; otherwise
        they free them after ``lease_s``."""
        engine = str(params.get("remote_engine_id"))
        try:
            self._dest.release(
                kvreq_of(engine, str(params.get("remote_request_id"))),
                engine=engine,
                reason="released: the decode will not read it",
            )
        except (KVStageError, KeyError) as e:
            logger.info(
                "kvstage: release of %s not delivered (%s); the prefill frees it after its lease",
                params.get("remote_request_id"),
                e,
            )

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
                stage, peer, cause = (
                    (err.stage, err.peer, err.cause) if err is not None else ("start", "its prefill engine", failed)
                )
                # one WARNING per failed load: kvstage's own (its Destination's) where it took the request,
                # else this one; then what vLLM does next
                say = logger.info if ld.handle is not None else logger.warning
                say(
                    "kvstage: rank %d: KV load of request %s (%s) failed after %.3f s at stage %s with %s: %s; "
                    "vLLM %s (kv_load_failure_policy=%s)",
                    self.rank,
                    req_id,
                    ld.kvreq,
                    seconds,
                    stage,
                    peer,
                    cause,
                    "recomputes its prompt" if self.policy == "recompute" else "fails the request",
                    self.policy,
                )
                self.stats.record_load(False, seconds, nbytes, kvmetrics.classify(cause, stage))
            else:
                logger.debug(
                    "kvstage: rank %d: KV of %s received in %.3f s (%d bytes, %s)",
                    self.rank,
                    req_id,
                    seconds,
                    ld.handle.bytes,
                    ld.handle.path,
                )
                self.stats.record_load(True, seconds, nbytes)
            self.summary.add(not failed, seconds, nbytes)
            self.recent = (
                self.recent
                + [
                    {
                        "req": req_id,
                        "seconds": seconds,
                        "ok": not failed,
                        "error": failed,
                        "bytes": ld.handle.bytes if ld.handle else 0,
                        "path": ld.handle.path if ld.handle else None,
                    }
                ]
            )[-64:]
        line = self.summary.due()
        if line:
            logger.info("%s", line)
        if self.producer:
            out.finished_sending = self._finished_sending(finished_req_ids)
        return out

    def _still_landing(self, ld: _Loading) -> bool:
        """A failed request may still have reads in flight into its pages: vLLM must not reuse
        them before the destination forgot it."""
        return ld.handle.state is State.FAILED and self._dest.tracks(ld.kvreq, engine=ld.engine)

    # -- prefill: sending ----------------------------------------------------------------------
    def layer_saved(self, meta: KVStageMeta, layer_name: str) -> None:
        """The forward has written layer ``layer_name`` (vLLM's ``save_kv_layer``, in layer order): prompts
        whose last forward this is start their stream at the first layer, and every group whose layers are
        all written leaves now, while the forward computes the next layers."""
        index = self._layer_index.get(layer_name)
        if index is None or self.src is None or not self.extra["stream_layers"]:
            return  # a layer sharing another's KV (not a buffer of its own)
        e: _Produced | None
        with self._lock:
            if index == 0:
                for req_id, (blocks, done, prompt) in meta.produce.items():
                    e = self._produced.setdefault(req_id, _Produced(blocks))
                    if e.handle is None:
                        e.blocks = blocks
                    if done and e.handle is None:
                        self._send(req_id, e, prompt, stream=True)
            # a kvstage layer is two vLLM layers (its two buffers; ``layout.VllmKVLayout.geometry``)
            written = self._cache.spec.geometry.layers if index + 1 == self._layout.layers else (index + 1) // 2
            for req_id in meta.produce:
                e = self._produced.get(req_id)
                if e is not None and e.streaming:
                    e.handle.written(written)

    def after_forward(self, meta: KVStageMeta) -> None:
        """After the step's forward: prompts computed in it are sent now (what their streams have not sent
        yet), to whichever decode reads them. On a GPU nothing waits here: kvstage orders its reads after
        the work queued on this stream."""
        e: _Produced | None
        with self._lock:
            for req_id, (blocks, done, prompt) in meta.produce.items():
                e = self._produced.setdefault(req_id, _Produced(blocks))
                if e.handle is None:
                    e.blocks = blocks
                if done and e.handle is None and self.src is not None:
                    self._send(req_id, e, prompt)
                if e.streaming:
                    e.handle.written(self._cache.spec.geometry.layers)
                    e.streaming = False
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

    def _send(self, req_id: str, e: _Produced, prompt: int, stream: bool = False) -> None:
        """Send a computed prompt whole, or (``stream``) start its stream, which sends its layer groups as
        ``layer_saved`` reports them written."""
        nblocks = -(-prompt // self._layout.block_size)
        blocks = e.blocks[:nblocks]
        args = (kvreq_of(self.engine_id, req_id), self._layout.pages(blocks), self._layout.tokens(len(blocks)))
        try:
            if stream:
                e.handle, e.streaming = self._source.stream(*args, engine=None), True
            else:
                e.handle = self._source.send(*args, engine=None)
        except (KVStageError, ValueError) as err:
            logger.warning(
                "kvstage: rank %d cannot send %s: %s; its decode recomputes or fails it", self.rank, req_id, err
            )

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
        if msg.get("type") != "connect" or not isinstance(addr, (str, list)):
            raise PullError(f"malformed {str(msg.get('type'))[:32]} message (expected connect with an address)")
        try:
            with self._connect_lock:
                self._source.connect([Address.parse(addr)])
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
