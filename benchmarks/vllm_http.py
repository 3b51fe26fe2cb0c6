"""docs/vllm.md's two-engine HTTP recipe, run as written: does every request load its KV?

Starts the two OpenAI API servers of docs/vllm.md ("CPU: two engines on one machine") with the
tiny random Llama of the tests (tests/support/vllm_model.py, plus a word-level tokenizer so that
the servers take text): prefill TP 2 and decode TP 1 unpinned on the machine's two cores (the doc's
2-core choice, ``SHARED_CORES``), ``kv_load_failure_policy`` recompute, ``KVSTAGE_ARENA_MB=64``, every
other setting at its default. ``--pinned`` is the control: prefill ranks on cores 0 and 1, decode on
core 1, as ``VLLM_CPU_OMP_THREADS_BIND`` would place them.
Then, per request, one after another, as the doc's snippet does: the prompt to the prefill server
with ``max_tokens=1`` and ``{"do_remote_decode": true}``, then to the decode server with the
returned ``kv_transfer_params``.

- Reference: before that, the decode server computes each prompt itself (a ``cache_salt`` keeps
  those blocks out of the later requests' prefix-cache lookups); every disaggregated decode's text
  must equal it.
- Loads: counted from the decode server's log. The connector logs a received KV at DEBUG
  ("KV of R received in S s") and a failed load at WARNING ("KV load of request R (...) failed
  after S s at stage ..."), after which vLLM recomputes the prompt. ``VLLM_LOGGING_CONFIG_PATH`` points both servers at a
  logging config that shows the connector's DEBUG lines and gives kvstage's own logger a
  timestamped handler; nothing else changes.
- Worst waits: the longest load, kvstage's "is slow" warnings, pull errors, and the endpoints'
  "did not run for S s" lines (a process starved or stopped), from both servers' logs.

    python -m benchmarks.vllm_http [--requests 24] [--runs 2] [--pinned] [--json out.json]

Run from the repository root: the helpers it shares with the tests import as ``tests.support``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from tests.support.vllm_engine import SHARED_CORES
from tests.support.vllm_model import build, prompts, text

CFG = '"kv_connector":"KVStageConnector","kv_connector_module_path":"kvstage.plugin.vllm"'
COMMON = "--dtype float32 --block-size 32 --kv-cache-memory-bytes 1073741824 --enforce-eager".split()
FORMAT = "%(created).6f %(levelname)s {label} pid=%(process)d %(name)s: %(message)s"


def log_config(root: str, label: str) -> str:
    """vLLM's INFO lines as usual; the connector's DEBUG lines; kvstage's logger with a handler."""
    path = os.path.join(root, f"logging-{label}.json")
    with open(path, "w") as f:
        json.dump({"version": 1, "disable_existing_loggers": False,
                   "formatters": {"t": {"format": FORMAT.format(label=label)}},
                   "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "t", "stream": "ext://sys.stdout"}},
                   "loggers": {"vllm": {"handlers": ["h"], "level": "INFO", "propagate": False},
                               "vllm.kvstage": {"level": "DEBUG"},
                               "kvstage": {"handlers": ["h"], "level": "INFO", "propagate": False}}}, f)
    return path


def free_port(preferred: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def serve(model: str, port: int, role: str, root: str, label: str, pinned: bool) -> subprocess.Popen:
    """The doc's command line for one server (its own session: it and its TP workers stop together)."""
    if role == "prefill":
        cmd = ["--port", str(port), "-tp", "2", *COMMON, "--kv-transfer-config", f'{{{CFG},"kv_role":"kv_producer"}}']
        bind = "0|1"
    else:
        cmd = ["--port", str(port), *COMMON, "--kv-transfer-config",
               f'{{{CFG},"kv_role":"kv_consumer","kv_load_failure_policy":"recompute"}}']
        bind = "1"  # the control: the decode shares core 1 with the prefill's rank 1
    cores = {"VLLM_CPU_OMP_THREADS_BIND": bind} if pinned else SHARED_CORES
    env = dict(os.environ, **cores, KVSTAGE_ARENA_MB="64", VLLM_LOGGING_CONFIG_PATH=log_config(root, label))
    full = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *cmd]
    with open(os.path.join(root, f"{label}.cmd"), "w") as f:
        f.write(" ".join(full) + "\n")
    log = open(os.path.join(root, f"{label}.log"), "w")
    return subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def post(port: int, timeout: float = 600, **body) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 900) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10):
                return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            time.sleep(2)
    raise TimeoutError(f"server on port {port} not ready after {timeout:g} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # TP workers left behind, if any
    except ProcessLookupError:
        pass
    proc.wait()


RECEIVED = re.compile(r"KV of (\S+) received in ([\d.]+) s \((\d+) bytes, (\w+)\)")
NOT_RECEIVED = re.compile(r"KV load of request (\S+) \(\S+\) failed after ([\d.]+) s (at stage .*)")
SLOW = re.compile(r"is slow: .*?(?:after|landed) ([\d.]+) s")
STARVED = re.compile(r"did not run for ([\d.]+) s")


def scan(path: str) -> dict:
    out = {"received": [], "failed": [], "slow": [], "starved": [], "errors": []}
    for line in open(path, errors="replace"):
        if m := RECEIVED.search(line):
            out["received"].append({"req": m.group(1), "s": float(m.group(2)), "bytes": int(m.group(3)),
                                    "path": m.group(4)})
        elif m := NOT_RECEIVED.search(line):
            out["failed"].append({"req": m.group(1), "s": float(m.group(2)), "cause": m.group(3).strip()})
        elif "is slow" in line:
            m = re.search(r"([\d.]+) s", line.split("is slow", 1)[1])
            out["slow"].append({"s": float(m.group(1)) if m else None, "line": line.strip()[-300:]})
        elif m := STARVED.search(line):
            out["starved"].append(float(m.group(1)))
        elif ("ERROR" in line or "Traceback" in line) and "kvstage" in line:
            out["errors"].append(line.strip()[-300:])
    return out


def one_run(run: int, args, model: str, ps: list[str], root: str) -> dict:
    rdir = os.path.join(root, f"run{run}")
    os.makedirs(rdir)
    ports = {"prefill": free_port(args.prefill_port), "decode": free_port(args.decode_port)}
    pp, dp = ports["prefill"], ports["decode"]
    t0 = time.monotonic()
    servers = {role: serve(model, port, role, rdir, role, args.pinned) for role, port in ports.items()}
    reqs = []
    try:
        startup = {role: wait_ready(port, servers[role]) for role, port in ports.items()}
        print(f"run {run} ({'pinned to shared cores' if args.pinned else 'unpinned'}): servers ready in "
              f"{max(startup.values()):.0f} s, load avg {os.getloadavg()[0]:.1f}", flush=True)
        plain = [post(dp, model=model, prompt=p, max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                      cache_salt="plain")["choices"][0]["text"] for p in ps]
        for i, p in enumerate(ps):
            la = os.getloadavg()[0]
            t = time.perf_counter()
            pre = post(pp, model=model, prompt=p, max_tokens=1, temperature=0,
                       kv_transfer_params={"do_remote_decode": True})
            t_pre = time.perf_counter() - t
            t = time.perf_counter()
            out = post(dp, model=model, prompt=p, max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                       kv_transfer_params=pre["kv_transfer_params"])
            reqs.append({"i": i, "tokens": len(p.split()), "id": out["id"], "prefill_s": t_pre,
                         "decode_s": time.perf_counter() - t, "match": out["choices"][0]["text"] == plain[i],
                         "loadavg": la})
        loadavg = [r["loadavg"] for r in reqs]
    finally:
        for s in servers.values():
            stop(s)
    dec, pre_log = scan(os.path.join(rdir, "decode.log")), scan(os.path.join(rdir, "prefill.log"))
    for r in reqs:  # the engine's request id extends the response's id
        r["load"] = next((x for x in dec["received"] + dec["failed"] if x["req"].startswith(r["id"])), None)
    return {"run": run, "dir": rdir, "requests": reqs, "decode": dec, "prefill": pre_log,
            "loaded": len(dec["received"]), "failed": len(dec["failed"]),
            "mismatched": sum(not r["match"] for r in reqs), "loadavg": [min(loadavg), max(loadavg)],
            "seconds": time.monotonic() - t0}


def report(res: dict) -> str:
    d, p = res["decode"], res["prefill"]
    loads = [x["s"] for x in d["received"]]
    slow = d["slow"] + p["slow"]
    starved = d["starved"] + p["starved"]
    lines = [f"run {res['run']}: {len(res['requests'])} requests; KV loaded {res['loaded']}, failed (recomputed) "
             f"{res['failed']}; decode text = plain: {len(res['requests']) - res['mismatched']}/{len(res['requests'])}; "
             f"load avg {res['loadavg'][0]:.0f}-{res['loadavg'][1]:.0f}; {res['seconds']:.0f} s",
             f"  load time: median {statistics.median(loads):.3f} s, max {max(loads):.3f} s" if loads else "  no load",
             f"  'is slow' warnings: {len(slow)}" + (f", longest {max(s['s'] or 0 for s in slow):.1f} s" if slow else ""),
             f"  'did not run for' lines (starved endpoint loops): {len(starved)}"
             + (f", longest {max(starved):.1f} s" if starved else "")]
    for f in d["failed"]:
        lines.append(f"  failed: {f['req']} after {f['s']:.1f} s: {f['cause'][:200]}")
    for s in slow[:5]:
        lines.append(f"  slow: {s['line'][-200:]}")
    for e in (d["errors"] + p["errors"])[:5]:
        lines.append(f"  error: {e[-200:]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--runs", type=int, default=2, help="fresh servers each run")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--pinned", action="store_true", help="the control: pin the engines' workers to shared cores")
    ap.add_argument("--json", help="write every run's records here")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvstage-vllm-http-")
    model = build(os.path.join(root, "model"), max_len=2048, tokenizer=True)
    rng = random.Random(args.seed)
    ps = [text(p) for p in prompts([rng.randint(args.min_len, args.max_len) for _ in range(args.requests)], args.seed)]
    results = []
    for run in range(1, args.runs + 1):
        res = one_run(run, args, model, ps, root)
        results.append(res)
        print(report(res), flush=True)
    print(f"\nlogs and commands in {root}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
