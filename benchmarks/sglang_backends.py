"""Time to first token and KV transfer time through real SGLang servers: kvstage against SGLang's
own backends, in one run, on CPU.

For each backend: a prefill server at TP 2, a decode server at TP 1, SGLang's router in front
(the commands of tests/test_sglang_servers.py, tests/support/sglang_servers.py) and a random Llama
built here. After one warm-up request, the prompts go through the router one at a time,
streamed, each with a new prefix (no radix hits). Per request:

- TTFT: from sending the request to the router to its first streamed token (the prefill's
  forward, the KV transfer and the decode's first step);
- KV transfer: SGLang's own per-request figure on the prefill, the change in
  ``sglang:kv_transfer_latency_ms`` (``--enable-metrics``) across the request.

Every output is compared, token for token, with a plain server's. SGLang's ``fake`` backend moves
no bytes: its outputs are not expected to match, and its TTFT is the floor without a transfer.

    python benchmarks/sglang_backends.py [--backends kvstage,fake,nixl] [--prompt-len 1000] [--requests 8]

Needs a venv from ``bash .ci/sglang-venv``; the ``nixl`` backend needs ``nixl==1.5.1`` there too
(``--no-deps``: SGLang imports ``nixl._api``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from support import sglang_servers as S  # noqa: E402

MODEL = dict(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024)  # 32 KiB of KV a token (float32)
METRIC = "sglang:kv_transfer_latency_ms"


def metric(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on a server's /metrics; (0, 0) before its first observation."""
    total = count = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total, count


def stream(url: str, ids: list, max_new: int) -> tuple[float, list, str | None]:
    """(TTFT in s, output ids, error) of one streamed greedy request."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, ttft, out = time.perf_counter(), None, []
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return ttft or 0.0, out, str(chunk["error"])
                if ttft is None:
                    ttft = time.perf_counter() - t0
                out = chunk.get("output_ids", out)
    except urllib.error.HTTPError as e:
        return 0.0, [], f"{e.code} {e.read().decode(errors='replace')[:300]}"
    return ttft, out, None


def run_backend(backend: str, model: str, root: str, prompts: list, max_new: int, env: dict) -> dict:
    logs = os.path.join(root, backend)
    os.makedirs(logs)
    boot = S.free_port()
    prefill = S.server("prefill", model, S.free_port(), 2, "prefill", logs, boot, backend, env)
    decode = S.server("decode", model, S.free_port(), 1, "decode", logs, backend=backend, env=env)
    for p in (prefill, decode):
        p.argv.append("--enable-metrics")
    procs = [prefill.start(), decode.start()]
    try:
        deadline = time.monotonic() + 900
        for p in procs:
            p.wait_ready(deadline)
        router = S.router("router", prefill, boot, decode, S.free_port(), S.free_port(), logs).start()
        procs.append(router)
        router.wait_ready(deadline, "/readiness")
        first = stream(router.url, prompts[0], max_new)  # connection set-up, first forward
        rows = []
        for ids in prompts[1:]:
            before = metric(prefill.url, METRIC)
            ttft, out, err = stream(router.url, ids, max_new)
            after = metric(prefill.url, METRIC)
            n = after[1] - before[1]
            rows.append({"ttft_ms": ttft * 1e3, "transfer_ms": (after[0] - before[0]) / n if n else None,
                         "out": out, "error": err})
        return {"first_ttft_ms": first[0] * 1e3, "first_error": first[2], "rows": rows}
    except AssertionError as e:  # a server that does not start: the reason is the result
        return {"error": str(e)[-1500:]}
    finally:
        for p in reversed(procs):
            p.stop()


def reference(model: str, root: str, prompts: list, max_new: int) -> list:
    logs = os.path.join(root, "plain")
    os.makedirs(logs)
    plain = S.server("plain", model, S.free_port(), 1, "plain", logs).start()
    try:
        plain.wait_ready(time.monotonic() + 900)
        return [S.generate(plain.url, ids, max_new, timeout=600)[1]["output_ids"] for ids in prompts]
    finally:
        plain.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="kvstage,fake,nixl")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=4)
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    os.environ.setdefault("KVSTAGE_AUTH_TOKEN", "kvstage-bench")
    root = tempfile.mkdtemp(prefix="sglang-backends-")
    print(f"logs: {root}", flush=True)
    model = S.build_model(os.path.join(root, "model"), **MODEL)
    prompts = [[(i % (S.VOCAB - len(S.SPECIAL))) + len(S.SPECIAL)] +
               [random.Random(i).randrange(len(S.SPECIAL), S.VOCAB) for _ in range(a.prompt_len - 1)]
               for i in range(a.requests + 1)]  # distinct first tokens: no radix hits
    want = reference(model, root, prompts, a.max_new)
    results = {}
    for backend in a.backends.split(","):
        res = run_backend(backend, model, root, prompts, a.max_new, {})
        results[backend] = res
        if "error" in res:
            print(f"{backend}: did not run: {res['error'][-600:]}", flush=True)
            continue
        rows = res["rows"]
        ok = [r for r in rows if r["error"] is None]
        same = sum(r["out"] == w for r, w in zip(rows, want[1:]))
        ttft = [r["ttft_ms"] for r in ok]
        xfer = [r["transfer_ms"] for r in ok if r["transfer_ms"] is not None]
        summary = {
            "requests": len(rows), "failed": len(rows) - len(ok), "match_plain": same,
            "ttft_median_ms": statistics.median(ttft) if ttft else None,
            "ttft_range_ms": [min(ttft), max(ttft)] if ttft else None,
            "transfer_median_ms": statistics.median(xfer) if xfer else None,
            "transfer_range_ms": [min(xfer), max(xfer)] if xfer else None,
            "first_ttft_ms": res["first_ttft_ms"], "first_error": res["first_error"],
            "errors": sorted({r["error"][:200] for r in rows if r["error"]}),
        }
        res["summary"] = summary
        print(f"{backend}: {json.dumps(summary)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "model": MODEL, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
