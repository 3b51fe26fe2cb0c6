"""A destination process for the two-process direct-write tests, run as a script.

It allocates destination caches the way engines do (torch's caching allocator, one
big tensor per plane viewed per layer, the first view past a small offset), shares
them with ``share_buffers`` and checks them against the reference once the test's
source has written. One JSON object per line each way on stdin and stdout:

- ``{"cmd": "allocate", "case": name, "rank": r, "pages": n, "device": "cuda:0"}`` ->
  ``{"desc": ...}`` or ``{"refused": reason}``;
- ``{"cmd": "check", "rank": r, "seed": s, "ids": [...], "tokens": t}`` -> ``{"errors": [...]}``
  (pages outside ``ids`` must still be zero);
- ``{"cmd": "quit"}``.

As a source (``{"cmd": "write_until_killed", "case": name, "rank": r, "desc": ..., "dst_rank": d,
"grant": [...], "tokens": t}``) it opens the destination's shared buffers and writes its piece of
tokens ``0 .. t`` into the granted pages over and over, saying ``{"writing": true}`` once the
first write has landed, until it is killed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder, when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvstage.bench.reference import check_shard  # noqa: E402
from kvstage.layout import buffer_shape  # noqa: E402
from kvstage.staging.cache import RankCache, torch_dtype  # noqa: E402
from kvstage.staging.shared_buffers import NotShareable, share_buffers  # noqa: E402
from support.placed import case_plan  # noqa: E402

PAD = 256  # elements before the first view: buffers sit at an offset inside their allocation


def engine_buffers(spec, pages: int, device: str) -> list[torch.Tensor]:
    """A rank's buffers as views of one zeroed tensor per plane, interleaved layer by layer."""
    g = spec.geometry
    shape = buffer_shape(g, spec.page, spec.local_heads(), pages)
    n = math.prod(shape)
    planes = [torch.zeros(PAD + g.layers * n, dtype=torch_dtype(g.dtype), device=device) for _ in range(g.planes)]
    return [planes[k][PAD + layer * n : PAD + (layer + 1) * n].view(shape)
            for layer in range(g.layers) for k in range(g.planes)]


def write_until_killed(msg: dict) -> None:
    from kvstage.staging.copy import TokenIndex
    from kvstage.staging.cuda_place import PlacedCopier, PlacedWrite
    from kvstage.staging.shared_buffers import open_buffers

    p = case_plan(msg["case"])
    tokens = msg["tokens"]
    src_pages = -(-tokens // p.src.page.page_size)
    cache = RankCache.allocate(p.src, msg["rank"], src_pages, "cuda", fill=0x5A)
    opened = open_buffers(msg["desc"], cache.device)
    copier = PlacedCopier(cache, p.dst)
    dest = copier.destination(opened.spans)
    writes = [PlacedWrite(dest, piece, np.asarray(msg["grant"])) for piece in p.targets_of(msg["rank"])
              if piece.dst_rank == msg["dst_rank"]]
    idx = TokenIndex(cache, np.arange(src_pages), 0, tokens)
    copier.launch(idx, writes)
    torch.cuda.synchronize()
    print(json.dumps({"writing": True}), flush=True)
    while True:
        for _ in range(64):
            copier.launch(idx, writes)
        torch.cuda.synchronize()


def main() -> None:
    caches: dict[int, RankCache] = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "allocate":
            spec = case_plan(msg["case"]).dst
            buffers = engine_buffers(spec, msg["pages"], msg["device"])
            caches[msg["rank"]] = RankCache(spec, msg["rank"], buffers)
            torch.cuda.synchronize()
            try:
                reply = {"desc": share_buffers(buffers)}
            except NotShareable as e:
                reply = {"refused": str(e)}
        elif msg["cmd"] == "write_until_killed":
            write_until_killed(msg)
        else:
            c = caches[msg["rank"]]
            reply = {"errors": check_shard(c, msg["seed"], np.asarray(msg["ids"]), msg["tokens"])}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
