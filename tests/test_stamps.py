"""``benchmarks/stamps.patch`` and ``benchmarks/stamps.py``: the step-by-step timing of a request.

The patch must keep applying to this tree (it marks steps inside the protocol
code), and a real ``kvstage bench`` run from a patched copy must leave stamps
that the reader lays out per step, in the order a staged request passes them.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_patched_copy_stamps_every_step_of_a_staged_request(tmp_path):
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copytree(ROOT / "kvstage", copy / "kvstage", ignore=shutil.ignore_patterns("__pycache__"))
    applied = subprocess.run(["git", "apply", "-p1", str(ROOT / "benchmarks" / "stamps.patch")], cwd=copy,
                             capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stderr
    stamps = tmp_path / "stamps" / "case"
    stamps.mkdir(parents=True)
    env = dict(os.environ, KVSTAGE_STAMPS=str(stamps), PYTHONPATH=str(copy))
    # 1 -> 1 with an NHD -> HND change: staged, one chunk per request
    run = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "bench", "--layers", "2", "--head-dim", "32", "--kv-heads", "4",
         "--src-tp", "1", "--dst-tp", "1", "--dst-layout", "hnd", "--tokens", "64", "--mode", "staged",
         "--iters", "4", "--warmup", "1", "--no-progress"],
        cwd=copy, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    files = sorted(stamps.glob("*.json"))
    assert len(files) == 2, files  # one source, one destination
    assert all(json.loads(f.read_text()) for f in files)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stamps.py"), str(stamps.parent), "--warmup", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.match(r"== case: 4 staged requests", lines[0]), lines[0]
    steps = [re.match(r"\s*(-?[\d.]+)  n=\s*(\d+)  (\S+) (\S+)", ln).groups() for ln in lines[1:]]
    at = {step: float(ms) for ms, _, _, step in steps}
    assert {who for _, _, who, _ in steps} == {"src0", "dst0"}
    assert at["b.send"] == 0.0
    assert at["d.expect"] < 0  # the destination expects the request before the source sends it
    order = ["b.send", "s.send", "s.checked", "s.add", "s.launched", "s.gathered", "d.scattered", "d.done"]
    assert [at[s] for s in order] == sorted(at[s] for s in order), at
    assert all(int(n) == 4 for _, n, _, step in steps if step in order)
