"""Tests of ``kvstage.layout`` against real torch tensors.

Offsets are checked by indexing a tensor filled with ``torch.arange`` (every
element unique) and by ``data_ptr`` arithmetic on tensors of the real dtype;
token positions are checked against a brute-force list of (page, slot) pairs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.layout import (
    DTYPE_SIZES,
    KVGeometry,
    PageLayout,
    buffer_shape,
    element_offsets,
    pages_needed,
    token_bytes,
    token_positions,
)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def test_dtype_sizes_match_torch():
    for name, size in DTYPE_SIZES.items():
        assert torch.empty((), dtype=torch_dtype(name)).element_size() == size, name


# --------------------------------------------------------------------------
# buffer_shape / token_bytes
# --------------------------------------------------------------------------


def test_buffer_shape_explicit():
    geo = KVGeometry(layers=32, kv_heads=8, head_dim=128)
    assert buffer_shape(geo, PageLayout(16, "nhd"), 4, 10) == (10, 16, 4, 128)
    assert buffer_shape(geo, PageLayout(16, "hnd"), 4, 10) == (10, 4, 16, 128)
    mla = KVGeometry(layers=61, kv_heads=1, head_dim=576, mla=True)
    assert buffer_shape(mla, PageLayout(64, "nhd"), 1, 3) == (3, 64, 576)
    # MLA is always stored as nhd with one head, whatever the order says.
    assert buffer_shape(mla, PageLayout(64, "hnd"), 1, 3) == (3, 64, 576)


def test_token_bytes_explicit():
    # Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16, K and V.
    geo = KVGeometry(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    assert token_bytes(geo, 8) == 131072
    assert token_bytes(geo, 2) == 32768  # one TP-4 rank
    # DeepSeek-like MLA: one 576-wide latent per layer.
    mla = KVGeometry(layers=61, kv_heads=1, head_dim=576, dtype="bfloat16", mla=True)
    assert token_bytes(mla, 1) == 61 * 576 * 2
    assert token_bytes(KVGeometry(1, 1, 1, dtype="float8_e4m3fn"), 1) == 2
    assert token_bytes(KVGeometry(3, 4, 5, dtype="float32"), 4) == 3 * 2 * 4 * 5 * 4


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 5),
    head_dim=st.integers(1, 9),
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    mla=st.booleans(),
    page_size=st.integers(1, 7),
    order=st.sampled_from(["nhd", "hnd"]),
    pages=st.integers(1, 5),
)
def test_token_bytes_matches_real_buffers(layers, heads, head_dim, dtype, mla, page_size, order, pages):
    if mla:
        heads = 1
    geo = KVGeometry(layers=layers, kv_heads=heads, head_dim=head_dim, dtype=dtype, mla=mla)
    page = PageLayout(page_size, order)
    shape = buffer_shape(geo, page, heads, pages)
    # Expected shape straight from the module docstring.
    if mla:
        assert shape == (pages, page_size, head_dim)
    elif order == "nhd":
        assert shape == (pages, page_size, heads, head_dim)
    else:
        assert shape == (pages, heads, page_size, head_dim)
    # A rank's whole cache: K and V per layer (or the one latent per layer).
    planes = 1 if mla else 2
    bufs = [torch.empty(shape, dtype=torch_dtype(dtype)) for _ in range(layers * planes)]
    total = sum(b.numel() * b.element_size() for b in bufs)
    assert total % (pages * page_size) == 0
    assert token_bytes(geo, heads) == total // (pages * page_size)
    assert geo.buffers == len(bufs)
    assert geo.head_bytes() == head_dim * torch.empty((), dtype=torch_dtype(dtype)).element_size()


# --------------------------------------------------------------------------
# pages_needed / token_positions
# --------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,page_size,want", [
    (0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (5, 1, 5), (1000, 64, 16),
])
def test_pages_needed_explicit(tokens, page_size, want):
    assert pages_needed(tokens, page_size) == want


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(0, 2000), page_size=st.integers(1, 300))
def test_pages_needed_brute(tokens, page_size):
    n = 0
    while n * page_size < tokens:
        n += 1
    assert pages_needed(tokens, page_size) == n


def slots_of(page_ids, page_size):
    """Brute force: the request's token slots, in order, as (page id, offset)."""
    return [(int(pid), o) for pid in page_ids for o in range(page_size)]


def test_token_positions_explicit():
    pages, offs = token_positions(np.array([7, 2, 9]), 4, 3, 6)
    assert pages.tolist() == [7, 2, 2, 2, 2, 9]
    assert offs.tolist() == [3, 0, 1, 2, 3, 0]
    pages, offs = token_positions([5], 8, 0, 0)
    assert pages.tolist() == [] and offs.tolist() == []


@st.composite
def request(draw, max_pages=6):
    page_size = draw(st.integers(1, 6))
    total_pages = draw(st.integers(1, 10))
    n = draw(st.integers(1, min(max_pages, total_pages)))
    page_ids = draw(st.permutations(list(range(total_pages))))[:n]
    start = draw(st.integers(0, n * page_size))
    count = draw(st.integers(0, n * page_size - start))
    return total_pages, page_size, page_ids, start, count


@settings(max_examples=300, deadline=None)
@given(request())
def test_token_positions_brute(req):
    _, page_size, page_ids, start, count = req
    pages, offs = token_positions(np.array(page_ids), page_size, start, count)
    want = slots_of(page_ids, page_size)[start:start + count]
    assert list(zip(pages.tolist(), offs.tolist())) == want
    assert pages.dtype == np.int64 and offs.dtype == np.int64


# --------------------------------------------------------------------------
# element_offsets against torch indexing
# --------------------------------------------------------------------------


def index_head(buf: torch.Tensor, mla: bool, order: str, p: int, o: int, h: int) -> torch.Tensor:
    """The head vector of (page p, slot o, head h), by plain tensor indexing."""
    if mla:
        assert h == 0
        return buf[p, o]
    if order == "nhd":
        return buf[p, o, h]
    return buf[p, h, o]


def check_offsets(geo, page, heads, total_pages, page_ids, start, count):
    shape = buffer_shape(geo, page, heads, total_pages)
    n = int(np.prod(shape))
    buf = torch.arange(n, dtype=torch.int64).reshape(shape)
    flat = buf.reshape(-1)
    real = torch.empty(shape, dtype=torch_dtype(geo.dtype))
    isz = real.element_size()
    slots = slots_of(page_ids, page.page_size)[start:start + count]
    pids, offs = token_positions(np.array(page_ids), page.page_size, start, count)
    for h in range(1 if geo.mla else heads):
        got = element_offsets(geo, page, heads, pids, offs, h)
        assert got.shape == (count,)
        for i, (p, o) in enumerate(slots):
            off = int(got[i])
            want = index_head(buf, geo.mla, page.order, p, o, h)
            assert want.shape == (geo.head_dim,)
            assert 0 <= off and off + geo.head_dim <= n
            assert int(flat[off]) == int(want[0]), (p, o, h, off)
            assert torch.equal(flat[off:off + geo.head_dim], want), (p, o, h, off)
            # Same answer by address arithmetic on a tensor of the real dtype.
            vec = index_head(real, geo.mla, page.order, p, o, h)
            assert vec.is_contiguous()
            assert vec.data_ptr() - real.data_ptr() == off * isz


@pytest.mark.parametrize("order", ["nhd", "hnd"])
def test_element_offsets_explicit(order):
    geo = KVGeometry(layers=1, kv_heads=4, head_dim=3, dtype="float16")
    page = PageLayout(2, order)
    # buffer [pages=3, ...]; tokens (page 2, slot 0) head 1 and (page 0, slot 1) head 1
    got = element_offsets(geo, page, 4, np.array([2, 0]), np.array([0, 1]), 1)
    if order == "nhd":  # [3, 2, 4, 3]: ((p*2 + o)*4 + h)*3
        assert got.tolist() == [((2 * 2 + 0) * 4 + 1) * 3, ((0 * 2 + 1) * 4 + 1) * 3]
    else:  # [3, 4, 2, 3]: ((p*4 + h)*2 + o)*3
        assert got.tolist() == [((2 * 4 + 1) * 2 + 0) * 3, ((0 * 4 + 1) * 2 + 1) * 3]
    check_offsets(geo, page, 4, 3, [2, 0, 1], 0, 6)


@pytest.mark.parametrize("order", ["nhd", "hnd"])
def test_element_offsets_mla(order):
    geo = KVGeometry(layers=2, kv_heads=1, head_dim=5, dtype="bfloat16", mla=True)
    page = PageLayout(3, order)
    got = element_offsets(geo, page, 1, np.array([1, 0]), np.array([2, 0]), 0)
    assert got.tolist() == [(1 * 3 + 2) * 5, 0]
    check_offsets(geo, page, 1, 4, [3, 1, 0], 2, 6)


@settings(max_examples=300, deadline=None)
@given(
    req=request(max_pages=4),
    heads=st.integers(1, 4),
    head_dim=st.integers(1, 6),
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    mla=st.booleans(),
    order=st.sampled_from(["nhd", "hnd"]),
)
def test_element_offsets_property(req, heads, head_dim, dtype, mla, order):
    total_pages, page_size, page_ids, start, count = req
    if mla:
        heads = 1
    geo = KVGeometry(layers=1, kv_heads=heads, head_dim=head_dim, dtype=dtype, mla=mla)
    check_offsets(geo, PageLayout(page_size, order), heads, total_pages, page_ids, start, count)


@settings(max_examples=100, deadline=None)
@given(req=request(), heads=st.integers(1, 4), head_dim=st.integers(1, 5),
       order=st.sampled_from(["nhd", "hnd"]), mla=st.booleans())
def test_gather_roundtrip(req, heads, head_dim, order, mla):
    """Scatter a request's tokens into its pages by tensor indexing, then gather
    them back through token_positions + element_offsets: same tokens, same order."""
    total_pages, page_size, page_ids, start, count = req
    if mla:
        heads = 1
    geo = KVGeometry(layers=1, kv_heads=heads, head_dim=head_dim, mla=mla)
    page = PageLayout(page_size, order)
    shape = buffer_shape(geo, page, heads, total_pages)
    buf = torch.full(shape, -1, dtype=torch.int64)
    slots = slots_of(page_ids, page_size)
    tokens = torch.arange(len(slots) * heads * head_dim, dtype=torch.int64).reshape(len(slots), heads, head_dim)
    for t, (p, o) in enumerate(slots):
        for h in range(heads):
            index_head(buf, mla, order, p, o, h).copy_(tokens[t, h])
    flat = buf.reshape(-1)
    pids, offs = token_positions(page_ids, page_size, start, count)
    for h in range(heads):
        eo = torch.from_numpy(element_offsets(geo, page, heads, pids, offs, h))
        idx = (eo[:, None] + torch.arange(head_dim)[None, :]).reshape(-1)
        got = flat[idx].reshape(count, head_dim)
        assert torch.equal(got, tokens[start:start + count, h])
