"""Hostile "chunk landed" notices from an authenticated source, through the real
transport: a fake source rank (a real NIXL agent behind a raw control socket)
writes real bytes into the destination's arena with crafted notifications.

Each bad notice is refused with an error naming the problem on the writer's
control connection; notices that name no grant of theirs change nothing; a
notice that says its chunk went to the wrong place or had the wrong length
fails that request (its slot does not hold the chunk). Throughout, the
destination keeps serving: requests before, between and after complete byte
for byte, and every slot is free at the end.
"""

from __future__ import annotations

import time

import pytest
import torch

from support import fault_ranks as fr
from support.fake_peers import FakeSource, expect_reversed as _expect
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.protocol.destination import Destination
from kvstage.protocol.request import State
from kvstage.protocol.wire import encode_notice
from kvstage.staging.cache import RankCache
from kvstage.transports.base import Spans, WriteState
from kvstage.transports.nixl import NixlTransport

TOKEN = "notice-test"
CHUNK = 32  # tokens per chunk: 16 KiB slots, 512 B a token (fault_ranks geometry, source TP 1)


@pytest.fixture
def pair():
    # peer_timeout_s: the fake source answers grants but does not ping like a real one
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 1024),
                      Settings(**fr.SETTINGS, auth_token=TOKEN, peer_timeout_s=600))
    src = FakeSource(dst.address, TOKEN)
    yield dst, src
    src.close()
    dst.close()


def test_hostile_notices_are_refused_and_the_destination_keeps_serving(pair):
    dst, src = pair
    tokens = 8 * CHUNK  # 8 chunks through 4 slots: chunks 4..7 are granted only as 0..3 land
    h, ids = _expect(dst, "good", tokens, 0)
    src.announce("good", tokens, 5)
    g = {c: src.grant("good", c) for c in range(4)}
    honest = encode_notice("good", 0, 0, g[0]["offset"], CHUNK * src.token_bytes)

    # each carries chunk 0's real bytes to chunk 0's own slot, so the data is right; only the notice lies
    for notice, needle in [
        (b"\xff not json", "not JSON"),
        (b'{"t": "landed", "req": "good"}', "lacks field 'chunk'"),
        (honest.replace(b'"writer":0', b'"writer":1'), "names writer 1, but agent"),
        (honest.replace(b'"good"', b'"nope"'), "unknown request 'nope'"),
        (encode_notice("good", 8, 0, g[0]["offset"], CHUNK * src.token_bytes), "chunk 8 of 'good', out of range: the request has 8 chunks"),
        (encode_notice("good", 5, 0, g[0]["offset"], CHUNK * src.token_bytes), "chunk 5 of 'good', which is not granted yet"),
        (encode_notice("good", 0, 0, -1, CHUNK * src.token_bytes), "offset=-1 is below 0"),
        (encode_notice("good", 0, 0, g[0]["offset"], 0), "bytes=0 is below 1"),
    ]:
        src.write("good", g[0], notice)
        reason = src.error()
        assert needle in reason, (notice, reason)
        assert h.state is State.TRANSFERRING and dst.slots_free() == 0, "a refused notice changes nothing"

    src.write("good", g[0])  # now honestly
    src.write("good", g[0])  # the same chunk again
    assert "duplicate notice: chunk 0 of 'good' from writer 0 already landed" in src.error()
    for c in range(1, 8):
        src.write("good", g[c] if c in g else src.grant("good", c))
    h.wait(10)
    assert fr.check(dst.cache, 5, ids, tokens) == []  # byte-exact despite all of the above
    src.write("good", g[3], encode_notice("good", 3, 0, g[3]["offset"], CHUNK * src.token_bytes))
    assert "unknown request 'good'" in src.error()  # finished requests are forgotten

    # a chunk written to another slot than its grant's, and one of the wrong length: the request fails
    for req, over, needle in [
        ("wrong-slot", lambda gr: dict(offset=(gr["offset"] + 16384) % (4 * 16384)), "wrong slot: chunk 0 was written as 16384 bytes at arena offset"),
        ("wrong-size", lambda gr: dict(nbytes=16384 - 512), "wrong size: chunk 0 was written as 15872 bytes"),
        ("beyond", lambda gr: dict(offset=gr["offset"], notice=encode_notice("beyond", 0, 0, 1 << 40, 16384)), "at arena offset 1099511627776"),
    ]:
        hv, _ = _expect(dst, req, CHUNK, 100)
        src.announce(req, CHUNK, 6)
        gr = src.grant(req, 0)
        kw = over(gr)
        src.write(req, gr, kw.pop("notice", None), **kw)
        assert needle.split(":")[0] in src.error()
        with pytest.raises(TransferFailed) as err:
            hv.wait(10)
        assert err.value.peer == "source rank 0" and err.value.stage == "write" and needle in err.value.cause, err.value
        assert src.message(lambda m: m["type"] == "abort" and m["req"] == req)["reason"] == err.value.cause
        assert dst.slots_free() == 4

    # and the destination still serves: a last request, byte-exact, then nothing left behind
    h2, ids2 = _expect(dst, "after", 3 * CHUNK + 7, 200)
    src.announce("after", 3 * CHUNK + 7, 7)
    for c in range(4):
        src.write("after", src.grant("after", c))
    h2.wait(10)
    assert fr.check(dst.cache, 7, ids2, 3 * CHUNK + 7) == []
    assert dst.slots_free() == 4 and dst.stats().requests == 0


def test_a_notice_from_an_agent_that_is_not_a_source_is_refused(pair, caplog):
    """A second NIXL agent that never passed the handshake (it only learned the
    destination's metadata) writes into the arena with a notice naming writer 0."""
    dst, src = pair
    h, ids = _expect(dst, "r", CHUNK, 0)
    src.announce("r", CHUNK, 3)
    gr = src.grant("r", 0)
    stranger = NixlTransport("stranger")
    buf = torch.zeros(16384, dtype=torch.uint8)
    try:
        local = stranger.register(buf)
        peer = stranger.connect(dst.transport.metadata())  # as if it had eavesdropped the handshake
        w = stranger.write(peer, Spans.single(local, [0], [16384]), Spans.single(src.arena, [gr["offset"]], [16384]),
                           encode_notice("r", 0, 0, gr["offset"], 16384))
        deadline = time.monotonic() + 10
        while stranger.poll(w) is not WriteState.DONE:
            assert time.monotonic() < deadline
        time.sleep(0.3)
        assert h.state is State.TRANSFERRING and dst.slots_free() == 3  # ignored: the chunk still waits for writer 0
        refused = [r.getMessage() for r in caplog.records if "rejected a landing notice" in r.getMessage()]
        assert refused and "not a connected source" in refused[0] and "names writer 0, but agent" in refused[0], refused
    finally:
        stranger.close()
    src.write("r", gr)  # the real writer's bytes land over the stranger's
    h.wait(10)
    assert fr.check(dst.cache, 3, ids, CHUNK) == []
