"""Gather/scatter kernel speed on one GPU beside a device-to-device copy of the same bytes.

Llama-3-8B KV geometry (32 layers, 8 KV heads, head_dim 128, bf16), page
size 16, random page order. Times with CUDA events, best of N after warm-up.
The gather is a source's whole shard in head order; the scatter, every writer's
piece of a destination's slot. The main figures time a chunk's copy as the
endpoints issue it (page ids uploaded when the request was posted; the scatter
prepared at grant time); "cold" puts every set-up step inside the timed call.
"torch" rows run the same copies through the torch copier, for comparison. "summed" times the same
gather and scatter adding up their chunk checksums (``checksum=all`` on the read path).
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
from kvstage.staging.checksum import ChunkSums
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import SideSpec, plan


def timed(fn, reps=20):
    """Best single call (CUDA events around one call, host set-up included when
    the GPU waits for it) and the mean per call of ``reps`` calls queued back to
    back (set-up overlapped with the previous call's copy, as in the pipeline)."""
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
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return best, a.elapsed_time(b) / 1e3 / reps


def host_seconds(fn, reps=20):
    """Host time of one call (launch only, no synchronization): the per-call set-up."""
    import time

    fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return sorted(t)[len(t) // 2]


def case(src_tp, dst_tp, tokens, fused=True, host_region=False):
    geo = KVGeometry(32, 8, 128, "bfloat16")
    p = plan(SideSpec(geo, src_tp, PageLayout(16)), SideSpec(geo, dst_tp, PageLayout(16)))
    dev = torch.device("cuda", 0)
    pages = 2 * pages_needed(tokens, 16) + 1
    rng = np.random.default_rng(0)
    copier = None if fused else "torch"
    src = RankCache.allocate(p.src, 0, pages, dev, copier=copier)
    dst = RankCache.allocate(p.dst, 0, pages, dev, copier=copier)
    sp = rng.permutation(pages)[: pages_needed(tokens, 16)]
    dp = rng.permutation(pages)[: pages_needed(tokens, 16)]
    hb = geo.head_bytes()
    # the source's gather: its whole shard, head order (each destination reads its heads' rows from it)
    shard = [RegionPiece(0, p.src.local_heads(), range(geo.buffers), 0, Order.HEADS)]
    # the destination's scatter: every writer's piece of its slot, laid end to end
    pieces = end_to_end([RegionPiece(w.dst_offset, w.heads.count, w.buffers, 0, Order.HEADS) for w in p.writers_of(0)],
                        hb, tokens)
    nbytes_g = shard[0].nbytes(hb, tokens)
    nbytes_s = pieces[-1].offset + pieces[-1].nbytes(hb, tokens)
    if host_region:  # the pinned-host arena: the kernel reads/writes host memory over the GPU's host link
        region = torch.empty(max(nbytes_g, nbytes_s), dtype=torch.uint8).pin_memory()
    else:
        region = torch.empty(max(nbytes_g, nbytes_s), dtype=torch.uint8, device=dev)
    # as the endpoints run them: page ids uploaded once when the request is posted
    # (send / expect), the source building its chunk index at grant time, the
    # destination's scatter prepared at grant time and launched when the bytes land
    sdev, ddev = kcopy.upload_pages(src, sp), kcopy.upload_pages(dst, dp)

    def do_gather():
        kcopy.gather(src, kcopy.TokenIndex(src, sp, 0, tokens, sdev), shard, region)

    do_scatter = kcopy.prepare_scatter(dst, kcopy.TokenIndex(dst, dp, 0, tokens, ddev), pieces, region)

    # cold: every set-up step inside the timed call (page ids uploaded per call, scatter prepared per call)
    def cold_gather():
        kcopy.gather(src, kcopy.TokenIndex(src, sp, 0, tokens), shard, region)

    def cold_scatter():
        kcopy.scatter_chunk(dst, kcopy.TokenIndex(dst, dp, 0, tokens), pieces, region)

    gather_sums, scatter_sums = ChunkSums.of(shard, hb, tokens), ChunkSums.of(pieces, hb, tokens)

    def summed_gather():
        kcopy.gather(src, kcopy.TokenIndex(src, sp, 0, tokens, sdev), shard, region, gather_sums)

    summed_scatter = kcopy.prepare_scatter(dst, kcopy.TokenIndex(dst, dp, 0, tokens, ddev), pieces, region,
                                           sums=scatter_sums)
    g, gq = timed(do_gather)
    s, sq = timed(do_scatter)
    gs, _ = timed(summed_gather)
    ss, _ = timed(summed_scatter)
    gc, _ = timed(cold_gather)
    sc, _ = timed(cold_scatter)
    gh, sh = host_seconds(do_gather), host_seconds(do_scatter)
    gch, sch = host_seconds(cold_gather), host_seconds(cold_scatter)
    a = torch.empty(max(nbytes_g, nbytes_s), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    cg, _ = timed(lambda: b[:nbytes_g].copy_(a[:nbytes_g]))
    cs, _ = timed(lambda: b[:nbytes_s].copy_(a[:nbytes_s]))
    return {
        "case": f"{src_tp}->{dst_tp}{' host arena' if host_region else ''}", "tokens": tokens, "fused": fused,
        "gather_gbps": nbytes_g / g / 1e9, "gather_vs_copy": cg / g, "gather_us": g * 1e6,
        "scatter_gbps": nbytes_s / s / 1e9, "scatter_vs_copy": cs / s, "scatter_us": s * 1e6,
        "copy_gbps": nbytes_s / cs / 1e9,
        "gather_summed_us": gs * 1e6, "gather_summed_vs_plain": g / gs,
        "scatter_summed_us": ss * 1e6, "scatter_summed_vs_plain": s / ss,
        "gather_queued_gbps": nbytes_g / gq / 1e9, "scatter_queued_gbps": nbytes_s / sq / 1e9,
        "gather_host_us": gh * 1e6, "scatter_host_us": sh * 1e6,
        "gather_cold_gbps": nbytes_g / gc / 1e9, "scatter_cold_gbps": nbytes_s / sc / 1e9,
        "gather_cold_host_us": gch * 1e6, "scatter_cold_host_us": sch * 1e6,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    cases = [(True, s, d, t, False) for s, d in ((4, 1), (1, 4)) for t in (8192, 128)]
    cases += [(True, 4, 1, 8192, True), (True, 1, 4, 8192, True)]  # pinned-host arena
    cases += [(False, s, d, t, False) for s, d in ((4, 1), (1, 4)) for t in (8192, 128)]
    for fused, src_tp, dst_tp, tokens, host in cases:
        r = case(src_tp, dst_tp, tokens, fused, host)
        rows.append(r)
        print(f"{'fused' if fused else 'torch'} {r['case']} {tokens:5d} tok: gather {r['gather_gbps']:7.1f} GB/s "
              f"({r['gather_vs_copy']:.0%} of copy, {r['gather_us']:.0f} us)  scatter {r['scatter_gbps']:7.1f} GB/s "
              f"({r['scatter_vs_copy']:.0%} of copy, {r['scatter_us']:.0f} us)  queued: gather "
              f"{r['gather_queued_gbps']:.1f} scatter {r['scatter_queued_gbps']:.1f} GB/s  host set-up: "
              f"gather {r['gather_host_us']:.0f} us scatter {r['scatter_host_us']:.0f} us | cold (set-up per call): gather "
              f"{r['gather_cold_gbps']:.1f} scatter {r['scatter_cold_gbps']:.1f} GB/s, host {r['gather_cold_host_us']:.0f}"
              f"/{r['scatter_cold_host_us']:.0f} us | summed: gather {r['gather_summed_us']:.0f} us "
              f"({r['gather_summed_vs_plain']:.3f}x) scatter {r['scatter_summed_us']:.0f} us "
              f"({r['scatter_summed_vs_plain']:.3f}x)", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
