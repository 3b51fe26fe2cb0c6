"""One-host reads in tests: the plan shapes they cover, source caches holding the reference
shards (``bench.reference``) at a different token of each source's request, destination
caches zeroed, and the bytes moved on the host through the kernel's addressing
(``ipc_read.byte_offsets``), the way the kernel would move them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvstage.bench.reference import check_shard, full_buffer
from kvstage.layout import KVGeometry, PageLayout, buffer_shape, element_offsets, pages_needed, token_positions
from kvstage.staging.cache import RankCache, torch_dtype
from kvstage.staging.ipc_read import WORD, byte_offsets
from kvstage.tp import SideSpec, TransferPlan, plan

TOKENS = 100
CHUNK = 37  # not a multiple of any page size: chunks start and end mid-page
SPARE_PAGES = 5  # pages of each cache outside the request: they must stay untouched
SOURCE_FILL = 0xEE  # what a source's pages hold outside its shard of the request
PAD = 256  # elements before the first view of an engine's buffers: they sit inside their allocation


def _geo(kv_heads: int, layers: int = 2, mla: bool = False) -> KVGeometry:
    # 32-byte heads (two 16-byte words), 64-byte latents (four)
    return KVGeometry(layers, 1, 32, "bfloat16", True) if mla else KVGeometry(layers, kv_heads, 16, "bfloat16")


#: name -> (geometry, source tp, source paging, destination tp, destination paging); six layers where the
#: holders of replicated heads share them (8 -> 2, MLA 4 -> 1): uneven shares of one and two layers
CASES = {
    "4->1": (_geo(8), 4, (16, "nhd"), 1, (16, "nhd")),
    "1->4": (_geo(8), 1, (16, "nhd"), 4, (1, "hnd")),
    "1->1 nhd16->hnd1": (_geo(8), 1, (16, "nhd"), 1, (1, "hnd")),
    "1->1 hnd1->nhd64": (_geo(8), 1, (1, "hnd"), 1, (64, "nhd")),
    "2->1 hnd64->nhd16": (_geo(4), 2, (64, "hnd"), 1, (16, "nhd")),
    "2->8 replicated": (_geo(4), 2, (4, "hnd"), 8, (8, "nhd")),
    "4->6 12 heads": (_geo(12), 4, (2, "nhd"), 6, (16, "hnd")),
    "8->2 2 kv heads": (_geo(2, layers=6), 8, (16, "nhd"), 2, (4, "hnd")),
    "mla 4->1": (_geo(1, layers=6, mla=True), 4, (16, "nhd"), 1, (64, "nhd")),
    "mla 2->3": (_geo(1, mla=True), 2, (16, "nhd"), 3, (1, "nhd")),
}


def case_plan(name: str, src_page: tuple | None = None, dst_page: tuple | None = None) -> TransferPlan:
    """The case's plan, with either side's paging replaced where given as (page size, order)."""
    geo, stp, spage, dtp, dpage = CASES[name]
    return plan(SideSpec(geo, stp, PageLayout(*(src_page or spage))),
                SideSpec(geo, dtp, PageLayout(*(dst_page or dpage))))


def fill_shifted(cache: RankCache, seed: int, pages: np.ndarray, tokens: int, shift: int) -> None:
    """Write this rank's shard of the reference cache's tokens ``0 .. tokens`` at tokens
    ``shift .. shift+tokens`` of a request on ``pages``: element by element from
    ``layout.element_offsets``, apart from the code under test."""
    spec = cache.spec
    g = spec.geometry
    heads = spec.heads_of(cache.rank)
    hb = g.head_bytes()
    pid, off = token_positions(pages, spec.page.page_size, shift, tokens)
    for i, buf in enumerate(cache.buffers):
        full = full_buffer(seed, i, tokens, heads.stop, hb, heads.start)  # [tokens, local heads, head bytes]
        flat = buf.view(-1).view(torch.uint8)
        for j in range(heads.count):
            at = element_offsets(g, spec.page, spec.local_heads(), pid, off, j) * g.itemsize
            where = torch.from_numpy((at[:, None] + np.arange(hb)).reshape(-1)).to(buf.device)
            flat[where] = full[:, j].reshape(-1).to(buf.device)


def engine_buffers(spec: SideSpec, pages: int, device, fill: int = 0) -> list[torch.Tensor]:
    """A rank's buffers the way engines allocate them: views of one tensor per plane from torch's
    caching allocator, interleaved layer by layer, the first past a small offset."""
    g = spec.geometry
    shape = buffer_shape(g, spec.page, spec.local_heads(), pages)
    n = math.prod(shape)
    planes = [torch.empty(PAD + g.layers * n, dtype=torch_dtype(g.dtype), device=device) for _ in range(g.planes)]
    for p in planes:
        p.view(torch.uint8).fill_(fill)
    return [planes[k][PAD + layer * n : PAD + (layer + 1) * n].view(shape)
            for layer in range(g.layers) for k in range(g.planes)]


@dataclass(frozen=True)
class SourceRequest:
    """Where a source rank holds the request: its pages, its page ids of the request and the
    token of the request where the reference's first token sits."""

    pages: int
    ids: np.ndarray
    shift: int


def source_requests(p: TransferPlan, seed: int = 7, tokens: int = TOKENS) -> list[SourceRequest]:
    """Each source rank's request: random pages spread over its cache, and a shift of its own
    (mid-page, a different one on each rank), so each read starts at its own token."""
    rng = np.random.default_rng([seed, 1])
    out = []
    for r in range(p.src.tp):
        shift = int(rng.integers(0, 2 * p.src.page.page_size + 3))
        need = pages_needed(shift + tokens, p.src.page.page_size)
        out.append(SourceRequest(need + SPARE_PAGES, rng.permutation(need + SPARE_PAGES)[:need].astype(np.int64),
                                 shift))
    return out


def source_cache(p: TransferPlan, rank: int, req: SourceRequest, seed: int, tokens: int, device="cpu",
                 filled: bool = True) -> RankCache:
    """Source rank ``rank``'s cache in engine-like buffers: ``SOURCE_FILL`` everywhere, and its
    shard of the request where ``req`` says (``filled``)."""
    cache = RankCache(p.src, rank, engine_buffers(p.src, req.pages, device, SOURCE_FILL))
    if filled:
        fill_shifted(cache, seed, req.ids, tokens, req.shift)
    return cache


@dataclass
class Caches:
    """Every source rank's request (its cache here when the sources are in this process),
    every destination rank's cache zeroed, and each destination rank's request page ids."""

    plan: TransferPlan
    src: list[RankCache] | None
    requests: list[SourceRequest]
    dst: list[RankCache]
    dst_ids: list[np.ndarray]
    seed: int
    tokens: int

    def check(self) -> list[str]:
        """Mismatches of every destination against the reference, pages outside the request included."""
        return [f"destination rank {r}: {e}" for r, c in enumerate(self.dst)
                for e in check_shard(c, self.seed, self.dst_ids[r], self.tokens)]

    def clear(self) -> None:
        """Every destination page back to zero."""
        for c in self.dst:
            for b in c.buffers:
                b.view(torch.uint8).zero_()


def make_caches(p: TransferPlan, device="cpu", seed: int = 7, tokens: int = TOKENS, sources_here: bool = True,
                copier: str | None = None) -> Caches:
    """The caches of a case; ``sources_here`` False: the sources live in other processes
    (``support/ipc_source.py``), built there from ``requests``. ``copier``: the destination
    caches' (``RankCache``), which uploads their request page ids."""
    requests = source_requests(p, seed, tokens)
    src = [source_cache(p, r, q, seed, tokens, device) for r, q in enumerate(requests)] if sources_here else None
    rng = np.random.default_rng([seed, 2])
    dst, dst_ids = [], []
    for r in range(p.dst.tp):
        need = pages_needed(tokens, p.dst.page.page_size)
        dst.append(RankCache.allocate(p.dst, r, need + SPARE_PAGES, device, fill=0, copier=copier))
        dst_ids.append(rng.permutation(need + SPARE_PAGES)[:need].astype(np.int64))
    return Caches(p, src, requests, dst, dst_ids, seed, tokens)


def chunks(tokens: int = TOKENS, size: int = CHUNK) -> list[tuple[int, int]]:
    return [(s, min(size, tokens - s)) for s in range(0, tokens, size)]


def _words(t: torch.Tensor) -> np.ndarray:
    return t.view(-1).view(torch.uint8).numpy().view(np.dtype((np.void, WORD)))


def read_on_host(c: Caches, dst_rank: int, start: int, count: int) -> None:
    """Every piece landing on ``dst_rank`` for tokens ``start .. start+count`` moved word by word
    on the host, at the offsets the kernel computes."""
    dst = c.dst[dst_rank]
    for piece in c.plan.writers_of(dst_rank):
        src, req = c.src[piece.src_rank], c.requests[piece.src_rank]
        buffer, s, d = byte_offsets(c.plan.src, c.plan.dst, piece, req.ids, req.shift + start, c.dst_ids[dst_rank],
                                    start, count, src.pages, dst.pages)
        assert not (s % WORD).any() and not (d % WORD).any()
        for b in piece.buffers:
            at = buffer == b
            _words(dst.buffers[b])[d[at] // WORD] = _words(src.buffers[b])[s[at] // WORD]
