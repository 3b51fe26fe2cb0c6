"""The kvstage transfer backend inside real SGLang 0.5.23 code (CPU, separate processes).

Registration is checked in this process; transfers run one process per
scheduler rank (tests/support/sglang_rank.py), the ranks of each side in one gloo
group, all scenarios at once to keep the run short on two cores:

- equal TP 1 -> 1, prefill TP 2 -> decode TP 1, 1 -> 2 (MHA, 4 KV heads), MLA 2 -> 1;
- KV pages and metadata rows byte-identical on every decode rank;
- state buffers (a hybrid SWA pool plus a mamba-style component, see tests/support/sglang_rank.py) at equal TP
  1 -> 1 and 2 -> 2: KV, metadata and state rows byte-identical; TP 2 -> 1 with state buffers: Failed on
  both sides with the reason (kvstage moves state rows at equal TP only);
- the comparison itself: a request whose prefill bytes are corrupted (one byte of KV, of the metadata
  row and of each state component, after the expected bytes are fixed) is reported as exactly those
  mismatches;
- an abort on either side, a prefill whose decode never calls (bootstrap
  timeout) and a decode whose prefill never sends (waiting timeout) end in
  Failed with a clear exception on the side(s) that hold the request, no hang;
- every prefill rank's kvstage metrics count the rooms its log reports failed (aborts on either side
  included), one each;
- decode TP 2, a failure only decode rank 1 sees (kvstage's, or SGLang's own as its heartbeat sets for
  a lost prefill): SGLang's poll all-reduce fails the room on rank 0 too, and rank 0 (whose exception
  is what a client gets) reports rank 1's cause;
- several prefill engines, one decode engine (xPyD): prefill engines at TP 2 and TP 1 feed one decode
  rank at TP 1, their rooms interleaved, through its one Destination, byte-identical; a prefill engine
  whose model identity differs (another dtype) is refused by name in kvstage's handshake, and one whose KV geometry gives
  the decode rank another spec is refused by the decode; both fail only their own rooms;
- the same model path and shapes with other weights (the checkpoint at the path replaced between the decode's start
  and the prefill's, no token anywhere): refused by name in kvstage's handshake, with both weights fingerprints, and
  the room fails on both sides.

Needs sglang (0.5.23); the main venv skips this file. CI installs it into its own venv (.ci/run).
"""

import importlib.util
import json
import os
import random
import re
import socket
import subprocess
import sys
import time

import pytest

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("KVSTAGE_REQUIRE_SGLANG"):
        raise ImportError("KVSTAGE_REQUIRE_SGLANG is set but sglang is not importable")
    pytest.skip("sglang is not importable here (CI runs these in the SGLang venv, see .ci/run)", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
from support import sglang_cpu  # noqa: E402

# SGLang's timeouts in these runs: the decode's waiting timeout must strike while the prefill ranks are still
# alive (they stay until their own bootstrap timeout), or the decode sees "connection lost" instead
BOOTSTRAP_TIMEOUT_S, WAITING_TIMEOUT_S = 25, 10
OK = [{"room": 1001, "tokens": 10}, {"room": 2002, "tokens": 37}]
ABORTS = [{"room": 3003, "tokens": 9, "abort": "prefill"},
          {"room": 4004, "tokens": 9, "abort": "decode", "hold_s": 6}]
TIMEOUTS = [{"room": 5005, "tokens": 5, "abort": "never_decode"},
            {"room": 6006, "tokens": 5, "abort": "never_prefill"}]
CORRUPT = [{"room": 7007, "tokens": 13, "corrupt": True}]
# a failure only decode rank 1 sees (its kvstage request aborted; or SGLang's own, as its heartbeat fails
# the rooms of a lost prefill); the prefill stays silent meanwhile
ONE_RANK = [{"room": 8008, "tokens": 9, "abort": "decode_rank1", "hold_s": 4},
            {"room": 8118, "tokens": 9, "abort": "decode_rank1_sglang", "hold_s": 4}]
# several prefill engines into one decode engine at TP 1: name -> (prefill TP, requests, config overrides)
PREFILL_ENGINES = {
    "tp2": (2, [{"room": 9101, "tokens": 23}, {"room": 9102, "tokens": 6}], {}),
    "tp1": (1, [{"room": 9201, "tokens": 17}, {"room": 9202, "tokens": 40}], {}),
    # served in float16 (the others: SGLang's "auto"): another model identity
    "other-model": (1, [{"room": 9301, "tokens": 9}], {"dtype": "float16"}),
    # 8 KV heads of 4 elements: the same bytes per page as the decode's 4 heads of 8, another spec
    "other-geometry": (1, [{"room": 9401, "tokens": 9}], {"kv_heads": 8, "head_dim": 4}),
}
SCENARIOS = {  # name: (prefill TP, decode TP, MLA, requests, state buffers)
    "tp1-1": (1, 1, False, OK, False),
    "tp2-1": (2, 1, False, OK + ABORTS + TIMEOUTS, False),
    "tp1-2": (1, 2, False, OK + ABORTS + ONE_RANK, False),
    "mla2-1": (2, 1, True, OK, False),
    "state1-1": (1, 1, False, OK + CORRUPT, True),
    "state2-2": (2, 2, False, OK, True),
    "state2-1": (2, 1, False, OK[:1], True),
}


_PICKED: set = set()


def _port() -> int:
    """A free port outside the kernel's ephemeral range, for a server a rank binds later.

    A port from bind(0) is ephemeral: between its release here and the rank's
    bind, kvstage's listeners (port 0) or any outgoing connection of the many
    rank processes could take it (seen: EADDRINUSE on the gloo store)."""
    lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    low, high = (10000, lo) if lo > 11000 else (hi + 1, 65536)
    rng = random.Random()
    while True:
        port = rng.randrange(low, high)
        if port in _PICKED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PICKED.add(port)
        return port


def _rank_env() -> dict:
    return dict(os.environ, KVSTAGE_ARENA_MB="2", KVSTAGE_STALL_TIMEOUT_S="60",
                SGLANG_HOST_IP="127.0.0.1", SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(BOOTSTRAP_TIMEOUT_S),
                SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(WAITING_TIMEOUT_S), PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every scenario's ranks at once; return {scenario: {(role, rank): results}}."""
    logs = tmp_path_factory.mktemp("sglang")
    env = _rank_env()
    procs = []
    for name, (ptp, dtp, mla, reqs, state) in SCENARIOS.items():
        bootstrap, http = _port(), _port()
        for role, tp in (("prefill", ptp), ("decode", dtp)):
            store = _port()
            for rank in range(tp):
                cfg = dict(role=role, tp=tp, rank=rank, mla=mla, state=state, kv_heads=4, http_port=http,
                           bootstrap_port=bootstrap, store_port=store, requests=reqs, deadline_s=200)
                log = open(logs / f"{name}-{role}{rank}.log", "w")
                procs.append((name, role, rank, log, subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "support", "sglang_rank.py"), json.dumps(cfg)],
                    env=env, stdout=subprocess.PIPE, stderr=log, text=True)))
    procs += _many_prefills(env, logs)
    out: dict = {name: {} for name in list(SCENARIOS) + ["many"]}
    deadline = time.monotonic() + 400
    try:
        for name, role, rank, log, p in procs:
            stdout, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                log.flush()
                tail = open(log.name).read()[-3000:]
                raise AssertionError(f"{name} {role} rank {rank} exited {p.returncode} without a result:\n{tail}")
            out[name][(role, rank)] = json.loads(lines[-1][7:])["results"]
    finally:
        for *_, log, p in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    return out


def _many_prefills(env: dict, logs) -> list:
    """Scenario "many": every engine of PREFILL_ENGINES (each with its own bootstrap server) and one
    decode rank that receives all their rooms, interleaved; results under role "prefill:<engine>"."""
    procs, decode_reqs = [], []
    for engine, (tp, reqs, extra) in PREFILL_ENGINES.items():
        bootstrap, http, store = _port(), _port(), _port()
        decode_reqs += [dict(r, bootstrap_port=bootstrap) for r in reqs]
        for rank in range(tp):
            cfg = dict(dict(role="prefill", tp=tp, rank=rank, mla=False, kv_heads=4, http_port=http,
                            bootstrap_port=bootstrap, store_port=store, requests=reqs, deadline_s=200), **extra)
            log = open(logs / f"many-{engine}-prefill{rank}.log", "w")
            procs.append(("many", f"prefill:{engine}", rank, log, subprocess.Popen(
                [sys.executable, os.path.join(HERE, "support", "sglang_rank.py"), json.dumps(cfg)],
                env=env, stdout=subprocess.PIPE, stderr=log, text=True)))
    cfg = dict(role="decode", tp=1, rank=0, mla=False, kv_heads=4, http_port=_port(),
               bootstrap_port=decode_reqs[0]["bootstrap_port"], store_port=_port(), requests=decode_reqs,
               deadline_s=200, report_engines=True)
    log = open(logs / "many-decode0.log", "w")
    procs.append(("many", "decode", 0, log, subprocess.Popen(
        [sys.executable, os.path.join(HERE, "support", "sglang_rank.py"), json.dumps(cfg)],
        env=env, stdout=subprocess.PIPE, stderr=log, text=True)))
    return procs


def test_registration():
    """After load_plugins: CLI choice, a real TransferBackend member, our classes; other backends unchanged."""
    sglang_cpu.install()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import argparse

    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.server_args import ServerArgs

    from kvstage.plugin.sglang import conn as sglang_conn

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "kvstage"])
    assert ns.disaggregation_transfer_backend == "kvstage"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "no-such-backend"])
    member = TransferBackend("kvstage")
    assert member is TransferBackend.KVSTAGE and member.value == "kvstage" and member in list(TransferBackend)
    assert get_kv_class(member, KVClassType.MANAGER) is sglang_conn.KVStageManager
    assert get_kv_class(member, KVClassType.SENDER) is sglang_conn.KVStageSender
    assert get_kv_class(member, KVClassType.RECEIVER) is sglang_conn.KVStageReceiver
    assert get_kv_class(member, KVClassType.BOOTSTRAP_SERVER) is sglang_conn.KVStageBootstrapServer
    from sglang.srt.disaggregation.base.conn import KVArgs

    assert get_kv_class(member, KVClassType.KVARGS) is KVArgs
    from sglang.srt.disaggregation.fake import FakeKVManager
    from sglang.srt.disaggregation.nixl import NixlKVManager

    assert get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER) is NixlKVManager
    assert get_kv_class(TransferBackend("fake"), KVClassType.MANAGER) is FakeKVManager
    assert [m.value for m in TransferBackend][:5] == ["mooncake", "mori", "nixl", "ascend", "fake"]


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s[0] == s[1] or not s[4]])
def test_transfer_byte_identical(runs, name):
    ptp, dtp, _, _, state = SCENARIOS[name]
    res = runs[name]
    for rank in range(ptp):
        for r in OK:
            assert res[("prefill", rank)][str(r["room"])] == {"state": "success"}, (name, rank, r)
    for rank in range(dtp):
        for r in OK:
            got = res[("decode", rank)][str(r["room"])]
            want = {"state": "success", "kv_mismatch": [], "aux_mismatch": [], "room_row": r["room"]}
            if state:  # SWA window pages (a partial last page included) and one mamba slot, every buffer compared
                want.update(state_mismatch=[], state_rows=[-(-r["tokens"] // 4) - max(0, r["tokens"] - 8) // 4, 1])
            assert got == want, (name, rank, got)


def test_state_buffers_refused_across_tp(runs):
    """Prefill TP 2 -> decode TP 1 with state buffers: Failed on both sides with the reason, no hang."""
    res = runs["state2-1"]
    room = str(OK[0]["room"])
    errors = [res[("prefill", rank)][room] for rank in range(2)] + [res[("decode", 0)][room]]
    for got in errors:
        assert got["state"] == "failed", errors
    # each prefill rank refuses before sending; the MIN all-reduce may report the other's failure instead
    assert any("state buffers" in g["error"] and "equal TP only" in g["error"] for g in errors[:2]), errors
    assert "prefill rank " in errors[2]["error"] and "equal TP only" in errors[2]["error"], errors[2]


def test_corruption_is_detected(runs):
    """The byte comparison can fail: one corrupted byte each of KV, metadata row and state rows is reported."""
    res = runs["state1-1"]
    room = str(CORRUPT[0]["room"])
    assert res[("prefill", 0)][room] == {"state": "success"}
    got = res[("decode", 0)][room]
    assert got["state"] == "success" and got["room_row"] == CORRUPT[0]["room"], got
    assert got["kv_mismatch"] == ["layer 2 plane 1"], got
    assert got["aux_mismatch"] == [0], got
    assert got["state_mismatch"] == ["component 0 buffer 3", "component 1 buffer 3"], got


@pytest.mark.parametrize("name", ["tp2-1", "tp1-2"])
def test_abort_from_either_side(runs, name):
    ptp, dtp, _, _, _ = SCENARIOS[name]
    res = runs[name]
    for rank in range(ptp):
        got = res[("prefill", rank)]
        assert got["3003"]["state"] == "failed" and "Aborted by AbortReq" in got["3003"]["error"], got["3003"]
    # the decode's abort reaches each prefill rank on its own: a rank that has not read it yet when the MIN
    # all-reduce turns Failed reports SGLang's "from another rank"; at least one rank names the cause
    got = [res[("prefill", rank)]["4004"] for rank in range(ptp)]
    assert all(g["state"] == "failed" and ("decode aborted" in g["error"] or "from another rank" in g["error"])
               for g in got), got
    assert any("decode aborted" in g["error"] for g in got), got
    # each decode rank: the prefill's own record ("Aborted by AbortReq.") or kvstage's, from whichever prefill
    # rank (each aborts) reached the wire first. A decode rank reports Failed only once the others hold the
    # cause, so every decode rank names the prefill rank and the abort (never SGLang's "from another rank")
    got = [res[("decode", rank)]["3003"] for rank in range(dtp)]
    assert all(g["state"] == "failed" and re.search(f"prefill rank [0-{ptp - 1}]: ", g["error"])
               and "abort" in g["error"].lower() for g in got), got
    for rank in range(dtp):
        got = res[("decode", rank)]
        assert got["4004"]["state"] == "failed" and "Aborted by AbortReq" in got["4004"]["error"], got["4004"]


def test_failure_seen_by_one_decode_rank_reaches_every_decode_rank(runs):
    """Decode TP 2: only decode rank 1 sees the failure (its kvstage request aborted, or SGLang's own
    Failed, as its heartbeat sets for a lost prefill), and the prefill stays silent for 4 s. SGLang's MIN all-reduce fails the room on rank 0 too, and rank 0's
    failure_exception() is the one a client gets: it must carry rank 1's cause, not SGLang's
    "Failed due to an unknown reason from another rank"."""
    res = runs["tp1-2"]
    for room, cause in (("8008", "its kvstage request aborted"), ("8118", "SGLang failed the room")):
        got = [res[("decode", rank)][room] for rank in range(2)]
        assert all(g["state"] == "failed" and "injected on decode rank 1" in g["error"] and cause in g["error"]
                   for g in got), got
        assert got[0]["error"].startswith("KVTransferError") and "decode rank 1: " in got[0]["error"], got[0]
        assert res[("prefill", 0)][room]["state"] == "failed", res[("prefill", 0)][room]


def test_timeouts_fail_cleanly(runs):
    res = runs["tp2-1"]
    got = [res[("prefill", rank)]["5005"] for rank in range(2)]
    assert all(g["state"] == "failed" for g in got), got
    # the rank that timed out says so; the MIN all-reduce fails the other with SGLang's "from another rank"
    assert any("timed out" in g["error"] and "KVPoll.Bootstrapping" in g["error"] for g in got), got
    got = res[("decode", 0)]["6006"]
    assert got["state"] == "failed" and "KVPoll.WaitingForInput" in got["error"], got


def test_several_prefill_engines_one_decode_endpoint(runs):
    """Prefill engines at TP 2 and TP 1 feed one decode rank, their rooms interleaved: every room
    byte-identical, through the decode rank's one Destination, which serves both engines."""
    res = runs["many"]
    dec = res[("decode", 0)]
    for engine in ("tp2", "tp1"):
        tp, reqs, _ = PREFILL_ENGINES[engine]
        for r in reqs:
            for rank in range(tp):
                assert res[(f"prefill:{engine}", rank)][str(r["room"])] == {"state": "success"}, (engine, rank, r)
            want = {"state": "success", "kv_mismatch": [], "aux_mismatch": [], "room_row": r["room"]}
            assert dec[str(r["room"])] == want, (engine, r, dec[str(r["room"])])
    assert dec["engines"] == 2, dec  # the two prefill engines, on one Destination (the refused ones never joined)


def test_another_model_or_geometry_is_refused_by_name(runs):
    """A prefill engine whose model identity differs (served in another dtype): kvstage's handshake
    refuses it, naming both identities; one whose KV gives the decode rank another spec: the decode
    refuses it, saying why. Each fails only its own room, on both sides."""
    res = runs["many"]
    dec = res[("decode", 0)]
    got, pre = dec["9301"], res[("prefill:other-model", 0)]["9301"]
    for g in (got, pre):
        ids = set(re.findall(r"'(dummy#[0-9a-f]{16})'", g["error"]))
        assert g["state"] == "failed" and "model: " in g["error"] and len(ids) == 2, g
    got, pre = dec["9401"], res[("prefill:other-geometry", 0)]["9401"]
    assert got["state"] == "failed" and "cannot send to this decode" in got["error"] \
        and "the first prefill's" in got["error"], got
    assert pre["state"] == "failed" and "decode rank 0: " in pre["error"] and "the first prefill's" in pre["error"], pre


# -- the identity covers the weights: one path, one config, two checkpoints ----------------------

WEIGHTS_ROOM = {"room": 9501, "tokens": 9}


def _rank(cfg: dict, log_path, env: dict) -> tuple:
    log = open(log_path, "w")
    return log, subprocess.Popen([sys.executable, os.path.join(HERE, "support", "sglang_rank.py"), json.dumps(cfg)],
                                 env=env, stdout=subprocess.PIPE, stderr=log, text=True)


def _result(name: str, log, p, deadline: float) -> dict:
    stdout, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
    log.close()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, \
        f"{name} exited {p.returncode} without a result:\n{open(log.name).read()[-3000:]}"
    return json.loads(lines[-1][7:])["results"]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """A decode rank started on a checkpoint at ``current``; then ``current`` replaced by another checkpoint of the
    same config and shapes (another seed: a rolling update of ``/models/current``), and a prefill rank started on it.
    No token anywhere (the docs' recipe). Returns both ranks' identities and results, and both fingerprints."""
    import shutil

    from support import sglang_servers as S

    from kvstage.plugin import fingerprint

    root = tmp_path_factory.mktemp("sglang-weights")
    model = str(root / "current")
    S.build_model(model, seed=0)
    fps = {"decode": fingerprint.checkpoint(model)}
    env = _rank_env()
    env.pop("KVSTAGE_AUTH_TOKEN", None)  # tests/conftest.py sets one for this process
    bootstrap, http = _port(), _port()
    common = dict(tp=1, rank=0, mla=False, kv_heads=4, bootstrap_port=bootstrap, requests=[WEIGHTS_ROOM],
                  deadline_s=200, model_path=model)
    ready = {role: str(root / f"{role}.identity") for role in ("decode", "prefill")}
    procs = {}
    deadline = time.monotonic() + 300
    try:
        procs["decode"] = _rank(dict(common, role="decode", http_port=_port(), store_port=_port(),
                                     ready_file=ready["decode"]), root / "decode.log", env)
        while not os.path.exists(ready["decode"]):  # the decode fingerprinted the first checkpoint
            assert procs["decode"][1].poll() is None, open(root / "decode.log").read()[-3000:]
            assert time.monotonic() < deadline, "the decode rank never took its model identity"
            time.sleep(0.2)
        shutil.rmtree(model)
        S.build_model(model, seed=1)
        fps["prefill"] = fingerprint.checkpoint(model)
        procs["prefill"] = _rank(dict(common, role="prefill", http_port=http, store_port=_port(),
                                      ready_file=ready["prefill"]), root / "prefill.log", env)
        results = {role: _result(role, *procs[role], deadline) for role in ("prefill", "decode")}
    finally:
        for log, p in procs.values():
            if p.poll() is None:
                p.kill()
            log.close()
    identities = {role: open(path).read() for role, path in ready.items()}
    return {"model": model, "fingerprints": fps, "identities": identities, "results": results}


def test_the_same_path_and_shapes_with_other_weights_are_refused_by_name(other_weights):
    """The prefill loaded other weights at the decode's model path (same config and shapes): its KV would decode
    wrong tokens. kvstage's handshake refuses it, naming both weights fingerprints; the room fails on both sides
    (no KV lands: a failed request, not wrong tokens)."""
    fp_d, fp_p = other_weights["fingerprints"]["decode"], other_weights["fingerprints"]["prefill"]
    assert fp_d and fp_p and fp_d != fp_p, other_weights["fingerprints"]
    ids = other_weights["identities"]
    for role, fp in (("decode", fp_d), ("prefill", fp_p)):  # each side fingerprinted what it loaded
        assert ids[role].startswith(other_weights["model"] + "#") and ids[role].endswith(" weights=" + fp), ids
    assert ids["decode"].split(" weights=")[0] == ids["prefill"].split(" weights=")[0], ids  # path and shapes agree
    room = str(WEIGHTS_ROOM["room"])
    for role in ("decode", "prefill"):
        got = other_weights["results"][role][room]
        assert got["state"] == "failed", (role, got)
        assert "model weights" in got["error"] and fp_d in got["error"] and fp_p in got["error"], (role, got)


def test_prefill_counts_each_failed_room_it_logs(runs):
    """Each prefill rank's kvstage failed requests (``kvstage_requests_total{result="failed"}``, and
    ``kvstage_failures_total``) equal its "room N failed" WARNINGs, one per room: aborts on either side (a
    client that gives up), a decode's waiting timeout, a refused peer, each failed before kvstage sent a
    chunk of it. Issue 50: such rooms were logged and counted 0."""
    for name, res in runs.items():
        for (role, rank), got in res.items():
            if not role.startswith("prefill"):
                continue
            m = got["metrics"]
            assert len(set(m["logged"])) == len(m["logged"]), (name, role, rank, m)  # one WARNING per room
            assert m["failed"] == m["failures"] == len(m["logged"]), (name, role, rank, m)
    for name in ("tp2-1", "tp1-2"):  # a prefill's abort and a decode's, on every prefill rank
        for rank in range(SCENARIOS[name][0]):
            m = runs[name][("prefill", rank)]["metrics"]
            assert {"3003", "4004"} <= set(m["logged"]), (name, rank, m)
            assert m["by_cause"].get("start/aborted", 0) >= 1, (name, rank, m)
