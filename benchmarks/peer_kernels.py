"""kvstage's gather/scatter beside the peer's, same GPU, same bytes, same pages, one run.

The peer: SGLang 0.5.23's staging functions (``gather_all_layers_to_staging``,
``scatter_staging_to_kv`` in ``sglang/srt/disaggregation/common/staging_buffer.py``,
its fused Triton kernels), called as its transfer path calls them: the gather
with the request's page ids as numpy (uploaded in the call, then its stream
synchronized), the scatter with page ids already on the device (SGLang's
decode derives them on the GPU from ``req_to_token``). kvstage's calls are
the ones its endpoints issue (page ids uploaded when the request is posted,
the scatter prepared at grant time).

Both sides work on the same buffers: kvstage's NHD pages of 16 tokens are
SGLang's ``[tokens, heads, head_dim]`` layer buffers, K layers then V layers.
Each case first checks that both sides' scatters left byte-identical
destination pages, so the two time the same work.

Not a copy of SGLang: its two modules are loaded from an unpacked wheel
(``benchmarks/fetch_peer.sh`` puts them in ``.peer/``). The three names they
import from SGLang's heavy modules are given here as what they are in 0.5.23:
``envs.SGLANG_STAGING_USE_TORCH`` (False: the Triton path), and two one-line
stream helpers (a new torch stream; torch's stream context).

"One call": CUDA events around a single call, so host work inside the call
that the GPU waits for is counted (best of N); "synchronized": wall time of a
call and ``torch.cuda.synchronize()`` (best of N).

Usage: python benchmarks/peer_kernels.py [--sglang .peer/sglang-0.5.23] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
import types

import numpy as np
import torch

from gpu_kernels import timed
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging import copy as kcopy
from kvstage.staging.cache import RankCache
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import SideSpec, plan

PAGE = 16


def load_peer(root: str):
    """SGLang's staging module from ``root`` (an unpacked wheel), with its three outside names."""
    path = os.path.join(root, "sglang", "srt", "disaggregation", "common", "staging_buffer.py")
    table = os.path.join(root, "sglang", "kernels", "ops", "memory", "ptr_table.py")
    for f in (path, table):
        if not os.path.exists(f):
            sys.exit(f"--sglang {root}: {f} not found (run benchmarks/fetch_peer.sh)")
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.disaggregation.common",
                 "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.memory"):
        sys.modules.setdefault(name, types.ModuleType(name))
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = types.SimpleNamespace(SGLANG_STAGING_USE_TORCH=types.SimpleNamespace(get=lambda: False))
    utils = types.ModuleType("sglang.srt.utils")
    utils.create_device_stream = lambda device: torch.get_device_module(torch.device(device)).Stream(device=device)
    utils.device_stream_context = lambda stream: torch.get_device_module(stream.device).stream(stream)
    sys.modules["sglang.srt.environ"], sys.modules["sglang.srt.utils"] = environ, utils
    mods = {}
    for name, f in (("sglang.kernels.ops.memory.ptr_table", table),
                    ("sglang.srt.disaggregation.common.staging_buffer", path)):
        spec = importlib.util.spec_from_file_location(name, f)
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[name] = mods[name]
        spec.loader.exec_module(mods[name])
    return mods["sglang.srt.disaggregation.common.staging_buffer"]


def synchronized(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def layers(cache: RankCache):
    """SGLang's k_buffers and v_buffers: views of kvstage's layer-major (K, V) buffers as [tokens, heads, dim]."""
    flat = [b.view(-1, b.shape[-2], b.shape[-1]) for b in cache.buffers]
    return flat[0::2], flat[1::2]


def case(sb, src_tp: int, dst_tp: int, tokens: int) -> dict:
    geo = KVGeometry(32, 8, 128, "bfloat16")
    p = plan(SideSpec(geo, src_tp, PageLayout(PAGE)), SideSpec(geo, dst_tp, PageLayout(PAGE)))
    dev = torch.device("cuda", 0)
    npages = pages_needed(tokens, PAGE)
    pool = 2 * npages + 1
    rng = np.random.default_rng(0)
    sp = rng.permutation(pool)[:npages]
    dp = rng.permutation(pool)[:npages]
    # the destination rank 0 and its writers; each writer's gather of destination 0's heads
    writers = p.writers_of(0)
    srcs = {w.src_rank: RankCache.allocate(p.src, w.src_rank, pool, dev, fill=None) for w in writers}
    for c in srcs.values():
        for b in c.buffers:
            b.view(torch.int16).random_(-2**15, 2**15)
    dst_ours = RankCache.allocate(p.dst, 0, pool, dev)
    dst_peer = RankCache.allocate(p.dst, 0, pool, dev)
    hb = geo.head_bytes()
    # kvstage's slot: each writer's piece in head order, end to end (SGLang's staging holds the writers end to end
    # in its own layout)
    pieces = end_to_end([RegionPiece(w.dst_offset, w.heads.count, w.buffers, 0, Order.HEADS) for w in writers],
                        hb, tokens)
    offs = {w.src_rank: piece.offset for w, piece in zip(writers, pieces)}
    nbytes_s = pieces[-1].offset + pieces[-1].nbytes(hb, tokens)
    region = torch.empty(nbytes_s, dtype=torch.uint8, device=dev)
    staging = sb.StagingBuffer(nbytes_s, "cuda", 0)
    w0 = writers[0]
    src0 = srcs[w0.src_rank]
    nbytes_g = p.piece_token_bytes(w0) * tokens

    def gathered(w) -> list[RegionPiece]:
        """Writer ``w``'s gather: its heads for destination 0, at its place in the slot."""
        return [RegionPiece(w.src_offset, w.heads.count, w.buffers, offs[w.src_rank], Order.HEADS)]

    # kvstage, as the endpoints issue it
    sdev, ddev = kcopy.upload_pages(src0, sp), kcopy.upload_pages(dst_ours, dp)
    first = gathered(w0)

    def ours_gather():
        kcopy.gather(src0, kcopy.TokenIndex(src0, sp, 0, tokens, sdev), first, region)

    ours_scatter = kcopy.prepare_scatter(dst_ours, kcopy.TokenIndex(dst_ours, dp, 0, tokens, ddev), pieces, region)

    # the peer, as SGLang's transfer path calls it (its staging holds a writer's region end to end)
    k0, v0 = layers(src0)
    kd, vd = layers(dst_peer)
    dp_dev = torch.from_numpy(dp.astype(np.int64)).to(dev)

    def peer_gather():
        sb.gather_all_layers_to_staging(k0, v0, sp, staging, w0.src_offset, w0.heads.count, PAGE)

    def peer_scatter():
        sb.scatter_staging_to_kv(staging.buffer, kd, vd, dp_dev, PAGE, src_tp, dst_tp, 0, geo.kv_heads)

    # the same bytes land: every writer gathered by each side, then each side's scatter
    for w in writers:
        c = srcs[w.src_rank]
        kcopy.gather(c, kcopy.TokenIndex(c, sp, 0, tokens), gathered(w), region)
        kw, vw = layers(c)
        nbytes = p.piece_token_bytes(w) * tokens
        own = sb.StagingBuffer(nbytes, "cuda", 0)  # the writer's staging, sent end to end into the reader's
        sb.gather_all_layers_to_staging(kw, vw, sp, own, w.src_offset, w.heads.count, PAGE)
        staging.buffer[offs[w.src_rank]:offs[w.src_rank] + nbytes].copy_(own.buffer)
    ours_scatter()
    peer_scatter()
    torch.cuda.synchronize()
    def raw(t):
        return t.view(torch.uint8)

    same = all(torch.equal(raw(a), raw(b)) for a, b in zip(dst_ours.buffers, dst_peer.buffers))
    sp_t, dp_t = torch.from_numpy(sp).to(dev), torch.from_numpy(dp).to(dev)
    same = same and all(  # and they are the source's heads, in their places
        torch.equal(raw(dst_ours.buffers[b][dp_t][:, :, w.dst_offset:w.dst_offset + w.heads.count]),
                    raw(srcs[w.src_rank].buffers[b][sp_t][:, :, w.src_offset:w.src_offset + w.heads.count]))
        for w in writers for b in range(geo.buffers))
    if not same:
        sys.exit(f"{src_tp}->{dst_tp} {tokens} tokens: the two scatters left different destination pages, "
                 "or not the source's heads")
    row = {"case": f"{src_tp}->{dst_tp}", "tokens": tokens, "gather_bytes": nbytes_g, "scatter_bytes": nbytes_s,
           "same_pages": same}
    for side, g, s in (("kvstage", ours_gather, ours_scatter), ("sglang", peer_gather, peer_scatter)):
        (gt, _), (st, _) = timed(g), timed(s)
        row[f"{side}_gather_gbps"], row[f"{side}_scatter_gbps"] = nbytes_g / gt / 1e9, nbytes_s / st / 1e9
        row[f"{side}_gather_us"], row[f"{side}_scatter_us"] = gt * 1e6, st * 1e6
        gs, ss = synchronized(g), synchronized(s)
        row[f"{side}_gather_sync_gbps"], row[f"{side}_scatter_sync_gbps"] = nbytes_g / gs / 1e9, nbytes_s / ss / 1e9
    a = torch.empty(nbytes_s, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    cg, _ = timed(lambda: b[:nbytes_g].copy_(a[:nbytes_g]))
    cs, _ = timed(lambda: b.copy_(a))
    row["copy_gather_gbps"], row["copy_scatter_gbps"] = nbytes_g / cg / 1e9, nbytes_s / cs / 1e9
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang", default=".peer/sglang-0.5.23", help="an unpacked SGLang 0.5.23 wheel")
    ap.add_argument("--json")
    a = ap.parse_args()
    sb = load_peer(a.sglang)
    rows = []
    with contextlib.suppress(KeyboardInterrupt):
        for src_tp, dst_tp, tokens in ((4, 1, 128), (1, 4, 128), (4, 1, 8192), (1, 4, 8192)):
            r = case(sb, src_tp, dst_tp, tokens)
            rows.append(r)
            for what in ("gather", "scatter"):
                k, s = r[f"kvstage_{what}_gbps"], r[f"sglang_{what}_gbps"]
                print(f"{r['case']} {tokens:5d} tok {what:7s} {r[f'{what}_bytes'] / 1e6:7.2f} MB: "
                      f"kvstage {k:7.1f} GB/s ({r[f'kvstage_{what}_us']:.1f} us), sglang {s:7.1f} GB/s "
                      f"({r[f'sglang_{what}_us']:.1f} us): {k / s:.1f}x | synchronized: kvstage "
                      f"{r[f'kvstage_{what}_sync_gbps']:.1f}, sglang {r[f'sglang_{what}_sync_gbps']:.1f} GB/s "
                      f"({r[f'kvstage_{what}_sync_gbps'] / r[f'sglang_{what}_sync_gbps']:.1f}x) | d2d copy "
                      f"{r[f'copy_{what}_gbps']:.1f} GB/s", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
