"""What only the UCX transport (UCXX, two-sided) does: real UCX workers, no mocks.

Receives are posted by ``expect`` and a write needs the ticket it returned. The
contract every transport keeps is in tests/test_transports.py.
"""

import logging
import struct
import time

import pytest
import torch

from kvstage.config import Settings
from kvstage.errors import ConfigError, TransferFailed, TransportError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.destination import Destination
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec
from support.transport_pair import finish_write, transport_pair
from kvstage.transports.base import Spans, WriteState
from kvstage.transports.ucx import UcxTransport


@pytest.fixture
def pair():
    with transport_pair("ucx", 1 << 18, 1 << 18) as p:
        yield p


def test_a_write_needs_the_receivers_ticket(pair):
    a, b, peer, ra, rb, *_ = pair
    spans = Spans.single(rb, [0], [1024]), Spans.single(ra, [0], [1024])
    with pytest.raises(TransportError, match="not a ticket from the receiver's expect"):
        a.write(peer, spans[1], spans[0], b"n")
    two = b.expect(a.id, Spans.single(rb, [0, 4096], [1024, 1024]))
    with pytest.raises(TransportError, match="1 spans, but the receiver expects 2"):
        a.write(peer, spans[1], spans[0], b"n", two)


def test_tickets_never_repeat_and_each_write_lands_where_its_ticket_says(pair):
    a, b, peer, ra, rb, src, dst = pair
    spans = Spans.single(rb, [8192], [4096])
    t1, t2 = b.expect(a.id, spans), b.expect(a.id, spans)
    assert t1 != t2
    for ticket, off, note in ((t2, 0, b"second"), (t1, 4096, b"first")):
        h = a.write(peer, Spans.single(ra, [off], [4096]), spans, note, ticket)
        got = finish_write(a, b, h)
        assert got == [(a.id, note)]
        assert torch.equal(dst[8192:12288], src[off : off + 4096])
    assert not dst[:8192].any() and not dst[12288:].any()


def test_a_write_completes_only_once_the_receiver_took_the_bytes(pair):
    # rendezvous for every size (RNDV_THRESH=0): without the receiver's progress nothing completes, so
    # a finished write means landed bytes (what the protocol's abort_ack relies on), even for 16 bytes
    a, b, peer, ra, rb, src, dst = pair
    spans = Spans.single(rb, [0], [16])
    h = a.write(peer, Spans.single(ra, [64], [16]), spans, b"tiny", b.expect(a.id, spans))
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert a.poll(h) is WriteState.PENDING
    assert finish_write(a, b, h) == [(a.id, b"tiny")]
    assert torch.equal(dst[:16], src[64:80])


def test_a_write_with_a_ticket_never_issued_lands_nowhere_and_is_not_notified(pair, caplog):
    a, b, peer, ra, rb, src, dst = pair
    forged = struct.pack("!QI", (1 << 61) + 12345, 1)  # no receive was posted for this tag
    h = a.write(peer, Spans.single(ra, [4096], [4096]), Spans.single(rb, [0], [4096]), b"forged", forged)
    with caplog.at_level(logging.WARNING, logger="kvstage.transports.ucx"):
        notes, done = [], False
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not done:
            notes += b.notifications()
            done = a.poll(h) is WriteState.DONE
    assert "did not issue" in caplog.text and "discarded" in caplog.text
    assert done  # the receiver swallowed the stray message; nothing is left queued (closing would hang on it)
    assert notes == [] and not dst.any()


def test_facts_come_from_ucxx_not_from_nixls_bundled_ucx(pair):
    facts = pair[0].facts()
    import ucxx

    assert facts["ucx_version"]["value"] == ".".join(map(str, ucxx.get_ucx_version()))
    assert {"self", "tcp"} <= set(facts["ucx_transports"]["value"])  # what UCX lists on every host
    assert "cma" in facts["ucx_modules"]["value"]  # a loadable module of the libucx wheel


def test_settings_pick_the_transport_and_ucx_has_no_direct_path(monkeypatch):
    assert Settings().transport == "nixl" and Settings().may_go_direct
    s = Settings(transport="ucx")
    assert not s.may_go_direct
    with pytest.raises(ConfigError, match=r"direct=True with transport='ucx'.*two-sided"):
        Settings(transport="ucx", direct=True)
    with pytest.raises(ConfigError, match=r"transport='tcp': must be one of nixl, ucx"):
        Settings(transport="tcp")
    monkeypatch.setenv("KVSTAGE_TRANSPORT", "ucx")
    assert Settings().transport == "ucx" and not Settings().may_go_direct
    monkeypatch.setenv("KVSTAGE_DIRECT", "1")
    with pytest.raises(ConfigError, match="unset KVSTAGE_DIRECT"):
        Settings()


GEO = KVGeometry(2, 4, 16, "bfloat16")


def test_endpoints_on_different_transports_refuse_each_other_by_name():
    spec = SideSpec(GEO, 1, PageLayout(4))
    dst = Destination(RankCache.allocate(spec, 0, 8), Settings(arena_mb=0.25))
    src = Source(RankCache.allocate(spec, 0, 8), Settings(arena_mb=0.25, transport="ucx"))
    try:
        with pytest.raises(TransferFailed, match="transport: the source uses 'ucx', this side 'nixl'"):
            src.connect([dst.address])
    finally:
        src.close()
        dst.close()


def test_a_ucx_endpoint_refuses_direct_true():
    spec = SideSpec(GEO, 1, PageLayout(4))
    with pytest.raises(ConfigError, match="two-sided and has no direct path"):
        Destination(RankCache.allocate(spec, 0, 8), Settings(arena_mb=0.25, direct=True), transport=UcxTransport("x"))


@pytest.mark.gpu
def test_cuda_spans_between_two_workers_are_byte_exact():
    dev = torch.device("cuda", 0)
    a, b = UcxTransport("ga"), UcxTransport("gb")
    try:
        src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device=dev)
        dst = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
        ra, rb = a.register(src), b.register(dst)
        peer = a.connect(b.metadata())
        remote = Spans.single(rb, [0, 32 << 20], [4096, 16 << 20])
        ticket = b.expect(a.id, remote)
        torch.cuda.synchronize()
        h = a.write(peer, Spans.single(ra, [1 << 20, 8 << 20], [4096, 16 << 20]), remote, b"gpu", ticket)
        assert finish_write(a, b, h) == [(a.id, b"gpu")]
        assert torch.equal(dst[:4096], src[1 << 20 : (1 << 20) + 4096])
        assert torch.equal(dst[32 << 20 : 48 << 20], src[8 << 20 : 24 << 20])
        assert int(dst[4096 : 32 << 20].count_nonzero()) == 0
    finally:
        a.close()
        b.close()
