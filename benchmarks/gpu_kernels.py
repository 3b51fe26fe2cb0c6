"""Gather/scatter kernel speed on one GPU beside a device-to-device copy of the same bytes.

Llama-3-8B KV geometry (32 layers, 8 KV heads, head_dim 128, bf16), page
size 16, random page order. Times with CUDA events, best of N after warm-up.
Usage: python benchmarks/gpu_kernels.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging import copy as kcopy
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec, plan


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def case(src_tp, dst_tp, tokens, fused=True):
    geo = KVGeometry(32, 8, 128, "bfloat16")
    p = plan(SideSpec(geo, src_tp, PageLayout(16)), SideSpec(geo, dst_tp, PageLayout(16)))
    dev = torch.device("cuda", 0)
    pages = 2 * pages_needed(tokens, 16) + 1
    rng = np.random.default_rng(0)
    src = RankCache.allocate(p.src, 0, pages, dev)
    dst = RankCache.allocate(p.dst, 0, pages, dev)
    sp = rng.permutation(pages)[: pages_needed(tokens, 16)]
    dp = rng.permutation(pages)[: pages_needed(tokens, 16)]
    piece = p.targets_of(0)[0]
    writers = p.writers_of(0)
    if not fused:
        src._copier = dst._copier = None
    nbytes_g = p.piece_token_bytes(piece) * tokens
    offs = p.writer_offsets(0, tokens)
    nbytes_s = sum(p.piece_token_bytes(w) * tokens for w in writers)
    region = torch.empty(max(nbytes_g, nbytes_s), dtype=torch.uint8, device=dev)
    sidx = kcopy.TokenIndex(src, sp, 0, tokens)
    didx = kcopy.TokenIndex(dst, dp, 0, tokens)
    g = timed(lambda: kcopy.gather(src, kcopy.TokenIndex(src, sp, 0, tokens), piece.src_offset, piece.heads.count, region[:nbytes_g]))
    s = timed(lambda: kcopy.scatter_chunk(dst, kcopy.TokenIndex(dst, dp, 0, tokens),
                                          [(w.dst_offset, w.heads.count, offs[w.src_rank]) for w in writers], region))
    a = torch.empty(max(nbytes_g, nbytes_s), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    cg = timed(lambda: b[:nbytes_g].copy_(a[:nbytes_g]))
    cs = timed(lambda: b[:nbytes_s].copy_(a[:nbytes_s]))
    del sidx, didx
    return {
        "case": f"{src_tp}->{dst_tp}", "tokens": tokens, "fused": fused,
        "gather_gbps": nbytes_g / g / 1e9, "gather_vs_copy": cg / g, "gather_us": g * 1e6,
        "scatter_gbps": nbytes_s / s / 1e9, "scatter_vs_copy": cs / s, "scatter_us": s * 1e6,
        "copy_gbps": nbytes_s / cs / 1e9,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for fused in (True, False):
        for src_tp, dst_tp in ((4, 1), (1, 4)):
            for tokens in (8192, 128):
                r = case(src_tp, dst_tp, tokens, fused)
                rows.append(r)
                print(f"{'fused' if fused else 'torch'} {r['case']} {tokens:5d} tok: gather {r['gather_gbps']:7.1f} GB/s "
                      f"({r['gather_vs_copy']:.0%} of copy, {r['gather_us']:.0f} us)  scatter {r['scatter_gbps']:7.1f} GB/s "
                      f"({r['scatter_vs_copy']:.0%} of copy, {r['scatter_us']:.0f} us)", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
