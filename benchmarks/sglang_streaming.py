"""SGLang CPU servers: the time to first token with the prefill's per-chunk streaming and without,
the same prompts in the same run.

    .venv-sglang/bin/python -m benchmarks.sglang_streaming
        [--prefill-tp 2 --decode-tp 1 --min-len 1000 --max-len 1500 --chunk 256 --requests 6]

Run from the repository root: the helpers it shares with the tests import as ``tests.support``.

Two routes at once, each a prefill server (TP P) and a decode server (TP D) with the kvstage backend
behind SGLang's router: ``streamed`` (the backend as shipped: each chunk of a chunked prefill leaves
as its forward ends) and ``whole`` (every chunk held until the last, the room sent as one span: the
prefill's ``STREAM_CHUNKS`` off, set by tests/support/sglang_site's sitecustomize where
``KVSTAGE_BENCH_WHOLE_ROOMS`` is set; a benchmark's lever, not a setting). The model is a random
float32 Llama (tests/support/sglang_servers.build_model) large enough that a prompt's forward takes
a while on the CPU.

A request with ``max_new_tokens=1`` ends at the decode once the KV landed and the decode emitted
the prefill's first token: its latency is the client's time to first token. The routes take turns
(A B, then B A), one request at a time. Then each prompt runs with 8 new tokens through both
routes, which must agree token for token. Prints medians and the ratio streamed / whole.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

from tests.support import sglang_servers as S

START_S = 600  # both routes' servers and routers up, on two cores


def _argv_chunk(p: S.Proc, chunk: int, max_tokens: int) -> S.Proc:
    """The servers' flags, but this chunk size and KV pool."""
    a = p.argv
    a[a.index("--chunked-prefill-size") + 1] = str(chunk)
    a[a.index("--max-total-tokens") + 1] = str(max_tokens)
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--min-len", type=int, default=1000)
    ap.add_argument("--max-len", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size of the prefills")
    ap.add_argument("--requests", type=int, default=6, help="TTFT requests per route")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true", help="keep the servers' logs (their folder is printed)")
    a = ap.parse_args()
    if not a.max_len < S.MAX_POS:
        ap.error(f"--max-len must be below the model's {S.MAX_POS} positions")
    root = tempfile.mkdtemp(prefix="kvstage-sglang-streaming-")
    logs = os.path.join(root, "logs")
    os.makedirs(logs)
    model = S.build_model(os.path.join(root, "model"), layers=a.layers, hidden=a.hidden, heads=a.heads,
                          kv_heads=a.kv_heads, intermediate=2 * a.hidden)
    pool = 2 * a.max_len + 2 * a.chunk
    procs, routes = [], {}
    for name, env in (("streamed", {}), ("whole", {"KVSTAGE_BENCH_WHOLE_ROOMS": "1"})):
        bootstrap = S.free_port()
        prefill = _argv_chunk(S.server(f"{name}-prefill", model, S.free_port(), a.prefill_tp, "prefill", logs,
                                       bootstrap, env=env), a.chunk, pool)
        decode = _argv_chunk(S.server(f"{name}-decode", model, S.free_port(), a.decode_tp, "decode", logs),
                             a.chunk, pool)
        routes[name] = {"prefill": prefill, "decode": decode, "bootstrap": bootstrap}
        procs += [prefill, decode]
    t0 = time.monotonic()
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(t0 + START_S)
        for name, r in routes.items():
            r["router"] = S.router(f"{name}-router", r["prefill"], r["bootstrap"], r["decode"], S.free_port(),
                                   S.free_port(), logs)
            # a prefill busy with a long prompt on two cores misses the router's health checks, and the
            # router then refuses every request ("all circuits open or unhealthy")
            r["router"].argv += ["--disable-circuit-breaker", "--disable-health-check"]
            procs.append(r["router"].start())
        for r in routes.values():
            r["router"].wait_ready(t0 + START_S, "/readiness")
        print(f"servers and routers up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        rng = random.Random(0)
        prompts = [[rng.randrange(len(S.SPECIAL), S.VOCAB) for _ in range(rng.randint(a.min_len, a.max_len))]
                   for _ in range(a.requests + 1)]
        order = list(routes)
        # a first request per route, not counted: first forwards and first connections
        for name in order:
            status, body = S.generate(routes[name]["router"].url, prompts[-1], 1)
            assert status == 200, f"{name}: {status} {body}"
        ttft: dict = {name: [] for name in order}
        for i, prompt in enumerate(prompts[:-1]):
            for name in order if i % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                status, body = S.generate(routes[name]["router"].url, prompt, 1)
                dt = time.perf_counter() - t
                assert status == 200, f"{name}: {status} {body}"
                ttft[name].append(dt)
        print("TTFT (s): " + json.dumps(ttft), file=sys.stderr, flush=True)
        mismatches = 0
        for prompt in prompts[:-1]:
            outs = {}
            for name in order:
                status, body = S.generate(routes[name]["router"].url, prompt, 8)
                assert status == 200, f"{name}: {status} {body}"
                outs[name] = body["output_ids"]
            mismatches += outs["streamed"] != outs["whole"]
        chunks = {name: _chunks_logged(routes[name]["prefill"]) for name in order}
    finally:
        for p in reversed(procs):
            p.stop()
    p50 = {name: statistics.median(v) for name, v in ttft.items()}
    row = {
        "prefill_tp": a.prefill_tp, "decode_tp": a.decode_tp, "chunk": a.chunk,
        "lengths": [len(p) for p in prompts[:-1]], "ttft_s": ttft, "ttft_p50_s": p50,
        "streamed_over_whole": p50["streamed"] / p50["whole"], "token_mismatches": mismatches,
        "chunks_per_room": chunks, "layers": a.layers, "hidden": a.hidden, "kv_heads": a.kv_heads,
    }
    print(f"TP {a.prefill_tp} -> {a.decode_tp}, prompts {a.min_len}-{a.max_len} tokens in chunks of {a.chunk}, "
          f"{a.requests} requests per route")
    for name in order:
        v = sorted(ttft[name])
        print(f"  {name:8s} TTFT p50 {p50[name] * 1e3:8.1f} ms  min {v[0] * 1e3:8.1f}  max {v[-1] * 1e3:8.1f}  "
              f"chunks sent per room {chunks[name]}")
    print(f"  streamed / whole: {row['streamed_over_whole']:.3f}x; token mismatches between routes: {mismatches}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)
    if a.keep:
        print(f"logs: {logs}", file=sys.stderr)
    return 1 if mismatches else 0


def _chunks_logged(p: S.Proc) -> list:
    """The chunk counts of the rooms the prefill's kvstage DEBUG lines report sent (``in N chunks``),
    distinct values: proof of which way the route sent."""
    with open(p.log_path, errors="replace") as f:
        return sorted({int(n) for n in re.findall(r"pages to decode TP \d+ in (\d+) chunks", f.read())})


if __name__ == "__main__":
    sys.exit(main())
