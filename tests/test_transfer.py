"""Byte-exact transfers over every path and transport between real rank processes.

Each case builds the full KV cache from a seed, shards it by source TP into
random non-contiguous pages, transfers, and compares every destination shard
(random pages too) with the full cache sharded by destination TP; pages
outside the request must stay untouched. The destination moves the bytes on
every path (``protocol.route``):

- ``read``: each source gathers its slices into its arena at ``send``, the destination
  reads one span per chunk and source and scatters; over nixl, ucx and cma;
- ``pages``: the destination reads the head slices straight from the sources' pages into
  its arena (host memory; nixl and cma);
- ``direct``: whole shards with equal paging: page runs straight into the destination's pages;
- ``ipc`` (GPU): the destination's one kernel reads every source's pages over CUDA IPC.
"""

import dataclasses

import pytest

from kvstage.bench.runner import run
from kvstage.bench.scenario import Scenario
from kvstage.layout import KVGeometry, PageLayout, token_bytes
from support.marks import TRANSPORTS, needs, over


def scenario(src_tp, dst_tp, heads=8, tokens=203, src_page=(16, "nhd"), dst_page=None, mla=False, device="cpu",
             modes=("staged",), arena_mb=1.0, head_dim=32, layers=3, transport="nixl", path="auto"):
    geo = KVGeometry(layers, 1 if mla else heads, head_dim, "bfloat16", mla)
    return Scenario(geo, src_tp, dst_tp, tokens, PageLayout(*src_page), PageLayout(*(dst_page or src_page)),
                    modes=modes, device=device, iters=1, warmup=0, arena_mb=arena_mb,
                    transport=transport, settings_extra={"path": path})


CASES = {
    "4to1": dict(src_tp=4, dst_tp=1),
    "1to4": dict(src_tp=1, dst_tp=4),
    "2to4_2heads": dict(src_tp=2, dst_tp=4, heads=2, dst_page=(8, "nhd")),
    "4to6_12heads": dict(src_tp=4, dst_tp=6, heads=12),
    "8to2_2heads": dict(src_tp=8, dst_tp=2, heads=2, dst_page=(4, "hnd")),
    "8to2_2heads_4layers_spread": dict(src_tp=8, dst_tp=2, heads=2, layers=4),
    "mla_4to2": dict(src_tp=4, dst_tp=2, mla=True, dst_page=(1, "nhd")),
    "mla_4to1_spread": dict(src_tp=4, dst_tp=1, mla=True, layers=4),
    "page16nhd_to_page1hnd": dict(src_tp=2, dst_tp=1, dst_page=(1, "hnd")),
    "hnd_to_nhd": dict(src_tp=1, dst_tp=2, src_page=(4, "hnd"), dst_page=(16, "nhd")),
    "one_token": dict(src_tp=4, dst_tp=1, tokens=1),
}
#: the cases whose pieces are whole shards with equal paging: the direct path can carry them
DIRECT_CASES = {
    "2to2": dict(src_tp=2, dst_tp=2),
    "mla_3to3": dict(src_tp=3, dst_tp=3, mla=True),
    "2to4_2heads_replicas": dict(src_tp=2, dst_tp=4, heads=2),
    "mla_4to1_spread": dict(src_tp=4, dst_tp=1, mla=True, layers=4),
}


def _check(result, path):
    (row,) = [r for r in result["results"] if r["mode"] == "staged"]
    assert row["verified"] is True, row.get("errors")
    assert row["path"] == [path], row["path"]
    return row


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: every transport on the CPU; on a GPU the two that reach device memory (cma moves host memory only)
DEVICE_TRANSPORTS = [pytest.param("cpu", t, marks=needs(t)) for t in TRANSPORTS] + [
    pytest.param("cuda", t, marks=(pytest.mark.gpu, *needs(t))) for t in TRANSPORTS if t != "cma"]
#: on the CPU, the cases the pages path and the transports other than nixl (the default: every case of
#: the read path) run: one of each plan feature (a ratio, replicas with a page size change, an MLA spread
#: over layers, a layout change, one token). The planning and copies of every case are the same code
#: whatever the transport (tp, staging and copier tests, in process); a real process per rank costs
#: seconds a case
CORE = ("4to1", "2to4_2heads", "mla_4to1_spread", "page16nhd_to_page1hnd", "one_token")


def _matrix(transports, every: str = "nixl") -> list:
    """(name, device, transport): every case over ``every`` and on a GPU, the ``CORE`` cases otherwise."""
    out = []
    for name in sorted(CASES):
        for dt in transports:
            device, transport = dt.values if hasattr(dt, "values") else dt
            if device == "cpu" and transport != every and name not in CORE:
                continue
            out.append(pytest.param(name, device, transport, marks=getattr(dt, "marks", ())))
    return out


@pytest.mark.parametrize("name,device,transport", _matrix(DEVICE_TRANSPORTS))
def test_read_byte_exact(name, device, transport):
    """Each source gathers into its arena at send; the destination reads one span per chunk and source."""
    row = _check(run(scenario(**CASES[name], device=device, transport=transport, path="read")), "read")
    assert row["descriptors"] == row["writes"]  # one span per read


@pytest.mark.parametrize("name,device,transport", _matrix([("cpu", "nixl"), ("cpu", "cma")], every=""))
def test_pages_byte_exact(name, device, transport):
    """The destination reads the head slices straight from the sources' pages into its arena: no gather."""
    row = _check(run(scenario(**CASES[name], transport=transport, path="pages")), "pages")
    assert row["stages"]["gather"] == 0


@pytest.mark.parametrize("device,transport", [("cpu", "nixl"), ("cpu", "cma"), pytest.param("cuda", "nixl", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", sorted(DIRECT_CASES))
def test_direct_byte_exact(name, device, transport):
    """Whole shards with equal paging: page runs straight into the destination's pages, no arena."""
    sc = scenario(**DIRECT_CASES[name], device=device, transport=transport, path="direct")
    assert sc.plan.direct
    row = _check(run(sc), "direct")
    pages = -(-sc.tokens // 16)
    # one span per run of pages and buffer of each piece, summed over the destination ranks
    assert row["descriptors"] <= sum(len(p.buffers) for p in sc.plan.pieces) * pages
    assert row["stages"]["gather"] == 0 and row["stages"]["scatter"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("transport", [over("nixl"), over("ucx")])
@pytest.mark.parametrize("name", sorted(CASES))
def test_ipc_byte_exact(name, transport):
    """The GPU default on one host: the destination's one kernel launch reads every source's head slices
    out of the sources' pages (CUDA IPC) into its own, its page size and layout; no transport read, no
    gather, no arena."""
    row = _check(run(scenario(**CASES[name], device="cuda", transport=transport)), "ipc")
    assert row["descriptors"] == 0 and row["writes"] == 0
    assert row["stages"]["gather"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["4to1", "1to4", "8to2_2heads", "mla_4to2", "page16nhd_to_page1hnd", "hnd_to_nhd"])
def test_ipc_streamed_byte_exact(name):
    """Streamed on the GPU default: each layer group is read by the destination's kernel over CUDA IPC as
    the source's (simulated) forward writes it; checksums off, so that the request stays on ipc."""
    sc = dataclasses.replace(scenario(**CASES[name], tokens=640, device="cuda", modes=("streamed",)), prefill_ms=4.0,
                             settings_extra={"path": "auto", "checksum": "off"})
    (row,) = [r for r in run(sc)["results"] if r["mode"] == "streamed"]
    assert row["verified"] is True, row.get("errors")
    assert row["path"] == ["ipc"], row["path"]
    assert len(row.get("layer_groups") or []) > 1, row.get("layer_groups")


#: the checksummed cases: ratios both ways, replication, MLA, page size and layout
SUMMED = ["4to1", "1to4", "2to4_2heads", "mla_4to2", "page16nhd_to_page1hnd", "hnd_to_nhd"]
#: (path, device) a checksummed request runs over in the suite: every path the device has
SUMMED_PATHS = [("read", "cpu"), ("pages", "cpu"), pytest.param("read", "cuda", marks=pytest.mark.gpu),
                pytest.param("ipc", "cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("path,device", SUMMED_PATHS)
@pytest.mark.parametrize("name", SUMMED)
def test_checksummed_requests_land_byte_exact(name, path, device):
    """``checksum=all`` on each path: the read path's gather and scatter sum every chunk, the pages path's
    source sums its pages and the destination the pages its piece landed in, the ipc kernel sums what it
    reads; a false mismatch would fail the request."""
    sc = dataclasses.replace(scenario(**CASES[name], device=device), settings_extra={"path": path, "checksum": "all"})
    _check(run(sc), path)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(DIRECT_CASES))
def test_checksummed_direct_requests_land_byte_exact(name, device):
    sc = dataclasses.replace(scenario(**DIRECT_CASES[name], device=device),
                             settings_extra={"path": "direct", "checksum": "all"})
    _check(run(sc), "direct")


def test_a_path_the_pair_cannot_take_fails_the_request_by_name():
    # page runs need whole shards with equal paging: 4 -> 1 cannot go direct
    with pytest.raises(Exception, match="direct: the pieces are not whole shards"):
        run(scenario(4, 1, path="direct"))


@pytest.mark.parametrize("transport", ["nixl", "cma"])
def test_a_host_default_takes_the_path_the_cost_model_picks(transport):
    """By default each source picks its path per request (``protocol.route``): never the page paths where
    their spans would cost more than a gather."""
    result = run(scenario(2, 2, transport=transport))
    row = _check(result, result["results"][0]["path"][0])
    assert row["path"][0] in ("read", "pages", "direct")


@pytest.mark.parametrize("case", [dict(src_tp=2, dst_tp=2), dict(src_tp=4, dst_tp=2, mla=True)], ids=["equal_tp", "mla"])
@pytest.mark.ucx
def test_ucx_reads_only_arenas(case):
    """UCX is two-sided: no page path; whole shards go through the arenas, one offer and read per piece and chunk."""
    sc = scenario(**case, transport="ucx")
    assert sc.plan.direct
    row = _check(run(sc), "read")
    assert row["descriptors"] == row["writes"]


@pytest.mark.parametrize("device,transport", DEVICE_TRANSPORTS)
def test_request_four_times_the_arena_streams_through_it(device, transport):
    geo_bytes = token_bytes(KVGeometry(3, 8, 32, "bfloat16"), 8)  # destination token bytes, TP 1
    arena_mb = 0.5
    tokens = int(4 * arena_mb * (1 << 20) // geo_bytes)
    sc = scenario(4, 1, tokens=tokens, arena_mb=arena_mb, device=device, transport=transport, path="read")
    assert sc.payload_bytes() >= 4 * arena_mb * (1 << 20) * 0.99
    row = _check(run(sc), "read")
    fit = (1 << 17) // geo_bytes  # tokens that fit one 128 KiB slot of the destination
    chunk = fit // 16 * 16  # rounded down to whole pages (page size 16 on both sides)
    assert row["writes"] == 4 * -(-tokens // chunk)  # four writers, one read per chunk each


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
    sc = dataclasses.replace(scenario(**CASES[name], device=device, path="read"),
                             settings_extra={"arena": "host", "path": "read"})
    row = _check(run(sc), "read")
    assert row["arena"] == ["host"]


@pytest.mark.gpu
def test_vmm_kv_pages_are_not_shared_and_go_through_the_arena(monkeypatch):
    """KV pages from expandable segments (CUDA VMM) cannot be shared by legacy CUDA IPC: the source
    says so once, with the cause and the fix, and its requests go through its cudaMalloc arena."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    row = _check(run(scenario(4, 1, device="cuda")), "read")
    assert row["arena"] == ["device"]


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["2to1", "1to2", "4to1", "1to4", "hnd_to_nhd", "direct_2to2"])
def test_across_two_gpus_byte_exact(name):
    """Sources on GPU 0, destinations on GPU 1: every byte crosses the GPU link (NVLink on a GPU pair)."""
    if not _two_gpus():
        pytest.skip("needs two CUDA devices")
    kw = {"2to1": dict(src_tp=2, dst_tp=1), "1to2": dict(src_tp=1, dst_tp=2), "direct_2to2": dict(src_tp=2, dst_tp=2),
          **CASES}[name]
    for path in ("ipc", "read") + (("direct",) if name == "direct_2to2" else ()):
        sc = dataclasses.replace(scenario(**kw, device="cuda", path=path), src_gpu=0, dst_gpu=1)
        _check(run(sc), path)
