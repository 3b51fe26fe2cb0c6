"""The CSV of a result: its columns and one row per result row.

Its own module because the columns are a file format others parse: they change only
with the result rows (``summary``), never with the table's layout.
"""

from __future__ import annotations

import csv

from kvstage.bench.report import is_multi

#: a result row's size and speed, as ``summary`` names them: the same columns in both CSVs
_SIZE_COLUMNS = (
    "src_tp",
    "dst_tp",
    "tokens",
    "concurrency",
    "bytes",
    "total_bytes",
    "seconds",
    "gbps",
)
#: the run's configuration, the same on every row (``_config_columns``)
_CONFIG_COLUMNS = (
    "layers",
    "kv_heads",
    "head_dim",
    "dtype",
    "mla",
    "device",
    "src_page_size",
    "src_layout",
    "dst_page_size",
    "dst_layout",
    "iters",
    "warmup",
)

CSV_COLUMNS = (
    "mode",
    *_SIZE_COLUMNS,
    "latency_p50_ms",
    "latency_p99_ms",
    "latency_samples",
    "exposed_s",
    "descriptors_per_request",
    "arena_bytes",
    "ratio_to_bulk",
    "verified",
    "path",
    "gather_s",
    "read_s",
    "slot_wait_s",
    "scatter_s",
    "gather_gpu_s",
    "read_gpu_s",
    "scatter_gpu_s",
    "stage_overlap",
    "arena",
    "copier",
    "bulk_degraded",
    *_CONFIG_COLUMNS,
    "prefill_ms",
    "layer_groups",
)


#: the CSV of a multi-engine run (``--src-engines`` / ``--dst-engines``): one row per engine pair
ENGINE_CSV_COLUMNS = (
    "mode",
    "engines",
    "src_engine",
    "dst_engine",
    *_SIZE_COLUMNS,
    "latency_p50_ms",
    "latency_p99_ms",
    "latency_samples",
    "slot_wait_s",
    "src_slot_wait_s",
    "step_bytes",
    "step_seconds",
    "step_gbps",
    "descriptors_per_request",
    "arena_bytes",
    "verified",
    "path",
    "gather_s",
    "read_s",
    "scatter_s",
    "gather_gpu_s",
    "read_gpu_s",
    "scatter_gpu_s",
    "arena",
    "copier",
    "src_peer_engines",
    "dst_peer_engines",
    *_CONFIG_COLUMNS,
)


def _measured_columns(r: dict) -> dict:
    """The CSV columns every result row has of its own measurement: latency, descriptors, what it took,
    and its stages' seconds."""
    st = r.get("stages") or {}
    return {
        "latency_p50_ms": r["latency_p50_s"] * 1e3,
        "latency_p99_ms": r["latency_p99_s"] * 1e3,
        "descriptors_per_request": r["descriptors"],
        "path": "+".join(r.get("path") or []),
        "arena": "+".join(r.get("arena") or []),
        "copier": "+".join(r.get("copier") or []),
        **{f"{k}_s": st.get(k) for k in ("gather", "read", "scatter", "gather_gpu", "read_gpu", "scatter_gpu")},
    }


def _config_columns(cfg: dict) -> dict:
    """The CSV columns of the run's configuration, the same on every row."""
    g = cfg["geometry"]
    return {
        **{k: g[k] for k in ("layers", "kv_heads", "head_dim", "dtype", "mla")},
        "device": cfg["device"],
        "src_page_size": cfg["src_page"]["page_size"],
        "src_layout": cfg["src_page"]["order"],
        "dst_page_size": cfg["dst_page"]["page_size"],
        "dst_layout": cfg["dst_page"]["order"],
        "iters": cfg["iters"],
        "warmup": cfg["warmup"],
    }


def csv_rows(result: dict) -> list[dict]:
    cfg = result["config"]
    if is_multi(result):
        return _engine_csv_rows(result)
    out = []
    for r in result["results"]:
        st = r.get("stages") or {}
        out.append(
            {
                **{
                    k: r.get(k)
                    for k in (
                        "mode",
                        *_SIZE_COLUMNS,
                        "latency_samples",
                        "exposed_s",
                        "arena_bytes",
                        "ratio_to_bulk",
                        "verified",
                    )
                },
                **_measured_columns(r),
                "bulk_degraded": r.get("bulk_degraded"),
                "slot_wait_s": st.get("slot_wait"),
                "stage_overlap": st.get("overlap"),
                **_config_columns(cfg),
                "prefill_ms": cfg.get("prefill_ms"),
                "layer_groups": " ".join(f"{a}-{b}" for a, b in r["layer_groups"]) if r.get("layer_groups") else None,
            }
        )
    return out


def _engine_csv_rows(result: dict) -> list[dict]:
    cfg = result["config"]
    out = []
    for r in result["results"]:
        out.append(
            {
                **{
                    k: r.get(k)
                    for k in (
                        "mode",
                        "engines",
                        "src_engine",
                        "dst_engine",
                        *_SIZE_COLUMNS,
                        "latency_samples",
                        "slot_wait_s",
                        "src_slot_wait_s",
                        "step_bytes",
                        "step_seconds",
                        "step_gbps",
                        "arena_bytes",
                        "verified",
                        "src_peer_engines",
                        "dst_peer_engines",
                    )
                },
                **_measured_columns(r),
                **_config_columns(cfg),
            }
        )
    return out


def write_csv(result: dict, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ENGINE_CSV_COLUMNS if is_multi(result) else CSV_COLUMNS)
        w.writeheader()
        for row in csv_rows(result):
            w.writerow({k: "" if v is None else v for k, v in row.items()})
