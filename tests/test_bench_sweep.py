"""``kvstage bench`` input: sweep lists, up-front validation, scenario files, summaries.

Nothing here starts a rank process: invalid input must be refused before any is.
"""

import dataclasses
import json

import numpy as np
import pytest

from kvstage.bench import children, runner
from kvstage.bench.report import link_warnings, render_table
from kvstage.bench.report_csv import CSV_COLUMNS, csv_rows, write_csv
from kvstage.bench.scenario import Group, Scenario, Sweep, parse_int_list
from kvstage.bench.summary import links_of, percentile, summarize
from kvstage.cli import main
from kvstage.errors import ConfigError, IncompatibleGeometry
from kvstage.layout import KVGeometry, PageLayout

TINY = ["--layers", "2", "--head-dim", "32", "--arena-mb", "4"]


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    """Fail if anything here tries to start a rank process."""
    def refuse(*a, **k):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(children.Children, "start", refuse)


@pytest.mark.parametrize("text,want", [
    ("4", [4]), ("1,2,8", [1, 2, 8]), (" 2 , 4 ", [2, 4]), ("8,1,8", [8, 1]), (4, [4]), ([128, 1024], [128, 1024]),
])
def test_int_lists(text, want):
    assert parse_int_list("tokens", text) == want


@pytest.mark.parametrize("text", ["", "1,,2", "1,a", "2.5", [1.5], True])
def test_bad_int_lists_name_the_flag(text):
    with pytest.raises(ConfigError, match="tokens="):
        parse_int_list("tokens", text)


def _common(**kw):
    base = dict(geometry=KVGeometry(2, 8, 32), src_page=PageLayout(16), dst_page=PageLayout(16), arena_mb=4)
    return base | kw


def test_sweep_groups_by_tp_pair_and_keeps_order():
    sw = Sweep.build([4, 2], [1, 2], [256, 64], [1, 3], **_common())
    assert [g.label for g in sw.groups] == ["4->1", "4->2", "2->1", "2->2"]
    assert [(p.tokens, p.concurrency) for p in sw.groups[0].points] == [(256, 1), (256, 3), (64, 1), (64, 3)]
    g = sw.groups[0]
    # one schedule walks every point, mode and iteration; the cache fits the largest point
    assert len(g.schedule()) == 4 * 3 * (3 + 1)
    assert g.pages(g.base.dst) == max(p.pages(p.dst) for p in g.points) == 4 * 16 + 1


def test_invalid_pairs_are_all_listed_and_nothing_runs(capsys):
    rc = main(["bench", *TINY, "--src-tp", "2,3", "--dst-tp", "1,5", "--tokens", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "3 of 4 TP pairs cannot run" in err
    for pair in ("src_tp=2 -> dst_tp=5", "src_tp=3 -> dst_tp=1", "src_tp=3 -> dst_tp=5"):
        assert pair in err
    assert "src_tp=2 -> dst_tp=1" not in err


def test_skip_invalid_keeps_the_valid_pairs():
    sw = Sweep.build([2, 3], [1], [64], [1], skip_invalid=True, **_common())
    assert [g.label for g in sw.groups] == ["2->1"]
    assert len(sw.skipped) == 1 and "src_tp=3" in sw.skipped[0]
    with pytest.raises(IncompatibleGeometry):
        Sweep.build([3], [1, 5], [64], [1], skip_invalid=True, **_common())  # nothing valid left


@pytest.mark.parametrize("args,needle", [
    (["--tokens", "64,0"], "tokens=0"),
    (["--concurrency", "0"], "concurrency=0"),
    (["--concurrency", "2,x"], "concurrency="),
    (["--src-tp", "1,"], "src_tp="),
    (["--role", "dst"], "--listen"),
    (["--role", "src"], "--connect"),
    (["--role", "dst", "--listen", "nohost"], "listen='nohost'"),
    (["--json", "/nonexistent-dir/r.json"], "does not exist"),
    (["--plot", "r.txt"], "plot='r.txt'"),
    (["--tokens", "100000000"], "memory:"),
])
def test_invalid_input_exits_2_before_anything_starts(args, needle, capsys):
    assert main(["bench", *TINY, *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_scenario_file_sets_defaults_and_flags_win(tmp_path, monkeypatch):
    seen = {}

    def fake_run(sweep, **kw):
        seen["sweep"] = sweep
        raise ConfigError("stop here")

    monkeypatch.setattr(runner, "run_sweep", fake_run)
    toml = tmp_path / "s.toml"
    toml.write_text('description = "a test sweep"\nsrc_tp = [2, 4]\ndst-tp = 1\ntokens = [64, 128]\n'
                    'layers = 2\nhead_dim = 32\narena_mb = 4\nverify = false\nmode = "staged,bulk"\n')
    assert main(["bench", "--scenario", str(toml), "--tokens", "32"]) == 2
    sw = seen["sweep"]
    assert [g.label for g in sw.groups] == ["2->1", "4->1"]
    assert {p.tokens for p in sw.points} == {32}  # the flag won
    p = sw.points[0]
    assert p.geometry.layers == 2 and p.verify is False and p.modes == ("staged", "bulk")
    js = tmp_path / "s.json"
    js.write_text(json.dumps({"src_tp": 2, "tokens": [64], "layers": 2, "head_dim": 32, "concurrency": [1, 2]}))
    assert main(["bench", "--scenario", str(js)]) == 2
    assert [(p.tokens, p.concurrency) for p in seen["sweep"].points] == [(64, 1), (64, 2)]


@pytest.mark.parametrize("text,needle", [
    ("tokens = [64]\nbogus = 1\n", "unknown key 'bogus'"),
    ("model = 'gpt-9'\n", "model='gpt-9'"),
    ("tokens = [64\n", "not valid TOML"),
])
def test_bad_scenario_files_exit_2(tmp_path, text, needle, capsys):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    assert main(["bench", "--scenario", str(f)]) == 2
    assert needle in capsys.readouterr().err


def test_shipped_scenario_files_are_valid(monkeypatch):
    """Every file under benchmarks/ parses into a runnable sweep."""
    import pathlib

    seen = []

    def fake_run(sweep, **kw):
        seen.append(sweep)
        raise ConfigError("stop here")

    monkeypatch.setattr(runner, "run_sweep", fake_run)
    monkeypatch.setattr("kvstage.cli._check_memory", lambda *a: None)
    files = sorted(pathlib.Path(__file__).parent.parent.joinpath("benchmarks").glob("*.toml"))
    assert files
    for f in files:
        assert main(["bench", "--scenario", str(f)]) == 2, f
    assert len(seen) == len(files)


def test_percentile_is_nearest_rank():
    assert percentile([5.0], 99) == 5.0
    xs = list(range(1, 101))
    assert percentile(xs, 50) == 50 and percentile(xs, 99) == 99 and percentile(xs, 100) == 100
    assert percentile([3, 1, 2], 50) == 2 and percentile([3, 1, 2], 99) == 3


def _synthetic():
    """Two source ranks, one destination rank, 2 requests in flight, 2 measured iterations. On the kvstage path
    the destination reads (its descriptors and reads count); a baseline's sources write (theirs count)."""
    sc = Scenario(KVGeometry(2, 8, 32), 2, 1, 64, PageLayout(16), PageLayout(16), modes=("staged", "bulk"),
                  iters=2, warmup=0, arena_mb=4, concurrency=2)
    g = Group([sc])
    reports = []
    for mode, scale in (("staged", 2.0), ("bulk", 1.0)):
        staged = mode == "staged"
        for it in range(2):
            base = 100.0 * (it + 1)
            for r in range(2):
                reports.append(("src", r, 0, mode, it, {
                    "t0": base + r * 1e-3, "sent": [base + r * 1e-3, base + 2e-3], "t_end": base + 0.01,
                    "forward_end": base + r * 1e-3,  # no simulated forward: it ends as the step starts
                    "descriptors": 0 if staged else 2, "writes": 0 if staged else 2,
                    "stages": {"gather": 1e-3, "read": 0.0, "scatter": 0.0, "slot_wait": 0.0} if staged else {}}))
            reports.append(("dst", 0, 0, mode, it, {
                "t1": base + 0.01 * scale * (it + 1), "done": [base + 0.004 * scale, base + 0.01 * scale * (it + 1)],
                "verified": True if staged else None, "errors": [],
                "stages": {"gather": 0.0, "read": 3e-3, "scatter": 2e-3, "slot_wait": 5e-4} if staged else {},
                "descriptors": 6 if staged else 0, "writes": 4 if staged else 0,
                "path": "read" if staged else None}))
    return sc, g, reports


def test_summary_figures():
    sc, g, reports = _synthetic()
    rows = {r["mode"]: r for r in summarize(g, reports)}
    s, b = rows["staged"], rows["bulk"]
    assert s["seconds_all"] == pytest.approx([0.02, 0.04])
    assert s["seconds"] == pytest.approx(0.03)
    assert s["gbps"] == pytest.approx(2 * sc.payload_bytes() / 0.03 / 1e9)
    assert s["bytes"] == sc.payload_bytes() and s["total_bytes"] == 2 * sc.payload_bytes()
    # latency of request k: last destination done - first source send
    lats = sorted([0.008, 0.02 - 0.002, 0.008, 0.04 - 0.002])
    assert s["latency_samples"] == 4
    assert s["latency_p50_s"] == pytest.approx(lats[1]) and s["latency_p99_s"] == pytest.approx(lats[3])
    # the kvstage path's spans and transfers are the destination's reads (6 spans, 4 reads over 2 requests);
    # a baseline's are its sources' writes (2 each over 2 requests, two sources)
    assert s["descriptors"] == 3 and s["writes"] == 2
    assert b["descriptors"] == 2 and b["writes"] == 2
    assert s["arena_bytes"] == 4 << 20 and b["arena_bytes"] is None
    assert s["ratio_to_bulk"] == pytest.approx(b["seconds"] / s["seconds"])
    # the source's gather (both ranks), the destination's read, slot wait and scatter
    assert s["stages"]["gather"] == pytest.approx(2e-3) and s["stages"]["scatter"] == pytest.approx(2e-3)
    assert s["stages"]["read"] == pytest.approx(3e-3) and s["stages"]["slot_wait"] == pytest.approx(5e-4)
    # one source rank's gather, then the destination's reads and scatter, over the median wall (iteration 2)
    assert s["stages"]["overlap"] == pytest.approx((1e-3 + 5e-3) / 0.04)
    assert "write" not in s["stages"] and "start" not in s["stages"]
    assert s["path"] == ["read"] and "path" not in b
    assert s["verified"] is True and b["verified"] is None
    # exposed: the last source rank's forward end (no forward: its start, 1 ms in) to the last destination done
    assert s["exposed_s_all"] == pytest.approx([0.02 - 1e-3, 0.04 - 1e-3])
    assert s["exposed_s"] == pytest.approx(0.03 - 1e-3) and b["exposed_s"] == pytest.approx(0.015 - 1e-3)


def test_streamed_against_staged_exposed_time_in_the_table():
    """A run with a simulated forward: streamed and staged rows end 30 and 5 ms after a 50 ms forward;
    the table has an exposed column and the ratio; a run without forward or streamed mode has neither."""
    sc = Scenario(KVGeometry(8, 8, 32), 2, 1, 1024, PageLayout(16), PageLayout(16), modes=("staged", "streamed"),
                  iters=1, warmup=0, arena_mb=4, prefill_ms=50)
    reports = []
    for mode, left in (("staged", 0.03), ("streamed", 0.005)):
        for r in range(2):
            reports.append(("src", r, 0, mode, 0, {
                "t0": 10.0, "sent": [10.0], "t_end": 10.05 + left, "forward_end": 10.05 - r * 1e-4,
                "descriptors": 0, "writes": 0, "stages": {"gather": 1e-3},
                "layer_groups": [[0, 4], [4, 8]] if mode == "streamed" else None}))
        reports.append(("dst", 0, 0, mode, 0, {
            "t1": 10.05 + left, "done": [10.05 + left], "verified": True, "errors": [],
            "stages": {"read": 1e-3, "scatter": 1e-3}, "descriptors": 4, "writes": 2, "path": "read"}))
    rows = {r["mode"]: r for r in summarize(Group([sc]), reports)}
    assert rows["staged"]["exposed_s"] == pytest.approx(0.03) and rows["streamed"]["exposed_s"] == pytest.approx(0.005)
    assert rows["streamed"]["layer_groups"] == [[0, 4], [4, 8]] and "layer_groups" not in rows["staged"]
    assert rows["streamed"]["stages"]["overlap"] is None  # its stages run under the forward
    result = {"config": sc.to_dict(), "results": list(rows.values())}
    text = render_table(result)
    assert "exposed ms" in text and "30.00" in text and "5.00" in text
    assert "streamed / staged exposed: 0.17x (5.00 / 30.00 ms; streamed in 2 layer groups of 4 layers)" in text
    sc0, g0, reports0 = _synthetic()
    assert "exposed" not in render_table({"config": sc0.to_dict(), "results": summarize(g0, reports0)})


def test_table_and_csv_from_a_result(tmp_path):
    sc, g, reports = _synthetic()
    result = {"config": sc.to_dict(), "results": summarize(g, reports)}
    text = render_table(result)
    for col in ("mode", "TP", "tokens", "conc", "GB/s", "p50 ms", "p99 ms", "desc/req", "arena MiB", "vs bulk"):
        assert col in text
    assert "2->1" in text
    assert ", nixl, median of 2" in text  # the transport beside the device: rows of two transports differ a lot
    sc = dataclasses.replace(sc, transport="cma")
    assert ", cma, median of 2" in render_table({"config": sc.to_dict(), "results": result["results"]})
    path = tmp_path / "r.csv"
    write_csv(result, str(path))
    import csv

    rows = list(csv.DictReader(path.open()))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [r["mode"] for r in rows] == ["staged", "bulk"]
    assert float(rows[0]["gbps"]) == pytest.approx(result["results"][0]["gbps"])
    assert rows[1]["arena_bytes"] == "" and rows[0]["arena_bytes"] == str(4 << 20)
    assert len(csv_rows(result)) == 2


@pytest.mark.parametrize("path", ["read", "pages", "direct", "ipc"])
def test_table_names_the_path_staged_bytes_took(path):
    """A staged row says the route's path its requests took (``protocol.route.Path``): "staged (read)",
    "staged (pages)", ...; a baseline's row names none."""
    sc, g, reports = _synthetic()
    for who, *_, data in reports:
        if who == "dst" and data["path"] is not None:
            data["path"] = path
    result = {"config": sc.to_dict(), "results": summarize(g, reports)}
    text = render_table(result)
    assert f"staged ({path})" in text
    assert [p for p in ("read", "pages", "direct", "ipc") if f"staged ({p})" in text] == [path]
    assert "bulk (" not in text
    assert [r["path"] for r in csv_rows(result)] == [path, ""]


def test_a_staged_row_whose_requests_took_several_paths_names_them_all():
    sc, g, reports = _synthetic()
    dsts = [data for who, *_, data in reports if who == "dst" and data["path"] is not None]
    dsts[0]["path"] = "pages,read"  # one request read one writer's pages and another's arena
    text = render_table({"config": sc.to_dict(), "results": summarize(g, reports)})
    assert "staged (pages,read+read)" in text


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    from kvstage.bench.report_plot import write_plot

    sc, g, reports = _synthetic()
    result = {"config": sc.to_dict(), "results": summarize(g, reports)}
    for name in ("a.png", "b.svg"):
        write_plot(result, str(tmp_path / name), "title")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "b.svg").read_bytes()[:2000]


def test_plot_without_matplotlib_is_refused_up_front(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main(["bench", *TINY, "--plot", "r.png"]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_reference_content_any_seed_and_distinct_heads():
    from kvstage.bench.reference import full_buffer, head_column

    big = head_column(10**30, 3, 1, 8, 64)  # --seed of any size (content seeds multiply up)
    assert big.shape == (8, 64) and torch_equal(big, head_column(10**30, 3, 1, 8, 64))
    full = full_buffer(7, 2, 8, 4, 64)
    assert full.shape == (8, 4, 64)
    assert not torch_equal(full[:, 0], full[:, 1])
    assert torch_equal(full[:, 2:], full_buffer(7, 2, 8, 4, 64, first=2))  # a rank builds only its heads


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _with_links(reports, expected_gbps, severity="WARNING"):
    """The synthetic reports with a link finding on each rank's last step."""
    link = {"severity": severity, "peer": "destination rank 0", "path": "VRAM->VRAM; expected not to use CUDA IPC",
            "cause": "UCX_TLS=^cuda_ipc leaves out cuda_ipc", "fix": "unset UCX_TLS", "line": f"{severity} kvstage link to x",
            "expected_gbps": expected_gbps}
    last = max(it for *_, it, _ in reports)
    return [(role, rank, pi, mode, it, dict(data, links=[link]) if (mode, it) == ("bulk", last) else data)
            for role, rank, pi, mode, it, data in reports]


@pytest.mark.parametrize("tokens,expected,degraded", [
    (65536, 1470.0, True),  # 64 MiB writes far under what the link should give: a degraded baseline
    (65536, None, False),  # nothing says what the link should give: no judgement
    (64, 1470.0, False),  # small writes run at their per-write cost: not judged
])
def test_a_bulk_far_below_its_link_is_called_degraded_not_a_speed_up(tokens, expected, degraded):
    sc, _, reports = _synthetic()
    sc = dataclasses.replace(sc, tokens=tokens)
    g = Group([sc])
    reports = _with_links(reports, expected)
    rows = summarize(g, reports)
    assert [r["bulk_degraded"] for r in rows] == [degraded, degraded]
    result = {"config": sc.to_dict(), "results": rows, "links": links_of([(g, reports)])}
    text = render_table(result)
    assert ("bulk degraded" in text) is degraded and ("the baseline is degraded" in text) is degraded
    assert (f"{rows[0]['ratio_to_bulk']:.2f}x" in text) is not degraded
    assert rows[0]["ratio_to_bulk"] == pytest.approx(rows[1]["seconds"] / rows[0]["seconds"])  # kept in the JSON


def test_link_warnings_are_collected_once_naming_the_ranks():
    sc, g, reports = _synthetic()
    reports = _with_links(reports, 1470.0)
    links = links_of([(g, reports)])
    assert len(links) == 1 and sorted(links[0]["ranks"]) == ["dst0", "src0", "src1"]
    assert link_warnings({"links": links}) == ["WARNING kvstage link to x [ranks: src0, src1, dst0]"]
    info = links_of([(g, _with_links(reports, 1470.0, severity="INFO"))])
    assert link_warnings({"links": info}) == []


def test_bench_prints_a_link_warning_on_stderr_above_the_table(tmp_path):
    """UCX_TLS=tcp on one host rules out shared memory: every rank's finding says so, and the
    bench prints it once, on stderr, before the table goes to stdout."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvstage.cli", "bench", *TINY, "--tokens", "64", "--iters", "1",
                           "--warmup", "0", "--mode", "staged,bulk", "--no-progress"],
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, UCX_TLS="tcp"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING kvstage link to")]
    assert warned and all("UCX_TLS=tcp leaves out cma" in ln and "fix: unset UCX_TLS" in ln for ln in warned)
    assert len(warned) == len(set(warned))  # one line per distinct finding
    assert "kvstage bench:" in proc.stdout and "WARNING" not in proc.stdout


# -- several engines (--src-engines / --dst-engines) --------------------------------------------
def _engines(src=(2, 4), dst=(1,), **kw):
    return Scenario(KVGeometry(2, 8, 32), src[0], dst[0], 64, PageLayout(16), PageLayout(16),
                    **(dict(iters=1, warmup=0, arena_mb=4) | kw), src_engines=src, dst_engines=dst)


def test_an_engine_group_counts_every_engine():
    sc = _engines(concurrency=3)
    g = Group([sc])
    assert sc.multi and sc.modes == ("staged",)  # the default mode with several engines
    assert g.label == "2,4->1" and Group([_engines((2,), (1, 2))]).label == "2->1,2"
    assert g.processes("src") == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert g.processes("dst") == [(0, 0)]
    assert sc.pairs() == [(0, 0), (1, 0)]
    # a destination rank holds 3 requests of each of the 2 source engines at once; a source rank 3
    assert sc.requests_per_rank("dst") == 6 and sc.requests_per_rank("src") == 3
    assert g.pages(sc.side("dst", 0), "dst") == (6 + 1) * 4 + 1 and g.pages(sc.side("src", 1), "src") == (3 + 1) * 4 + 1
    # memory: every engine's ranks, each with its cache (sized for its requests) and arena
    from kvstage.layout import token_bytes

    def side_bytes(role, e):
        spec = sc.side(role, e)
        cache = g.pages(spec, role) * 16 * token_bytes(sc.geometry, spec.local_heads())
        return spec.tp * (cache + sc.arena_bytes(role, e))

    assert g.host_bytes(("src",)) == side_bytes("src", 0) + side_bytes("src", 1)
    assert g.host_bytes() == side_bytes("src", 0) + side_bytes("src", 1) + side_bytes("dst", 0)
    # a one-engine group of the same first pair is smaller: the check sees every engine
    assert Group([Scenario(KVGeometry(2, 8, 32), 2, 1, 64, PageLayout(16), PageLayout(16), modes=("staged",),
                           arena_mb=4, concurrency=3)]).host_bytes() < g.host_bytes()


def test_an_engine_group_travels_and_records_its_engines():
    sc = _engines((2, 2), (1, 2), concurrency=2)  # two engines of one TP size are two engines
    assert sc.engines("src") == (2, 2) and len(sc.pairs()) == 4
    back = Scenario.from_dict(json.loads(json.dumps(sc.to_dict())))
    assert back == sc and back.group_key() == sc.group_key()
    one = Scenario(KVGeometry(2, 8, 32), 2, 1, 64, PageLayout(16), PageLayout(16), arena_mb=4)
    assert "src_engines" not in one.to_dict()  # a one-engine run's record is as before
    cfg = runner._config(Sweep.build([2], [1, 2], [64], [1], **_common(src_engines=(2, 4))))
    assert cfg["engines"] == [[[2, 4], [1]], [[2, 4], [2]]]
    assert "src_tp" not in cfg and "src_engines" not in cfg and "pairs" not in cfg
    cfg = runner._config(Sweep([Group([sc])]))
    assert cfg["src_engines"] == [2, 2] and cfg["dst_engines"] == [1, 2] and "src_tp" not in cfg


@pytest.mark.parametrize("kw,needle", [
    (dict(modes=("staged", "bulk")), "mode=staged,bulk: a run with several engines"),
    (dict(modes=("per-slice",)), "staged only"),
    (dict(src=(2, 0)), "src_engines=2,0: every entry is a TP size >= 1"),
    (dict(src=tuple([1] * 17)), "at most 16 engines"),
])
def test_engine_scenarios_refuse_what_they_cannot_run(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        _engines(**kw)


def test_an_engine_pair_that_cannot_plan_is_named():
    with pytest.raises(IncompatibleGeometry, match=r"source engine s1 \(TP 3\) -> destination engine d0 \(TP 1\)"):
        _engines((2, 3), (1,))


def test_every_pair_has_its_own_pages_and_bytes():
    """Each request a rank holds in a step has pages of its own and bytes from a seed of its own
    (source engine, destination engine, k): a request landing in another's pages shows."""
    from kvstage.bench.steps import content_seed, request_index, request_pages

    sc = _engines((2, 2), (1, 2), concurrency=3)
    g = Group([sc])
    seeds = set()
    for it in range(2):
        for i, j in sc.pairs():
            for k in range(3):
                seeds.add(content_seed(g, 0, "staged", it, k, (i, j)))
    assert len(seeds) == 2 * 4 * 3
    assert content_seed(g, 0, "staged", 0, 0) != content_seed(g, 0, "staged", 0, 1)  # one-engine seeds as before
    for role in ("src", "dst"):
        for e, rank in g.processes(role):
            pages = request_pages(g, 0, role, rank, 0, e)
            assert len(pages) == sc.requests_per_rank(role) == 6
            flat = np.concatenate(pages)
            assert len(set(flat.tolist())) == len(flat) and flat.max() < g.pages(sc.side(role, e), role)
            assert request_index(sc, 1, 2) == 5
    # engines of one side draw different pages (their own seeds)
    assert not np.array_equal(np.concatenate(request_pages(g, 0, "src", 0, 0, 0)),
                              np.concatenate(request_pages(g, 0, "src", 0, 0, 1)))


def test_verification_catches_a_request_from_another_engine():
    """The mutation a misrouted request makes: s1's request k in the pages where s0's request k
    belongs. The destination's check of s0's request fails there, and passes on the right bytes."""
    import torch

    from kvstage.bench.reference import check_shard, fill_shard
    from kvstage.bench.steps import content_seed, request_index, request_pages
    from kvstage.staging.cache import RankCache

    sc = _engines((2, 4), (1,), concurrency=2)
    g = Group([sc])
    spec = sc.side("dst", 0)
    cache = RankCache.allocate(spec, 0, g.pages(spec, "dst"), torch.device("cpu"))
    reqs = request_pages(g, 0, "dst", 0, 0, 0)
    mine = reqs[request_index(sc, 0, 1)]
    right = content_seed(g, 0, "staged", 0, 1, (0, 0))
    fill_shard(cache, right, mine, sc.tokens)
    assert check_shard(cache, right, mine, sc.tokens, written=np.concatenate(reqs)) == []
    fill_shard(cache, content_seed(g, 0, "staged", 0, 1, (1, 0)), mine, sc.tokens)  # s1's bytes, s0's pages
    errors = check_shard(cache, right, mine, sc.tokens, written=np.concatenate(reqs))
    assert errors and "tokens differ" in errors[0]


def _engine_reports():
    """Source engines s0 (TP 2) and s1 (TP 4) into d0 (TP 1), 2 requests each, 2 measured iterations."""
    sc = _engines(concurrency=2, iters=2)
    g = Group([sc])
    reports = []
    for it in range(2):
        base = 100.0 * (it + 1)
        for e, r in g.processes("src"):
            reports.append(("src", r, 0, "staged", it, {
                "engine": e, "t0": base, "sent": [[base + e * 1e-3 + r * 1e-4, base + 2e-3]], "t_end": base + 0.05,
                "descriptors": [0], "writes": [0], "arena": "host", "copier": "native",
                "stages": [{"gather": 1e-3, "read": 0.0, "scatter": 0.0, "slot_wait": 1e-3 * (e + 1)}]}))
        # s0's requests done at +10/+20 ms (x it), s1's at +30/+40 ms
        reports.append(("dst", 0, 0, "staged", it, {
            "engine": 0, "t1": base + 0.04 * (it + 1),
            "done": [[base + 0.01 * (it + 1), base + 0.02 * (it + 1)], [base + 0.03 * (it + 1), base + 0.04 * (it + 1)]],
            "verified": [True, True] if it == 1 else None, "errors": [[], []],
            "stages": [{"read": 2e-3, "scatter": 1e-3, "slot_wait": 5e-3},
                       {"read": 4e-3, "scatter": 1e-3, "slot_wait": 7e-3 * (it + 1)}],
            # the destination's reads of each source engine's requests: one span per read (2 and 4 writers, 2 requests)
            "descriptors": [4 * 2, 8 * 2], "writes": [4 * 2, 8 * 2],
            "path": ["read", "read"], "arena": "host", "arena_bytes": 4 << 20, "copier": "native",
            "endpoint": {"engines": 2, "peers": 6, "slots_total": 4}}))
    return sc, g, reports


def test_engine_summary_has_one_row_per_pair():
    sc, g, reports = _engine_reports()
    rows = summarize(g, reports)
    assert [(r["src_engine"], r["dst_engine"], r["src_tp"], r["dst_tp"]) for r in rows] == [("s0", "d0", 2, 1),
                                                                                             ("s1", "d0", 4, 1)]
    s0, s1 = rows
    assert s0["seconds_all"] == pytest.approx([0.01 * 2, 0.02 * 2])  # first send (s0 rank 0 at +0) to last done
    assert s1["seconds_all"] == pytest.approx([0.04 - 1e-3, 0.08 - 1e-3])  # s1's first send is at +1 ms
    assert s0["gbps"] == pytest.approx(2 * sc.payload_bytes() / s0["seconds"] / 1e9)
    assert s0["latency_samples"] == 4
    assert s1["latency_p99_s"] == pytest.approx(0.08 - 2e-3)
    assert s0["slot_wait_s"] == pytest.approx(5e-3)  # the destination's wait for s0's requests
    assert s1["slot_wait_s"] == pytest.approx(14e-3)  # the median iteration's (of two, the slower)
    assert s0["src_slot_wait_s"] == pytest.approx(2 * 1e-3) and s1["src_slot_wait_s"] == pytest.approx(4 * 2e-3)
    assert s0["descriptors"] == 4 and s1["descriptors"] == 8  # the destination's read spans, per request
    assert s0["writes"] == 4 and s1["writes"] == 8  # its reads: one per chunk and source rank
    assert s0["stages"] == pytest.approx({"gather": 2e-3, "slot_wait": 2e-3, "read": 2e-3, "scatter": 1e-3})
    assert s0["path"] == ["read"]
    # the whole step: every pair's bytes over the earliest send to the latest completion
    assert s0["step_seconds_all"] == pytest.approx([0.04, 0.08]) and s0["step_bytes"] == 4 * sc.payload_bytes()
    assert s0["step_gbps"] == pytest.approx(4 * sc.payload_bytes() / 0.06 / 1e9)
    assert s0["verified"] is True and s1["verified"] is True
    assert s0["dst_peer_engines"] == 2 and s0["engines"] == "2,4->1"


def test_engine_table_markdown_and_csv(tmp_path):
    import csv

    from kvstage.bench.report import markdown
    from kvstage.bench.report_csv import ENGINE_CSV_COLUMNS

    sc, g, reports = _engine_reports()
    reports[-1][-1]["verified"] = [True, False]
    reports[-1][-1]["errors"] = [[], ["request 1 from engine s1: buffer 0: 3 of 64 tokens differ (first token 0)"]]
    result = {"config": runner._config(Sweep([g])), "results": summarize(g, reports)}
    text = render_table(result)
    for cell in ("s0 (TP 2) -> d0 (TP 1)", "s1 (TP 4) -> d0 (TP 1)", "all pairs (2,4->1)", "dst slot wait ms",
                 "src slot wait ms", "slowest pair / fastest pair"):
        assert cell in text
    assert "NO" in text and "vs bulk" not in text and "(direct)" not in text
    assert "s0 (TP 2) -> d0 (TP 1) (read)" in text
    md = markdown(result, "t", "kvstage bench --src-engines 2,4")
    assert "| s1 (TP 4) → d0 (TP 1) (read) |" in md and "**NO**" in md and "| all pairs (2,4→1) |" in md
    path = tmp_path / "r.csv"
    write_csv(result, str(path))
    got = list(csv.DictReader(path.open()))
    assert tuple(got[0]) == ENGINE_CSV_COLUMNS and [r["src_engine"] for r in got] == ["s0", "s1"]
    assert float(got[1]["slot_wait_s"]) == pytest.approx(result["results"][1]["slot_wait_s"])
    result["results"][1]["path"] = ["direct"]  # a pair whose bytes went as page runs says so
    assert "s1 (TP 4) -> d0 (TP 1) (direct)" in render_table(result)
    assert [r["path"] for r in csv_rows(result)] == ["read", "direct"]


def test_engine_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    from kvstage.bench.report_plot import write_plot

    sc, g, reports = _engine_reports()
    write_plot({"config": runner._config(Sweep([g])), "results": summarize(g, reports)}, str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rank_processes_are_named_by_engine():
    from kvstage.bench.control import rank_name

    assert rank_name("src", 1, 0) == "source rank 1 of engine s0"
    assert rank_name("dst", 0, 1) == "destination rank 0 of engine d1"
    assert rank_name("src", 3) == "source rank 3"


@pytest.mark.parametrize("args,needle", [
    (["--src-engines", "2,4", "--src-tp", "1,2"], "src_tp=1,2 with src_engines=2,4: src_engines gives each source engine's"),
    (["--src-engines", "2,4", "--src-tp", "2"], "src_tp=2 with src_engines=2,4"),
    (["--dst-engines", "1,2", "--dst-tp", "1"], "dst_tp=1 with dst_engines=1,2"),
    (["--src-engines", "2,4", "--mode", "all"], "mode=staged,bulk,per-slice: a run with several engines"),
    (["--src-tp", "2", "--dst-engines", "1,2", "--mode", "bulk"], "mode=bulk: a run with several engines"),
    (["--src-engines", "2,3"], "source engine s1 (TP 3) -> destination engine d0 (TP 1)"),
    (["--src-engines", "2,4", "--dst-tp", "1,3"], "src_engines=2,4 -> dst_tp=3"),
    (["--dst-engines", "1,"], "dst_engines='1,'"),
    (["--src-engines", "2,0"], "src_engines=2,0: every entry is a TP size >= 1"),
    (["--src-engines", "2,4", "--tokens", "100000000"], "memory: TP 2,4->1"),
])
def test_invalid_engine_input_exits_2_before_anything_starts(args, needle, capsys):
    assert main(["bench", *TINY, *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_engines_from_a_scenario_file(tmp_path, monkeypatch):
    seen = {}

    def fake_run(sweep, **kw):
        seen["sweep"] = sweep
        raise ConfigError("stop here")

    monkeypatch.setattr(runner, "run_sweep", fake_run)
    f = tmp_path / "s.toml"
    f.write_text("src_engines = [2, 2, 4]\ndst_tp = [1, 2]\nlayers = 2\nhead_dim = 32\narena_mb = 4\n")
    assert main(["bench", "--scenario", str(f)]) == 2
    assert [g.label for g in seen["sweep"].groups] == ["2,2,4->1", "2,2,4->2"]
    assert all(p.modes == ("staged",) for p in seen["sweep"].points)
