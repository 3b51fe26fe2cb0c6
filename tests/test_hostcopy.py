"""Native span copies (``staging.hostcopy``, ``_spans.c``): built by the install, exact for any
span list (streaming stores or not), refusing spans past a buffer. Which caches use them
(``staging.copier.choose_copier``) is tests/test_copier.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.staging import hostcopy

SIZE = 1 << 14


def test_the_install_built_the_native_copier():
    """CI installs with pip, which compiles ``_spans.c``: a failed build must not pass as green."""
    assert hostcopy.available(), hostcopy.why_unavailable()


def _ptr(a: np.ndarray) -> tuple[int, int]:
    return a.ctypes.data, a.nbytes


@st.composite
def _spans(draw):
    """Disjoint destination spans (any alignment, lengths from 1 byte to past 64-byte blocks)
    and source spans anywhere (they may overlap: a source is only read)."""
    n = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.sampled_from([1, 7, 15, 16, 63, 64, 65, 100, 512, 1000, 2048]), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    gaps = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    dst_off, at = [0] * n, 0
    for i, gap in zip(order, gaps):  # destination spans in a shuffled order, with gaps between them
        at += gap
        dst_off[i], at = at, at + lengths[i]
    src_off = [draw(st.integers(0, SIZE - m)) for m in lengths]
    return np.array(dst_off), np.array(src_off), np.array(lengths)


@settings(max_examples=150, deadline=None)
@given(spans=_spans(), blocks=st.integers(1, 3), streaming=st.booleans(), shift=st.integers(0, 15))
def test_every_span_lands_and_nothing_else_changes(spans, blocks, streaming, shift):
    dst_off, src_off, lengths = spans
    rng = np.random.default_rng(int(lengths.sum()))
    src = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in range(blocks)]
    room = SIZE + 16
    raw = [np.full(room + shift, 0xA5, dtype=np.uint8) for _ in range(blocks)]
    dst = [r[shift:] for r in raw]  # destinations at every alignment: the streaming path aligns its stores itself
    want = [d.copy() for d in dst]
    for b in range(blocks):
        for d, s, m in zip(dst_off, src_off, lengths):
            want[b][d : d + m] = src[b][s : s + m]
    hostcopy.SpanCopy(dst_off, src_off, lengths, streaming=streaming).run([_ptr(d) for d in dst], [_ptr(s) for s in src])
    for b in range(blocks):
        assert np.array_equal(dst[b], want[b]), b
        assert (raw[b][:shift] == 0xA5).all()


def test_spans_past_a_buffer_are_refused_before_any_byte_moves():
    src, big, dst = np.arange(256, dtype=np.uint8), np.zeros(256, dtype=np.uint8), np.zeros(128, dtype=np.uint8)
    copy = hostcopy.SpanCopy(np.array([0, 100]), np.array([0, 10]), np.array([64, 29]))
    with pytest.raises(IndexError, match=r"destination buffer 1 holds 128 bytes; the spans reach 129"):
        copy.run([_ptr(big), _ptr(dst)], [_ptr(src), _ptr(src)])
    assert not big.any() and not dst.any()  # the first buffer fits, but nothing moves before every check passed
    with pytest.raises(IndexError, match=r"source buffer 0 holds 32 bytes; the spans reach 64"):
        copy.run([(dst.ctypes.data, 200)], [(src.ctypes.data, 32)])
    assert not dst.any()


@pytest.mark.parametrize("dst_off,src_off,lengths,match", [
    ([0], [0, 1], [4], "1 destination offsets, 2 source offsets, 1 lengths"),
    ([-1], [0], [4], "offsets must be >= 0 and lengths >= 1"),
    ([0], [-8], [4], "offsets must be >= 0 and lengths >= 1"),
    ([0], [0], [0], "offsets must be >= 0 and lengths >= 1"),
])
def test_malformed_spans_are_refused(dst_off, src_off, lengths, match):
    with pytest.raises(ValueError, match=match):
        hostcopy.SpanCopy(np.array(dst_off), np.array(src_off), np.array(lengths))


def test_as_many_destinations_as_sources():
    copy = hostcopy.SpanCopy(np.array([0]), np.array([0]), np.array([4]))
    buf = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="2 destination buffers, 1 source buffers"):
        copy.run([_ptr(buf), _ptr(buf)], [_ptr(buf)])
