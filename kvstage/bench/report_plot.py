"""The plot of a result (matplotlib, imported only here and only when a plot is asked for).

Apart from the table so that a run without ``--plot`` never loads matplotlib.
"""

from __future__ import annotations

from kvstage.bench.report import _geometry_line, _mode_label, is_multi
from kvstage.bench.scenario import MODES


def check_plot_available() -> None:
    """Raise ConfigError now (before any process starts) if matplotlib is missing."""
    from kvstage.errors import ConfigError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("plot: matplotlib is not installed; `pip install 'kvstage[plot]'` or drop --plot") from None


_COLORS = {"staged": "tab:blue", "bulk": "tab:green", "per-slice": "tab:red", "streamed": "tab:purple"}


def write_plot(result: dict, path: str, title: str | None = None) -> None:
    """GB/s against tokens: one panel per TP pair, one line per mode (and per
    concurrency); with several engines, one panel per set of engines and one
    line per engine pair, and all pairs together. A sweep of concurrencies at
    one token count plots GB/s against requests in flight instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    class _PlainLog(matplotlib.ticker.LogFormatterSciNotation):
        """The ticks matplotlib labels on a log axis, written as plain numbers."""

        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    rows = result["results"]
    multi = is_multi(result)
    if multi:  # one panel per set of engines, one line per engine pair and one for all pairs together
        rows = rows + [
            dict(r, src_engine="all", dst_engine="pairs", gbps=r["step_gbps"])
            for r in rows
            if (r["src_engine"], r["dst_engine"]) == ("s0", "d0")
        ]
    panel_of = (lambda r: r["engines"]) if multi else (lambda r: (r["src_tp"], r["dst_tp"]))
    pairs = list(dict.fromkeys(panel_of(r) for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    concs = sorted({r["concurrency"] for r in rows})
    by_conc = len(tokens) == 1 and len(concs) > 1
    x_of = (lambda r: r["concurrency"]) if by_conc else (lambda r: r["tokens"])
    series = [None] if by_conc else concs  # by_conc: one line per mode across concurrencies
    ncol = min(3, len(pairs))
    nrow = -(-len(pairs) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(7.5, 5.2 * ncol), 4.0 * nrow + 0.4), squeeze=False, sharey=True)
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D"]
    for ax, panel in zip(axes.flat, pairs, strict=False):  # the grid may have more axes than panels
        if multi:
            _plot_pairs(ax, [r for r in rows if r["engines"] == panel], x_of, by_conc, concs, styles, markers)
        else:
            _plot_modes(ax, rows, panel, x_of, series, concs, styles, markers)
        ticks = concs if by_conc else tokens
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        for axis_set in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 0.3, 6, 20; not 6x10^0
            axis_set(_PlainLog(labelOnlyBase=False))
        name = f"engines {panel}" if multi else f"TP {panel[0]} \u2192 {panel[1]}"
        ax.set_title(name + (f", {tokens[0]} tokens per request" if by_conc else ""))
        ax.set_xlabel("requests in flight" if by_conc else "tokens per request")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("GB/s (1e9 B/s)")
    for ax in list(axes.flat)[len(pairs) :]:
        ax.set_visible(False)
    head = (title + "\n" if title else "") + _geometry_line(result["config"])
    fig.suptitle(head, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_modes(ax, rows, panel, x_of, series, concs, styles, markers) -> None:
    """One panel of a one-engine run: a line per mode (and concurrency)."""
    s, d = panel
    for mode in MODES:
        for ci, c in enumerate(series):
            sel = [
                r
                for r in rows
                if (r["src_tp"], r["dst_tp"], r["mode"]) == (s, d, mode) and (c is None or r["concurrency"] == c)
            ]
            if not sel:
                continue
            _line(ax, sel, x_of, _mode_label(mode, sel), c, concs, styles[ci % 4], markers[ci % 4], _COLORS[mode])


def _plot_pairs(ax, rows, x_of, by_conc, concs, styles, markers) -> None:
    """One panel of a multi-engine run: a line per engine pair (and concurrency), and all pairs together."""
    keys = list(dict.fromkeys((r["src_engine"], r["dst_engine"]) for r in rows))
    series = [None] if by_conc else concs
    for pi, key in enumerate(keys):
        for ci, c in enumerate(series):
            sel = [
                r for r in rows if (r["src_engine"], r["dst_engine"]) == key and (c is None or r["concurrency"] == c)
            ]
            if not sel:
                continue
            label = (
                "all pairs"
                if key == ("all", "pairs")
                else f"{key[0]} (TP {sel[0]['src_tp']}) \u2192 {key[1]} (TP {sel[0]['dst_tp']})"
            )
            color = "black" if key == ("all", "pairs") else f"C{pi}"
            _line(ax, sel, x_of, label, c, concs, styles[ci % 4], markers[ci % 4], color)


def _line(ax, sel, x_of, label: str, c, concs, style, marker, color) -> None:
    """One series' GB/s against ``x_of``, its label naming the concurrency where a panel has several."""
    pts = sorted((x_of(r), r["gbps"]) for r in sel)
    label += f", {c} in flight" if c is not None and len(concs) > 1 else ""
    ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=style, marker=marker, color=color, label=label)
