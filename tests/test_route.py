"""The one route decision (``protocol.route.choose``): pure, every reason tested."""

import pytest

from kvstage.protocol.route import COPIES, COPY_BPS, Link, Path, Request, allowed_paths, choose, cost_s, page_runs

ALL = frozenset(Path)


def link(memory="cpu", ipc=False, pages=True, direct=False, span=3.6e-6, allowed=ALL):
    return Link(memory, ipc, pages, direct, span, allowed)


def req(nbytes=64 << 20, runs=8192, page_spans=8192, fits=True):
    return Request(nbytes, runs, page_spans, fits)


def test_page_runs():
    assert page_runs([]) == 0
    assert page_runs([3, 4, 5, 9, 10, 2]) == 3


def test_ipc_wins_wherever_the_destination_opened_the_pages():
    r = choose(link("cuda", ipc=True, direct=True), req())
    assert r.path is Path.IPC and "one pass" in r.reason


def test_on_a_gpu_without_ipc_the_read_path_beats_descriptor_bound_page_runs():
    # random pages: 8192 spans at 12 us each against three 1.4 TB/s copies of 64 MiB
    r = choose(link("cuda", direct=True, span=12e-6), req())
    assert r.path is Path.READ and "expected fastest" in r.reason
    assert "pages" not in r.reason.split(";")[0] or "direct" in r.reason  # pages is no candidate on a GPU


def test_on_a_host_few_page_runs_go_direct_and_many_go_staged():
    assert choose(link(direct=True), req(runs=64, page_spans=64)).path is Path.DIRECT
    # the same bytes cut into a million spans: direct and pages cost seconds, the read path one more copy
    r = choose(link(direct=True), req(runs=10**6, page_spans=10**6))
    assert r.path is Path.READ


def test_pages_is_cheaper_than_read_on_a_host_where_its_spans_are_few():
    r = choose(link(), req(page_spans=64))
    assert r.path is Path.PAGES
    assert cost_s(Path.PAGES, link(), req(page_spans=64)) < cost_s(Path.READ, link(), req(page_spans=64))


def test_a_gather_that_does_not_fit_the_free_slots_reads_the_pages_where_it_can():
    r = choose(link(), req(page_spans=10**6, fits=False))
    assert r.path is Path.PAGES and "does not fit" in r.reason
    assert choose(link("cuda"), req(fits=False)).path is Path.READ  # no pages path on a GPU: it waits for slots


def test_without_offered_kv_only_the_arena_paths_remain():
    r = choose(link(pages=False, direct=True), req(page_spans=1))
    assert r.path is Path.READ


def test_a_forced_path_that_cannot_run_names_why():
    r = choose(link("cpu", allowed=frozenset({Path.IPC})), req())
    assert r.path is None and "ipc: the destination did not open" in r.reason
    r = choose(link("cuda", allowed=frozenset({Path.PAGES})), req())
    assert r.path is None and "pages is for host memory" in r.reason
    r = choose(link(allowed=frozenset({Path.DIRECT})), req())
    assert r.path is None and "not whole shards" in r.reason


def test_a_forced_path_that_can_run_is_taken_whatever_it_costs():
    r = choose(link(direct=True, allowed=frozenset({Path.DIRECT})), req(runs=10**6))
    assert r.path is Path.DIRECT and "only path allowed" in r.reason


def test_the_cost_model_counts_copies_and_spans():
    l, q = link(), req(nbytes=5 * 10**9, runs=1000, page_spans=2000)
    assert cost_s(Path.READ, l, q) == pytest.approx(COPIES[Path.READ] * 1.0 + 3.6e-6)
    assert cost_s(Path.DIRECT, l, q) == pytest.approx(1.0 + 1000 * 3.6e-6)
    assert cost_s(Path.PAGES, l, q) == pytest.approx(2.0 + 2000 * 3.6e-6)
    assert set(COPY_BPS) == {"cuda", "cpu"}


def test_allowed_paths():
    assert allowed_paths("auto") == ALL
    assert allowed_paths("read") == {Path.READ}
    with pytest.raises(ValueError):
        allowed_paths("staged")

