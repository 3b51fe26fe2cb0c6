"""The connector's scheduler side: which requests load KV, which blocks, and what a finished
prefill hands to its decode (``kv_transfer_params``). No transfer happens here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvstage import metrics as kvmetrics
from kvstage.errors import ConfigError
from kvstage.plugin.vllm.meta import PARAMS_VERSION, KVStageMeta, Recv, is_remote_prefill, pull_secret
from kvstage.plugin.vllm.stats import KVStageStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvstage.plugin.vllm")


class Scheduler:
    """One engine's scheduler-side state: the prefills it produces and the decodes it loads."""

    def __init__(self, connector, vllm_config: VllmConfig, extra: dict):
        self.connector = connector
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.connect_ranks: list | None = None  # producer ranks' connect addresses, by TP rank
        self.rank_secrets: list = []  # producer ranks' own secrets, by TP rank (never handed out)
        self.layout: dict | None = None
        self._producing: dict[str, Request] = {}
        self._loading: set[str] = set()  # decode requests whose KV is being received
        self._meta = KVStageMeta()
        self.recompute = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail") == "recompute"
        self.stats = KVStageStats()

    def set_ranks(self, metadata: dict) -> None:
        ranks = sorted(metadata.items())
        if [r for r, _ in ranks] != list(range(self.tp)):
            raise ConfigError(
                f"kvstage handshake metadata from TP ranks {[r for r, _ in ranks]}; expected 0..{self.tp - 1}"
            )
        metas = [m for _, m in ranks]
        self.layout = metas[0].layout
        if all(m.connect for m in metas):
            self.connect_ranks = [list(m.connect) for m in metas]
            self.rank_secrets = [m.secret for m in metas]
        logger.info(
            "kvstage: engine %s, TP %d, prefill ranks connect on %s", self.engine_id, self.tp, self.connect_ranks
        )

    def _total(self, request: Request) -> int:
        params = request.kv_transfer_params
        return min(int(params.get("remote_num_tokens", 0)), request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not is_remote_prefill(request.kv_transfer_params):
            return 0, False
        count = self._total(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._producing[request.request_id] = request
            return
        if not is_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one load per request, even if it is preempted later
        if num_external_tokens <= 0:  # everything is cached here: the prefill can free its blocks
            self._meta.release.append(params)
            return
        total = self._total(request)
        local = total - num_external_tokens
        skip = local // self.block_size
        ids = list(blocks.get_block_ids()[0])[skip : -(-total // self.block_size)]
        self._meta.recv.append(Recv(request.request_id, ids, skip, dict(params)))
        self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStageMeta:
        meta, self._meta = self._meta, KVStageMeta()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._producing.get(req_id)
            if request is None:
                continue
            (ids,) = self.connector._kv_cache_manager.get_block_ids(req_id)
            meta.produce[req_id] = (
                list(ids),
                request.num_computed_tokens + n >= request.num_prompt_tokens,
                request.num_prompt_tokens,
            )
        meta.preempted = [r for r in (scheduler_output.preempted_req_ids or ()) if r in self._producing]
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.recompute:  # a failed load of a request still waiting for it: vLLM recomputes its prompt
            for req_id in connector_output.failed_recving or ():
                if req_id in self._loading:
                    self.stats.record_recompute()
                    kvmetrics.recomputed(self.engine_id)
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        req_id, params = request.request_id, request.kv_transfer_params
        self._producing.pop(req_id, None)
        if req_id in self._loading:  # vLLM keeps its blocks until the load is reported finished
            self._loading.discard(req_id)
            self._meta.cancel.append(req_id)
            return False, None
        if is_remote_prefill(params):  # finished before it was scheduled: never read
            params["do_remote_prefill"] = False
            self._meta.release.append(params)
            return False, None
        if not (params and params.get("do_remote_decode")):
            return False, None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not ok or not block_ids or not self.connect_ranks:
            self._meta.drop.append(req_id)
            if ok and block_ids:  # the router is told in the response, not only in this engine's log
                why = "this engine has no producer ranks (kv_role must be kv_producer or kv_both)"
                logger.error("kvstage: request %s cannot be handed off: %s", req_id, why)
                return False, {
                    "do_remote_prefill": False,
                    "do_remote_decode": False,
                    "kvstage": PARAMS_VERSION,
                    "error": f"kvstage: the prefill cannot hand off request {req_id}: {why}",
                }
            return False, None
        self._meta.delay_freed.append(req_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvstage": PARAMS_VERSION,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,
            "remote_ranks": self.connect_ranks,
            # what each rank's connect port asks for: whoever holds these params may have this request's KV
            "remote_secrets": [pull_secret(s, req_id) for s in self.rank_secrets] if self.rank_secrets else None,
            "remote_tp_size": self.tp,
            "remote_num_tokens": min(request.num_computed_tokens, request.num_prompt_tokens),
            "remote_layout": self.layout,
        }
