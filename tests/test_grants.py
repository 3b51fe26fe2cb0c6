"""A destination's grant order (``protocol.grants``): announced requests first, early grants
bounded, a slot per chunk, a direct request's one chunk needing none."""

from kvstage.protocol.grants import EARLY_CHUNKS, Waiting, chunk_tokens, early_room, grant_order


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
