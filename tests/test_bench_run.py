"""``kvstage bench`` end to end: sweeps, concurrency, every output, Ctrl-C.

Real rank processes over real NIXL, tiny geometries.
"""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kvstage.bench.runner import run
from kvstage.bench.scenario import Scenario
from kvstage.layout import KVGeometry, PageLayout

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:  # the plot itself is tested in test_bench_sweep.py, which skips and says so
    HAVE_MPL = False

TINY = ["--layers", "2", "--head-dim", "32", "--arena-mb", "4"]


def bench(*args, timeout=240, **kw):
    return subprocess.run([sys.executable, "-m", "kvstage.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_sweep_with_concurrency_writes_json_csv_and_plot(tmp_path):
    out = tmp_path / "r.json"
    table = tmp_path / "r.csv"
    png = tmp_path / "r.png"
    plot = ["--plot", str(png)] if HAVE_MPL else []
    proc = bench(*TINY, "--src-tp", "2,4", "--dst-tp", "1", "--tokens", "64,200", "--concurrency", "1,3",
                 "--iters", "1", "--warmup", "0", "--json", str(out), "--csv", str(table), *plot)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    rows = data["results"]
    assert data["config"]["pairs"] == [[2, 1], [4, 1]]
    assert data["config"]["tokens"] == [64, 200] and data["config"]["concurrency"] == [1, 3]
    # 2 pairs x 2 token counts x 2 concurrencies x 3 modes
    assert len(rows) == 24
    keys = {(r["src_tp"], r["dst_tp"], r["tokens"], r["concurrency"], r["mode"]) for r in rows}
    assert len(keys) == 24
    for r in rows:
        assert r["verified"] is (None if r["mode"] == "bulk" else True), r.get("errors")
        assert r["bytes"] == r["tokens"] * 2 * 2 * 8 * 32 * 2
        assert r["total_bytes"] == r["bytes"] * r["concurrency"]
        assert r["gbps"] > 0 and 0 < r["latency_p50_s"] <= r["latency_p99_s"]
        assert r["latency_samples"] == r["concurrency"]
        assert r["ratio_to_bulk"] > 0
        check_exposed(r)  # no forward: from the step's start
        if r["mode"] == "bulk":
            assert r["descriptors"] == r["src_tp"]  # one write per source rank and request
        if r["mode"] == "staged":  # the route's path, per request (2 or 4 -> 1 are not whole shards: never direct)
            assert r["path"] and set(r["path"]) <= {"read", "pages"}, r["path"]
            assert r["writes"] >= r["src_tp"]  # the destination's reads: at least one per source rank
    with table.open() as f:
        assert len(list(csv.DictReader(f))) == 24
    if HAVE_MPL:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for col in ("GB/s", "p50 ms", "p99 ms", "desc/req", "conc", "4->1", "2->1"):
        assert col in proc.stdout


def check_exposed(row: dict) -> None:
    """Every result says how much of its transfer the forward did not hide: from the last source rank's
    forward end to the last destination rank holding every byte, never before the forward ended."""
    assert "exposed_s" in row, f"{row['mode']}: no exposed_s in {sorted(row)}"
    assert row["exposed_s"] >= 0 and all(x >= 0 for x in row["exposed_s_all"]), (row["mode"], row["exposed_s_all"])
    assert len(row["exposed_s_all"]) == len(row["seconds_all"])


def test_check_exposed_fails_a_row_without_exposed_time_or_with_a_negative_one():
    good = {"mode": "streamed", "exposed_s": 0.002, "exposed_s_all": [0.002], "seconds_all": [0.05]}
    check_exposed(good)
    for bad in ({k: v for k, v in good.items() if k != "exposed_s"}, dict(good, exposed_s=-0.001),
                dict(good, exposed_s_all=[-0.001])):
        with pytest.raises(AssertionError):
            check_exposed(bad)


def test_streamed_and_staged_under_a_simulated_forward_are_byte_exact_and_report_exposed_time(tmp_path):
    """--mode staged,streamed,bulk --prefill-ms: every mode after (streamed: under) the same simulated forward,
    2 requests in flight; the streamed requests leave in the core's layer groups."""
    from kvstage.protocol.stream import layer_groups

    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    layers, tokens = 8, 1024
    proc = bench("--layers", str(layers), "--head-dim", "32", "--arena-mb", "4", "--src-tp", "2", "--tokens",
                 str(tokens), "--concurrency", "2", "--mode", "staged,streamed,bulk", "--prefill-ms", "40",
                 "--iters", "1", "--warmup", "1", "--verify", "--json", str(out), "--csv", str(table))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["prefill_ms"] == 40
    rows = {r["mode"]: r for r in data["results"]}
    assert list(rows) == ["staged", "streamed", "bulk"]
    for mode in ("staged", "streamed"):
        assert rows[mode]["verified"] is True, rows[mode].get("errors")  # every byte of every request
        assert rows[mode]["path"] and rows[mode]["latency_samples"] == 2
    for r in rows.values():
        check_exposed(r)
    want = [[g.start, g.stop] for g in layer_groups(layers, tokens)]
    assert len(want) > 1  # above the short-prompt bypass: the request really streams
    assert rows["streamed"]["layer_groups"] == want
    assert want[0][0] == 0 and want[-1][1] == layers and all(a[1] == b[0] for a, b in zip(want, want[1:]))
    assert "layer_groups" not in rows["staged"]
    with table.open() as f:
        assert [float(r["exposed_s"]) >= 0 for r in csv.DictReader(f)] == [True] * 3
    assert "exposed ms" in proc.stdout and "streamed / staged exposed: " in proc.stdout


def test_simulated_forward_on_a_cpu_reports_each_layer_in_order_then_its_end():
    import torch

    from kvstage.bench.forward import SimulatedForward

    for ms in (0, 5):
        forward, seen = SimulatedForward(4, ms, torch.device("cpu")), []
        before = time.perf_counter()
        forward.run(seen.append)
        assert seen == [1, 2, 3, 4]
        assert before <= forward.end <= time.perf_counter()


@pytest.mark.gpu
def test_simulated_forward_on_a_gpu_queues_its_layers_and_sees_its_last_kernel_end():
    import torch

    from kvstage.bench.forward import SimulatedForward

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    forward, seen = SimulatedForward(4, 20, torch.device("cuda", 0)), []
    before = time.perf_counter()
    forward.run(lambda n: seen.append((n, torch.cuda.current_stream().query())))
    assert [n for n, _ in seen] == [1, 2, 3, 4]
    assert not seen[-1][1]  # the caller got the last layer while the kernels still ran: queued, not waited for
    end = forward.end
    assert torch.cuda.current_stream().query() and before < end <= time.perf_counter()


@pytest.mark.gpu
def test_streamed_and_staged_on_a_gpu_under_a_simulated_forward_are_byte_exact(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "r.json"
    proc = bench("--device", "cuda", "--layers", "8", "--head-dim", "32", "--src-tp", "2", "--tokens", "1024",
                 "--mode", "staged,streamed", "--prefill-ms", "20", "--iters", "1", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    for r in json.loads(out.read_text())["results"]:
        assert r["verified"] is True, r.get("errors")
        check_exposed(r)


@pytest.mark.ucx
def test_bench_over_ucx_runs_every_mode_and_verifies(tmp_path):
    out = tmp_path / "r.json"
    proc = bench(*TINY, "--transport", "ucx", "--src-tp", "2", "--tokens", "100", "--concurrency", "2",
                 "--iters", "1", "--warmup", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["transport"] == "ucx"
    assert data["host"].get("ucxx-cu13")  # the UCXX release that moved the bytes is recorded with them
    rows = {r["mode"]: r for r in data["results"]}
    assert set(rows) == {"staged", "bulk", "per-slice"}
    assert rows["staged"]["verified"] is True and rows["per-slice"]["verified"] is True, rows
    assert rows["bulk"]["verified"] is None and rows["bulk"]["descriptors"] == 2
    assert rows["staged"]["path"] == ["read"]  # two-sided: the arenas only, no page path
    assert rows["staged"]["descriptors"] == rows["staged"]["writes"] >= 2  # one span per read, one read per source


def test_bench_refuses_an_unknown_transport():
    proc = bench(*TINY, "--transport", "tcp", "--iters", "1")
    assert proc.returncode == 2 and "invalid choice: 'tcp'" in proc.stderr


def test_json_to_stdout():
    proc = bench(*TINY, "--src-tp", "2", "--tokens", "32", "--mode", "bulk", "--iters", "1", "--warmup", "0",
                 "--json", "-")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [r["mode"] for r in data["results"]] == ["bulk"]


@pytest.mark.parametrize("path", ["read", "pages"])
def test_concurrent_requests_contend_for_a_small_arena_and_stay_byte_exact(path):
    # 4 requests at once through 4 slots per rank: chunks interleave and wait for freed slots (the sources'
    # arenas on the read path, the destinations' on both)
    sc = Scenario(KVGeometry(2, 8, 32), 4, 2, 300, PageLayout(16), PageLayout(4, "hnd"),
                  modes=("staged", "per-slice"), iters=1, warmup=0, arena_mb=0.25, concurrency=4,
                  settings_extra={"path": path})
    result = run(sc)
    rows = {r["mode"]: r for r in result["results"]}
    for mode in ("staged", "per-slice"):
        assert rows[mode]["verified"] is True, rows[mode].get("errors")
        assert rows[mode]["latency_samples"] == 4
    assert rows["staged"]["path"] == [path]
    # each request was cut into several chunks: more than one read per (source, destination) pair
    assert rows["staged"]["writes"] > 4
    if path == "read":
        assert rows["staged"]["descriptors"] == rows["staged"]["writes"]  # one span per read
        assert rows["staged"]["stages"]["gather"] > 0
    else:
        assert rows["staged"]["descriptors"] > rows["staged"]["writes"]  # head slices of the pages
        assert rows["staged"]["stages"]["gather"] == 0


def _processes_of(pid: int) -> tuple[list[int], list[int]]:
    """Live processes started for the run of ``pid``: its rank processes, and the launcher that forks
    them. Each carries --parent PID on its command line: a rank started on its own as
    ``python -m kvstage.bench.worker``, or forked by the launcher (``python -m kvstage.bench.launcher``),
    whose command line it keeps; the launcher is the one of those whose parent is ``pid``."""
    ranks, launchers = [], []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{p}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if b"--parent" not in cmd or cmd[cmd.index(b"--parent") + 1] != str(pid).encode() or state == "Z":
            continue
        if b"kvstage.bench.worker" in cmd:
            ranks.append(int(p))
        elif b"kvstage.bench.launcher" in cmd:
            (launchers if int(ppid) == pid else ranks).append(int(p))
    return ranks, launchers


def _ranks_of(pid: int) -> list[int]:
    """Live rank processes started by ``pid`` (they carry --parent PID)."""
    return _processes_of(pid)[0]


def test_ctrl_c_stops_cleanly_with_no_orphans():
    proc = _start_long_run("--mode", "staged,bulk")
    try:
        ranks = _ranks_of(proc.pid)
        assert len(ranks) == 5  # 4 sources + 1 destination
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert _processes_of(proc.pid) == ([], [])  # no rank, nor the launcher that forked them
    for r in ranks:
        assert not os.path.exists(f"/proc/{r}") or open(f"/proc/{r}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def _start_long_run(*extra):
    """A run that would go on for hours, once it is measuring (its --progress log says so)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvstage.cli", "bench", *TINY, "--tokens", "64", "--iters", "100000",
                             "--progress", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = []
    while True:
        line = proc.stderr.readline()
        assert line, "the run ended early:\n" + "".join(log)
        log.append(line)
        if "measuring" in line:
            break
    time.sleep(1)  # well inside the measured steps
    return proc


def test_a_rank_dying_fails_the_run_and_ends_the_others():
    proc = _start_long_run("--mode", "staged")
    try:
        victim = max(_ranks_of(proc.pid))
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    # the coordinator or a destination rank noticed first; either way the dead rank is named
    assert re.search(r"source rank \d+ (disconnected|exited with code|was killed by)|with peer source rank \d+", err), err
    assert "Traceback" not in err
    assert _processes_of(proc.pid) == ([], [])


def test_bulk_buffers_are_real_memory_before_the_first_step():
    """Host memory never written reads as the kernel's one zero page, which stays in
    cache: a bulk write sourced from it ran faster than real bytes allow (a 64 MiB copy
    ~27 against ~17.5 GB/s here). Bulk's buffers are written at set-up, as the arena is."""
    from types import SimpleNamespace

    import torch

    from kvstage.bench.ranks import _bulk_buffer
    from kvstage.transports.nixl import NixlTransport

    def rss() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    points = [SimpleNamespace(concurrency=2, tokens=1024, run_modes=("staged", "bulk")),
              SimpleNamespace(concurrency=1, tokens=4096, run_modes=("staged",))]  # no bulk: not sized for
    t = NixlTransport("bulk-test")
    try:
        before = rss()
        buf, region = _bulk_buffer(SimpleNamespace(points=points), 16 << 10, torch.device("cpu"), t)
        assert buf.numel() == 2 * 1024 * (16 << 10) and region.nbytes == buf.numel()
        assert rss() - before >= 0.9 * buf.numel()  # resident: its own pages, not the shared zero page
        assert bool(buf[:: 4096].ne(0).all())  # bytes written, as a KV cache's are
        assert _bulk_buffer(SimpleNamespace(points=points[1:]), 16 << 10, torch.device("cpu"), t) == (None, None)
    finally:
        t.close()


# -- several engines: one endpoint per rank serves every peer engine --------------------------------
def _check_pairs(data, want, concurrency, iters=1):
    rows = data["results"]
    assert [(r["src_engine"], r["dst_engine"], r["src_tp"], r["dst_tp"]) for r in rows] == want
    step = {(r["tokens"], r["concurrency"]) for r in rows}
    assert len(step) == 1
    for r in rows:
        assert r["mode"] == "staged" and r["verified"] is True, r.get("errors")  # every request, byte for byte
        assert r["bytes"] == r["tokens"] * 2 * 2 * 8 * 32 * 2 and r["total_bytes"] == r["bytes"] * concurrency
        assert r["gbps"] > 0 and 0 < r["latency_p50_s"] <= r["latency_p99_s"]
        assert r["latency_samples"] == concurrency * iters
        assert r["slot_wait_s"] >= 0 and r["src_slot_wait_s"] >= 0
        assert r["path"] and set(r["path"]) <= {"read", "pages", "direct"}  # the route's choice, by its cost model
        # the whole step holds every pair: all pairs' bytes over a wall at least as long as any pair's
        assert r["step_bytes"] == sum(x["total_bytes"] for x in rows)
        assert r["step_seconds"] >= r["seconds"] and r["step_gbps"] > 0
    return rows


def test_two_source_engines_of_different_tp_into_one_destination_engine(tmp_path):
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    proc = bench(*TINY, "--src-engines", "2,4", "--dst-tp", "1", "--tokens", "100", "--concurrency", "2",
                 "--iters", "1", "--warmup", "0", "--verify", "--json", str(out), "--csv", str(table))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["src_engines"] == [2, 4] and data["config"]["dst_engines"] == [1]
    assert data["config"]["modes"] == ["staged"] and "src_tp" not in data["config"]
    rows = _check_pairs(data, [("s0", "d0", 2, 1), ("s1", "d0", 4, 1)], 2)
    assert all(r["dst_peer_engines"] == 2 for r in rows)  # the destination rank's one endpoint served both
    with table.open() as f:
        assert [r["src_engine"] for r in csv.DictReader(f)] == ["s0", "s1"]
    for cell in ("s0 (TP 2) -> d0 (TP 1)", "s1 (TP 4) -> d0 (TP 1)", "all pairs (2,4->1)", "dst slot wait ms"):
        assert cell in proc.stdout


def test_one_source_engine_into_two_destination_engines_through_a_small_arena(tmp_path):
    # 2 requests to each destination engine at once through 4 slots per rank: chunks wait for slots
    out = tmp_path / "r.json"
    proc = bench("--layers", "2", "--head-dim", "32", "--arena-mb", "0.25", "--src-tp", "2", "--dst-engines", "1,2",
                 "--tokens", "300", "--concurrency", "2", "--iters", "1", "--warmup", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["src_engines"] == [2] and data["config"]["dst_engines"] == [1, 2]
    rows = _check_pairs(data, [("s0", "d0", 2, 1), ("s0", "d1", 2, 2)], 2)
    assert all(r["descriptors"] > 2 for r in rows)  # each request cut into several chunks


def test_two_engines_of_one_tp_to_two_engines_same_request_ids(tmp_path):
    """2x2 engines, two of them alike (TP 2 and TP 2): every pair's requests carry the same ids,
    which are per engine pair; each lands in its own pages."""
    sc = Scenario(KVGeometry(2, 8, 32), 2, 1, 64, PageLayout(16), PageLayout(4, "hnd"), iters=1, warmup=0,
                  arena_mb=4, src_engines=(2, 2), dst_engines=(1, 2))
    result = run(sc)
    _check_pairs(result, [("s0", "d0", 2, 1), ("s0", "d1", 2, 2), ("s1", "d0", 2, 1), ("s1", "d1", 2, 2)], 1)


# -- --metrics FILE -----------------------------------------------------------------------------------------

def metrics_blocks(path) -> dict:
    """``kvstage bench --metrics`` FILE as {(TP, role, rank): {(sample, labels): value}}, one block per rank."""
    from prometheus_client.parser import text_string_to_metric_families

    blocks, key, lines = {}, None, []
    for line in list(path.read_text().splitlines()) + ["# kvstage bench: END"]:
        head = re.match(r"# kvstage bench: (?:TP (\S+), \w+ rank \d+(?: of engine \w+)? \(role=(\w+), rank=(\d+)(?:, engine=\w+)?\)|END)$", line)
        if head:
            if key is not None:
                blocks[key] = {(s.name, frozenset(s.labels.items())): s.value
                               for fam in text_string_to_metric_families("\n".join(lines) + "\n") for s in fam.samples}
                blocks[key]["families"] = {fam.name for fam in text_string_to_metric_families("\n".join(lines) + "\n")}
            key, lines = (head.group(1), head.group(2), int(head.group(3))) if head.group(1) else None, []
        else:
            lines.append(line)
    return blocks


def total(block: dict, name: str, **labels) -> float:
    return sum(v for k, v in block.items() if k != "families" and k[0] == name and labels.items() <= dict(k[1]).items())


def test_metrics_file_holds_every_ranks_exposition(tmp_path):
    out = tmp_path / "metrics.txt"
    proc = bench(*TINY, "--src-tp", "2", "--tokens", "64", "--iters", "1", "--warmup", "0", "--mode", "staged",
                 "--metrics", str(out))
    assert proc.returncode == 0, proc.stderr
    blocks = metrics_blocks(out)
    assert list(blocks) == [("2->1", "dst", 0), ("2->1", "src", 0), ("2->1", "src", 1)]
    for block in blocks.values():
        assert {"kvstage_requests", "kvstage_failures", "kvstage_transfer_bytes", "kvstage_request_seconds",
                "kvstage_stage_seconds", "kvstage_slots_free", "kvstage_slots_total", "kvstage_requests_in_flight",
                "kvstage_link_info", "kvstage_slow_requests"} <= block["families"]


def test_a_ranks_recorded_metrics_reach_the_file(tmp_path):
    """The plumbing from a rank's metrics to the coordinator's file: the exposition a rank takes at
    the end of its run (``ranks._exposition``) and the file the coordinator writes from them."""
    from kvstage import metrics
    from kvstage.bench.ranks import _exposition
    from kvstage.bench.runner import write_metrics

    m = metrics.endpoint_metrics("dst", 0, "bench-plumbing")
    m.request_finished("src/1", True, 0.01, 4096)
    m.slots(7, 8)
    assert _exposition(False) is None
    write_metrics(str(tmp_path / "m.txt"), [("4->1", "dst", 0, "", _exposition(True)), ("2,4->1", "src", 3, "s1", "")])
    blocks = metrics_blocks(tmp_path / "m.txt")
    assert list(blocks) == [("4->1", "dst", 0), ("2,4->1", "src", 3)]
    ep = dict(role="dst", rank="0", engine="bench-plumbing")
    assert total(blocks[("4->1", "dst", 0)], "kvstage_requests_total", **ep, result="done") == 1
    assert total(blocks[("4->1", "dst", 0)], "kvstage_transfer_bytes_total", **ep) == 4096
    assert total(blocks[("4->1", "dst", 0)], "kvstage_slots_free", **ep) == 7
    m.close()


@pytest.mark.parametrize("path", ["read", "pages"])
def test_metrics_count_a_known_bench_run(tmp_path, path):
    """What every rank's metrics say after a run whose requests, bytes and stages are known:
    2 source ranks -> 1 destination rank, 3 steps (1 warm-up) of 2 requests of 200 tokens. On the read path
    each source gathers its chunks; on the pages path nothing is gathered; the destination reads and
    scatters every chunk on both, each chunk after its wait for a slot."""
    out = tmp_path / "metrics.txt"
    proc = bench(*TINY, "--src-tp", "2", "--tokens", "200", "--concurrency", "2", "--iters", "2", "--warmup", "1",
                 "--mode", "staged", "--metrics", str(out), env=dict(os.environ, KVSTAGE_PATH=path))
    assert proc.returncode == 0, proc.stderr
    blocks = metrics_blocks(out)
    requests, payload = 3 * 2, 200 * 2 * 2 * 8 * 32 * 2  # steps x concurrency; tokens x layers x K,V x heads x dim x 2 B
    for (_, role, rank), b in blocks.items():
        ep = dict(role=role, rank=str(rank))
        assert total(b, "kvstage_requests_total", **ep, result="done") == requests, (role, rank)
        assert total(b, "kvstage_requests_total", **ep, result="failed") == 0
        assert total(b, "kvstage_failures_total", **ep) == 0
        assert total(b, "kvstage_transfer_bytes_total", **ep) == requests * (payload if role == "dst" else payload // 2)
        assert total(b, "kvstage_request_seconds_count", **ep) == requests
        assert total(b, "kvstage_request_seconds_sum", **ep) > 0
        timed = ("read", "scatter", "slot_wait") if role == "dst" else ("gather",) if path == "read" else ()
        for stage in timed:
            assert total(b, "kvstage_stage_seconds_count", **ep, stage=stage) >= requests, (role, rank, stage)
        for stage in {"gather", "read", "scatter", "slot_wait"} - set(timed) - {"slot_wait"}:
            assert total(b, "kvstage_stage_seconds_count", **ep, stage=stage) == 0, (role, rank, stage)
        slots = total(b, "kvstage_slots_total", **ep)
        assert slots > 0 and total(b, "kvstage_slots_free", **ep) == slots  # idle at the end: every slot back
        assert total(b, "kvstage_requests_in_flight", **ep) == 0
        links = [(dict(k[1])["severity"], v) for k, v in b.items() if k != "families" and k[0] == "kvstage_link_info"
                 and v == 1 and ep.items() <= dict(k[1]).items()]
        assert links and all(sev in ("INFO", "WARNING", "ERROR") for sev, _ in links), (role, rank, links)
