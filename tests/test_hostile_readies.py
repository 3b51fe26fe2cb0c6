"""Hostile request messages against real endpoints (real sockets, real NIXL, the real handshake).

A fake source (``support.fake_peers.FakeSource``: a NIXL agent behind a raw
control socket) sends a real destination ``ready`` and ``chunk`` messages a
real source never would; a fake destination sends a real source hostile
``read``, ``done`` and ``abort`` messages. Each must fail only the request it
names, or be refused with an ``error``, naming the field; the endpoint keeps
serving a real peer byte-exact afterwards, and nothing is left behind.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from support import fault_ranks as fr
from support.fake_peers import ARENA_BYTES, TOKEN, FakeDestination, FakeSource
from kvstage.bench.reference import fill_shard
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.layout import pages_needed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.protocol.source import ABORT_HOLD_S, Source
from kvstage.staging.cache import RankCache

FAKE = "source rank 0 of engine hostile"  # how the destination names the fake source
TOKENS = 40  # two chunks of 32 tokens (a destination slot); three source pages of 16, ten destination pages of 4
SLOT = 16384  # a chunk's place in the fake source's arena
_ids = itertools.count()


@pytest.fixture(scope="module")
def peers():
    """A real destination, the fake source of engine "hostile" and a real source of engine "" connected
    to it; every test sends its own requests."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 128), Settings(**fr.SETTINGS, auth_token=TOKEN))
    fake = real = None
    try:
        fake = FakeSource(dst.address)
        real = Source(RankCache.allocate(fr.src_spec(1), 0, 64), Settings(**fr.SETTINGS, auth_token=TOKEN))
        real.connect([dst.address])
        yield dst, fake, real
    finally:
        for ep in (real, fake, dst):
            if ep is not None:
                ep.close()


def _req(kind: str) -> str:
    return f"{kind}{next(_ids)}"


def _expect(dst, req: str, tokens: int = TOKENS, engine: str = "hostile"):
    pages = np.arange(10, 10 + pages_needed(tokens, 4))
    return dst.expect(req, pages, tokens, engine=engine), pages


def _failed(h, needle: str, stage: str = "ready", peer: str = FAKE) -> None:
    with pytest.raises(TransferFailed) as err:
        h.wait(5)
    e = err.value
    assert (e.peer, e.stage) == (peer, stage) and needle in e.cause, str(e)


def _serves_byte_exact(dst, real, seed: int) -> None:
    """The destination still serves a real source: a request of three chunks lands exactly, and then
    nothing of any request is held and every slot is free."""
    tokens = 70
    spages = np.arange(pages_needed(tokens, 16))
    fill_shard(real.cache, seed, spages, tokens)
    dpages = np.random.default_rng(seed).permutation(np.arange(40, 128))[: pages_needed(tokens, 4)]
    hd = dst.expect(f"real{seed}", dpages, tokens)
    real.send(f"real{seed}", spages, tokens).wait(10)
    hd.wait(10)
    assert fr.check(dst.cache, seed, dpages, tokens) == []
    fr.until(lambda: (dst.stats().requests, dst.slots_free()) == (0, 4), 5)


def test_an_honest_fake_source_is_read_byte_exact_by_both_paths(peers):
    """The fake is a fair baseline: what it says honestly lands exactly, so a refusal below is the
    hostile field's doing."""
    dst, fake, _ = peers
    req = _req("pages")
    h, pages = _expect(dst, req)
    fake.ready(req, TOKENS, "pages", pages=fake.fill(11, TOKENS))
    h.wait(5)
    assert h.path == "pages" and fr.check(dst.cache, 11, pages, TOKENS) == []
    assert fake.about(req) == {"type": "done", "req": req}
    req = _req("read")
    h, pages = _expect(dst, req)
    fake.ready(req, TOKENS, "read", chunk_tokens=32, chunks=2, gathered=[], order="tokens")
    fake.stage(12, 0, 32, 0)
    fake.stage(12, 32, TOKENS - 32, SLOT)
    fake.chunk(req, 0, 0)
    fake.chunk(req, 1, SLOT)
    h.wait(5)
    assert h.path == "read" and fr.check(dst.cache, 12, pages, TOKENS) == []
    assert [fake.about(req) for _ in range(3)] == [{"type": "read", "req": req, "index": 0},
                                                   {"type": "read", "req": req, "index": 1},
                                                   {"type": "done", "req": req}]


READ = dict(path="read", chunk_tokens=32, chunks=2, order="tokens")
#: a ready that fails its request: its fields beyond req and tokens, and the words of the failure
BAD_READIES = {
    "unknown_path": (dict(path="warp"), "path 'warp' is none of ipc, direct, pages, read"),
    "ipc_on_a_host_destination": (dict(path="ipc", pages=[0, 1, 2]), "path ipc is not allowed here"),
    "direct_where_the_plan_is_not": (dict(path="direct", pages=[0, 1, 2]), "path direct, but the pieces are not whole "
                                                                     "shards with equal paging"),
    "pages_without_page_ids": (dict(path="pages"), "path pages needs the source's page ids"),
    "pages_of_the_wrong_count": (dict(path="pages", pages=[0, 1]), "2 page ids for 40 tokens of page size 16; they "
                                                                   "need 3"),
    "pages_past_the_offer": (dict(path="pages", pages=[0, 1, 64]), "page id 64 is past the 64 pages the source "
                                                                   "offered"),
    "duplicate_page_ids": (dict(path="pages", pages=[0, 1, 1]), "a page id appears twice"),
    "read_without_chunking": (dict(path="read"), "the read path needs an arena, chunk_tokens and chunks"),
    "chunks_that_do_not_cut_the_tokens": (READ | dict(chunks=3), "3 chunks of 32 tokens do not cut 40 tokens"),
    "unknown_order": (READ | dict(order="diagonal"), "order 'diagonal' is none of heads, tokens"),
    "a_gathered_chunk_malformed": (READ | dict(gathered=[[0, "0", ""]]), "a gathered chunk must be [index, offset, "
                                                                         "ticket]"),
    "a_gathered_chunk_out_of_range": (READ | dict(gathered=[[2, 0, ""]]), "chunk 2 of '{req}' is out of range: the "
                                                                          "request has 2 chunks"),
    "a_gathered_chunk_outside_the_arena": (READ | dict(gathered=[[0, ARENA_BYTES - 100, ""]]),
                                           f"lie outside the source's arena of {ARENA_BYTES} bytes"),
    "a_gathered_chunk_twice": (READ | dict(gathered=[[0, 0, ""], [0, SLOT, ""]]), "chunk 0 of '{req}' announced twice"),
    "a_gathered_ticket_not_base64": (READ | dict(gathered=[[0, 0, "%%%"]]), "its ticket is not base64"),
}


@pytest.mark.parametrize("early", [False, True], ids=["expected", "early"])
@pytest.mark.parametrize("case", sorted(BAD_READIES))
def test_a_hostile_ready_fails_only_its_request_naming_the_field(peers, case, early):
    """Expected first, the ready is checked as it comes; before the expect, it is kept and checked
    when the request is expected. Either way only that request fails (both sides hear why) and the
    destination goes on serving."""
    dst, fake, real = peers
    fields, needle = BAD_READIES[case]
    req = _req(case)
    needle = needle.format(req=req)
    if early:
        fake.ready(req, TOKENS, **fields)
        fr.until(lambda: dst.stats().unknown_announced == 1, 5)
    h, _ = _expect(dst, req)
    if not early:
        fake.ready(req, TOKENS, **fields)
    _failed(h, needle)
    m = fake.about(req)
    assert m["type"] == "abort" and needle in m["reason"], m
    _serves_byte_exact(dst, real, seed=20)


def test_a_ready_said_twice_fails_the_request(peers):
    dst, fake, real = peers
    req = _req("twice")
    h, _ = _expect(dst, req)
    fake.ready(req, TOKENS, gathered=[], **READ)  # no chunk gathered yet: the request waits for them
    fake.ready(req, TOKENS, gathered=[], **READ)
    _failed(h, f"ready for '{req}' said twice")
    assert fake.about(req)["type"] == "abort"
    _serves_byte_exact(dst, real, seed=21)


def test_a_read_chunk_bigger_than_a_destination_slot_fails_by_name(peers):
    """A source that cuts chunks past the destination's slot (it was told the slot size) is refused
    before anything is read, naming the sizes and the fix."""
    dst, fake, real = peers
    req = _req("big")
    h, _ = _expect(dst, req, tokens=100)
    fake.ready(req, 100, "read", chunk_tokens=100, chunks=1, gathered=[], order="tokens")
    _failed(h, "a chunk of 100 tokens needs 51200 bytes of a slot here, which holds 16384", stage="read", peer="local")
    assert fake.about(req)["type"] == "abort"
    _serves_byte_exact(dst, real, seed=22)


#: a chunk after a good read ready of two chunks (or with none): its fields and the words of the failure
BAD_CHUNKS = {
    "index_out_of_range": (dict(index=2, offset=0), "chunk 2 of '{req}' is out of range: the request has 2 chunks"),
    "outside_the_arena": (dict(index=1, offset=ARENA_BYTES - 2048), "4096 bytes at offset 63488 lie outside the "
                                                                    f"source's arena of {ARENA_BYTES} bytes"),
    "without_a_ready": (dict(index=0, offset=0), "chunk 0 of '{req}' from a source that did not say ready for the "
                                                 "read path"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHUNKS))
def test_a_hostile_chunk_fails_only_its_request_naming_the_field(peers, case):
    dst, fake, real = peers
    fields, needle = BAD_CHUNKS[case]
    req = _req(case)
    h, _ = _expect(dst, req)
    if case != "without_a_ready":
        fake.ready(req, TOKENS, gathered=[], **READ)
    fake.chunk(req, **fields)
    _failed(h, needle.format(req=req))
    assert fake.about(req)["type"] == "abort"
    _serves_byte_exact(dst, real, seed=23)


def test_a_chunk_announced_twice_fails_the_request(peers):
    """The first announcement is read (the fake hears ``read``); the second fails the request."""
    dst, fake, real = peers
    req = _req("dup")
    h, _ = _expect(dst, req)
    fake.ready(req, TOKENS, gathered=[], **READ)
    fake.stage(13, 0, 32, 0)
    fake.chunk(req, 0, 0)
    assert fake.about(req) == {"type": "read", "req": req, "index": 0}
    fake.chunk(req, 0, 0)
    _failed(h, f"chunk 0 of '{req}' announced twice")
    assert fake.about(req)["type"] == "abort"
    _serves_byte_exact(dst, real, seed=24)


def test_a_chunk_of_a_request_neither_expected_nor_ready_is_dropped(peers):
    """Nothing is kept for it: the request, expected later, waits for its ready as any other, and
    lands exactly once the fake says it honestly."""
    dst, fake, _ = peers
    req = _req("stray")
    fake.chunk(req, 0, 0)
    assert fake.quiet(0.2) == [] and dst.stats().unknown_announced == 0
    h, pages = _expect(dst, req)
    fake.ready(req, TOKENS, "pages", pages=fake.fill(14, TOKENS))
    h.wait(5)
    assert fr.check(dst.cache, 14, pages, TOKENS) == []


#: fields that break a message's own rule: refused where it is decoded, with an ``error`` naming them
MALFORMED = {
    "a_bool_page": ({"type": "ready", "tokens": TOKENS, "path": "pages", "pages": [0, True, 2]},
                    "every page id must be a non-negative integer"),
    "a_float_page": ({"type": "ready", "tokens": TOKENS, "path": "pages", "pages": [0, 1.0, 2]},
                     "every page id must be a non-negative integer"),
    "a_negative_page": ({"type": "ready", "tokens": TOKENS, "path": "pages", "pages": [0, -1, 2]},
                        "every page id must be a non-negative integer"),
    "pages_not_a_list": ({"type": "ready", "tokens": TOKENS, "path": "pages", "pages": "0,1,2"},
                         "must be a list of at most"),
    "no_tokens": ({"type": "ready", "tokens": 0, "path": "pages", "pages": [0, 1, 2]}, "tokens=0: below 1"),
    "tokens_a_bool": ({"type": "ready", "tokens": True, "path": "pages", "pages": [0, 1, 2]}, "tokens=True: must be int"),
    "chunks_zero": ({"type": "ready", "tokens": TOKENS, "path": "read", "chunk_tokens": 32, "chunks": 0},
                    "chunks=0: below 1"),
    "a_negative_chunk_index": ({"type": "chunk", "index": -1, "offset": 0}, "index=-1: below 0"),
    "a_float_offset": ({"type": "chunk", "index": 0, "offset": 0.5}, "offset=0.5: must be int"),
    "a_ticket_not_base64": ({"type": "chunk", "index": 0, "offset": 0, "ticket": "%%%"}, "not base64"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_ready_or_chunk_is_refused_and_changes_nothing(peers, case):
    """A message that breaks its own fields' rules is refused by name; the request it names goes on, and
    lands exactly when the fake then says it honestly."""
    dst, fake, _ = peers
    msg, needle = MALFORMED[case]
    req = _req(case)
    h, pages = _expect(dst, req)
    fake.send(msg | {"req": req})
    m = fake.error()
    assert m["about"] == msg["type"] and m["req"] == req and needle in m["reason"], m
    assert not h.done() and dst.tracks(req, engine="hostile")
    fake.ready(req, TOKENS, "pages", pages=fake.fill(15, TOKENS))
    h.wait(5)
    assert fr.check(dst.cache, 15, pages, TOKENS) == []


def test_a_path_the_destinations_setting_refuses_fails_by_name():
    """The welcome tells the source which paths it may take; a source that ignores it is refused."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 64), Settings(**fr.SETTINGS, auth_token=TOKEN, path="read"))
    fake = None
    try:
        fake = FakeSource(dst.address)
        assert fake.paths == ["read"]
        h, _ = _expect(dst, "p")
        fake.ready("p", TOKENS, "pages", pages=fake.fill(16, TOKENS))
        _failed(h, "path pages is not allowed here")
    finally:
        if fake is not None:
            fake.close()
        dst.close()


# -- a fake destination against a real source ------------------------------------------------------------

@pytest.fixture
def fake_dst():
    f = FakeDestination()
    yield f
    f.close()


def _chunks(f, req: str, ready: dict) -> dict:
    """Every chunk of a read ready, as {index: offset}: those it listed and the ``chunk`` messages after it."""
    got = {i: off for i, off, _ in ready["gathered"]}
    while len(got) < ready["chunks"]:
        m = f.message(lambda m: m["type"] == "chunk" and m["req"] == req)
        got[m["index"]] = m["offset"]
    return got


def _refused(f, msg: dict, needle: str) -> None:
    f.send(msg)
    m = f.error()
    assert m["about"] == msg["type"] and needle in m["reason"], (msg, m)


def test_hostile_reads_and_dones_are_refused_and_the_source_keeps_serving(fake_dst):
    """A real source whose destination is fake: each hostile message is refused by name and changes
    nothing; a ``read`` frees its chunk's slot at once, ``done`` ends the request, and a message for it
    after that is refused as one for a finished request."""
    f = fake_dst
    h = f.send_request("r", TOKENS)
    ready = f.message(lambda m: m["type"] == "ready")
    assert (ready["path"], ready["chunks"], ready["chunk_tokens"], ready["order"]) == ("read", 2, 32, "tokens")
    chunks = _chunks(f, "r", ready)
    fr.until(lambda: f.src.stats().slots_free == 2, 5)  # two of the source's four slots hold the chunks
    for msg, needle in [
        ({"type": "read", "req": "zzz", "index": 0}, "request 'zzz' is not in flight here"),
        ({"type": "done", "req": "zzz"}, "request 'zzz' is not in flight here"),
        ({"type": "read", "req": "r", "index": 2}, "read of chunk 2 of 'r', which has 2 chunks"),
        ({"type": "read", "req": "r", "index": -1}, "index=-1: below 0"),
        ({"type": "read", "req": "r"}, "lacks field 'index'"),
        ({"type": "ready", "req": "r", "tokens": TOKENS, "path": "read"}, "ready message from a destination"),
        ({"type": "offer", "arena": {}, "kv": []}, "offer message from a destination"),
    ]:
        _refused(f, msg, needle)
    assert h.state is State.PENDING and f.src.stats().slots_free == 2
    assert f.read_chunk(0, chunks[0], ready)
    f.send({"type": "read", "req": "r", "index": 0})
    fr.until(lambda: f.src.stats().slots_free == 3, 5)  # its slot is free at once
    assert h.state is State.TRANSFERRING
    _refused(f, {"type": "read", "req": "r", "index": 0}, "read of chunk 0 of 'r', which destination rank 0 was not "
                                                         "offered or read already")
    assert f.read_chunk(1, chunks[1], ready)
    f.send({"type": "read", "req": "r", "index": 1})
    f.send({"type": "done", "req": "r"})
    h.wait(5)
    assert f.src.stats().slots_free == 4
    _refused(f, {"type": "read", "req": "r", "index": 1}, "request 'r' already done here")
    _refused(f, {"type": "done", "req": "r"}, "request 'r' already done here")
    # it keeps serving: another request, read and checked byte for byte
    h = f.send_request("s", 100)
    ready = f.message(lambda m: m["type"] == "ready" and m["req"] == "s")
    for index, offset in sorted(_chunks(f, "s", ready).items()):
        assert f.read_chunk(index, offset, ready), f"chunk {index} is not the reference's"
        f.send({"type": "read", "req": "s", "index": index})
    f.send({"type": "done", "req": "s"})
    h.wait(5)
    st = f.src.stats()
    assert (st.slots_free, st.requests) == (4, 0)


def test_a_destinations_abort_fails_the_request_and_frees_its_slots_at_once(fake_dst):
    """The destination that aborts has stopped reading: the source's slots come back at once. One for a
    request not sent yet is remembered, and that request fails the moment it is sent."""
    f = fake_dst
    h = f.send_request("m", 100)
    _chunks(f, "m", f.message(lambda m: m["type"] == "ready"))
    fr.until(lambda: f.src.stats().slots_free == 0, 5)  # four chunks gathered, none read
    t0 = time.monotonic()
    f.send({"type": "abort", "req": "m", "reason": "decode gave up"})
    with pytest.raises(TransferFailed) as err:
        h.wait(5)
    assert (err.value.peer, err.value.stage) == ("destination rank 0", "abort")
    assert err.value.cause == "destination aborted: decode gave up"
    fr.until(lambda: f.src.stats().slots_free == 4, 5)
    assert time.monotonic() - t0 < ABORT_HOLD_S
    assert [m for m in f.quiet(0.2) if m.get("req") == "m"] == []  # the aborting side is not told back
    f.send({"type": "abort", "req": "later", "reason": "not wanted"})
    fr.until(lambda: f.src.stats().aborts_remembered == 1, 5)
    with pytest.raises(TransferFailed, match="destination aborted: not wanted"):
        f.send_request("later", 10).wait(1)
    assert f.about("later") == {"type": "abort", "req": "later", "reason": "destination aborted: not wanted"}
    assert f.src.stats().slots_free == 4


def test_a_sources_abort_holds_its_gathered_slots_while_a_read_may_still_copy_them(fake_dst):
    """The source aborts a request whose chunks a destination may be reading (one-sided: the source cannot
    see it): the destination hears ``abort``, and the slots return only after ``ABORT_HOLD_S``."""
    f = fake_dst
    h = f.send_request("q", 100)
    _chunks(f, "q", f.message(lambda m: m["type"] == "ready"))
    fr.until(lambda: f.src.stats().slots_free == 0, 5)
    t0 = time.monotonic()
    h.abort("prefill gave up")
    m = f.about("q")
    assert m == {"type": "abort", "req": "q", "reason": "prefill gave up"}
    with pytest.raises(TransferFailed, match="prefill gave up"):
        h.wait(1)
    fr.until(lambda: f.src.stats().slots_free == 4, ABORT_HOLD_S + 5)
    assert time.monotonic() - t0 >= ABORT_HOLD_S * 0.9
    assert f.src.stats().requests == 0
