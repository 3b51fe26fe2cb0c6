"""One request's host gather and scatter, in this process, each way kvstage can copy.

The default CPU scenario's request (Llama-3-8B KV geometry, 2,048 tokens, page 16
NHD, random pages): a TP-4 source rank gathers its two heads (67 MB), and the
TP-1 destination scatters the four sources' regions (268 MB). Each is timed with
numpy/torch (``host_copy="numpy"``), with the native span copies
(``host_copy="native"``), and with the native loop on ordinary
stores (memcpy), which shows what the streaming stores themselves are worth.
The scatter's spans are one source's heads of one token (512 bytes here).
Mean of ``--reps`` after one warm-up, one thread.

Usage: python benchmarks/host_copies.py [--reps 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvstage.layout import KVGeometry, PageLayout
from kvstage.staging import hostcopy
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather, region_bytes, scatter_chunk, use_host_copies
from kvstage.staging.spans import buffer_spans
from kvstage.tp import SideSpec

TOKENS, PAGES = 2048, 256


def _timed(f, reps: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--reps", type=int, default=10)
    reps = a.parse_args().reps
    torch.set_num_threads(1)
    geo = KVGeometry(32, 8, 128, "bfloat16")
    src = RankCache.allocate(SideSpec(geo, 4, PageLayout(16, "nhd")), 0, PAGES)
    dst = RankCache.allocate(SideSpec(geo, 1, PageLayout(16, "nhd")), 0, PAGES)
    for b in src.buffers:
        b.view(torch.uint8).random_(0, 255)
    ids = np.random.default_rng(0).permutation(PAGES)[: TOKENS // 16]
    piece = region_bytes(src, TOKENS, 2)
    region = torch.empty(piece, dtype=torch.uint8)
    slot = torch.randint(0, 256, (4 * piece,), dtype=torch.uint8)
    pieces = [(2 * k, 2, k * piece) for k in range(4)]

    offsets, lengths = buffer_spans(src, ids, 0, TOKENS, 0, 2)
    per = int(lengths.sum())
    to_region = [(region.data_ptr() + b * per, per) for b in range(geo.buffers)]
    from_cache = [(b.data_ptr(), b.nbytes) for b in src.buffers]

    def memcpy_gather() -> None:
        hostcopy.SpanCopy(np.cumsum(lengths) - lengths, offsets, lengths, streaming=False).run(to_region, from_cache)

    rows = []
    for mode in ("numpy", "native"):
        use_host_copies(src, mode)
        use_host_copies(dst, mode)
        g = _timed(lambda: gather(src, TokenIndex(src, ids, 0, TOKENS), 0, 2, region), reps)
        s = _timed(lambda: scatter_chunk(dst, TokenIndex(dst, ids, 0, TOKENS), pieces, slot), reps)
        rows.append((mode, g, s))
    to_cache = [(b.data_ptr(), b.nbytes) for b in dst.buffers]
    scatters = []
    for lo, n, base in pieces:
        off, ln = buffer_spans(dst, ids, 0, TOKENS, lo, n)
        scatters.append((hostcopy.SpanCopy(off, np.cumsum(ln) - ln, ln, streaming=False), base, int(ln.sum())))

    def memcpy_scatter() -> None:
        for copy, base, per in scatters:
            copy.run(to_cache, [(slot.data_ptr() + base + b * per, per) for b in range(geo.buffers)])

    rows.append(("native, ordinary stores", _timed(memcpy_gather, reps), _timed(memcpy_scatter, reps)))
    print(f"one request, {TOKENS} tokens: gather {piece / 1e6:.1f} MB (one TP-4 source), "
          f"scatter {4 * piece / 1e6:.1f} MB (the TP-1 destination); ms, GB/s")
    for mode, g, s in rows:
        print(f"  {mode:24s} gather {g * 1e3:6.2f} ms {piece / g / 1e9:5.2f} GB/s"
              f"   scatter {s * 1e3:6.2f} ms {4 * piece / s / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
