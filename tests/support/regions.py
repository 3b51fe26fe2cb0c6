"""An independent reference for staging regions: the bytes a region of pieces must hold,
and the cache a scatter must leave, built with plain loops from the region rule written
out in ``staging.region``'s docstring, never with the code under test (no copier, no
span list, no ``layout`` addressing): a cache buffer is indexed as the numpy array it is.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstage.staging.region import Order


def random_bytes(cache, seed: int) -> None:
    """Fill every buffer of ``cache`` with random bytes (any device)."""
    g = torch.Generator().manual_seed(seed)
    for b in cache.buffers:
        raw = b.view(torch.uint8).view(-1)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))


def host_buffers(cache) -> list[np.ndarray]:
    """Each buffer's bytes on the host as ``[pages, page_size, heads, head_bytes]`` (token-major
    pages and MLA) or ``[pages, heads, page_size, head_bytes]`` (HND): a copy."""
    spec = cache.spec
    geo, page = spec.geometry, spec.page
    heads = 1 if geo.mla else spec.local_heads()
    hb = geo.head_bytes()
    out = []
    for b in cache.buffers:
        raw = b.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1).copy()
        if geo.mla or page.order == "nhd":
            out.append(raw.reshape(-1, page.page_size, heads, hb))
        else:
            out.append(raw.reshape(-1, heads, page.page_size, hb))
    return out


def _head(spec, buf: np.ndarray, page_ids, token: int, head: int) -> np.ndarray:
    """The bytes of local ``head`` of request token ``token`` in ``buf`` (a view)."""
    P = spec.page.page_size
    p, o = int(page_ids[token // P]), token % P
    if spec.geometry.mla or spec.page.order == "nhd":
        return buf[p, o, head]
    return buf[p, head, o]


def _region_at(piece, bi: int, r: int, j: int, count: int, hb: int) -> int:
    """The region byte of head ``j`` of row position ``r`` of the piece's buffer ``bi``."""
    nb, R = len(piece.buffers), count if piece.rows is None else piece.rows
    if piece.order is Order.HEADS:
        return piece.offset + ((j * nb + bi) * R + r) * hb
    return piece.offset + ((bi * R + r) * piece.heads + j) * hb


def expected_region(spec, buffers: list[np.ndarray], page_ids, start: int, count: int, pieces,
                    region: np.ndarray) -> np.ndarray:
    """``region`` (bytes, copied) with every piece of tokens ``start .. start+count`` gathered
    from ``buffers`` (``host_buffers``) into it; every other byte as it was."""
    out = np.array(region, dtype=np.uint8, copy=True)
    hb = spec.geometry.head_bytes()
    for piece in pieces:
        for bi, b in enumerate(piece.buffers):
            for t in range(count):
                for j in range(piece.heads):
                    at = _region_at(piece, bi, piece.row_first + t, j, count, hb)
                    out[at : at + hb] = _head(spec, buffers[b], page_ids, start + t, piece.head_lo + j)
    return out


def expected_cache(spec, buffers: list[np.ndarray], page_ids, start: int, count: int, pieces,
                   region: np.ndarray) -> list[np.ndarray]:
    """``buffers`` (copied) with every piece of tokens ``start .. start+count`` scattered from
    ``region`` into them; every other byte as it was."""
    out = [b.copy() for b in buffers]
    hb = spec.geometry.head_bytes()
    region = np.asarray(region, dtype=np.uint8)
    for piece in pieces:
        for bi, b in enumerate(piece.buffers):
            for t in range(count):
                for j in range(piece.heads):
                    at = _region_at(piece, bi, piece.row_first + t, j, count, hb)
                    _head(spec, out[b], page_ids, start + t, piece.head_lo + j)[:] = region[at : at + hb]
    return out


def same_buffers(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
