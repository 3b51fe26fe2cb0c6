"""Direct page writes on the host: the kernel's addressing (``placement.byte_offsets``,
the numpy twin of ``cuda_place``) moves every plan shape's bytes exactly where the
destination's shard wants them, and nowhere else; the checks a grant passes first."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.placed import CASES, case_plan, chunks, grant_pages, make_caches, place_on_host
from kvstage.errors import ProtocolError
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.staging.placement import (WORD, buffer_pages, byte_offsets, check_piece, check_write, chunk_span,
                                       page_bytes, refusal)
from kvstage.staging.words import divide, divider
from kvstage.tp import HeadRange, Piece, SideSpec, plan


@pytest.mark.parametrize("name", list(CASES))
def test_every_plan_shape_lands_byte_for_byte_through_the_kernels_addressing(name):
    c = make_caches(case_plan(name))
    for start, count in chunks():
        place_on_host(c, start, count)
    assert c.check() == []


def test_the_check_sees_a_chunk_left_out():
    """The comparison above can fail: one chunk not moved leaves its tokens zero."""
    c = make_caches(case_plan("4->6 12 heads"))
    for start, count in chunks()[1:]:
        place_on_host(c, start, count)
    assert any("tokens differ" in e for e in c.check())


def _spec(kv_heads, tp, page, order, head_dim=16, mla=False):
    geo = KVGeometry(2, 1, head_dim, "bfloat16", True) if mla else KVGeometry(2, kv_heads, head_dim, "bfloat16")
    return SideSpec(geo, tp, PageLayout(page, order))


@st.composite
def _pairs(draw):
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8, 12]))
    sizes = [t for t in (1, 2, 3, 4, 6, 8, 12, 16, 24) if mla or heads % t == 0 or t % heads == 0]
    head_dim = draw(st.sampled_from([8, 16, 24]))  # 16, 32 and 48 bytes: one to three words
    sides = []
    for _ in range(2):
        sides.append(_spec(heads, draw(st.sampled_from(sizes)), draw(st.sampled_from([1, 2, 4, 16])),
                           "nhd" if mla else draw(st.sampled_from(["nhd", "hnd"])), head_dim, mla))
    return plan(*sides)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=_pairs(), tokens=st.integers(1, 70), chunk=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_any_valid_pair_lands_byte_for_byte(p, tokens, chunk, seed):
    c = make_caches(p, seed=seed, tokens=tokens)
    for start, count in chunks(tokens, chunk):
        place_on_host(c, start, count)
    assert c.check() == []


@settings(max_examples=60, deadline=None)
@given(p=_pairs(), data=st.data())
def test_an_accepted_grant_writes_only_inside_the_destination_and_each_slot_once(p, data):
    """Whatever page ids and tokens a grant names, once ``check_write`` accepts them every
    store lies inside the destination's buffer, and no two stores hit the same word."""
    piece = data.draw(st.sampled_from(p.pieces))
    dst_pages = data.draw(st.integers(1, 12))
    start = data.draw(st.integers(0, 200))
    count = data.draw(st.integers(1, 60))
    first, span = chunk_span(p.dst.page.page_size, start, count)
    ids = data.draw(st.lists(st.integers(0, dst_pages - 1), min_size=span, max_size=span, unique=span <= dst_pages))
    src_ids = np.arange(pages_needed(start + count, p.src.page.page_size))
    buffer, s, d = byte_offsets(p.src, p.dst, piece, src_ids, ids, start, count, dst_pages)
    assert len(d) == p.geometry.buffers * count * piece.heads.count * p.geometry.head_bytes() // WORD
    assert d.min() >= 0 and d.max() + WORD <= dst_pages * page_bytes(p.dst)
    assert s.min() >= 0 and s.max() + WORD <= len(src_ids) * page_bytes(p.src)
    if len(set(ids)) == len(ids):  # distinct pages: distinct slots
        assert len(np.unique(np.stack([buffer, d]), axis=1)[0]) == len(d)


def _piece(n=2, src=0, dst=0):
    return Piece(0, 0, HeadRange(src, src + n), src, dst)


def test_check_write_refuses_a_grant_that_would_reach_outside_the_destination():
    dst = _spec(8, 1, 4, "nhd")
    ok = check_write(dst, [3, 0, 9], 10, 5, 10, 2)  # tokens 5..15 at page size 4: pages 1, 2, 3 of the request
    assert ok.dtype == np.int64 and list(ok) == [3, 0, 9]
    cases = [
        (([3, 0, 10], 10, 5, 10), r"must lie in \[0, 10\); got 0\.\.10"),
        (([3, -1, 9], 10, 5, 10), r"must lie in \[0, 10\); got -1\.\.9"),
        (([3, 0], 10, 5, 10), "2 destination page ids for tokens 5..15; they span 3 pages of 4"),
        (([3, 0, 9, 1], 10, 5, 10), "4 destination page ids"),
        (([], 10, 5, 10), "0 destination page ids"),
        (([3, 0, 9], 10, -1, 10), "start must be >= 0"),
        (([3, 0, 9], 10, 5, 0), "count >= 1"),
        (([3, 0, 9], 10, 5.0, 10), "must be integers"),
        (([3, 0, 9], 10, True, 10), "must be integers"),
        (([3, "0", 9], 10, 5, 10), "a list of integers"),
        (([3.0, 0, 9], 10, 5, 10), "a list of integers"),
        (([[3], [0, 1], 9], 10, 5, 10), "a list of integers"),
        (([True, False, True], 10, 5, 10), "a list of integers"),
        (([2**70, 0, 9], 10, 5, 10), "a list of integers|must lie in"),
    ]
    for (ids, pages, start, count), match in cases:
        with pytest.raises(ProtocolError, match=match):
            check_write(dst, ids, pages, start, count, 2)
    wide = SideSpec(KVGeometry(2, 1, 2048, "float32", True), 1, PageLayout(1))  # 512 words a token
    with pytest.raises(ProtocolError, match="32-bit index"):
        check_write(wide, np.arange(1 << 22), 1 << 22, 0, 1 << 22, 1)


def test_pieces_and_pairs_the_path_cannot_take_are_refused():
    src, dst = _spec(8, 2, 16, "nhd"), _spec(8, 4, 1, "hnd")
    check_piece(src, dst, _piece(2, 2, 0))
    with pytest.raises(ValueError, match="destination heads 1..3 past its 2 local heads"):
        check_piece(src, dst, _piece(2, 2, 1))
    with pytest.raises(ValueError, match="source heads 3..5 past its 4"):
        check_piece(src, dst, _piece(2, 3, 0))
    assert refusal(src, dst) is None
    assert "head_dim differs" in refusal(src, _spec(8, 4, 1, "hnd", head_dim=32))
    eight_bytes = SideSpec(KVGeometry(2, 8, 4, "float16"), 2, PageLayout(16))
    assert "8 bytes (head_dim=4 of float16), not a whole number of 16-byte words" in refusal(eight_bytes, eight_bytes)


def test_buffer_pages_checks_the_destinations_buffers_against_its_spec():
    dst = _spec(8, 2, 4, "hnd")  # 4 heads of 32 bytes, 4 tokens a page: 512 bytes
    assert page_bytes(dst) == 512
    assert buffer_pages(dst, [(4096 * i, 512 * 7) for i in range(4)]) == 7
    with pytest.raises(ValueError, match="3 buffers; need layers\\*planes = 2\\*2 = 4"):
        buffer_pages(dst, [(0, 512)] * 3)
    with pytest.raises(ValueError, match="the same whole number of 512-byte pages"):
        buffer_pages(dst, [(0, 512), (4096, 1024), (8192, 512), (12288, 512)])
    with pytest.raises(ValueError, match="the same whole number"):
        buffer_pages(dst, [(0, 500)] * 4)
    with pytest.raises(ValueError, match="buffer 2 at 0x2008 is not on a 16-byte boundary"):
        buffer_pages(dst, [(0, 512), (4096, 512), (8200, 512), (12288, 512)])


def test_grant_pages_in_the_helpers_are_the_chunks_own():
    c = make_caches(case_plan("1->1 nhd16->hnd1"))
    assert list(grant_pages(c, 0, 5, 3)) == list(c.dst_ids[0][5:8])  # page size 1: one page a token


def test_the_kernels_division_by_multiply_and_shift_is_exact():
    """``words.divider``: the kernel divides by each run-time divisor with a multiply and a
    shift; exact for every divisor and every 32-bit numerator it can meet."""
    rng = np.random.default_rng(8)
    divisors = list(range(1, 1025)) + [int(d) for d in rng.integers(1025, 2**31, 1000)] + [2**31 - 1, 2**30, 3 << 20]
    edges = np.array([0, 1, 2, 3, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=np.int64)
    for d in divisors:
        m, s = divider(d)
        assert 0 < m < 2**32 and 0 <= s <= 31
        around = (d * np.arange(5))[:, None] + np.array([-1, 0, 1])
        n = np.concatenate([edges, rng.integers(0, 2**32, 64), around.ravel()])
        n = n[(n >= 0) & (n < 2**32)]
        assert np.array_equal(divide(n, m, s), n // d), d
    for bad in (0, -1, 2**31, 1.0, True):
        with pytest.raises(ValueError, match="divisor"):
            divider(bad)
