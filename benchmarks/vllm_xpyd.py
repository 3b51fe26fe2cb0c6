"""xPyD in real vLLM CPU engines: two prefill engines (TP 2 and TP 1), one decode engine (TP 1),
KVStageConnector against vLLM's NixlConnector, the same model and prompts for both.

Per connector three engines (tests/support/vllm_engine.py, one process each, unpinned on the
machine's cores as ``SHARED_CORES`` says): ``P2`` (TP 2), ``P1`` (TP 1), ``D`` (TP 1,
``kv_load_failure_policy="fail"`` so that a failed load shows as a failed request). A minimal
router in this script sends request *i* to ``P2`` when *i* is even and to ``P1`` when odd
(``max_tokens=1``, ``do_remote_decode``), then the same prompt to ``D`` with the returned
``kv_transfer_params``, keeping ``--inflight`` requests in the pipeline.

1. **Plain reference.** Each ``D`` computes every prompt itself (no transfer); the two connectors'
   decode engines must agree, and every disaggregated decode must give the same tokens.
2. **New peers.** One request through ``P2``, then one through ``P1``, alone: the *first-request
   load* of each new peer engine. For kvstage, every worker's endpoints and staging arenas are read
   before the first request and after each (``endpoints``): they must not grow with the peers.
3. **Load.** ``--rounds`` rounds of ``--requests`` requests, ``--inflight`` in flight, prompts of
   ``--min-len``..``--max-len`` tokens; rounds alternate the connectors' order.

Per request: *decode TTFT* (``D``'s ``add_request`` to its first token) and *KV load* (from the
engine step whose connector metadata starts the load to the step that reports it received: the same
hooks around either connector, ``LoadClock``). p50/p99 are nearest-rank over the load rounds.

    python -m benchmarks.vllm_xpyd [--requests 24] [--inflight 4] [--rounds 2] [--json out.json]

Run from the repository root: the helpers it shares with the tests import as ``tests.support``.

kvstage runs at its defaults (timeouts, arena) with an auth token (without one it never takes the
direct path). ``--trace`` logs every kvstage event for benchmarks/vllm_timeline.py. Needs a venv from ``bash .ci/vllm-venv`` plus ``nixl==1.5.1`` (``--no-deps``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import secrets
import tempfile
import threading
import time

from tests.support.vllm_engine import SHARED_CORES, EngineProcess
from tests.support.vllm_model import build, prompts

MODEL = dict(layers=8, heads=8, kv_heads=8, head_dim=64, intermediate=1024, max_len=2048)
PREFILL = {"P2": 2, "P1": 1}  # name -> TP


def trace_config(root: str, label: str) -> str:
    """A vLLM logging config (``VLLM_LOGGING_CONFIG_PATH``) that stamps every line with the host clock
    and the engine's name and shows kvstage's DEBUG lines (endpoints, connector, load clock)."""
    path = os.path.join(root, f"logging-{label}.json")
    handler = {"class": "logging.StreamHandler", "formatter": "t", "stream": "ext://sys.stdout"}
    with open(path, "w") as f:
        json.dump({"version": 1, "disable_existing_loggers": False,
                   "formatters": {"t": {"format": f"%(created).6f %(levelname)s {label} %(message)s"}},
                   "handlers": {"h": handler},
                   "loggers": {"vllm": {"handlers": ["h"], "level": "INFO", "propagate": False},
                               "vllm.kvstage": {"level": "DEBUG"},
                               "kvstage": {"handlers": ["h"], "level": "DEBUG", "propagate": False}}}, f)
    return path


#: a label of ``--connectors`` -> (the connector, its extra config beyond the token): ``kvstage-streamed`` is
#: kvstage sending prompts of 512 tokens or more in layer groups during the forward (``stream_layers``)
VARIANTS = {"kvstage": ("kvstage", {}), "kvstage-streamed": ("kvstage", {"stream_layers": True}), "nixl": ("nixl", {})}


def start(label: str, model: str, root: str, kv_mb: int, port0: int, extra: dict, trace: bool = False) -> dict:
    connector, more = VARIANTS[label]
    extra = {**extra, **more} if connector == "kvstage" else {}
    common = ["--model", model, "--connector", connector, "--max-len", str(MODEL["max_len"]), "--kv-mb", str(kv_mb)]
    if extra:
        common += ["--extra", json.dumps(extra)]
    engines = {}
    for i, (name, tp) in enumerate([*PREFILL.items(), ("D", 1)]):
        env = dict(SHARED_CORES)
        if trace:
            env["VLLM_LOGGING_CONFIG_PATH"] = trace_config(root, f"{label}-{name}")
        if connector == "nixl":
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(port0 + 10 * i))
        role = "kv_consumer" if name == "D" else "kv_producer"
        engines[name] = EngineProcess(f"{label}-{name}", os.path.join(root, f"{label}-{name}.log"), *common,
                                      "--tp", str(tp), "--role", role, "--policy", "fail", env=env)
    return engines


class Router:
    """Prefill on ``P2``/``P1`` by parity, then decode on ``D``, ``inflight`` requests at a time."""

    def __init__(self, engines: dict):
        self.engines = engines
        self.events: queue.Queue = queue.Queue()
        for name, e in engines.items():
            threading.Thread(target=self._forward, args=(name, e), daemon=True).start()

    def _forward(self, name: str, e: EngineProcess) -> None:
        while True:
            reply = e.done.get()
            self.events.put((name, reply))
            if reply.get("done") is None:
                return

    def run(self, tag: str, ps: list, idx: list[int], inflight: int, max_tokens: int, timeout: float = 900) -> list:
        todo, active, out = list(idx), {}, []
        deadline = time.monotonic() + timeout

        def begin(i):
            rid = f"{tag}-{i}"
            p = "P2" if i % 2 == 0 else "P1"
            active[rid] = {"rid": rid, "i": i, "prefill": p, "len": len(ps[i]), "t0": time.perf_counter()}
            self.engines[p].submit(rid, ps[i], {"do_remote_decode": True}, 1)

        while todo or active:
            while todo and len(active) < inflight:
                begin(todo.pop(0))
            try:
                name, reply = self.events.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{tag}: {len(active)} requests unfinished after {timeout:g} s") from None
            rid = reply.get("done")
            if rid is None or "error" in reply:
                raise RuntimeError(f"{tag}: engine {name}: {reply}")
            r = active[rid]
            if name != "D":  # prefilled: hand to the decode engine
                r["prefill_s"] = reply["e2e_s"]
                r["prefill_finish"] = reply["finish"]
                self.engines["D"].submit(rid, ps[r["i"]], reply["params"], max_tokens)
                continue
            del active[rid]
            r.update(tokens=reply["tokens"], finish=reply["finish"], ttft_s=reply["ttft_s"], load_s=reply["load_s"],
                     decode_s=reply["e2e_s"], total_s=time.perf_counter() - r.pop("t0"), loadavg=os.getloadavg()[0],
                     received_s=reply.get("received_s"), report_wait_s=reply.get("report_wait_s"))
            if "recv" in reply:  # kvstage: the decode rank's receive (path, bytes, error)
                r.update(path=reply["recv"]["path"], recv_ok=reply["recv"]["ok"], recv_error=reply["recv"]["error"])
            out.append(r)
        return sorted(out, key=lambda r: r["i"])


def endpoints(engines: dict) -> dict:
    return {name: e.cmd(cmd="endpoints", timeout=600)["outputs"] for name, e in engines.items()}


def pct(xs: list, q: float) -> float | None:
    """Nearest-rank percentile."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[max(0, min(len(xs) - 1, -(-len(xs) * q // 100) - 1))] if q < 100 else xs[-1]


def ms(x) -> str:
    return "n/a" if x is None else f"{1000 * x:,.1f}"


def summarize(res: dict, ref: list) -> list[dict]:
    rows = []
    for c, r in res.items():
        for p in PREFILL:
            load = [x for x in r["load"] if x["prefill"] == p]
            first = [x for x in r["first"] if x["prefill"] == p]
            bad = [x["i"] for x in load + first if x["tokens"] != ref[x["i"]]]
            rows.append({
                "connector": c, "pair": f"{PREFILL[p]}→1", "prefill": p, "n": len(load),
                "ttft_p50": pct([x["ttft_s"] for x in load], 50), "ttft_p99": pct([x["ttft_s"] for x in load], 99),
                "load_p50": pct([x["load_s"] for x in load], 50), "load_p99": pct([x["load_s"] for x in load], 99),
                "received_p50": pct([x.get("received_s") for x in load], 50),
                "report_wait_p50": pct([x.get("report_wait_s") for x in load], 50),
                "first_load": first[0]["load_s"] if first else None, "first_ttft": first[0]["ttft_s"] if first else None,
                "mismatched": len(bad), "failed": sum(x["finish"] == "error" for x in load + first),
                "loadavg": [min(x["loadavg"] for x in load + first), max(x["loadavg"] for x in load + first)],
                "paths": sorted({x.get("path") for x in load + first if x.get("path")}),
            })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| connector | prefill TP → decode TP | requests | decode TTFT p50 / p99 (ms) | KV load p50 / p99 (ms) "
             "| first request: KV load / TTFT (ms) | mismatched requests | failed | load avg |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        path = f" ({', '.join(r['paths'])})" if r["paths"] else ""
        lines.append(f"| {r['connector']}{path} | {r['pair']} | {r['n']} | {ms(r['ttft_p50'])} / {ms(r['ttft_p99'])} | "
                     f"{ms(r['load_p50'])} / {ms(r['load_p99'])} | {ms(r['first_load'])} / {ms(r['first_ttft'])} | "
                     f"{r['mismatched']} | {r['failed']} | {r['loadavg'][0]:.0f}–{r['loadavg'][1]:.0f} |")
    return "\n".join(lines)


def split_table(rows: list[dict], res: dict) -> str:
    """Where kvstage's load time goes, and how often each decode engine stepped."""
    lines = ["| connector | prefill TP → decode TP | KV load p50 (ms) | of it: until every byte is here, p50 (ms) "
             "| then until the step that reports it, p50 (ms) |", "|---|---|--:|--:|--:|"]
    for r in rows:
        if r["received_p50"] is not None:
            lines.append(f"| {r['connector']} | {r['pair']} | {ms(r['load_p50'])} | {ms(r['received_p50'])} | "
                         f"{ms(r['report_wait_p50'])} |")
    lines += ["", "| connector | decode engine steps during the load rounds | step p50 / p90 / p99 / max (ms) |",
              "|---|--:|--:|"]
    for c, r in res.items():
        st = r.get("steps") or []
        if st:
            lines.append(f"| {c} | {len(st)} | {ms(pct(st, 50))} / {ms(pct(st, 90))} / {ms(pct(st, 99))} / "
                         f"{ms(max(st))} |")
    return "\n".join(lines)


#: the targets, kvstage's figure over NixlConnector's from the same run: a new peer's first KV load, the
#: 1→1 and the 2→1 load medians
FIRST_MOST, EQUAL_MOST, HETERO_MOST = 1.2, 0.5, 1.0


def targets(rows: list[dict]) -> list[str]:
    by = {(r["connector"], r["pair"]): r for r in rows}
    out = []

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    for pair in ("2→1", "1→1"):
        k, n = by.get(("kvstage", pair)), by.get(("nixl", pair))
        if not (k and n):
            continue
        f = ratio(k["first_load"], n["first_load"])
        out.append(f"first request of new peer {pair}: kvstage/nixl KV load = {f:.2f} (target <= {FIRST_MOST}): "
                   f"{'met' if f <= FIRST_MOST else 'MISSED'}" if f is not None else f"first request {pair}: n/a")
    k, n = by.get(("kvstage", "1→1")), by.get(("nixl", "1→1"))
    if k and n and k["load_p50"] and n["load_p50"]:
        f = k["load_p50"] / n["load_p50"]
        out.append(f"equal TP 1→1: kvstage/nixl KV load median = {f:.2f} (target <= {EQUAL_MOST}): "
                   f"{'met' if f <= EQUAL_MOST else 'MISSED'}")
    k, n = by.get(("kvstage", "2→1")), by.get(("nixl", "2→1"))
    if k and n and k["load_p50"] and n["load_p50"]:
        f = k["load_p50"] / n["load_p50"]
        out.append(f"different TP 2→1: kvstage/nixl KV load median = {f:.2f} (target <= {HETERO_MOST}): "
                   f"{'met' if f <= HETERO_MOST else 'MISSED'}")
    bad = sum(r["mismatched"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    out.append(f"mismatched requests {bad}, failed requests {failed} (target 0, 0): "
               f"{'met' if bad == failed == 0 else 'MISSED'}")
    return out


def memory(snaps: dict) -> tuple[list[str], bool]:
    """The endpoints/arena columns of every kvstage worker, per snapshot; ok when nothing grew."""
    lines = ["| engine | rank | before the first request | after P2's first | after P1's first (2nd peer) |",
             "|---|---|---|---|---|"]
    ok = True
    names = snaps["before"].keys()
    for name in names:
        for i, before in enumerate(snaps["before"][name]):
            cells = []
            for when in ("before", "after_P2", "after_P1"):
                s = snaps[when][name][i]
                peers = s.get("destination_engines") or s.get("source_engines") or []
                cells.append(f"{s['endpoints']} endpoint(s), {s['arenas']} arena(s) {s['arena_bytes'] / 2**20:.0f} MiB, "
                             f"{len(peers)} peer engine(s)")
            grown = any(snaps[w][name][i][k] != before[k] for w in ("after_P2", "after_P1")
                        for k in ("endpoints", "arenas", "arena_bytes"))
            ok &= not grown
            lines.append(f"| {name} | {before['rank']} | " + " | ".join(cells) + " |")
    return lines, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=24, help="requests per load round")
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="load rounds per connector, alternating their order")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens each decode generates")
    ap.add_argument("--connectors", default="kvstage,nixl", help=f"a comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--kv-mb", type=int, default=512)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", help="write every request's record here")
    ap.add_argument("--trace", action="store_true",
                    help="kvstage DEBUG lines with host-clock stamps in the engine logs (benchmarks/vllm_timeline.py "
                         "reads them; they slow every step: traced latencies are not results)")
    args = ap.parse_args()
    conns = args.connectors.split(",")
    root = tempfile.mkdtemp(prefix="kvstage-vllm-xpyd-")
    t0 = time.perf_counter()
    model = build(os.path.join(root, "model"), **MODEL)
    rng = random.Random(args.seed)
    n = args.requests
    # evenly spread over min..max, shuffled; requests n and n+1 (each new peer's first) at the middle
    lengths = [args.min_len + (args.max_len - args.min_len) * k // max(1, n - 1) for k in range(n)]
    rng.shuffle(lengths)
    ps = prompts(lengths + [(args.min_len + args.max_len) // 2] * 2, seed=args.seed)
    extra = {"auth_token": secrets.token_hex(16)}
    stacks = {c: start(c, model, root, args.kv_mb, 5600 + 100 * i, extra, args.trace) for i, c in enumerate(conns)}
    res = {c: {"first": [], "load": []} for c in conns}
    snaps = {}
    try:
        for st in stacks.values():
            for e in st.values():
                e.read(timeout=900)
        print(f"engines ready ({time.perf_counter() - t0:.0f} s), load avg {os.getloadavg()[0]:.1f}", flush=True)
        plain = {c: [o["tokens"] for o in stacks[c]["D"].cmd(cmd="generate", prompts=ps, max_tokens=args.max_tokens,
                                                                timeout=1200)["outputs"]] for c in conns}
        ref = plain[conns[0]]
        if any(plain[c] != ref for c in conns):
            raise SystemExit("the decode engines' plain runs differ: no reference")
        routers = {c: Router(stacks[c]) for c in conns}
        for c in conns:  # new peers: the first request of each prefill engine, alone (request n: P2, n+1: P1)
            if c == "kvstage":
                snaps["before"] = endpoints(stacks[c])
            for i in (n, n + 1):
                (r,) = routers[c].run(f"{c}-first", ps, [i], 1, args.max_tokens)
                res[c]["first"].append(r)
                if c == "kvstage":
                    snaps[f"after_{r['prefill']}"] = endpoints(stacks[c])
            print(f"{c}: first requests " + ", ".join(f"{r['prefill']} load {ms(r['load_s'])} ms"
                                                      for r in res[c]["first"]), flush=True)
        for rnd in range(args.rounds):
            for c in conns if rnd % 2 == 0 else conns[::-1]:
                stacks[c]["D"].cmd(cmd="steps")
                got = routers[c].run(f"{c}-r{rnd}", ps, list(range(n)), args.inflight, args.max_tokens)
                res[c]["load"] += got
                res[c].setdefault("steps", []).extend(stacks[c]["D"].cmd(cmd="steps")["outputs"])
                print(f"{c} round {rnd}: {len(got)} requests, load avg {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for st in stacks.values():
            for e in st.values():
                e.stop()
    rows = summarize(res, ref)
    print()
    print(table(rows))
    print()
    print(split_table(rows, res))
    print()
    for line in targets(rows):
        print("-", line)
    if snaps:
        lines, ok = memory(snaps)
        print("\nkvstage staging per worker (endpoints alive, arenas and their bytes, peer engines known):\n")
        print("\n".join(lines))
        print(f"\nstaging memory grows with peer engines: {'no' if ok else 'YES'}")
    print(f"\n{args.rounds} load rounds x {n} requests per connector, {args.inflight} in flight, prompts "
          f"{min(map(len, ps))}-{max(map(len, ps))} tokens, {args.max_tokens} decode tokens; "
          f"({time.perf_counter() - t0:.0f} s; engine logs in {root})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "model": MODEL, "rows": rows, "requests": res, "endpoints": snaps}, f,
                      indent=1)


if __name__ == "__main__":
    main()
