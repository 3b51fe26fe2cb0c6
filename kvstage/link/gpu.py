"""GPU facts: the GPUs and their NVLink links (NVML), peer access, and whether
a CUDA buffer is legacy-IPC capable (cudaMalloc) or VMM (expandable segments).

A missing NVML, a missing driver or no GPU is a fact, never an exception.
"""

from __future__ import annotations

import ctypes
import re

from kvstage.link.finding import fact

# CUpointer_attribute values from cuda.h (stable across CUDA versions).
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 15
_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS on Hopper


def pci_key(bus_id: str | None) -> str | None:
    """Normalise a PCI id: ``00000000:06:00.0`` and ``0000:06:00.0`` → ``0000:06:00.0``."""
    if not bus_id:
        return None
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])", bus_id.strip())
    if not m:
        return bus_id.strip().lower()
    dom = int(m.group(1) or "0", 16)
    return f"{dom:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _links(nv, handle) -> dict:
    links, supported = [], True
    for link in range(_MAX_LINKS):
        try:
            up = nv.nvmlDeviceGetNvLinkState(handle, link) == nv.NVML_FEATURE_ENABLED
        except nv.NVMLError_NotSupported:
            supported = link > 0
            break
        except nv.NVMLError:  # past the last link of this GPU
            break
        entry: dict[str, object] = {"link": link, "up": bool(up)}
        if up:
            try:
                entry["remote_pci"] = pci_key(_s(nv.nvmlDeviceGetNvLinkRemotePciInfo_v2(handle, link).busId))
            except (nv.NVMLError, AttributeError):
                entry["remote_pci"] = None
            try:
                kind = nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
                entry["remote_type"] = {0: "gpu", 1: "ibmnpu", 2: "switch"}.get(int(kind), "unknown")
            except (nv.NVMLError, AttributeError):
                entry["remote_type"] = "unknown"
        links.append(entry)
    return {"supported": supported, "links": links}


def nvml_gpus() -> dict:
    """Every GPU NVML sees: index, name, PCI id, UUID, NVLink links."""
    try:
        import pynvml as nv
    except ImportError:
        return fact(None, "queried", "NVML not available: nvidia-ml-py is not installed")
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        return fact(None, "queried", f"NVML not available: {e} (no NVIDIA driver on this host)")
    try:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                {
                    "index": i,
                    "name": _s(nv.nvmlDeviceGetName(h)),
                    "pci": pci_key(_s(nv.nvmlDeviceGetPciInfo(h).busId)),
                    "uuid": _s(nv.nvmlDeviceGetUUID(h)),
                    "nvlink": _links(nv, h),
                }
            )
        return fact(
            gpus, "queried", "NVML (nvmlDeviceGetPciInfo, nvmlDeviceGetNvLinkState, nvmlDeviceGetNvLinkRemotePciInfo)"
        )
    except nv.NVMLError as e:
        return fact(None, "queried", f"NVML failed: {e}")
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def nvlink_between(gpus: list[dict] | None, a_pci: str | None, b_pci: str | None) -> tuple[bool | None, str]:
    """Whether NVLink joins GPUs ``a`` and ``b`` (both as NVML sees them on one host)."""
    if not gpus or not a_pci or not b_pci:
        return None, "unknown: NVML or the GPUs' PCI ids are missing"
    by_pci = {g["pci"]: g for g in gpus}
    a, b = by_pci.get(pci_key(a_pci)), by_pci.get(pci_key(b_pci))
    if a is None or b is None:
        return None, "unknown: NVML does not list both GPUs"
    if a is b:
        return False, f"one GPU ({a['name']} {a['pci']}): the link is its own memory"
    up_a = [link for link in a["nvlink"]["links"] if link["up"]]
    direct = [link for link in up_a if link.get("remote_pci") == b["pci"]]
    if direct:
        return True, f"{len(direct)} NVLink link(s) up from {a['pci']} to {b['pci']}"
    sw_a = sum(link.get("remote_type") == "switch" for link in up_a)
    sw_b = sum(link.get("remote_type") == "switch" for link in b["nvlink"]["links"] if link["up"])
    if sw_a and sw_b:
        return True, f"{a['pci']} and {b['pci']} have {sw_a} and {sw_b} NVLink links up to NVSwitch"
    if not a["nvlink"]["supported"]:
        return False, f"NVLink not supported on {a['name']} {a['pci']}"
    return False, f"no NVLink link up between {a['pci']} and {b['pci']}"


def _torch_pci(props) -> str | None:
    if not hasattr(props, "pci_bus_id"):
        return None
    return pci_key(f"{getattr(props, 'pci_domain_id', 0):x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0")


def buffer_gpu(tensor) -> dict | None:
    """Index, name, PCI id and UUID of the GPU holding a CUDA tensor (None for host memory)."""
    if not getattr(tensor, "is_cuda", False):
        return None
    import torch

    idx = tensor.device.index or 0
    p = torch.cuda.get_device_properties(idx)
    return {"index": idx, "name": p.name, "pci": _torch_pci(p), "uuid": str(getattr(p, "uuid", "")) or None}


def peer_access(tensor) -> dict:
    """Whether the tensor's GPU can access each other visible GPU (torch → cudaDeviceCanAccessPeer)."""
    if not getattr(tensor, "is_cuda", False):
        return fact(None, "queried", "host memory: peer access does not apply")
    import torch

    idx, out = tensor.device.index or 0, {}
    for j in range(torch.cuda.device_count()):
        if j != idx:
            key = _torch_pci(torch.cuda.get_device_properties(j)) or str(j)
            out[key] = bool(torch.cuda.can_device_access_peer(idx, j))
    return fact(
        out, "queried", "torch.cuda.can_device_access_peer (cudaDeviceCanAccessPeer), keyed by the other GPU's PCI id"
    )


def _libcuda():
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def pointer_ipc(ptr: int) -> dict:
    """Legacy-IPC capability of a device pointer: ``legacy-ipc`` (cudaMalloc),
    ``vmm`` (cuMemCreate, e.g. PyTorch expandable segments) or ``unknown (...)``.
    Also says whether the driver calls it GPUDirect-RDMA capable."""
    lib = _libcuda()
    if lib is None:
        return fact({"ipc": "unknown (no CUDA)", "gpudirect_rdma": None}, "queried", "libcuda not found")
    ipc, gdr = ctypes.c_int(-1), ctypes.c_int(-1)
    f = lib.cuPointerGetAttribute
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    rc = f(ctypes.byref(ipc), _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_uint64(ptr))
    if rc != 0:
        return fact(
            {"ipc": f"unknown (cuPointerGetAttribute returned {rc})", "gpudirect_rdma": None},
            "queried",
            "cuPointerGetAttribute",
        )
    rc2 = f(ctypes.byref(gdr), _CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, ctypes.c_uint64(ptr))
    value = {"ipc": "legacy-ipc" if ipc.value else "vmm", "gpudirect_rdma": bool(gdr.value) if rc2 == 0 else None}
    return fact(value, "queried", "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE, IS_GPU_DIRECT_RDMA_CAPABLE)")


def memory_ipc(tensor) -> dict:
    """``pointer_ipc`` for a tensor; host tensors are ``host``, no CUDA is ``unknown (no CUDA)``."""
    if not getattr(tensor, "is_cuda", False):
        return fact({"ipc": "host", "gpudirect_rdma": None}, "queried", "tensor.device is cpu")
    return pointer_ipc(tensor.data_ptr())
