"""Tests of ``kvstage.tp``: shard maps and transfer plans.

Expectations are computed independently of the code under test: shards are
built by brute force from the rules in the module docstring (which ranks hold
which head), never by calling ``SideSpec.heads_of`` / ``holders_of``.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.errors import ConfigError, IncompatibleGeometry
from kvstage.layout import DTYPE_SIZES, KVGeometry, PageLayout
from kvstage.tp import HeadRange, Piece, SideSpec, TransferPlan, plan

HEAD_COUNTS = (1, 2, 4, 6, 8, 12, 16, 32, 64)
MAX_TP = 64
MLA_TPS = tuple(range(1, 17))


def valid_tps(kv_heads: int) -> list[int]:
    """Divisors of kv_heads and multiples of it up to MAX_TP (brute force)."""
    return sorted(
        {t for t in range(1, kv_heads + 1) if kv_heads % t == 0}
        | {t for t in range(kv_heads, MAX_TP + 1) if t % kv_heads == 0}
    )


def brute_holders(kv_heads: int, tp: int, mla: bool) -> dict[int, list[int]]:
    """head -> ranks holding it, straight from the docstring rules."""
    if mla:
        return {0: list(range(tp))}
    out: dict[int, list[int]] = {h: [] for h in range(kv_heads)}
    if tp <= kv_heads:
        for r in range(tp):
            for h in range(r * kv_heads // tp, (r + 1) * kv_heads // tp):
                out[h].append(r)
    else:
        for k in range(kv_heads):
            out[k].extend(range(k * tp // kv_heads, (k + 1) * tp // kv_heads))
    return out


def brute_shards(kv_heads: int, tp: int, mla: bool) -> list[list[int]]:
    """rank -> sorted global heads it holds."""
    shards: list[list[int]] = [[] for _ in range(tp)]
    for h, ranks in brute_holders(kv_heads, tp, mla).items():
        for r in ranks:
            shards[r].append(h)
    return [sorted(s) for s in shards]


def side(kv_heads: int, tp: int, mla: bool = False, *, layers: int = 2, head_dim: int = 8,
         dtype: str = "bfloat16", page_size: int = 16, order: str = "nhd") -> SideSpec:
    geo = KVGeometry(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, mla=mla)
    return SideSpec(geo, tp, PageLayout(page_size, order))


def expected_direct(src: SideSpec, dst: SideSpec) -> bool:
    """Direct iff identical paging and every piece is a whole source shard and a
    whole destination shard; brute force over the shard lists."""
    if src.page != dst.page:
        return False
    geo = src.geometry
    src_shards = brute_shards(geo.kv_heads, src.tp, geo.mla)
    return all(ds in src_shards for ds in brute_shards(geo.kv_heads, dst.tp, geo.mla))


def check_plan(src: SideSpec, dst: SideSpec, p: TransferPlan) -> None:
    """Every invariant a plan must satisfy, checked against brute-force shards."""
    geo = src.geometry
    H, mla = geo.kv_heads, geo.mla
    src_shards = brute_shards(H, src.tp, mla)
    dst_shards = brute_shards(H, dst.tp, mla)
    src_holders = brute_holders(H, src.tp, mla)

    # The shard maps themselves agree with the brute force.
    for r, heads in enumerate(src_shards):
        hr = src.heads_of(r)
        assert list(range(hr.start, hr.stop)) == heads, (r, hr, heads)
    for r, heads in enumerate(dst_shards):
        hr = dst.heads_of(r)
        assert list(range(hr.start, hr.stop)) == heads, (r, hr, heads)
    for h, ranks in src_holders.items():
        assert list(src.holders_of(h)) == ranks, (h, ranks)
    assert src.local_heads() == len(src_shards[0])
    assert dst.local_heads() == len(dst_shards[0])

    assert p.src == src and p.dst == dst
    B, P = geo.buffers, geo.planes
    covered: dict[int, Counter] = {d: Counter() for d in range(dst.tp)}
    pairs: Counter = Counter()
    for pc in p.pieces:
        assert isinstance(pc, Piece)
        assert 0 <= pc.src_rank < src.tp and 0 <= pc.dst_rank < dst.tp, pc
        assert pc.heads.start < pc.heads.stop, pc
        assert pc.buffers.step == 1 and 0 <= pc.buffers.start < pc.buffers.stop <= B, pc
        assert pc.buffers.start % P == 0 and pc.buffers.stop % P == 0, pc  # whole layers
        heads = list(range(pc.heads.start, pc.heads.stop))
        s_shard, d_shard = src_shards[pc.src_rank], dst_shards[pc.dst_rank]
        assert set(heads) <= set(s_shard), (pc, s_shard)
        assert set(heads) <= set(d_shard), (pc, d_shard)
        assert pc.src_offset == pc.heads.start - s_shard[0], pc
        assert pc.dst_offset == pc.heads.start - d_shard[0], pc
        if len(pc.buffers) < B:  # a share of the layers only where the heads are replicated at the source
            assert len(src_holders[pc.heads.start]) > 1 and pc.heads.count == 1, pc
        covered[pc.dst_rank].update((h, b) for h in heads for b in pc.buffers)
        pairs[(pc.src_rank, pc.dst_rank)] += 1

    # Exactly-once coverage of every (destination head, buffer).
    for d in range(dst.tp):
        assert covered[d] == Counter((h, b) for h in dst_shards[d] for b in range(B)), d
    # At most one piece per (src, dst) pair.
    assert max(pairs.values()) == 1, pairs
    # No piece splitting beyond what the source shards force: each destination head group takes its
    # heads from min(holders, what the spread gives it) holders, every holder serving an even share.
    for d in range(dst.tp):
        into = [pc for pc in p.pieces if pc.dst_rank == d]
        by_shard: dict[tuple, list] = {}
        for pc in into:
            by_shard.setdefault(tuple(src_shards[pc.src_rank]), []).append(pc)
        for shard, pcs in by_shard.items():
            holders = src_holders[shard[0]]
            wanting = sorted({dd for dd in range(dst.tp) if set(shard) & set(dst_shards[dd])})
            if len(wanting) >= len(holders):
                assert len(pcs) == 1 and len(pcs[0].buffers) == B, (d, pcs)
            else:
                mine = holders[wanting.index(d)::len(wanting)]
                shares = sorted(len(pc.buffers) // P for pc in pcs)
                assert sum(shares) == geo.layers and shares[-1] - shares[0] <= 1, (d, pcs)
                assert {pc.src_rank for pc in pcs} <= set(mine), (d, pcs, mine)
                assert len(pcs) == min(len(mine), geo.layers), (d, pcs, mine)

    # writers_of: sorted by (dst_offset, buffers) and covering the dst shard; offsets are cumulative bytes.
    tokens = 3
    hb = geo.head_dim * DTYPE_SIZES[geo.dtype]
    per_head_token = B * hb
    assert p.dst_token_bytes() == per_head_token * len(dst_shards[0])
    for d in range(dst.tp):
        ws = p.writers_of(d)
        assert ws == tuple(sorted((pc for pc in p.pieces if pc.dst_rank == d),
                                  key=lambda x: (x.dst_offset, x.buffers.start)))
        offs = p.writer_offsets(d, tokens)
        assert len(offs) == len(ws)
        run = 0
        for w in ws:
            assert offs[w.src_rank] == run, (d, offs, ws)
            assert p.piece_token_bytes(w) == hb * w.heads.count * len(w.buffers)
            run += hb * w.heads.count * len(w.buffers) * tokens
        assert run == p.dst_token_bytes() * tokens

    # targets_of returns exactly the pieces a source sends.
    for s in range(src.tp):
        assert Counter(p.targets_of(s)) == Counter(pc for pc in p.pieces if pc.src_rank == s)

    # Replica balance: among the holders of one head, the bytes they send differ by at most one layer's
    # worth per destination served, and none sends more than one piece more than another.
    sent = Counter()
    for pc in p.pieces:
        sent[pc.src_rank] += len(pc.buffers)
    for h, ranks in src_holders.items():
        if len(ranks) > 1:
            loads = [sent[r] for r in ranks]
            wanting = sum(1 for dd in range(dst.tp) if h in dst_shards[dd])
            assert max(loads) - min(loads) <= max(P * wanting, B), (h, ranks, loads)

    if mla:
        for pc in p.pieces:
            assert pc.heads == HeadRange(0, 1) and pc.src_offset == 0 and pc.dst_offset == 0


# --------------------------------------------------------------------------
# Exhaustive and property-based plans
# --------------------------------------------------------------------------


def test_valid_tps_helper():
    # Guard the test's own generator (it drives everything below).
    assert valid_tps(12) == [1, 2, 3, 4, 6, 12, 24, 36, 48, 60]
    assert valid_tps(64) == [1, 2, 4, 8, 16, 32, 64]
    assert brute_shards(2, 4, False) == [[0], [0], [1], [1]]
    assert brute_shards(12, 4, False)[1] == [3, 4, 5]


@pytest.mark.parametrize("H", HEAD_COUNTS)
def test_exhaustive(H):
    """Every valid (src tp, dst tp) for this head count, tp up to 64."""
    tps = valid_tps(H)
    for a in tps:
        for b in tps:
            src, dst = side(H, a), side(H, b)
            check_plan(src, dst, plan(src, dst))


def test_exhaustive_mla():
    """MLA: every src tp x dst tp in 1..16."""
    for a in MLA_TPS:
        for b in MLA_TPS:
            src, dst = side(1, a, True), side(1, b, True)
            check_plan(src, dst, plan(src, dst))


@st.composite
def geometries(draw):
    mla = draw(st.booleans())
    layers = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([1, 3, 64, 128, 576]))
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    if mla:
        H = 1
        a, b = draw(st.sampled_from(MLA_TPS)), draw(st.sampled_from(MLA_TPS))
    else:
        H = draw(st.sampled_from(HEAD_COUNTS))
        tps = valid_tps(H)
        a, b = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    kw = dict(layers=layers, head_dim=head_dim, dtype=dtype)
    src = side(H, a, mla, **kw, page_size=draw(st.sampled_from([1, 16, 64])),
               order=draw(st.sampled_from(["nhd", "hnd"])))
    dst = side(H, b, mla, **kw, page_size=draw(st.sampled_from([1, 16, 64])),
               order=draw(st.sampled_from(["nhd", "hnd"])))
    return src, dst


@settings(max_examples=300, deadline=None)
@given(geometries())
def test_plan_properties(sd):
    src, dst = sd
    p = plan(src, dst)
    check_plan(src, dst, p)
    assert p.geometry == src.geometry
    assert p.direct == expected_direct(src, dst)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(HEAD_COUNTS).flatmap(
    lambda H: st.tuples(st.just(H), st.sampled_from(valid_tps(H)), st.sampled_from(valid_tps(H)))))
def test_plan_properties_mha(args):
    H, a, b = args
    src, dst = side(H, a), side(H, b)
    check_plan(src, dst, plan(src, dst))


def test_plan_is_deterministic():
    src, dst = side(12, 4), side(12, 6)
    assert plan(src, dst) == plan(src, dst)


# --------------------------------------------------------------------------
# Explicit cases, written out by hand
# --------------------------------------------------------------------------


def assert_pieces(p: TransferPlan, expected):
    """``expected`` rows are (src, dst, lo, hi, src_off, dst_off); ``src`` may be a
    set of acceptable replicas when the choice among them is free."""
    got = sorted(p.pieces, key=lambda x: (x.dst_rank, x.dst_offset))
    exp = sorted(expected, key=lambda x: (x[1], x[5]))
    assert len(got) == len(exp), (got, exp)
    for g, (s, d, lo, hi, so, do) in zip(got, exp):
        ok_src = g.src_rank in s if isinstance(s, (set, frozenset)) else g.src_rank == s
        assert ok_src and (g.dst_rank, g.heads, g.src_offset, g.dst_offset) == (
            d, HeadRange(lo, hi), so, do), (g, (s, d, lo, hi, so, do))


def test_4_to_1_eight_heads():
    p = plan(side(8, 4), side(8, 1))
    assert_pieces(p, [(0, 0, 0, 2, 0, 0), (1, 0, 2, 4, 0, 2), (2, 0, 4, 6, 0, 4), (3, 0, 6, 8, 0, 6)])
    assert [w.src_rank for w in p.writers_of(0)] == [0, 1, 2, 3]
    hb = 2 * 2 * 8 * 2  # layers * planes * head_dim * bf16, per head per token
    assert p.writer_offsets(0, 5) == {0: 0, 1: 2 * hb * 5, 2: 4 * hb * 5, 3: 6 * hb * 5}
    assert not p.direct


def test_1_to_4_eight_heads():
    p = plan(side(8, 1), side(8, 4))
    assert_pieces(p, [(0, 0, 0, 2, 0, 0), (0, 1, 2, 4, 2, 0), (0, 2, 4, 6, 4, 0), (0, 3, 6, 8, 6, 0)])
    assert [pc.dst_rank for pc in p.targets_of(0)] == [0, 1, 2, 3]


def test_2_to_4_two_kv_heads():
    # dst replicates: ranks 0,1 hold head 0; ranks 2,3 hold head 1.
    p = plan(side(2, 2), side(2, 4))
    assert_pieces(p, [(0, 0, 0, 1, 0, 0), (0, 1, 0, 1, 0, 0), (1, 2, 1, 2, 0, 0), (1, 3, 1, 2, 0, 0)])


def test_4_to_6_twelve_heads():
    # src shards [0,3) [3,6) [6,9) [9,12); dst shards of 2 heads each.
    p = plan(side(12, 4), side(12, 6))
    assert_pieces(p, [
        (0, 0, 0, 2, 0, 0),
        (0, 1, 2, 3, 2, 0), (1, 1, 3, 4, 0, 1),
        (1, 2, 4, 6, 1, 0),
        (2, 3, 6, 8, 0, 0),
        (2, 4, 8, 9, 2, 0), (3, 4, 9, 10, 0, 1),
        (3, 5, 10, 12, 1, 0),
    ])
    hb = 2 * 2 * 8 * 2
    assert p.writer_offsets(1, 7) == {0: 0, 1: hb * 7}
    assert p.writer_offsets(4, 7) == {2: 0, 3: hb * 7}


def test_6_to_4_twelve_heads():
    p = plan(side(12, 6), side(12, 4))
    assert_pieces(p, [
        (0, 0, 0, 2, 0, 0), (1, 0, 2, 3, 0, 2),
        (1, 1, 3, 4, 1, 0), (2, 1, 4, 6, 0, 1),
        (3, 2, 6, 8, 0, 0), (4, 2, 8, 9, 0, 2),
        (4, 3, 9, 10, 1, 0), (5, 3, 10, 12, 0, 1),
    ])


def test_8_to_2_two_kv_heads():
    # src replicates: ranks 0-3 hold head 0, ranks 4-7 hold head 1; each destination rank wants one
    # head from four holders, so it takes a share of the layers from each (layers=4: one layer each)
    p = plan(side(2, 8, layers=4), side(2, 2, layers=4))
    assert [(pc.src_rank, pc.dst_rank, pc.heads, pc.buffers) for pc in p.pieces] == [
        (s, s // 4, HeadRange(s // 4, s // 4 + 1), range(2 * (s % 4), 2 * (s % 4) + 2)) for s in range(8)]
    # two layers over four holders: two of them serve a layer each, the others nothing
    p = plan(side(2, 8), side(2, 2))
    assert [(pc.src_rank, pc.buffers) for pc in p.writers_of(0)] == [(1, range(0, 2)), (3, range(2, 4))]


def test_mla_4_to_1_reads_a_quarter_of_the_layers_from_each_rank():
    p = plan(side(1, 4, True, layers=32), side(1, 1, True, layers=32))
    assert [(pc.src_rank, pc.buffers) for pc in p.writers_of(0)] == [(r, range(8 * r, 8 * r + 8)) for r in range(4)]
    hb = 8 * 2
    assert p.piece_token_bytes(p.pieces[0]) == 8 * hb
    assert p.writer_offsets(0, 3) == {r: r * 8 * hb * 3 for r in range(4)}
    assert p.direct  # same paging, whole shards: each holder's page runs of its layers


def test_4_to_8_two_kv_heads_spreads_replicas():
    # src: 0,1 hold head 0; 2,3 hold head 1. dst: 0-3 want head 0, 4-7 head 1.
    p = plan(side(2, 4), side(2, 8))
    assert_pieces(p, [({0, 1}, d, 0, 1, 0, 0) for d in range(4)]
                  + [({2, 3}, d, 1, 2, 0, 0) for d in range(4, 8)])
    assert Counter(pc.src_rank for pc in p.pieces) == {0: 2, 1: 2, 2: 2, 3: 2}


def test_mla_4_to_2():
    # two destination ranks, four holders: each destination rank takes half the layers from two of them
    p = plan(side(1, 4, True), side(1, 2, True))
    assert [(pc.src_rank, pc.dst_rank, pc.buffers) for pc in p.pieces] == [
        (0, 0, range(0, 1)), (2, 0, range(1, 2)), (1, 1, range(0, 1)), (3, 1, range(1, 2))]
    assert p.dst_token_bytes() == 2 * 1 * 8 * 2  # layers * one latent plane * dim * bf16


def test_mla_2_to_6_round_robin_load():
    p = plan(side(1, 2, True), side(1, 6, True))
    assert Counter(pc.src_rank for pc in p.pieces) == {0: 3, 1: 3}
    assert sorted(pc.dst_rank for pc in p.pieces) == list(range(6))


def test_equal_2_to_2_direct():
    src = side(8, 2, page_size=16, order="nhd")
    p = plan(src, side(8, 2, page_size=16, order="nhd"))
    assert_pieces(p, [(0, 0, 0, 4, 0, 0), (1, 1, 4, 8, 0, 0)])
    assert p.direct is True
    assert plan(src, side(8, 2, page_size=32, order="nhd")).direct is False
    assert plan(src, side(8, 2, page_size=16, order="hnd")).direct is False
    assert plan(src, side(8, 4, page_size=16, order="nhd")).direct is False
    # Unequal TP can still be direct when every piece is a whole shard on both sides.
    assert plan(side(2, 2), side(2, 4)).direct is True
    assert plan(side(2, 8), side(2, 2)).direct is True
    assert plan(side(1, 4, True), side(1, 2, True)).direct is True
    assert plan(side(1, 4, True), side(1, 2, True, page_size=32)).direct is False
    assert plan(side(12, 4), side(12, 6)).direct is False
    assert plan(side(8, 8), side(8, 16)).direct is True
    assert plan(side(8, 4), side(8, 16)).direct is False
    m = side(1, 3, True)
    assert plan(m, side(1, 3, True)).direct is True
    assert_pieces(plan(m, side(1, 3, True)), [(0, 0, 0, 1, 0, 0), (1, 1, 0, 1, 0, 0), (2, 2, 0, 1, 0, 0)])


def test_heads_of_rank_out_of_range():
    s = side(8, 4)
    with pytest.raises(IndexError):
        s.heads_of(4)
    with pytest.raises(IndexError):
        s.heads_of(-1)


# --------------------------------------------------------------------------
# Invalid pairs and invalid settings
# --------------------------------------------------------------------------


def _names(msg: str, field: str, *values) -> None:
    assert field in msg, msg
    for v in values:
        assert re.search(rf"(?<![\w.]){re.escape(str(v))}(?![\w.])", msg), (v, msg)


@pytest.mark.parametrize("field,a,b", [
    ("dtype", "bfloat16", "float32"),
    ("dtype", "float16", "bfloat16"),
    ("head_dim", 128, 64),
    ("layers", 32, 40),
    ("kv_heads", 8, 4),
])
def test_mismatched_geometry(field, a, b):
    kw_a = dict(layers=4, kv_heads=8, head_dim=128, dtype="bfloat16")
    kw_b = dict(kw_a)
    kw_a[field], kw_b[field] = a, b
    src = SideSpec(KVGeometry(**kw_a), 2, PageLayout(16))
    dst = SideSpec(KVGeometry(**kw_b), 2, PageLayout(16))
    with pytest.raises(IncompatibleGeometry) as ei:
        plan(src, dst)
    _names(str(ei.value), field, a, b)
    assert str(ei.value).index(str(a)) < str(ei.value).index("destination")


@pytest.mark.parametrize("src_mla", [True, False])
def test_mla_on_one_side_only(src_mla):
    src = SideSpec(KVGeometry(4, 1, 576, mla=src_mla), 2, PageLayout(16))
    dst = SideSpec(KVGeometry(4, 1, 576, mla=not src_mla), 2, PageLayout(16))
    with pytest.raises(IncompatibleGeometry) as ei:
        plan(src, dst)
    _names(str(ei.value), "mla", True, False)


@pytest.mark.parametrize("heads,bad", [(8, 3), (8, 12), (8, 6), (6, 4), (6, 16), (12, 8), (2, 3), (16, 24)])
def test_tp_incompatible_with_heads_is_refused_where_the_spec_is_made(heads, bad):
    with pytest.raises(IncompatibleGeometry) as ei:
        side(heads, bad)
    msg = str(ei.value)
    _names(msg, "tp", bad, heads)
    assert "kv_heads" in msg, msg


@pytest.mark.parametrize("bad", [0, -2, True, 2.0])
@pytest.mark.parametrize("mla", [False, True])
def test_tp_not_positive_int_is_refused_where_the_spec_is_made(bad, mla):
    with pytest.raises(IncompatibleGeometry) as ei:
        side(1 if mla else 8, bad, mla)
    _names(str(ei.value), "tp", bad)


def test_mla_accepts_any_tp():
    for a in (1, 3, 5, 7, 11):
        for b in (1, 2, 3, 13):
            plan(side(1, a, True), side(1, b, True))


@pytest.mark.parametrize("kw,field,value", [
    (dict(layers=-1, kv_heads=8, head_dim=128), "layers", -1),
    (dict(layers=0, kv_heads=8, head_dim=128), "layers", 0),
    (dict(layers=4, kv_heads=0, head_dim=128), "kv_heads", 0),
    (dict(layers=4, kv_heads=8, head_dim=-64), "head_dim", -64),
    (dict(layers=4.0, kv_heads=8, head_dim=128), "layers", 4.0),
    (dict(layers=True, kv_heads=8, head_dim=128), "layers", True),
    (dict(layers=4, kv_heads=8, head_dim=128, dtype="float64"), "dtype", "float64"),
    (dict(layers=4, kv_heads=8, head_dim=128, dtype="bf16"), "dtype", "bf16"),
    (dict(layers=4, kv_heads=8, head_dim=576, mla=True), "kv_heads", 8),
    (dict(layers=4, kv_heads=2, head_dim=576, mla=True), "mla", True),
])
def test_geometry_validation(kw, field, value):
    with pytest.raises(ConfigError) as ei:
        KVGeometry(**kw)
    _names(str(ei.value), field, value)
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("kw,value", [
    (dict(page_size=0), 0),
    (dict(page_size=-16), -16),
    (dict(page_size=16, order="nhwc"), "nhwc"),
    (dict(page_size=16, order="NHD"), "NHD"),
])
def test_page_layout_validation(kw, value):
    with pytest.raises(ConfigError) as ei:
        PageLayout(**kw)
    _names(str(ei.value), "", value)


def test_valid_configs_accepted():
    for dt in DTYPE_SIZES:
        KVGeometry(1, 1, 1, dtype=dt)
    KVGeometry(61, 1, 576, mla=True)
    PageLayout(1, "hnd")
    PageLayout(64, "nhd")
