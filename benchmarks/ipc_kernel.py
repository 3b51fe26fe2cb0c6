"""The one-host read kernel alone (``cuda_ipc.IpcReadCopier``), timed with CUDA events beside a
torch device-to-device copy of the same bytes: every source rank's buffers (in this process here,
opened over CUDA IPC in the endpoints) read into one destination rank's pages in one launch, random
page order, ids uploaded once as the endpoints do. Best of 10 after a warm-up; one JSON line per case.
With checksums (``checksum=all`` on the ipc path): the same launch adding up each read's sum
(``summed_us``), and the sources' own sum passes over their pages (``source_sums_us``: the gather
kernel's sum-only mode, one launch per piece, as ``protocol.src_sums`` runs them on each source).

    python benchmarks/ipc_kernel.py
"""
import json

import numpy as np
import torch

from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.protocol.checksums import page_sums
from kvstage.staging import checksum, cuda_ipc
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, upload_pages
from kvstage.staging.shared_buffers import tensor_spans
from kvstage.tp import SideSpec, plan

from gpu_kernels import timed  # beside this script (run as python benchmarks/ipc_kernel.py)

out = []
dev = torch.device("cuda", 0)
rng = np.random.default_rng(0)
CASES = [(4, 1, 8192, 16, "nhd", 8, 128), (1, 4, 8192, 16, "nhd", 8, 128), (1, 1, 8192, 1, "hnd", 8, 128),
         (4, 1, 32768, 16, "nhd", 8, 128), (4, 1, 8192, 16, "nhd", 1, 576), (4, 1, 128, 16, "nhd", 8, 128)]
for s, d, tokens, dps, dlay, heads, hd in CASES:
    mla = heads == 1
    geo = KVGeometry(32 if not mla else 61, heads, hd, "bfloat16", mla)
    p = plan(SideSpec(geo, s, PageLayout(16)), SideSpec(geo, d, PageLayout(dps, dlay)))
    sp_n, dp_n = pages_needed(tokens, 16), pages_needed(tokens, dps)
    src = [RankCache.allocate(p.src, r, sp_n + 1, dev) for r in range(s)]
    dst = RankCache.allocate(p.dst, 0, dp_n + 1, dev)
    copier = cuda_ipc.IpcReadCopier(dst, p.src)
    sources = [copier.source(tensor_spans(c.buffers)) for c in src]
    sp = [rng.permutation(sp_n + 1)[:sp_n] for _ in range(s)]
    dp = rng.permutation(dp_n + 1)[:dp_n]
    kp = upload_pages(dst, dp)
    reads = [cuda_ipc.IpcRead(sources[pc.src_rank], pc, sp[pc.src_rank], 0) for pc in p.writers_of(0)]
    idx = TokenIndex(dst, dp, 0, tokens, kp)
    t, _ = timed(lambda: copier.launch(idx, reads), reps=10)
    sums = checksum.ChunkSums(tuple(range(len(reads))), np.zeros(len(reads), dtype=np.uint32))

    def summed():
        copier.launch(idx, reads, 0, checksum.on_device(sums, dev))
        checksum.to_host(sums)

    ts, _ = timed(summed, reps=10)
    spk = [upload_pages(c, ids) for c, ids in zip(src, sp)]
    tsrc, _ = timed(lambda: [page_sums(src[pc.src_rank], sp[pc.src_rank], spk[pc.src_rank], tokens, [pc], "source")
                             for pc in p.writers_of(0)], reps=10)
    nbytes = p.dst_token_bytes() * tokens
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    tc, _ = timed(lambda: b.copy_(a), reps=10)
    row = {"case": f"{s}->{d} {tokens} tok dst page {dps} {dlay} heads {heads}x{hd}", "kernel_gbps": nbytes / t / 1e9, "copy_gbps": nbytes / tc / 1e9, "kernel_us": t * 1e6,
           "vs_copy": tc / t, "summed_us": ts * 1e6, "summed_vs_plain": t / ts, "source_sums_us": tsrc * 1e6}
    print(json.dumps(row), flush=True)
    del src, dst, copier, sources, a, b
    torch.cuda.empty_cache()
