"""The path a request takes (``protocol.route``): direct page runs only where their spans
are expected to cost no more than staging the same bytes."""

import numpy as np
import pytest

from kvstage.protocol.route import BULK_BPS, STAGED_SHARE, choose, page_runs

LLAMA_PAGE = 16 * 8 * 128 * 2  # one page of one buffer of Llama-3-8B at TP 1: 32 KiB
BUFFERS = 64


def test_page_runs_count_breaks_in_consecutive_ids():
    assert page_runs(np.array([], dtype=np.int64)) == 0
    assert page_runs(np.arange(10)) == 1
    assert page_runs(np.array([3, 4, 5, 9, 10, 2])) == 3
    assert page_runs(np.random.default_rng(0).permutation(1000)) > 990


@pytest.mark.parametrize("memory,cost,direct", [
    ("cuda", 12e-6, False),  # one H200: 32 KiB spans at 12 us each crawl next to staging
    ("cpu", 3.6e-6, True),  # the CPU machine: the same spans beat staging through two cores
    ("cpu", 0.5e-6, True),  # cma
])
def test_random_pages_of_the_model(memory, cost, direct):
    ids = np.random.default_rng(1).permutation(4096)[:512]  # 8k tokens of page 16
    r = choose(ids, BUFFERS, LLAMA_PAGE, cost, memory)
    assert r.direct is direct and r.spans == page_runs(ids) * BUFFERS
    assert ("direct is expected to be as fast" if direct else "staging is expected to be faster") in r.reason
    assert f"{r.spans} spans" in r.reason


def test_contiguous_pages_go_direct_even_on_a_gpu():
    r = choose(np.arange(512), BUFFERS, LLAMA_PAGE, 12e-6, "cuda")
    assert r.direct and r.spans == BUFFERS


def _runs(n: int, pages: int = 512) -> np.ndarray:
    """``pages`` page ids in ``n`` runs of consecutive ids."""
    cuts = np.linspace(0, pages, n + 1).astype(int)
    return np.concatenate([np.arange(k * 10_000 + lo, k * 10_000 + hi) for k, (lo, hi) in enumerate(zip(cuts, cuts[1:]))])


def test_the_break_even_is_where_the_spans_cost_what_staging_saves():
    nbytes = 512 * BUFFERS * LLAMA_PAGE
    saved = nbytes / (BULK_BPS["cuda"] * STAGED_SHARE["cuda"]) - nbytes / BULK_BPS["cuda"]
    even = saved / 12e-6 / BUFFERS  # runs at which both cost the same
    below, above = max(1, int(even)), int(even) + 1
    assert choose(_runs(below), BUFFERS, LLAMA_PAGE, 12e-6, "cuda").direct
    r = choose(_runs(above), BUFFERS, LLAMA_PAGE, 12e-6, "cuda")
    assert not r.direct and r.direct_s > r.staged_s and r.spans == above * BUFFERS


def test_forced_direct_says_so_with_the_estimate():
    r = choose(np.arange(0, 1024, 2), BUFFERS, LLAMA_PAGE, 12e-6, "cuda", forced=True)
    assert r.direct and r.reason.startswith("direct=True (")


def test_an_unknown_memory_is_refused():
    with pytest.raises(ValueError, match="memory='tpu'"):
        choose(np.arange(4), 2, 4096, 1e-6, "tpu")
