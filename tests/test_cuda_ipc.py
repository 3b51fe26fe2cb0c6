"""The one-host read kernel on a GPU: a destination rank reads every source rank's pieces
of a request in one launch, byte for byte against the reference shards (pages outside
the request untouched), for every plan shape. First with the sources' caches in this
process (page ids in the launch or uploaded, a chunk per launch or the whole request,
prepared and launched later), then with each source rank in a process of its own, its
buffers opened here over CUDA IPC; the destination's stream waits on a source's ready
event without the host; page ids a source names that lie outside its buffers are refused
before anything is launched."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
import torch

from support.ipc_reads import CASES, case_plan, chunks, make_caches
from support.ipc_source import SourcePeer
from kvstage.errors import ConfigError, ProtocolError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.staging import cuda_copy, cuda_ipc
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, upload_pages
from kvstage.staging.cuda_ipc import IpcRead, IpcReadCopier
from kvstage.staging.shared_buffers import OpenedEvent, open_buffers, share_buffers, tensor_spans
from kvstage.tp import SideSpec

pytestmark = pytest.mark.gpu


def _gpu() -> str | None:
    """Why the kernel cannot run here, or None."""
    if not (torch.cuda.is_available() and cuda_copy.available()):
        return "needs CUDA and CuPy"
    return None


@pytest.fixture
def gpu():
    if _gpu():
        pytest.skip(_gpu())


def _reads(c, sources, dst_rank: int, start: int) -> list[IpcRead]:
    """Every piece landing on ``dst_rank``, each from its source's own token of the request."""
    return [IpcRead(sources[p.src_rank], p, c.requests[p.src_rank].ids, c.requests[p.src_rank].shift + start)
            for p in c.plan.writers_of(dst_rank)]


def _read_all(c, copiers, sources, ids: str = "chunk", whole: bool = False) -> None:
    """Every destination rank's tokens, one launch per (rank, chunk) or per rank (``whole``)
    covering every source rank's pieces."""
    for d, (dst, k) in enumerate(zip(c.dst, copiers)):
        kernel_pages = upload_pages(dst, c.dst_ids[d]) if ids.startswith("request") else None
        if ids == "request on device":
            assert isinstance(kernel_pages, torch.Tensor)
        for start, count in [(0, c.tokens)] if whole else chunks(c.tokens):
            k.launch(TokenIndex(dst, c.dst_ids[d], start, count, kernel_pages), _reads(c, sources, d, start))
    torch.cuda.synchronize()


def _local(name: str):
    """A case with its sources in this process, each destination rank's copier and each source
    rank's buffers as the copiers read them."""
    c = make_caches(case_plan(name), "cuda", copier="cuda")
    copiers = [IpcReadCopier(d, c.plan.src) for d in c.dst]
    sources = [copiers[0].source(tensor_spans(s.buffers)) for s in c.src]
    return c, copiers, sources


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ids", ["chunk", "request on host", "request on device", "all uploaded", "whole request"])
def test_every_plan_shape_lands_byte_for_byte_in_one_launch(gpu, name, ids, monkeypatch):
    """Where this rank's page ids come from: each chunk's own (``chunk``) or the request's from
    ``upload_pages``, kept on the host for a small request or put on the device; ``all
    uploaded``: none fit in the launch, so every read's and this rank's go up together;
    ``whole request``: one launch per destination rank for all its tokens."""
    if ids == "request on device":
        monkeypatch.setattr(cuda_copy, "INLINE_PAGES", 0)
    if ids == "all uploaded":
        monkeypatch.setattr(cuda_ipc, "INLINE_IDS", 0)
    c, copiers, sources = _local(name)
    _read_all(c, copiers, sources, ids, whole=ids == "whole request")
    assert c.check() == []


@pytest.mark.parametrize("name", list(CASES))
def test_each_read_sums_what_it_reads_as_its_source_sums_its_pages(gpu, name):
    """The kernel's sum of each read (``sums_addr``; also with ``skip``, a prefix read and summed but not
    written) equals its source's sum of that piece over its own pages (``checksums.page_sums``: the source
    side of the ipc path's checksum, the gather kernel summing with no copy); a byte flipped in one
    source's pages changes that source's reads' sums and no other's."""
    from kvstage.protocol.checksums import page_sums
    from kvstage.staging import checksum

    c, copiers, sources = _local(name)
    skip = 5
    for d, (dst, k) in enumerate(zip(c.dst, copiers)):
        reads = _reads(c, sources, d, 0)
        want = [page_sums(c.src[r.piece.src_rank], r.pages, None, c.tokens, [r.piece], "source", r.src_start)
                for r in reads]
        for first in (0, skip):  # the whole part written, or its first ``skip`` tokens cached here
            got = checksum.ChunkSums(tuple(range(len(reads))), np.zeros(len(reads), dtype=np.uint32))
            idx = TokenIndex(dst, c.dst_ids[d], first, c.tokens - first)
            k.launch(idx, reads, first, checksum.on_device(got, dst.device))
            checksum.to_host(got)
            torch.cuda.synchronize()
            assert [int(v) for v in got.values] == [w.total(0) for w in want], (d, first)
        flipped = reads[0].piece.src_rank
        buf = c.src[flipped].buffers[reads[0].piece.buffers.start]
        page = int(reads[0].pages[reads[0].src_start // c.plan.src.page.page_size])
        buf.view(torch.uint8).reshape(buf.shape[0], -1)[page].bitwise_xor_(255)  # the first page of the read
        got = checksum.ChunkSums(tuple(range(len(reads))), np.zeros(len(reads), dtype=np.uint32))
        k.launch(TokenIndex(dst, c.dst_ids[d], 0, c.tokens), reads, 0, checksum.on_device(got, dst.device))
        checksum.to_host(got)
        torch.cuda.synchronize()
        changed = [int(v) != w.total(0) for v, w in zip(got.values, want)]
        assert changed[0] and all(ch == (r.piece.src_rank == flipped) or not ch for ch, r in zip(changed, reads))
        buf.view(torch.uint8).reshape(buf.shape[0], -1)[page].bitwise_xor_(255)


def test_a_prepared_launch_moves_nothing_until_called(gpu):
    c, copiers, sources = _local("8->2 2 kv heads")
    before = [b.clone() for d in c.dst for b in d.buffers]
    launches = [k.prepare(TokenIndex(dst, c.dst_ids[d], start, count), _reads(c, sources, d, start))
                for d, (dst, k) in enumerate(zip(c.dst, copiers)) for start, count in chunks()]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, (b for d in c.dst for b in d.buffers)))
    for run in launches:
        run()
    torch.cuda.synchronize()
    assert c.check() == []


def test_page_ids_outside_a_source_are_refused_before_any_launch(gpu):
    c, copiers, sources = _local("4->1")
    k, dst = copiers[0], c.dst[0]
    idx = TokenIndex(dst, c.dst_ids[0], 0, 37)
    good = _reads(c, sources, 0, 0)
    past = sources[3].pages
    bad_page = good[:3] + [good[3]._replace(pages=np.concatenate([good[3].pages[:1], [past], good[3].pages[2:]]))]
    short = good[:1] + [good[1]._replace(pages=good[1].pages[:1], src_start=0)] + good[2:]
    bools = good[:2] + [good[2]._replace(pages=[True] * len(good[2].pages))] + good[3:]
    for reads, match in ((bad_page, r"source rank 3's page ids must lie in \[0, \d+\)"),
                         (short, "source rank 1's page ids: 1 page ids; tokens 0..37 need 3 pages"),
                         (bools, "source rank 2's page ids must be a flat list of integers")):
        with pytest.raises(ProtocolError, match=match):
            k.launch(idx, reads)
        with pytest.raises(ProtocolError, match=match):
            k.prepare(idx, reads)
    wide, wide_copiers, wide_sources = _local("1->4")
    elsewhere = IpcRead(wide_sources[0], wide.plan.writers_of(1)[0], wide.requests[0].ids, 0)
    with pytest.raises(ValueError, match="lands on destination rank 1; this copier writes rank 0"):
        wide_copiers[0].launch(TokenIndex(wide.dst[0], wide.dst_ids[0], 0, 37), [elsewhere])
    with pytest.raises(ValueError, match="of no pieces"):
        k.launch(idx, [])
    torch.cuda.synchronize()
    assert all(not b.view(torch.uint8).any() for d in c.dst + wide.dst for b in d.buffers), "a refused read wrote"


def test_sources_and_sides_the_kernel_cannot_read_are_refused(gpu):
    c, copiers, _ = _local("4->1")
    k = copiers[0]
    spans = tensor_spans(c.src[0].buffers)
    with pytest.raises(ValueError, match="not on a 16-byte boundary"):
        k.source([(spans[0][0] + 8, spans[0][1])] + spans[1:])
    with pytest.raises(ValueError, match="buffers; need layers"):
        k.source(spans[:-1])
    with pytest.raises(ValueError, match="same whole number"):
        k.source([(a, n - 16) for a, n in spans])
    narrow = SideSpec(KVGeometry(2, 8, 4, "float16"), 1, PageLayout(16))  # 8-byte heads
    with pytest.raises(ConfigError, match="not a whole number of 16-byte words"):
        IpcReadCopier(RankCache.allocate(narrow, 0, 4, "cuda"), narrow)
    with pytest.raises(ConfigError, match="its cache is on cpu"):
        IpcReadCopier(RankCache.allocate(c.plan.dst, 0, 4), c.plan.src)
    other = SideSpec(KVGeometry(3, 8, 16, "bfloat16"), 4, PageLayout(16))
    with pytest.raises(ConfigError, match="layers differs"):
        IpcReadCopier(c.dst[0], other)


# -- sources in processes of their own ---------------------------------------------------------
@pytest.fixture(scope="module")
def peers():
    """One source process per source rank of the widest case, started together and kept for
    the module."""
    if _gpu():
        pytest.skip(_gpu())
    started = [SourcePeer() for _ in range(max(CASES[name][1] for name in CASES))]
    yield started
    for p in started:
        p.close()


def _devices() -> list[str]:
    """The sources' GPU: this one, and another one (peer access) where there is one."""
    return ["cuda:0"] + (["cuda:1"] if torch.cuda.is_available() and torch.cuda.device_count() > 1 else [])


def _opened(c, peers, name: str, where: str, filled: bool = True):
    """Each source rank's cache allocated in its process on ``where``, its buffers opened here."""
    for r, req in enumerate(c.requests):  # every process at once
        peers[r].send_allocate(name, r, req, c.seed, c.tokens, where, filled)
    replies = [peers[r].answer("allocate") for r in range(len(c.requests))]
    opened = []
    try:
        for reply in replies:
            assert "desc" in reply, reply
            assert reply["desc"]["buffers"][0][1] > 0  # the first view sits past its allocation's start
            opened.append(open_buffers(reply["desc"], c.dst[0].device))
    except BaseException:
        for o in opened:
            o.close()
        raise
    return opened


@pytest.mark.parametrize("where", _devices())
def test_every_plan_shape_reads_another_process_s_pages_byte_for_byte(peers, where):
    for name in CASES:
        c = make_caches(case_plan(name), "cuda", sources_here=False, copier="cuda")
        opened = _opened(c, peers, name, where)
        try:
            assert all(o.on(c.dst[0].device) == (where == "cuda:0") for o in opened)
            copiers = [IpcReadCopier(d, c.plan.src) for d in c.dst]
            sources = [copiers[0].source(o.spans) for o in opened]
            _read_all(c, copiers, sources)
            assert c.check() == [], name
            c.clear()
            _read_all(c, copiers, sources, whole=True)
            assert c.check() == [], name
        finally:
            for o in opened:
                o.close()


def test_the_read_waits_on_the_sources_ready_event_without_the_host(peers):
    """The source queues its writes of the request behind a kernel that waits for a flag in
    this process's memory, records its ready event and says so at once. This process's
    stream waits on the event and launches the read: the stream stays blocked (the host
    does not) until the flag is set, then the read finds the source's writes, byte for byte."""
    name = "4->1"
    c = make_caches(case_plan(name), "cuda", sources_here=False, copier="cuda")
    device = c.dst[0].device
    opened = _opened(c, peers, name, "cuda:0", filled=False)
    try:
        events = [OpenedEvent(base64.b64decode(peers[r].ask(cmd="event")["handle"]), device)
                  for r in range(c.plan.src.tp)]
        copier = IpcReadCopier(c.dst[0], c.plan.src)
        sources = [copier.source(o.spans) for o in opened]
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        flag_set = torch.ones(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize()
        late = 1  # this rank's writes wait for the flag; the others' run as they come
        for r, req in enumerate(c.requests):
            reply = peers[r].ask(cmd="write_after", flag=share_buffers([flag if r == late else flag_set]),
                                 seed=c.seed, tokens=c.tokens, ids=req.ids.tolist(), shift=req.shift)
            assert reply == {"recorded": True}
        stream, setter = torch.cuda.Stream(device), torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            for e in events:
                e.wait()
            copier.launch(TokenIndex(c.dst[0], c.dst_ids[0], 0, c.tokens), _reads(c, sources, 0, 0))
        time.sleep(0.5)  # long enough for a read that did not wait to have ended
        blocked = not stream.query()
        with torch.cuda.stream(setter):
            flag.fill_(1)
        stream.synchronize()
        assert blocked, "the read did not wait for the source's ready event"
        assert c.check() == []
    finally:
        for o in opened:
            o.close()
