"""The self-test: two local processes, a measured write, and what UCX chose.

Both children run with ``UCX_PROTO_INFO=y``; their stdout and stderr go to
files, so the protocol tables UCX prints (at the file-descriptor level, from C)
are captured whole. The writer's tables for its writes to the target say which
transport the bytes really took.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from kvstage.link import ucx_info
from kvstage.link.assess import assess
from kvstage.link.facts import collect_local, environment, value
from kvstage.link.finding import Evidence, Finding, Severity, fact

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class SelfTestResult:
    finding: Finding
    writer_facts: dict | None = None
    target_facts: dict | None = None
    selection: dict | None = None
    seconds: list[float] = field(default_factory=list)
    verified: bool | None = None
    tables: dict = field(default_factory=dict)
    ucx_messages: list[str] = field(default_factory=list)
    env_overrides: dict = field(default_factory=dict)
    output: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "finding": self.finding.to_dict(),
            "writer_facts": self.writer_facts,
            "target_facts": self.target_facts,
            "selection": self.selection,
            "seconds": self.seconds,
            "verified": self.verified,
            "ucx_tables": self.tables,
            "ucx_messages": self.ucx_messages,
            "env_overrides": self.env_overrides,
        }


class _Child:
    def __init__(self, role: str, cfg: dict, env: dict, tmp: str):
        rfd, wfd = os.pipe()
        self.role = role
        self.out_path, self.err_path = os.path.join(tmp, f"{role}.out"), os.path.join(tmp, f"{role}.err")
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstage.probe.worker", json.dumps({**cfg, "role": role, "ctrl_fd": wfd})],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=env,
                pass_fds=(wfd,),
            )
        os.close(wfd)
        self.ctrl = os.fdopen(rfd, "r")

    def recv(self, deadline: float) -> dict:
        """The next message, or an ``error`` message if the child died or the time ran out."""
        sel = selectors.DefaultSelector()
        sel.register(self.ctrl, selectors.EVENT_READ)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"type": "error", "stage": "timeout", "error": f"the {self.role} gave no answer in time"}
                if sel.select(timeout=min(left, 0.5)):
                    line = self.ctrl.readline()
                    if not line:
                        code = self.proc.wait(timeout=10)
                        return {
                            "type": "error",
                            "stage": "exit",
                            "error": f"the {self.role} exited with code {code} without an answer",
                        }
                    return json.loads(line)
        finally:
            sel.close()

    def send(self, msg: dict) -> None:
        assert self.proc.stdin is not None  # Popen(stdin=PIPE)
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def finish(self, deadline: float, abort: bool = False) -> str:
        """Wait for the child (interrupt it first if ``abort``); return its stdout + stderr."""
        try:
            assert self.proc.stdin is not None  # Popen(stdin=PIPE)
            self.proc.stdin.close()  # a writer still waiting for the target's metadata reads EOF
        except OSError:
            pass
        if abort and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the child reports and exits, flushing UCX's output
            deadline = min(deadline, time.monotonic() + 5)
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.ctrl.close()
        parts = []
        for p in (self.out_path, self.err_path):
            with open(p, errors="replace") as f:
                parts.append(f.read())
        return "\n".join(parts)


def child_env(overrides: dict | None) -> dict:
    env = dict(os.environ)
    for k, v in (overrides or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    env["UCX_PROTO_INFO"] = "y"
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env["PYTHONPATH"] = os.pathsep.join([_PKG_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _failed(role: str, msg: dict) -> str | None:
    return f"the {role} failed at {msg['stage']}: {msg['error']}" if msg["type"] == "error" else None


def _exchange(target: _Child, writer: _Child, deadline: float, res: dict) -> str | None:
    """Hand the target's metadata to the writer and collect both results; the first error, if any."""
    th = target.recv(deadline)
    res["target_facts"] = th.get("facts")
    if _failed("target", th):
        return _failed("target", th)
    wh = writer.recv(deadline)
    res["writer_facts"], res["writer_agent"] = wh.get("facts"), wh.get("agent")
    if _failed("writer", wh):
        return _failed("writer", wh)
    writer.send({"metadata": th["metadata"], "region": th["region"]})
    wr = writer.recv(deadline)
    if _failed("writer", wr):
        return _failed("writer", wr)
    res["seconds"] = wr.get("seconds", [])
    tr = target.recv(deadline)
    if _failed("target", tr):
        return _failed("target", tr)
    res["verified"] = tr.get("verified")
    return None if res["verified"] else "the bytes that arrived differ from the bytes written"


def _measure(
    device: str, nbytes: int, iters: int, overrides: dict | None, timeout: float, gpus: tuple[int, int]
) -> dict:
    """Run the two children once; return everything they said and printed."""
    deadline = time.monotonic() + timeout
    cfg = {"device": device, "nbytes": nbytes, "iters": iters, "timeout": timeout, "salt": random.randrange(251)}
    env = child_env(overrides)
    res: dict = {"error": None}
    with tempfile.TemporaryDirectory(prefix="kvstage-probe-") as tmp:
        target = _Child("target", {**cfg, "gpu": gpus[0]}, env, tmp)
        writer = _Child("writer", {**cfg, "gpu": gpus[1]}, env, tmp)
        try:
            res["error"] = _exchange(target, writer, deadline, res)
        except (OSError, ValueError, KeyError) as e:  # a broken pipe or a garbled message
            res["error"] = f"the self-test lost contact with its processes: {type(e).__name__}: {e}"
        finally:
            res["writer_output"] = writer.finish(deadline, abort=bool(res["error"]))
            res["target_output"] = target.finish(deadline, abort=bool(res["error"]))
    tables = ucx_info.parse_proto_info(res["writer_output"])
    mem = {"cpu": "host", "cuda": "cuda"}[device]
    sel = ucx_info.select(tables, mem, mem, nbytes, worker=res.get("writer_agent")) or ucx_info.select(
        tables, mem, mem, nbytes
    )
    res["selection"] = sel.to_dict() if sel else None
    res["tables"] = ucx_info.by_memory_pair(tables, nbytes)
    msgs = ucx_info.ucx_messages(res["writer_output"] + "\n" + res["target_output"])
    res["ucx_messages"] = list(dict.fromkeys(msgs))
    res["env"] = environment(env)["value"]
    secs = res.get("seconds") or []
    res["gbps"] = nbytes / min(secs) / 1e9 if secs and not res["error"] else None
    return res


def _fix_overrides(finding: Finding) -> tuple[dict, str] | None:
    """The environment change that applies the WARNING's fix, when it is one (``assess`` says)."""
    change = finding.details.get("fix_env")
    if not change:
        return None
    return change, ", ".join(f"{k} unset" if v is None else f"{k}={v}" for k, v in change.items())


def _stand_in(device: str) -> dict:
    """This process's facts plus the memory the self-test asked for, when the writer gave none."""
    facts = collect_local(with_gpus=False)
    facts["memory"] = fact({"device": device, "gpu": None}, "assumed", "the device the self-test asked for")
    return facts


def run_selftest(
    device: str = "cpu",
    size_mb: int = 64,
    iters: int = 3,
    env: dict | None = None,
    timeout: float = 90.0,
    verify_fix: bool = True,
    gpus: tuple[int, int] | None = None,
) -> SelfTestResult:
    """Probe the path between two local processes.

    ``env``: variables to set (``None`` to unset) in both children, on top of
    this process's environment. ``gpus``: (target, writer) CUDA device indices
    (default: 0 and 1 when there are two GPUs, else 0 and 0). With
    ``verify_fix``, a WARNING whose fix is an environment change is checked by
    a second run with that change.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} must be cpu or cuda")
    if size_mb < 1:
        raise ValueError(f"size_mb {size_mb} must be at least 1")
    if device == "cuda" and gpus is None:
        import torch

        gpus = (0, 1) if torch.cuda.device_count() > 1 else (0, 0)
    gpus = gpus or (0, 0)
    nbytes = size_mb << 20
    res = _measure(device, nbytes, iters, env, timeout, gpus)
    local = res.get("writer_facts") or _stand_in(device)
    peer = res.get("target_facts")
    peer_name = f"self-test peer (pid {value(peer, 'pid', '?')}, {device})"
    child_env_fact = value(res.get("writer_facts"), "env", None) or res["env"]
    kw = dict(peer_name=peer_name, write_error=res["error"], ucx_messages=res["ucx_messages"])
    finding = assess(local, peer, res["selection"], res["gbps"], child_env_fact, **kw)
    if finding.severity is Severity.WARNING and verify_fix:
        change = _fix_overrides(finding)
        if change:
            again = _measure(device, nbytes, iters, {**(env or {}), **change[0]}, timeout, gpus)
            check = {
                "change": change[1],
                "selection": again["selection"],
                "gbps": again["gbps"],
                "error": again["error"],
            }
            finding = assess(local, peer, res["selection"], res["gbps"], child_env_fact, fix_check=check, **kw)
    finding.details["tables"] = res["tables"]
    if res.get("verified"):
        at = 1 if finding.evidence and finding.evidence[0].text.startswith("UCX selected") else 0
        finding.evidence.insert(
            at, Evidence("measured", f"{size_mb} MiB write, best of {iters}, every byte checked on the peer")
        )
    return SelfTestResult(
        finding=finding,
        writer_facts=res.get("writer_facts"),
        target_facts=peer,
        selection=res["selection"],
        seconds=res.get("seconds") or [],
        verified=res.get("verified"),
        tables=res["tables"],
        ucx_messages=res["ucx_messages"],
        env_overrides=dict(env or {}),
        output={"writer": res["writer_output"], "target": res["target_output"]},
    )
