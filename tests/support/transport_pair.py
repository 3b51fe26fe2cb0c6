"""Two endpoints of one transport in this process: a writer connected to a receiver."""

from __future__ import annotations

import contextlib

import torch

from kvstage.transports import make_transport


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
