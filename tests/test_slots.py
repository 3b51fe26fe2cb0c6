"""A destination's slot order (``protocol.slots``): arrival order, one chunk per request per pass,
each peer engine held to its share of the slots."""

from hypothesis import given, strategies as st

from kvstage.protocol.slots import Waiting, engine_limit, slot_order


def W(req, ready=4, peer=""):
    return Waiting(req, ready, peer)


def test_each_pass_gives_each_waiting_request_one_chunk_while_slots_last():
    assert slot_order([W("a"), W("b")], free=3, count=8) == ["a", "b", "a"]


def test_a_full_arena_ends_the_order_and_a_request_with_nothing_readable_gets_nothing():
    assert slot_order([W("a")], free=0, count=4) == []
    assert slot_order([W("a", ready=0), W("b", ready=1)], free=4, count=4) == ["b"]


def test_a_request_gets_no_more_chunks_than_are_readable():
    assert slot_order([W("a", ready=2)], free=4, count=4) == ["a", "a"]


def P(req, peer, ready=8):
    return Waiting((peer, req), ready, peer)


def test_a_lone_engine_uses_every_slot():
    assert len(slot_order([P("a", "x")], free=4, count=4)) == 4
    assert engine_limit(4, waiting=1, connected=1) == 4


def test_engines_waiting_together_share_the_slots():
    order = slot_order([P("a", "x"), P("b", "x"), P("c", "y")], free=4, count=4, held={}, connected=2)
    assert sorted(k[0] for k in order) == ["x", "x", "y", "y"]  # x has two requests, but only its half


def test_a_backlog_leaves_one_slot_for_each_other_connected_engine():
    # y is connected but waits for nothing: x, alone with a backlog, may hold 3 of 4 slots, not 4
    assert slot_order([P("a", "x")], free=4, count=4, held={}, connected=2) == [("x", "a")] * 3
    assert engine_limit(4, waiting=1, connected=2) == 3
    assert engine_limit(4, waiting=1, connected=9) == 1  # more engines than slots: one each at most


def test_an_engine_holding_its_share_is_passed_over_while_another_waits():
    # x holds 3 slots (a stalled peer), one frees: it goes to y, not to x's next chunk
    assert slot_order([P("a", "x"), P("b", "y")], free=1, count=4, held={"x": 3}, connected=2) == [("y", "b")]
    # with x's slots freed, each engine gets up to its half
    order = slot_order([P("a", "x"), P("b", "y")], free=3, count=4, held={"y": 1}, connected=2)
    assert sorted(k[0] for k in order) == ["x", "x", "y"]


@given(st.lists(st.tuples(st.sampled_from("xyz"), st.integers(0, 5)), max_size=8),
       st.integers(0, 6), st.integers(1, 6), st.integers(1, 4))
def test_fairness_never_gives_more_slots_than_are_free_nor_an_engine_past_its_share(reqs, free, count, connected):
    free = min(free, count)
    waiting = [P(str(i), peer, ready) for i, (peer, ready) in enumerate(reqs)]
    order = slot_order(waiting, free, count, {p: 0 for p in "xyz"}, connected)
    assert len(order) <= free
    for w in waiting:
        assert sum(k == w.req for k in order) <= w.ready
    engines = {w.peer for w in waiting if w.ready}
    for peer in engines:
        got = sum(k[0] == peer for k in order)
        if len(engines) > 1:
            assert got <= -(-count // len(engines))
        assert got <= max(1, count - (max(connected, len(engines)) - 1))
