"""Region pieces (``staging.region``): their sizes and strides, refusals by field where a piece
is made and where it meets a rank, and slots laid end to end on 16-byte boundaries."""

import pytest

from kvstage.staging.region import ALIGN, Order, RegionPiece, check_pieces, end_to_end


def test_a_piece_spans_its_heads_buffers_and_whole_rows():
    p = RegionPiece(1, 3, range(2, 6), 0)
    assert p.order is Order.HEADS and p.row_tokens(37) == 37 and p.nbytes(256, 37) == 3 * 4 * 37 * 256
    w = RegionPiece(1, 3, range(2, 6), 0, Order.TOKENS, rows=100, row_first=37)
    assert w.row_tokens(37) == 100 and w.nbytes(256, 37) == 3 * 4 * 100 * 256
    assert RegionPiece(0, 3, range(4), 0, Order.HEADS, rows=50).buffer_stride(16, 10) == 50 * 16
    assert RegionPiece(0, 3, range(4), 0, Order.TOKENS, rows=50).buffer_stride(16, 10) == 50 * 3 * 16


def test_an_order_may_be_named_by_its_value():
    assert RegionPiece(0, 1, range(1), 0, "tokens").order is Order.TOKENS
    assert hash(RegionPiece(0, 1, range(1), 0, "tokens")) == hash(RegionPiece(0, 1, range(1), 0, Order.TOKENS))


@pytest.mark.parametrize("fields,match", [
    (dict(head_lo=-1), r"head_lo=-1: must be an integer >= 0"),
    (dict(heads=0), r"heads=0: must be an integer >= 1"),
    (dict(heads=True), r"heads=True: must be an integer >= 1"),
    (dict(buffers=range(0)), r"buffers=range\(0, 0\): must be a non-empty range of step 1"),
    (dict(buffers=range(0, 6, 2)), r"buffers=range\(0, 6, 2\): must be a non-empty range of step 1"),
    (dict(buffers=[0, 1]), r"buffers=\[0, 1\]: must be a non-empty range of step 1"),
    (dict(offset=8), r"offset=8: must be an integer >= 0 and a multiple of 16"),
    (dict(offset=-16), r"offset=-16: must be an integer >= 0 and a multiple of 16"),
    (dict(order="rows"), r"order='rows': must be one of heads, tokens"),
    (dict(rows=0), r"rows=0: must be None \(the index's count\) or an integer >= 1"),
    (dict(rows=10, row_first=-1), r"row_first=-1: must be an integer >= 0"),
    (dict(row_first=3), r"row_first=3: needs rows"),
])
def test_a_piece_no_rank_could_take_is_refused_where_it_is_made(fields, match):
    base = dict(head_lo=0, heads=1, buffers=range(2), offset=0)
    with pytest.raises(ValueError, match=match):
        RegionPiece(**{**base, **fields})


def test_pieces_are_checked_against_the_rank_and_the_region():
    ok = RegionPiece(0, 2, range(4), 0, rows=20, row_first=10)
    rank = dict(local_heads=2, buffers=4, head_bytes=16, count=10)
    assert check_pieces([ok], **rank, region_bytes=ok.nbytes(16, 10)) == (ok,)
    with pytest.raises(ValueError, match=r"pieces\[0\]\.offset: the piece spans bytes 0\.\.2560, past the "
                                         r"region's 2559"):
        check_pieces([ok], **rank, region_bytes=2559)
    assert check_pieces([ok], **rank) == (ok,)  # no region: its bounds are not checked
    with pytest.raises(ValueError, match=r"pieces\[0\]\.rows: row_first=10 \+ count=11 = 21 must be <= rows=20"):
        check_pieces([ok], **{**rank, "count": 11})
    with pytest.raises(ValueError, match=r"pieces\[0\]\.heads: head_lo=0 \+ heads=2 = 2 must be <= 1"):
        check_pieces([ok], **{**rank, "local_heads": 1})
    with pytest.raises(ValueError, match=r"pieces\[0\]\.buffers=range\(0, 4\): must lie in range\(0, 2\)"):
        check_pieces([ok], **{**rank, "buffers": 2})


def test_pieces_laid_end_to_end_start_on_16_byte_boundaries():
    pieces = [RegionPiece(0, 1, range(1), 0), RegionPiece(1, 1, range(3), 0, Order.TOKENS),
              RegionPiece(0, 2, range(1), 0)]
    laid = end_to_end(pieces, 6, 5, offset=16)  # 30, 90 and 60 bytes
    assert [p.offset for p in laid] == [16, 48, 144]
    assert all(p.offset % ALIGN == 0 for p in laid)
    assert [(p.head_lo, p.heads, p.buffers, p.order) for p in laid] == [(p.head_lo, p.heads, p.buffers, p.order)
                                                                        for p in pieces]
