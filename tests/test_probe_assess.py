"""assess(): one test per message the probe can print, plus connect_line."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from kvstage.link.connect import connect_line
from kvstage.link.assess import assess
from kvstage.link.finding import Evidence, Finding, Severity, fact
from kvstage.link.ucx_info import parse_proto_info, select

DATA = pathlib.Path(__file__).parent / "data"
GPU_A, GPU_B = "0000:00:06.0", "0000:00:07.0"


def facts(host="h1", boot="boot-1", pidns="pid:[1]", device="cpu", gpu=None, gpus=None, ipc=None, env=None,
          rdma=(), modules=("cma", "cuda", "ib"), peer_access=None, ptrace=None, peermem=False, pid=100, gdr=None):
    """Facts as collect_local() returns them, for a made-up process."""
    return {
        "pid": fact(pid, "queried", "test"),
        "host": fact({"hostname": host, "boot_id": boot}, "queried", "test"),
        "pid_namespace": fact(pidns, "queried", "test"),
        "ptrace_scope": fact(ptrace, "queried", "test"),
        "gpus": fact(gpus, "queried", "test"),
        "rdma": fact([{"name": d, "ports": [{"port": 1, "state": s, "rate": r}]} for d, s, r in rdma], "queried", "test"),
        "gpudirect_rdma": fact({"nvidia_peermem": peermem, "nv_peer_mem": False}, "queried", "test"),
        "ucx_modules": fact(list(modules), "queried", "test"),
        "nixl_plugins": fact(["POSIX", "UCX"], "queried", "test"),
        "env": fact(dict(env or {}), "queried", "test"),
        "memory": fact({"device": device, "gpu": {"pci": gpu, "name": "NVIDIA H200"} if gpu else None}, "queried", "test"),
        "memory_ipc": fact({"ipc": ipc or ("host" if device == "cpu" else "legacy-ipc"), "gpudirect_rdma": gdr}, "queried", "test"),
        "peer_access": fact(peer_access, "queried", "test"),
    }


def gpu_list(*pcis, links=None):
    """NVML's GPU list; ``links`` maps a PCI id to the PCI ids its NVLink links reach."""
    links = links or {}
    return [{"index": i, "name": "NVIDIA H200", "pci": p, "uuid": f"GPU-{i}",
             "nvlink": {"supported": bool(links), "links": [{"link": k, "up": True, "remote_pci": r, "remote_type": "gpu"}
                                                            for k, r in enumerate(links.get(p, []))]}}
            for i, p in enumerate(pcis)]


def sel(summary, src="host", dst="host"):
    tls = [part.split("/")[0].split()[-1] for part in summary.split("|")[-1].split(" and ")]
    return {"summary": summary, "transports": tls, "descriptions": [summary.split("|")[0].strip()], "src": src, "dst": dst}


def _no_warning(f: Finding):
    assert f.severity is Severity.INFO, f.line()
    assert f.cause is None and f.fix is None
    assert "WARNING" not in f.line()


# --- INFO: the best path ------------------------------------------------------------------------

def test_info_same_host_shared_memory():
    f = assess(facts(pid=1), facts(pid=2), sel("zero-copy | cma/memory"), 5.3, peer_name="p")
    _no_warning(f)
    assert f.line().startswith("INFO kvstage link to p: DRAM->DRAM via shared memory (UCX: zero-copy | cma/memory), 5.30 GB/s measured")
    assert "measured: UCX selected zero-copy | cma/memory" in f.line()
    assert "queried: same host (hostname + boot id)" in f.line()
    assert "expected: same host, host memory" in f.line()


def test_info_h200_default_capture_no_warning():
    """The healthy default on the H200 (real capture): cuda_ipc, no warning."""
    s = select(parse_proto_info((DATA / "h200-selftest-cuda-default.writer.txt").read_text()), "cuda", "cuda", 64 << 20)
    g = gpu_list(GPU_A)
    f = assess(facts(device="cuda", gpu=GPU_A, gpus=g), facts(device="cuda", gpu=GPU_A, gpus=g), s, 569.7)
    _no_warning(f)
    assert "VRAM->VRAM via CUDA IPC (one GPU)" in f.path
    assert "queried: local GPU memory is legacy-IPC capable (cudaMalloc)" in f.line()


def test_info_no_peer_access_cuda_copy_is_best():
    g = gpu_list(GPU_A, GPU_B)
    f = assess(facts(device="cuda", gpu=GPU_A, gpus=g, peer_access={GPU_B: False}),
               facts(device="cuda", gpu=GPU_B, gpus=g), sel("zero-copy | cuda_copy/cuda", "cuda", "cuda"), 8.0)
    _no_warning(f)
    assert "peer access 0000:00:06.0 -> 0000:00:07.0: no" in f.line()


def test_info_different_hosts_without_rdma_tcp():
    f = assess(facts(host="a", boot="1"), facts(host="b", boot="2"), sel("zero-copy | tcp/eth0"), 1.1)
    _no_warning(f)
    assert "different hosts" in f.line() and "TCP" in f.path


def test_info_different_hosts_rdma_used():
    rdma = [("mlx5_0", "ACTIVE", "400 Gb/sec (4X NDR)")]
    f = assess(facts(host="a", boot="1", rdma=rdma), facts(host="b", boot="2", rdma=rdma), sel("zero-copy | rc_mlx5/mlx5_0:1"), 45.0)
    _no_warning(f)
    assert "RDMA" in f.path and "should give about 50 GB/s" in f.line()


def test_info_when_peer_facts_missing_labels_expectation():
    f = assess(facts(), None, sel("zero-copy | tcp/lo"), 2.0)
    _no_warning(f)
    assert "assumed: host of the peer unknown" in f.line()
    assert "expected: cannot tell whether this is the best path" in f.line()


# --- WARNING: a better path exists and is not used ------------------------------------------------

def test_warning_ucx_tls_tcp_on_one_host():
    f = assess(facts(env={"UCX_TLS": "tcp"}), facts(), sel("zero-copy | 52% on tcp/lo and 48% on tcp/eth0"), 1.6)
    assert f.severity is Severity.WARNING
    assert f.cause.startswith("UCX_TLS=tcp leaves out cma")
    assert f.fix == "unset UCX_TLS (UCX then picks its fastest transport), or add sm to it: UCX_TLS=tcp,sm"
    assert "faster path not used: shared memory" in f.path
    assert f.line().startswith("WARNING kvstage link to peer: DRAM->DRAM via TCP")


def test_warning_ucx_tls_without_cma():
    f = assess(facts(env={"UCX_TLS": "posix,tcp"}), facts(), sel("zero-copy | tcp/lo"), 2.0)
    assert f.severity is Severity.WARNING and "UCX_TLS=posix,tcp" in f.cause
    assert "UCX_TLS=posix,tcp,sm" in f.fix


def test_warning_ucx_tls_negated():
    f = assess(facts(env={"UCX_TLS": "^cma"}), facts(), sel("zero-copy | tcp/lo"), 2.0)
    assert f.severity is Severity.WARNING
    assert f.fix == "unset UCX_TLS, or remove cma from its exclusion list (UCX_TLS=^cma)"


def test_warning_vmm_memory_emulated_h200_capture():
    """The silent 0.4 GB/s of expandable segments (real capture) becomes a warning with its fix."""
    s = select(parse_proto_info((DATA / "h200-selftest-cuda-vmm.writer.txt").read_text()), "cuda", "cuda", 64 << 20)
    g = gpu_list(GPU_A)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    f = assess(facts(device="cuda", gpu=GPU_A, gpus=g, ipc="vmm", env=env), facts(device="cuda", gpu=GPU_A, gpus=g, ipc="vmm"), s, 0.41)
    assert f.severity is Severity.WARNING
    assert "VMM" in f.cause and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in f.cause
    assert "expandable_segments" in f.fix and "cudaMalloc" in f.fix
    assert "software emulation | tcp/lo" in f.path


def test_warning_nvlink_present_not_used():
    g = gpu_list(GPU_A, GPU_B, links={GPU_A: [GPU_B] * 18, GPU_B: [GPU_A] * 18})
    f = assess(facts(device="cuda", gpu=GPU_A, gpus=g, peer_access={GPU_B: True}, env={"UCX_TLS": "tcp,cuda_copy"}),
               facts(device="cuda", gpu=GPU_B, gpus=g), sel("zero-copy | tcp/lo", "cuda", "cuda"), 3.0)
    assert f.severity is Severity.WARNING
    assert f.cause.startswith("NVLink is up between the GPUs but UCX_TLS=tcp,cuda_copy leaves out cuda_ipc")
    assert "UCX_TLS=tcp,cuda_copy,cuda" in f.fix
    assert "queried: NVLink: 18 NVLink link(s) up from 0000:00:06.0 to 0000:00:07.0" in f.line()


def test_warning_nvlink_not_used_cause_unknown():
    g = gpu_list(GPU_A, GPU_B, links={GPU_A: [GPU_B], GPU_B: [GPU_A]})
    f = assess(facts(device="cuda", gpu=GPU_A, gpus=g), facts(device="cuda", gpu=GPU_B, gpus=g),
               sel("zero-copy | cuda_copy/cuda", "cuda", "cuda"), 9.0)
    assert f.severity is Severity.WARNING
    assert f.cause.startswith("NVLink is up between the GPUs but UCX chose")
    assert "UCX_LOG_LEVEL" in f.fix


def test_warning_rdma_active_but_tcp_net_devices():
    rdma = [("mlx5_0", "ACTIVE", "400 Gb/sec (4X NDR)")]
    f = assess(facts(host="a", boot="1", rdma=rdma, env={"UCX_NET_DEVICES": "eth0"}),
               facts(host="b", boot="2", rdma=rdma), sel("zero-copy | tcp/eth0"), 1.0)
    assert f.severity is Severity.WARNING
    assert "UCX_NET_DEVICES=eth0 names none of the ACTIVE RDMA ports (mlx5_0:1)" in f.cause
    assert "UCX_NET_DEVICES=mlx5_0:1" in f.fix


def test_warning_rdma_active_but_no_ib_module():
    rdma = [("mlx5_0", "ACTIVE", "200 Gb/sec")]
    f = assess(facts(host="a", boot="1", rdma=rdma, modules=("cma", "cuda")), facts(host="b", boot="2", rdma=rdma),
               sel("zero-copy | tcp/eth0"), 1.0)
    assert f.severity is Severity.WARNING and "libuct_ib" in f.cause


def test_warning_gpudirect_missing():
    rdma = [("mlx5_0", "ACTIVE", "400 Gb/sec")]
    f = assess(facts(host="a", boot="1", rdma=rdma, device="cuda", gpu=GPU_A),
               facts(host="b", boot="2", rdma=rdma, device="cuda", gpu=GPU_A),
               sel("zero-copy | cuda_copy/cuda and rc_mlx5/mlx5_0:1", "cuda", "cuda"), 12.0)
    assert f.severity is Severity.WARNING
    assert "GPUDirect RDMA is not in use" in f.cause and "nvidia_peermem" in f.cause
    assert "modprobe nvidia_peermem" in f.fix


def test_info_gpudirect_not_capable_staged_is_best():
    rdma = [("mlx5_0", "ACTIVE", "400 Gb/sec")]
    f = assess(facts(host="a", boot="1", rdma=rdma, device="cuda", gpu=GPU_A, gdr=False),
               facts(host="b", boot="2", rdma=rdma, device="cuda", gpu=GPU_A, gdr=False),
               sel("zero-copy | cuda_copy/cuda and rc_mlx5/mlx5_0:1", "cuda", "cuda"), 12.0)
    _no_warning(f)


def test_warning_different_pid_namespaces():
    f = assess(facts(pidns="pid:[1]"), facts(pidns="pid:[2]"), sel("zero-copy | tcp/lo"), 1.5)
    assert f.severity is Severity.WARNING
    assert "different PID namespaces" in f.cause and "--pid=host" in f.fix


def test_warning_ptrace_scope_blocks_cma():
    f = assess(facts(ptrace=2), facts(), sel("zero-copy | tcp/lo"), 1.5)
    assert f.severity is Severity.WARNING
    assert "ptrace_scope=2" in f.cause and "ptrace_scope=1" in f.fix


def test_warning_unexplained_fallback():
    f = assess(facts(), facts(), sel("zero-copy | tcp/lo"), 1.5)
    assert f.severity is Severity.WARNING
    assert "none of the probe's checks explains why" in f.cause and "UCX_PROTO_INFO=y" in f.fix


def test_warning_bandwidth_far_below_path():
    f = assess(facts(), facts(), sel("zero-copy | cma/memory"), 0.2)
    assert f.severity is Severity.WARNING
    assert "under 10% of the ~5 GB/s shared memory should give" in f.cause
    assert f.fix


def test_bandwidth_just_low_is_not_a_warning():
    _no_warning(assess(facts(), facts(), sel("zero-copy | cma/memory"), 0.9))


def test_fix_check_confirms_the_fix():
    check = {"change": "UCX_TLS unset", "selection": sel("zero-copy | cma/memory"), "gbps": 5.5}
    f = assess(facts(env={"UCX_TLS": "tcp"}), facts(), sel("zero-copy | tcp/lo"), 1.6, fix_check=check)
    assert f.severity is Severity.WARNING
    assert "measured: with UCX_TLS unset: UCX selected zero-copy | cma/memory, 5.50 GB/s" in f.line()


def test_fix_check_withdraws_a_warning_that_the_fix_does_not_cure():
    check = {"change": "UCX_TLS unset", "selection": sel("zero-copy | tcp/lo"), "gbps": 1.6}
    f = assess(facts(env={"UCX_TLS": "tcp"}), facts(), sel("zero-copy | tcp/lo"), 1.6, fix_check=check)
    _no_warning(f)
    assert "best path that works here" in f.path
    assert "measured: with UCX_TLS unset: still zero-copy | tcp/lo" in f.line()


# --- ERROR: no path --------------------------------------------------------------------------------

def test_error_ucx_cannot_start():
    msgs = ["UCX WARN transport 'rc' is not available, please use one or more of: cma, posix, tcp",
            "UCX ERROR no usable transports/devices (asked rc on network:intra-node:accelerator:loopback:)"]
    f = assess(facts(env={"UCX_TLS": "rc"}), None, None, None, write_error="the target failed at start NIXL: NIXL_ERR_BACKEND",
               ucx_messages=msgs)
    assert f.severity is Severity.ERROR and not f.ok
    assert f.fix == "UCX_TLS=rc names transports this host lacks; unset UCX_TLS or use only: cma, posix, tcp"
    assert "measured: UCX ERROR no usable transports/devices" in f.line()
    assert "no working path" in f.path


def test_error_nixl_rejects_ucx_tls_for_gpu():
    msgs = ["NIXL ERROR Invalid UCX_TLS=tcp for NIXL UCX backend: NVIDIA GPU(s) are present, but this setting does not "
            "enable CUDA memory support. Add cuda_copy for basic GPU support, or cuda to also include NVLink support."]
    f = assess(facts(device="cuda", env={"UCX_TLS": "tcp"}), None, None, None, write_error="the writer failed", ucx_messages=msgs)
    assert f.severity is Severity.ERROR
    assert f.fix.startswith("unset UCX_TLS, or make UCX_TLS=tcp include cuda")


def test_error_write_failed_without_messages():
    f = assess(facts(), facts(), sel("zero-copy | cma/memory"), None, write_error="the bytes that arrived differ from the bytes written")
    assert f.severity is Severity.ERROR and f.cause == "the bytes that arrived differ from the bytes written"
    assert f.fix


def test_error_no_ucx_plugin():
    local = facts()
    local["nixl_plugins"] = fact(["POSIX"], "queried", "test")
    f = assess(local, None, None, None, write_error="NIXL backend UCX is not available")
    assert "libplugin_UCX.so" in f.fix


# --- connect_line: what the engine logs once per peer ------------------------------------------------

def test_connect_line_opaque_transport_is_expected_not_warned(caplog):
    f = connect_line(facts(pid=1), facts(pid=2), "nixl", None)
    _no_warning(f)
    assert "via shared memory (expected; the transport was not observed)" in f.path
    assert f.peer == "h1 pid 2"
    logger = logging.getLogger("kvstage.test")
    with caplog.at_level(logging.INFO, logger="kvstage.test"):
        f.log(logger)
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.INFO
    assert caplog.records[0].getMessage() == f.line()


def test_connect_line_named_transport_warns_with_fix(caplog):
    f = connect_line(facts(env={"UCX_TLS": "tcp"}), facts(), "tcp", 1.5, peer_name="decode-0")
    assert f.severity is Severity.WARNING and "UCX_TLS" in f.cause
    with caplog.at_level(logging.INFO, logger="kvstage.test"):
        f.log(logging.getLogger("kvstage.test"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "queried: UCX selected tcp" in f.line()


def test_connect_line_of_kvstage_cma_names_its_own_transport_not_ucx():
    """cma is kvstage's own process_vm_writev: the line must not say UCX chose anything."""
    f = connect_line(facts(pid=1), facts(pid=2), "cma", None)
    _no_warning(f)
    assert "queried: kvstage's cma transport (process_vm_writev, no UCX) moves the writes" in f.line()
    assert "UCX selected" not in f.line() and "(UCX:" not in f.path
    assert "via shared memory (kvstage's cma transport" in f.path


def test_connect_line_low_bandwidth_on_unknown_transport():
    g = gpu_list(GPU_A)
    f = connect_line(facts(device="cuda", gpu=GPU_A, gpus=g), facts(device="cuda", gpu=GPU_A, gpus=g), "nixl", 0.4)
    assert f.severity is Severity.WARNING
    assert "1470 GB/s" in f.cause and "kvstage probe" in f.fix


def test_connect_line_healthy_gpu_is_silent():
    g = gpu_list(GPU_A)
    _no_warning(connect_line(facts(device="cuda", gpu=GPU_A, gpus=g), facts(device="cuda", gpu=GPU_A, gpus=g), "cuda_ipc", 600.0))


# --- connect time over an opaque transport (NIXL): what the facts alone rule out --------------------------
def test_connect_line_predicts_ucx_tls_leaving_out_cuda_ipc():
    """NIXL says nothing of UCX's choice; ``UCX_TLS=^cuda_ipc`` rules the best path out, so the
    line warns, names the cause and the fix, and labels the path as expected."""
    g = gpu_list(GPU_A)
    f = connect_line(facts(device="cuda", gpu=GPU_A, gpus=g, env={"UCX_TLS": "^cuda_ipc"}),
                     facts(device="cuda", gpu=GPU_A, gpus=g), "nixl", None)
    assert f.severity is Severity.WARNING and "UCX_TLS=^cuda_ipc leaves out cuda_ipc" in f.cause
    assert "unset UCX_TLS" in f.fix and "expected not to use CUDA IPC" in f.path
    assert f.details["expected_gbps"] == 1470.0


@pytest.mark.parametrize("side", ["local", "peer"])
def test_connect_line_warns_for_kv_memory_from_expandable_segments(side):
    """The direct path registers the KV buffers: VMM memory there (expandable segments) rules out
    CUDA IPC, whichever side holds it; the arena's cudaMalloc memory would not."""
    g = gpu_list(GPU_A)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    vmm = facts(device="cuda", gpu=GPU_A, gpus=g, ipc="vmm", env=env)
    ok = facts(device="cuda", gpu=GPU_A, gpus=g, env=env)
    local, peer = (vmm, ok) if side == "local" else (ok, vmm)
    f = connect_line(local, peer, "nixl", None)
    assert f.severity is Severity.WARNING and "VMM (expandable segments)" in f.cause, f.line()
    assert "expandable_segments" in f.fix
    _no_warning(connect_line(ok, ok, "nixl", None))


def test_connect_line_predicts_cma_blocked_by_ptrace_scope():
    f = connect_line(facts(ptrace=3), facts(), "nixl", None)
    assert f.severity is Severity.WARNING and "ptrace_scope=3" in f.cause


# --- the Finding itself -------------------------------------------------------------------------------

def test_finding_to_dict_is_json():
    f = assess(facts(), facts(), sel("zero-copy | cma/memory"), 5.0)
    d = json.loads(json.dumps(f.to_dict()))
    assert d["severity"] == "INFO" and d["line"] == f.line()
    assert all(e["source"] in ("queried", "measured", "assumed", "expected") for e in d["evidence"])


def test_evidence_source_is_checked():
    with pytest.raises(ValueError):
        Evidence("guessed", "x")
    with pytest.raises(ValueError):
        fact(1, "rumoured", "x")


# --- two H200s joined by NVLink through NVSwitch (real NVML answer and capture) -----------------------

def _x2():
    g = json.loads((DATA / "h200x2-nvml-gpus.json").read_text())["value"]
    a, b = g[1]["pci"], g[0]["pci"]  # the writer ran on cuda:1, the target on cuda:0
    return g, a, b


def test_info_two_h200_nvlink_capture():
    g, a, b = _x2()
    s = select(parse_proto_info((DATA / "h200x2-selftest-cuda-nvlink.writer.txt").read_text()), "cuda", "cuda", 64 << 20)
    f = assess(facts(device="cuda", gpu=a, gpus=g, peer_access={b: True}), facts(device="cuda", gpu=b, gpus=g), s, 241.8)
    _no_warning(f)
    assert "VRAM->VRAM via CUDA IPC over NVLink (UCX: zero-copy | cuda_ipc/cuda)" in f.path
    assert f"queried: NVLink: {a} and {b} have 18 and 18 NVLink links up to NVSwitch" in f.line()


def test_warning_two_h200_nvlink_unused():
    g, a, b = _x2()
    f = assess(facts(device="cuda", gpu=a, gpus=g, peer_access={b: True}), facts(device="cuda", gpu=b, gpus=g),
               sel("zero-copy | cuda_copy/cuda", "cuda", "cuda"), 20.0)
    assert f.severity is Severity.WARNING
    assert f.cause.startswith("NVLink is up between the GPUs but")


def test_warning_two_h200_nvlink_too_slow():
    g, a, b = _x2()
    f = assess(facts(device="cuda", gpu=a, gpus=g, peer_access={b: True}), facts(device="cuda", gpu=b, gpus=g),
               sel("zero-copy | cuda_ipc/cuda", "cuda", "cuda"), 30.0)
    assert f.severity is Severity.WARNING and "under 10% of the ~450 GB/s" in f.cause
