"""Sharing a destination's KV buffers with a source on its host.

On the CPU: a peer's description is checked field by field (hostile input never raises
anything but ``MappingError``), host memory is refused with the reason, the bytes a
source can reach beyond the buffers are counted. On a GPU, across two processes: a
destination allocates its cache the way engines do (views of one big tensor from
torch's caching allocator), shares it; the test opens it and writes every chunk with
the direct page-write kernel; the destination finds its shard byte for byte and every
page outside the request untouched. With expandable segments the share is refused,
naming the cause and the fix.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support.placed import case_plan, chunks, grant_pages, make_caches
from kvstage.staging.mapped import MappingError
from kvstage.staging.shared_buffers import (KIND, MAX_BUFFERS, NotShareable, _owner, exposed_bytes, open_buffers,
                                            parse, share_buffers)

HANDLE = base64.b64encode(bytes(range(64))).decode()
OTHER = base64.b64encode(bytes(range(1, 65))).decode()


def _desc(**over) -> dict:
    d = {"kind": KIND, "owner": "f" * 32, "gpu": "GPU-1234",
         "allocations": [{"handle": HANDLE, "nbytes": 4096}, {"handle": OTHER, "nbytes": 1024}],
         "buffers": [[0, 512, 1024], [1, 0, 1024], [0, 1536, 1024]]}
    return d | over


def test_a_description_is_read_back_field_by_field():
    d = parse(_desc())
    assert d.owner == "f" * 32 and d.gpu == "GPU-1234"
    assert d.allocations == ((bytes(range(64)), 4096), (bytes(range(1, 65)), 1024))
    assert d.buffers == ((0, 512, 1024), (1, 0, 1024), (0, 1536, 1024))
    assert parse(_desc(gpu=None)).gpu is None


@pytest.mark.parametrize("over,match", [
    ({"kind": "cuda_ipc"}, "not a description of shared KV buffers"),
    ({"owner": ""}, "owner must be a string"),
    ({"owner": "x" * 129}, "owner must be a string"),
    ({"gpu": 5}, "gpu must be a string"),
    ({"buffers": []}, "buffers must be a list of 1 to"),
    ({"buffers": [[0, 0, 8]] * (MAX_BUFFERS + 1)}, "buffers must be a list of 1 to"),
    ({"allocations": {}}, "allocations must be a list"),
    ({"buffers": [[0, 0, 8]]}, "allocations must be a list of 1 to one per buffer"),
    ({"allocations": [{"handle": HANDLE[:-4], "nbytes": 4096}, {"handle": OTHER, "nbytes": 1024}]}, "not 64 bytes"),
    ({"allocations": [{"handle": "!" * 88, "nbytes": 4096}, {"handle": OTHER, "nbytes": 1024}]}, "not 64 bytes"),
    ({"allocations": [{"handle": HANDLE, "nbytes": 4096}, {"handle": HANDLE, "nbytes": 1024}]}, "appears twice"),
    ({"allocations": [{"handle": HANDLE, "nbytes": 0}, {"handle": OTHER, "nbytes": 1024}]}, "allocation 0 nbytes"),
    ({"allocations": [{"handle": HANDLE, "nbytes": 2**60}, {"handle": OTHER, "nbytes": 1}]}, "allocation 0 nbytes"),
    ({"allocations": [{"handle": HANDLE, "nbytes": True}, {"handle": OTHER, "nbytes": 1}]}, "allocation 0 nbytes"),
    ({"allocations": ["x", {"handle": OTHER, "nbytes": 1}]}, "allocation 0 must be an object"),
    ({"buffers": [[0, 512, 1024], [2, 0, 8], [0, 0, 8]]}, "buffer 1 allocation"),
    ({"buffers": [[0, 512, 1024], [1, 0, 1024], [0, 3500, 1024]]}, "buffer 2 nbytes"),
    ({"buffers": [[0, 512, 1024], [1, 1024, 1], [0, 0, 8]]}, "buffer 1 offset"),
    ({"buffers": [[0, -1, 1024], [1, 0, 1], [0, 0, 8]]}, "buffer 0 offset"),
    ({"buffers": [[0, 0, 0], [1, 0, 1], [0, 0, 8]]}, "buffer 0 nbytes"),
    ({"buffers": [[0, 0, 8, 1], [1, 0, 1], [0, 0, 8]]}, r"must be \[allocation, offset, nbytes\]"),
    ({"buffers": [[0, 0, 8], [0, 8, 8], [0, 0, 8]]}, "an allocation holds no buffer"),
])
def test_a_hostile_description_is_refused_naming_the_field(over, match):
    with pytest.raises(MappingError, match=match):
        parse(_desc(**over))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.text(max_size=100),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["kind", "owner", "gpu", "allocations", "buffers", None]), value=_json,
       nested=st.booleans())
def test_any_malformed_description_is_a_mapping_error(field, value, nested):
    """A field replaced by anything JSON holds (or a nested part of one): parsed, or refused
    with ``MappingError``; never another exception."""
    desc = _desc()
    if field is None:
        desc = value
    elif nested and field in ("allocations", "buffers"):
        desc[field][0] = value
    else:
        desc[field] = value
    try:
        parse(desc)
    except MappingError:
        pass


def test_exposed_bytes_counts_what_lies_outside_the_buffers():
    assert exposed_bytes(_desc()) == 4096 - 2048  # the second allocation is one whole buffer
    whole = _desc(allocations=[{"handle": HANDLE, "nbytes": 2048}, {"handle": OTHER, "nbytes": 1024}],
                  buffers=[[0, 0, 1024], [1, 0, 1024], [0, 1024, 1024]])
    assert exposed_bytes(whole) == 0
    overlapping = _desc(buffers=[[0, 0, 1024], [1, 0, 1024], [0, 512, 1024]])
    assert exposed_bytes(overlapping) == 4096 - 1536


def test_host_memory_and_no_buffers_are_refused_with_the_reason():
    with pytest.raises(NotShareable, match="buffer 0 is in host memory .* staged or mapped path"):
        share_buffers([torch.zeros(16)])
    with pytest.raises(NotShareable, match="no buffers"):
        share_buffers([])


def test_open_refuses_before_any_cuda_call():
    with pytest.raises(MappingError, match="this rank runs on cpu"):
        open_buffers(_desc(), torch.device("cpu"))
    with pytest.raises(MappingError, match="this process's own buffers"):
        open_buffers(_desc(owner=_owner()), torch.device("cuda", 0))
    with pytest.raises(MappingError, match="buffer 2 nbytes"):
        open_buffers(_desc(buffers=[[0, 512, 1024], [1, 0, 1024], [0, 3500, 1024]]), torch.device("cuda", 0))


# -- two processes on a GPU -------------------------------------------------------------------
PEER = Path(__file__).parent / "support" / "placed_peer.py"


class _Peer:
    """The destination process (``support/placed_peer.py``), driven one JSON line at a time."""

    def __init__(self, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})

    def ask(self, timeout: float = 120.0, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            assert ready, f"the destination process did not answer {msg['cmd']} in {timeout} s"
            line = self.proc.stdout.readline()
            assert line, f"the destination process exited ({self.proc.poll()}) on {msg['cmd']}"
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(cmd="quit", timeout=5)
            except (AssertionError, BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def gpu():
    from kvstage.staging import cuda_copy

    if not (torch.cuda.is_available() and cuda_copy.available()):
        pytest.skip("needs CUDA and CuPy")


def _devices() -> list[str]:
    """The destination's GPU: this one, and another one (peer access) where there is one."""
    return ["cuda:0"] + (["cuda:1"] if torch.cuda.is_available() and torch.cuda.device_count() > 1 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("where", _devices())
def test_a_source_writes_into_another_process_s_pages_byte_for_byte(gpu, where):
    from kvstage.staging.copy import TokenIndex
    from kvstage.staging.cuda_place import PlacedCopier, PlacedWrite

    peer = _Peer()
    device = torch.device("cuda", 0)
    try:
        for name in ("4->1", "1->4", "1->1 nhd16->hnd1", "2->8 replicated", "mla 2->3"):
            c = make_caches(case_plan(name), device)  # the sources here; the destinations are the peer's
            descs = []
            for r, local in enumerate(c.dst):
                reply = peer.ask(cmd="allocate", case=name, rank=r, pages=local.pages, device=where)
                assert "desc" in reply, reply
                descs.append(reply["desc"])
                assert len(reply["desc"]["allocations"]) <= c.plan.geometry.planes
                assert reply["desc"]["buffers"][0][1] > 0  # the first view sits past the allocation's start
            opened = [open_buffers(d, device) for d in descs]
            try:
                assert all(o.on(device) == (where == "cuda:0") for o in opened)
                copiers = [PlacedCopier(s, c.plan.dst) for s in c.src]
                dests = [[k.destination(o.spans) for o in opened] for k in copiers]
                for start, count in chunks():
                    for r, (src, k) in enumerate(zip(c.src, copiers)):
                        writes = [PlacedWrite(dests[r][p.dst_rank], p, grant_pages(c, p.dst_rank, start, count))
                                  for p in c.plan.targets_of(r)]
                        if writes:
                            k.launch(TokenIndex(src, c.src_ids[r], start, count), writes)
                torch.cuda.synchronize()
            finally:
                for o in opened:
                    o.close()
            for r in range(c.plan.dst.tp):
                reply = peer.ask(cmd="check", rank=r, seed=c.seed, ids=c.dst_ids[r].tolist(), tokens=c.tokens)
                assert reply["errors"] == [], (name, r)
        # a description whose sizes do not match the mapping is refused, and the mapping released
        desc = peer.ask(cmd="allocate", case="4->1", rank=0, pages=40, device=where)["desc"]
        inflated = json.loads(json.dumps(desc))
        for a in inflated["allocations"]:
            a["nbytes"] *= 64
        with pytest.raises(MappingError, match="the sizes do not match"):
            open_buffers(inflated, device)
        open_buffers(desc, device).close()
        forged = json.loads(json.dumps(desc))
        forged["allocations"][0]["handle"] = base64.b64encode(os.urandom(64)).decode()
        with pytest.raises(MappingError, match="cudaIpcOpenMemHandle of allocation 0 failed"):
            open_buffers(forged, device)
    finally:
        peer.close()


@pytest.mark.gpu
def test_expandable_segments_are_refused_naming_the_cause_and_the_fix(gpu):
    peer = _Peer({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        reply = peer.ask(cmd="allocate", case="4->1", rank=0, pages=40, device="cuda:0")
    finally:
        peer.close()
    assert "refused" in reply, reply
    assert "expandable segments" in reply["refused"]
    assert "PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True" in reply["refused"]


@pytest.mark.gpu
def test_a_source_killed_mid_write_leaves_other_requests_and_the_destination_intact(gpu):
    """A source process writing a request's pages is killed while its kernels run: the pages
    of another request hold their bytes, pages of no request stay zero, and this (the
    destination's) process goes on using its GPU."""
    import numpy as np

    from kvstage.bench.reference import check_shard, fill_shard
    from kvstage.staging.cache import RankCache
    from support.placed_peer import engine_buffers

    p = case_plan("4->1")
    tokens, pages = 100, 40
    ids = np.random.default_rng(3).permutation(pages)
    mine, other = ids[:7], ids[7:14]  # the killed source's request, and another one already written
    dst = RankCache(p.dst, 0, engine_buffers(p.dst, pages, "cuda:0"))
    fill_shard(dst, 11, other, tokens)
    torch.cuda.synchronize()
    peer = _Peer()
    try:
        reply = peer.ask(cmd="write_until_killed", case="4->1", rank=1, desc=share_buffers(dst.buffers), dst_rank=0,
                         grant=mine.tolist(), tokens=tokens)
        assert reply == {"writing": True}
        peer.proc.kill()
        peer.proc.wait(timeout=20)
    finally:
        peer.close()
    written = dst.buffers[0].view(torch.uint8)[torch.from_numpy(mine).cuda()]
    assert bool((written == 0x5A).any()), "the source never wrote its pages"
    assert check_shard(dst, 11, other, tokens, written=np.concatenate([mine, other])) == []
    probe = torch.arange(1 << 20, device="cuda")
    assert int(probe.sum()) == (1 << 20) * ((1 << 20) - 1) // 2
