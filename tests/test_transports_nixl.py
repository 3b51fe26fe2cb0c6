"""The NIXL transport on its own (two agents over UCX shared memory, no mocks):
a write prepared ahead moves nothing until posted, and a dropped one never does."""

import time

import torch

from kvstage.transports.base import Spans, WriteState
from kvstage.transports.nixl import NixlTransport


def _pair():
    a, b = NixlTransport("prep-a"), NixlTransport("prep-b")
    src, dst = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8), torch.zeros(1 << 18, dtype=torch.uint8)
    local, remote = a.register(src), b.register(dst)
    return a, b, src, dst, local, remote, a.connect(b.metadata())


def _finish(a, b, h, timeout=10.0) -> list:
    """Progress both agents until the write is done and its notice arrived; the notices."""
    deadline, got = time.monotonic() + timeout, []
    while True:
        state = a.poll(h)
        got += b.notifications()
        if state is WriteState.DONE and got:
            return got
        assert time.monotonic() < deadline, "write not finished"


def test_a_prepared_write_moves_nothing_until_posted():
    a, b, src, dst, local, remote, peer = _pair()
    try:
        n = 1 << 16
        ready = a.prepare_write(peer, Spans.single(local, [0], [n]), Spans.single(remote, [4096], [n]), b"chunk 0")
        time.sleep(0.2)
        assert not dst.any() and not b.notifications()
        h = ready.post()
        assert _finish(a, b, h) == [(a.id, b"chunk 0")]
        a.release(h)
        assert torch.equal(dst[4096 : 4096 + n], src[:n]) and not dst[:4096].any() and not dst[4096 + n :].any()

        dropped = a.prepare_write(peer, Spans.single(local, [0], [n]), Spans.single(remote, [n + 8192], [n]), b"never")
        dropped.drop()
        time.sleep(0.2)
        assert not b.notifications() and not dst[n + 8192 :].any()
    finally:
        a.close()
        b.close()
