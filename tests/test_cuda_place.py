"""The direct page-write kernel on a GPU, in one process: every plan shape byte for byte
against the reference shards (pages outside the request untouched), a 1->N source's
pieces in one launch, page ids in the launch or uploaded, prepared and launched later,
and grants refused before anything is launched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.placed import CASES, case_plan, chunks, grant_pages, make_caches
from kvstage.errors import ConfigError, ProtocolError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.staging import cuda_copy, cuda_place
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, upload_pages
from kvstage.staging.cuda_place import PlacedCopier, PlacedWrite
from kvstage.staging.shared_buffers import tensor_spans
from kvstage.tp import SideSpec

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu():
    if not (torch.cuda.is_available() and cuda_copy.available()):
        pytest.skip("needs CUDA and CuPy")


def _copiers(c):
    """Each source rank's copier and, per source rank, each destination rank's buffers as it writes them."""
    copiers = [PlacedCopier(src, c.plan.dst) for src in c.src]
    dests = [[k.destination(tensor_spans(dst.buffers)) for dst in c.dst] for k in copiers]
    return copiers, dests


def _write_all(c, copiers, dests, uploaded: bool, prepared: bool = False) -> None:
    """Every chunk from every source rank, one launch per (rank, chunk) covering all its destinations."""
    ids = [upload_pages(s, c.src_ids[r]) if uploaded else None for r, s in enumerate(c.src)]
    launches = []
    for start, count in chunks():
        for r, (src, k) in enumerate(zip(c.src, copiers)):
            targets = c.plan.targets_of(r)
            if not targets:
                continue
            idx = TokenIndex(src, c.src_ids[r], start, count, ids[r])
            writes = [PlacedWrite(dests[r][p.dst_rank], p, grant_pages(c, p.dst_rank, start, count)) for p in targets]
            if prepared:
                launches.append(k.prepare(idx, writes))
            else:
                k.launch(idx, writes)
    for run in launches:
        run()
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ids", ["chunk", "request on host", "request on device", "all uploaded"])
def test_every_plan_shape_lands_byte_for_byte(gpu, name, ids, monkeypatch):
    """Where the source's page ids come from: each chunk's own (``chunk``) or the request's from
    ``upload_pages``, kept on the host for a small request or put on the device; ``all
    uploaded``: none fit in the launch, so the source's and the grants' ids go up together."""
    if ids == "request on device":
        monkeypatch.setattr(cuda_copy, "INLINE_PAGES", 0)
    if ids == "all uploaded":
        monkeypatch.setattr(cuda_place, "INLINE_IDS", 0)
    c = make_caches(case_plan(name), "cuda")
    copiers, dests = _copiers(c)
    _write_all(c, copiers, dests, uploaded=ids.startswith("request"))
    assert c.check() == []


def test_a_prepared_launch_moves_nothing_until_called(gpu):
    c = make_caches(case_plan("2->8 replicated"), "cuda")
    copiers, dests = _copiers(c)
    before = [b.clone() for d in c.dst for b in d.buffers]
    launches = []
    for start, count in chunks():
        for r, (src, k) in enumerate(zip(c.src, copiers)):
            writes = [PlacedWrite(dests[r][p.dst_rank], p, grant_pages(c, p.dst_rank, start, count))
                      for p in c.plan.targets_of(r)]
            launches.append(k.prepare(TokenIndex(src, c.src_ids[r], start, count), writes))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, (b for d in c.dst for b in d.buffers)))
    for run in launches:
        run()
    torch.cuda.synchronize()
    assert c.check() == []


def test_a_grant_outside_the_destination_is_refused_before_any_launch(gpu):
    c = make_caches(case_plan("1->4"), "cuda")
    copiers, dests = _copiers(c)
    k, src = copiers[0], c.src[0]
    pieces = c.plan.targets_of(0)
    idx = TokenIndex(src, c.src_ids[0], 0, 37)
    good = [PlacedWrite(dests[0][p.dst_rank], p, grant_pages(c, p.dst_rank, 0, 37)) for p in pieces]
    bad_page = good[:3] + [good[3]._replace(pages=np.array([0, c.dst[3].pages, 1]))]
    short = good[:1] + [good[1]._replace(pages=good[1].pages[:-1])] + good[2:]
    for writes, match in ((bad_page, r"must lie in \[0, \d+\)"), (short, "they span 3 pages")):
        with pytest.raises(ProtocolError, match=match):
            k.launch(idx, writes)
        with pytest.raises(ProtocolError, match=match):
            k.prepare(idx, writes)
    torch.cuda.synchronize()
    assert all(not b.view(torch.uint8).any() for d in c.dst for b in d.buffers), "a refused grant wrote"


def test_destinations_and_sides_the_kernel_cannot_write_are_refused(gpu):
    c = make_caches(case_plan("4->1"), "cuda")
    k = PlacedCopier(c.src[0], c.plan.dst)
    spans = tensor_spans(c.dst[0].buffers)
    with pytest.raises(ValueError, match="not on a 16-byte boundary"):
        k.destination([(spans[0][0] + 8, spans[0][1])] + spans[1:])
    with pytest.raises(ValueError, match="buffers; need layers"):
        k.destination(spans[:-1])
    narrow = SideSpec(KVGeometry(2, 8, 4, "float16"), 1, PageLayout(16))  # 8-byte heads
    with pytest.raises(ConfigError, match="not a whole number of 16-byte words"):
        PlacedCopier(RankCache.allocate(narrow, 0, 4, "cuda"), narrow)
    with pytest.raises(ConfigError, match="its cache is on cpu"):
        PlacedCopier(RankCache.allocate(c.plan.src, 0, 4), c.plan.dst)
