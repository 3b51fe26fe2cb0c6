"""A destination's grant order (``protocol.grants``): announced requests first, early grants
bounded, a slot per chunk, a direct request's one chunk needing none."""

from kvstage.protocol.grants import (EARLY_CHUNKS, Waiting, chunk_tokens, early_room, eligible, engine_limit,
                                     grant_order)


def W(req, announced=True, next_chunk=0, chunks=4, direct=False):
    return Waiting(req, announced, next_chunk, chunks, direct)


def test_each_pass_gives_each_waiting_request_one_chunk_while_slots_last():
    assert grant_order([W("a"), W("b")], free=3, count=8) == ["a", "b", "a"]


def test_announced_requests_are_served_before_early_ones():
    assert grant_order([W("early", announced=False), W("ready")], free=8, count=8)[:2] == ["ready", "early"]


def test_early_grants_stop_at_early_chunks_and_at_half_the_slots():
    assert grant_order([W("e", announced=False, chunks=10)], free=8, count=8) == ["e"] * EARLY_CHUNKS
    assert early_room(5, 8) and not early_room(4, 8)
    assert grant_order([W("e", announced=False)], free=4, count=8) == []  # half the slots must stay free


def test_a_full_arena_ends_the_order_and_direct_needs_no_slot():
    assert grant_order([W("a")], free=0, count=4) == []
    assert grant_order([W("d", chunks=1, direct=True)], free=0, count=4) == ["d"]
    assert grant_order([W("d", announced=False, chunks=1, direct=True)], free=0, count=4) == ["d"]


def test_a_request_with_every_chunk_granted_gets_no_more():
    assert grant_order([W("a", next_chunk=4), W("b", next_chunk=3)], free=4, count=4) == ["b"]


def test_chunks_start_on_whole_pages_of_both_sides_where_they_can():
    assert chunk_tokens(1000, fit=100, src_page=16, dst_page=4) == 96
    assert chunk_tokens(1000, fit=10, src_page=16, dst_page=4) == 10  # less than a page of both: what fits


def P(req, peer, announced=True, next_chunk=0, chunks=8):
    return Waiting((peer, req), announced, next_chunk, chunks, False, peer)


def test_a_lone_engine_uses_every_slot():
    assert len(grant_order([P("a", "x")], free=4, count=4)) == 4
    assert engine_limit(4, waiting=1, connected=1) == 4


def test_engines_waiting_together_share_the_slots():
    order = grant_order([P("a", "x"), P("b", "x"), P("c", "y")], free=4, count=4, held={}, connected=2)
    assert sorted(k[0] for k in order) == ["x", "x", "y", "y"]  # x has two requests, but only its half


def test_a_backlog_leaves_one_slot_for_each_other_connected_engine():
    # y is connected but waits for nothing: x, alone with a backlog, may hold 3 of 4 slots, not 4
    assert grant_order([P("a", "x")], free=4, count=4, held={}, connected=2) == [("x", "a")] * 3
    assert engine_limit(4, waiting=1, connected=2) == 3
    assert engine_limit(4, waiting=1, connected=9) == 1  # more engines than slots: one each at most


def test_an_engine_holding_its_share_is_passed_over_while_another_waits():
    # x holds 3 slots (a stalled peer), one frees: it goes to y, not to x's next chunk
    order = grant_order([P("a", "x", next_chunk=3), P("b", "y")], free=1, count=4, held={"x": 3}, connected=2)
    assert order == [("y", "b")]
    # with x's slots freed, each engine gets up to its half
    order = grant_order([P("a", "x", next_chunk=3), P("b", "y", next_chunk=1)], free=3, count=4, held={"y": 1},
                        connected=2)
    assert sorted(k[0] for k in order) == ["x", "x", "y"]


def test_fairness_never_grants_more_slots_than_are_free():
    from hypothesis import given, strategies as st

    @given(st.lists(st.tuples(st.sampled_from("xyz"), st.booleans(), st.integers(0, 5)), max_size=8),
           st.integers(0, 6), st.integers(1, 6), st.integers(1, 4))
    def check(reqs, free, count, connected):
        free = min(free, count)
        waiting = [P(str(i), peer, announced, nxt, 6) for i, (peer, announced, nxt) in enumerate(reqs)]
        held = {p: 0 for p in "xyz"}
        order = grant_order(waiting, free, count, held, connected)
        assert len(order) <= free
        eligible_engines = {w.peer for w in waiting if eligible(w, free, count)}
        for peer in eligible_engines:  # no engine beyond its share while others wait, nor past the reserve
            got = sum(k[0] == peer for k in order)
            if len(eligible_engines) > 1:
                assert got <= -(-count // len(eligible_engines))
            assert got <= max(1, count - (max(connected, len(eligible_engines)) - 1))

    check()
