"""The UCX_PROTO_INFO parser on real captures (H200 and the CPU machine)."""

from __future__ import annotations

import pathlib

import pytest

from kvstage.link import paths
from kvstage.link.ucx_info import by_memory_pair, memory_type, parse_proto_info, select, ucx_messages

DATA = pathlib.Path(__file__).parent / "data"
MiB64 = 64 << 20


def _read(name: str) -> str:
    return (DATA / name).read_text()


def test_h200_capture_every_table_parsed():
    tables = parse_proto_info(_read("h200-two-procs-cudamalloc.ucx-proto-info.txt"))
    assert len(tables) == 45
    assert {t.worker for t in tables} == {"a", "b"}
    assert {t.scope for t in tables} == {"self", "intra-node"}
    assert {t.stream.split(":")[1] for t in tables} == {"440", "466"}


def test_h200_vram_to_vram_is_cuda_ipc_zero_copy():
    tables = parse_proto_info(_read("h200-two-procs-cudamalloc.ucx-proto-info.txt"))
    sel = select(tables, "cuda", "cuda", 1 << 30)
    assert sel is not None
    assert sel.summary == "zero-copy | cuda_ipc/cuda"
    assert sel.transports == ["cuda_ipc"]
    assert [t.api for t in sel.tables] == ["ucp_put*(multi)"]
    assert sel.tables[0].src_raw == "cuda/GPU0" and sel.tables[0].dst_raw == "cuda/dev[1]"
    assert paths.transport_kind(sel.transports, sel.descriptions, gpu_memory=True) == "cuda_ipc"


def test_h200_other_memory_pairs():
    tables = parse_proto_info(_read("h200-two-procs-cudamalloc.ucx-proto-info.txt"))
    pairs = by_memory_pair(tables, MiB64)
    assert pairs["remote memory write: host->host"] == ["zero-copy | cma/memory"]
    # a pair the KV path does not use: UCX would emulate it; the probe must not judge by it
    assert pairs["remote memory write: host->cuda"] == ["software emulation | tcp/lo"]
    assert pairs["active message: host->-"] == ["multi-frag copy-in | tcp/lo"]


def test_loopback_tables_left_out_unless_asked():
    tables = parse_proto_info(_read("h200-two-procs-cudamalloc.ucx-proto-info.txt"))
    assert select(tables, "host", "host", 100).summary == "zero-copy | cma/memory"
    with_self = select(tables, "host", "host", 100, include_self=True)
    assert "short | cuda_copy/cuda" in with_self.summary  # the self endpoint's own choice


def test_rows_and_ranges():
    tables = parse_proto_info(_read("h200-two-procs-cudamalloc.ucx-proto-info.txt"))
    am = next(t for t in tables if t.operation == "active message" and t.api == "ucp_am_send*" and t.scope == "intra-node")
    assert am.dst is None
    assert [(r.lo, r.hi, r.description) for r in am.rows] == [
        (0, 0, "short"), (1, 16515, "zero-copy"), (16516, None, "multi-frag copy-in")]
    assert am.row_for(16515).description == "zero-copy"
    assert am.row_for(1 << 40).description == "multi-frag copy-in"
    bounded = next(t for t in tables if t.scope == "self" and t.operation == "remote memory write")
    assert bounded.rows[0].hi == 4294967295


def test_h200_selftest_default_and_vmm():
    default = select(parse_proto_info(_read("h200-selftest-cuda-default.writer.txt")), "cuda", "cuda", MiB64)
    assert default.summary == "zero-copy | cuda_ipc/cuda"
    vmm = select(parse_proto_info(_read("h200-selftest-cuda-vmm.writer.txt")), "cuda", "cuda", MiB64)
    assert vmm.summary == "software emulation | tcp/lo"
    assert paths.transport_kind(vmm.transports, vmm.descriptions, gpu_memory=True) == "emulated"
    # UCX said nothing about it
    assert ucx_messages(_read("h200-selftest-cuda-vmm.writer.txt")) == []


def test_cpu_default_is_cma_and_worker_filter():
    tables = parse_proto_info(_read("cpu-selftest-default.writer.txt"))
    writer = next(t.worker for t in tables if t.scope == "intra-node")
    assert writer.startswith("kvstage-probe-writer-")
    sel = select(tables, "host", "host", MiB64, worker=writer)
    assert sel.summary == "zero-copy | cma/memory"
    assert paths.transport_kind(sel.transports, sel.descriptions) == "shm"
    assert select(tables, "host", "host", MiB64, worker="someone-else") is None
    assert select(tables, "cuda", "cuda", MiB64) is None


@pytest.mark.parametrize("name", ["cpu-selftest-ucx-tls-tcp.writer.txt", "cpu-selftest-ucx-tls-posix-tcp.writer.txt"])
def test_cpu_tcp_forced_lanes(name):
    sel = select(parse_proto_info(_read(name)), "host", "host", MiB64)
    assert sel.transports == ["tcp"]
    lanes = {(lane.transport, lane.device, lane.share) for row in sel.rows for lane in row.lanes}
    assert lanes == {("tcp", "lo", 52), ("tcp", "eth0", 48)}
    assert paths.transport_kind(sel.transports, sel.descriptions) == "tcp"
    assert ucx_messages(_read(name)) == []  # 4x slower, and nobody says so


def test_failed_start_messages():
    text = _read("cpu-selftest-ucx-tls-rc.writer.txt")
    assert parse_proto_info(text) == []
    msgs = ucx_messages(text)
    assert msgs[0] == "UCX WARN transport 'rc' is not available, please use one or more of: cma, mm, posix, self, shm, sm, sysv, tcp"
    assert msgs[1].startswith("UCX ERROR no usable transports/devices")
    assert any(m.startswith("NIXL ERROR Failed to create engine") for m in msgs)
    gpu = ucx_messages(_read("h200-selftest-cuda-ucx-tls-tcp.writer.txt"))
    assert gpu[0].startswith("NIXL ERROR Invalid UCX_TLS=tcp for NIXL UCX backend")


def test_interleaved_processes_are_separated():
    a = _read("cpu-selftest-default.writer.txt").splitlines()
    b = _read("h200-selftest-cuda-default.writer.txt").splitlines()
    mixed = [line for pair in zip(a, b) for line in pair] + a[len(b):] + b[len(a):]
    tables = parse_proto_info("\n".join(mixed))
    assert len(tables) == len(parse_proto_info("\n".join(a))) + len(parse_proto_info("\n".join(b)))
    assert select(tables, "cuda", "cuda", MiB64).summary == "zero-copy | cuda_ipc/cuda"


def test_without_prefix_and_garbage():
    text = """
+--------+-------------+-----------------------------------+
| w inter-node cfg#3                                       |
| remote memory write by ucp_put* from cuda/GPU0 to cuda/GPU1 |
+--------+-------------+-----------------------------------+
| Range  | Description |              Config               |
+--------+-------------+-----------------------------------+
| 0..8K  | short       | rc_mlx5/mlx5_0:1                  |
| 8K..inf | zero-copy  | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
+--------+-------------+-----------------------------------+
"""
    (t,) = parse_proto_info(text)
    assert (t.worker, t.scope, t.cfg) == ("w", "inter-node", 3)
    assert t.rows[0].hi == 8192 and t.rows[1].lo == 8192
    sel = select(parse_proto_info(text), "cuda", "cuda", MiB64)
    assert [lane.device for lane in sel.rows[0].lanes] == ["mlx5_0:1", "mlx5_1:1"]
    assert paths.transport_kind(sel.transports, sel.descriptions, gpu_memory=True) == "rdma"
    assert parse_proto_info("no tables here\n| just | a | row |\n") == []


def test_memory_type():
    assert memory_type("host memory") == "host"
    assert memory_type("host") == "host"
    assert memory_type("cuda/GPU0") == "cuda"
    assert memory_type("cuda/dev[1]") == "cuda"


def test_two_gpu_capture_is_cuda_ipc():
    sel = select(parse_proto_info(_read("h200x2-selftest-cuda-nvlink.writer.txt")), "cuda", "cuda", MiB64)
    assert sel.summary == "zero-copy | cuda_ipc/cuda"
    assert sel.tables[0].src_raw == "cuda/GPU1" and sel.tables[0].dst_raw == "cuda/dev[2]"
