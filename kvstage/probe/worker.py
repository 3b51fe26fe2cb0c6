"""One side of the self-test, run as ``python -m kvstage.probe.worker CONFIG_JSON``.

The ``target`` registers a zeroed buffer, reports its facts and metadata, waits
for the writer's notification and checks every byte. The ``writer`` registers a
buffer filled with a pattern, loads the target's metadata (a line of JSON on
stdin), times ``iters`` writes of the whole buffer through ``NixlTransport``
and sends one more with a notification.

Messages to the parent go as JSON lines on the file descriptor ``ctrl_fd``;
stdout and stderr are left to UCX, whose ``UCX_PROTO_INFO`` tables the parent
reads from them.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

_BLOCK = 1 << 20
DONE = b"kvstage-probe-done"


def _pattern(torch, device, salt: int):
    return ((torch.arange(_BLOCK, dtype=torch.int32, device=device) + salt) % 251).to(torch.uint8)


def _wait(tr, handle, deadline: float) -> None:
    from kvstage.transports.base import WriteState

    while tr.poll(handle) is not WriteState.DONE:
        if time.monotonic() > deadline:
            raise TimeoutError("the write did not complete in time")


def _writer(tr, torch, buf, region, cfg, send) -> None:
    from kvstage.transports.base import Region, Spans

    peer_msg = json.loads(sys.stdin.readline())
    peer = tr.connect(base64.b64decode(peer_msg["metadata"]))
    remote = Region.from_wire(peer_msg["region"])
    buf.view(-1, _BLOCK).copy_(_pattern(torch, buf.device, cfg["salt"]).expand(buf.numel() // _BLOCK, _BLOCK))
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    local, dest = Spans.single(region, [0], [region.nbytes]), Spans.single(remote, [0], [region.nbytes])
    deadline = time.monotonic() + cfg["timeout"]
    seconds = []
    for i in range(cfg["iters"] + 1):
        last = i == cfg["iters"]
        t0 = time.perf_counter()
        h = tr.write(peer, local, dest, DONE if last else b"")
        _wait(tr, h, deadline)
        if not last:
            seconds.append(time.perf_counter() - t0)
        tr.release(h)
    send(type="result", seconds=seconds, nbytes=region.nbytes)


def _target(tr, torch, buf, cfg, send) -> None:
    deadline = time.monotonic() + cfg["timeout"]
    while not any(msg == DONE for _, msg in tr.notifications()):
        if time.monotonic() > deadline:
            raise TimeoutError("no notification from the writer in time")
        time.sleep(0.0005)
    expect = _pattern(torch, buf.device, cfg["salt"])
    ok = bool((buf.view(-1, _BLOCK) == expect).all())
    send(type="result", verified=ok)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(cfg["ctrl_fd"], "w", buffering=1)

    def send(**msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    stage = "import"
    tr = None
    try:
        import torch

        from kvstage.link.facts import collect_local
        from kvstage.transports.nixl import NixlTransport

        stage = "allocate"
        device = torch.device("cuda", cfg["gpu"]) if cfg["device"] == "cuda" else torch.device("cpu")
        buf = torch.zeros(cfg["nbytes"], dtype=torch.uint8, device=device)
        stage = "start NIXL"
        tr = NixlTransport(label=f"kvstage-probe-{cfg['role']}")
        stage = "register"
        region = tr.register(buf)
        facts = collect_local(buf, agent_plugins=tr.plugins())
        send(
            type="hello",
            facts=facts,
            agent=tr.agent_name,
            region=region.to_wire(),
            metadata=base64.b64encode(tr.metadata()).decode(),
        )
        stage = "write" if cfg["role"] == "writer" else "receive"
        if cfg["role"] == "writer":
            _writer(tr, torch, buf, region, cfg, send)
        else:
            _target(tr, torch, buf, cfg, send)
        return 0
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        send(type="error", stage=stage, error=f"{type(e).__name__}: {e}")
        return 1
    finally:
        if tr is not None:
            tr.close()


if __name__ == "__main__":
    sys.exit(main())
