"""The severity rules: facts + what UCX selected + measured bandwidth → one Finding.

INFO     the path taken is the best this hardware offers (or nothing says otherwise);
WARNING  a better path exists and is not used, or the measured bandwidth is
         below LOW_FRACTION of what the path should give; names cause and fix;
ERROR    no path works (the write failed, UCX could not start).

Pure: no I/O. Everything inferred rather than observed is labelled ``expected``.
"""

from __future__ import annotations

import re

from kvstage.link import paths
from kvstage.link.context import LinkContext, link_context
from kvstage.link.facts import value
from kvstage.link.finding import Evidence, Finding, Severity

_MEM = {"host": "DRAM", "cuda": "VRAM", None: "?"}
_CUDAMALLOC = (
    "register memory with cudaMalloc semantics (kvstage's own staging arena is cudaMalloc'd): drop "
    "expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF, or switch it off around the allocation of the "
    "registered buffer (torch.cuda.memory._set_allocator_settings('expandable_segments:False'))"
)
_VMM_FIX = _CUDAMALLOC + "; UCX_PROTO_EMULATION_ENABLE=n makes such writes fail loudly instead of crawling"


def expected_best(ctx: LinkContext):
    """(acceptable kinds, best kind, why) for this link, or None when the facts cannot tell."""
    if ctx.same_host is None or ctx.src_mem is None or ctx.dst_mem is None:
        return None
    if ctx.same_host:
        if not ctx.gpu:
            return {"shm"}, "shm", "same host, host memory: shared memory (cma, zero-copy) is the fastest path"
        if ctx.src_mem == ctx.dst_mem == "cuda":
            if ctx.same_gpu or ctx.peer_access is not False:
                via = "one GPU" if ctx.same_gpu else ("NVLink" if ctx.nvlink else "peer access")
                return {"cuda_ipc"}, "cuda_ipc", f"same host, GPU memory, {via}: cuda_ipc is the fastest path"
            return (
                {"cuda_ipc", "cuda_copy"},
                "cuda_copy",
                "no peer access between the GPUs: a copy through host memory is the best path",
            )
        return {"cuda_ipc", "cuda_copy", "shm"}, "cuda_copy", "same host, host and GPU memory: CUDA copies are the path"
    if ctx.rdma_both:
        if ctx.gpu and ctx.gpudirect_capable is False:
            return (
                {"rdma", "rdma_staged"},
                "rdma_staged",
                "different hosts, RDMA, GPU memory the driver calls not GPUDirect capable",
            )
        return (
            {"rdma"},
            "rdma",
            "different hosts with ACTIVE RDMA ports on both: RDMA"
            + (" with GPUDirect" if ctx.gpu else "")
            + " is the fastest path",
        )
    return {"tcp", "emulated", "other"}, "tcp", "different hosts without ACTIVE RDMA ports on both: TCP is the path"


def expected_gbps(kind: str, ctx: LinkContext) -> tuple[float | None, str]:
    """What ``kind`` should give on this link, and where the figure comes from."""
    if kind == "shm" and not ctx.gpu:
        return paths.EXPECTED_GBPS[("shm", "host")]
    if kind == "cuda_ipc":
        key = "same-gpu" if ctx.same_gpu else "nvlink" if ctx.nvlink else "pcie" if ctx.nvlink is False else None
        return paths.EXPECTED_GBPS[("cuda_ipc", key)] if key else (None, "")
    if kind == "cuda_copy":
        return paths.EXPECTED_GBPS[("cuda_copy", "any")]
    if kind in ("rdma", "rdma_staged") and ctx.rdma_both:
        rates = [max((paths.rdma_port_gbps(p.get("rate")) or 0) for p in side) for side in ctx.rdma_active]
        if min(rates) > 0:
            return min(rates), "the slower side's fastest ACTIVE RDMA port rate"
    return None, ""


def _path_text(kind: str | None, selection: dict | None, ctx: LinkContext) -> str:
    pair = f"{_MEM[ctx.src_mem]}->{_MEM[ctx.dst_mem]}"
    if kind is None:
        return pair
    name = paths.kind_name(kind, ctx.gpu)
    if kind == "cuda_ipc":
        name += (
            " (one GPU)"
            if ctx.same_gpu
            else " over NVLink"
            if ctx.nvlink
            else " over PCIe"
            if ctx.nvlink is False
            else ""
        )
    ucx = (
        f" ({selection['mover']})"
        if selection and selection.get("mover")
        else f" (UCX: {selection['summary']})"
        if selection and selection.get("summary")
        else ""
    )
    return f"{pair} via {name}{ucx}"


def _diagnose(kind: str | None, best: str, ctx: LinkContext, env: dict, local: dict) -> tuple[str, str, dict | None]:
    """Cause, fix, and the environment change that applies the fix (None if it is no such change),
    for UCX taking ``kind`` (None: not observed) where ``best`` is expected."""
    tls = env.get("UCX_TLS")
    took = paths.kind_name(kind, ctx.gpu) if kind else "a slower path"
    want = paths.kind_name(best, ctx.gpu)
    nvl = "NVLink is up between the GPUs but " if ctx.nvlink and best == "cuda_ipc" else ""
    if tls and not paths.tls_allows(tls, best):
        return (
            f"{nvl}UCX_TLS={tls} leaves out {paths.TLS_LEFT_OUT.get(best, want)}, so UCX fell back to {took}",
            paths.tls_fix(tls, best),
            {"UCX_TLS": None},
        )
    if best == "cuda_ipc" and "vmm" in ctx.memory_ipc:
        var = next(
            (
                k
                for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                if "expandable_segments" in (env.get(k) or "")
            ),
            None,
        )
        why = f" ({var}={env[var]})" if var else ""
        return (
            f"{nvl}the registered GPU memory is VMM (expandable segments){why}, not legacy-IPC capable, "
            f"so UCX cannot use cuda_ipc and took {took}",
            _VMM_FIX,
            {var: None} if var else None,
        )
    if best == "cuda_ipc" and "cuda" not in (value(local, "ucx_modules") or ["cuda"]):
        return (
            f"{nvl}UCX has no cuda module (libuct_cuda), so it cannot use cuda_ipc",
            "install a CUDA build of NIXL (pip install nixl-cu13 or nixl-cu12)",
            None,
        )
    if best == "shm" and ctx.same_pidns is False:
        return (
            "the two processes are in different PID namespaces, so cma cannot reach the peer",
            "run both in one PID namespace (e.g. docker --pid=host, "
            "or containers of one pod sharing the PID namespace)",
            None,
        )
    scope = value(local, "ptrace_scope")
    if best == "shm" and isinstance(scope, int) and scope >= 2:
        return (
            f"kernel.yama.ptrace_scope={scope} forbids the cross-process access cma needs",
            "sysctl kernel.yama.ptrace_scope=1 (or give the processes CAP_SYS_PTRACE)",
            None,
        )
    if best in ("rdma", "rdma_staged"):
        if "ib" not in (value(local, "ucx_modules") or ["ib"]):
            return (
                "UCX has no ib module (libuct_ib), so it cannot use the RDMA devices",
                "install NIXL's UCX with verbs support (nixl-cu13 bundles libuct_ib) and rdma-core",
                None,
            )
        nd = env.get("UCX_NET_DEVICES")
        active = [p["device"] for p in ctx.rdma_active[0]]
        if nd and nd != "all" and not set(re.split(r"\s*,\s*", nd)) & set(active):
            return (
                f"UCX_NET_DEVICES={nd} names none of the ACTIVE RDMA ports ({', '.join(active)})",
                f"set UCX_NET_DEVICES to the RDMA ports, e.g. UCX_NET_DEVICES={active[0]}, or unset it",
                {"UCX_NET_DEVICES": None},
            )
        if kind == "rdma_staged":
            mods = value(local, "gpudirect_rdma") or {}
            missing = " and no nvidia_peermem / nv_peer_mem module is loaded" if mods and not any(mods.values()) else ""
            return (
                f"GPUDirect RDMA is not in use: UCX bounces GPU memory through host memory{missing}",
                "load nvidia_peermem (modprobe nvidia_peermem), or use a driver and kernel with dma-buf support",
                None,
            )
    return (
        f"{nvl}UCX chose {took} where {want} is expected; none of the probe's checks explains why",
        f"rerun with UCX_LOG_LEVEL=info and UCX_PROTO_INFO=y to see why UCX left out {want}",
        None,
    )


def blocked(best: str, ctx: LinkContext, env: dict, local: dict) -> bool:
    """Whether the facts alone say UCX cannot take ``best`` (the checks ``_diagnose`` names):
    what a connect-time line, which sees no UCX selection, can still tell for sure."""
    if env.get("UCX_TLS") and not paths.tls_allows(env["UCX_TLS"], best):
        return True
    if best == "cuda_ipc":
        return "vmm" in ctx.memory_ipc or "cuda" not in (value(local, "ucx_modules") or ["cuda"])
    if best == "shm":
        scope = value(local, "ptrace_scope")
        return ctx.same_pidns is False or (isinstance(scope, int) and scope >= 2)
    return False


def _ucx_fix(messages: list[str], env: dict, local: dict) -> str:
    for m in messages:
        bad = re.search(r"Invalid (UCX_TLS=\S*) for NIXL UCX backend: (.*)$", m)
        if bad:
            return f"unset UCX_TLS, or make {bad.group(1)} include cuda (NIXL: {bad.group(2)})"
    for m in messages:
        avail = re.search(r"please use one or more of: (.*)$", m)
        if avail:
            return (
                f"UCX_TLS={env.get('UCX_TLS', '')} names transports this host lacks; "
                f"unset UCX_TLS or use only: {avail.group(1)}"
            )
    if "UCX" not in (value(local, "nixl_plugins") or ["UCX"]):
        return (
            "NIXL has no UCX plugin: reinstall nixl-cu13 "
            "(or point NIXL_PLUGIN_DIR at a folder holding libplugin_UCX.so)"
        )
    if any("No zero-copy protocol found" in m for m in messages):
        return _CUDAMALLOC + ", or allow emulation with UCX_PROTO_EMULATION_ENABLE=y"
    return "read the UCX and NIXL messages in the evidence; rerun with UCX_LOG_LEVEL=info for more"


def assess(
    local: dict,
    peer: dict | None,
    selection,
    gbps: float | None,
    env: dict | None = None,
    *,
    peer_name: str = "peer",
    selection_source: str = "measured",
    write_error: str | None = None,
    ucx_messages: list[str] | tuple = (),
    fix_check: dict | None = None,
) -> Finding:
    """One Finding for the link from ``local`` (the writer) to ``peer``.

    ``selection``: what UCX selected for the writes (``ucx_info.Selection`` or its
    ``to_dict()``), or None when unknown. ``env``: the writer's environment
    (default: the ``env`` fact of ``local``). ``fix_check``: the result of a second
    run with the suggested fix applied: ``{"change": str, "selection": dict|None,
    "gbps": float|None}``.
    """
    env = dict(value(local, "env", {}) if env is None else env)
    sel = selection.to_dict() if hasattr(selection, "to_dict") else selection
    ctx = link_context(local, peer)
    ev = list(ctx.evidence)
    for k in ("UCX_TLS", "UCX_NET_DEVICES", "PYTORCH_CUDA_ALLOC_CONF"):
        if env.get(k):
            ev.append(Evidence("queried", f"{k}={env[k]}"))
    details = {"selection": sel, "env": env}

    if write_error:
        msgs = list(ucx_messages)
        ev.extend(Evidence("measured", m) for m in msgs[:3])  # the first few say why
        return Finding(
            Severity.ERROR,
            peer_name,
            f"{_MEM[ctx.src_mem]}->{_MEM[ctx.dst_mem]}: no working path",
            gbps,
            ev,
            cause=write_error,
            fix=_ucx_fix(msgs, env, local),
            details=details,
        )

    gpu_mem = ctx.gpu
    kind = paths.transport_kind(sel.get("transports", []), sel.get("descriptions", []), gpu_mem) if sel else None
    if sel:
        ev.insert(
            0,
            Evidence(
                selection_source,
                f"{sel['mover']} moves the writes"
                if sel.get("mover")
                else f"UCX selected {sel.get('summary') or ', '.join(sel.get('transports', []))}"
                + (f" for {sel['src']}->{sel['dst']} writes" if sel.get("src") else ""),
            ),
        )
    best = expected_best(ctx)
    path = _path_text(kind, sel, ctx)
    if best is None:
        ev.append(Evidence("expected", "cannot tell whether this is the best path: the peer's facts are missing"))
        return Finding(
            Severity.INFO, peer_name, path if kind else f"{path} (transport not observed)", gbps, ev, details=details
        )
    ok_kinds, best_kind, why = best
    details["best_kind"] = best_kind
    ev.append(Evidence("expected", why))

    if kind is None and blocked(best_kind, ctx, env, local):  # not observed, but the facts rule the best path out
        cause, fix, change = _diagnose(None, best_kind, ctx, env, local)
        details["fix_env"] = change
        exp, _ = expected_gbps(best_kind, ctx)
        if exp:
            details["expected_gbps"] = exp
        ev.append(Evidence("expected", f"UCX cannot use {paths.kind_name(best_kind, gpu_mem)} here (the cause below)"))
        return Finding(
            Severity.WARNING,
            peer_name,
            f"{path}; expected not to use {paths.kind_name(best_kind, gpu_mem)}, the fastest path here",
            gbps,
            ev,
            cause=cause,
            fix=fix,
            best=paths.kind_name(best_kind, gpu_mem),
            details=details,
        )
    if kind is None or kind in ok_kinds:
        shown = kind or best_kind
        exp, src = expected_gbps(shown, ctx)
        if kind is None:
            path = f"{path} via {paths.kind_name(best_kind, gpu_mem)} (expected; the transport was not observed)"
        if exp:
            details["expected_gbps"] = exp
            ev.append(Evidence("expected", f"{paths.kind_name(shown, gpu_mem)} should give about {exp:g} GB/s ({src})"))
        if gbps is not None and exp and gbps < paths.LOW_FRACTION * exp:
            return Finding(
                Severity.WARNING,
                peer_name,
                path,
                gbps,
                ev,
                best=paths.kind_name(best_kind, gpu_mem),
                cause=f"measured {gbps:.2f} GB/s is under {paths.LOW_FRACTION:.0%} of the ~{exp:g} GB/s "
                f"{paths.kind_name(shown, gpu_mem)} should give",
                fix="look for other traffic on the link or busy cores/GPU, check NUMA placement, "
                "and rerun `kvstage probe`"
                + ("" if kind else "; run `kvstage probe` to see which transport UCX really selects"),
                details=details,
            )
        return Finding(
            Severity.INFO, peer_name, path, gbps, ev, best=paths.kind_name(best_kind, gpu_mem), details=details
        )

    cause, fix, change = _diagnose(kind, best_kind, ctx, env, local)
    details["fix_env"] = change
    finding = Finding(
        Severity.WARNING,
        peer_name,
        f"{path}; faster path not used: {paths.kind_name(best_kind, gpu_mem)}",
        gbps,
        ev,
        cause=cause,
        fix=fix,
        best=paths.kind_name(best_kind, gpu_mem),
        details=details,
    )
    if fix_check is not None:
        _apply_fix_check(finding, fix_check, ok_kinds, gpu_mem)
    return finding


def _apply_fix_check(finding: Finding, check: dict, ok_kinds: set[str], gpu_mem: bool) -> None:
    """Confirm the fix by a second measured run, or withdraw the warning if it does not help."""
    sel = check.get("selection") or {}
    kind = paths.transport_kind(sel.get("transports", []), sel.get("descriptions", []), gpu_mem) if sel else None
    bw = f", {check['gbps']:.2f} GB/s" if check.get("gbps") is not None else ""
    finding.details["fix_check"] = check
    if kind in ok_kinds:
        finding.evidence.append(Evidence("measured", f"with {check['change']}: UCX selected {sel.get('summary')}{bw}"))
        return
    seen = sel.get("summary") if sel else check.get("error") or "no working path"
    finding.evidence.append(
        Evidence("measured", f"with {check['change']}: still {seen}{bw}, so the expected path does not work here")
    )
    finding.severity = Severity.INFO
    finding.path = finding.path.split("; faster path not used")[0] + " (best path that works here)"
    finding.cause = finding.fix = None
