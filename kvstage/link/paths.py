"""Kinds of path, what UCX_TLS allows, and what bandwidth a path should give.

A *kind* groups UCX transports by how the bytes travel:

- ``shm``: shared memory between processes of one host (cma, knem, xpmem, posix, sysv);
- ``cuda_ipc``: GPU memory mapped into the peer process (NVLink, PCIe P2P or one GPU's HBM);
- ``cuda_copy``: GPU memory copied through host memory by the CUDA copy engines;
- ``rdma``: InfiniBand/RoCE verbs (rc, dc, ud) or EFA (srd), GPUDirect when the memory is GPU;
- ``rdma_staged``: RDMA for GPU memory, bounced through host memory (no GPUDirect);
- ``tcp``: sockets;
- ``emulated``: UCX's "software emulation" of a remote write over active messages;
- ``other``: anything else UCX may print.
"""

from __future__ import annotations

import re

SHM = frozenset({"cma", "knem", "xpmem", "posix", "sysv", "mm"})
RDMA_PREFIXES = ("rc", "dc", "ud", "srd")

KIND_NAMES = {
    "shm": "shared memory",
    "cuda_ipc": "CUDA IPC",
    "cuda_copy": "CUDA copy through host memory",
    "rdma": "RDMA",
    "rdma_staged": "RDMA staged through host memory (no GPUDirect)",
    "tcp": "TCP",
    "emulated": "software emulation",
    "other": "another transport",
}

# Names in UCX_TLS (transports or UCX's aliases) that enable a kind, and the
# one to suggest adding. cma is the shared-memory transport that does
# zero-copy writes: with only posix/sysv UCX sends writes over tcp (measured).
_TLS_ENABLING = {
    "shm": ({"cma", "sm", "shm", "all"}, "sm"),
    "cuda_ipc": ({"cuda_ipc", "cuda", "all"}, "cuda"),
    "cuda_copy": ({"cuda_copy", "cuda", "all"}, "cuda"),
    "rdma": (
        {
            "rc",
            "rc_v",
            "rc_x",
            "rc_verbs",
            "rc_mlx5",
            "dc",
            "dc_x",
            "dc_mlx5",
            "ud",
            "ud_v",
            "ud_x",
            "ud_verbs",
            "ud_mlx5",
            "ib",
            "srd",
            "all",
        },
        "rc",
    ),
}

# What a path should give, for the bandwidth check. A WARNING needs the
# measured figure below LOW_FRACTION of this: a conservative floor, not a target.
LOW_FRACTION = 0.10
EXPECTED_GBPS = {
    ("shm", "host"): (5.0, "NIXL over cma, 2-core CPU host: 5.2-6.6 GB/s measured"),
    ("cuda_ipc", "same-gpu"): (1470.0, "NIXL over cuda_ipc on one H200: 1,470-1,600 GB/s measured"),
    ("cuda_ipc", "nvlink"): (450.0, "H100/H200 NVLink: 450 GB/s per direction"),
    ("cuda_ipc", "pcie"): (25.0, "PCIe Gen4 x16 peer-to-peer"),
    ("cuda_copy", "any"): (10.0, "copies through pinned host memory"),
}

# How a cause names what UCX_TLS left out.
TLS_LEFT_OUT = {
    "shm": "cma, the shared-memory transport that does zero-copy writes",
    "cuda_ipc": "cuda_ipc",
    "cuda_copy": "cuda_copy",
    "rdma": "the RDMA transports (rc, dc, ud)",
}


def kind_name(kind: str, gpu_memory: bool = False) -> str:
    """How a line names a kind of path."""
    if kind == "rdma" and gpu_memory:
        return "RDMA with GPUDirect"
    return KIND_NAMES[kind]


def transport_kind(transports: list[str] | tuple[str, ...], descriptions=(), gpu_memory: bool = False) -> str:
    """The kind of path for UCX transport names (and protocol descriptions)."""
    tls = [t.lower() for t in transports]
    if any("emulation" in d for d in descriptions):
        return "emulated"
    rdma = any(t.startswith(RDMA_PREFIXES) for t in tls)
    if rdma:
        return "rdma_staged" if gpu_memory and "cuda_copy" in tls else "rdma"
    if "cuda_ipc" in tls:
        return "cuda_ipc"
    if any(t in SHM for t in tls):
        return "shm"
    if "cuda_copy" in tls or "gdr_copy" in tls:
        return "cuda_copy"
    if "tcp" in tls:
        return "tcp"
    return "other"


def transports_in(text: str) -> list[str]:
    """UCX transport names in a free string such as ``"cma/memory"`` or ``"tcp"``."""
    lanes = re.findall(r"([A-Za-z][A-Za-z0-9_]*)/", text)
    if lanes:
        return lanes
    return [w for w in re.split(r"[\s,;+|]+", text) if w]


def tls_items(value: str | None) -> tuple[bool, set[str]]:
    """``UCX_TLS`` as (negated, names); ``:aux`` suffixes dropped."""
    if not value:
        return False, set()
    neg = value.startswith("^")
    items = {x.split(":", 1)[0].strip().lower() for x in value.lstrip("^").split(",") if x.strip()}
    return neg, items


def tls_allows(value: str | None, kind: str) -> bool:
    """Whether ``UCX_TLS=value`` leaves UCX the transports of ``kind`` (unset: yes)."""
    if not value or kind not in _TLS_ENABLING:
        return True
    neg, items = tls_items(value)
    hit = bool(items & _TLS_ENABLING[kind][0])
    return not hit if neg else hit


def tls_fix(value: str, kind: str) -> str:
    """The change to UCX_TLS that gives UCX the transports of ``kind`` back."""
    neg, items = tls_items(value)
    if neg:
        drop = sorted(items & _TLS_ENABLING[kind][0])
        return f"unset UCX_TLS, or remove {', '.join(drop)} from its exclusion list (UCX_TLS={value})"
    add = _TLS_ENABLING[kind][1]
    return f"unset UCX_TLS (UCX then picks its fastest transport), or add {add} to it: UCX_TLS={value},{add}"


def rdma_port_gbps(rate: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` → 50.0 GB/s."""
    if not rate:
        return None
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate)
    return float(m.group(1)) / 8 if m else None
