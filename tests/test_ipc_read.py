"""One-host reads on the host: the kernel's addressing (``ipc_read.byte_offsets``, the numpy
twin of ``cuda_ipc``) matches a brute force built from ``layout.element_offsets`` word for
word, moves every plan shape's bytes exactly where the destination's shard wants them and
nowhere else; the checks a source's page ids and a piece pass first."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.ipc_reads import CASES, case_plan, chunks, make_caches, read_on_host
from kvstage.errors import ProtocolError
from kvstage.layout import KVGeometry, PageLayout, element_offsets, pages_needed, token_positions
from kvstage.staging.ipc_read import (MAX_PIECE_WORDS, WORD, buffer_pages, byte_offsets, check_pages, check_piece,
                                      page_bytes, refusal)
from kvstage.staging.words import divide, divider
from kvstage.tp import HeadRange, Piece, SideSpec, plan

#: (source paging, destination paging): page sizes 1, 16 and 64 and either order on either side
PAGINGS = [((1, "nhd"), (16, "hnd")), ((16, "hnd"), (64, "nhd")), ((64, "nhd"), (1, "nhd")),
           ((16, "nhd"), (16, "nhd")), ((64, "hnd"), (1, "hnd"))]
#: the plan shapes ``tp.plan`` makes: one to one, N to one, one to N, uneven, layer shares of replicated heads
SHAPES = ["4->1", "1->4", "1->1 nhd16->hnd1", "2->1 hnd64->nhd16", "4->6 12 heads", "8->2 2 kv heads", "mla 4->1"]


def brute_offsets(src: SideSpec, dst: SideSpec, piece: Piece, src_pages, src_start: int, dst_pages, dst_start: int,
                  count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(buffer, source byte, destination byte) of every 16-byte word of the read, buffer by buffer,
    token by token, head by head, word by word: each head's place from ``layout.element_offsets``."""
    g = src.geometry
    words = g.head_bytes() // WORD
    sp, so = token_positions(src_pages, src.page.page_size, src_start, count)
    dp, do = token_positions(dst_pages, dst.page.page_size, dst_start, count)
    s_head = np.stack([element_offsets(g, src.page, src.local_heads(), sp, so, piece.src_offset + j)
                       for j in range(piece.heads.count)], axis=1) * g.itemsize  # [count, heads]
    d_head = np.stack([element_offsets(g, dst.page, dst.local_heads(), dp, do, piece.dst_offset + j)
                       for j in range(piece.heads.count)], axis=1) * g.itemsize
    w = np.arange(words) * WORD
    s_words = (s_head[:, :, None] + w).reshape(-1)
    d_words = (d_head[:, :, None] + w).reshape(-1)
    n = len(piece.buffers)
    return (np.repeat(np.asarray(piece.buffers), len(s_words)), np.tile(s_words, n), np.tile(d_words, n))


@pytest.mark.parametrize("paging", PAGINGS, ids=lambda p: f"{p[0][1]}{p[0][0]}->{p[1][1]}{p[1][0]}")
@pytest.mark.parametrize("name", SHAPES)
def test_the_addressing_matches_a_brute_force_word_for_word(name, paging):
    p = case_plan(name, *paging)
    rng = np.random.default_rng(5)
    for piece in p.pieces:
        for src_start, dst_start, count in ((0, 0, 1), (5, 70, 37), (63, 1, 66), (130, 17, 9)):
            src_pages = rng.permutation(pages_needed(src_start + count, p.src.page.page_size) + 3)
            dst_pages = rng.permutation(pages_needed(dst_start + count, p.dst.page.page_size) + 3)
            got = byte_offsets(p.src, p.dst, piece, list(src_pages), src_start, dst_pages, dst_start, count,
                               len(src_pages), len(dst_pages))
            want = brute_offsets(p.src, p.dst, piece, src_pages, src_start, dst_pages, dst_start, count)
            for g, w, what in zip(got, want, ("buffer", "source byte", "destination byte")):
                assert np.array_equal(g, w), (name, paging, piece, src_start, dst_start, count, what)


def test_the_plan_shapes_include_layer_shares_of_several_holders():
    """The cases above really cover what they are named for: holders of replicated heads
    serving uneven shares of the layers (8->2, MLA 4->1), every source rank with a share."""
    for name in ("8->2 2 kv heads", "mla 4->1"):
        p = case_plan(name)
        assert {piece.src_rank for piece in p.pieces} == set(range(p.src.tp))
        assert {len(piece.buffers) for piece in p.pieces} == {p.geometry.planes, 2 * p.geometry.planes}


@pytest.mark.parametrize("name", list(CASES))
def test_every_plan_shape_lands_byte_for_byte_through_the_kernels_addressing(name):
    c = make_caches(case_plan(name))
    for d in range(c.plan.dst.tp):
        for start, count in chunks():
            read_on_host(c, d, start, count)
    assert c.check() == []


def test_the_check_sees_a_chunk_left_out():
    """The comparison above can fail: one chunk not read leaves its tokens zero."""
    c = make_caches(case_plan("4->6 12 heads"))
    for d in range(c.plan.dst.tp):
        for start, count in chunks()[1:]:
            read_on_host(c, d, start, count)
    assert any("tokens differ" in e for e in c.check())


def _spec(kv_heads, tp, page, order, head_dim=16, mla=False, layers=2):
    geo = (KVGeometry(layers, 1, head_dim, "bfloat16", True) if mla
           else KVGeometry(layers, kv_heads, head_dim, "bfloat16"))
    return SideSpec(geo, tp, PageLayout(page, order))


@st.composite
def _pairs(draw):
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8, 12]))
    sizes = [t for t in (1, 2, 3, 4, 6, 8, 12, 16, 24) if mla or heads % t == 0 or t % heads == 0]
    head_dim = draw(st.sampled_from([8, 16, 24]))  # 16, 32 and 48 bytes: one to three words
    layers = draw(st.integers(1, 5))
    sides = []
    for _ in range(2):
        sides.append(_spec(heads, draw(st.sampled_from(sizes)), draw(st.sampled_from([1, 2, 4, 16, 64])),
                           "nhd" if mla else draw(st.sampled_from(["nhd", "hnd"])), head_dim, mla, layers))
    return plan(*sides)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=_pairs(), tokens=st.integers(1, 70), chunk=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_any_valid_pair_lands_byte_for_byte(p, tokens, chunk, seed):
    c = make_caches(p, seed=seed, tokens=tokens)
    for d in range(p.dst.tp):
        for start, count in chunks(tokens, chunk):
            read_on_host(c, d, start, count)
    assert c.check() == []


@settings(max_examples=60, deadline=None)
@given(p=_pairs(), data=st.data())
def test_accepted_page_ids_read_only_inside_the_source_and_write_each_slot_once(p, data):
    """Whatever page ids and tokens a source names, once ``check_pages`` accepts them every
    load lies inside the source's buffer, every store inside the destination's, and no two
    stores hit the same word."""
    piece = data.draw(st.sampled_from(p.pieces))
    src_pages, dst_pages = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    src_start, count = data.draw(st.integers(0, 200)), data.draw(st.integers(1, 60))
    need = (src_start + count - 1) // p.src.page.page_size + 1
    ids = data.draw(st.lists(st.integers(0, src_pages - 1), min_size=need, max_size=need + 3))
    dst_ids = np.random.default_rng(data.draw(st.integers(0, 99))).permutation(
        max(dst_pages, pages_needed(count, p.dst.page.page_size)))
    dst_pages = len(dst_ids)
    buffer, s, d = byte_offsets(p.src, p.dst, piece, ids, src_start, dst_ids, 0, count, src_pages, dst_pages)
    assert len(d) == len(piece.buffers) * count * piece.heads.count * p.geometry.head_bytes() // WORD
    assert set(np.unique(buffer)) == set(piece.buffers)
    assert d.min() >= 0 and d.max() + WORD <= dst_pages * page_bytes(p.dst)
    assert s.min() >= 0 and s.max() + WORD <= src_pages * page_bytes(p.src)
    assert len(np.unique(np.stack([buffer, d]), axis=1)[0]) == len(d)


def test_check_pages_returns_the_ids_holding_the_tokens():
    spec = _spec(8, 1, 4, "nhd")
    ok = check_pages(spec, [7, 3, 0, 9, 2], 10, 5, 10, "source rank 0's page ids")  # tokens 5..15: pages 1..3
    assert ok.dtype == np.int64 and list(ok) == [3, 0, 9]
    assert list(check_pages(spec, np.array([4, 6], dtype=np.int32), 10, 0, 8, "ids")) == [4, 6]
    assert list(check_pages(spec, (1,), 10, 3, 1, "ids")) == [1]


@pytest.mark.parametrize("ids,start,count,match", [
    ([3, True, 9], 0, 12, "source rank 2's page ids must be a flat list of integers"),
    ([True, False, True], 0, 12, "must be a flat list of integers"),
    (lambda: np.array([True, False, True]), 0, 12, "must be a flat list of integers"),
    ([3, 1.0, 9], 0, 12, "must be a flat list of integers"),
    ([3.0, 1.0, 9.0], 0, 12, "must be a flat list of integers"),
    (lambda: np.array([3.0, 1.0, 9.0]), 0, 12, "must be a flat list of integers"),
    ([3, "1", 9], 0, 12, "must be a flat list of integers"),
    ([3, None, 9], 0, 12, "must be a flat list of integers"),
    ([[3], [0, 1], 9], 0, 12, "must be a flat list of integers"),
    ([[3], [0], [9]], 0, 12, "must be a flat list of integers"),
    ("309", 0, 12, "must be a flat list of integers"),
    ({0: 3}, 0, 12, "must be a flat list of integers"),
    ([2**70, 0, 9], 0, 12, "must be a flat list of integers"),
    ([3, -1, 9], 0, 12, r"source rank 2's page ids must lie in \[0, 10\); got -1\.\.9"),
    ([3, 10, 9], 0, 12, r"must lie in \[0, 10\); got 3\.\.10"),
    ([2**63, 0, 9], 0, 12, r"must lie in \[0, 10\)|must be a flat list of integers"),
    ([-1, 2**63], 0, 12, r"must lie in \[0, 10\)|must be a flat list of integers"),
    ([3, 0], 0, 12, "source rank 2's page ids: 2 page ids; tokens 0..12 need 3 pages of 4"),
    ([3, 0, 9], 5, 10, "3 page ids; tokens 5..15 need 4 pages of 4"),
    ([], 0, 1, "0 page ids; tokens 0..1 need 1 pages of 4"),
    ([3, 0, 9], -1, 10, "start must be >= 0"),
    ([3, 0, 9], 0, 0, "count >= 1"),
    ([3, 0, 9], 5.0, 10, "source rank 2's page ids: tokens start=5.0 count=10 must be integers"),
    ([3, 0, 9], True, 10, "must be integers"),
    ([3, 0, 9], 0, "4", "must be integers"),
])
def test_check_pages_refuses_a_peers_ids_naming_the_field(ids, start, count, match):
    ids = ids() if callable(ids) else ids  # an array stands in a lambda: pytest tests parameters' truth
    with pytest.raises(ProtocolError, match=match):
        check_pages(_spec(8, 1, 4, "nhd"), ids, 10, start, count, "source rank 2's page ids")


def test_check_pages_keeps_a_piece_inside_the_kernels_32_bit_index():
    wide = SideSpec(KVGeometry(2, 1, 2048, "float32", True), 1, PageLayout(1))  # 512 words a token
    fits = MAX_PIECE_WORDS // 512
    assert len(check_pages(wide, np.arange(fits), fits, 0, fits, "ids")) == fits
    with pytest.raises(ProtocolError, match="ids: 4194304 tokens of 1 heads are 2147483648 words, past the kernel's"):
        check_pages(wide, np.arange(1 << 22), 1 << 22, 0, 1 << 22, "ids")


def _piece(n=2, src=0, dst=0, buffers=range(4)):
    return Piece(0, 0, HeadRange(src, src + n), src, dst, buffers)


def test_pieces_and_pairs_the_kernel_cannot_take_are_refused():
    src, dst = _spec(8, 2, 16, "nhd"), _spec(8, 4, 1, "hnd")
    check_piece(src, dst, _piece(2, 2, 0))
    check_piece(src, dst, _piece(2, 2, 0, range(2, 3)))
    cases = [
        (_piece(2, 2, 1), "destination heads 1..3 past its 2 local heads"),
        (_piece(2, 3, 0), "source heads 3..5 past its 4"),
        (_piece(0, 0, 0), "heads and offsets must be positive"),
        (_piece(2, 0, 0, range(0)), r"buffers range\(0, 0\) must be a non-empty range of step 1 inside the 4"),
        (_piece(2, 0, 0, range(3, 3)), "must be a non-empty range"),
        (_piece(2, 0, 0, range(0, 4, 2)), "of step 1"),
        (_piece(2, 0, 0, range(2, 5)), "inside the 4 buffers"),
        (_piece(2, 0, 0, range(-1, 2)), "inside the 4 buffers"),
        (_piece(2, 0, 0, [0, 1]), r"buffers \[0, 1\] must be a non-empty range"),
    ]
    for piece, match in cases:
        with pytest.raises(ValueError, match=match):
            check_piece(src, dst, piece)
    assert refusal(src, dst) is None
    assert "head_dim differs" in refusal(src, _spec(8, 4, 1, "hnd", head_dim=32))
    assert "layers differs" in refusal(src, _spec(8, 4, 1, "hnd", layers=3))
    eight_bytes = SideSpec(KVGeometry(2, 8, 4, "float16"), 2, PageLayout(16))
    assert "8 bytes (head_dim=4 of float16), not a whole number of 16-byte words" in refusal(eight_bytes, eight_bytes)


def test_byte_offsets_refuses_what_the_kernel_would_refuse():
    p = case_plan("4->1")
    piece = p.pieces[0]
    with pytest.raises(ProtocolError, match="source page ids must lie in"):
        byte_offsets(p.src, p.dst, piece, [0, 9], 0, [0], 0, 16, 9, 4)
    with pytest.raises(ProtocolError, match="destination page ids: 1 page ids; tokens 10..26 need 2"):
        byte_offsets(p.src, p.dst, piece, [0, 1], 0, [0], 10, 16, 9, 4)
    with pytest.raises(ValueError, match="source heads"):
        byte_offsets(p.src, p.dst, _piece(3, 0, 0), [0, 1], 0, [0, 1], 0, 16, 9, 4)


def test_buffer_pages_checks_a_ranks_buffers_against_its_spec():
    spec = _spec(8, 2, 4, "hnd")  # 4 heads of 32 bytes, 4 tokens a page: 512 bytes
    assert page_bytes(spec) == 512
    assert buffer_pages(spec, [(4096 * i, 512 * 7) for i in range(4)]) == 7
    with pytest.raises(ValueError, match="3 buffers; need layers\\*planes = 2\\*2 = 4"):
        buffer_pages(spec, [(0, 512)] * 3)
    with pytest.raises(ValueError, match="the same whole number of 512-byte pages"):
        buffer_pages(spec, [(0, 512), (4096, 1024), (8192, 512), (12288, 512)])
    with pytest.raises(ValueError, match="the same whole number"):
        buffer_pages(spec, [(0, 500)] * 4)
    with pytest.raises(ValueError, match="buffer 2 at 0x2008 is not on a 16-byte boundary"):
        buffer_pages(spec, [(0, 512), (4096, 512), (8200, 512), (12288, 512)])


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
