"""vLLM KV connector: prefill and decode engines move KV through kvstage.

Load it by module path::

    KVTransferConfig(kv_connector="KVStageConnector", kv_connector_module_path="kvstage.plugin.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both")

Requests follow vLLM's NixlConnector convention: a prefill request carries
``kv_transfer_params={"do_remote_decode": True}`` (and ``max_tokens=1``); its
``RequestOutput.kv_transfer_params`` is what the decode request passes in
``SamplingParams(extra_args={"kv_transfer_params": ...})``.

This module is the facade vLLM loads: each call goes to the role that serves
it, ``scheduler.Scheduler`` or ``worker.Worker`` (README.md beside it gives the
reading path). All transfer logic is kvstage's; the plugin only translates
blocks and requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvstage.errors import ConfigError
from kvstage.plugin.vllm.meta import KVStageMeta, extra_config
from kvstage.plugin.vllm.scheduler import Scheduler
from kvstage.plugin.vllm.stats import KVStagePromMetrics, KVStageStats
from kvstage.plugin.vllm.worker import Worker

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


def _into_vllms_log() -> None:
    """kvstage's own lines (its endpoints log to "kvstage") go out through vLLM's handlers, in its
    format, at its level: vLLM's logger does not propagate to the root, so they would otherwise
    reach stderr bare (Python's last-resort handler). Once per process, when a connector is made."""
    ours, theirs = logging.getLogger("kvstage"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False


class KVStageConnector(KVConnectorBase_V1):
    """vLLM's connector interface, split by role into ``Scheduler`` and ``Worker``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _into_vllms_log()
        extra = extra_config(vllm_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("KVStageConnector supports tensor parallelism only (pipeline_parallel_size > 1)")
        if role == KVConnectorRole.SCHEDULER:
            self._s: Scheduler | None = Scheduler(self, vllm_config, extra)
            self._w: Worker | None = None
        else:
            self._s, self._w = None, Worker(vllm_config, extra)

    # Each process serves one role: the other's handle is None, and vLLM calls only this role's methods.
    @property
    def _sched(self) -> Scheduler:
        assert self._s is not None, "a scheduler-side call on a worker-role connector"
        return self._s

    @property
    def _work(self) -> Worker:
        assert self._w is not None, "a worker-side call on a scheduler-role connector"
        return self._w

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return extra_config(vllm_config).get("kv_cache_layout")

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._sched.set_ranks(metadata)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._w.handshake() if self._w is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStageMeta):
            self._work.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStageMeta) and self._w is not None:
            self._w.layer_saved(meta, layer_name)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStageMeta):
            self._work.after_forward(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work.results(finished_req_ids)

    def shutdown(self) -> None:
        if self._w is not None:
            self._w.close()

    # stats: each step's loads (worker) and recomputes (scheduler), through vLLM's connector stats (stats.py)
    def get_kv_connector_stats(self) -> KVStageStats | None:
        return (self._w if self._w is not None else self._sched).stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStageStats:
        return KVStageStats(data=data) if data is not None else KVStageStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVStagePromMetrics:
        return KVStagePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
