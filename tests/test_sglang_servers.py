"""Real SGLang servers end to end on CPU: prefill and decode servers of different TP sizes, the
kvstage backend between them, SGLang's router in front (the shape of SGLang's own
test_disaggregation_different_tp.py, on kvstage).

One cluster for the module, every server started at once:

- ``reference``: a plain (non-disaggregated) server, TP 1;
- route ``p2-d1``: prefill TP 2 -> decode TP 1, and its router;
- route ``p1-d2``: prefill TP 1 -> decode TP 2, and its router.

Every prompt (shorter than a page, one page, several pages, more than one chunk, a radix-cache
hit on the prefill) goes through each router, one at a time and then all at once, with greedy
decoding; the output tokens must equal the reference server's, token for token. The model is a
tiny random Llama built here in float32 (in bfloat16 the TP 2 all-reduce rounds differently
from TP 1 and greedy decoding of a random model meets near-ties).

No token is set anywhere, as in docs/sglang.md's recipe: each decode rank's Destination makes a
secret of its own, which the prefill presents (from the decode's KVSTAGE_ROOM message). A
stranger process with a raw NIXL agent that knows each decode rank's kvstage port, not its secret,
is told only "authentication failed", and the servers serve on, token for token.

Faults (tests/support/sglang_faults.py, armed by a file, on prefill rank 0 after its forward and
before kvstage sends):

- a slow forward the client gives up on: SGLang aborts the request on both servers, kvstage's
  request ends on the decode, and the next request is served and matches;
- one byte of a request's KV corrupted on the prefill, the control that the KV came through
  kvstage: the decode's tokens must differ from the reference (its first token, computed by the
  prefill before the corruption, must not);
- one byte flipped in the prefill's staging arena after kvstage's gather read it (the prefills run
  with ``KVSTAGE_CHECKSUM=all`` and ``KVSTAGE_PATH=read``): the decode's chunk checksum fails the request, the client gets an
  error that names the checksum and no tokens, and the next request matches;
- the prefill server killed with eight requests in flight: within 1 s every decode rank has failed
  each one and counted it as ``connection_lost`` in kvstage's metrics, every client gets the
  decode's failure with kvstage's cause, and the decode server stays up. This runs last: it takes
  each route's prefill down.

Needs sglang 0.5.23 and sglang-router (.ci/sglang-venv); the main venv skips this file.
"""

import concurrent.futures
import importlib.util
import os
import random
import re
import time

import pytest

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_router") is None:
    if os.environ.get("KVSTAGE_REQUIRE_SGLANG"):
        raise ImportError("KVSTAGE_REQUIRE_SGLANG is set but sglang or sglang_router is not importable")
    pytest.skip("sglang is not importable here (CI runs these in the SGLang venv, see .ci/run)", allow_module_level=True)

from support import sglang_servers as S  # noqa: E402

ROUTES = {"p2-d1": (2, 1), "p1-d2": (1, 2)}  # name: (prefill TP, decode TP)
MAX_NEW = 16
START_S = 480  # every server and router up, on two loaded cores
pytestmark = pytest.mark.timeout(START_S + 300)  # the first test also waits for the cluster
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "sglang.md")


def _prompt(seed: int, n: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(len(S.SPECIAL), S.VOCAB) for _ in range(n)]


_LONG = _prompt(4, 300)
PROMPTS = {  # name: input ids (page 16 tokens, chunk 128: S.PAGE_SIZE, S.CHUNK)
    "3 tokens": _prompt(1, 3),
    "one page": _prompt(2, S.PAGE_SIZE),
    "37 tokens": _prompt(3, 37),
    "two chunks": _prompt(5, S.CHUNK + 9),
    "300 tokens": _LONG,
    "radix hit": _LONG[:200] + _prompt(6, 41),  # after "300 tokens": the prefill reuses 192 cached tokens
}
CORRUPT_PROMPT = _prompt(7, 45)  # its own prefix: the prefill's radix cache keeps the corrupted page
FLIP_PROMPT = _prompt(8, 45)
IN_FLIGHT = 8  # requests in flight when the prefill is killed
KILL_PROMPTS = [_prompt(100 + i, 40) for i in range(IN_FLIGHT)]  # distinct: no radix hit between them
KILL_AFTER_S = 2.0  # the first one's hold on prefill rank 0 before the kill: the others reach both servers
FAIL_WITHIN_S = 1.0  # every decode rank has failed and counted each one this soon after the prefill's death shows
TEARDOWN_S = 2.0  # the most the kernel may take to close a killed prefill's sockets on two loaded cores
GIVE_UP_PROMPT = _prompt(9, 50)
STALL_S = 8  # the prefill's "slow forward" in test_client_gives_up_mid_request


class Cluster:
    def __init__(self, root):
        self.root = root
        self.logs = os.path.join(root, "logs")
        os.makedirs(self.logs)
        self.model = S.build_model(os.path.join(root, "model"))
        self.procs: list[S.Proc] = []
        self.routes: dict = {}
        self.timings: dict = {}

    def start(self):
        t0 = time.monotonic()
        self.reference = self._add(S.server("reference", self.model, S.free_port(), 1, "plain", self.logs))
        for name, (ptp, dtp) in ROUTES.items():
            faults = os.path.join(self.root, f"faults-{name}")
            os.makedirs(faults)
            bootstrap = S.free_port()
            prefill = self._add(S.server(f"{name}-prefill", self.model, S.free_port(), ptp, "prefill", self.logs,
                                         bootstrap, env={"KVSTAGE_TEST_FAULTS": faults, "KVSTAGE_CHECKSUM": "all",
                                                         "KVSTAGE_PATH": "read"}))  # flip-next flips a gather
            metrics = S.free_port(dtp)  # kvstage's metrics, one port per decode rank
            decode = self._add(S.server(f"{name}-decode", self.model, S.free_port(), dtp, "decode", self.logs,
                                        env={"KVSTAGE_METRICS_PORT": str(metrics)}))
            self.routes[name] = {"prefill": prefill, "decode": decode, "bootstrap": bootstrap, "faults": faults,
                                 "decode_metrics": [f"http://127.0.0.1:{metrics + i}" for i in range(dtp)]}
        for p in self.procs:  # all at once: start-up is mostly imports, on both cores
            p.start()
        deadline = t0 + START_S
        for p in self.procs:
            p.wait_ready(deadline)
        self.timings["servers up"] = time.monotonic() - t0
        for name, r in self.routes.items():
            r["router"] = self._add(S.router(f"{name}-router", r["prefill"], r["bootstrap"], r["decode"],
                                             S.free_port(), S.free_port(), self.logs)).start()
        for r in self.routes.values():
            r["router"].wait_ready(deadline, "/readiness")
        self.timings["routers up"] = time.monotonic() - t0

    def _add(self, p: S.Proc) -> S.Proc:
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("sglang-servers")))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(cluster):
    """The plain server's greedy tokens for every prompt (one at a time)."""
    out = {}
    for name, ids in list(PROMPTS.items()) + [("corrupt", CORRUPT_PROMPT)]:
        status, body = S.generate(cluster.reference.url, ids, MAX_NEW)
        assert status == 200, (name, status, body)
        out[name] = body["output_ids"]
        assert len(out[name]) == MAX_NEW, (name, body)
    return out


def _check(got: dict, want: list, name: str) -> None:
    assert got["meta_info"]["prompt_tokens"] == len(PROMPTS[name]), got["meta_info"]
    assert got["output_ids"] == want, f"{name}: {got['output_ids']} != reference {want}"


@pytest.mark.parametrize("route", ROUTES)
def test_each_prompt_matches_a_plain_server(cluster, reference, route):
    """One request at a time through the router: every output token equals the plain server's."""
    url = cluster.routes[route]["router"].url
    for name, ids in PROMPTS.items():
        status, body = S.generate(url, ids, MAX_NEW)
        assert status == 200, (route, name, status, body)
        _check(body, reference[name], name)
    # the radix hit reused the prefill's cache: 192 tokens (12 whole pages of the 200 shared)
    with open(cluster.routes[route]["prefill"].log_path) as f:
        assert "#cached-token: 192," in f.read(), "the prefill never reported the radix hit"


@pytest.mark.parametrize("route", ROUTES)
def test_concurrent_prompts_match_a_plain_server(cluster, reference, route):
    """All prompts at once: several rooms in flight in both servers and in kvstage."""
    url = cluster.routes[route]["router"].url
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {name: pool.submit(S.generate, url, ids, MAX_NEW) for name, ids in PROMPTS.items()}
    for name, f in futures.items():
        status, body = f.result()
        assert status == 200, (route, name, status, body)
        _check(body, reference[name], name)


def _arm(folder: str, fault: str, text: str = "") -> None:
    """Arm a fault of tests/support/sglang_faults.py for the route's next request (written whole, then renamed)."""
    with open(os.path.join(folder, fault + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(folder, fault + ".tmp"), os.path.join(folder, fault))


def _wait_for_log(proc: S.Proc, start: int, needle: str, timeout_s: float) -> str:
    """The part of ``proc``'s log after byte ``start`` once it holds ``needle``; AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(proc.log_path, errors="replace") as f:
            f.seek(start)
            text = f.read()
        if needle in text:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.name}'s log never said {needle!r}; it said:\n{text[-3000:]}")
        time.sleep(1.0)


@pytest.mark.parametrize("route", ROUTES)
def test_client_gives_up_mid_request(cluster, reference, route):
    """The client disconnects while prefill rank 0 holds the request after its forward (a slow
    forward): the router drops it on both servers, SGLang aborts it on both, the kvstage request ends
    on the decode, and the next request is served and matches the plain server."""
    r = cluster.routes[route]
    start = os.path.getsize(r["decode"].log_path)
    _arm(r["faults"], "stall-next", str(STALL_S))
    with pytest.raises(OSError):  # urllib's timeout: the client gives up
        S.generate(r["router"].url, GIVE_UP_PROMPT, MAX_NEW, timeout=STALL_S / 2)
    assert os.path.exists(os.path.join(r["faults"], "stall-next.fired")), "the stall hook never ran"
    _wait_for_log(r["decode"], start, "the decode aborted the request", 120)
    status, body = S.generate(r["router"].url, PROMPTS["37 tokens"], MAX_NEW)
    assert status == 200, (status, body)
    _check(body, reference["37 tokens"], "37 tokens")


@pytest.mark.parametrize("route", ROUTES)
def test_corrupted_prefill_byte_shows_in_the_decode(cluster, reference, route):
    """The control: one KV byte changed on the prefill after its forward changes what the decode generates."""
    r = cluster.routes[route]
    _arm(r["faults"], "corrupt-next")
    status, body = S.generate(r["router"].url, CORRUPT_PROMPT, MAX_NEW)
    assert os.path.exists(os.path.join(r["faults"], "corrupt-next.fired")), "the corruption hook never ran"
    assert status == 200, (status, body)
    got, want = body["output_ids"], reference["corrupt"]
    assert got[0] == want[0], (got, want)  # the prefill's own token, computed before the corruption
    assert got[1:] != want[1:], f"decode output unchanged by a corrupted KV byte: {got}"


@pytest.mark.parametrize("route", ROUTES)
def test_a_chunk_corrupted_in_transit_fails_its_request_not_its_tokens(cluster, reference, route):
    """One byte flipped in the prefill's arena after kvstage's gather read it (the prefills run with
    ``KVSTAGE_CHECKSUM=all``): the decode's checksum fails the request, so the client gets an error naming the
    checksum and no token computed from the changed byte; the next request is served and matches."""
    r = cluster.routes[route]
    _arm(r["faults"], "flip-next")
    status, body = S.generate(r["router"].url, FLIP_PROMPT, MAX_NEW)
    assert os.path.exists(os.path.join(r["faults"], "flip-next.fired")), "the flip hook never ran"
    assert status != 200 and "checksum" in str(body), (status, body)
    status, body = S.generate(r["router"].url, PROMPTS["37 tokens"], MAX_NEW)
    assert status == 200, (status, body)
    _check(body, reference["37 tokens"], "37 tokens")


_LISTENING = re.compile(r"dst (\d+): listening on (\S+):(\d+) \([^;\n]*; ([^)\n]*)\)")
_DECODE_MODEL = re.compile(r"kvstage: decode rank \d+ of engine .* receives from every prefill engine on .* model "
                           r"(\S+#[0-9a-f]{16}(?: weights=[0-9a-f]{16})?)\)")


def _decode_ranks(proc: S.Proc) -> tuple[list, str]:
    """A decode server's kvstage Destinations as its log names them, [(rank, host, port, how sources
    authenticate)], and the model identity they carry."""
    with open(proc.log_path, errors="replace") as f:
        text = f.read()
    ranks = sorted({(int(m[1]), m[2], int(m[3]), m[4]) for m in _LISTENING.finditer(text)})
    models = set(_DECODE_MODEL.findall(text))
    assert len(models) == 1, f"{proc.name}'s log names the model {models}"
    return ranks, models.pop()


@pytest.mark.parametrize("route", ROUTES)
def test_the_default_recipe_sets_no_token_and_each_decode_rank_makes_its_own_secret(cluster, reference, route):
    """The servers run as docs/sglang.md's recipe: no KVSTAGE_AUTH_TOKEN anywhere. Every decode rank's
    Destination makes a secret of its own and admits only sources that present it (the prefill gets it in
    the KVSTAGE_ROOM message), and the output is token-exact with the plain server's."""
    r = cluster.routes[route]
    for p in cluster.procs:
        assert "KVSTAGE_AUTH_TOKEN" not in p.env, p.name
    status, body = S.generate(r["router"].url, PROMPTS["two chunks"], MAX_NEW)
    assert status == 200, (status, body)
    _check(body, reference["two chunks"], "two chunks")
    ranks, model = _decode_ranks(r["decode"])
    assert [rank for rank, *_ in ranks] == list(range(ROUTES[route][1])), ranks
    for rank, _, _, auth in ranks:
        assert auth.startswith("sources present this rank's own secret"), (rank, auth)
    assert " weights=" in model, model  # the identity covers the checkpoint's weights


@pytest.mark.parametrize("route", ROUTES)
def test_a_stranger_at_a_decode_rank_port_is_told_nothing_and_the_servers_serve_on(cluster, reference, route):
    """A stranger process of this host that knows each decode rank's kvstage port, not its secret (the
    prefill ranks listen on no kvstage port: they connect out): a raw NIXL agent and a raw socket
    (tests/support/stranger.py) are told "authentication failed" to a hello (its own spec, a wrong geometry,
    a guessed token) and to a probe, nothing to a ping, and nothing of the model, the geometry or the
    Destination's memory. The servers then serve every prompt, token for token, as before."""
    import json
    import subprocess
    import sys

    from support.stranger import told_nothing

    r = cluster.routes[route]
    if not _LISTENING.search(open(r["decode"].log_path, errors="replace").read()):
        status, body = S.generate(r["router"].url, PROMPTS["37 tokens"], MAX_NEW)  # the Destinations start
        assert status == 200, (status, body)
    ranks, model = _decode_ranks(r["decode"])
    assert len(ranks) == ROUTES[route][1], ranks
    start = os.path.getsize(r["decode"].log_path)
    stranger = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "stranger.py")
    env = {k: v for k, v in os.environ.items() if k != "KVSTAGE_AUTH_TOKEN"}
    for rank, host, port, _ in ranks:
        out = subprocess.run([sys.executable, stranger, json.dumps({"host": host, "port": port})],
                             capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert told_nothing(got, model) == [], (rank, got)
    with open(r["decode"].log_path, errors="replace") as f:
        f.seek(start)
        assert "authentication failed" in f.read(), "the decode never logged refusing the stranger"
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {name: pool.submit(S.generate, r["router"].url, ids, MAX_NEW) for name, ids in PROMPTS.items()}
    for name, f in futures.items():
        status, body = f.result()
        assert status == 200, (route, name, status, body)
        _check(body, reference[name], name)


def _timed_generate(url: str, ids: list) -> tuple:
    status, body = S.generate(url, ids, MAX_NEW)
    return status, body, time.time()


def _first_disconnect(proc: S.Proc, start: int) -> float:
    """The wall-clock time of the first kvstage ``disconnected`` line in ``proc``'s log after byte ``start``."""
    import datetime
    import re

    with open(proc.log_path, errors="replace") as f:
        f.seek(start)
        text = f.read()
    m = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \d+\] kvstage dst \d+: .* disconnected", text)
    assert m, f"{proc.name}'s log has no kvstage disconnect line after the kill:\n{text[-3000:]}"
    seen = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    return time.mktime(seen.timetuple()) + int(m.group(2)) / 1000


def _counted(urls: list, before: list, cause: str, n: int, timeout_s: float) -> float:
    """The time at which every decode rank's kvstage metrics count ``n`` more failures of ``cause``."""
    deadline = time.time() + timeout_s
    while True:
        now = time.time()
        if all(S.kvstage_failures(u).get(cause, 0) - b.get(cause, 0) >= n for u, b in zip(urls, before)):
            return now
        if now > deadline:
            raise AssertionError(f"not {n} {cause} failures counted within {timeout_s} s: "
                                 f"{[S.kvstage_failures(u) for u in urls]} (before: {before})")
        time.sleep(0.02)


@pytest.mark.parametrize("route", ROUTES)
def test_prefill_killed_with_requests_in_flight_fails_each_within_1s(cluster, reference, route):
    """Eight requests in flight; prefill rank 0 holds the first after its forward, then dies (its server with it):
    within 1 s of its connection closing (the kernel closes a killed process's sockets after tearing down its
    memory) every decode rank has failed and counted each request as ``connection_lost`` (none waits for
    SGLang's heartbeat and is counted ``aborted``), every client gets the decode's KVTransferError with
    kvstage's cause, and the decode server stays up. The clients' answers come when SGLang's router has the
    prefill server's answer too (the prefill's HTTP server outlives its scheduler by seconds): printed, not
    kvstage's to bound. (Takes the route's prefill down.)"""
    r = cluster.routes[route]
    before = [S.kvstage_failures(url) for url in r["decode_metrics"]]
    start = os.path.getsize(r["decode"].log_path)
    _arm(r["faults"], "die-next", str(KILL_AFTER_S))
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(_timed_generate, r["router"].url, ids) for ids in KILL_PROMPTS]
        t_counted = _counted(r["decode_metrics"], before, "connection_lost", IN_FLIGHT, 60 + KILL_AFTER_S)
        results = [f.result() for f in futures]
    fired = os.path.join(r["faults"], "die-next.fired")
    assert os.path.exists(fired), "the kill hook never ran"
    t_kill = float(open(fired).read().split()[1])
    for status, body, _ in results:
        assert status != 200, (status, body)
        assert "KVTransferError" in body and "connection lost" in body, (status, body)
        assert "unknown reason from another rank" not in body, (status, body)
    answered = sorted(t - t_kill for _, _, t in results)
    t_seen = _first_disconnect(r["decode"], start)
    print(f"\n{route}: the decode saw the prefill's connection close {t_seen - t_kill:.3f} s after the kill; "
          f"{IN_FLIGHT} requests failed and counted on every decode rank {t_counted - t_kill:.3f} s after it; "
          f"clients answered {answered[0]:.2f}-{answered[-1]:.2f} s after it")
    # kvstage's part: from the first sign of the death to every request failed and counted
    assert t_counted - t_seen <= FAIL_WITHIN_S, f"{route}: counted {t_counted - t_seen:.3f} s after the disconnect"
    # the kernel's: a SIGKILLed process's sockets close once its memory is torn down (0.4-1.0 s measured here)
    assert t_counted - t_kill <= TEARDOWN_S + FAIL_WITHIN_S, f"{route}: counted {t_counted - t_kill:.3f} s after the kill"
    for url, was in zip(r["decode_metrics"], before):
        now = S.kvstage_failures(url)
        grew = {cause: n - was.get(cause, 0) for cause, n in now.items() if n != was.get(cause, 0)}
        assert grew == {"connection_lost": IN_FLIGHT}, (url, grew)
    r["decode"].wait_ready(time.monotonic() + 30)  # still serving


def test_docs_show_the_commands_this_test_runs():
    """docs/sglang.md's CPU commands are the ones the cluster above launches (placeholders for paths and ports)."""
    def flat(text: str) -> str:
        return " ".join(text.replace("\\\n", " ").split())

    docs = flat(open(DOCS).read())
    for tps in ROUTES.values():
        for command in S.doc_commands(*tps):
            assert flat(command) in docs, f"docs/sglang.md does not show: {command}"
