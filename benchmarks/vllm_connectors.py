"""Decode time to first token and KV load time: KVStageConnector vs vLLM's NixlConnector.

Same engines (vLLM CPU, a random Llama built here), same prompts. Both connectors' engines start
first; rounds then alternate the connectors' order. For each prefill TP ->
decode TP 1 pair and round: the prefill engine prefills the prompts, then the
decode engine serves them one at a time with ``max_tokens=1``. Per request:

- TTFT: wall time of the decode engine's ``generate`` (request in, first token out);
- KV load: from the engine step whose connector metadata starts the load to
  the step whose ``get_transfer_results`` reports it finished (the same hooks
  around either connector's worker, tests/support/vllm_engine.py ``LoadClock``).

The first request of each pair also pays connection setup and is reported
apart. Plain TTFT (the decode engine computing the prompt itself) is the
reference, and every decode's first token is checked against it.

    python -m benchmarks.vllm_connectors [--prompt-len 1000] [--requests 4] [--rounds 3] [--json out.json]

Run from the repository root: the helpers it shares with the tests import as ``tests.support``.

Needs a venv from ``bash .ci/vllm-venv`` plus ``nixl==1.5.1`` (``--no-deps``) for NixlConnector.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time

from tests.support.vllm_engine import SHARED_CORES, EngineProcess
from tests.support.vllm_model import build, prompts

TOKEN = secrets.token_hex(16)
MODEL = dict(layers=8, heads=8, kv_heads=8, head_dim=64, intermediate=1024, max_len=2048)


def engine_env(connector: str, port: int) -> dict:
    env = dict(SHARED_CORES)
    if connector == "nixl":
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(port))
    return env


def start_engines(connector, model, pairs, root, kv_mb, port0):
    common = ["--model", model, "--connector", connector, "--max-len", str(MODEL["max_len"]), "--kv-mb", str(kv_mb)]
    # kvstage at its defaults, with an auth token: without one it never takes the direct path (equal TP)
    extra = ["--extra", json.dumps({"auth_token": TOKEN})] if connector == "kvstage" else []
    engines = {}
    for i, tp in enumerate(sorted({p for p, _ in pairs}, reverse=True)):
        engines[tp] = EngineProcess(f"{connector}-P{tp}", os.path.join(root, f"{connector}-P{tp}.log"), *common,
                                    *extra, "--tp", str(tp), "--role", "kv_producer",
                                    env=engine_env(connector, port0 + 10 * i))
    engines["D"] = EngineProcess(f"{connector}-D", os.path.join(root, f"{connector}-D.log"), *common, *extra,
                                 "--tp", "1", "--role", "kv_consumer", env=engine_env(connector, port0 + 90))
    return engines


def run(connectors, model, ps, pairs, root, kv_mb, rounds):
    """Every engine of every connector starts first (idle engines cost no CPU); then rounds
    alternate the connectors' order, so slow periods of a shared machine hit both alike."""
    stacks = {c: start_engines(c, model, pairs, root, kv_mb, 5600 + 100 * i) for i, c in enumerate(connectors)}
    rows = {(c, p, d): {"connector": c, "prefill_tp": p, "decode_tp": d, "ttft_s": [], "load_s": [],
                        "plain_ttft_s": [], "tokens_match": True, "finish": set(), "loadavg_1min": []}
            for c in connectors for p, d in pairs}
    try:
        for e in [e for st in stacks.values() for e in st.values()]:
            e.read(timeout=900)
        for r in range(rounds):
            for c in connectors if r % 2 == 0 else connectors[::-1]:
                dec = stacks[c]["D"]
                plain = dec.cmd(cmd="timed", prompts=ps, params=[None] * len(ps), timeout=600)["outputs"]
                for ptp, dtp in pairs:
                    row = rows[(c, ptp, dtp)]
                    row["loadavg_1min"].append(os.getloadavg()[0])
                    pre = stacks[c][ptp].cmd(cmd="prefill", prompts=ps, timeout=600)["outputs"]
                    out = dec.cmd(cmd="timed", prompts=ps, params=[o["params"] for o in pre], timeout=600)["outputs"]
                    row["ttft_s"] += [o["seconds"] for o in out]
                    row["load_s"] += [o.get("load_s") for o in out]
                    row["plain_ttft_s"] += [o["seconds"] for o in plain]
                    row["tokens_match"] &= [o["tokens"] for o in out] == [o["tokens"] for o in plain]
                    row["errors"] = row.get("errors", 0) + sum(o["finish"] == "error" for o in out)
                    row["finish"] |= {o["finish"] for o in out}
        for row in rows.values():
            row["finish"] = sorted(row["finish"])
        return list(rows.values())
    finally:
        for st in stacks.values():
            for e in st.values():
                e.stop()


def kv_bytes(n: int) -> int:
    return -(-n // 32) * 32 * MODEL["layers"] * MODEL["kv_heads"] * 2 * MODEL["head_dim"] * 4


def ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def table(rows, n_tokens) -> str:
    lines = [f"KV per request: {kv_bytes(n_tokens) / 2**20:.0f} MiB ({n_tokens} tokens, float32)", "",
             "| connector | prefill TP → decode TP | decode TTFT median (ms) | KV load median [min, max] (ms) "
             "| first request TTFT / load (ms) | plain TTFT median (ms) | tokens = plain | load avg |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft, load = r["ttft_s"][1:], [x for x in r["load_s"][1:] if x is not None]
        load_s = f"{ms(statistics.median(load))} [{ms(min(load))}, {ms(max(load))}]" if load else "n/a"
        first_load = ms(r["load_s"][0]) if r["load_s"][0] is not None else "n/a"
        match = "yes" if r["tokens_match"] else "NO"
        if r.get("errors"):
            match += f" ({r['errors']} failed)"
        lines.append(f"| {r['connector']} | {r['prefill_tp']} → {r['decode_tp']} | {ms(statistics.median(ttft))} | "
                     f"{load_s} | {ms(r['ttft_s'][0])} / {first_load} | {ms(statistics.median(r['plain_ttft_s']))} | "
                     f"{match} | {min(r['loadavg_1min']):.1f}–{max(r['loadavg_1min']):.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=4, help="prompts per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", default="2:1,1:1", help="prefill TP:decode TP pairs (decode TP 1 only)")
    ap.add_argument("--connectors", default="kvstage,nixl")
    ap.add_argument("--kv-mb", type=int, default=512)
    ap.add_argument("--json", help="write raw results here")
    args = ap.parse_args()
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",")]
    if any(d != 1 for _, d in pairs):
        ap.error("the load clock reads the decode worker in-process: decode TP must be 1")
    root = tempfile.mkdtemp(prefix="kvstage-vllm-bench-")
    t0 = time.perf_counter()
    model = build(os.path.join(root, "model"), **MODEL)
    ps = prompts([args.prompt_len] * args.requests, seed=3)
    rows = run(args.connectors.split(","), model, ps, pairs, root, args.kv_mb, args.rounds)
    print(table(rows, args.prompt_len))
    print(f"\n{args.rounds} rounds x {args.requests} requests per row; medians leave out each row's first request "
          "(it also sets up the connections).\nload avg: the 1-minute load average at the start of each round "
          "(2 cores; other jobs may share them)")
    print(f"\n({time.perf_counter() - t0:.0f} s; engine logs in {root})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "model": MODEL, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
