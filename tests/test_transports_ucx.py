"""The UCX transport (UCXX, two-sided) on its own: real UCX workers, no mocks.

Receives are posted by ``expect``; a write needs the ticket it returned; a
notification is handed out only after every byte of its write landed.
"""

import logging
import multiprocessing as mp
import struct
import time

import numpy as np
import pytest
import torch

from kvstage.config import Settings
from kvstage.errors import ConfigError, TransferFailed, TransportError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.destination import Destination
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec
from kvstage.transports.base import Region, Spans, WriteState
from kvstage.transports.ucx import UcxTransport


def _wait(fn, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        time.sleep(0.0005)


def _both(a, b, h, timeout=20.0):
    """Progress writer ``a`` and receiver ``b`` (one thread: two-sided needs both) until the write
    is done and its notification arrived; return the notifications."""
    notes, done = [], False
    deadline = time.monotonic() + timeout
    while not (done and notes):
        done = done or a.poll(h) is WriteState.DONE
        notes += b.notifications()
        assert time.monotonic() < deadline, f"write done={done}, notifications={notes} after {timeout} s"
    return notes


def _receiver(conn, nbytes):
    """Child process: register a zeroed buffer, expect the spans the parent names, report what landed."""
    tr = UcxTransport("recv")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    region = tr.register(buf)
    conn.send((tr.metadata(), region.to_wire()))
    writer, offsets, lengths = conn.recv()
    conn.send(tr.expect(writer, Spans.single(region, offsets, lengths)))
    notes = []
    deadline = time.monotonic() + 30
    while not notes and time.monotonic() < deadline:
        notes = tr.notifications()
        time.sleep(0.0005)
    conn.send((notes, buf.numpy().tobytes()))  # the buffer as it was when the notification came
    conn.recv()
    tr.close()


def test_two_processes_multi_span_write_lands_byte_exact_before_its_notification():
    nbytes = 8 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, nbytes))
    proc.start()
    tr = UcxTransport("send")
    try:
        md, region = parent.recv()
        remote_region = Region.from_wire(region)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        local_region = tr.register(src)
        peer = tr.connect(md)
        # spans of several sizes, the big one well past any eager threshold, at offsets that differ per side
        r_off, lengths = [0, 4096, 1 << 20, 7 << 20], [1, 3000, 5 << 20, 4096]
        l_off = [nbytes - 1, 100, 2 << 20, 0]
        parent.send((tr.id, r_off, lengths))
        ticket = parent.recv()
        h = tr.write(peer, Spans.single(local_region, l_off, lengths), Spans.single(remote_region, r_off, lengths),
                     b"chunk-7", ticket)
        _wait(lambda: tr.poll(h) is WriteState.DONE, "write completion")
        tr.release(h)
        assert parent.poll(30), "receiver sent nothing back"
        notes, landed = parent.recv()
        assert notes == [(tr.id, b"chunk-7")]
        got = np.frombuffer(landed, dtype=np.uint8)
        want = np.zeros(nbytes, dtype=np.uint8)
        s = src.numpy()
        for lo, ro, n in zip(l_off, r_off, lengths):
            want[ro : ro + n] = s[lo : lo + n]
        assert np.array_equal(got, want)  # every span landed, nothing else was touched
        parent.send("bye")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        tr.close()
        if proc.is_alive():
            proc.kill()


@pytest.fixture
def pair():
    a, b = UcxTransport("a"), UcxTransport("b")
    src = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros(1 << 18, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())
    yield a, b, peer, ra, rb, src, dst
    a.close()
    b.close()


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
        got = _both(a, b, h)
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
    assert _both(a, b, h) == [(a.id, b"tiny")]
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


def test_metadata_of_another_transport_is_refused_by_name():
    from kvstage.transports.nixl import NixlTransport

    n, u = NixlTransport("n"), UcxTransport("u")
    try:
        with pytest.raises(TransportError, match="transport=nixl"):
            u.connect(n.metadata())
    finally:
        u.close()
        n.close()


def test_settings_pick_the_transport_and_ucx_has_no_direct_path(monkeypatch):
    assert Settings().transport == "nixl" and Settings().direct is True
    s = Settings(transport="ucx")
    assert s.direct is False
    with pytest.raises(ConfigError, match=r"direct=True with transport='ucx'.*two-sided"):
        Settings(transport="ucx", direct=True)
    with pytest.raises(ConfigError, match=r"transport='tcp': must be one of nixl, ucx"):
        Settings(transport="tcp")
    monkeypatch.setenv("KVSTAGE_TRANSPORT", "ucx")
    assert Settings().transport == "ucx" and Settings().direct is False
    monkeypatch.setenv("KVSTAGE_DIRECT", "1")
    with pytest.raises(ConfigError, match="KVSTAGE_DIRECT=0"):
        Settings()


GEO = KVGeometry(2, 4, 16, "bfloat16")


def test_endpoints_on_different_transports_refuse_each_other_by_name():
    spec = SideSpec(GEO, 1, PageLayout(4))
    dst = Destination(RankCache.allocate(spec, 0, 8), Settings(arena_mb=0.25, slot_mb=0.0625))
    src = Source(RankCache.allocate(spec, 0, 8), Settings(arena_mb=0.25, slot_mb=0.0625, transport="ucx"))
    try:
        with pytest.raises(TransferFailed, match="transport: the source uses 'ucx', this side 'nixl'"):
            src.connect([dst.address])
    finally:
        src.close()
        dst.close()


def test_a_ucx_endpoint_refuses_direct_true():
    spec = SideSpec(GEO, 1, PageLayout(4))
    with pytest.raises(ConfigError, match="two-sided and has no direct path"):
        Destination(RankCache.allocate(spec, 0, 8), Settings(arena_mb=0.25, slot_mb=0.0625), transport=UcxTransport("x"))


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
        assert _both(a, b, h) == [(a.id, b"gpu")]
        assert torch.equal(dst[:4096], src[1 << 20 : (1 << 20) + 4096])
        assert torch.equal(dst[32 << 20 : 48 << 20], src[8 << 20 : 24 << 20])
        assert int(dst[4096 : 32 << 20].count_nonzero()) == 0
    finally:
        a.close()
        b.close()
