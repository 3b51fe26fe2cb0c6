"""The endpoints' per-event debug lines and ``benchmarks/timeline.py``, which reads them.

A real ``kvstage bench`` run (rank processes over NIXL) with
``--log-level DEBUG``: every rank must log each stage of a staged
request once per chunk (a source's gather, the destination's read of it and its
scatter, the source hearing its slot is free), and the timeline must lay them out in
time order.
"""

import re
import subprocess
import sys
from pathlib import Path

TIMELINE = Path(__file__).resolve().parents[1] / "benchmarks" / "timeline.py"


def test_debug_events_trace_every_hop_of_a_request(tmp_path):
    # 2 -> 1, 1,100 tokens of 2 KiB on the read path (host memory, no token): 3 chunks
    proc = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "bench", "--layers", "2", "--head-dim", "32", "--kv-heads", "8",
         "--src-tp", "2", "--dst-tp", "1", "--tokens", "1100", "--mode", "staged", "--iters", "1", "--warmup", "0",
         "--arena-mb", "4", "--no-progress", "--log-level", "DEBUG"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = tmp_path / "bench.err"
    err.write_text(proc.stderr)
    out = subprocess.run([sys.executable, str(TIMELINE), str(err)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    m = re.match(r"request (\S+): (\d+) events over ([\d.]+) ms", lines[0])
    assert m, lines[0]
    events = [re.match(r"\s*([\d.]+) ms  (\S+)\s+(.*)", ln).groups() for ln in lines[1:]]
    assert len(events) == int(m.group(2))
    times = [float(t) for t, _, _ in events]
    assert times == sorted(times) and times[0] == 0.0
    said = [(who, what) for _, who, what in events]
    chunks = {int(c) for c in re.findall(r"chunk (\d+) takes slot", "\n".join(w for _, w in said))}
    assert len(chunks) >= 2, said  # several chunks, so the per-chunk lines repeat
    for c in chunks:
        for src in ("src0", "src1"):
            rank = src[-1]
            gathered = [w for who, w in said if who == src and re.fullmatch(rf"chunk {c} gathered into slot \d+", w)]
            assert len(gathered) == 1, (src, c, said)
            assert said.count((src, f"chunk {c} read: slot free")) == 1, (src, c, said)
            for what in (f"chunk {c} read posted to source rank {rank}", f"chunk {c} read from source rank {rank}"):
                assert said.count(("dst0", what)) == 1, (what, said)
            # the source gathers, then the destination reads, then the source hears its slot is free
            assert said.index((src, gathered[0])) < said.index(("dst0", f"chunk {c} read posted to source rank {rank}"))
            assert said.index(("dst0", f"chunk {c} read from source rank {rank}")) < \
                said.index((src, f"chunk {c} read: slot free"))
        for what in (f"chunk {c} takes slot", f"chunk {c} scatter launched", f"chunk {c} scattered"):
            assert sum(who == "dst0" and w.startswith(what) for who, w in said) == 1, (what, said)
    for who in ("src0", "src1"):
        assert ("dst0", f"ready from source rank {who[-1]} (read)") in said
        # the caller's send() is an event too: once, before the source's loop takes the request
        assert said.count((who, "sent by the caller, 1100 tokens")) == 1, (who, said)
        first = next(i for i, (w, what) in enumerate(said) if w == who and what.startswith("chunk "))
        assert said.index((who, "sent by the caller, 1100 tokens")) < first
    done = said.index(("dst0", "transferring -> done"))
    assert all(said.index(("dst0", f"chunk {c} scattered")) < done for c in chunks)
