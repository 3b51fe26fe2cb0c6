"""``kvstage probe --peer HOST:PORT``: probe the path to a running destination rank.

The destination (a serving rank or ``kvstage bench --role dst``) lends one
free slot of its staging arena, the memory KV chunks land in. A local writer
process (the self-test's, run with ``UCX_PROTO_INFO=y``) writes into it a few
times; its UCX tables say which transport the bytes took, the timings give the
bandwidth, and ``assess`` judges it against both sides' facts.
"""

from __future__ import annotations

import random
import socket
import tempfile
import time
from typing import Any

from kvstage.errors import KVStageError
from kvstage.link import ucx_info
from kvstage.link.assess import assess
from kvstage.link.facts import environment, value
from kvstage.probe.selftest import SelfTestResult, _Child, _failed, child_env


class PeerProbeFailed(KVStageError):
    """The peer could not be reached or refused the probe."""


def _ask_peer(host: str, port: int, hello: dict, token: str, nbytes: int, timeout: float) -> tuple[dict, Any]:
    from kvstage.protocol.messages import PROTOCOL_VERSION
    from kvstage.protocol.wire import Connection

    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise PeerProbeFailed(f"cannot connect to {host}:{port}: {e}") from e
    conn = Connection(sock, f"{host}:{port}")
    conn.send(
        {
            "type": "probe",
            "version": PROTOCOL_VERSION,
            "token": token,
            "transport": "nixl",
            "nbytes": nbytes,
            "agent": hello["agent"],
            "facts": hello["facts"],
        }
    )
    try:
        reply = conn.recv()
    except (OSError, ConnectionError, KVStageError) as e:
        conn.close()
        raise PeerProbeFailed(f"{host}:{port} gave no answer to the probe: {e}") from e
    if reply.get("type") != "probe_ok":
        conn.close()
        raise PeerProbeFailed(f"{host}:{port} refused the probe: {reply.get('reason', reply.get('type'))}")
    return reply, conn


def run_peer_probe(
    host: str,
    port: int,
    device: str = "cpu",
    size_mb: int = 64,
    iters: int = 3,
    token: str = "",
    timeout: float = 90.0,
    gpu: int = 0,
) -> SelfTestResult:
    """Measure writes from a local process into a slot lent by the destination at ``host:port``."""
    deadline = time.monotonic() + timeout
    env = child_env(None)
    with tempfile.TemporaryDirectory(prefix="kvstage-probe-") as tmp:
        cfg: dict[str, Any] = {
            "device": device,
            "nbytes": size_mb << 20,
            "iters": iters,
            "timeout": timeout,
            "salt": random.randrange(251),
            "gpu": gpu,
        }
        writer = _Child("writer", cfg, env, tmp)
        conn, error, hello = None, None, None
        res: dict[str, Any] = {}
        try:
            hello = writer.recv(deadline)
            error = _failed("writer", hello)
            if not error:
                reply, conn = _ask_peer(host, port, hello, token, cfg["nbytes"], timeout)
                res["peer_facts"] = reply.get("facts")
                writer.send({"metadata": reply["metadata"], "region": reply["region"]})
                result = writer.recv(deadline)
                error = _failed("writer", result)
                res["seconds"] = result.get("seconds", [])
                res["nbytes"] = result.get("nbytes", cfg["nbytes"])
        except PeerProbeFailed as e:
            error = str(e)
        finally:
            output = writer.finish(deadline, abort=bool(error))
            if conn is not None:
                conn.close()
    local = hello.get("facts") if isinstance(hello, dict) else None
    peer = res.get("peer_facts")
    tables = ucx_info.parse_proto_info(output)
    mem = {"cpu": "host", "cuda": "cuda"}
    peer_mem = (value(peer, "memory", {}) or {}).get("device", "cpu") if peer else "cpu"
    nbytes = res.get("nbytes", cfg["nbytes"])
    agent = hello.get("agent") if isinstance(hello, dict) else None
    sel = ucx_info.select(tables, mem[device], mem.get(peer_mem, "host"), nbytes, worker=agent)
    secs = res.get("seconds") or []
    gbps = nbytes / min(secs) / 1e9 if secs and not error else None
    peer_name = f"{host}:{port} ({(value(peer, 'host', {}) or {}).get('hostname', 'peer')})"
    msgs = list(dict.fromkeys(ucx_info.ucx_messages(output)))
    finding = assess(
        local or {},
        peer,
        sel.to_dict() if sel else None,
        gbps,
        environment(env)["value"],
        peer_name=peer_name,
        write_error=error,
        ucx_messages=msgs,
    )
    return SelfTestResult(
        finding=finding,
        writer_facts=local,
        target_facts=peer,
        selection=sel.to_dict() if sel else None,
        seconds=secs,
        tables=ucx_info.by_memory_pair(tables, nbytes),
        ucx_messages=msgs,
        output={"writer": output},
    )
