"""The transport contract (``transports.base.Transport``), one suite over every
transport: nixl, ucx and cma, real endpoints in real processes, no mocks.

What each must do: land every span of a write byte for byte, and nothing else;
hand the peer the write's notification only after its bytes are there; refuse
spans that do not pair up; move nothing for a prepared write until it is
posted, and nothing ever for a dropped one; refuse another transport's
metadata. Behaviour only one transport has (UCX tickets, cma's call planning,
namespaces) is in that transport's own test file.
"""

import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from kvstage.errors import TransportError
from kvstage.transports import make_transport
from kvstage.transports.base import Region, Spans, WriteState
from support.transport_pair import finish_write, transport_pair

TRANSPORTS = ["nixl", "ucx", "cma"]


def _receiver(name: str, conn, nbytes: int) -> None:
    """Child process: register a zeroed buffer, expect the spans the parent names, and send back
    the buffer as it was when the notification arrived."""
    tr = make_transport(name, "recv")
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
    conn.send((notes, buf.numpy().tobytes()))
    conn.recv()
    tr.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_multi_span_write_between_two_processes_lands_byte_exact_before_its_notification(transport):
    nbytes = 8 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(transport, child, nbytes))
    proc.start()
    tr = make_transport(transport, "send")
    try:
        md, region = parent.recv()
        remote = Region.from_wire(region)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        local = tr.register(src)
        peer = tr.connect(md)
        # spans of several sizes, the big one well past any eager threshold, at offsets that differ per side
        r_off, lengths = [0, 4096, 1 << 20, 7 << 20], [1, 3000, 5 << 20, 4096]
        l_off = [nbytes - 1, 100, 2 << 20, 0]
        parent.send((tr.id, r_off, lengths))
        ticket = parent.recv()
        h = tr.write(peer, Spans.single(local, l_off, lengths), Spans.single(remote, r_off, lengths), b"chunk-7", ticket)
        deadline = time.monotonic() + 20
        while tr.poll(h) is not WriteState.DONE:
            assert time.monotonic() < deadline, "write not complete"
        tr.release(h)
        assert parent.poll(30), "receiver sent nothing back"
        notes, landed = parent.recv()
        assert notes == [(tr.id, b"chunk-7")]
        want = np.zeros(nbytes, dtype=np.uint8)
        for lo, ro, n in zip(l_off, r_off, lengths):
            want[ro : ro + n] = src.numpy()[lo : lo + n]
        assert np.array_equal(np.frombuffer(landed, dtype=np.uint8), want)  # every span, nothing else
        parent.send("bye")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        tr.close()
        if proc.is_alive():
            proc.kill()


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    with transport_pair(request.param, 1 << 16, 1 << 17) as p:
        yield p


def test_writes_in_one_process_land_where_they_say(pair):
    a, b, peer, ra, rb, src, dst = pair
    for note, l_off, r_off, n in ((b"one", [0, 100], [5000, 6000], [10, 20]), (b"two", [4096], [60000], [8192])):
        remote = Spans.single(rb, r_off, n)
        h = a.write(peer, Spans.single(ra, l_off, n), remote, note, b.expect(a.id, remote))
        assert finish_write(a, b, h) == [(a.id, note)]
        a.release(h)
    want = torch.zeros_like(dst)
    want[5000:5010], want[6000:6020], want[60000:68192] = src[:10], src[100:120], src[4096:12288]
    assert torch.equal(dst, want)


def test_spans_that_do_not_pair_up_are_refused(pair):
    a, b, peer, ra, rb, src, dst = pair
    remote = Spans.single(rb, [0], [9])
    with pytest.raises(TransportError, match="differ in count or lengths"):
        a.write(peer, Spans.single(ra, [0], [8]), remote, b"x", b.expect(a.id, remote))
    time.sleep(0.1)
    assert b.notifications() == [] and not dst.any()


def test_a_prepared_write_moves_nothing_until_posted_and_a_dropped_one_never(pair):
    a, b, peer, ra, rb, src, dst = pair
    n = 1 << 14
    remote = Spans.single(rb, [4096], [n])
    ready = a.prepare_write(peer, Spans.single(ra, [0], [n]), remote, b"chunk 0", b.expect(a.id, remote))
    time.sleep(0.2)
    assert not dst.any() and not b.notifications()
    h = ready.post()
    assert finish_write(a, b, h) == [(a.id, b"chunk 0")]
    a.release(h)
    assert torch.equal(dst[4096 : 4096 + n], src[:n]) and not dst[:4096].any() and not dst[4096 + n :].any()

    later = Spans.single(rb, [n + 8192], [n])
    dropped = a.prepare_write(peer, Spans.single(ra, [0], [n]), later, b"never", b.expect(a.id, later))
    dropped.drop()
    time.sleep(0.2)
    assert not b.notifications() and not dst[n + 8192 :].any()


@pytest.mark.parametrize("transport,other", [(t, o) for t in TRANSPORTS for o in TRANSPORTS if t != o])
def test_metadata_of_another_transport_is_refused(transport, other):
    mine, theirs = make_transport(transport, "mine"), make_transport(other, "theirs")
    try:
        with pytest.raises(TransportError):
            mine.connect(theirs.metadata())
    finally:
        mine.close()
        theirs.close()
