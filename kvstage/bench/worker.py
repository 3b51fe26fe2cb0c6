"""Benchmark rank processes: one per source rank and one per destination rank.

Run with the arguments of ``python -m kvstage.bench.worker --coord HOST:PORT --role dst|src
--rank R --group G --parent PID [--engine E]``: forked by the coordinator's launcher
(``launcher``), or started on its own that way. A rank connects to the coordinator
(``control.Link``), receives its group of points, and walks the group's
schedule of (point, mode, iteration) steps in lockstep with every other rank:

    prep   -> set up the step (page ids, cache contents, expected requests)
    armed  -> (coordinator waits for every rank)
    go     -> run the step: ``concurrency`` requests at once
    result -> timestamps, descriptors, verification

Page ids and cache contents change every step and come from seeds, so any
rank can derive another rank's page ids (the per-slice baseline writes
straight into destination pages) and stale bytes from an earlier step can
never pass verification.

In a multi-engine group (``--engine E``: rank R of source engine ``sE`` or
destination engine ``dE``), a rank holds ``concurrency`` requests of every
peer engine in a step, on disjoint pages, each filled from a seed of its own
(source engine, destination engine, k): a request that lands in another's
pages fails verification.

A rank ends itself when the coordinator goes away or aborts, and (Linux) when
the process that started it dies.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import traceback

from kvstage.bench.control import Aborted, BenchError, Link, parse_hostport
from kvstage.bench.engine_ranks import dst_engines_main, src_engines_main
from kvstage.bench.launcher import die_with_parent
from kvstage.bench.ranks import dst_main, src_main
from kvstage.bench.scenario import Group, engine_id
from kvstage.bench.steps import WAIT_S


class _NotLinkLines(logging.Filter):
    """The connect-time link lines go to the coordinator with the results, which prints each
    WARNING once above the table: a rank does not print them too."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            isinstance(record.msg, str)
            and isinstance(record.args, tuple)  # a lone mapping argument makes args that mapping
            and bool(record.args)
            and str(record.args[0]).startswith(
                ("INFO kvstage link to", "WARNING kvstage link to", "ERROR kvstage link to")
            )
        )


def _setup(label: str, level: str) -> None:
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    faulthandler.enable(all_threads=True)  # a rank that crashes (SIGSEGV in a transport) says where
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 2) // 2)))
    logging.basicConfig(level=level, format=f"%(created).6f %(levelname)s {label} %(message)s")
    for h in logging.getLogger().handlers:
        h.addFilter(_NotLinkLines())


def main(argv=None, launcher: int | None = None) -> int:
    """Run one rank; ``launcher``: the pid of the launcher that forked this process, which it
    dies with (a rank started on its own dies with ``--parent``)."""
    ap = argparse.ArgumentParser(prog="python -m kvstage.bench.worker")
    ap.add_argument("--coord", required=True)
    ap.add_argument("--role", choices=("dst", "src"), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--engine", type=int, default=None, help="the rank's engine in a multi-engine group (s0, d1, ...)")
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument(
        "--clock-sync", action="store_true", help="measure the clock offset even on the coordinator's kernel"
    )
    a = ap.parse_args(argv)
    die_with_parent(a.parent if launcher is None else launcher)
    _setup(f"{a.role}{a.rank}" + (f"@{engine_id(a.role, a.engine)}" if a.engine is not None else ""), a.log_level)
    from kvstage.config import Settings

    def lost():  # the coordinator is gone or aborted: nothing left to do here
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        hello = {"kind": "rank", "role": a.role, "rank": a.rank, "group": a.group}
        if a.engine is not None:
            hello["engine"] = a.engine
        link = Link(
            parse_hostport(a.coord, "--coord"),
            hello,
            token=Settings().auth_token,
            on_lost=lost,
            clock_sync=a.clock_sync,
        )
    except BenchError as e:  # the run ended (or failed) before this rank joined
        of = f" of engine {engine_id(a.role, a.engine)}" if a.engine is not None else ""
        print(f"kvstage bench {a.role} rank {a.rank}{of}: {e}", file=sys.stderr)
        return 1
    try:
        cfg = link.recv("config", timeout=WAIT_S)
        g = Group.from_wire(cfg["group"])
        want = bool(cfg.get("metrics"))
        if a.engine is not None and a.role == "dst":
            exposition = dst_engines_main(link, g, a.rank, a.engine, cfg["listen_host"], want)
        elif a.engine is not None:
            exposition = src_engines_main(link, g, a.rank, a.engine, want)
        elif a.role == "dst":
            exposition = dst_main(link, g, a.rank, cfg["listen_host"], want)
        else:
            exposition = src_main(link, g, a.rank, want)
    except Aborted:
        link.close()
        return 1
    except BaseException as e:
        from kvstage.errors import KVStageError

        # a failure kvstage names itself (a transfer that failed, with peer, stage and cause) needs no traceback
        known = isinstance(e, (KVStageError, TimeoutError))
        try:
            link.send(
                {"type": "error", "reason": f"{type(e).__name__}: {e}"}
                if known
                else {"type": "error", "trace": traceback.format_exc()}
            )
        except Exception:
            pass
        link.close()
        return 1
    link.finished = True
    link.send({"type": "bye"} | ({"metrics": exposition} if exposition is not None else {}))
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
