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
- ``{"cmd": "metrics"}`` (``--log-stats``): vLLM's own metrics of kvstage (``vllm:kvstage_*``, as ``LLM.get_metrics``
  gives them) and kvstage's exposition text of this process; first it logs vLLM's stats line, as vLLM's
  API server does every ``VLLM_LOG_STATS_INTERVAL``
- ``{"cmd": "steps"}``: seconds of each engine step taken for submitted requests since the last ``steps``
- ``{"cmd": "endpoints"}``: per TP rank, the kvstage endpoints alive in the worker process and
  their staging arenas (any TP; ``[]`` for other connectors)
- ``{"cmd": "submit", "id": ID, "prompt": [token ids], "params": ..., "max_tokens": N}``: adds one
  request and answers at once with nothing; the engine steps while requests are in flight and,
  when this one finishes, writes ``@@ {"done": ID, "tokens", "params", "finish", "ttft_s",
  "e2e_s", "load_s"}`` (seconds from ``add_request``; ``load_s`` as for ``timed``, TP 1 only; for
  kvstage also ``received_s``, the load's start until this rank held every byte, and
  ``report_wait_s``, from then until the engine step that reported it).
  Other commands are answered between steps; generate/prefill/timed wait until none is in flight.
- ``{"cmd": "flip"}`` (TP 1: the worker is this process): the next kvstage gather of this process flips
  one bit of the middle byte of the staging region it wrote, after the copy read and summed it (a fault
  between the source's read and the decode's landing, for the chunk checksum to catch)
- ``{"cmd": "quit"}``

A ready line ``@@ {"ready": true, "startup_s": S}`` comes first. One engine per
process: vLLM's worker-side connector is a process-wide singleton.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: The environment of an engine whose cores other engines share (the CI machine has two). vLLM pins
#: each CPU worker's main thread (``VLLM_CPU_OMP_THREADS_BIND``), and that thread spins while a request
#: waits for KV; another engine's process pinned to the same core then gets no CPU until a timeout
#: ends the wait (docs/vllm.md). Unpinned, the kernel runs each where a core is free.
SHARED_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
log = logging.getLogger("kvstage.clock")  # timelines (benchmarks/vllm_timeline.py) read its DEBUG lines


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
        self.done: queue.Queue = queue.Queue()  # finished ``submit`` requests: (engine name, reply)
        self._write = threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                reply = json.loads(line[3:])
                (self.done if "done" in reply else self._replies).put(reply)
            else:
                self._log.write(line)
                self._log.flush()
        self._replies.put(None)
        self.done.put({"done": None, "error": f"engine {self.name} exited"})

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

    def send(self, **command) -> None:
        with self._write:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()

    def cmd(self, timeout: float = 120.0, **command) -> dict:
        self.send(**command)
        return self.read(timeout)

    def submit(self, rid: str, prompt: list, params: dict | None, max_tokens: int) -> None:
        """Add one request; its reply comes on ``self.done``."""
        self.send(cmd="submit", id=rid, prompt=prompt, params=params, max_tokens=max_tokens)

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
        self.connector = connector
        self.started: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        #: kvstage: (from the load's start until the destination held every byte, from then until the step reported it)
        self.split: dict[str, tuple[float, float]] = {}
        start, results = connector.start_load_kv, connector.get_transfer_results

        traced = log.isEnabledFor(logging.DEBUG)
        self.step_began = 0.0

        def start_load_kv(forward_context, **kw):
            meta = connector._connector_metadata
            now = self.step_began = time.perf_counter()
            for rid in self._loading(meta):
                if rid not in self.started:
                    self.started[rid] = now
                    log.debug("clock: %s load starts (step)", rid)
            try:
                return start(forward_context, **kw)
            finally:
                if traced:
                    log.debug("clock: step's start_load_kv took %.1f ms", 1e3 * (time.perf_counter() - now))

        def get_transfer_results(finished):
            t = time.perf_counter()
            worker = getattr(connector, "_w", None)  # kvstage: when each receive finished on this rank
            handles = {r: ld.handle for r, ld in getattr(worker, "_loading", {}).items() if ld.handle is not None}
            out = results(finished)
            now = time.perf_counter()
            for rid in out.finished_recving or ():
                h = handles.get(rid)
                if h is not None and h.finished is not None and rid in self.started:
                    self.split[rid] = (h.finished - self.started[rid], now - h.finished)
            if traced:
                log.debug("clock: step ends, %.1f ms after its start_load_kv (get_transfer_results %.1f ms)",
                          1e3 * (now - self.step_began), 1e3 * (now - t))
            for rid in out.finished_recving or ():
                if rid in self.started:
                    self.seconds[rid] = now - self.started.pop(rid)
                    log.debug("clock: %s load reported (step) after %.1f ms", rid, 1e3 * self.seconds[rid])
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


def endpoints(worker) -> dict:
    """In a worker process (``collective_rpc``): the kvstage endpoints alive there (one loop thread
    each) and the staging arenas of the connector's source and destination."""
    import re

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = getattr(get_kv_transfer_group(), "_w", None)
    if w is None:
        return {}
    loops = [t.name for t in threading.enumerate() if re.fullmatch(r"kvstage-(src|dst)\d+", t.name)]
    mine = [ep for ep in (w.src, w.dst) if ep is not None]
    out = {"rank": w.rank, "endpoints": len(loops), "arenas": len(mine),
           "arena_bytes": sum(ep.arena.buffer.numel() * ep.arena.buffer.element_size() for ep in mine)}
    if w.src is not None:
        out["source_engines"] = sorted(w.src.engines)
        out["model"] = w.src.model
    if w.dst is not None:
        out["destination_engines"] = sorted(w.dst.engines)
        out["dst_port"], out["model"] = w.dst.address[1], w.dst.model  # the port only: never its secret
    if w.server is not None:
        out["pull_port"] = w.server.address[1]
    return out



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
    ap.add_argument("--log-stats", action="store_true", help="vLLM's stats on (its log line, LLM.get_metrics)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_len, block_size=32,
              kv_cache_memory_bytes=args.kv_mb << 20, enable_prefix_caching=False, tensor_parallel_size=args.tp,
              skip_tokenizer_init=True, kv_transfer_config=make_config(args), disable_log_stats=not args.log_stats)
    clock = None
    if args.tp == 1 and args.connector != "none" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        clock = LoadClock(get_kv_transfer_group())
    emit({"ready": True, "startup_s": time.perf_counter() - t0})

    def sampling(p, max_tokens, **kw):
        extra = {"kv_transfer_params": p} if p is not None else None
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra, **kw)

    def run(prompts, params, max_tokens):
        sps = [sampling(p, max_tokens) for p in params]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids), "params": o.kv_transfer_params,
                 "finish": o.outputs[0].finish_reason} for o in outs]

    commands: queue.Queue = queue.Queue()

    def read_stdin():
        for raw in sys.stdin:
            commands.put(json.loads(raw))
        commands.put({"cmd": "quit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    engine = llm.llm_engine
    inflight: dict[str, dict] = {}  # engine request id -> the submitted request's state

    def submit(cmd):
        rid = engine.add_request(str(cmd["id"]), TokensPrompt(prompt_token_ids=cmd["prompt"]),
                                 sampling(cmd.get("params"), cmd.get("max_tokens", 8),
                                          output_kind=RequestOutputKind.DELTA))
        inflight[rid] = {"id": cmd["id"], "t": time.perf_counter(), "tokens": [], "ttft_s": None}

    steps: list[float] = []  # seconds per engine step while submitted requests were in flight

    def step():
        t = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append(now - t)
        for o in outs:
            st = next((v for k, v in inflight.items() if k == o.request_id or v["id"] == o.request_id), None)
            if st is None:
                continue
            st["tokens"] += list(o.outputs[0].token_ids)
            if st["ttft_s"] is None and st["tokens"]:
                st["ttft_s"] = now - st["t"]
            if o.finished:
                rid = next(k for k, v in inflight.items() if v is st)
                del inflight[rid]
                load = clock.seconds.pop(rid, None) if clock is not None else None
                done = {"done": st["id"], "tokens": st["tokens"], "params": o.kv_transfer_params,
                        "finish": o.outputs[0].finish_reason, "ttft_s": st["ttft_s"], "e2e_s": now - st["t"],
                        "load_s": load}
                if clock is not None and rid in clock.split:
                    done["received_s"], done["report_wait_s"] = clock.split.pop(rid)
                if clock is not None and args.connector == "kvstage":  # this rank's receive: path, bytes, error
                    rec = next((t for t in reversed(clock.connector._w.recent) if t["req"] == rid), None)
                    if rec is not None:
                        done["recv"] = {k: rec[k] for k in ("ok", "path", "bytes", "error")}
                emit(done)

    while True:
        try:
            cmd = commands.get_nowait() if inflight else commands.get()
        except queue.Empty:
            step()
            continue
        kind = cmd["cmd"]
        if kind == "quit":
            break
        if kind == "submit":
            try:
                submit(cmd)
            except Exception as e:  # answered as a finished request, so the caller does not wait forever
                emit({"done": cmd.get("id"), "error": f"{type(e).__name__}: {e}"})
            continue
        if inflight and kind in ("generate", "prefill", "timed"):
            while inflight:
                step()
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
            elif kind == "metrics":
                from kvstage import metrics

                llm.llm_engine.do_log_stats()
                outs = {"vllm": [vars(m) for m in llm.get_metrics() if m.name.startswith("vllm:kvstage_")],
                        "kvstage": metrics.exposition().decode()}
            elif kind == "transfers":
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                outs = list(get_kv_transfer_group()._w.recent)
            elif kind == "flip":
                sys.path.insert(0, os.path.dirname(HERE))  # the tests folder: ``support`` as a package
                from support.flips import flip_after_next_gather

                flip_after_next_gather()
                outs = []
            elif kind == "steps":  # the step times since the last ``steps``
                outs, steps[:] = list(steps), []
            elif kind == "endpoints":
                outs = [] if args.connector != "kvstage" else llm.collective_rpc(endpoints)
            else:
                raise ValueError(f"unknown command {kind!r}")
            emit({"outputs": outs, "seconds": time.perf_counter() - t})
        except Exception as e:  # report, keep serving
            emit({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
