"""One vLLM engine in its own process, driven over stdin/stdout (tests, benchmarks).

    python tests/support/vllm_engine.py --model DIR --tp 1 --connector kvstage --role kv_both

Reads one JSON command per line on stdin and answers each with one line
``@@ {json}`` on stdout (vLLM's own logs go around it):

- ``{"cmd": "generate", "prompts": [[token ids]], "max_tokens": N, "params": [kv_transfer_params or null]}``
  -> ``{"outputs": [{"tokens", "params", "finish"}], "seconds"}``
- ``{"cmd": "prefill", "prompts": [...]}``: ``max_tokens=1`` with ``{"do_remote_decode": true}``
- ``{"cmd": "timed", "prompts": [...], "params": [...]}``: one request at a time, max_tokens=1; per
  request the wall time of ``generate`` and the KV load time seen by the worker connector
  (from the step that starts the load to the step that reports it finished; TP 1 only)
- ``{"cmd": "transfers"}``: the kvstage worker connector's recent receives (TP 1 only)
- ``{"cmd": "quit"}``

A ready line ``@@ {"ready": true, "startup_s": S}`` comes first. One engine per
process: vLLM's worker-side connector is a process-wide singleton.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class EngineProcess:
    """The test side: starts this file as an engine process and talks to it.

    vLLM's own output goes to ``log_path``; a reader thread drains it so the
    engine never blocks on a full pipe."""

    def __init__(self, name: str, log_path: str, *args: str, env: dict | None = None):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w")
        full_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_engine.py"), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env, start_new_session=True)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._replies.put(json.loads(line[3:]))
            else:
                self._log.write(line)
                self._log.flush()
        self._replies.put(None)

    def read(self, timeout: float = 300.0) -> dict:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine {self.name}: no answer within {timeout:g} s\n{self.tail()}") from None
        if reply is None:
            raise RuntimeError(f"engine {self.name} exited with {self.proc.wait()}\n{self.tail()}")
        if "error" in reply:
            raise RuntimeError(f"engine {self.name}: {reply['error']}\n{self.tail()}")
        return reply

    def cmd(self, timeout: float = 120.0, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)  # the engine and its TP workers (its own session)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # TP workers left behind, if any
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def emit(obj) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_config(args):
    from vllm.config import KVTransferConfig

    if args.connector == "none":
        return None
    extra = json.loads(args.extra) if args.extra else {}
    if args.connector == "kvstage":
        return KVTransferConfig(kv_connector="KVStageConnector", kv_connector_module_path="kvstage.plugin.vllm",
                                kv_role=args.role, kv_load_failure_policy=args.policy, kv_connector_extra_config=extra)
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=args.role, kv_buffer_device="cpu",
                            kv_load_failure_policy=args.policy, kv_connector_extra_config=extra)


class LoadClock:
    """Times KV loads inside the worker connector (in-process engines only):
    from the step whose metadata starts a request's load to the step that
    reports it in ``finished_recving``. The same hooks for any connector."""

    def __init__(self, connector):
        self.started: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        start, results = connector.start_load_kv, connector.get_transfer_results

        def start_load_kv(forward_context, **kw):
            meta = connector._connector_metadata
            now = time.perf_counter()
            for rid in self._loading(meta):
                self.started.setdefault(rid, now)
            return start(forward_context, **kw)

        def get_transfer_results(finished):
            out = results(finished)
            now = time.perf_counter()
            for rid in out.finished_recving or ():
                if rid in self.started:
                    self.seconds[rid] = now - self.started.pop(rid)
            return out

        connector.start_load_kv, connector.get_transfer_results = start_load_kv, get_transfer_results

    @staticmethod
    def _loading(meta):
        if meta is None:
            return []
        recv = getattr(meta, "recv", None)  # kvstage
        if recv is not None:
            return [r.req_id for r in recv]
        return list(getattr(meta, "reqs_to_recv", {}) or {})  # NixlConnector


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--connector", choices=("kvstage", "nixl", "none"), default="kvstage")
    ap.add_argument("--role", default="kv_both")
    ap.add_argument("--policy", default="fail", choices=("fail", "recompute"))
    ap.add_argument("--extra", default="", help="kv_connector_extra_config as JSON")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-mb", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    args = ap.parse_args()

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_len, block_size=32,
              kv_cache_memory_bytes=args.kv_mb << 20, enable_prefix_caching=False, tensor_parallel_size=args.tp,
              skip_tokenizer_init=True, kv_transfer_config=make_config(args))
    clock = None
    if args.tp == 1 and args.connector != "none" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        clock = LoadClock(get_kv_transfer_group())
    emit({"ready": True, "startup_s": time.perf_counter() - t0})

    def run(prompts, params, max_tokens):
        sps = []
        for p in params:
            extra = {"kv_transfer_params": p} if p is not None else None
            sps.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra))
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids), "params": o.kv_transfer_params,
                 "finish": o.outputs[0].finish_reason} for o in outs]

    for line in sys.stdin:
        cmd = json.loads(line)
        kind = cmd["cmd"]
        if kind == "quit":
            break
        prompts = cmd.get("prompts", [])
        t = time.perf_counter()
        try:
            if kind == "prefill":
                outs = run(prompts, [{"do_remote_decode": True}] * len(prompts), 1)
            elif kind == "generate":
                outs = run(prompts, cmd.get("params") or [None] * len(prompts), cmd.get("max_tokens", 8))
            elif kind == "timed":
                outs = []
                for prompt, p in zip(prompts, cmd["params"]):
                    t1 = time.perf_counter()
                    (o,) = run([prompt], [p], 1)
                    o["seconds"] = time.perf_counter() - t1
                    outs.append(o)
                if clock is not None:  # request ids are the engine's; results come in order
                    loads = list(clock.seconds.values())[-len(outs):]
                    for o, s in zip(outs, loads):
                        o["load_s"] = s
            elif kind == "transfers":
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                outs = list(get_kv_transfer_group()._w.recent)
            else:
                raise ValueError(f"unknown command {kind!r}")
            emit({"outputs": outs, "seconds": time.perf_counter() - t})
        except Exception as e:  # report, keep serving
            emit({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
