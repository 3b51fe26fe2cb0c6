"""The decode engine's pull to a prefill rank (kvstage.plugin.vllm.pull): real sockets."""

import socket
import time

import pytest

from kvstage.errors import KVStageError
from kvstage.plugin.vllm.pull import PullError, PullServer, pull


@pytest.fixture
def server():
    seen = []

    def handler(msg):
        seen.append(msg)
        if msg.get("req") == "slow":
            time.sleep(2)
        if msg.get("req") == "refused":
            raise KVStageError("not prefilled here")
        if msg.get("req") == "bug":
            raise RuntimeError("boom")
        return {"type": "ok"}

    s = PullServer("127.0.0.1", handler, token="t0k")
    s.seen = seen
    yield s
    s.close()


def test_ok_reply_and_token_checked(server):
    assert pull(server.address, {"type": "pull", "req": "r1"}, "t0k")["type"] == "ok"
    assert server.seen[-1]["req"] == "r1"
    with pytest.raises(PullError, match="auth token"):
        pull(server.address, {"type": "pull", "req": "r2"}, "wrong")
    assert server.seen[-1]["req"] == "r1"  # the handler never saw the unauthenticated pull


@pytest.mark.parametrize("req,needle", [("refused", "not prefilled here"), ("bug", "RuntimeError: boom")])
def test_refusals_and_bugs_are_answered(server, req, needle):
    with pytest.raises(PullError, match=needle):
        pull(server.address, {"type": "pull", "req": req}, "t0k")


def test_silent_prefill_times_out(server):
    t = time.perf_counter()
    with pytest.raises(PullError, match="no answer"):
        pull(server.address, {"type": "pull", "req": "slow"}, "t0k", timeout=0.5)
    assert time.perf_counter() - t < 1.5


def test_unreachable_prefill_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(PullError, match=f"127.0.0.1:{port}: cannot connect"):
        pull(("127.0.0.1", port), {"type": "pull", "req": "r"}, timeout=1)
