"""Local facts for the probe, as one JSON-able dict.

Each entry is ``{"value": ..., "source": "queried"|"measured"|"assumed"|"expected",
"how": "..."}``. Nothing here raises for a missing GPU, driver, RDMA device or
file: its absence is recorded as the fact.
"""

from __future__ import annotations

import os
import socket

from kvstage.link import gpu, libs
from kvstage.link.finding import fact

ENV_VARS = (
    "UCX_TLS",
    "UCX_NET_DEVICES",
    "UCX_PROTO_EMULATION_ENABLE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "CUDA_VISIBLE_DEVICES",
    "NIXL_PLUGIN_DIR",
)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def host_identity() -> dict:
    boot = _read("/proc/sys/kernel/random/boot_id")
    value = {"hostname": socket.gethostname(), "boot_id": boot}
    how = (
        "hostname + /proc/sys/kernel/random/boot_id"
        if boot
        else "hostname only (/proc/sys/kernel/random/boot_id unreadable)"
    )
    return fact(value, "queried", how)


def pid_namespace() -> dict:
    try:
        return fact(os.readlink("/proc/self/ns/pid"), "queried", "readlink /proc/self/ns/pid")
    except OSError as e:
        return fact(None, "queried", f"readlink /proc/self/ns/pid failed: {e}")


def ptrace_scope() -> dict:
    """kernel.yama.ptrace_scope: 2 or 3 forbid the cross-process reads UCX's cma needs."""
    v = _read("/proc/sys/kernel/yama/ptrace_scope")
    if v is None:
        return fact(None, "queried", "/proc/sys/kernel/yama/ptrace_scope absent (no Yama: cma is not restricted by it)")
    return fact(int(v), "queried", "/proc/sys/kernel/yama/ptrace_scope")


def rdma_devices(root: str = "/sys/class/infiniband") -> dict:
    """RDMA devices and their ports' state, link layer and rate."""
    if not os.path.isdir(root):
        return fact([], "queried", f"no {root}: no RDMA device")
    devices = []
    for dev in sorted(os.listdir(root)):
        ports = []
        pdir = os.path.join(root, dev, "ports")
        for port in sorted(os.listdir(pdir)) if os.path.isdir(pdir) else []:
            p = os.path.join(pdir, port)
            state = _read(os.path.join(p, "state")) or ""
            ports.append(
                {
                    "port": int(port) if port.isdigit() else port,
                    "state": state.split(":")[-1].strip() or None,  # "4: ACTIVE" -> "ACTIVE"
                    "phys_state": (_read(os.path.join(p, "phys_state")) or "").split(":")[-1].strip() or None,
                    "link_layer": _read(os.path.join(p, "link_layer")),
                    "rate": _read(os.path.join(p, "rate")),
                }
            )
        devices.append({"name": dev, "ports": ports})
    return fact(devices, "queried", f"{root}/*/ports/*/{{state,phys_state,link_layer,rate}}")


def gpudirect_modules(root: str = "/sys/module") -> dict:
    """Whether a GPUDirect RDMA kernel module (nvidia_peermem or nv_peer_mem) is loaded."""
    if not os.path.isdir(root):
        return fact(None, "queried", f"{root} unreadable")
    value = {m: os.path.isdir(os.path.join(root, m)) for m in ("nvidia_peermem", "nv_peer_mem")}
    return fact(value, "queried", f"{root}/<module> present (dma-buf GPUDirect, which needs neither, is not checked)")


def environment(environ=None) -> dict:
    """The variables that steer the path (UCX_*, allocator, visible GPUs)."""
    src = os.environ if environ is None else environ
    env = {k: src[k] for k in ENV_VARS if k in src}
    env.update({k: v for k, v in src.items() if k.startswith("UCX_") and k != "UCX_PROTO_INFO"})
    return fact(
        env, "queried", "environment of this process" if environ is None else "environment given to the processes"
    )


def collect_local(tensor=None, agent_plugins: list[str] | None = None, with_gpus: bool = True) -> dict:
    """Facts about this process and host; with ``tensor``, also about its memory."""
    facts = {
        "pid": fact(os.getpid(), "queried", "os.getpid()"),
        "host": host_identity(),
        "pid_namespace": pid_namespace(),
        "ptrace_scope": ptrace_scope(),
        "gpus": gpu.nvml_gpus() if with_gpus else fact(None, "assumed", "not gathered"),
        "rdma": rdma_devices(),
        "gpudirect_rdma": gpudirect_modules(),
        "ucx_version": libs.ucx_version(),
        "ucx_modules": libs.ucx_modules(),
        "nixl_plugins": libs.nixl_plugins(agent_plugins),
        "env": environment(),
    }
    if tensor is not None:
        facts.update(memory_facts(tensor, facts["gpus"]["value"]))
    return facts


def memory_facts(tensor, nvml_list) -> dict:
    """Facts about a registered tensor's memory (``nvml_list``: the ``gpus`` fact's value)."""
    return {
        "memory": fact(
            {
                "device": "cuda" if tensor.is_cuda else "cpu",
                "nbytes": int(tensor.nbytes),
                "gpu": _resolve_gpu(tensor, nvml_list),
            },
            "queried",
            "the registered tensor",
        ),
        "memory_ipc": gpu.memory_ipc(tensor),
        "peer_access": gpu.peer_access(tensor),
    }


def _resolve_gpu(tensor, nvml_list) -> dict | None:
    info = gpu.buffer_gpu(tensor)
    if info and not info.get("pci") and info.get("uuid") and nvml_list:
        for g in nvml_list:
            if g["uuid"].lower().endswith(info["uuid"].lower()):
                info["pci"] = g["pci"]
    return info


def value(facts: dict | None, name: str, default=None):
    """The value of fact ``name`` (``default`` when absent)."""
    if not facts or name not in facts or not isinstance(facts[name], dict):
        return default
    v = facts[name].get("value")
    return default if v is None else v
