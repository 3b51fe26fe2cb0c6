"""``kvstage probe``: which path the KV bytes take to each peer, and whether it is the best.

Exit codes: 0 a working path exists (INFO or WARNING); 1 no working path
(ERROR); 2 the probe could not run as asked; 3 a WARNING under ``--strict``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from kvstage.errors import KVStageError
from kvstage.link.finding import Finding, Severity

EXIT_OK, EXIT_NO_PATH, EXIT_USAGE, EXIT_WARNING = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="memory to register and write: host DRAM or GPU VRAM (default: cpu)",
    )
    parser.add_argument("--size-mb", type=int, default=64, help="bytes of the measured write, in MiB (default: 64)")
    parser.add_argument("--iters", type=int, default=3, help="timed writes; the best one counts (default: 3)")
    parser.add_argument(
        "--peer",
        metavar="HOST:PORT|URL",
        help="probe a running destination rank (its control port) instead of a local self-test; "
        "it lends one arena slot for the measured write. Its address as it hands it out "
        "(kvstage://SECRET@HOST:PORT) carries its secret; HOST:PORT presents KVSTAGE_AUTH_TOKEN",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the findings and every fact as JSON to PATH")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set NAME in both self-test processes (NAME= unsets it); e.g. --env UCX_TLS=tcp",
    )
    parser.add_argument(
        "--no-verify-fix", action="store_true", help="do not rerun with a WARNING's fix applied to confirm it"
    )
    parser.add_argument("--facts", action="store_true", help="also print the facts behind the line")
    parser.add_argument("--strict", action="store_true", help="exit 3 when there is a WARNING")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds one self-test run may take (default: 90)")


def _parse_env(items: list[str]) -> dict:
    env = {}
    for item in items:
        name, sep, val = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"--env {item!r}: expected NAME=VALUE (NAME= to unset)")
        env[name] = val or None
    return env


def _parse_peer(text: str) -> tuple[str, int, str]:
    """(host, port, secret) of ``--peer``: a destination's ``kvstage://`` address (its secret), or HOST:PORT
    (secret "": the auth token is presented)."""
    from kvstage.protocol.address import SCHEME, Address

    if text.startswith(SCHEME):
        try:
            a = Address.parse(text)
        except KVStageError as e:
            raise ValueError(f"--peer: {e}") from None
        return a.host, a.port, a.secret
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--peer {text!r}: expected HOST:PORT with a port in 1..65535, or kvstage://SECRET@HOST:PORT")
    return host.strip("[]"), int(port), ""


def _print(findings: list[Finding], facts: dict | None) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape

        console = Console(highlight=False, soft_wrap=True)
        style = {Severity.INFO: "green", Severity.WARNING: "yellow", Severity.ERROR: "bold red"}
        for name, f in (facts or {}).items():
            console.print(escape(f"  {name}: {json.dumps(f['value'])} [{f['source']}: {f['how']}]"), style="dim")
        for f in findings:
            console.print(f"[{style[f.severity]}]{escape(f.line())}[/]")
    except ImportError:  # rich is a dependency, but plain text must always work
        for name, f in (facts or {}).items():
            print(f"  {name}: {json.dumps(f['value'])} [{f['source']}: {f['how']}]")
        for f in findings:
            print(f.line())


def run(args: argparse.Namespace) -> int:
    """Run the probe as ``args`` say; print one line per peer; return the exit code."""
    if args.size_mb < 1 or args.iters < 1:
        raise ValueError("--size-mb and --iters must be at least 1")
    if args.peer:
        host, port, secret = _parse_peer(args.peer)
        if args.env:
            raise ValueError("--env applies to the local self-test only; set variables in the environment for --peer")
        from kvstage.config import Settings
        from kvstage.probe.peer import run_peer_probe

        result = run_peer_probe(
            host,
            port,
            device=args.device,
            size_mb=args.size_mb,
            iters=args.iters,
            token=secret or Settings().auth_token,
            timeout=args.timeout,
        )
        return _report(args, result)
    if args.size_mb < 1 or args.iters < 1:
        raise ValueError("--size-mb and --iters must be at least 1")
    env = _parse_env(args.env)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise KVStageError(
                "--device cuda: torch sees no CUDA device on this host (probe host memory with --device cpu)"
            )
    from kvstage.probe.selftest import run_selftest

    result = run_selftest(
        device=args.device,
        size_mb=args.size_mb,
        iters=args.iters,
        env=env,
        timeout=args.timeout,
        verify_fix=not args.no_verify_fix,
    )
    return _report(args, result)


def _report(args: argparse.Namespace, result) -> int:
    _print([result.finding], result.writer_facts if args.facts else None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peers": [result.to_dict()]}, f, indent=2, default=str)
    if not result.finding.ok:
        return EXIT_NO_PATH
    if args.strict and result.finding.severity is Severity.WARNING:
        return EXIT_WARNING
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstage probe", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (KVStageError, ValueError) as e:
        print(f"kvstage probe: {e}", file=sys.stderr)
        return EXIT_USAGE
