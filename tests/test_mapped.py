"""The mapped arena: a source on the destination's host gathers straight into
the destination's arena and says so with a ``landed`` control message.

Byte-exact transfers over it are in test_transfer.py; here: the settings, the
handshake's refusals, the checks a ``landed`` message goes through (the same as
a notice riding on a write), and the shared host arena's lifetime.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from support import fault_ranks as fr
from support.fake_peers import FakeSource
from kvstage.config import Settings
from kvstage.errors import ConfigError, TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache
from kvstage.staging.copy import TokenIndex, gather
from kvstage.staging.mapped import MappingError, open_shared

TOKEN = "mapped-test"
CHUNK = 32  # tokens per 16 KiB slot at 512 B a token (fault_ranks geometry, source TP 1)


def test_settings_name_the_rule():
    with pytest.raises(ConfigError, match="mapped='sometimes': must be one of auto, on, off"):
        Settings(mapped="sometimes")
    with pytest.raises(ConfigError, match="two-sided"):
        Settings(mapped="on", transport="ucx")
    assert Settings().mapped == "auto"


def _destination(mapped: str) -> Destination:
    return Destination(RankCache.allocate(fr.dst_spec(), 0, 256),
                       Settings(**fr.SETTINGS, auth_token=TOKEN, peer_timeout_s=600, mapped=mapped))


def test_host_arena_is_shared_only_when_asked():
    for mapped, shared in (("auto", False), ("off", False), ("on", True)):
        dst = _destination(mapped)
        try:
            src = FakeSource(dst.address, TOKEN)
            assert ("mapped" in src.welcome) is shared, mapped
            if shared:
                desc = src.welcome["mapped"]
                assert desc["kind"] == "memfd" and desc["pid"] == os.getpid()
                assert os.readlink(f"/proc/{desc['pid']}/fd/{desc['fd']}").startswith("/memfd:kvstage-arena")
            src.close()
        finally:
            dst.close()
        if shared:  # a closed destination offers its arena no more
            with pytest.raises(MappingError, match="cannot open|not a kvstage arena"):
                open_shared(desc, desc["nbytes"], torch.device("cpu"))


def test_source_with_mapped_on_refuses_a_destination_that_does_not_share():
    dst = _destination("auto")  # a host arena: not shared unless the destination says on
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 64), Settings(**fr.SETTINGS, auth_token=TOKEN, mapped="on"))
    try:
        with pytest.raises(TransferFailed, match="mapped=on, but the destination does not share its arena"):
            src.connect([dst.address])
    finally:
        src.close()
        dst.close()


def test_open_refuses_a_description_that_does_not_match():
    with pytest.raises(MappingError, match="does not match"):
        open_shared({"kind": "memfd", "pid": os.getpid(), "fd": 3, "nbytes": 10}, 20, torch.device("cpu"))
    with open(__file__) as f:  # an open descriptor, but not an arena
        with pytest.raises(MappingError, match="not a kvstage arena"):
            open_shared({"kind": "memfd", "pid": os.getpid(), "fd": f.fileno(), "nbytes": 20}, 20, torch.device("cpu"))
    with pytest.raises(MappingError, match="must be positive integers"):
        open_shared({"kind": "memfd", "pid": "1", "fd": -1, "nbytes": 20}, 20, torch.device("cpu"))
    with pytest.raises(MappingError, match="unknown shared arena kind"):
        open_shared({"kind": "rdma", "nbytes": 20}, 20, torch.device("cpu"))


@pytest.fixture
def mapped_pair():
    dst = _destination("on")
    src = FakeSource(dst.address, TOKEN)
    arena = open_shared(src.welcome["mapped"], src.arena.nbytes, torch.device("cpu"))
    yield dst, src, arena
    arena.close()
    src.close()
    dst.close()


def _gather_into(src: FakeSource, arena, req: str, grant: dict) -> int:
    nbytes = grant["count"] * src.token_bytes
    idx = TokenIndex(src.cache, src.pages[req], grant["start"], grant["count"])
    gather(src.cache, idx, src.piece.src_offset, src.piece.heads.count, arena.view(grant["offset"], nbytes))
    return nbytes


def _landed(req: str, grant: dict, nbytes: int, **over) -> dict:
    return {"type": "landed", "req": req, "chunk": grant["chunk"], "writer": 0, "offset": grant["offset"],
            "bytes": nbytes} | over


def test_landed_messages_complete_a_request_byte_for_byte(mapped_pair):
    dst, src, arena = mapped_pair
    tokens = 3 * CHUNK - 5
    ids = np.arange(pages_needed(tokens, 4))[::-1].copy()
    h = dst.expect("r", ids, tokens)
    src.announce("r", tokens, 11)
    for c in range(3):
        g = src.grant("r", c)
        src.conn.send(_landed("r", g, _gather_into(src, arena, "r", g)))
    h.wait(10)
    assert h.state is State.DONE and h.path == "mapped"
    from kvstage.bench.reference import check_shard

    assert check_shard(dst.cache, 11, ids, tokens) == []
    assert dst.slots_free() == dst.arena.allocator.count


def test_landed_messages_are_checked_like_notices(mapped_pair):
    dst, src, arena = mapped_pair
    ids = np.arange(pages_needed(CHUNK, 4))
    h = dst.expect("r", ids, CHUNK)
    src.announce("r", CHUNK, 3)
    g = src.grant("r", 0)
    nbytes = _gather_into(src, arena, "r", g)
    src.conn.send(_landed("r", g, nbytes, writer=1))
    assert "names writer 1, but came from source rank 0" in src.error()
    src.conn.send(_landed("nope", g, nbytes))
    assert "unknown request 'nope'" in src.error()
    src.conn.send(_landed("r", g, nbytes - 512))  # a wrong length fails the request: its slot lacks the chunk
    assert "wrong size" in src.error()
    with pytest.raises(TransferFailed, match="wrong size"):
        h.wait(10)


def test_landed_message_refused_when_the_arena_is_not_shared():
    dst = _destination("off")
    src = FakeSource(dst.address, TOKEN)
    try:
        h = dst.expect("r", np.arange(pages_needed(CHUNK, 4)), CHUNK)
        src.announce("r", CHUNK, 3)
        g = src.grant("r", 0)
        src.conn.send(_landed("r", g, CHUNK * src.token_bytes))
        assert "shares no arena" in src.error()
        assert h.state is not State.DONE and not h.done()
        src.write("r", g)  # the honest write still completes it
        h.wait(10)
    finally:
        src.close()
        dst.close()


def test_chunks_owed_by_a_mapped_writer_leave_the_loop_idle(mapped_pair):
    """A mapped writer's ``landed`` message wakes the destination's loop, so chunks
    only such writers owe do not make it poll the transport; a writer not known
    to be mapped yet (its first chunk) does."""
    dst, src, arena = mapped_pair
    for i, req in enumerate(("first", "second")):
        ids = np.arange(i * 8, i * 8 + pages_needed(CHUNK, 4))
        h = dst.expect(req, ids, CHUNK)
        src.announce(req, CHUNK, 20 + i)
        g = src.grant(req, 0)
        deadline = time.monotonic() + 5
        while dst.stats().announced == 0:
            assert time.monotonic() < deadline, f"{req}: announcement not handled"
            time.sleep(0.01)
        assert dst.stats().polling is (i == 0)  # the first request polls, the second waits idle
        src.conn.send(_landed(req, g, _gather_into(src, arena, req, g)))
        h.wait(10)
        assert h.path == "mapped"


def test_a_mapped_message_makes_the_first_request_idle_too(mapped_pair):
    """A source that mapped the arena says ``mapped``: the destination then
    knows before any ``landed`` that this writer owes no transport notice."""
    dst, src, arena = mapped_pair
    src.conn.send({"type": "mapped"})
    ids = np.arange(pages_needed(CHUNK, 4))
    h = dst.expect("first", ids, CHUNK)
    src.announce("first", CHUNK, 30)
    g = src.grant("first", 0)
    deadline = time.monotonic() + 5
    while dst.stats().announced == 0:
        assert time.monotonic() < deadline, "announcement not handled"
        time.sleep(0.01)
    assert dst.stats().polling is False
    src.conn.send(_landed("first", g, _gather_into(src, arena, "first", g)))
    h.wait(10)
    assert h.path == "mapped"


def test_mapped_message_refused_when_the_arena_is_not_shared():
    dst = _destination("off")
    src = FakeSource(dst.address, TOKEN)
    try:
        src.conn.send({"type": "mapped"})
        m = src.message(lambda m: m["type"] == "error")
        assert m["about"] == "mapped" and "shares no arena" in m["reason"]
    finally:
        src.close()
        dst.close()


def test_a_real_source_says_mapped_once_it_maps_the_arena():
    dst = _destination("on")
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 64), Settings(**fr.SETTINGS, auth_token=TOKEN, mapped="on"))
    try:
        src.connect([dst.address])
        deadline = time.monotonic() + 5
        while dst.stats().mapped_peers != 1:
            assert time.monotonic() < deadline, "the destination did not hear that its writer maps its arena"
            time.sleep(0.01)
    finally:
        src.close()
        dst.close()


def test_source_does_not_map_an_arena_of_another_host():
    """The welcome's facts say where the destination runs: a shared arena of another
    host is never opened (``on`` refuses it, ``auto`` writes through the transport)."""
    from kvstage.staging.mapped import share

    dst = _destination("on")
    try:
        for setting in ("on", "auto"):
            src = Source(RankCache.allocate(fr.src_spec(1), 0, 64), Settings(**fr.SETTINGS, auth_token=TOKEN, mapped=setting))
            elsewhere = {"host": {"value": {"hostname": "elsewhere", "boot_id": "0"}}}
            desc = share(dst.arena.buffer)
            try:
                got = src._call(lambda: src._map_arena(_Conn(), dst.arena_region, desc, elsewhere))
                assert setting == "auto" and got is None
            except TransferFailed as e:
                assert setting == "on" and "another host" in str(e)
            mine = src._call(lambda: src._map_arena(_Conn(), dst.arena_region, desc, src.facts))
            assert mine is not None and mine.kind == "memfd"
            src._call(mine.close)
            src.close()
    finally:
        dst.close()


class _Conn:
    """What ``_map_arena`` uses of a control connection: its name, and close."""

    peer = "destination rank 0 (test)"

    def close(self):
        pass


def test_closing_a_mapping_keeps_live_views_valid():
    """A source drops a destination's arena when the destination goes; a view of it
    still held somewhere stays valid (the map goes with the last tensor holding it)."""
    from kvstage.staging.mapped import share, shared_host_buffer

    owner = shared_host_buffer(1 << 16)
    m = open_shared(share(owner), 1 << 16, torch.device("cpu"))
    view = m.view(128, 16)
    view.fill_(7)
    m.close()
    assert int(owner[128]) == 7 and int(view[0]) == 7


@pytest.mark.gpu
def test_a_cuda_arena_is_local_only_on_the_gpu_its_owner_names():
    """``auto`` maps a CUDA arena only on the source's own GPU. The tensor over an IPC
    mapping reports the opening process's current device whatever GPU holds the memory,
    so the owner's share names its GPU by UUID and the source compares that."""
    from kvstage.staging.arena import allocate_arena
    from kvstage.staging.mapped import MappedArena, gpu_uuid, share

    dev = torch.device("cuda", 0)
    buf = allocate_arena(1 << 20, dev)
    desc = share(buf)
    assert desc["kind"] == "cuda_ipc" and desc["gpu"] == gpu_uuid(dev) and len(desc["gpu"]) >= 32
    view = buf[:16]  # stands for an IPC mapping (a process cannot open its own handle)
    assert MappedArena(view, "cuda_ipc", lambda: None, desc["gpu"]).on(dev)
    assert not MappedArena(view, "cuda_ipc", lambda: None, "GPU-00000000-0000-0000-0000-000000000000").on(dev)
    assert not MappedArena(view, "cuda_ipc", lambda: None, None).on(dev)  # unknown: not taken for local
    if torch.cuda.device_count() > 1:
        assert not MappedArena(view, "cuda_ipc", lambda: None, desc["gpu"]).on(torch.device("cuda", 1))
