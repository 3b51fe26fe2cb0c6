"""kvstage.metrics: what each call counts, the cause classes, the standalone port, the
multiprocess directory engines read, the off switch, and the engine plugins' summary line.

In-process tests use this process's one set of families, each with its own engine label;
what needs a fresh process (the switch, a missing prometheus_client, the port, the
multiprocess directory) runs in one."""

import ast
import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstage import metrics
from kvstage.config import Settings
from kvstage.errors import ConfigError

ROOT = pathlib.Path(__file__).parent.parent


def samples(text) -> dict:
    """{(sample name, frozenset of labels): value} of an exposition."""
    if isinstance(text, bytes):
        text = text.decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(got: dict, name: str, **labels):
    """The one sample of ``name`` whose labels include ``labels`` (None if none; an error if several)."""
    hits = [v for (n, ls), v in got.items() if n == name and set(labels.items()) <= dict(ls).items()]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def run_python(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh process (this one's environment without the metrics' own variables, plus ``env``)."""
    full = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "KVSTAGE_METRICS")}
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc


# -- what each call counts -------------------------------------------------------------------------------

def test_a_request_is_counted_with_its_result_bytes_and_seconds():
    m = metrics.endpoint_metrics("dst", 3, "eng-requests")
    m.request_finished("pre/0", True, 0.012, 4096)
    m.request_finished("pre/0", True, 0.030, 4096)
    m.request_finished("pre/1", False, 5.0, 1024)
    got = samples(metrics.exposition())
    ep = dict(role="dst", rank="3", engine="eng-requests")
    assert value(got, "kvstage_requests_total", **ep, peer="pre/0", result="done") == 2
    assert value(got, "kvstage_requests_total", **ep, peer="pre/0", result="failed") == 0  # bound with "done": rate() sees 0
    assert value(got, "kvstage_requests_total", **ep, peer="pre/1", result="failed") == 1
    assert value(got, "kvstage_transfer_bytes_total", **ep, peer="pre/0") == 8192
    assert value(got, "kvstage_transfer_bytes_total", **ep, peer="pre/1") == 1024  # a failed request's bytes moved
    assert value(got, "kvstage_request_seconds_count", **ep, peer="pre/0") == 2
    assert value(got, "kvstage_request_seconds_sum", **ep, peer="pre/0") == pytest.approx(0.042)
    assert value(got, "kvstage_request_seconds_bucket", **ep, peer="pre/0", le="0.025") == 1
    assert value(got, "kvstage_request_seconds_count", **ep, peer="pre/1") == 0  # failed: not a latency


def test_a_failure_is_counted_with_its_stage_and_cause_class():
    m = metrics.endpoint_metrics("src", 1, "eng-failures")
    m.failure("dec/0", "waiting for a reader", "no destination started reading it within 120 s")
    m.failure("dec/0", "read", "connection lost (Connection reset by peer)")
    m.failure("dec/0", "read", "NIXL_ERR_REMOTE_DISCONNECT")  # a transport's own text at read
    m.failure("dec/0", "read", "connection lost (EOF)")
    m.failure("dec/0", "chunk", "refused: read of chunk 7 of 'r', which has 4 chunks")  # a peer's message type: not a stage
    m.failure("dec/0", "write", "x")  # a stage of the old protocol is no label any more
    got = samples(metrics.exposition())
    ep = dict(role="src", rank="1", engine="eng-failures", peer="dec/0")
    assert value(got, "kvstage_failures_total", **ep, stage="waiting_for_a_reader", cause="timeout") == 1
    assert value(got, "kvstage_failures_total", **ep, stage="read", cause="connection_lost") == 2
    assert value(got, "kvstage_failures_total", **ep, stage="read", cause="read_error") == 1
    assert value(got, "kvstage_failures_total", **ep, stage="other", cause="refused") == 1
    assert value(got, "kvstage_failures_total", **ep, stage="other", cause="other") == 1
    assert value(got, "kvstage_failures_total", **ep, stage="write") is None


def test_stage_seconds_slow_requests_and_a_stage_that_is_not_one():
    m = metrics.endpoint_metrics("dst", 0, "eng-stages")
    for stage, s in (("gather", 0.001), ("read", 0.002), ("scatter", 0.0003), ("slot_wait", 0.05), ("read", 0.004)):
        m.stage(stage, s)
    m.slow("pre/0", "read")
    for gone in ("copy", "write"):  # "write": the source moved the bytes before protocol 9; now the destination reads
        with pytest.raises(ValueError, match=f"stage='{gone}': must be one of gather, read, scatter, slot_wait"):
            m.stage(gone, 0.1)
    got = samples(metrics.exposition())
    ep = dict(role="dst", rank="0", engine="eng-stages")
    assert value(got, "kvstage_stage_seconds_count", **ep, stage="read") == 2
    assert value(got, "kvstage_stage_seconds_sum", **ep, stage="read") == pytest.approx(0.006)
    assert value(got, "kvstage_stage_seconds_count", **ep, stage="slot_wait") == 1
    assert value(got, "kvstage_stage_seconds_count", **ep, stage="gather") == 1
    assert value(got, "kvstage_stage_seconds_count", **ep, stage="write") is None
    assert value(got, "kvstage_slow_requests_total", **ep, peer="pre/0", stage="read") == 1


def test_gauges_sum_over_a_ranks_endpoints_and_leave_when_they_close():
    a = metrics.endpoint_metrics("dst", 0, "eng-gauges")  # an engine plugin keeps one endpoint per peer engine
    b = metrics.endpoint_metrics("dst", 0, "eng-gauges")
    a.slots(3, 8)
    b.slots(8, 8)
    a.in_flight(5)
    b.in_flight(1)
    ep = dict(role="dst", rank="0", engine="eng-gauges")
    got = samples(metrics.exposition())
    assert (value(got, "kvstage_slots_free", **ep), value(got, "kvstage_slots_total", **ep)) == (11, 16)
    assert value(got, "kvstage_requests_in_flight", **ep) == 6
    a.close()
    got = samples(metrics.exposition())
    assert (value(got, "kvstage_slots_free", **ep), value(got, "kvstage_slots_total", **ep)) == (8, 8)
    a.slots(0, 8)  # a closed endpoint sets nothing
    assert value(samples(metrics.exposition()), "kvstage_slots_free", **ep) == 8
    b.close()
    got = samples(metrics.exposition())
    assert value(got, "kvstage_slots_free", **ep) is None and value(got, "kvstage_requests_in_flight", **ep) is None
    c = metrics.endpoint_metrics("dst", 0, "eng-gauges")  # a new endpoint of the same rank shows again
    c.slots(2, 4)
    assert value(samples(metrics.exposition()), "kvstage_slots_free", **ep) == 2
    c.close()


def test_a_links_judgement_replaces_its_earlier_one_and_goes_with_its_endpoint():
    m = metrics.endpoint_metrics("src", 2, "eng-links")
    ep = dict(role="src", rank="2", engine="eng-links", peer="dec/0")
    m.link("dec/0", "UCX cuda_ipc (NVLink)", "INFO")
    m.link("dec/0", "KV pages, direct: UCX tcp", "WARNING", kv=True)  # the KV pages' link is judged apart
    m.link("dec/0", "UCX tcp", "WARNING")  # reconnected over another path: replaces the arenas' judgement
    with pytest.raises(ValueError, match="severity='LOUD'"):
        m.link("dec/0", "x", "LOUD")
    got = samples(metrics.exposition())
    links = {(dict(ls)["path"], dict(ls)["severity"]): v for (n, ls), v in got.items()
             if n == "kvstage_link_info" and ep.items() <= dict(ls).items()}
    assert links == {("UCX tcp", "WARNING"): 1, ("KV pages, direct: UCX tcp", "WARNING"): 1}
    from kvstage.link.finding import Severity

    m.link("dec/0", "UCX tcp", Severity.INFO)  # the link module's own severities are accepted
    got = samples(metrics.exposition())
    assert value(got, "kvstage_link_info", **ep, path="UCX tcp", severity="INFO") == 1
    assert value(got, "kvstage_link_info", **ep, path="UCX tcp", severity="WARNING") is None
    m.close()
    assert value(samples(metrics.exposition()), "kvstage_link_info", **ep, path="UCX tcp") is None


def test_recomputes_are_counted_per_engine():
    metrics.recomputed("eng-recompute")
    metrics.recomputed("eng-recompute")
    assert value(samples(metrics.exposition()), "kvstage_recomputes_total", engine="eng-recompute") == 2


def test_the_families_are_in_prometheus_clients_default_registry():
    """An engine that serves the default registry (vLLM's API server without a multiprocess
    directory, in the process that holds the endpoints) shows kvstage's metrics."""
    from prometheus_client import REGISTRY, generate_latest

    metrics.endpoint_metrics("dst", 9, "eng-default").request_finished("p/0", True, 0.1, 1)
    text = generate_latest(REGISTRY).decode()
    assert 'kvstage_requests_total{engine="eng-default",peer="p/0",rank="9",result="done",role="dst"} 1.0' in text


# -- cause classes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cause,stage,want", [
    ("connection lost (Connection reset by peer)", "read", "connection_lost"),
    ("not connected", "read", "connection_lost"),
    ("no control message for 5.2 s: the destination is stopped or hung, or the link is down", "read", "peer_silent"),
    ("no control message for 30.1 s: the source is stopped or hung, or the link is down", "read", "peer_silent"),
    ("no destination started reading it within 120 s", "waiting for a reader", "timeout"),
    ("not ready within 120 s", "waiting for writers", "timeout"),
    ("no progress for 30 s, while the source runs", "read", "timeout"),
    ("no progress for 30 s: a read did not complete", "scatter", "timeout"),
    ("no progress for 30 s while the destination runs", "read", "timeout"),
    ("destination aborted: connection lost (EOF)", "abort", "aborted"),  # the peer counts its own cause
    ("source aborted: taken by engine 'd1'", "abort", "aborted"),
    ("destination aborted: released: the decode will not read it", "abort", "aborted"),
    ("aborted by caller", "abort", "aborted"),
    ("the decode request finished while its KV was loading", "abort", "aborted"),
    ("taken by engine 'd1'", "abort", "refused"),  # a request sent to any engine, read by another
    ("refused: read of chunk 7 of 'r', which has 4 chunks", "read", "refused"),
    ("refused: request 'r' is not in flight here", "done", "refused"),
    # the route: no path can carry it, or none is allowed
    ("no allowed path can carry it (direct: the pieces are not whole shards with equal paging)", "route", "refused"),
    ("path=pages is not allowed to this destination rank: a page path needs KVSTAGE_AUTH_TOKEN on both sides",
     "route", "refused"),
    # a writer's ready refused (``incoming.check_ready``, ``dst_requests.on_request_message``)
    ("ready for 'r': path ipc is not allowed here (the handshake with this source agreed pages, read)", "ready", "refused"),
    ("ready for 'r': page id 90 is past the 64 pages the source offered", "ready", "refused"),
    ("chunk 2 of 'r': 4096 bytes at offset 65536 lie outside the source's arena of 65536 bytes", "ready", "refused"),
    ("the source sends 99 tokens of 'r'; this rank expects tokens 0..100", "ready", "mismatch"),
    ("the source ranks of 'r' cut it into chunks of [16, 32] tokens; they must agree", "read", "mismatch"),
    # a prefill engine whose every rank left: requests that name it fail when expected (``Destination._gone``)
    ("every rank of prefill engine 'a' left: connection lost with the last, source rank 1 of engine a (peer closed "
     "the connection)",
     "waiting for writers", "connection_lost"),
    ("every rank of prefill engine 'a' left: connection lost with the last, source rank 0 of engine a (replaced by a "
     "new connection of source rank 0 of engine a)", "waiting for writers", "connection_lost"),
    ("source closed", "shutdown", "shutdown"),
    ("destination closed", "shutdown", "shutdown"),
    ("NIXL_ERR_BACKEND", "read", "read_error"),  # a transport's own text at read
    ("UCX_ERR_MESSAGE_TRUNCATED", "read", "read_error"),
    ("a chunk of 64 tokens needs 131072 bytes of a slot here, which holds 65536; raise KVSTAGE_ARENA_MB on this rank",
     "read", "read_error"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "gather", "copy_error"),
    ("ValueError: piece lies outside the slot", "scatter", "copy_error"),
    # the vLLM plugin's connect requests, which abort a load
    ("prefill rank at 10.0.0.1:5000: cannot connect ([Errno 111] Connection refused)", "abort", "connection_lost"),
    ("prefill rank at 10.0.0.1:5000: no answer to connect within 15 s (timed out)", "abort", "timeout"),
    ("peer layout None is not a mapping", "start", "mismatch"),  # an engine plugin's load that could not start
    # an SGLang prefill room that failed before kvstage sent a chunk of it (kvstage/plugin/sglang/prefill.py)
    ("the prefill aborted the request", "start", "aborted"),
    ("the decode aborted the request (abort or its waiting timeout)", "start", "aborted"),
    ("Request 5005 timed out after 25.0s in KVPoll.Bootstrapping", "start", "timeout"),
    ("failed on another prefill rank", "start", "other"),  # an echo: the rank that failed it counts the cause
    ("something new", "waiting for writers", "other"),
])
def test_classify(cause, stage, want):
    assert metrics.classify(cause, stage) == want
    assert want in metrics.CAUSES


def _render(node) -> list[str] | None:
    """The texts an expression can make: constants kept, each formatted value "1", both branches of a
    conditional; None when unknown."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for v in node.values:
            alts = [v.value] if isinstance(v, ast.Constant) else (_render(v.value) if isinstance(v.value, ast.IfExp)
                                                                  else None) or ["1"]
            out = [o + a for o in out for a in alts]
        return out
    if isinstance(node, ast.IfExp):
        alts = (_render(node.body) or []) + (_render(node.orelse) or [])
        return alts or None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left), _render(node.right)
        return None if left is None and right is None else [a + b for a in left or ["x"] for b in right or ["x"]]
    return None


def _cause_texts():
    """(file:line, stage, cause) of every text kvstage/protocol writes to fail a request with: each
    ``_fail(...)`` whose cause is written there (not an error's own message), each route's refusal
    (``Route(None, ...)``, failed at stage "route") and the text a gone prefill engine's requests fail with
    (``remember(self._gone, ...)``, at "waiting for writers")."""
    for path in sorted((ROOT / "kvstage" / "protocol").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name == "_fail":
                # an endpoint's _fail(req, peer, stage, cause, tell=...), or a handle's _fail(peer, stage, cause)
                args = node.args[2:4] if len(node.args) >= 4 else node.args[1:3]
                if len(args) < 2:
                    continue
                stages, causes = _render(args[0]) or [""], _render(args[1])
            elif name == "Route" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value is None:
                stages, causes = ["route"], _render(node.args[1])
            elif name == "remember" and len(node.args) >= 3 and "_gone" in ast.unparse(node.args[0]):
                stages, causes = ["waiting for writers"], _render(node.args[2])
            else:
                continue
            for stage in stages:
                for cause in causes or ():
                    yield f"{path.name}:{node.lineno}", stage, cause


def test_every_cause_text_the_protocol_fails_a_request_with_has_a_class():
    """Each text kvstage/protocol fails a request with falls in a class other than "other": a new cause
    text needs a rule in ``classify``."""
    seen = list(_cause_texts())
    unclassified = [f"{where}: {cause!r} at {stage!r}" for where, stage, cause in seen
                    if metrics.classify(cause, stage) == "other"]
    assert len(seen) >= 15, seen  # the scan found the call sites
    assert {"route", "waiting for writers"} <= {stage for _, stage, _ in seen}
    assert not unclassified, "\n".join(unclassified)


# -- the process's switch, a missing prometheus_client ------------------------------------------------------

def test_metrics_do_not_import_prometheus_client_until_an_endpoint_asks():
    """SGLang and vLLM pick prometheus_client's multiprocess mode by a variable set before they
    import it; loading kvstage (a plugin, early) must not import it first."""
    run_python("""
        import sys
        import kvstage, kvstage.metrics, kvstage.config, kvstage.protocol.source, kvstage.protocol.destination
        import kvstage.bench.worker, kvstage.cli
        from kvstage import metrics
        assert metrics.available() and metrics.classify("source closed") == "shutdown"
        assert "prometheus_client" not in sys.modules, "imported too early"
        metrics.endpoint_metrics("dst", 0)
        assert "prometheus_client" in sys.modules
    """)


def test_switched_off_every_call_does_nothing_and_says_so_once():
    proc = run_python("""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        from kvstage import metrics
        from kvstage.config import Settings
        from kvstage.errors import ConfigError
        a, b = metrics.endpoint_metrics("dst", 0), metrics.endpoint_metrics("src", 1)
        for m in (a, b):
            m.request_finished("p", True, 1.0, 10); m.failure("p", "read", "x"); m.stage("gather", 1.0)
            m.slots(1, 2); m.in_flight(3); m.link("p", "x", "INFO"); m.slow("p", "read"); m.close()
        metrics.recomputed("e")
        assert metrics.exposition() == b"" and not metrics.available()
        assert metrics.why_unavailable() == "KVSTAGE_METRICS=off"
        assert metrics.start_from_settings(Settings()) is None
        try:
            metrics.start_from_settings(Settings(metrics_port=9400))
        except ConfigError as e:
            print("REFUSED", e)
    """, env={"KVSTAGE_METRICS": "off"})
    assert proc.stderr.count("kvstage metrics: off: KVSTAGE_METRICS=off; no kvstage_* metrics from this process") == 1
    assert "REFUSED metrics_port=9400: KVSTAGE_METRICS=off; unset metrics_port or export metrics" in proc.stdout


def test_without_prometheus_client_endpoints_say_so_and_metrics_port_is_refused():
    proc = run_python("""
        import logging, sys
        sys.modules["prometheus_client"] = None  # not importable, as where it is not installed
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        from kvstage import metrics
        from kvstage.config import Settings
        from kvstage.errors import ConfigError
        m = metrics.endpoint_metrics("dst", 0)
        m.request_finished("p", True, 1.0, 10)
        assert metrics.exposition() == b""
        try:
            Settings(metrics_port=9400)
        except ConfigError as e:
            print("REFUSED", e)
    """)
    assert ("INFO kvstage metrics: off: prometheus_client is not installed (pip install 'kvstage[metrics]'); "
            "no kvstage_* metrics from this process") in proc.stderr
    assert "REFUSED metrics_port=9400: needs prometheus_client; pip install 'kvstage[metrics]'" in proc.stdout


def test_a_switch_that_is_neither_on_nor_off_is_refused():
    proc = subprocess.run([sys.executable, "-c", "from kvstage import metrics; metrics.endpoint_metrics('dst', 0)"],
                          capture_output=True, text=True, env={**os.environ, "KVSTAGE_METRICS": "maybe"})
    assert proc.returncode != 0 and "KVSTAGE_METRICS='maybe': must be on or off" in proc.stderr


def test_peer_labels_are_capped_per_process():
    proc = run_python("""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        from kvstage import metrics
        metrics.MAX_PEER_LABELS = 3
        m = metrics.endpoint_metrics("dst", 0)
        for i in range(6):
            m.request_finished(f"pre/{i}", True, 0.1, 1)
        print(metrics.exposition().decode())
    """)
    got = samples(proc.stdout)
    peers = {dict(ls)["peer"]: v for (n, ls), v in got.items()
             if n == "kvstage_requests_total" and dict(ls)["result"] == "done"}
    assert peers == {"pre/0": 1, "pre/1": 1, "pre/2": 1, "other": 3}
    assert proc.stderr.count("more than 3 peers seen in this process") == 1


# -- the standalone port ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_port_serves_this_processs_metrics_once_at_port_plus_rank():
    port = _free_port() - 1  # rank 1 listens on port + 1
    proc = run_python(f"""
        import logging, sys, urllib.request
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        from kvstage import metrics
        from kvstage.config import Settings
        from kvstage.errors import ConfigError
        m = metrics.endpoint_metrics("dst", 1, "eng")
        m.request_finished("pre/0", True, 0.01, 123)
        m.slots(4, 8)
        s = Settings(metrics_port={port})
        where = metrics.start_from_settings(s, rank=1)
        assert where == ("127.0.0.1", {port + 1}), where
        assert metrics.start_from_settings(s, rank=0) == where  # a second endpoint of the process finds it
        assert metrics.serve({port + 1}) == where and metrics.serve(0) == where
        try:
            metrics.serve({port + 2})
        except ConfigError as e:
            print("REFUSED", e, file=sys.stderr)
        print(urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=10).read().decode())
    """)
    assert proc.stderr.count(f"kvstage metrics: serving http://127.0.0.1:{port + 1}/metrics") == 1
    assert (f"REFUSED metrics_port={port + 2}: this process serves its metrics on 127.0.0.1:{port + 1} already"
            in proc.stderr)
    got = samples(proc.stdout)
    ep = dict(role="dst", rank="1", engine="eng")
    assert value(got, "kvstage_requests_total", **ep, peer="pre/0", result="done") == 1
    assert value(got, "kvstage_slots_free", **ep) == 4


def test_metrics_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics_port={port}: cannot listen on 127.0.0.1:{port}"):
            metrics.serve(port)


# -- prometheus_client's multiprocess directory (how vLLM and SGLang collect their processes) ------------------

def test_multiprocess_directory_sums_processes_and_forgets_closed_endpoints(tmp_path):
    """Rank processes write into PROMETHEUS_MULTIPROC_DIR; a collector process reads them as an
    engine's /metrics does (``MultiProcessCollector``)."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    rank = """
        import os, sys, time
        from kvstage import metrics
        rank = int(sys.argv[1])
        m = metrics.endpoint_metrics("dst", rank, "eng")
        m.request_finished("pre/0", True, 0.02, 1000)
        m.failure("pre/0", "read", "no progress for 5 s: a read did not complete")
        m.slots(3, 8)
        m.in_flight(1)
        m.link("pre/0", "UCX shm", "INFO")
        m.link("pre/0", "UCX tcp", "WARNING")  # replaced: the directory keeps "UCX shm" at 0
        closed = metrics.endpoint_metrics("src", rank, "eng")
        closed.slots(8, 8)
        closed.close()
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        sys.stdin.readline()  # alive until told
    """
    full = {**os.environ, **env}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(rank), str(r)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=full, cwd=ROOT) for r in (0, 1)]
    collect = """
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        print(generate_latest(registry).decode())
    """
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        got = samples(run_python(collect, env=env).stdout)
        for r in ("0", "1"):
            ep = dict(role="dst", rank=r, engine="eng")
            assert value(got, "kvstage_requests_total", **ep, peer="pre/0", result="done") == 1
            assert value(got, "kvstage_failures_total", **ep, peer="pre/0", stage="read", cause="timeout") == 1
            assert value(got, "kvstage_request_seconds_count", **ep, peer="pre/0") == 1
            assert value(got, "kvstage_slots_free", **ep) == 3 and value(got, "kvstage_requests_in_flight", **ep) == 1
            assert value(got, "kvstage_link_info", **ep, path="UCX tcp", severity="WARNING") == 1
            assert value(got, "kvstage_link_info", **ep, path="UCX shm", severity="INFO") == 0
            assert value(got, "kvstage_slots_total", role="src", rank=r, engine="eng") == 0  # closed
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    got = samples(run_python(collect, env=env).stdout)
    # exited cleanly: their gauges are gone (live modes), their counters stay
    assert value(got, "kvstage_slots_free", role="dst", rank="0", engine="eng") is None
    assert value(got, "kvstage_requests_total", role="dst", rank="0", engine="eng", result="done") == 1


# -- an engine plugin's summary line ------------------------------------------------------------------------

def test_load_summary_is_one_line_a_minute_with_loads_bytes_and_p50():
    now = [100.0]
    s = metrics.LoadSummary("kvstage: rank 0", interval_s=60, clock=lambda: now[0])
    assert s.due() is None
    for seconds in (0.010, 0.030, 0.020):
        s.add(True, seconds, 2_000_000)
    s.add(False, 5.0, 0)
    now[0] = 159.0
    assert s.due() is None  # not a minute yet
    now[0] = 160.5
    assert s.due() == ("kvstage: rank 0: 4 KV loads in the last 60 s: 3 done, 1 failed, 6.0 MB, p50 20.0 ms, "
                       "max 30.0 ms")
    assert s.due() is None  # said; the next minute starts now
    now[0] = 400.0
    assert s.due() is None  # nothing loaded: nothing to say
    s.add(False, 1.0, 0)
    assert s.due() == "kvstage: rank 0: 1 KV loads in the last 240 s: 0 done, 1 failed, 0.0 MB"


def test_settings_carry_metrics_port():
    assert Settings(metrics_port=9400).metrics_port == 9400
    with pytest.raises(ConfigError, match=r"metrics_port=0: must be a port number in 1\.\.65535"):
        Settings(metrics_port=0)
    with pytest.raises(ConfigError, match="metrics_port=65535: rank 1 serves on metrics_port \\+ rank = 65536"):
        metrics.start_from_settings(Settings(metrics_port=65535), rank=1)
    assert json.dumps(metrics.CAUSES)  # the classes are plain strings (labels)
