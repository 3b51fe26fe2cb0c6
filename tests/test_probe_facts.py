"""Fact collection: real on this host, plus fake /sys trees and NVML lists for what it lacks."""

from __future__ import annotations

import json

import pytest
import torch

from kvstage.link import facts, gpu, libs, paths
from kvstage.link.finding import SOURCES


def test_collect_local_is_json_and_labelled():
    f = facts.collect_local(torch.zeros(16, dtype=torch.uint8))
    json.dumps(f)
    for name, entry in f.items():
        assert set(entry) == {"value", "source", "how"}, name
        assert entry["source"] in SOURCES, name
        assert entry["how"], name
    assert f["host"]["value"]["hostname"]
    assert f["pid_namespace"]["value"].startswith("pid:[")
    assert f["memory"]["value"] == {"device": "cpu", "nbytes": 16, "gpu": None}
    assert f["memory_ipc"]["value"]["ipc"] == "host"


def test_no_gpu_is_a_fact_not_an_error():
    g = gpu.nvml_gpus()
    assert g["source"] == "queried"
    if g["value"] is None:  # this CPU machine: NVML's library is missing
        assert g["how"].startswith("NVML not available")
    else:
        assert all({"name", "pci", "nvlink"} <= set(x) for x in g["value"])


def test_pointer_ipc_without_cuda_degrades():
    if gpu._libcuda() is not None:
        pytest.skip("libcuda present: the answer is real here")
    assert gpu.pointer_ipc(0x1000)["value"]["ipc"] == "unknown (no CUDA)"


def test_nixl_libraries_found():
    v = libs.ucx_version()
    assert v["source"] == "queried"
    assert v["value"] and v["value"][0].isdigit(), v
    assert "UCX" in libs.nixl_plugins()["value"]
    assert "UCX" in libs.nixl_plugins(["UCX", "POSIX"])["value"]
    assert "cma" in libs.ucx_modules()["value"]


def test_environment_picks_the_steering_variables(monkeypatch):
    env = facts.environment({"UCX_TLS": "tcp", "UCX_PROTO_INFO": "y", "PYTORCH_CUDA_ALLOC_CONF": "x", "HOME": "/h"})
    assert env["value"] == {"UCX_TLS": "tcp", "PYTORCH_CUDA_ALLOC_CONF": "x"}
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    assert facts.environment()["value"]["UCX_NET_DEVICES"] == "mlx5_0:1"


def test_rdma_devices_from_sysfs(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    down = tmp_path / "mlx5_1" / "ports" / "1"
    down.mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    r = facts.rdma_devices(str(tmp_path))
    assert r["value"][0] == {"name": "mlx5_0", "ports": [{"port": 1, "state": "ACTIVE", "phys_state": "LinkUp",
                                                          "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"}]}
    assert r["value"][1]["ports"][0]["state"] == "DOWN"
    assert paths.rdma_port_gbps("400 Gb/sec (4X NDR)") == 50.0
    assert facts.rdma_devices(str(tmp_path / "absent"))["value"] == []


def test_gpudirect_modules(tmp_path):
    (tmp_path / "nvidia_peermem").mkdir()
    assert facts.gpudirect_modules(str(tmp_path))["value"] == {"nvidia_peermem": True, "nv_peer_mem": False}


def test_pci_key():
    assert gpu.pci_key("00000000:00:06.0") == "0000:00:06.0"
    assert gpu.pci_key("0000:1A:00.0") == "0000:1a:00.0"
    assert gpu.pci_key("1a:00.0") == "0000:1a:00.0"


def _gpu(pci, links=(), supported=True):
    return {"name": "G", "pci": pci, "nvlink": {"supported": supported, "links": list(links)}}


def test_nvlink_between():
    a, b = "0000:01:00.0", "0000:02:00.0"
    direct = [_gpu(a, [{"link": 0, "up": True, "remote_pci": b, "remote_type": "gpu"}]), _gpu(b)]
    assert gpu.nvlink_between(direct, a, b)[0] is True
    switch = {"link": 0, "up": True, "remote_pci": "0000:ff:00.0", "remote_type": "switch"}
    assert gpu.nvlink_between([_gpu(a, [switch]), _gpu(b, [switch])], a, b)[0] is True
    down = [_gpu(a, [{"link": 0, "up": False}]), _gpu(b)]
    assert gpu.nvlink_between(down, a, b) == (False, f"no NVLink link up between {a} and {b}")
    lone = [_gpu(a, supported=False)]
    assert gpu.nvlink_between(lone, a, a)[0] is False  # one GPU: its own memory
    assert gpu.nvlink_between(None, a, b)[0] is None
    assert gpu.nvlink_between(direct, a, "0000:09:00.0")[0] is None


def test_nvlink_between_real_two_h200_nvml_answer():
    import pathlib

    g = json.loads((pathlib.Path(__file__).parent / "data" / "h200x2-nvml-gpus.json").read_text())["value"]
    up, why = gpu.nvlink_between(g, g[0]["pci"], g[1]["pci"])
    assert up is True and "18 and 18 NVLink links up to NVSwitch" in why


def test_ucx_tls_semantics():
    assert paths.tls_allows(None, "shm") and paths.tls_allows("", "shm")
    assert not paths.tls_allows("tcp", "shm")
    assert paths.tls_allows("sm,tcp", "shm") and paths.tls_allows("cma,tcp", "shm") and paths.tls_allows("all", "shm")
    assert not paths.tls_allows("posix,sysv,tcp", "shm")  # no cma: writes go over tcp (measured)
    assert not paths.tls_allows("^cma", "shm") and paths.tls_allows("^tcp", "shm")
    assert paths.tls_allows("cuda,tcp", "cuda_ipc") and not paths.tls_allows("cuda_copy,tcp", "cuda_ipc")
    assert paths.tls_allows("rc_x:aux,tcp", "rdma")
