"""The ``kvstage`` command: ``kvstage bench`` and ``kvstage probe``.

Exit codes: 0 success, 1 a transfer or verification failed, 2 invalid input.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstage.errors import ConfigError, IncompatibleGeometry, KVStageError

EXIT_FAILED, EXIT_USAGE = 1, 2


def _bench_args(p: argparse.ArgumentParser) -> None:
    from kvstage.bench.scenario import PRESETS

    p.add_argument("--model", choices=sorted(PRESETS), default="llama3-8b", help="geometry preset (flags below override)")
    p.add_argument("--src-tp", type=int, default=4)
    p.add_argument("--dst-tp", type=int, default=1)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--mla", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16, help="source page size")
    p.add_argument("--dst-page-size", type=int, help="destination page size (default: --page-size)")
    p.add_argument("--layout", choices=("nhd", "hnd"), default="nhd", help="source layout")
    p.add_argument("--dst-layout", choices=("nhd", "hnd"), help="destination layout (default: --layout)")
    p.add_argument("--arena-mb", type=float, default=512.0)
    p.add_argument("--slot-mb", type=float, default=64.0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mode", default="all", help="staged, bulk, per-slice, a comma list, or all")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", metavar="PATH", help="write config and results as JSON")


def scenario_from_args(a: argparse.Namespace):
    from kvstage.bench.scenario import MODES, PRESETS, Scenario
    from kvstage.layout import KVGeometry, PageLayout

    layers, heads, head_dim, mla = PRESETS[a.model]
    geo = KVGeometry(
        a.layers if a.layers is not None else layers,
        a.kv_heads if a.kv_heads is not None else heads,
        a.head_dim if a.head_dim is not None else head_dim,
        a.dtype,
        a.mla if a.mla is not None else mla,
    )
    modes = MODES if a.mode == "all" else tuple(m.strip() for m in a.mode.split(",") if m.strip())
    return Scenario(
        geometry=geo, src_tp=a.src_tp, dst_tp=a.dst_tp, tokens=a.tokens,
        src_page=PageLayout(a.page_size, a.layout),
        dst_page=PageLayout(a.dst_page_size or a.page_size, a.dst_layout or a.layout),
        modes=modes, device=a.device, iters=a.iters, warmup=a.warmup, seed=a.seed, verify=a.verify,
        arena_mb=a.arena_mb, slot_mb=a.slot_mb,
    )


def render_table(result: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    g = cfg["geometry"]
    t = Table(title=(
        f"kvstage bench: {g['layers']} layers, {g['kv_heads']} KV heads x {g['head_dim']} {g['dtype']}"
        f"{' MLA' if g['mla'] else ''}, {cfg['src_tp']}->{cfg['dst_tp']}, {cfg['tokens']} tokens, {cfg['device']}"
    ))
    for col in ("mode", "TP", "tokens", "MB", "GB/s", "ms (median)", "descriptors", "vs bulk", "verified"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in result["results"]:
        ratio = "-" if r["ratio_to_bulk"] is None else f"{r['ratio_to_bulk']:.2f}x"
        v = {True: "yes", False: "NO", None: "-"}[r["verified"]]
        t.add_row(r["mode"], f"{r['src_tp']}->{r['dst_tp']}", str(r["tokens"]), f"{r['bytes'] / 1e6:.1f}",
                  f"{r['gbps']:.3f}", f"{r['seconds'] * 1e3:.2f}", str(r["descriptors"]), ratio, v)
    console = Console(record=True, width=120)
    with console.capture() as cap:
        console.print(t)
        modes = {r["mode"]: r for r in result["results"]}
        if "staged" in modes and "per-slice" in modes:
            console.print(f"staged / per-slice: {modes['staged']['gbps'] / modes['per-slice']['gbps']:.1f}x")
        if "staged" in modes and "stages" in modes["staged"]:
            s = modes["staged"]["stages"]
            console.print("staged stage seconds (summed over ranks): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in s.items()))
    return cap.get()


def cmd_bench(a: argparse.Namespace) -> int:
    from kvstage.bench.runner import run

    sc = scenario_from_args(a)
    result = run(sc)
    print(render_table(result), end="")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    bad = [r for r in result["results"] if r["verified"] is False]
    for r in bad:
        print(f"VERIFICATION FAILED in mode {r['mode']}: " + "; ".join(r.get("errors", [])), file=sys.stderr)
    return EXIT_FAILED if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstage", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_args(sub.add_parser("bench", help="measure staged vs bulk vs per-slice transfers between local rank processes"))
    probe = sub.add_parser("probe", help="diagnose the path KV bytes take between two peers")
    try:
        from kvstage.probe import cli as probe_cli

        probe_cli.add_arguments(probe)
    except ImportError:
        probe_cli = None
    a = parser.parse_args(argv)
    try:
        if a.command == "bench":
            return cmd_bench(a)
        if probe_cli is None:
            print("kvstage probe is not available in this build", file=sys.stderr)
            return EXIT_USAGE
        return probe_cli.run(a)
    except (ConfigError, IncompatibleGeometry) as e:
        print(f"kvstage: invalid input: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KVStageError as e:
        print(f"kvstage: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("kvstage: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
