"""Byte-exact transfers over both real transports between real rank processes.

Each case builds the full KV cache from a seed, shards it by source TP into
random non-contiguous pages, transfers, and compares every destination shard
(random pages too) with the full cache sharded by destination TP; pages
outside the request must stay untouched. Every case runs over NIXL (one-sided
writes), over UCX through UCXX (two-sided tag messages) and over cma
(``process_vm_writev``: each source writes straight from its pages, no gather);
the direct path is for the one-sided two (with UCX, equal TP goes staged,
tested below). The mapped path
(each source gathers straight into the destination's arena: shared memory on
CPU, CUDA IPC on GPU) runs the same cases, and on a GPU so does direct-ipc (each
source stores its head slices straight into the destination's pages through
CUDA IPC: the GPU default); the cases of the other paths turn it off
(``share_kv="off"``).
"""

import dataclasses

import pytest

from kvstage.bench.runner import run
from kvstage.bench.scenario import Scenario
from kvstage.layout import KVGeometry, PageLayout, token_bytes
from kvstage.staging.arena import MIN_SLOTS


def scenario(src_tp, dst_tp, heads=8, tokens=203, src_page=(16, "nhd"), dst_page=None, mla=False, device="cpu",
             modes=("staged",), arena_mb=1.0, head_dim=32, layers=3, transport="nixl"):
    geo = KVGeometry(layers, 1 if mla else heads, head_dim, "bfloat16", mla)
    return Scenario(geo, src_tp, dst_tp, tokens, PageLayout(*src_page), PageLayout(*(dst_page or src_page)),
                    modes=modes, device=device, iters=1, warmup=0, arena_mb=arena_mb,
                    transport=transport)


CASES = {
    "4to1": dict(src_tp=4, dst_tp=1),
    "1to4": dict(src_tp=1, dst_tp=4),
    "2to4_2heads": dict(src_tp=2, dst_tp=4, heads=2, dst_page=(8, "nhd")),
    "4to6_12heads": dict(src_tp=4, dst_tp=6, heads=12),
    "8to2_2heads": dict(src_tp=8, dst_tp=2, heads=2, dst_page=(4, "hnd")),
    "mla_4to2": dict(src_tp=4, dst_tp=2, mla=True, dst_page=(1, "nhd")),
    "page16nhd_to_page1hnd": dict(src_tp=2, dst_tp=1, dst_page=(1, "hnd")),
    "hnd_to_nhd": dict(src_tp=1, dst_tp=2, src_page=(4, "hnd"), dst_page=(16, "nhd")),
    "one_token": dict(src_tp=4, dst_tp=1, tokens=1),
}


def _check(result, path):
    (row,) = [r for r in result["results"] if r["mode"] == "staged"]
    assert row["verified"] is True, row.get("errors")
    assert row["path"] == [path]
    return row


#: the settings a case of another path than direct-ipc adds: on a GPU, direct-ipc is the default
NO_IPC = {"share_kv": "off"}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TRANSPORTS = ["nixl", "ucx", "cma"]
#: every transport on the CPU; on a GPU the two that reach device memory (cma moves host memory only)
DEVICE_TRANSPORTS = [("cpu", t) for t in TRANSPORTS] + [pytest.param("cuda", t, marks=pytest.mark.gpu)
                                                         for t in TRANSPORTS if t != "cma"]


@pytest.mark.parametrize("device,transport", DEVICE_TRANSPORTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_staged_byte_exact(name, device, transport):
    """Through the transport: gather into the source's arena, one write, scatter."""
    sc = dataclasses.replace(scenario(**CASES[name], device=device, transport=transport),
                             settings_extra={"mapped": "off"} | NO_IPC)
    _check(run(sc), "staged")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_mapped_byte_exact(name, device):
    """mapped=on: no transport write at all, the gathers' stores land in the destination's slots."""
    sc = dataclasses.replace(scenario(**CASES[name], device=device), settings_extra={"mapped": "on"} | NO_IPC)
    row = _check(run(sc), "mapped")
    assert row["descriptors"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nixl", "ucx"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_direct_ipc_byte_exact(name, transport):
    """The GPU default on one host: every source stores its head slices straight into the
    destination's pages (their page size, their layout) with one kernel; no transport write,
    and the destination runs no copy at all."""
    if transport == "ucx":
        pytest.importorskip("ucxx", reason="the ucx transport needs UCXX")
    row = _check(run(scenario(**CASES[name], device="cuda", transport=transport)), "direct-ipc")
    assert row["descriptors"] == 0 and row["writes"] == 0
    assert row["stages"]["scatter"] == 0 and not row["stages"].get("scatter_gpu")


@pytest.mark.parametrize("device,transport", [("cpu", "nixl"), pytest.param("cuda", "nixl", marks=pytest.mark.gpu),
                                              ("cpu", "cma")])
def test_equal_tp_direct_page_runs_byte_exact(device, transport):
    """direct=True: page runs in place, whatever the route's estimate."""
    sc = dataclasses.replace(scenario(2, 2, modes=("staged", "per-slice"), device=device, transport=transport),
                             settings_extra={"direct": True} | NO_IPC)
    result = run(sc)
    row = _check(result, "direct")
    sc = scenario(2, 2)
    pages = -(-sc.tokens // 16)
    # one descriptor per run of consecutive pages per buffer, at most one run per page
    assert row["descriptors"] <= 2 * sc.geometry.buffers * pages
    assert [r["verified"] for r in result["results"]] == [True, True]
    assert 0 < row["stages"]["start"] < 2 * row["seconds"]  # each source's send to its first direct write, summed


@pytest.mark.parametrize("device", DEVICES)
def test_mla_equal_paging_is_direct_one_sender_per_destination(device):
    sc = dataclasses.replace(scenario(4, 2, mla=True, device=device), settings_extra={"direct": True} | NO_IPC)
    _check(run(sc), "direct")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,path", [
    # small pages of random ids: many spans of a few KiB, staged is expected faster everywhere
    (dict(src_tp=2, dst_tp=2), "staged"),
    # the model's pages (32 KiB per buffer): direct on a host, staged (mapped) on one GPU
    (dict(src_tp=1, dst_tp=1, heads=8, head_dim=128, layers=4, tokens=512), "direct|staged"),
], ids=["small_pages", "llama_pages"])
def test_equal_paging_takes_the_route_the_cost_model_expects(device, case, path):
    """By default the destination picks direct or staged per request (``protocol.route``); on
    one GPU host with direct-ipc off (with it on, direct-ipc goes first)."""
    sc = dataclasses.replace(scenario(**case, device=device), settings_extra=NO_IPC)
    row = _check_any(run(sc))
    want = path.split("|")[0 if device == "cpu" else -1]
    assert row["path"] == [want if device == "cpu" or want == "direct" else "mapped"], row["path"]


def _check_any(result):
    (row,) = [r for r in result["results"] if r["mode"] == "staged"]
    assert row["verified"] is True, row.get("errors")
    return row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [dict(src_tp=2, dst_tp=2), dict(src_tp=4, dst_tp=2, mla=True)], ids=["equal_tp", "mla"])
def test_ucx_has_no_direct_path_whole_shards_go_staged(device, case):
    # the plan allows the direct path; UCX is two-sided, so the destination grants slots instead
    sc = dataclasses.replace(scenario(**case, modes=("staged", "per-slice"), device=device, transport="ucx"),
                             settings_extra=NO_IPC)
    assert sc.plan.direct and not sc.settings().may_go_direct
    result = run(sc)
    row = _check(result, "staged")
    slot = row["arena_bytes"] // MIN_SLOTS  # arena_mb=1 is cut into four slots
    chunk = slot // sc.plan.dst_token_bytes() // 16 * 16  # whole pages of 16 tokens
    assert row["descriptors"] == len(sc.plan.pieces) * -(-sc.tokens // chunk)  # one write per piece and chunk
    assert [r["verified"] for r in result["results"]] == [True, True]


@pytest.mark.parametrize("device,transport", DEVICE_TRANSPORTS)
def test_request_four_times_the_arena_streams_through_it(device, transport):
    geo_bytes = token_bytes(KVGeometry(3, 8, 32, "bfloat16"), 8)  # destination token bytes, TP 1
    arena_mb = 0.5
    tokens = int(4 * arena_mb * (1 << 20) // geo_bytes)
    sc = scenario(4, 1, tokens=tokens, arena_mb=arena_mb, device=device, transport=transport)
    assert sc.payload_bytes() >= 4 * arena_mb * (1 << 20) * 0.99
    sc = dataclasses.replace(sc, settings_extra={"mapped": "off"} | NO_IPC)
    row = _check(run(sc), "staged")
    fit = (1 << 17) // geo_bytes  # tokens that fit one 128 KiB slot
    chunk = fit // 16 * 16  # rounded down to whole pages (page size 16 on both sides)
    assert row["writes"] == 4 * -(-tokens // chunk)  # four writers, one write per chunk each
    if transport != "cma":  # one span each; cma takes each chunk's page rows as they lie
        assert row["descriptors"] == row["writes"]
    else:
        assert row["descriptors"] > row["writes"]


@pytest.mark.parametrize("device,transport", DEVICE_TRANSPORTS)
def test_baselines_write_the_same_bytes_and_verify(device, transport):
    result = run(scenario(4, 1, modes=("staged", "bulk", "per-slice"), device=device, transport=transport))
    rows = {r["mode"]: r for r in result["results"]}
    assert rows["staged"]["verified"] and rows["per-slice"]["verified"]
    assert rows["bulk"]["verified"] is None
    assert len({r["bytes"] for r in rows.values()}) == 1
    assert rows["bulk"]["descriptors"] == 4
    # one per token and buffer on each of the four sources: heads are contiguous in NHD
    assert rows["per-slice"]["descriptors"] == 4 * 203 * 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["4to1", "1to4", "hnd_to_nhd", "mla_4to2"])
def test_pinned_host_arena_byte_exact(name, device):
    """arena=host: GPU -> pinned host arena -> NIXL (host memory) -> pinned host arena -> GPU.
    (On a CPU-only machine a host arena is every arena; the GPU run is the real test.)"""
    sc = dataclasses.replace(scenario(**CASES[name], device=device), settings_extra={"arena": "host"} | NO_IPC)
    row = _check(run(sc), "staged")
    assert row["arena"] == ["host"]


@pytest.mark.gpu
def test_gpu_arena_defaults_to_device_memory_mapped_by_sources():
    sc = dataclasses.replace(scenario(4, 1, device="cuda"), settings_extra=NO_IPC)
    row = _check(run(sc), "mapped")
    assert row["arena"] == ["device"]


@pytest.mark.gpu
def test_vmm_kv_pages_are_not_shared_and_go_through_the_arena(monkeypatch):
    """KV pages from expandable segments (CUDA VMM) cannot be shared by legacy CUDA IPC: the
    destination says so once and offers nothing; the request goes through its cudaMalloc arena."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    row = _check(run(scenario(4, 1, device="cuda")), "mapped")
    assert row["arena"] == ["device"]


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["2to1", "1to2", "4to1", "1to4", "hnd_to_nhd", "direct_2to2"])
def test_across_two_gpus_byte_exact(name):
    """Sources on GPU 0, destinations on GPU 1: every byte crosses the GPU link (NVLink on the H200 pair)."""
    if not _two_gpus():
        pytest.skip("needs two CUDA devices")
    kw = {"2to1": dict(src_tp=2, dst_tp=1), "1to2": dict(src_tp=1, dst_tp=2), "direct_2to2": dict(src_tp=2, dst_tp=2),
          **CASES}[name]
    # auto: a NIXL write over the link (another GPU's arena is not mapped unless asked);
    # on: the gather kernel's own stores over the link (CUDA IPC with peer access)
    for mapped in ("auto", "on"):
        extra = {"mapped": mapped} | ({"direct": True} if name == "direct_2to2" else {})
        sc = dataclasses.replace(scenario(**kw, device="cuda"), src_gpu=0, dst_gpu=1, settings_extra=extra)
        _check(run(sc), "direct" if name == "direct_2to2" else "mapped" if mapped == "on" else "staged")
