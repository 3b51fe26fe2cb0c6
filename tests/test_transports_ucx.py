"""What only the UCX transport (UCXX, two-sided) does: real UCX workers, no mocks.

Receives are posted by ``expect`` and a write needs the ticket it returned; a
read needs the ticket of the source's ``offer``, and only that source's. The
contract every transport keeps is in tests/test_transports.py.
"""

import logging
import struct
import time

import pytest
import torch

import numpy as np

from kvstage.config import Settings
from kvstage.errors import ConfigError, TransportError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.destination import Destination
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec
from support.read_sources import ReadSources, finish
from support.transport_pair import finish_write, transport_pair
from kvstage.transports.base import Spans, WriteState
from kvstage.transports.ucx import UcxTransport


@pytest.fixture
def pair():
    with transport_pair("ucx", 1 << 18, 1 << 18) as p:
        yield p


@pytest.mark.ucx
def test_a_write_needs_the_receivers_ticket(pair):
    a, b, peer, ra, rb, *_ = pair
    spans = Spans.single(rb, [0], [1024]), Spans.single(ra, [0], [1024])
    with pytest.raises(TransportError, match="not a ticket from the receiver's expect"):
        a.write(peer, spans[1], spans[0], b"n")
    two = b.expect(a.id, Spans.single(rb, [0, 4096], [1024, 1024]))
    with pytest.raises(TransportError, match="1 spans, but the receiver expects 2"):
        a.write(peer, spans[1], spans[0], b"n", two)


@pytest.mark.ucx
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


@pytest.mark.ucx
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


@pytest.mark.ucx
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


@pytest.mark.ucx
def test_facts_come_from_ucxx_not_from_nixls_bundled_ucx(pair):
    facts = pair[0].facts()
    import ucxx

    assert facts["ucx_version"]["value"] == ".".join(map(str, ucxx.get_ucx_version()))
    assert {"self", "tcp"} <= set(facts["ucx_transports"]["value"])  # what UCX lists on every host
    assert "cma" in facts["ucx_modules"]["value"]  # a loadable module of the libucx wheel


def test_settings_pick_the_transport_and_ucx_reads_no_pages(monkeypatch):
    assert Settings().transport == "nixl" and Settings(transport="ucx").path == "auto"
    for path in ("pages", "direct"):
        with pytest.raises(ConfigError, match=rf"path='{path}' with transport='ucx'.*two-sided"):
            Settings(transport="ucx", path=path)
    assert Settings(transport="ucx", path="read").path == "read"
    with pytest.raises(ConfigError, match=r"transport='tcp': must be one of nixl, ucx"):
        Settings(transport="tcp")
    monkeypatch.setenv("KVSTAGE_TRANSPORT", "ucx")
    assert Settings().transport == "ucx"
    monkeypatch.setenv("KVSTAGE_PATH", "pages")
    with pytest.raises(ConfigError, match="set KVSTAGE_PATH=auto or read"):
        Settings()


GEO = KVGeometry(2, 4, 16, "bfloat16")


def _finish_read(reader, read, source, offer, timeout: float = 10.0) -> None:
    """Progress both ends from one thread until the read and its offer are done (each needs the other)."""
    deadline = time.monotonic() + timeout
    while True:
        states = reader.poll(read), source.poll(offer)  # both, every time: neither side moves alone
        if states == (WriteState.DONE, WriteState.DONE):
            return
        assert time.monotonic() < deadline, f"read, offer: {states}"


@pytest.mark.ucx
def test_a_read_needs_the_sources_own_offer_ticket():
    a, b, c = UcxTransport("a"), UcxTransport("b"), UcxTransport("c")
    try:
        src, dst = torch.arange(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
        ra, rb = a.register(src), b.register(dst)
        b_from_a, b_from_c = b.connect(a.metadata()), b.connect(c.metadata())
        a_to_b, c_to_b = a.connect(b.metadata()), c.connect(b.metadata())
        local, remote = Spans.single(rb, [0], [64]), Spans.single(ra, [0], [64])
        with pytest.raises(TransportError, match="not a ticket from the peer's offer"):
            b.read(b_from_a, local, remote)
        with pytest.raises(TransportError, match="not one of .*offers"):
            b.read(b_from_a, local, remote, b.expect(b_from_a, local))  # a receive ticket is not an offer
        ticket, offer = a.offer(a_to_b, remote)
        with pytest.raises(TransportError, match="not one of .*offers"):
            b.read(b_from_c, local, remote, ticket)  # a's offer, named as c's
        with pytest.raises(TransportError, match="2 spans, but the peer offered 1"):
            b.read(b_from_a, Spans.single(rb, [0, 100], [64, 64]), Spans.single(ra, [0, 100], [64, 64]), ticket)
        with pytest.raises(TransportError, match="offered spans.*outside"):
            a.offer(a_to_b, Spans.single(ra, [4090], [64]))
        h = b.read(b_from_a, local, remote, ticket)
        _finish_read(b, h, a, offer)
        assert torch.equal(dst[:64], src[:64]) and not dst[64:].any()
    finally:
        for t in (a, b, c):
            t.close()


@pytest.mark.ucx
def test_abandoning_a_read_whose_offer_never_came_cancels_its_receives(pair):
    a, b, peer, ra, rb, src, dst = pair
    b_from_a = b.connect(a.metadata())
    ticket, first = a.offer(peer, Spans.single(ra, [0], [4096]))
    base, count = struct.unpack("!QI", ticket)
    never = struct.pack("!QI", base + 1000, 1)  # a's tags, of an offer it has not made
    h = b.read(b_from_a, Spans.single(rb, [0], [4096]), Spans.single(ra, [0], [4096]), never)
    assert b.poll(h) is WriteState.PENDING
    assert b.abandon(h) is True  # nothing matched it: cancelled, nothing can land
    with pytest.raises(TransportError, match="anceled"):
        b.poll(h)
    b.release(h)
    got = b.read(b_from_a, Spans.single(rb, [8192], [4096]), Spans.single(ra, [0], [4096]), ticket)
    _finish_read(b, got, a, first)
    assert torch.equal(dst[8192:12288], src[:4096]) and not dst[:8192].any()


@pytest.mark.ucx
def test_an_offer_is_not_taken_back_and_says_so():
    """UCX cancels receives only: an offer not yet read cannot be withdrawn."""
    a, b = UcxTransport("a"), UcxTransport("b")
    try:
        ra = a.register(torch.arange(4096, dtype=torch.uint8))
        rb = b.register(torch.zeros(4096, dtype=torch.uint8))
        peer, b_from_a = a.connect(b.metadata()), b.connect(a.metadata())
        ticket, offer = a.offer(peer, Spans.single(ra, [0], [4096]))
        assert a.abandon(offer) is False
        h = b.read(b_from_a, Spans.single(rb, [0], [4096]), Spans.single(ra, [0], [4096]), ticket)
        _finish_read(b, h, a, offer)
        assert a.abandon(offer) is True  # taken: over
    finally:
        a.close()
        b.close()


@pytest.mark.ucx
def test_an_offer_made_right_after_connect_is_read_while_its_source_is_stopped():
    """No read before: connect's hello resolved the endpoints while both ran. 2,000 spans: more
    rendezvous requests than UCX's default shared-memory FIFO (256) would hold."""
    with ReadSources("ucx", 1, 1 << 20, 1 << 20) as s:
        s.ask(0, "run", 1.0)  # both processes run their endpoints a while (the reader while it waits)
        offsets = np.arange(2000, dtype=np.int64) * 512
        ticket = s.offer(0, offsets, np.full(2000, 256), then_stop=True)
        s.wait_stopped(0)
        h = s.tr.read(s.peers[0], Spans.single(s.region, offsets, np.full(2000, 256)),
                      Spans.single(s.remotes[0], offsets, np.full(2000, 256)), ticket)
        finish(s.tr, [h], timeout=5)
        assert s.state(0) == "T"
        assert np.array_equal(s.dst.numpy(), s.expected([(0, offsets, offsets, np.full(2000, 256))]))


@pytest.mark.gpu
@pytest.mark.ucx
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
