"""vLLM's paged KV cache described with kvstage's layout types. Pure: torch
tensors are inspected and viewed, never copied; vLLM is not imported.

What vLLM 0.32 hands a connector (``register_kv_caches``): one tensor per
attention layer, logical shape ``[blocks, kv_heads, block_size, content]``,
whose physical axis order is the engine's resolved KV cache layout:

- ``LBHNC`` (``HND``): ``[blocks, heads, block_size, content]``. The CPU
  backend's only layout. Its ``content`` is ``2 * head_size``, but the CPU
  kernels read a (block, head) unit as K stored transposed ``[head_size,
  block_size]`` followed by V ``[block_size, head_size]``: the unit is
  contiguous and meaningful only as a whole.
- ``LBNHC`` (``NHD``): ``[blocks, block_size, heads, content]``. The GPU
  FlashAttention default; ``content`` is K then V of one token and head.

Either way a layer is ONE contiguous buffer with no K/V plane of its own, and
the head axis is the KV head axis that tensor parallelism splits. kvstage
describes it exactly with its existing types when:

- ``head_dim`` is ``content`` (what one head of one "row" holds),
- ``page_size`` is the tensor's block size and ``order`` its physical order,
- transfers always move **whole blocks** (token count rounded up to whole
  pages). Row ``r`` of a page then lands on row ``r`` of the peer's page
  whatever the row means, so the CPU backend's transposed K is carried intact.
  Both sides must use the same block size and order (checked: ``check_peer``).

kvstage's ``KVGeometry`` has two buffers per layer (K and V) unless MLA. A
plane-less layer is therefore described by pairing: kvstage layer ``i`` is
vLLM layers ``2i`` (its "K" buffer) and ``2i+1`` (its "V" buffer). The
planner and the staging code only count buffers and heads, so the pairing
moves exactly the right bytes. With an odd layer count the last vLLM layer
fills both buffers of the last kvstage layer: correct, but it moves that
layer twice and must use the staged path (``duplicated_last``). A ``planes``
field on ``KVGeometry`` would remove both tricks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstage.errors import ConfigError
from kvstage.layout import DTYPE_SIZES, KVGeometry, PageLayout
from kvstage.tp import SideSpec

#: physical order name -> permutation of the logical [blocks, heads, block_size, content] axes
ORDERS = {"hnd": (0, 1, 2, 3), "nhd": (0, 2, 1, 3)}


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError(f"KV cache dtype {name}: kvstage moves {', '.join(DTYPE_SIZES)}")
    return name


#: vLLM's layout names (``VLLM_KV_CACHE_LAYOUT``, ``CacheConfig.kv_cache_layout``) -> order
VLLM_LAYOUTS = {"LBHNC": "hnd", "HND": "hnd", "LBNHC": "nhd", "NHD": "nhd"}


def physical_order(t: torch.Tensor, hint: str | None = None) -> str:
    """``hnd`` or ``nhd``: which physical order a logical ``[B, H, N, C]`` layer
    tensor has. Where both fit (one head per rank: the same bytes either way)
    ``hint`` (vLLM's resolved layout name) decides, so both sides of a transfer
    name the same order. Raises ``ConfigError`` when the layer is not one dense
    buffer (block-outer layouts interleave layers; padded blocks leave holes)."""
    if t.dim() != 4:
        raise ConfigError(
            f"KV cache layer tensor has shape {tuple(t.shape)}; expected [blocks, heads, block_size, content]"
        )
    fits = [name for name, perm in ORDERS.items() if t.permute(*perm).is_contiguous()]
    if len(fits) > 1 and hint is not None:
        want = VLLM_LAYOUTS.get(hint.upper(), hint.lower())
        if want in fits:
            return want
    if fits:
        return fits[0]
    raise ConfigError(
        f"KV cache layer of shape {tuple(t.shape)} with strides {t.stride()} is not one dense "
        "[blocks, heads, block_size, content] or [blocks, block_size, heads, content] buffer. kvstage needs a "
        "layer-outer layout: set VLLM_KV_CACHE_LAYOUT=LBNHC (NHD) or LBHNC (HND)"
    )


@dataclass(frozen=True)
class VllmKVLayout:
    """One engine rank's KV cache as kvstage sees it."""

    names: tuple[str, ...]  # vLLM layer names, in buffer order
    kv_heads: int  # the model's KV heads (all ranks together)
    local_heads: int  # heads in this rank's tensors
    content: int  # elements per (row, head): 2 * head_size for K|V layers
    page_size: int  # tokens per page of the tensors (vLLM's kernel block size)
    order: str  # "hnd" or "nhd"
    dtype: str
    pages_per_block: int = 1  # kernel pages per scheduler block

    @property
    def layers(self) -> int:
        return len(self.names)

    @property
    def duplicated_last(self) -> bool:
        """An odd layer count: the last layer stands in both buffers of the last kvstage layer."""
        return self.layers % 2 == 1

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(layers=-(-self.layers // 2), kv_heads=self.kv_heads, head_dim=self.content, dtype=self.dtype)

    @property
    def page(self) -> PageLayout:
        return PageLayout(self.page_size, self.order)

    @property
    def block_size(self) -> int:
        """Tokens per vLLM scheduler block."""
        return self.page_size * self.pages_per_block

    def spec(self, tp: int) -> SideSpec:
        spec = SideSpec(self.geometry, tp, self.page)
        spec.check("this engine")
        if spec.local_heads() != self.local_heads:
            raise ConfigError(
                f"this rank's KV tensors hold {self.local_heads} heads; {self.kv_heads} KV heads at TP {tp} "
                f"means {spec.local_heads()} per rank"
            )
        return spec

    def buffers(self, kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The tensors as kvstage buffers (views, no copy), paired two layers per kvstage layer."""
        out = []
        for name in self.names:
            t = kv_caches[name]
            out.append(t.permute(*ORDERS[self.order]))
        if self.duplicated_last:
            out.append(out[-1])
        return out

    def pages(self, block_ids: Sequence[int]) -> np.ndarray:
        """kvstage page ids of vLLM scheduler blocks (kernel blocks when vLLM splits them)."""
        b = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
        return (b * self.pages_per_block + np.arange(self.pages_per_block, dtype=np.int64)).reshape(-1)

    def tokens(self, blocks: int) -> int:
        """Tokens kvstage moves for ``blocks`` scheduler blocks: always whole pages."""
        return blocks * self.block_size

    # -- what a peer needs to know to check it can pair with this side ------
    def to_wire(self) -> dict:
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "content": self.content,
            "page_size": self.page_size,
            "order": self.order,
            "dtype": self.dtype,
            "block_size": self.block_size,
        }

    def check_peer(self, peer: object) -> None:
        """Raise ``ConfigError`` naming the first field a peer engine's layout differs in.

        Whole-page moves need the same page size and order on both sides (the
        CPU backend's block interior is only meaningful whole)."""
        mine = self.to_wire()
        if not isinstance(peer, Mapping):
            raise ConfigError(f"peer layout {peer!r} is not a mapping")
        for key, value in mine.items():
            if peer.get(key) != value:
                raise ConfigError(
                    f"KV layout differs: peer {key}={peer.get(key)!r}, this engine {key}={value!r}; "
                    "prefill and decode must serve the same model with the same block size, KV dtype and layout"
                )


def describe(
    kv_caches: Mapping[str, torch.Tensor], kv_heads: int, block_size: int, layout_hint: str | None = None
) -> VllmKVLayout:
    """Describe the tensors vLLM registered. ``kv_heads`` is the model's total
    KV head count, ``block_size`` the scheduler's block size (tokens),
    ``layout_hint`` vLLM's resolved layout name (``LBHNC``, ``LBNHC``)."""
    if not kv_caches:
        raise ConfigError("no KV cache tensors registered")
    seen: dict[int, str] = {}
    names = []
    for name in sorted(kv_caches, key=_natural):
        t = kv_caches[name]
        key = t.data_ptr()
        if key in seen:  # cross-layer KV sharing: the same tensor under two names
            continue
        seen[key] = name
        names.append(name)
    first = kv_caches[names[0]]
    order = physical_order(first, layout_hint)
    blocks, heads, page_size, content = first.shape
    for name in names[1:]:
        t = kv_caches[name]
        if (
            t.shape != first.shape
            or t.dtype != first.dtype
            or t.device != first.device
            or physical_order(t, order) != order
        ):
            raise ConfigError(
                f"layer {name}: {tuple(t.shape)} {t.dtype} on {t.device}; layer {names[0]}: "
                f"{tuple(first.shape)} {first.dtype} on {first.device}. "
                "kvstage needs one shape, dtype and layout for all layers "
                "(hybrid models with several KV cache groups are not supported)"
            )
    if block_size % page_size:
        raise ConfigError(f"block_size={block_size} is not a multiple of the KV tensors' block size {page_size}")
    return VllmKVLayout(
        names=tuple(names),
        kv_heads=kv_heads,
        local_heads=heads,
        content=content,
        page_size=page_size,
        order=order,
        dtype=dtype_name(first.dtype),
        pages_per_block=block_size // page_size,
    )
