"""A stranger on a rank's host, as an attacker would be: a raw NIXL agent (NIXL's own
``nixl_agent``, no kvstage endpoint) and a raw socket that speaks the control protocol by hand.
It knows a destination's port, not its secret, and tries what it can before authenticating:

- a hello with its agent's metadata, no token and its own spec (``spec``), as a source would;
- the same with a wrong geometry (99 layers), fishing for the destination's in the refusal;
- a hello with a guessed token;
- a probe request (a slot of the arena to write into);
- a ping first (anything but a hello or a probe).

Prints one JSON line: per try, every message the destination sent before it closed the
connection, and whether it did (within 10 s).

    python stranger.py '{"host": "127.0.0.1", "port": 1234, "spec": {...}}'
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvstage.protocol.messages import PROTOCOL_VERSION  # noqa: E402
from kvstage.transports.nixl import load_nixl  # noqa: E402

DEFAULT_SPEC = {"layers": 2, "kv_heads": 4, "head_dim": 32, "dtype": "float32", "mla": False, "tp": 1,
                "page_size": 16, "order": "NHD"}


def _frame(msg: dict) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack("!I", len(data)) + data


def _try(host: str, port: int, msg: dict) -> dict:
    """Send ``msg``; every message that comes back, until the destination closes (or 10 s pass)."""
    s = socket.create_connection((host, port), timeout=10)
    replies, closed, buf = [], False, b""
    try:
        s.sendall(_frame(msg))
        while True:
            try:
                data = s.recv(1 << 16)
            except ConnectionResetError:
                closed = True
                break
            except socket.timeout:
                break
            if not data:
                closed = True
                break
            buf += data
            while len(buf) >= 4 and len(buf) >= 4 + struct.unpack("!I", buf[:4])[0]:
                n = struct.unpack("!I", buf[:4])[0]
                replies.append(json.loads(buf[4:4 + n]))
                buf = buf[4 + n:]
    finally:
        s.close()
    return {"about": msg["type"], "replies": replies, "closed": closed}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    host, port = cfg["host"], int(cfg["port"])
    api = load_nixl()
    agent = api.nixl_agent("stranger", api.nixl_agent_config(backends=["UCX"]))
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    agent.register_memory(buf)
    md = base64.b64encode(agent.get_agent_metadata()).decode()
    spec = cfg.get("spec") or DEFAULT_SPEC
    hello = {"type": "hello", "version": PROTOCOL_VERSION, "token": "", "engine": "", "model": "", "uid": os.getuid(),
             "spec": spec, "rank": 0, "agent": "stranger", "transport": "nixl", "metadata": md,
             "slot_bytes": 1 << 16, "facts": {}, "kv_facts": {}, "paths": ["read", "pages", "direct", "ipc"],
             "nonce": "0" * 32}
    tries = {
        "no token, its own spec": hello,
        "no token, a wrong geometry": dict(hello, spec=dict(spec, layers=99)),
        "a guessed token": dict(hello, token="kvstage"),
        "a probe": {"type": "probe", "version": PROTOCOL_VERSION, "token": "", "nbytes": 1 << 16, "agent": "stranger",
                    "facts": {}, "transport": "nixl"},
        "a ping first": {"type": "ping"},
    }
    print(json.dumps({"tries": {name: _try(host, port, msg) for name, msg in tries.items()}}), flush=True)


def told_nothing(got: dict, model: str = "") -> list:
    """What is wrong with what a stranger got (``main``'s output): each try must end in one refusal that says
    only that authentication failed (a ping first: no answer), its connection closed, and nothing of the
    model (``model``: the destination's identity) or of the destination's memory told. [] when all is right."""
    from kvstage.protocol.handshake import AUTH_FAILED

    wrong = []
    for name, t in got["tries"].items():
        want = [] if name == "a ping first" else [{"type": "error", "reason": AUTH_FAILED, "about": t["about"]}]
        if t["replies"] != want or not t["closed"]:
            wrong.append(f"{name}: {t}")
    text = json.dumps(got)
    for word in ("metadata", "region", "welcome", "probe_ok", "slot", "layers=", "kv_heads", "float", "dtype",
                 "weights"):
        if word in text:
            wrong.append(f"{word!r} told: {text[:2000]}")
    for part in filter(None, [model] + model.replace(" weights=", "#").split("#")):
        if part in text:
            wrong.append(f"the model ({part!r}) told")
    return wrong


if __name__ == "__main__":
    main()
