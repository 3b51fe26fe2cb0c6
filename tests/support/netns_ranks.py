"""A source or destination rank driven over stdin/stdout, one JSON object a line.

Run inside a network namespace by the link-cut fault test
(``ip netns exec NS python tests/support/netns_ranks.py dst|src ...``): the test
process cannot reach the namespaces' addresses itself, so it talks to its
ranks through their standard streams. Times are ``time.monotonic()``, one
clock for every process of the machine (network namespaces do not change it).

Commands (stdin, one JSON object a line): ``expect``/``send`` {req, tokens, seed}, ``connect``,
``slots``, ``quit``. Events (stdout, lines starting with ``PREFIX``): ``ready``, ``progress`` (the
destination reads the request: every writer ready, a chunk holding a slot), ``final`` {req, state, path,
error: {peer, stage, cause}, t, corrupt}, ``slots`` {free, total, requests, held: reads of failed requests
that may still land}, ``connected`` / ``connect_failed``. Settings come from the environment
(``KVSTAGE_PATH``, ...), with an arena of 4 slots of 16 KiB.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder, when run as a script
from support import fault_ranks as fr  # noqa: E402
import kvstage  # noqa: E402
from kvstage.config import Settings  # noqa: E402
from kvstage.layout import pages_needed  # noqa: E402
from kvstage.staging.cache import RankCache  # noqa: E402

_out = threading.Lock()
PREFIX = "@kvstage-event "  # libraries may print to stdout too; events are the lines with this prefix


def emit(**ev) -> None:
    with _out:
        sys.stdout.write(PREFIX + json.dumps(ev) + "\n")
        sys.stdout.flush()


def watch(h, req: str, on_done=None, on_final=None, reading=None) -> None:
    """Report when a request is being read (``reading()``, a destination's) and its final state."""
    from kvstage.protocol.request import State

    def run():
        while reading is not None and not h.done() and not (h.state is State.TRANSFERRING and reading()):
            time.sleep(0.001)
        if reading is not None and not h.done():
            emit(ev="progress", req=req, t=time.monotonic())
        try:
            h.wait()
        except Exception:
            pass
        t = time.monotonic()
        err = h.error
        corrupt = on_done() if on_done and err is None else []
        if on_final:
            on_final()
        emit(ev="final", req=req, state=h.state.value, t=t, corrupt=corrupt[:5], path=h.path,
             error=None if err is None else {"peer": err.peer, "stage": err.stage, "cause": err.cause, "text": str(err)})

    threading.Thread(target=run, daemon=True).start()


def main() -> None:
    role, ip, port, pages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    settings = Settings(arena_mb=1 / 16)  # 4 slots of 16 KiB; every timeout at its default
    if role == "dst":
        from kvstage.protocol.destination import Destination

        ep = Destination(RankCache.allocate(fr.dst_spec(), 0, pages), settings, listen=(ip, port))
        page_size = 4
    else:
        from kvstage.protocol.source import Source

        ep = Source(RankCache.allocate(fr.src_spec(1), 0, pages), settings)
        page_size = 16
    emit(ev="ready", kvstage=kvstage.__file__, settings=dataclasses.asdict(settings))
    pool, pool_lock = fr.PagePool(ep.cache.pages, 0), threading.Lock()  # concurrent requests get disjoint pages
    for line in sys.stdin:
        cmd = json.loads(line)
        kind = cmd["cmd"]
        if kind == "quit":
            break
        if kind == "slots":
            st = ep.stats()
            emit(ev="slots", free=st.slots_free, total=st.slots_total, requests=st.requests, held=st.late_holds)
        elif kind == "connect":
            try:
                emit(ev="connected", ranks=ep.connect([(cmd["ip"], cmd["port"])]))
            except Exception as e:
                emit(ev="connect_failed", error=str(e))
        elif kind in ("expect", "send"):
            req, tokens, seed = cmd["req"], cmd["tokens"], cmd["seed"]
            with pool_lock:
                ids = pool.take(pages_needed(tokens, page_size))
            assert ids is not None, f"{role}: not enough free pages for {req}"

            def give(ids=ids):
                with pool_lock:
                    pool.give(ids)

            if kind == "send":
                from kvstage.bench.reference import fill_shard

                fill_shard(ep.cache, seed, ids, tokens)
                try:
                    h = ep.send(req, ids, tokens)
                except Exception as e:  # e.g. not connected: final at once
                    give()
                    emit(ev="final", req=req, state="failed", t=time.monotonic(), corrupt=[],
                         error={"peer": getattr(e, "peer", "-"), "stage": getattr(e, "stage", "send"),
                                "cause": str(e), "text": str(e)})
                    continue
                watch(h, req, on_final=give)
            else:
                def reading():
                    st = ep.stats()
                    return st.slots_free < st.slots_total

                watch(ep.expect(req, ids, tokens), req,
                      lambda ids=ids, seed=seed, tokens=tokens: fr.check(ep.cache, seed, ids, tokens), give, reading)
    ep.close()
    emit(ev="closed")


if __name__ == "__main__":
    main()
