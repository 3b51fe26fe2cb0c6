"""Sharing a source's KV buffers and its ready event with the destination on its host.

On the CPU: a peer's description is checked field by field (hostile input never raises
anything but ``MappingError``), host memory is refused with the reason, the bytes a
peer can reach beyond the buffers are counted, a peer's event handle is checked before
any CUDA call. On a GPU, across two processes: a source allocates its cache the way
engines do (views of one big tensor from torch's caching allocator) and shares it; this
process opens it and finds every buffer's bytes where the description says. With
expandable segments the share is refused, naming the cause and the fix. A stream here
waits on the source's ready event, with no host synchronization, until the source's
queued writes have run.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support.ipc_reads import case_plan, source_cache, source_requests
from support.ipc_source import SourcePeer
from kvstage.errors import KVStageError, MappingError
from kvstage.staging.shared_buffers import (KIND, MAX_BUFFERS, NotShareable, OpenedEvent, ReadyEvent, _owner,
                                            exposed_bytes, open_buffers, parse, share_buffers)

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


def test_a_peers_event_handle_is_checked_before_any_cuda_call():
    for handle, match in ((b"\0" * 63, "got 63 bytes"), (b"\0" * 65, "got 65 bytes"), ("0" * 64, "got str"),
                          (None, "got NoneType"), (list(range(64)), "got list")):
        with pytest.raises(MappingError, match=f"event handle: must be the 64 bytes of a CUDA IPC event handle; "
                                               f"{match}"):
            OpenedEvent(handle, torch.device("cuda", 0))
    with pytest.raises(MappingError, match="a CUDA event; this rank runs on cpu"):
        OpenedEvent(bytes(64), torch.device("cpu"))
    with pytest.raises(NotShareable, match="a ready event is a CUDA event; this rank runs on cpu"):
        ReadyEvent(torch.device("cpu"))


def test_sharing_errors_are_kvstage_errors():
    """A caller that handles kvstage's own errors handles these too."""
    assert issubclass(MappingError, KVStageError) and issubclass(NotShareable, KVStageError)


# -- two processes on a GPU -------------------------------------------------------------------
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


@pytest.fixture
def gpu():
    from kvstage.staging import cuda_copy

    if not (torch.cuda.is_available() and cuda_copy.available()):
        pytest.skip("needs CUDA and CuPy")


@pytest.fixture
def peer(gpu):
    p = SourcePeer()
    yield p
    p.close()


def _devices() -> list[str]:
    """The source's GPU: this one, and another one (peer access) where there is one."""
    return ["cuda:0"] + (["cuda:1"] if torch.cuda.is_available() and torch.cuda.device_count() > 1 else [])


def _read(spans, device) -> list[torch.Tensor]:
    """A copy here of each buffer's bytes at ``spans`` (mapped here), queued on the current
    stream: the runtime's device-to-device copy, as bytes, whichever GPU holds them."""
    from kvstage.cudart import runtime

    out = []
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):
        for address, nbytes in spans:
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            err = runtime().cudaMemcpyAsync(ctypes.c_void_p(t.data_ptr()), ctypes.c_void_p(address),
                                            ctypes.c_size_t(nbytes), _DEVICE_TO_DEVICE, ctypes.c_void_p(stream))
            assert err == 0, f"cudaMemcpyAsync failed with CUDA error {err}"
            out.append(t)
    return out


def _expected(name: str, rank: int, filled: bool = True) -> list[torch.Tensor]:
    """The bytes of the peer's cache, built alike here."""
    p = case_plan(name)
    req = source_requests(p)[rank]
    return [b.view(-1).view(torch.uint8) for b in source_cache(p, rank, req, 7, 100, "cuda:0", filled).buffers]


@pytest.mark.gpu
@pytest.mark.parametrize("where", _devices())
def test_a_source_process_s_buffers_are_opened_here_byte_for_byte(peer, where):
    device = torch.device("cuda", 0)
    for name, rank in (("4->1", 2), ("mla 4->1", 3), ("2->8 replicated", 1)):
        p = case_plan(name)
        reply = peer.allocate(name, rank, source_requests(p)[rank], 7, 100, where)
        assert "desc" in reply, reply
        desc = reply["desc"]
        assert len(desc["allocations"]) <= p.geometry.planes  # one big tensor per plane, viewed per layer
        assert desc["buffers"][0][1] > 0  # the first view sits past the allocation's start
        with open_buffers(desc, device) as opened:
            assert opened.on(device) == (where == "cuda:0")
            got = _read(opened.spans, device)
            torch.cuda.synchronize()
        want = _expected(name, rank)
        assert [len(g) for g in got] == [len(w) for w in want]
        assert all(torch.equal(g, w.to(device)) for g, w in zip(got, want)), name
    # a description whose sizes do not match the mapping is refused, and the mapping released
    desc = peer.allocate("4->1", 0, source_requests(case_plan("4->1"))[0], 7, 100, where)["desc"]
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


@pytest.mark.gpu
def test_expandable_segments_are_refused_naming_the_cause_and_the_fix(gpu):
    peer = SourcePeer({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        reply = peer.allocate("4->1", 0, source_requests(case_plan("4->1"))[0], 7, 100, "cuda:0")
    finally:
        peer.close()
    assert "refused" in reply, reply
    assert "expandable segments" in reply["refused"]
    assert "PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True" in reply["refused"]


@pytest.mark.gpu
def test_a_stream_waits_on_the_sources_ready_event_until_its_writes_have_run(peer):
    """The source queues its writes behind a kernel that waits for a flag in this process's
    memory, records its ready event and answers at once. A copy of its buffers queued here
    behind a wait on the event stays pending (the host goes on) until the flag is set, then
    holds the source's writes."""
    device = torch.device("cuda", 0)
    name, rank = "4->1", 2
    req = source_requests(case_plan(name))[rank]
    desc = peer.allocate(name, rank, req, 7, 100, "cuda:0", filled=False)["desc"]
    handle = base64.b64decode(peer.ask(cmd="event")["handle"])
    assert len(handle) == 64
    event = OpenedEvent(handle, device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    with open_buffers(desc, device) as opened:
        torch.cuda.synchronize()
        reply = peer.ask(cmd="write_after", flag=share_buffers([flag]), seed=7, tokens=100, ids=req.ids.tolist(),
                         shift=req.shift)
        assert reply == {"recorded": True}
        stream, setter = torch.cuda.Stream(device), torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            event.wait()
            got = _read(opened.spans, device)
        time.sleep(0.5)  # long enough for a copy that did not wait to have ended
        blocked = not stream.query()
        with torch.cuda.stream(setter):
            flag.fill_(1)
        stream.synchronize()
    assert blocked, "the copy did not wait for the source's ready event"
    want = _expected(name, rank)
    assert all(torch.equal(g, w.to(device)) for g, w in zip(got, want))
    assert not all(torch.equal(w, s) for w, s in zip(want, _expected(name, rank, filled=False)))
