"""Presenting benchmark results as text: the table, its markdown, the notes under it.

Units: GB/s is 1e9 bytes per second; MB in the table is 1e6 bytes; latencies
in milliseconds. Every figure here is computed from the JSON result, so the
table, the CSV (``report_csv``) and the plot (``report_plot``) never disagree with it.
"""

from __future__ import annotations


def is_multi(result: dict) -> bool:
    """A multi-engine run: its rows are engine pairs."""
    return any("src_engine" in r for r in result["results"])


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _num(x) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:.1f}"
    return str(int(x))


def _mode_label(mode: str, rows: list[dict]) -> str:
    """The mode, and for the kvstage path the path its requests took (``protocol.route.Path``:
    ipc, direct, pages, read), where every row took the same."""
    paths = {"+".join(r.get("path") or []) for r in rows}
    if len(paths) == 1 and paths != {""}:
        return f"{mode} ({paths.pop()})"
    return mode


def shows_exposed(result: dict) -> bool:
    """Whether the table has an exposed-time column: a run with a simulated forward or a streamed mode
    (the default table is as it was)."""
    return bool(result["config"].get("prefill_ms")) or any(r["mode"] == "streamed" for r in result["results"])


def _head(result: dict, show_n: bool, conc: str) -> list[str]:
    """The one-engine table's columns (``conc``: the concurrency column's name)."""
    return (
        ["mode", "TP", "tokens"]
        + ([conc] if show_n else [])
        + ["MB/req", "GB/s", "p50 ms", "p99 ms"]
        + (["exposed ms"] if shows_exposed(result) else [])
        + ["desc/req", "arena MiB", "vs bulk", "verified"]
    )


def _cells(r: dict, show_n: bool, arrow: str, failed: str, exposed: bool = False) -> list[str]:
    """One result row's cells, shared by the terminal table and the markdown table."""
    ratio = (
        "-"
        if r["ratio_to_bulk"] is None
        else "bulk degraded"
        if r.get("bulk_degraded") and r["mode"] != "bulk"
        else f"{r['ratio_to_bulk']:.2f}x"
    )
    v = {True: "yes", False: failed, None: "-"}[r["verified"]]
    arena = "-" if r["arena_bytes"] is None else f"{r['arena_bytes'] / (1 << 20):g}"
    return (
        [_mode_label(r["mode"], [r]), f"{r['src_tp']}{arrow}{r['dst_tp']}", str(r["tokens"])]
        + ([str(r["concurrency"])] if show_n else [])
        + [f"{r['bytes'] / 1e6:.2f}", f"{r['gbps']:.3f}", _ms(r["latency_p50_s"]), _ms(r["latency_p99_s"])]
        + ([_ms(r.get("exposed_s"))] if exposed else [])
        + [_num(r["descriptors"]), arena, ratio, v]
    )


def _geometry_line(cfg: dict) -> str:
    g = cfg["geometry"]
    sp, dp = cfg["src_page"], cfg["dst_page"]
    paging = f"page {sp['page_size']} {sp['order']}"
    if dp != sp:
        paging += f" -> page {dp['page_size']} {dp['order']}"
    return (
        f"{g['layers']} layers, {g['kv_heads']} KV heads x {g['head_dim']} {g['dtype']}"
        f"{' MLA' if g['mla'] else ''}, {paging}, {cfg['device']}, {cfg.get('transport', 'nixl')}, "
        f"median of {cfg['iters']} "
        f"(+{cfg['warmup']} warm-up)"
    )


def render_table(result: dict, title: str | None = None) -> str:
    """The human-readable table (rich), one row per (TP pair, tokens, concurrency, mode)."""
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    rows = result["results"]
    show_n = any(r["concurrency"] > 1 for r in rows)
    t = Table(title=(title + "\n" if title else "") + "kvstage bench: " + _geometry_line(cfg))
    if is_multi(result):
        return _render_engines(t, result, show_n)
    for col in _head(result, show_n, "conc"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    prev = None
    for r in rows:
        point = (r["src_tp"], r["dst_tp"], r["tokens"], r["concurrency"])
        if prev is not None and point != prev:
            t.add_section()
        prev = point
        t.add_row(*_cells(r, show_n, "->", "NO", shows_exposed(result)))
    console = Console(record=True, width=132)
    with console.capture() as cap:
        console.print(t)
        for line in notes(result):
            console.print(line, highlight=False)
    return cap.get()


# -- multi-engine runs: one row per (source engine, destination engine) pair ------------------------
ENGINE_HEAD = [
    "pair",
    "tokens",
    "conc",
    "MB/req",
    "GB/s",
    "p50 ms",
    "p99 ms",
    "dst slot wait ms",
    "src slot wait ms",
    "verified",
]


def _points(rows: list[dict]) -> dict:
    """Multi-engine rows by point (engines, tokens, concurrency), in order."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["engines"], r["tokens"], r["concurrency"]), []).append(r)
    return out


def _engine_rows(result: dict, show_n: bool, arrow: str, failed: str) -> list[list[str]]:
    """Every pair's cells and, after each point's pairs, one "all pairs" line: every pair's bytes
    over the step's wall time."""
    out = []
    for (engines, tok, n), rows in _points(result["results"]).items():
        for r in rows:
            v = {True: "yes", False: failed, None: "-"}[r["verified"]]
            way = r.get("path") or []  # the path its requests took: ipc, direct, pages, read
            way = f" ({'+'.join(way)})" if way else ""
            out.append(
                [f"{r['src_engine']} (TP {r['src_tp']}) {arrow} {r['dst_engine']} (TP {r['dst_tp']}){way}", str(tok)]
                + ([str(n)] if show_n else [])
                + [
                    f"{r['bytes'] / 1e6:.2f}",
                    f"{r['gbps']:.3f}",
                    _ms(r["latency_p50_s"]),
                    _ms(r["latency_p99_s"]),
                    _ms(r["slot_wait_s"]),
                    _ms(r["src_slot_wait_s"]),
                    v,
                ]
            )
        flags = [r["verified"] for r in rows]
        v = "-" if None in flags else "yes" if all(flags) else failed
        first = rows[0]
        out.append(
            [f"all pairs ({engines.replace('->', arrow)})", str(tok)]
            + ([str(n)] if show_n else [])
            + [
                f"{first['step_bytes'] / 1e6 / n:.2f}",
                f"{first['step_gbps']:.3f}",
                "-",
                "-",
                _ms(sum(r["slot_wait_s"] for r in rows)),
                _ms(sum(r["src_slot_wait_s"] for r in rows)),
                v,
            ]
        )
    return out


def _render_engines(t, result: dict, show_n: bool) -> str:
    from rich.console import Console

    head = [h for h in ENGINE_HEAD if show_n or h != "conc"]
    for col in head:
        t.add_column(col, justify="left" if col == "pair" else "right", no_wrap=col == "pair")
    for cells in _engine_rows(result, show_n, "->", "NO"):
        t.add_row(*cells, end_section=cells[0].startswith("all pairs"))
    console = Console(record=True, width=150)  # a pair's name and the two slot waits need the room
    with console.capture() as cap:
        console.print(t)
        for line in notes(result):
            console.print(line, highlight=False)
    return cap.get()


def _engine_notes(result: dict) -> list[str]:
    out = []
    points = _points(result["results"])
    for (engines, tok, n), rows in points.items():
        parts = []
        rates = [r["gbps"] for r in rows]
        if len(rows) > 1:
            slow, fast = min(rows, key=lambda r: r["gbps"]), max(rows, key=lambda r: r["gbps"])
            parts.append(
                f"slowest pair / fastest pair: {min(rates) / max(rates):.2f} "
                f"({slow['src_engine']}->{slow['dst_engine']} / {fast['src_engine']}->{fast['dst_engine']})"
            )
        served = {
            **{r["src_engine"]: r.get("src_peer_engines") for r in rows},
            **{r["dst_engine"]: r.get("dst_peer_engines") for r in rows},
        }
        served = {e: v for e, v in served.items() if v}  # (0: the endpoint does not count them)
        if served:
            parts.append(
                "peer engines each rank's one endpoint served: " + ", ".join(f"{e} {v}" for e, v in served.items())
            )
        copies = sorted({c for r in rows for c in r.get("copier") or []})
        if copies:
            parts.append("copies " + "+".join(copies))
        if parts:
            out.append(
                (f"{engines} {tok} tok{f' x{n}' if n > 1 else ''}: " if len(points) > 1 else "") + "; ".join(parts)
            )
    out.append(
        "Every source engine sends its requests to every destination engine at once (request k to d0, d1, "
        "..., then k+1), each engine's ranks through one endpoint per rank. GB/s per pair: the pair's bytes "
        "over its wall time (its first send to its last completion); all pairs: every pair's bytes over the "
        "step's wall time (1e9 B/s). Slot wait: time the pair's requests waited for a free arena slot, "
        "summed over requests and ranks, on the destination (dst) and on the sources (src). Latency: "
        "nearest-rank p50/p99 over the pair's requests x measured iterations."
    )
    return out


def notes(result: dict) -> list[str]:
    """Per point: staged vs per-slice, and where the staged time went."""
    if is_multi(result):
        out = _engine_notes(result)
        clock = result.get("clock") or {}
        if clock.get("synced_ranks"):
            out.append(
                f"clocks: {clock['synced_ranks']} rank processes on another clock, offsets measured at start; "
                f"timestamps may be off by up to {clock['max_offset_error_s'] * 1e6:.0f} us"
            )
        return out
    out = []
    points: dict = {}
    for r in result["results"]:
        points.setdefault((r["src_tp"], r["dst_tp"], r["tokens"], r["concurrency"]), {})[r["mode"]] = r
    many = len(points) > 1
    for (s, d, tok, n), modes in points.items():
        parts = []
        if "staged" in modes and "per-slice" in modes:
            parts.append(f"staged / per-slice: {modes['staged']['gbps'] / modes['per-slice']['gbps']:.1f}x")
        if "staged" in modes and "streamed" in modes:
            parts.append(_exposed_note(modes["staged"], modes["streamed"]))
        for mode in ("staged", "streamed"):
            st = modes.get(mode, {}).get("stages")
            if not st:
                continue
            ms = {k: v for k, v in st.items() if k != "overlap"}
            parts.append(f"{mode} ms, summed over ranks: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ms.items()))
            if st.get("overlap") and mode == "staged":  # streamed's stages run under the forward, not one after another
                parts.append(f"stage overlap {st['overlap']:.2f}x")
            if modes[mode].get("copier") and (mode == "staged" or "staged" not in modes):
                parts.append("copies " + "+".join(modes[mode]["copier"]))
        bulk = modes.get("bulk")
        if bulk and bulk.get("bulk_degraded"):
            parts.append(
                f"bulk ran at {bulk['gbps']:.3g} GB/s, far below what the link should give: the baseline is "
                "degraded (see the link WARNING above), so no ratio to it is shown"
            )
        if parts:
            prefix = f"{s}->{d} {tok} tok{f' x{n}' if n > 1 else ''}: " if many else ""
            out.append(prefix + "; ".join(parts))
    out.append(
        "GB/s: bytes of all requests in flight / wall time of the step (1e9 B/s). Latency: first source rank "
        "issuing a request to the last destination rank holding all of it; nearest-rank p50/p99 over "
        "requests x measured iterations."
    )
    prefill_ms = result["config"].get("prefill_ms")
    if prefill_ms:
        out.append(
            f"Each step runs a simulated prefill forward of {prefill_ms:g} ms on every source rank, its layers "
            "finished evenly (a GPU kernel or a CPU wait per layer); wall time and latency start with it. "
            "Exposed: the last source rank's forward end to the last destination rank holding every byte "
            "(median over iterations)."
        )
    elif shows_exposed(result):
        out.append(
            "Exposed: the step's start (no simulated forward: --prefill-ms 0) to the last destination rank "
            "holding every byte (median over iterations)."
        )
    clock = result.get("clock") or {}
    if clock.get("synced_ranks"):
        out.append(
            f"clocks: {clock['synced_ranks']} rank processes on another clock, offsets measured at start; "
            f"timestamps may be off by up to {clock['max_offset_error_s'] * 1e6:.0f} us"
        )
    for s in result.get("skipped", []):
        out.append(f"skipped: {s}")
    return out


def _exposed_note(staged: dict, streamed: dict) -> str:
    """Streamed against staged exposed time at one point of one run, with the streamed groups."""
    groups = streamed.get("layer_groups") or []
    sizes = sorted({stop - start for start, stop in groups})
    how = (
        (
            f"; streamed in {len(groups)} layer group{'s' if len(groups) != 1 else ''}"
            + (f" of {'/'.join(map(str, sizes))} layer{'s' if sizes != [1] else ''}" if sizes else "")
        )
        if groups
        else ""
    )
    ratio = f"{streamed['exposed_s'] / staged['exposed_s']:.2f}x" if staged.get("exposed_s") else "-"
    return (
        f"streamed / staged exposed: {ratio} ({_ms(streamed.get('exposed_s'))} / {_ms(staged.get('exposed_s'))} ms"
        f"{how})"
    )


def link_warnings(result: dict) -> list[str]:
    """One line per distinct connect-time WARNING or ERROR of the run's ranks, naming them."""
    return [
        f"{f['line']} [ranks: {', '.join(f['ranks'])}]"
        for f in result.get("links", [])
        if f.get("severity") in ("WARNING", "ERROR")
    ]


def markdown(result: dict, title: str | None = None, command: str | None = None) -> str:
    """The table as GitHub markdown, with the geometry line and the notes (for docs/benchmarks.md)."""
    rows = result["results"]
    show_n = any(r["concurrency"] > 1 for r in rows)
    multi = is_multi(result)
    if multi:
        head = [("in flight" if h == "conc" else h) for h in ENGINE_HEAD if show_n or h != "conc"]
    else:
        head = _head(result, show_n, "in flight")
    lines = []
    if title:
        lines += [f"**{title}**", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        _geometry_line(result["config"]) + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if h in ("mode", "pair") else "--:" for h in head) + "|",
    ]
    cells = (
        _engine_rows(result, show_n, "→", "**NO**")
        if multi
        else [_cells(r, show_n, "→", "**NO**", shows_exposed(result)) for r in rows]
    )
    for c in cells:
        lines.append("| " + " | ".join(c) + " |")
    lines.append("")
    lines += [f"- {n}" for n in notes(result)]
    return "\n".join(lines) + "\n"
