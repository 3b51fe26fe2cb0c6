"""Byte runs: a chunk's gather or scatter as a list of contiguous copies.

Every (layer, plane) buffer of a rank has the same shape, so one list of runs
serves all of them: run ``r`` copies ``length[r]`` bytes between
``buffer[b] + kv[r]`` and ``region + reg[r] + b * stride[r]``. The CUDA kernel
(``cuda_copy``) executes a whole list, for every buffer and every writer of a
chunk, in one launch; ``apply_on_host`` executes the same list with numpy so
the offsets are tested on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstage.layout import token_positions
from kvstage.staging.cache import RankCache


@dataclass
class Runs:
    kv: np.ndarray  # int64 byte offset inside each buffer
    reg: np.ndarray  # int64 byte offset of buffer 0's bytes inside the region
    stride: np.ndarray  # int64 region bytes between consecutive buffers
    length: np.ndarray  # int64 bytes

    @staticmethod
    def concat(parts: list["Runs"]) -> "Runs":
        return Runs(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("kv", "reg", "stride", "length")))

    def alignment(self) -> int:
        """Largest power of two (<= 16) dividing every offset and length."""
        g = np.gcd.reduce(np.concatenate([self.kv, self.reg, self.stride, self.length, [16]]).astype(np.int64))
        return int(g & -g)


def piece_runs(cache: RankCache, page_ids, start: int, count: int, head_lo: int, heads: int, base: int = 0) -> Runs:
    """Runs moving local heads ``[head_lo, head_lo+heads)`` of tokens ``start..start+count``
    between ``cache`` and a region laid out ``[buffers, count, heads, head_bytes]`` at ``base``."""
    spec = cache.spec
    g, P = spec.geometry, spec.page.page_size
    hb = g.head_bytes()
    H = 1 if g.mla else spec.local_heads()
    pid, off = token_positions(page_ids, P, start, count)
    stride = count * heads * hb
    token_major = g.mla or spec.page.order == "nhd"
    parts = []
    t0 = 0
    if token_major and heads == H and P > 1 and start % P == 0 and count >= P:
        pages = count // P  # whole pages first: one run per page
        t0 = pages * P
        pg = pid[:t0:P]
        parts.append(Runs(pg * (P * H * hb), base + np.arange(pages, dtype=np.int64) * (P * heads * hb),
                          np.full(pages, stride, np.int64), np.full(pages, P * heads * hb, np.int64)))
    rest = np.arange(t0, count, dtype=np.int64)
    if len(rest):
        if token_major:
            kv = ((pid[rest] * P + off[rest]) * H + head_lo) * hb
            parts.append(Runs(kv, base + rest * heads * hb, np.full(len(rest), stride, np.int64),
                              np.full(len(rest), heads * hb, np.int64)))
        else:
            j = np.arange(heads, dtype=np.int64)
            kv = ((pid[rest, None] * H + head_lo + j[None, :]) * P + off[rest, None]) * hb
            reg = base + (rest[:, None] * heads + j[None, :]) * hb
            n = kv.size
            parts.append(Runs(kv.reshape(-1), reg.reshape(-1), np.full(n, stride, np.int64), np.full(n, hb, np.int64)))
    return Runs.concat(parts)


def apply_on_host(cache: RankCache, runs: Runs, region: np.ndarray, to_region: bool) -> None:
    """Execute ``runs`` with numpy on host buffers (the kernel's reference)."""
    for b, buf in enumerate(cache.buffers):
        kvb = buf.view(-1).view(dtype=__import__("torch").uint8).numpy()
        for k, r, s, n in zip(runs.kv, runs.reg, runs.stride, runs.length):
            lo = r + b * s
            if to_region:
                region[lo : lo + n] = kvb[k : k + n]
            else:
                kvb[k : k + n] = region[lo : lo + n]
