"""kvstage's figures through vLLM's connector stats interface (the one NixlConnector uses).

Each step, every worker hands vLLM the KV loads it finished (``KVStageStats``: the
seconds and bytes of each done load, the cause class of each failed one) and the
scheduler adds the requests it recomputes after a failed load. vLLM sums them over
the TP ranks and the steps, and shows them two ways:

- its log line ``KV Transfer metrics: Loads done=..., Loads failed=..., ...`` every
  ``VLLM_LOG_STATS_INTERVAL`` seconds (``reduce``);
- ``vllm:kvstage_*`` metrics on its ``/metrics`` (``KVStagePromMetrics``), in the
  process that serves them, whatever process the workers run in.

A load is one rank's receive: a request decoded at TP 2 is two loads. A recompute
is one request. Needs vLLM; docs/metrics.md says what appears where.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: ``vllm:kvstage_load_time_seconds``: one rank's load, from its start in the worker to its end seen there
LOAD_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_KEYS = ("load_seconds", "load_bytes", "failed_loads", "recomputes")


@dataclass
class KVStageStats(KVConnectorStats):
    """One interval's KV loads: lists, so that vLLM can ship them between processes and add them up."""

    def __post_init__(self):
        for key in _KEYS:
            self.data.setdefault(key, [])

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {key: [] for key in _KEYS}

    def record_load(self, ok: bool, seconds: float, nbytes: int, cause: str | None = None) -> None:
        """A worker's load finished: done (its seconds and bytes), or failed (its cause class)."""
        if ok:
            self.data["load_seconds"].append(float(seconds))
            self.data["load_bytes"].append(int(nbytes))
        else:
            self.data["failed_loads"].append(cause or "other")

    def record_recompute(self) -> None:
        """The scheduler: a request whose load failed is recomputed (``kv_load_failure_policy=recompute``)."""
        self.data["recomputes"].append(1)

    def take(self) -> KVStageStats | None:
        """This interval's figures (None when there were none), and a fresh interval."""
        if self.is_empty():
            return None
        got = copy.copy(self)
        self.reset()
        return got

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key in _KEYS:
                self.data.setdefault(key, []).extend(other.data.get(key, ()))
        return self

    def reduce(self) -> dict[str, int | float | str]:
        seconds = np.asarray(self.data["load_seconds"], dtype=np.float64)
        mb = float(np.sum(self.data["load_bytes"])) / 2**20 if self.data["load_bytes"] else 0.0
        out: dict[str, int | float | str] = {
            "Loads done": len(seconds),
            "Loads failed": len(self.data["failed_loads"]),
            "Recomputes": len(self.data["recomputes"]),
            "MB loaded": round(mb, 3),
        }
        if len(seconds):
            out.update(
                {
                    "Avg load time (ms)": round(float(seconds.mean()) * 1e3, 3),
                    "P50 load time (ms)": round(float(np.percentile(seconds, 50)) * 1e3, 3),
                    "P90 load time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
                    "Throughput (MB/s)": round(mb / float(seconds.sum()), 3) if seconds.sum() > 0 else 0.0,
                }
            )
        failed = self.data["failed_loads"]
        if failed:
            causes = sorted(set(failed))
            out["Failed by cause"] = " ".join(f"{c}:{failed.count(c)}" for c in causes)
        return out


class KVStagePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstage_*``: registered by vLLM's Prometheus logger in the process that serves ``/metrics``."""

    def __init__(
        self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        def counter(name: str, documentation: str):
            return per_engine(self._counter_cls(name=name, documentation=documentation, labelnames=labelnames))

        self.load_time = per_engine(
            self._histogram_cls(
                name="vllm:kvstage_load_time_seconds",
                documentation="Seconds of each rank's KV load through kvstage.",
                buckets=LOAD_BUCKETS,
                labelnames=labelnames,
            )
        )
        self.loads_done = counter("vllm:kvstage_loads_done", "KV loads through kvstage that completed (one per rank).")
        self.loads_failed = counter("vllm:kvstage_loads_failed", "KV loads through kvstage that failed (one per rank).")
        self.loaded_bytes = counter("vllm:kvstage_loaded_bytes", "KV bytes received through kvstage.")
        self.recomputes = counter(
            "vllm:kvstage_recomputes",
            "Requests recomputed after their KV load through kvstage failed (kv_load_failure_policy=recompute).",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        data = transfer_stats_data
        for s in data.get("load_seconds", ()):
            self.load_time[engine_idx].observe(s)
        for metric, key in (
            (self.loads_done, "load_seconds"),
            (self.loads_failed, "failed_loads"),
            (self.recomputes, "recomputes"),
        ):
            if data.get(key):
                metric[engine_idx].inc(len(data[key]))
        total = sum(data.get("load_bytes", ()))
        if total:
            self.loaded_bytes[engine_idx].inc(total)
