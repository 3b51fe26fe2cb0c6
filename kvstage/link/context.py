"""What two peers' facts say about the link between them (pure: facts in, data out)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstage.link.facts import value
from kvstage.link.finding import Evidence
from kvstage.link.gpu import nvlink_between, pci_key


@dataclass
class LinkContext:
    src_mem: str | None  # "host" or "cuda": the writer's memory
    dst_mem: str | None  # the peer's memory
    same_host: bool | None
    same_pidns: bool | None
    same_gpu: bool | None = None
    nvlink: bool | None = None
    peer_access: bool | None = None
    rdma_active: tuple[list[dict], list[dict]] = ([], [])  # (local ports, peer ports) that are ACTIVE
    memory_ipc: tuple[str | None, str | None] = (None, None)
    gpudirect_capable: bool | None = None
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def gpu(self) -> bool:
        return "cuda" in (self.src_mem, self.dst_mem)

    @property
    def rdma_both(self) -> bool:
        return bool(self.rdma_active[0]) and bool(self.rdma_active[1])


def _mem(facts) -> str | None:
    dev = value(facts, "memory", {}).get("device")
    return {"cpu": "host", "cuda": "cuda"}.get(dev)


def _active_ports(facts) -> list[dict]:
    out = []
    for dev in value(facts, "rdma", []) or []:
        for p in dev.get("ports", []):
            if p.get("state") == "ACTIVE":
                out.append(
                    {"device": f"{dev['name']}:{p['port']}", "rate": p.get("rate"), "link_layer": p.get("link_layer")}
                )
    return out


def link_context(local: dict, peer: dict | None) -> LinkContext:
    ev: list[Evidence] = []
    peer = peer or {}
    lh, ph = value(local, "host"), value(peer, "host")
    same_host = same_pidns = None
    if lh and ph:
        if lh.get("boot_id") and ph.get("boot_id"):
            same_host = lh["boot_id"] == ph["boot_id"] and lh["hostname"] == ph["hostname"]
            ev.append(Evidence("queried", ("same host" if same_host else "different hosts") + " (hostname + boot id)"))
        else:
            same_host = lh["hostname"] == ph["hostname"]
            ev.append(Evidence("assumed", ("same host" if same_host else "different hosts") + " (by hostname alone)"))
    else:
        ev.append(Evidence("assumed", "host of the peer unknown (no peer facts)"))
    ln, pn = value(local, "pid_namespace"), value(peer, "pid_namespace")
    if same_host and ln and pn:
        same_pidns = ln == pn
        ev.append(
            Evidence("queried", "same PID namespace" if same_pidns else f"different PID namespaces ({ln} vs {pn})")
        )
    ctx = LinkContext(_mem(local), _mem(peer), same_host, same_pidns, evidence=ev)

    lg, pg = value(local, "memory", {}).get("gpu"), value(peer, "memory", {}).get("gpu")
    if same_host and lg and pg:
        ctx.same_gpu = pci_key(lg.get("pci")) == pci_key(pg.get("pci")) and lg.get("pci") is not None
        nv, why = nvlink_between(value(local, "gpus"), lg.get("pci"), pg.get("pci"))
        ctx.nvlink = nv
        if ctx.same_gpu:
            ev.append(Evidence("queried", f"both buffers on one GPU ({lg.get('name')} {lg.get('pci')})"))
        else:
            ev.append(Evidence("queried" if nv is not None else "assumed", f"NVLink: {why}"))
            acc = value(local, "peer_access", {}).get(pci_key(pg.get("pci")))
            if acc is not None:
                ctx.peer_access = bool(acc)
                ev.append(
                    Evidence("queried", f"peer access {lg.get('pci')} -> {pg.get('pci')}: {'yes' if acc else 'no'}")
                )

    li, pi = value(local, "memory_ipc", {}), value(peer, "memory_ipc", {})
    ctx.memory_ipc = (li.get("ipc"), pi.get("ipc"))
    for who, ipc in (("local", ctx.memory_ipc[0]), ("peer", ctx.memory_ipc[1])):
        if ipc in ("legacy-ipc", "vmm"):
            ev.append(
                Evidence(
                    "queried",
                    f"{who} GPU memory is "
                    + (
                        "legacy-IPC capable (cudaMalloc)"
                        if ipc == "legacy-ipc"
                        else "VMM (cuMemCreate / expandable segments), not legacy-IPC capable"
                    ),
                )
            )
    gd = [x.get("gpudirect_rdma") for x in (li, pi) if x.get("gpudirect_rdma") is not None]
    ctx.gpudirect_capable = all(gd) if gd else None

    if same_host is False:
        ctx.rdma_active = (_active_ports(local), _active_ports(peer))
        for who, ports in (("local", ctx.rdma_active[0]), ("peer", ctx.rdma_active[1])):
            names = ", ".join(p["device"] for p in ports) or "none"
            ev.append(Evidence("queried", f"{who} RDMA ports ACTIVE: {names}"))
    return ctx
