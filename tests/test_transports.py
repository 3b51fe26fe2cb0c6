"""The transport contract (``transports.base.Transport``), one suite over every
transport: nixl, ucx and cma, real endpoints in real processes, no mocks.

What each must do: land every span of a read or a write byte for byte, and
nothing else; hand the peer a write's notification only after its bytes are
there; refuse spans that do not pair up or lie outside what the peer
registered, before anything moves; complete a read while the source's process
is stopped; fail or complete a read of a killed source in bounded time, never
hang; move nothing for a prepared write until it is posted, and nothing ever
for a dropped one; refuse another transport's metadata. Behaviour only one
transport has (UCX tickets, cma's call planning, namespaces) is in that
transport's own test file.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from kvstage.errors import TransportError
from kvstage.transports import make_transport
from kvstage.transports.base import Region, Spans, WriteState
from support.read_sources import ReadSources, finish, random_spans
from support.marks import TRANSPORTS, needs, over
from support import procs
from support.transport_pair import finish_write, transport_pair

#: one case per transport, each carrying what its transport needs
EACH = [over(t) for t in TRANSPORTS]


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


@pytest.mark.parametrize("transport", EACH)
def test_a_multi_span_write_between_two_processes_lands_byte_exact_before_its_notification(transport):
    nbytes = 8 << 20
    ctx = procs.CTX
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


@pytest.fixture(params=EACH)
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


@pytest.mark.parametrize("transport,other", [pytest.param(t, o, marks=needs(t, o)) for t in TRANSPORTS for o in TRANSPORTS
                                             if t != o])
def test_metadata_of_another_transport_is_refused(transport, other):
    mine, theirs = make_transport(transport, "mine"), make_transport(other, "theirs")
    try:
        with pytest.raises(TransportError):
            mine.connect(theirs.metadata())
    finally:
        mine.close()
        theirs.close()


# -- reads ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=EACH)
def sources(request):
    """A reader and three live sources in their own processes, 1 MiB of known bytes each."""
    with ReadSources(request.param, 3, 1 << 20, 8 << 20) as s:
        yield s


def test_one_span_and_thousands_of_random_spans_are_read_byte_exact(sources):
    s = sources
    s.clear()
    h = s.read(0, [777], [12345], [300000])
    finish(s.tr, [h])
    s.tr.release(h)
    want = np.zeros(len(s.dst), dtype=np.uint8)
    want[777 : 777 + 300000] = s.data[0][12345 : 12345 + 300000]
    assert np.array_equal(s.dst.numpy(), want)

    s.clear()
    local, remote, lengths = random_spans(np.random.default_rng(1), 3000, s.peer_bytes, len(s.dst))
    h = s.read(0, local, remote, lengths)  # the local spans in another order than the remote ones
    finish(s.tr, [h])
    s.tr.release(h)
    assert np.array_equal(s.dst.numpy(), s.expected([(0, local, remote, lengths)]))


def test_reads_of_several_sources_at_once_each_land_where_they_say(sources):
    s = sources
    s.clear()
    rng = np.random.default_rng(2)
    third = len(s.dst) // 3
    plans = []
    for i in range(3):
        local, remote, lengths = random_spans(rng, 500, s.peer_bytes, third)
        plans.append((i, local + i * third, remote, lengths))
    handles = [s.read(i, local, remote, lengths) for i, local, remote, lengths in plans]  # all posted first
    finish(s.tr, handles)
    for h in handles:
        s.tr.release(h)
    assert np.array_equal(s.dst.numpy(), s.expected(plans))


def test_a_read_outside_the_sources_registered_region_is_refused_before_anything_moves(sources):
    s = sources
    s.clear()
    ticket = b"" if s.tr.one_sided else bytes(12)  # spans are checked before any ticket
    with pytest.raises(TransportError, match="outside its registered region"):
        beyond = Spans.single(s.remotes[0], [s.peer_bytes - 100], [200])
        s.tr.read(s.peers[0], Spans.single(s.region, [0], [200]), beyond, ticket)
    if s.tr.one_sided:  # a two-sided read lands what the source offered, wherever the reader thinks it is
        past = Region(s.remotes[0].addr + s.remotes[0].nbytes, 1 << 20, "cpu", 0)  # the next bytes of its memory
        with pytest.raises(TransportError):
            s.tr.read(s.peers[0], Spans.single(s.region, [0], [64]), Spans.single(past, [0], [64]))
    time.sleep(0.1)
    s.tr.notifications()
    assert not s.dst.any()


def test_abandoning_a_finished_read_says_nothing_more_can_land(sources):
    s = sources
    s.clear()
    h = s.read(1, [0], [0], [4096])
    finish(s.tr, [h])
    assert s.tr.abandon(h) is True
    s.tr.release(h)
    assert np.array_equal(s.dst.numpy()[:4096], s.data[1][:4096])


@pytest.mark.parametrize("transport", EACH)
def test_a_read_completes_while_the_source_is_stopped(transport):
    """The source makes its bytes available (a ucx source offers them) and stops itself (SIGSTOP):
    the reader completes alone; once the source runs again its offer completes too."""
    with ReadSources(transport, 1, 8 << 20, 8 << 20) as s:
        s.ask(0, "run", 1.0)  # both endpoints have run, but no byte has moved between them yet

        rng = np.random.default_rng(3)
        local, remote, lengths = random_spans(rng, 300, 4 << 20, 4 << 20)
        local = np.concatenate(([4 << 20], local))  # one big span and 300 small ones
        remote = np.concatenate(([4 << 20], remote))
        lengths = np.concatenate(([4 << 20], lengths))
        ticket = s.offer(0, remote, lengths, then_stop=True)
        s.wait_stopped(0)
        h = s.tr.read(s.peers[0], Spans.single(s.region, local, lengths), Spans.single(s.remotes[0], remote, lengths),
                      ticket)
        elapsed = finish(s.tr, [h], timeout=5)
        s.tr.release(h)
        assert s.state(0) == "T", "the source ran during the read"
        assert np.array_equal(s.dst.numpy(), s.expected([(0, local, remote, lengths)])), f"after {elapsed:.3f} s"
        os.kill(s.procs[0].pid, signal.SIGCONT)
        assert s.ask(0, "offers") is True  # a ucx source's sends complete once it runs and hears the reader took them


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("transport", EACH)
def test_a_read_of_a_killed_source_fails_or_completes_in_bounded_time(transport, when):
    nbytes = 128 << 20
    with ReadSources(transport, 1, nbytes, nbytes) as s:
        s.warm_up(0)
        s.clear()
        ticket = s.offer(0, [0], [nbytes])
        kill = lambda: (s.procs[0].kill(), s.procs[0].join(10))  # noqa: E731
        if when == "before":
            kill()
            h = s.tr.read(s.peers[0], Spans.single(s.region, [0], [nbytes]), Spans.single(s.remotes[0], [0], [nbytes]),
                          ticket)
        else:  # cma copies inside read(): the kill has to come from beside it
            killer = threading.Timer(0.002, kill)
            killer.start()
            h = s.tr.read(s.peers[0], Spans.single(s.region, [0], [nbytes]), Spans.single(s.remotes[0], [0], [nbytes]),
                          ticket)
            killer.join()
        t0 = time.monotonic()
        try:
            finish(s.tr, [h], timeout=5)
            assert np.array_equal(s.dst.numpy(), s.data[0])  # done means every byte
        except TransportError:
            pass  # failed: said so, in bounded time
        assert time.monotonic() - t0 < 5
        assert s.tr.abandon(h) is True  # over either way: nothing more can land
        s.tr.release(h)
