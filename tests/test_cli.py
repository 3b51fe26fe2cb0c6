"""The ``kvstage bench`` command: invalid input, JSON output, exit codes."""

import json
import os
import subprocess
import sys

import pytest

from kvstage.cli import main


@pytest.mark.parametrize("args,needle", [
    (["--src-tp", "3"], "source tp=3 with kv_heads=8"),
    (["--dst-tp", "5"], "destination tp=5 with kv_heads=8"),
    (["--mla", "--kv-heads", "8"], "kv_heads=8 with mla=True"),
    (["--dtype", "float64"], "dtype='float64'"),
    (["--layout", "nhd", "--page-size", "0"], "page_size=0"),
    (["--mode", "fast"], "mode=fast"),
    (["--tokens", "0"], "tokens=0"),
    (["--arena-mb", "0.001"], "arena_mb=0.001"),
    (["--prefill-ms", "-1"], "prefill_ms=-1.0: must be >= 0"),
    (["--src-engines", "2,4", "--prefill-ms", "50"], "prefill_ms=50: a run with several engines"),
    (["--src-engines", "2,4", "--mode", "staged,bulk"], "mode=staged,bulk: a run with several engines"),
    (["--src-engines", "2,4", "--src-tp", "2,4"], "src_tp=2,4 with src_engines=2,4"),
    (["--src-tp", "2", "--dst-engines", "1,3"], "destination engine d1 (TP 3)"),
    (["--role", "src", "--connect", "127.0.0.1:1", "--metrics", "m.txt"],
     "metrics: the --role dst side collects every rank's metrics; give --metrics there"),
    (["--metrics", "/no/such/dir/m.txt"], "metrics='/no/such/dir/m.txt': directory '/no/such/dir' does not exist"),
])
def test_invalid_input_exits_2_with_the_field_named(args, needle, capsys):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bench_json_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "bench", "--layers", "2", "--head-dim", "32", "--tokens", "64",
         "--src-tp", "2", "--dst-tp", "1", "--iters", "1", "--warmup", "0", "--arena-mb", "4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["src_tp"] == 2 and data["config"]["tokens"] == 64
    modes = [r["mode"] for r in data["results"]]
    assert modes == ["staged", "bulk", "per-slice"]
    for r in data["results"]:
        assert set(r) >= {"mode", "bytes", "seconds", "gbps", "descriptors", "verified"}
        assert r["bytes"] == 64 * 2 * 2 * 8 * 32 * 2
    assert "staged / per-slice" in proc.stdout


def test_bench_metrics_needs_metrics_on(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvstage.cli", "bench", "--metrics", str(tmp_path / "m.txt")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVSTAGE_METRICS": "off"})
    assert proc.returncode == 2, proc.stderr
    assert f"kvstage: invalid input: metrics='{tmp_path / 'm.txt'}': KVSTAGE_METRICS=off" in proc.stderr
