"""SGLang's KV pool, as its ``KVArgs`` describe it, in kvstage's layout types.

Pure bookkeeping plus zero-copy views; SGLang is not imported.

What SGLang 0.5.23 hands a transfer backend (``KVArgs``): raw pointers, one
per buffer, ``kv_data_ptrs`` = all K layers then all V layers (MHA/GQA), or one
latent buffer per layer (MLA). ``kv_item_lens[i]`` is one *page* of buffer
``i``; a page of an MHA pool is ``[page_size, local_heads, head_dim]``
token-major, which is kvstage's ``nhd`` order. ``kv_head_num`` and
``total_kv_head_num`` are set on the prefill side only (the decode scheduler
fills them only with SGLang's own staging on, and after the manager is
built), so the prefill publishes its layout on the bootstrap server and the
decode derives its own from it and checks it against its item sizes.

Every buffer is described as bytes (dtype ``uint8``, ``head_dim`` = bytes of
one head of one token): kvstage moves bytes, and SGLang itself checks that
both sides use the same ``--kv-cache-dtype``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstage.errors import ConfigError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.tp import SideSpec


@dataclass(frozen=True)
class SglangKVLayout:
    """The model-level KV shape both sides must share (what the prefill publishes)."""

    layers: int
    kv_heads: int  # all ranks together; 1 for MLA
    head_bytes: int  # one head of one token in one buffer (MLA: the whole latent)
    page_size: int
    mla: bool

    def geometry(self) -> KVGeometry:
        return KVGeometry(self.layers, self.kv_heads, self.head_bytes, "uint8", self.mla)

    def spec(self, tp: int) -> SideSpec:
        spec = SideSpec(self.geometry(), tp, PageLayout(self.page_size, "nhd"))
        spec.check("this engine")
        return spec

    def to_wire(self) -> dict:
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_bytes": self.head_bytes,
            "page_size": self.page_size,
            "mla": self.mla,
        }

    @classmethod
    def from_wire(cls, d: dict) -> SglangKVLayout:
        try:
            return cls(int(d["layers"]), int(d["kv_heads"]), int(d["head_bytes"]), int(d["page_size"]), bool(d["mla"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"prefill's published kvstage layout {d!r} is malformed: {e}") from None


def _buffers_per_layer(mla: bool) -> int:
    return 1 if mla else 2


def _check_args(kv_args, mla: bool) -> tuple[int, int]:
    """(layers, item_len) of ``kv_args``, or ``ConfigError`` naming what kvstage cannot describe."""
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    if not ptrs or not (len(ptrs) == len(lens) == len(items)):
        raise ConfigError(
            f"KVArgs: kv_data_ptrs/lens/item_lens have lengths {len(ptrs)}/{len(lens)}/{len(items)}; "
            "kvstage needs one entry per KV buffer, at least one"
        )
    if getattr(kv_args, "num_draft_entries", 0):
        raise ConfigError(
            f"KVArgs.num_draft_entries={kv_args.num_draft_entries}: kvstage does not move a speculative "
            "draft model's KV (disable speculative decoding on disaggregated engines)"
        )
    per = _buffers_per_layer(mla)
    if len(ptrs) % per:
        raise ConfigError(
            f"KVArgs: {len(ptrs)} KV buffers is not K and V per layer; kvstage needs 2 buffers per "
            "layer (all K layers, then all V layers) for MHA/GQA pools"
        )
    if len(set(items)) != 1:
        raise ConfigError(
            f"KVArgs.kv_item_lens={sorted(set(items))}: kvstage needs every KV buffer to have the same "
            "page size in bytes (K and V of equal head_dim, one pool kind)"
        )
    if any(n % items[0] for n in lens):
        raise ConfigError(f"KVArgs.kv_data_lens={lens}: not whole pages of {items[0]} bytes")
    return len(ptrs) // per, items[0]


def prefill_layout(kv_args, mla: bool) -> SglangKVLayout:
    """The prefill rank's layout, from ``KVArgs`` as SGLang's prefill scheduler fills them."""
    layers, item = _check_args(kv_args, mla)
    page = int(kv_args.page_size)
    local = 1 if mla else int(getattr(kv_args, "kv_head_num", 0) or 0)
    total = 1 if mla else int(getattr(kv_args, "total_kv_head_num", 0) or 0)
    if local < 1 or total < 1:
        raise ConfigError(
            f"KVArgs.kv_head_num={local}, total_kv_head_num={total}: the prefill scheduler sets both "
            "for MHA/GQA pools; kvstage needs them to plan head slices"
        )
    if item % (page * local):
        raise ConfigError(
            f"KVArgs.kv_item_lens[0]={item} is not page_size*kv_head_num*head_bytes "
            f"(page_size={page}, kv_head_num={local})"
        )
    return SglangKVLayout(layers, total, item // (page * local), page, mla)


def decode_spec(kv_args, mla: bool, prefill: SglangKVLayout, tp: int) -> SideSpec:
    """This decode rank's spec: the prefill's model shape at this engine's TP, checked
    against this rank's own buffers."""
    layers, item = _check_args(kv_args, mla)
    page = int(kv_args.page_size)
    if mla != prefill.mla:
        raise ConfigError(f"MLA differs: prefill mla={prefill.mla}, this decode mla={mla}")
    if layers != prefill.layers:
        raise ConfigError(f"layers differ: prefill has {prefill.layers} KV layers, this decode {layers}")
    if page != prefill.page_size:
        raise ConfigError(f"page_size differs: prefill {prefill.page_size}, this decode {page}; use one --page-size")
    spec = SglangKVLayout(layers, prefill.kv_heads, prefill.head_bytes, page, mla).spec(tp)
    want = page * spec.local_heads() * prefill.head_bytes
    if item != want:
        raise ConfigError(
            f"KVArgs.kv_item_lens[0]={item} on this decode rank; the prefill's layout ({prefill.kv_heads} KV heads "
            f"of {prefill.head_bytes} bytes) at decode TP {tp} means {spec.local_heads()} heads per rank, {want} "
            "bytes per page: prefill and decode must serve the same model with the same KV dtype"
        )
    return spec


def raw_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr`` (no copy; the memory stays SGLang's)."""
    if nbytes <= 0:
        raise ConfigError(f"buffer of {nbytes} bytes at {ptr:#x}: must be positive")
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    if device.type == "cuda":

        class _Span:  # what torch.as_tensor reads to wrap device memory without copying
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}

        return torch.as_tensor(_Span(), device=device)
    raise ConfigError(f"device {device}: kvstage's SGLang backend handles cpu and cuda KV pools")


def kv_buffers(kv_args, spec: SideSpec, device: torch.device) -> list[torch.Tensor]:
    """kvstage's buffers (L0.K, L0.V, L1.K, ... or one per MLA layer) over SGLang's pool."""
    layers = spec.geometry.layers
    item = int(kv_args.kv_item_lens[0])
    shape: tuple[int, ...] = (spec.page.page_size, spec.local_heads(), spec.geometry.head_dim)
    order: Sequence[int]
    if spec.geometry.mla:
        shape = (spec.page.page_size, spec.geometry.head_dim)
        order = range(layers)
    else:
        order = [i for layer in range(layers) for i in (layer, layers + layer)]  # SGLang: all K, then all V
    out = []
    for i in order:
        nbytes = int(kv_args.kv_data_lens[i])
        out.append(raw_bytes(int(kv_args.kv_data_ptrs[i]), nbytes, device).view(nbytes // item, *shape))
    return out


@dataclass
class RowBuffers:
    """Buffers addressed by row (SGLang's aux/metadata rows, or one state component)."""

    views: list[torch.Tensor]  # [rows, item_len] uint8 each

    @classmethod
    def of(cls, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int], device: torch.device) -> RowBuffers:
        return cls(
            [
                raw_bytes(int(p), int(n), device).view(int(n) // int(i), int(i))
                for p, n, i in zip(ptrs, lens, items, strict=False)
            ]
        )

    @property
    def item_lens(self) -> list[int]:
        return [v.shape[1] for v in self.views]

    def read(self, rows: Sequence[int]) -> list[bytes]:
        """One frame per buffer: the given rows, concatenated."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        return [v[idx.to(v.device)].cpu().numpy().tobytes() for v in self.views]

    def write(self, rows: Sequence[int], frames: Sequence[bytes]) -> None:
        if len(frames) != len(self.views):
            raise ConfigError(
                f"{len(frames)} buffers received, {len(self.views)} here: both sides must register "
                "the same metadata/state buffers"
            )
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        for v, f in zip(self.views, frames, strict=True):  # the same count: checked above
            if len(f) != len(rows) * v.shape[1]:
                raise ConfigError(f"{len(f)} bytes received for {len(rows)} rows of {v.shape[1]} bytes")
            v[idx.to(v.device)] = (
                torch.frombuffer(bytearray(f), dtype=torch.uint8).view(len(rows), v.shape[1]).to(v.device)
            )
