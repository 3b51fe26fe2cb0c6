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

    p.add_argument(
        "--scenario", metavar="FILE", help="read flags from a TOML or JSON file (see benchmarks/); flags given here win"
    )
    p.add_argument(
        "--model", choices=sorted(PRESETS), default="llama3-8b", help="geometry preset (flags below override)"
    )
    p.add_argument(
        "--src-tp",
        default=None,
        metavar="N[,N...]",
        help="source TP size, or a comma list to sweep (4 or 1,2,4; default 4)",
    )
    p.add_argument(
        "--dst-tp", default=None, metavar="N[,N...]", help="destination TP size, or a comma list to sweep (default 1)"
    )
    p.add_argument(
        "--src-engines",
        default=None,
        metavar="N,N[,...]",
        help="several source (prefill) engines at once, one per TP size listed (2,4: one at TP 2 and one "
        "at TP 4; 2,2: two at TP 2), each sending to every destination engine; instead of --src-tp. "
        "One result per engine pair; staged only",
    )
    p.add_argument(
        "--dst-engines",
        default=None,
        metavar="N,N[,...]",
        help="several destination (decode) engines at once, one per TP size listed; instead of --dst-tp",
    )
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--mla", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", default="2048", metavar="N[,N...]", help="tokens per request, or a comma list to sweep")
    p.add_argument(
        "--concurrency", default="1", metavar="N[,N...]", help="requests in flight at once, or a comma list to sweep"
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="in a sweep, run the valid TP pairs and list the others (default: refuse)",
    )
    p.add_argument("--page-size", type=int, default=16, help="source page size")
    p.add_argument("--dst-page-size", type=int, help="destination page size (default: --page-size)")
    p.add_argument("--layout", choices=("nhd", "hnd"), default="nhd", help="source layout")
    p.add_argument("--dst-layout", choices=("nhd", "hnd"), help="destination layout (default: --layout)")
    p.add_argument(
        "--arena-mb",
        type=float,
        default=None,
        help="staging memory per rank in MiB (default: sized from the model and the device)",
    )
    p.add_argument(
        "--copier",
        choices=("cuda", "native", "torch"),
        default=None,
        help="force how caches copy (a diagnostic; default: the rule's choice, logged by each rank)",
    )
    p.add_argument(
        "--log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="WARNING",
        help="log level of the rank processes on stderr (DEBUG: one line per request or chunk event, "
        "for benchmarks/timeline.py)",
    )
    p.add_argument(
        "--clock-sync",
        action="store_true",
        help="measure each rank's clock offset even on this host's kernel (other hosts always do)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--src-gpu", type=int, default=0, help="CUDA device of the source ranks (--device cuda)")
    p.add_argument("--dst-gpu", type=int, default=0, help="CUDA device of the destination ranks (--device cuda)")
    p.add_argument(
        "--transport",
        choices=("nixl", "ucx", "cma"),
        default=None,
        help="nixl (one-sided writes), ucx (UCXX tag messages, two-sided) or cma (one host, host memory: "
        "process_vm_writev); default: KVSTAGE_TRANSPORT, else nixl",
    )
    p.add_argument(
        "--mode",
        default=None,
        help="staged, bulk, per-slice, streamed, a comma list, or all (staged,bulk,per-slice; the default; "
        "staged with --src-engines or --dst-engines). streamed: each layer group is sent as the "
        "forward writes it (Source.stream); compare it with staged under --prefill-ms",
    )
    p.add_argument(
        "--prefill-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="simulate a prefill forward whose layers finish evenly over MS milliseconds before each step's "
        "transfer (streamed: under it), on a GPU as kernels on the source ranks' streams, on a CPU as "
        "waits; exposed_s (every result) runs from its end to the last byte in (default 0: no forward)",
    )
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--json", metavar="PATH", help="write config and results as JSON (- for stdout, instead of the table)"
    )
    p.add_argument("--csv", metavar="PATH", help="write one CSV row per result")
    p.add_argument(
        "--plot", metavar="PATH", help="write a chart of GB/s against tokens (.png, .svg or .pdf; needs matplotlib)"
    )
    p.add_argument("--markdown", metavar="PATH", help="write the table as GitHub markdown (for docs/benchmarks.md)")
    p.add_argument("--title", help="a line above the table and the plot (scenario files set it)")
    p.add_argument(
        "--metrics",
        metavar="FILE",
        help="write every rank's Prometheus metrics (exposition text, one block per rank) at the end of the "
        "run; needs prometheus_client (pip install 'kvstage[metrics]')",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on a terminal, once a run passes 2 s)",
    )
    p.add_argument(
        "--role",
        choices=("local", "dst", "src"),
        default="local",
        help="local: every rank on this host; dst/src: the two sides on different hosts",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="--role dst: where source hosts connect (HOST: an address they reach, or 0.0.0.0)",
    )
    p.add_argument(
        "--connect",
        metavar="HOST:PORT",
        help="--role src: the --listen of the dst side (everything else comes from there)",
    )
    p.add_argument(
        "--src-hosts",
        type=int,
        default=1,
        help="--role dst: source hosts to wait for; source ranks are split among them",
    )


#: scenario-file keys that are not flags
_FILE_ONLY = {"description"}


def load_scenario_file(path: str) -> dict:
    """A scenario file: keys are flag names (``src_tp`` or ``src-tp``); lists sweep."""
    from kvstage.errors import ConfigError

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"scenario={path!r}: cannot read: {e.strerror}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(raw)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                try:
                    import tomli as tomllib
                except ImportError:
                    raise ConfigError(
                        f"scenario={path!r}: TOML needs Python 3.11 or `pip install tomli`; or use JSON"
                    ) from None
            data = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"scenario={path!r}: not valid {'JSON' if path.endswith('.json') else 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"scenario={path!r}: must be a table of flag = value")
    return data


def _apply_scenario_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Set the file's values as the bench parser's defaults, so explicit flags still win."""
    from kvstage.errors import ConfigError

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--scenario")
    known, _ = pre.parse_known_args(argv)
    if not known.scenario:
        return
    data = load_scenario_file(known.scenario)
    dests = {a.dest: a for a in parser._actions if a.dest not in ("help", "scenario")}
    values: dict[str, object] = {}
    for key, v in data.items():
        dest = key.replace("-", "_")
        if dest in _FILE_ONLY:
            continue
        if dest not in dests:
            raise ConfigError(
                f"scenario={known.scenario!r}: unknown key {key!r} (keys are the flag names, like src_tp)"
            )
        if isinstance(v, list):
            v = ",".join(str(x) for x in v)
        action = dests[dest]
        if action.choices is not None and v not in action.choices:
            raise ConfigError(
                f"scenario={known.scenario!r}: {key}={v!r}: must be one of {', '.join(map(str, action.choices))}"
            )
        if isinstance(v, bool) or v is None:
            values[dest] = v
        else:
            values[dest] = str(v) if action.type is not None or not isinstance(v, (int, float)) else v
    if "description" in data and "title" not in data:
        values["title"] = str(data["description"]).strip().splitlines()[0]
    parser.set_defaults(**values)


def sweep_from_args(a: argparse.Namespace):
    from kvstage.bench.scenario import ALL_MODES, PRESETS, Sweep, parse_int_list
    from kvstage.errors import ConfigError
    from kvstage.layout import KVGeometry, PageLayout

    layers, heads, head_dim, mla = PRESETS[a.model]
    geo = KVGeometry(
        a.layers if a.layers is not None else layers,
        a.kv_heads if a.kv_heads is not None else heads,
        a.head_dim if a.head_dim is not None else head_dim,
        a.dtype,
        a.mla if a.mla is not None else mla,
    )
    engines, tps = {}, {}
    for side, default in (("src", "4"), ("dst", "1")):
        listed, tp = getattr(a, f"{side}_engines"), getattr(a, f"{side}_tp")
        engines[side] = parse_int_list(f"{side}_engines", listed, duplicates=True) if listed is not None else []
        if engines[side] and tp is not None:
            raise ConfigError(
                f"{side}_tp={tp} with {side}_engines={listed}: {side}_engines gives each "
                f"{'source' if side == 'src' else 'destination'} engine's TP size; give one or the other "
                f"(a list of the other side's TP sizes still sweeps)"
            )
        tps[side] = engines[side][:1] or parse_int_list(f"{side}_tp", tp if tp is not None else default)
    multi = bool(engines["src"] or engines["dst"])
    mode = a.mode or ("staged" if multi else "all")
    modes = ALL_MODES if mode == "all" else tuple(m.strip() for m in mode.split(",") if m.strip())
    return Sweep.build(
        tps["src"],
        tps["dst"],
        parse_int_list("tokens", a.tokens),
        parse_int_list("concurrency", a.concurrency),
        skip_invalid=a.skip_invalid,
        src_engines=tuple(engines["src"]),
        dst_engines=tuple(engines["dst"]),
        geometry=geo,
        src_page=PageLayout(a.page_size, a.layout),
        dst_page=PageLayout(a.dst_page_size or a.page_size, a.dst_layout or a.layout),
        modes=modes,
        device=a.device,
        iters=a.iters,
        warmup=a.warmup,
        seed=a.seed,
        verify=a.verify,
        arena_mb=a.arena_mb,
        copier=a.copier,
        src_gpu=a.src_gpu,
        dst_gpu=a.dst_gpu,
        transport=a.transport or _env_transport(),
        prefill_ms=a.prefill_ms,
    )


def _env_transport() -> str:
    import os

    return os.environ.get("KVSTAGE_TRANSPORT") or "nixl"  # Scenario checks the value


def render_table(result: dict) -> str:
    from kvstage.bench.report import render_table as render

    return render(result)


def _check_outputs(a: argparse.Namespace) -> None:
    """Output paths must be writable before anything runs."""
    import os

    from kvstage.errors import ConfigError

    for flag in ("json", "csv", "plot", "markdown", "metrics"):
        path = getattr(a, flag)
        if not path or (flag == "json" and path == "-"):
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(f"{flag}={path!r}: directory {parent!r} does not exist")
        if not os.access(parent, os.W_OK):
            raise ConfigError(f"{flag}={path!r}: directory {parent!r} is not writable")
    if a.plot:
        if not a.plot.lower().endswith((".png", ".svg", ".pdf")):
            raise ConfigError(f"plot={a.plot!r}: must end in .png, .svg or .pdf")
        from kvstage.bench.report_plot import check_plot_available

        check_plot_available()
    if a.metrics:
        from kvstage import metrics

        if a.role == "src":
            raise ConfigError("metrics: the --role dst side collects every rank's metrics; give --metrics there")
        if not metrics.available():
            raise ConfigError(f"metrics={a.metrics!r}: {metrics.why_unavailable()}")


def _check_memory(sweep, roles) -> None:
    """Refuse a CPU run whose buffers cannot fit in this host's available memory."""
    from kvstage.errors import ConfigError

    if sweep.groups[0].base.device != "cpu":
        return
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    g = max(sweep.groups, key=lambda g: g.host_bytes(roles))
    need = g.host_bytes(roles)
    if need > 0.9 * avail:
        big = max(g.points, key=lambda p: p.tokens * p.concurrency)
        raise ConfigError(
            f"memory: TP {g.label} at {big.tokens} tokens x {big.concurrency} in flight needs about "
            f"{need / 2**30:.1f} GiB of buffers on this host, {avail / 2**30:.1f} GiB is available; "
            "lower --tokens, --concurrency or --arena-mb"
        )


def _emit(result: dict, a: argparse.Namespace, title: str | None) -> None:
    from kvstage.bench import report, report_csv, report_plot

    for line in report.link_warnings(result):  # on stderr, above the table
        print(line, file=sys.stderr, flush=True)
    if a.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(report.render_table(result, title), end="")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=2)
    if a.csv:
        report_csv.write_csv(result, a.csv)
    if a.plot:
        report_plot.write_plot(result, a.plot, title)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(report.markdown(result, title, _command_line(a)))


def _command_line(a: argparse.Namespace) -> str:
    """How to rerun this run: the command line without its output flags."""
    import shlex

    drop = {
        "--json",
        "--csv",
        "--plot",
        "--markdown",
        "--metrics",
        "--title",
        "--progress",
        "--no-progress",
        "--log-level",
    }
    argv, out, skip = sys.argv[1:], [], False
    for x in argv:
        if skip:
            skip = False
            continue
        name = x.split("=", 1)[0]
        if name in drop:
            skip = "=" not in x and name not in ("--progress", "--no-progress")
            continue
        out.append(x)
    return "kvstage " + " ".join(shlex.quote(x) for x in out)


def _terminate_cleanly() -> None:
    """Ctrl-C (even where the shell started us with SIGINT ignored, as for a
    background job) and SIGTERM end the run with the rank processes stopped
    first; exit codes 130 and 143."""
    import signal
    import threading

    def handler(signum, frame):
        print("kvstage: terminated", file=sys.stderr)
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, handler)


def cmd_bench(a: argparse.Namespace) -> int:
    from kvstage.bench.control import parse_hostport
    from kvstage.bench.progress import Progress
    from kvstage.bench.runner import run_source_host, run_sweep
    from kvstage.errors import ConfigError

    _check_outputs(a)
    if a.role == "src":
        if not a.connect:
            raise ConfigError("connect: --role src needs --connect HOST:PORT (the --listen of the dst side)")
        _terminate_cleanly()

        def joined(kind, msg):
            sw = msg.get("sweep", {})
            print(
                f"kvstage bench: joined the run at {a.connect} as source host {msg.get('index', 0) + 1} "
                f"({sw.get('groups')} TP pairs, {sw.get('points')} points)",
                file=sys.stderr,
                flush=True,
            )

        result = run_source_host(
            parse_hostport(a.connect, "connect"), on_event=joined, log_level=a.log_level, clock_sync=a.clock_sync
        )
    else:
        if a.role == "dst" and not a.listen:
            raise ConfigError("listen: --role dst needs --listen HOST:PORT")
        if a.role == "local" and (a.listen or a.connect):
            raise ConfigError("listen/connect: only with --role dst / --role src")
        if a.src_hosts < 1:
            raise ConfigError(f"src_hosts={a.src_hosts}: must be >= 1")
        sweep = sweep_from_args(a)
        for s in sweep.skipped:
            print(f"kvstage: skipping {s}", file=sys.stderr)
        _check_memory(sweep, ("src", "dst") if a.role == "local" else ("dst",))
        listen = parse_hostport(a.listen, "listen") if a.role == "dst" else None

        def announce(addr):
            host = "HOST" if addr[0] in ("0.0.0.0", "::", "") else addr[0]
            print(
                f"kvstage bench: listening on {addr[0]}:{addr[1]}; waiting for {a.src_hosts} source host(s) to run: "
                f"kvstage bench --role src --connect {host}:{addr[1]}",
                file=sys.stderr,
                flush=True,
            )

        progress = Progress(a.progress)
        _terminate_cleanly()
        try:
            result = run_sweep(
                sweep,
                progress=progress,
                role=a.role,
                listen=listen,
                src_hosts=a.src_hosts,
                on_listen=announce,
                log_level=a.log_level,
                clock_sync=a.clock_sync,
                metrics=a.metrics,
            )
        finally:
            progress.close()
    _emit(result, a, a.title)
    bad = [r for r in result["results"] if r["verified"] is False]
    for r in bad:
        pair = (
            f"{r['src_engine']} (TP {r['src_tp']}) -> {r['dst_engine']} (TP {r['dst_tp']})"
            if "src_engine" in r
            else f"{r['src_tp']}->{r['dst_tp']}"
        )
        print(
            f"VERIFICATION FAILED in mode {r['mode']} ({pair}, {r['tokens']} tokens): "
            + "; ".join(r.get("errors", [])),
            file=sys.stderr,
        )
    return EXIT_FAILED if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstage", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure staged vs bulk vs per-slice transfers between rank processes")
    _bench_args(bench)
    probe = sub.add_parser("probe", help="diagnose the path KV bytes take between two peers")
    try:
        from kvstage.probe import cli as probe_cli

        probe_cli.add_arguments(probe)
    except ImportError:
        probe_cli = None  # type: ignore[assignment]  # said at "kvstage probe" below
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"]:
            _apply_scenario_file(bench, argv[1:])
    except (ConfigError, IncompatibleGeometry) as e:
        print(f"kvstage: invalid input: {e}", file=sys.stderr)
        return EXIT_USAGE
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
