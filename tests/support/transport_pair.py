"""Two endpoints of one transport in this process: a writer connected to a receiver, and
progressing a write between them."""

from __future__ import annotations

import contextlib
import time

import torch

from kvstage.transports import make_transport
from kvstage.transports.base import WriteState


@contextlib.contextmanager
def transport_pair(name: str, src_bytes: int, dst_bytes: int):
    """Yields ``(a, b, peer, ra, rb, src, dst)``: writer ``a`` connected to receiver ``b`` (its id
    ``peer``), ``src`` (counting bytes) registered at ``a`` as ``ra``, ``dst`` (zeros) at ``b`` as ``rb``."""
    a, b = make_transport(name, "a"), make_transport(name, "b")
    try:
        src = torch.arange(src_bytes // 4, dtype=torch.int32).view(torch.uint8)
        dst = torch.zeros(dst_bytes, dtype=torch.uint8)
        ra, rb = a.register(src), b.register(dst)
        yield a, b, a.connect(b.metadata()), ra, rb, src, dst
    finally:
        a.close()
        b.close()


def finish_write(a, b, h, timeout: float = 20.0) -> list:
    """Progress writer ``a`` and receiver ``b`` from one thread (a two-sided transport needs both)
    until write ``h`` is done and its notification arrived; the notifications."""
    notes, done = [], False
    deadline = time.monotonic() + timeout
    while not (done and notes):
        done = done or a.poll(h) is WriteState.DONE
        notes += b.notifications()
        assert time.monotonic() < deadline, f"write done={done}, notifications={notes} after {timeout} s"
    return notes
