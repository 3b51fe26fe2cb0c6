"""The cma transport (``process_vm_readv``/``writev``) on its own: real processes, real system calls.

A write of any span list lands byte for byte before its notification; the
calls never pass ``IOV_MAX`` spans a side; a peer on another kernel, a region
the peer did not register (read or written), a peer that exited and a stream
that lies about its writer are refused, each saying why.
"""

import json
import logging
import socket
import struct
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.errors import TransportError
from support.transport_pair import transport_pair
from support import procs
from kvstage.transports.base import Region, Spans, WriteState
from kvstage.transports.cma import IOV_MAX, CmaTransport, _writev, plan_calls


def _wait(fn, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        time.sleep(0.0005)


@st.composite
def span_lists(draw):
    """Span pairs in two 64 KiB buffers: random lengths, sometimes touching (mergeable), sometimes not."""
    n = draw(st.integers(1, 4000))
    lengths = np.array(draw(st.lists(st.integers(1, 16), min_size=n, max_size=n)), dtype=np.int64)
    gaps = [np.array(draw(st.lists(st.sampled_from([0, 1, 5] if draw(st.booleans()) else [0, 0, 0, 1]), min_size=n, max_size=n)), dtype=np.int64)
            for _ in range(2)]
    offs = [np.cumsum(g + lengths) - lengths for g in gaps]
    return offs[0], offs[1], lengths


@settings(max_examples=60, deadline=None)
@given(span_lists())
def test_planned_calls_copy_every_span_and_respect_iov_max(spans):
    """Each planned call, run on this very process, moves span i of one buffer to span i of the other."""
    l_off, r_off, lengths = spans
    src = np.random.default_rng(len(lengths)).integers(0, 256, int(l_off[-1] + lengths[-1]), dtype=np.uint8)
    dst = np.zeros(int(r_off[-1] + lengths[-1]), dtype=np.uint8)
    calls = plan_calls(src.ctypes.data + l_off.astype(np.uint64), dst.ctypes.data + r_off.astype(np.uint64), lengths)
    assert sum(b for _, _, b in calls) == lengths.sum()
    import os

    for liov, riov, nbytes in calls:
        assert 1 <= len(liov) <= IOV_MAX and 1 <= len(riov) <= IOV_MAX
        assert liov[:, 1].sum() == riov[:, 1].sum() == nbytes
        assert _writev(os.getpid(), liov.ctypes.data, len(liov), riov.ctypes.data, len(riov), 0) == nbytes
    want = np.zeros_like(dst)
    for lo, ro, n in zip(l_off, r_off, lengths):
        want[ro : ro + n] = src[lo : lo + n]
    assert np.array_equal(dst, want)


def test_touching_spans_merge_into_one_iovec():
    rows = np.arange(0, 4096 * 3000, 4096, dtype=np.uint64)
    calls = plan_calls((1 << 20) + rows, (1 << 30) + rows, np.full(3000, 4096))
    assert [(len(a), len(b)) for a, b, _ in calls] == [(1, 1)]


def test_disjoint_spans_take_a_call_per_iov_max():
    rows = np.arange(0, 8192 * 3000, 8192, dtype=np.uint64)
    calls = plan_calls((1 << 20) + rows, (1 << 30) + rows // 2, np.full(3000, 4096))  # remote side touches
    assert [(len(a), len(b)) for a, b, _ in calls] == [(1024, 1), (1024, 1), (952, 1)]


def _receiver(conn, nbytes, expected_notes):
    """Child process: register a zeroed buffer, hand over metadata, report what landed when the notes came."""
    tr = CmaTransport("recv")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    region = tr.register(buf)
    conn.send((tr.metadata(), region.to_wire()))
    conn.recv()  # the writer is done (it holds back nothing: the writes ended in its calls)
    notes = []
    deadline = time.monotonic() + 30
    while len(notes) < expected_notes and time.monotonic() < deadline:
        notes += tr.notifications()
        time.sleep(0.0005)
    conn.send((notes, buf.numpy().tobytes()))
    conn.recv()
    tr.close()


def _child(nbytes, expected_notes):
    ctx = procs.CTX
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, nbytes, expected_notes))
    proc.start()
    return proc, parent


def test_two_processes_span_list_lands_byte_exact_with_its_notifications_in_order():
    """3,000 spans (several calls), then 40 more writes: more notifications queued than a datagram queue holds."""
    nbytes = 1 << 20
    proc, parent = _child(nbytes, 41)
    tr = CmaTransport("send")
    try:
        md, region = parent.recv()
        remote = Region.from_wire(region)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        local = tr.register(src)
        peer = tr.connect(md)
        rng = np.random.default_rng(7)
        r_off = np.sort(rng.choice(nbytes // 256, 3000, replace=False)) * 256  # disjoint 200-byte spans
        l_off = rng.permutation(r_off)
        lengths = np.full(3000, 200)
        h = tr.write(peer, Spans.single(local, l_off, lengths), Spans.single(remote, r_off, lengths), b"big")
        assert tr.poll(h) is WriteState.DONE
        tr.release(h)
        for i in range(40):  # each 8 bytes at the end of a 256-byte block, left alone by the big write
            tr.write(peer, Spans.single(local, [i * 8], [8]), Spans.single(remote, [i * 256 + 248], [8]), b"n%d" % i)
        parent.send("done")
        assert parent.poll(30), "receiver sent nothing back"
        notes, landed = parent.recv()
        assert notes == [(tr.id, b"big")] + [(tr.id, b"n%d" % i) for i in range(40)]
        want = np.zeros(nbytes, dtype=np.uint8)
        s = src.numpy()
        for lo, ro in zip(l_off, r_off):
            want[ro : ro + 200] = s[lo : lo + 200]
        for i in range(40):
            want[i * 256 + 248 : i * 256 + 256] = s[i * 8 : i * 8 + 8]
        assert np.array_equal(np.frombuffer(landed, dtype=np.uint8), want)  # nothing else touched
        parent.send("bye")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        tr.close()
        if proc.is_alive():
            proc.kill()


def test_a_write_to_a_peer_that_exited_says_so():
    proc, parent = _child(4096, 1)
    tr = CmaTransport("send")
    try:
        md, region = parent.recv()
        local = tr.register(torch.zeros(4096, dtype=torch.uint8))
        peer = tr.connect(md)
        proc.kill()
        proc.join(30)
        with pytest.raises(TransportError, match="has exited"):
            tr.write(peer, Spans.single(local, [0], [64]), Spans.single(Region.from_wire(region), [0], [64]), b"x")
    finally:
        tr.close()


@pytest.fixture
def pair():
    with transport_pair("cma", 1 << 14, 1 << 14) as p:
        yield p


def test_a_region_the_peer_did_not_register_is_refused(pair):
    a, b, peer, ra, rb, src, dst = pair
    before = src.clone()
    other = Region(rb.addr + rb.nbytes, 4096, "cpu", 0)  # next to it: the peer's memory, but not offered
    with pytest.raises(TransportError, match="not one the peer registered"):
        a.write(peer, Spans.single(ra, [0], [8]), Spans.single(other, [0], [8]), b"x")
    with pytest.raises(TransportError, match="read from .*not one the peer registered"):
        a.read(peer, Spans.single(ra, [0], [8]), Spans.single(other, [0], [8]))
    assert b.notifications() == [] and torch.equal(src, before)


def test_a_span_outside_the_writers_region_is_refused(pair):
    a, b, peer, ra, rb, src, dst = pair
    with pytest.raises(TransportError, match="outside its registered region"):
        a.write(peer, Spans.single(ra, [ra.nbytes - 4], [8]), Spans.single(rb, [0], [8]), b"x")


@pytest.mark.parametrize("key,what", [("boot_id", "kernel"), ("pid_ns", "PID namespace"),
                                      ("net_ns", "network namespace"), ("uid", "user")])
def test_a_peer_on_another_host_or_namespace_is_refused(key, what):
    a, b = CmaTransport("a"), CmaTransport("b")
    try:
        md = json.loads(b.metadata())
        md["host"][key] = "elsewhere"
        with pytest.raises(TransportError, match=f"another {what}.*use nixl or ucx"):
            a.connect(json.dumps(md).encode())
        with pytest.raises(TransportError, match="not this transport's"):
            a.connect(b"\x00nixl metadata")
    finally:
        a.close()
        b.close()


def test_a_stream_whose_id_names_another_process_is_dropped(pair, caplog):
    a, b, peer, ra, rb, src, dst = pair
    md = json.loads(b.metadata())
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(md["address"].encode("latin-1"))
    liar = b"kvstage-1-deadbeef"  # pid 1 is not this process
    s.sendall(struct.pack("!I", len(liar)) + liar + struct.pack("!I", 4) + b"fake")
    with caplog.at_level(logging.WARNING, logger="kvstage.transports.cma"):
        _wait(lambda: "does not name process" in caplog.text or b.notifications(), "the lie noticed", 5)
    assert "does not name process" in caplog.text
    a.write(peer, Spans.single(ra, [0], [4]), Spans.single(rb, [0], [4]), b"real")
    assert _wait(b.notifications, "the real one") == [(a.id, b"real")]
    s.close()


def test_a_strided_tensor_is_refused():
    tr = CmaTransport("a")
    try:
        with pytest.raises(TransportError, match="contiguous"):
            tr.register(torch.zeros(4, 4).t())
    finally:
        tr.close()


@pytest.mark.gpu
def test_device_memory_is_refused():
    tr = CmaTransport("a")
    try:
        with pytest.raises(TransportError, match="host memory only.*cuda"):
            tr.register(torch.zeros(16, device="cuda"))
    finally:
        tr.close()


def test_a_peer_is_checked_alive_even_past_select_s_descriptor_limit():
    """An engine process holds many files: the peer's pidfd then lies past 1,023."""
    import os

    a, b = CmaTransport("a"), CmaTransport("b")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.connect(b.metadata())
        assert a._peers[peer].pidfd > 1023
        a.write(peer, Spans.single(ra, [0], [64]), Spans.single(rb, [0], [64]), b"far")
        assert _wait(b.notifications, "notification") == [(a.id, b"far")] and torch.equal(dst, src)
    finally:
        for fd in held:
            os.close(fd)
        a.close()
        b.close()


@pytest.mark.parametrize("scope,says", [(None, False), (0, False), (1, True), (2, False)])
def test_only_yama_scope_1_makes_an_endpoint_open_itself_and_it_says_so(scope, says, monkeypatch, caplog):
    import kvstage.transports.cma as cma

    monkeypatch.setattr(cma, "_yama_scope", lambda: scope)
    with caplog.at_level(logging.INFO, logger="kvstage.transports.cma"):
        CmaTransport("a").close()
    assert ("ptrace_scope is 1" in caplog.text) == says


def test_no_call_moves_more_than_the_kernel_allows_in_one():
    """Linux moves at most 2 GiB - 4 KiB a call and reports the rest only as a short count."""
    from kvstage.transports.cma import MAX_CALL_BYTES

    lengths = np.array([3 * MAX_CALL_BYTES + 5, 100, MAX_CALL_BYTES - 50, 60])
    l_off = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64) + (1 << 40)
    r_off = l_off + (1 << 44)
    calls = plan_calls(l_off, r_off, lengths)
    # the long span in three full calls and its 5-byte tail; the next span would pass the cap after the 100
    assert [b for _, _, b in calls] == [MAX_CALL_BYTES] * 3 + [5 + 100, MAX_CALL_BYTES - 50, 60]
    (liov, riov, _) = calls[3]  # the tail and the 100 run on in memory on both sides: one iovec each
    assert len(liov) == len(riov) == 1 and liov[0, 0] == (1 << 40) + 3 * MAX_CALL_BYTES
    assert sum(int(l[:, 1].sum()) for l, _, _ in calls) == lengths.sum()
