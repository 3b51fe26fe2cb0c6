"""Direct page writes in tests: the plan shapes they cover, source and destination caches
holding the reference shards (``bench.reference``), and the bytes moved on the host through
the kernel's addressing (``placement.byte_offsets``), the way the kernel would move them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstage.bench.reference import check_shard, fill_shard
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.cache import RankCache
from kvstage.staging.placement import WORD, byte_offsets, chunk_span
from kvstage.tp import SideSpec, TransferPlan, plan

TOKENS = 100
CHUNK = 37  # not a multiple of any page size: chunks start and end mid-page
SPARE_PAGES = 5  # pages of each cache outside the request: they must stay untouched


def _geo(kv_heads: int, mla: bool = False) -> KVGeometry:
    # 32-byte heads (two 16-byte words), 64-byte latents
    return KVGeometry(2, 1, 32, "bfloat16", True) if mla else KVGeometry(2, kv_heads, 16, "bfloat16")


#: name -> (geometry, source tp, source paging, destination tp, destination paging)
CASES = {
    "4->1": (_geo(8), 4, (16, "nhd"), 1, (16, "nhd")),
    "1->4": (_geo(8), 1, (16, "nhd"), 4, (16, "nhd")),
    "1->1 nhd16->hnd1": (_geo(8), 1, (16, "nhd"), 1, (1, "hnd")),
    "1->1 hnd1->nhd16": (_geo(8), 1, (1, "hnd"), 1, (16, "nhd")),
    "2->2 nhd1->hnd16": (_geo(4), 2, (1, "nhd"), 2, (16, "hnd")),
    "2->8 replicated": (_geo(4), 2, (4, "hnd"), 8, (8, "nhd")),
    "4->6 12 heads": (_geo(12), 4, (2, "nhd"), 6, (16, "hnd")),
    "8->2 2 kv heads": (_geo(2), 8, (16, "nhd"), 2, (4, "hnd")),
    "mla 2->3": (_geo(1, mla=True), 2, (16, "nhd"), 3, (1, "nhd")),
}


def case_plan(name: str) -> TransferPlan:
    geo, stp, spage, dtp, dpage = CASES[name]
    return plan(SideSpec(geo, stp, PageLayout(*spage)), SideSpec(geo, dtp, PageLayout(*dpage)))


@dataclass
class Caches:
    """Every source rank's cache holding its reference shard of the request, and every
    destination rank's cache zeroed; each rank's request page ids (random, spread over the cache)."""

    plan: TransferPlan
    src: list[RankCache]
    dst: list[RankCache]
    src_ids: list[np.ndarray]
    dst_ids: list[np.ndarray]
    seed: int
    tokens: int

    def check(self) -> list[str]:
        """Mismatches of every destination against the reference, pages outside the request included."""
        return [f"destination rank {r}: {e}" for r, c in enumerate(self.dst)
                for e in check_shard(c, self.seed, self.dst_ids[r], self.tokens)]


def _ids(rng, spec: SideSpec, tokens: int) -> tuple[int, np.ndarray]:
    need = pages_needed(tokens, spec.page.page_size)
    pages = need + SPARE_PAGES
    return pages, rng.permutation(pages)[:need].astype(np.int64)


def make_caches(p: TransferPlan, device="cpu", seed: int = 7, tokens: int = TOKENS) -> Caches:
    rng = np.random.default_rng(seed)
    src, src_ids = [], []
    for r in range(p.src.tp):
        pages, ids = _ids(rng, p.src, tokens)
        c = RankCache.allocate(p.src, r, pages, device, fill=0xEE)  # spare pages hold another byte than the shard
        fill_shard(c, seed, ids, tokens)
        src.append(c)
        src_ids.append(ids)
    dst, dst_ids = [], []
    for r in range(p.dst.tp):
        pages, ids = _ids(rng, p.dst, tokens)
        dst.append(RankCache.allocate(p.dst, r, pages, device, fill=0))
        dst_ids.append(ids)
    return Caches(p, src, dst, src_ids, dst_ids, seed, tokens)


def chunks(tokens: int = TOKENS, size: int = CHUNK) -> list[tuple[int, int]]:
    return [(s, min(size, tokens - s)) for s in range(0, tokens, size)]


def grant_pages(c: Caches, dst_rank: int, start: int, count: int) -> np.ndarray:
    """The destination's page ids a grant of tokens ``start .. start+count`` carries."""
    first_page = start // c.plan.dst.page.page_size
    _, span = chunk_span(c.plan.dst.page.page_size, start, count)
    return c.dst_ids[dst_rank][first_page : first_page + span]


def _words(t: torch.Tensor) -> np.ndarray:
    return t.view(-1).view(torch.uint8).numpy().view(np.dtype((np.void, WORD)))


def place_on_host(c: Caches, start: int, count: int) -> None:
    """Every piece of the chunk moved word by word on the host, at the offsets the kernel computes."""
    for piece in c.plan.pieces:
        src, dst = c.src[piece.src_rank], c.dst[piece.dst_rank]
        buffer, s, d = byte_offsets(c.plan.src, c.plan.dst, piece, c.src_ids[piece.src_rank],
                                    grant_pages(c, piece.dst_rank, start, count), start, count, dst.pages)
        assert not (s % WORD).any() and not (d % WORD).any()
        for b in range(c.plan.geometry.buffers):
            at = buffer == b
            _words(dst.buffers[b])[d[at] // WORD] = _words(src.buffers[b])[s[at] // WORD]
