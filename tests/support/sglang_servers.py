"""Real SGLang 0.5.23 servers on CPU for tests/test_sglang_servers.py: a random model built
here, server and router processes, and the HTTP calls made to them.

Nothing here replaces SGLang code. The servers are ``python -m sglang.launch_server``
processes and the router is ``python -m sglang_router.launch_router``; what CPU
needs is in ``ENV`` and ``CPU_FLAGS`` below and in sglang_site/ (put on the
servers' ``PYTHONPATH``: the triton/torchvision/sgl_kernel stand-ins and, for the
fault controls, the hook in sglang_faults.py). docs/sglang.md shows the same
commands.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "sglang_site")

# The model: a random Llama small enough to start in seconds. 2 KV heads, so TP 2 gives each rank one.
# float32: in bfloat16 the TP 2 all-reduce rounds differently from TP 1, and greedy decoding of a
# random model meets near-ties, so tokens would differ for reasons that are not the transfer.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, MAX_POS = 256, 64, 2, 4, 2, 128, 2048
SPECIAL = ["<unk>", "<s>", "</s>"]

# What SGLang needs to run on this CPU (docs/sglang.md, "Launch on CPU (what CI runs)").
ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # without it SGLang does not pick its CPU platform
    "SGLANG_HOST_IP": "127.0.0.1",
    # TP > 1 runs a torch.compile'd vocab mask; inductor's first C++ build takes minutes on two
    # cores. Eager computes the same integers.
    "TORCH_COMPILE_DISABLE": "1",
    # a chunk may take seconds on two cores that other jobs load (kvstage's default: 5 s)
    "KVSTAGE_STALL_TIMEOUT_S": "60",
    # the decode's heartbeat to the prefill's bootstrap server gives up after 2-3 s; on loaded cores
    # two misses in a row (SGLang's default) happen, and SGLang then fails the prefill's requests
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "12",
}
PAGE_SIZE, CHUNK = 16, 128
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--sampling-backend", "pytorch", "--grammar-backend", "none",
             "--page-size", str(PAGE_SIZE), "--chunked-prefill-size", str(CHUNK),
             "--max-total-tokens", "4096", "--max-running-requests", "8"]
ROLE_CPU_FLAGS = {
    "plain": [],
    # overlap scheduling makes the prefill's early send of a cached prefix call torch.cuda.Event()
    "prefill": ["--disable-overlap-schedule"],
    # the default retraction backup pins host memory with cudaHostRegister
    "decode": ["--disaggregation-decode-retraction-backup", "cpu_tensor"],
}


def server_argv(python: str, model: str, port, tp: int, role: str, bootstrap_port=None,
                backend: str = "kvstage") -> list:
    """``python -m sglang.launch_server ...`` for a plain, prefill or decode server on CPU: the
    flags a GPU server takes too, then ``CPU_FLAGS`` and the role's CPU-only flags."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", model, "--tp", str(tp),
            "--host", "127.0.0.1", "--port", str(port)]
    if role != "plain":
        argv += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", backend]
    if role == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return argv + CPU_FLAGS + ROLE_CPU_FLAGS[role]


def router_argv(python: str, prefill_port, bootstrap_port, decode_port, port, metrics_port) -> list:
    """SGLang's router in front of one prefill and one decode server."""
    return [python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{prefill_port}", str(bootstrap_port),
            "--decode", f"http://127.0.0.1:{decode_port}",
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
            "--disable-retries"]  # a failed request reaches the client as the decode reported it


def tp_env(tp: int) -> dict:
    """One core per rank: SGLang's default binds a NUMA node per rank, and this machine has one."""
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))} if tp > 1 else {}


def doc_commands(prefill_tp: int = 2, decode_tp: int = 1) -> list:
    """The commands as docs/sglang.md shows them (one route and the plain server), with placeholders."""
    def line(env: dict, argv: list, background: bool = True) -> str:
        pre = [f"{k}='{v}'" for k, v in env.items()]
        return " ".join(pre + argv) + (" &" if background else "")

    return [
        "export " + " ".join(f"{k}={v}" for k, v in ENV.items()),
        line(tp_env(prefill_tp), server_argv("python", "$MODEL", "$PREFILL_PORT", prefill_tp, "prefill",
                                             "$BOOTSTRAP_PORT")),
        line(tp_env(decode_tp), server_argv("python", "$MODEL", "$DECODE_PORT", decode_tp, "decode")),
        line({}, router_argv("python", "$PREFILL_PORT", "$BOOTSTRAP_PORT", "$DECODE_PORT", "$ROUTER_PORT",
                             "$METRICS_PORT")),
        line({}, server_argv("python", "$MODEL", "$PLAIN_PORT", 1, "plain")),
    ]


def build_model(path: str, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS,
                intermediate: int = INTERMEDIATE, seed: int = 0) -> str:
    """Write a random Llama (float32, seeded by ``seed``; tiny by default) and a WordLevel tokenizer to
    ``path``. Another seed: the same config and shapes, other weights."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=MAX_POS, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the init's, so greedy decoding does not settle on one token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    model.save_pretrained(path)
    return path


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive free ports below the kernel's ephemeral range (a server
    binds them later; an ephemeral port could be taken meanwhile by one of the many outgoing
    connections here). ``count`` > 1: kvstage's metrics, served on ``metrics_port + rank``."""
    lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    low, high = (20000, lo) if lo > 21000 else (hi + 1, 65536)
    rng = random.Random()
    while True:
        first = rng.randrange(low, high - count)
        ports = range(first, first + count)
        if any(p in _PICKED or not _bindable(p) for p in ports):
            continue
        _PICKED.update(ports)
        return first


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PICKED: set = set()


@dataclass
class Proc:
    """One launched process (a server or the router) and its log."""

    name: str
    argv: list
    log_path: str
    port: int
    popen: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Proc":
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(self.argv) + "\n")
        log.flush()
        self.popen = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # its own group: stop() ends its children too
        log.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def wait_ready(self, deadline: float, path: str = "/health") -> None:
        """Until ``GET path`` answers 200; AssertionError with the log's tail when it exits or time is up."""
        while True:
            if not self.alive():
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}) before it was ready:\n"
                                     f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready at {self.url}{path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``timeout``."""
        if self.popen is None or self.popen.poll() is not None:
            _kill_group(self.popen, signal.SIGKILL)  # children a killed rank left behind
            return
        _kill_group(self.popen, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(self.popen, signal.SIGKILL)
        self.popen.wait(5)


def _kill_group(p: subprocess.Popen | None, sig: int) -> None:
    if p is None:
        return
    try:
        os.killpg(p.pid, sig)  # the group start_new_session gave it: this process and its children only
    except ProcessLookupError:
        pass


def server_env(extra: dict | None = None) -> dict:
    """This process's environment, ``ENV``, and sglang_site/ first on ``PYTHONPATH``; no
    ``KVSTAGE_AUTH_TOKEN`` (the docs' recipe sets none: each decode rank makes a secret of its own)
    unless ``extra`` sets one."""
    env = dict(os.environ, **ENV)
    env.pop("KVSTAGE_AUTH_TOKEN", None)  # tests/conftest.py sets one for the test processes themselves
    env["PYTHONPATH"] = os.pathsep.join([SITE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


def server(name: str, model: str, port: int, tp: int, role: str, log_dir: str, bootstrap_port=None,
           backend: str = "kvstage", env: dict | None = None) -> Proc:
    """A server process (not started); its log has kvstage's DEBUG lines (one per room event)."""
    argv = server_argv(sys.executable, model, port, tp, role, bootstrap_port, backend)
    return Proc(name, argv, os.path.join(log_dir, f"{name}.log"), port,
                env=server_env({**tp_env(tp), "KVSTAGE_TEST_DEBUG": "1", **(env or {})}))


def router(name: str, prefill: Proc, bootstrap_port: int, decode: Proc, port: int, metrics_port: int,
           log_dir: str) -> Proc:
    argv = router_argv(sys.executable, prefill.port, bootstrap_port, decode.port, port, metrics_port)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVSTAGE_AUTH_TOKEN")}
    return Proc(name, argv, os.path.join(log_dir, f"{name}.log"), port, env=env)


def kvstage_failures(metrics_url: str) -> dict:
    """``kvstage_failures_total`` of one process's kvstage metrics (``KVSTAGE_METRICS_PORT``): {cause: count}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstage_failures_total":
                cause = sample.labels["cause"]
                out[cause] = out.get(cause, 0) + int(sample.value)
    return out


def generate(url: str, input_ids: list, max_new_tokens: int, timeout: float = 300.0) -> tuple[int, dict | str]:
    """POST /generate with greedy sampling; (HTTP status, parsed JSON or the body text)."""
    body = {"input_ids": input_ids, "return_logprob": False,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
