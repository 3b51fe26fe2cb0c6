"""vLLM KV connector: prefill and decode engines move KV through kvstage.

Load it by module path::

    KVTransferConfig(kv_connector="KVStageConnector", kv_connector_module_path="kvstage.plugin.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both")

Requests follow vLLM's NixlConnector convention: a prefill request carries
``kv_transfer_params={"do_remote_decode": True}`` (and ``max_tokens=1``); its
``RequestOutput.kv_transfer_params`` is what the decode request passes in
``SamplingParams(extra_args={"kv_transfer_params": ...})``.

What happens (docs/vllm.md has the user's view):

1. Each worker wraps its KV tensors as a kvstage ``RankCache``
   (``vllm_layout``) and opens its endpoints once, for the engine's life: a
   consumer rank a ``Destination``, a producer rank a ``Source`` and a port
   for pulls (``pull``). Each serves every peer engine; a new peer engine
   costs one handshake. Addresses reach the scheduler through vLLM's
   handshake metadata.
2. Prefill: when a remote-decode request's prompt is computed, each prefill
   worker holds its blocks ready; the scheduler delays freeing them and
   returns the prefill ranks' addresses in ``kv_transfer_params``.
3. Decode: the scheduler reports the prompt as externally computed and
   loading asynchronously; each decode worker calls ``Destination.expect``
   with its own blocks and the prefill engine's id, and pulls the prefill
   ranks, which ``Source.connect`` (once per decode rank) and ``Source.send``
   their blocks to that decode engine. kvstage plans the heads for the two TP
   sizes, stages, writes and scatters.
4. A finished transfer is reported as ``finished_recving``; a failed one also
   as ``failed_recving``, and vLLM then recomputes or fails the request by
   ``kv_load_failure_policy``. The prefill frees its blocks once its writes
   completed, failed, were released, or no pull came within ``lease_s``.

All transfer logic is kvstage's; this module only translates blocks and
requests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

from kvstage import metrics as kvmetrics
from kvstage.config import Settings
from kvstage.errors import ConfigError, KVStageError
from kvstage.plugin.vllm.pull import PullError, PullServer, pull
from kvstage.plugin.vllm.layout import VllmKVLayout, describe
from kvstage.plugin.vllm.stats import KVStagePromMetrics, KVStageStats
from kvstage.protocol.request import State
from kvstage.protocol.gate import check_listen

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log settings show it


def _into_vllms_log() -> None:
    """kvstage's own lines (its endpoints log to "kvstage") go out through vLLM's handlers, in its
    format, at its level: vLLM's logger does not propagate to the root, so they would otherwise
    reach stderr bare (Python's last-resort handler)."""
    ours, theirs = logging.getLogger("kvstage"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False


_into_vllms_log()


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
    """Threads started inside (the endpoint's loop and pinger, its transport's, the pull server's)
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


PARAMS_VERSION = 1

#: ``kv_connector_extra_config`` keys and their defaults (docs/vllm.md lists them)
DEFAULTS = {
    "host": "127.0.0.1",  # address this engine's ranks listen on and advertise
    "lease_s": 120.0,  # a prefilled request's blocks wait this long for a pull
    "pull_timeout_s": 15.0,  # a decode rank waits this long for a prefill rank's answer
    "pull_wait_s": 5.0,  # a prefill rank waits this long for a pulled request's prefill to finish
    "kv_cache_layout": None,  # ask vLLM for "NHD" or "HND"; None keeps the engine's choice
}
#: keys passed to kvstage's Settings, every one of them (the KVSTAGE_* environment variables are the defaults)
SETTINGS_KEYS = tuple(f.name for f in dataclasses.fields(Settings))
#: kvstage's own ready timeout is minutes; a decode waiting on a dead prefill should give up sooner
READY_TIMEOUT_S = 30.0


def _extra(vllm_config: "VllmConfig") -> dict:
    cfg = vllm_config.kv_transfer_config
    extra = dict(getattr(cfg, "kv_connector_extra_config", None) or {})
    unknown = set(extra) - set(DEFAULTS) - set(SETTINGS_KEYS)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}; known: "
                          f"{sorted(set(DEFAULTS) | set(SETTINGS_KEYS))}")
    return {**DEFAULTS, **extra}


def _settings(extra: dict) -> Settings:
    kw = {k: extra[k] for k in SETTINGS_KEYS if k in extra}
    if "ready_timeout_s" not in kw and not os.environ.get("KVSTAGE_READY_TIMEOUT_S"):
        kw["ready_timeout_s"] = READY_TIMEOUT_S
    return Settings(**kw)


def model_identity(vllm_config: "VllmConfig") -> str:
    """What kvstage's handshake compares between two engines: the model's name or path and a hash
    of what shapes its KV (as vLLM's own NixlConnector's compatibility hash). Another model of the
    same shapes would take the KV and decode wrong tokens; a mismatch is refused by name."""
    import hashlib
    import json

    from vllm import __version__ as vllm_version

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    factors = {"vllm": vllm_version, "model": mc.model, "dtype": str(mc.dtype), "kv_heads": mc.get_total_num_kv_heads(),
               "head_size": mc.get_head_size(), "layers": mc.get_total_num_hidden_layers(),
               "cache_dtype": str(cc.cache_dtype)}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]
    return f"{str(mc.model)[-400:]}#{digest}"


def _is_remote_prefill(params: dict | None) -> bool:
    return bool(params and params.get("do_remote_prefill") and params.get("kvstage") == PARAMS_VERSION)


def _kvreq(params: dict) -> str:
    """The kvstage request id both sides use: unique per prefill engine."""
    return f"{params['remote_engine_id']}:{params['remote_request_id']}"


# -- what travels from the scheduler to the workers ------------------------------------------

@dataclass
class Recv:
    """Decode: load ``blocks`` (this engine's) from the prefill named by ``params``."""

    req_id: str
    blocks: list[int]
    skip: int  # prefill blocks to skip (already computed here)
    params: dict


@dataclass
class KVStageMeta(KVConnectorMetadata):
    recv: list[Recv] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)  # decode requests finished while loading
    release: list[dict] = field(default_factory=list)  # prefills the decode will not pull
    produce: dict = field(default_factory=dict)  # prefill req -> (block ids, prompt computed after this step)
    preempted: list[str] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)  # prefill requests finished without a hand-off
    delay_freed: list[str] = field(default_factory=list)  # prefill requests whose blocks wait for a pull


@dataclass
class KVStageHandshake(KVConnectorHandshakeMetadata):
    rank: int
    pull: tuple | None  # a producer rank's pull address
    layout: dict


# -- the connector -----------------------------------------------------------------------------

class KVStageConnector(KVConnectorBase_V1):
    """vLLM's connector interface, split by role into ``_Scheduler`` and ``_Worker``."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = _extra(vllm_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("KVStageConnector supports tensor parallelism only (pipeline_parallel_size > 1)")
        if role == KVConnectorRole.SCHEDULER:
            self._s: _Scheduler | None = _Scheduler(self, vllm_config, extra)
            self._w: _Worker | None = None
        else:
            self._s, self._w = None, _Worker(vllm_config, extra)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return _extra(vllm_config).get("kv_cache_layout")

    # scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._s.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._s.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._s.set_ranks(metadata)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._w.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._w.handshake() if self._w is not None else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStageMeta):
            self._w.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # the prefill's blocks are sent whole once the prompt is computed

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStageMeta):
            self._w.after_forward(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._w.results(finished_req_ids)

    def shutdown(self) -> None:
        if self._w is not None:
            self._w.close()

    # stats: each step's loads (worker) and recomputes (scheduler), through vLLM's connector stats (stats.py)
    def get_kv_connector_stats(self) -> KVStageStats | None:
        return (self._w if self._w is not None else self._s).stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStageStats:
        return KVStageStats(data=data) if data is not None else KVStageStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVStagePromMetrics:
        return KVStagePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# -- scheduler side ----------------------------------------------------------------------------

class _Scheduler:
    def __init__(self, connector: KVStageConnector, vllm_config: "VllmConfig", extra: dict):
        self.connector = connector
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.pull_ranks: list | None = None  # producer ranks' pull addresses, by TP rank
        self.layout: dict | None = None
        self._producing: dict[str, "Request"] = {}
        self._loading: set[str] = set()  # decode requests whose KV is being received
        self._meta = KVStageMeta()
        self.recompute = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail") == "recompute"
        self.stats = KVStageStats()

    def set_ranks(self, metadata: dict) -> None:
        ranks = sorted(metadata.items())
        if [r for r, _ in ranks] != list(range(self.tp)):
            raise ConfigError(f"kvstage handshake metadata from TP ranks {[r for r, _ in ranks]}; expected 0..{self.tp - 1}")
        metas = [m for _, m in ranks]
        self.layout = metas[0].layout
        if all(m.pull for m in metas):
            self.pull_ranks = [list(m.pull) for m in metas]
        logger.info("kvstage: engine %s, TP %d, pulls on %s", self.engine_id, self.tp, self.pull_ranks)

    def _total(self, request: "Request") -> int:
        params = request.kv_transfer_params
        return min(int(params.get("remote_num_tokens", 0)), request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if not _is_remote_prefill(request.kv_transfer_params):
            return 0, False
        count = self._total(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._producing[request.request_id] = request
            return
        if not _is_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one load per request, even if it is preempted later
        if num_external_tokens <= 0:  # everything is cached here: the prefill can free its blocks
            self._meta.release.append(params)
            return
        total = self._total(request)
        local = total - num_external_tokens
        skip = local // self.block_size
        ids = list(blocks.get_block_ids()[0])[skip: -(-total // self.block_size)]
        self._meta.recv.append(Recv(request.request_id, ids, skip, dict(params)))
        self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVStageMeta()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._producing.get(req_id)
            if request is None:
                continue
            (ids,) = self.connector._kv_cache_manager.get_block_ids(req_id)
            meta.produce[req_id] = (list(ids), request.num_computed_tokens + n >= request.num_prompt_tokens)
        meta.preempted = [r for r in (scheduler_output.preempted_req_ids or ()) if r in self._producing]
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.recompute:  # a failed load of a request still waiting for it: vLLM recomputes its prompt
            for req_id in connector_output.failed_recving or ():
                if req_id in self._loading:
                    self.stats.record_recompute()
                    kvmetrics.recomputed(self.engine_id)
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        req_id, params = request.request_id, request.kv_transfer_params
        self._producing.pop(req_id, None)
        if req_id in self._loading:  # vLLM keeps its blocks until the load is reported finished
            self._loading.discard(req_id)
            self._meta.cancel.append(req_id)
            return False, None
        if _is_remote_prefill(params):  # finished before it was scheduled: never pulled
            params["do_remote_prefill"] = False
            self._meta.release.append(params)
            return False, None
        if not (params and params.get("do_remote_decode")):
            return False, None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not ok or not block_ids or not self.pull_ranks:
            if ok and block_ids:
                logger.error("kvstage: request %s cannot be handed off: this engine has no producer ranks "
                             "(kv_role must be kv_producer or kv_both)", req_id)
            self._meta.drop.append(req_id)
            return False, None
        self._meta.delay_freed.append(req_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvstage": PARAMS_VERSION,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,
            "remote_ranks": self.pull_ranks,
            "remote_tp_size": self.tp,
            "remote_num_tokens": min(request.num_computed_tokens, request.num_prompt_tokens),
            "remote_layout": self.layout,
        }


# -- worker side -------------------------------------------------------------------------------

@dataclass
class _Produced:
    """A prefill request's blocks on this rank, waiting for its pull."""

    blocks: list[int]
    ready_at: float | None = None  # prompt computed (None: still prefilling, or preempted)
    kvreq: str | None = None  # set by the first pull
    engine: str | None = None  # the decode engine pulling it
    addrs: dict = field(default_factory=dict)  # decode rank -> its Destination address for this prefill engine
    decided: threading.Event | None = None  # set once the send started or could not start
    sending: bool = False
    handle: Any = None  # kvstage TransferHandle
    outcome: str | None = None  # why the send could not start
    released: bool = False  # the decode will not pull it
    freed: bool = False  # the scheduler delays freeing its blocks until we report it


@dataclass
class _Loading:
    handle: Any
    engine: str  # the prefill engine it comes from
    kvreq: str
    started: float
    error: str | None = None  # failed before kvstage took it


class _Worker:
    """One TP rank. A producer rank answers pulls with its one kvstage ``Source``; a
    consumer rank receives with its one ``Destination``; each serves every peer engine."""

    def __init__(self, vllm_config: "VllmConfig", extra: dict):
        self.vllm_config = vllm_config
        self.extra = extra
        cfg = vllm_config.kv_transfer_config
        self.producer = cfg.kv_role in ("kv_producer", "kv_both")
        self.consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = cfg.engine_id
        self.settings = _settings(extra)
        self.rank, self.tp = 0, 1
        self.layout: VllmKVLayout | None = None
        self.cache = None
        self.server: PullServer | None = None
        self.src = None  # kvstage Source (producer), for every decode engine
        self.dst = None  # kvstage Destination (consumer), for every prefill engine
        self._connect_lock = threading.Lock()  # one pull at a time connects the Source
        self._lock = threading.Condition()
        self._produced: dict[str, _Produced] = {}
        self._finished: set[str] = set()  # finished_req_ids seen (send reports must name one)
        self._loading: dict[str, _Loading] = {}
        # pulls (one per prefill rank and request; a hung prefill holds one for pull_timeout_s), releases
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
        if self.layout.duplicated_last:
            self.settings.direct = False  # one layer stands in two buffers: never register it twice
        with _threads_on_every_cpu():
            self._open_endpoints(vc, spec)
        logger.info("kvstage: rank %d/%d (%s): %d layers as kvstage %s, %d heads here, pages of %d %s%s; its "
                    "threads run on every CPU, not on the worker's pinned cores",
                    self.rank, self.tp, _role(self), self.layout.layers, spec.geometry, spec.local_heads(),
                    self.layout.page_size, self.layout.order,
                    f", pulls on {self.server.address[0]}:{self.server.address[1]}" if self.server else "")

    def _open_endpoints(self, vc, spec) -> None:
        """This rank's one Source (prefill) and one Destination (decode) for the engine's life."""
        if self.producer:
            check_listen(self.settings, (self.extra["host"], 0), f"kvstage prefill rank {self.rank}'s pull port")
            from kvstage.protocol.source import Source

            self.src = self._registered(Source(self.cache, self.settings, engine=self.engine_id,
                                               model=model_identity(vc)))
            self.server = PullServer(self.extra["host"], self._on_pull, token=self.settings.auth_token)
        if self.consumer:
            from kvstage.protocol.destination import Destination

            self.dst = self._registered(Destination(self.cache, self.settings, listen=(self.extra["host"], 0),
                                                    engine=self.engine_id, model=model_identity(vc)))

    def _registered(self, ep):
        """``ep`` with the KV pool registered now where the direct path may need it (equal TP), so
        the first request of a peer engine does not wait for the registration."""
        if self.settings.direct:
            ep.kv_regions()
        return ep

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
        if meta.release and self.rank == 0:
            for params in meta.release:
                self._pool.submit(self._release, params)

    def _start_recv(self, r: Recv) -> None:
        p = r.params
        kvreq = _kvreq(p)
        engine = str(p.get("remote_engine_id"))
        try:
            if not self.consumer:
                raise ConfigError("this engine does not receive KV (kv_role must be kv_consumer or kv_both)")
            self.layout.check_peer(p.get("remote_layout"))
            handle = self.dst.expect(kvreq, self.layout.pages(r.blocks), self.layout.tokens(len(r.blocks)),
                                     engine=engine)
        except (KVStageError, ValueError, KeyError) as e:
            logger.warning("kvstage: rank %d cannot receive %s (%s): %s", self.rank, r.req_id, kvreq, e)
            self._loading[r.req_id] = _Loading(None, engine, kvreq, time.perf_counter(), str(e))
            return
        self._loading[r.req_id] = _Loading(handle, engine, kvreq, time.perf_counter())
        msg = {"type": "pull", "req": p["remote_request_id"], "kvreq": kvreq, "skip": r.skip, "blocks": len(r.blocks),
               "engine": self.engine_id, "rank": self.rank, "tp": self.tp, "address": list(self.dst.address)}
        for addr in p["remote_ranks"]:  # all prefill ranks at once
            self._pool.submit(self._pull, handle, addr, msg)

    def _pull(self, handle, addr, msg: dict) -> None:
        if handle.done():
            return
        try:
            pull(addr, msg, self.settings.auth_token, self.extra["pull_timeout_s"])
        except PullError as e:
            handle.abort(str(e))

    def _release(self, params: dict) -> None:
        for addr in params.get("remote_ranks") or ():
            try:
                pull(addr, {"type": "release", "req": params["remote_request_id"]}, self.settings.auth_token,
                     self.extra["pull_timeout_s"])
            except (PullError, KeyError) as e:
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
        """A failed direct-path request may still have writes in flight into
        its pages: vLLM must not reuse them before the destination forgot it."""
        if ld.handle.state is not State.FAILED or ld.handle.path != "direct":
            return False
        return self.dst.tracks(ld.kvreq, engine=ld.engine)

    # -- prefill: sending ----------------------------------------------------------------------
    def after_forward(self, meta: KVStageMeta) -> None:
        """After the step's forward: prompts computed in it are ready to send."""
        computed = [r for r, (_, done) in meta.produce.items() if done]
        if computed and self.cache is not None and self.cache.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.cache.device).synchronize()
        now = time.monotonic()
        with self._lock:
            for req_id, (blocks, done) in meta.produce.items():
                e = self._produced.setdefault(req_id, _Produced(blocks))
                if e.kvreq is None:
                    e.blocks = blocks
                    e.ready_at = now if done else None
            for req_id in meta.preempted:
                e = self._produced.get(req_id)
                if e is not None and e.kvreq is None:
                    e.ready_at = None
            for req_id in meta.drop:
                e = self._produced.pop(req_id, None)
                if e is not None and e.handle is not None:
                    e.handle.abort("the prefill request was aborted")
            for req_id in meta.delay_freed:
                self._produced.setdefault(req_id, _Produced([])).freed = True
            self._lock.notify_all()

    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Prefill requests whose blocks vLLM may free now: sent (or failed),
        released by the decode, or not pulled within ``lease_s``. vLLM only
        accepts ids it has reported finished (``finished_req_ids``, this step or before)."""
        self._finished |= set(finished_req_ids)
        done = set()
        now = time.monotonic()
        lease = self.extra["lease_s"]
        with self._lock:
            for req_id in [r for r in self._finished if r in self._produced]:
                e = self._produced[req_id]
                if not e.freed:
                    continue
                if e.kvreq is not None:  # pulled
                    if e.sending and not e.decided.is_set():
                        continue  # connecting to the decode ranks
                    if not e.sending and now - e.ready_at <= lease:
                        continue  # waiting for the other decode ranks' pulls
                    if e.handle is not None and not e.handle.done():
                        continue  # writes in flight
                elif not e.released:
                    if e.ready_at is not None and now - e.ready_at <= lease:
                        continue  # still waiting for its pull
                    logger.warning("kvstage: no decode pulled %s within %g s; freeing its blocks", req_id, lease)
                e.outcome = e.outcome or "freed"
                del self._produced[req_id]
                done.add(req_id)
            self._finished &= set(self._produced)
        return done

    def _on_pull(self, msg: dict) -> dict:
        """A decode rank asks this prefill rank to send a request (pull server thread).

        Every decode rank pulls every prefill rank with its own Destination's
        address; the pull that completes the set of addresses connects and
        sends, the others wait for that outcome."""
        kind, req = msg.get("type"), msg.get("req")
        if not isinstance(req, str):
            raise PullError(f"{kind} without a request id")
        if kind == "release":
            with self._lock:
                e = self._produced.get(req)
                if e is not None and e.kvreq is None:
                    e.released = True
            return {"type": "ok"}
        if kind != "pull":
            raise PullError(f"unknown message type {kind!r}")
        kvreq, engine, addr = msg.get("kvreq"), msg.get("engine"), msg.get("address")
        skip, blocks, rank, tp = msg.get("skip"), msg.get("blocks"), msg.get("rank"), msg.get("tp")
        if not (isinstance(kvreq, str) and isinstance(engine, str) and isinstance(addr, list) and len(addr) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in (skip, blocks, rank, tp))
                and skip >= 0 and blocks > 0 and 0 <= rank < tp):
            raise PullError(f"malformed pull for {req!r}")
        wait = self.extra["pull_wait_s"]
        deadline = time.monotonic() + wait
        with self._lock:
            e = self._produced.get(req)
            while e is None or e.ready_at is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PullError(f"request {req!r} is not prefilled on prefill rank {self.rank} "
                                    "(unknown, still running, aborted, or already freed)")
                self._lock.wait(left)
                e = self._produced.get(req)
            if e.outcome == "freed" or e.released or time.monotonic() - e.ready_at > self.extra["lease_s"]:
                raise PullError(f"request {req!r}: released, or its lease of {self.extra['lease_s']:g} s expired")
            if e.kvreq is None:
                e.kvreq, e.engine, e.decided = kvreq, engine, threading.Event()
            elif (e.kvreq, e.engine) != (kvreq, engine):
                raise PullError(f"request {req!r} was already pulled as {e.kvreq!r} by engine {e.engine}")
            e.addrs[rank] = (addr[0], int(addr[1]))
            sender = len(e.addrs) == tp and not e.sending
            if sender:
                e.sending = True
                addrs = [e.addrs[r] for r in range(tp)]
                pages_of = e.blocks[skip: skip + blocks]
            decided = e.decided
        if not sender:
            limit = self.extra["pull_timeout_s"]
            if not decided.wait(limit):
                raise PullError(f"request {req!r}: not sent within {limit:g} s (the other decode ranks' pulls, or the "
                                "connection to them, did not come)")
            if e.outcome and e.outcome != "freed":
                raise PullError(e.outcome)
            return {"type": "ok"}
        try:
            if len(pages_of) != blocks:
                raise PullError(f"request {req!r} holds {len(e.blocks)} blocks here; the pull asks for {skip}+{blocks}")
            pages, tokens = self.layout.pages(pages_of), self.layout.tokens(blocks)
            try:
                self._connect(addrs)
                e.handle = self.src.send(kvreq, pages, tokens, engine=engine)
            except KVStageError:  # a decode rank went away since its last request: connect again, once
                self._connect(addrs)
                e.handle = self.src.send(kvreq, pages, tokens, engine=engine)
        except (KVStageError, ValueError, TimeoutError) as err:
            e.outcome = f"prefill rank {self.rank}: {err}"
            raise PullError(e.outcome) from err
        finally:
            decided.set()
        return {"type": "ok"}

    def _connect(self, addrs: list) -> None:
        """Connect this rank's Source to the decode ranks at ``addrs`` it has no connection to yet
        (the first request of a decode engine, or one whose rank came back); the others are reused."""
        with self._connect_lock:
            self.src.connect(addrs)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ep in (self.src, self.dst):
            if ep is not None:
                ep.close()


def _role(w: _Worker) -> str:
    return "prefill and decode" if w.producer and w.consumer else "prefill" if w.producer else "decode"
