#!/usr/bin/env bash
# Rerun the scenarios behind docs/benchmarks.md (bench sections).
#
#   benchmarks/run.sh                       # every cpu-*.toml
#   benchmarks/run.sh benchmarks/gpu-tp-sweep.toml
#
# For each scenario it writes NAME.json, NAME.csv, NAME.png and NAME.md (the
# markdown table pasted into docs/benchmarks.md) into $OUT (default: a new
# temporary directory, printed). Needs matplotlib for the charts
# (pip install 'kvstage[plot]').
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t kvstage-bench.XXXXXX)}
mkdir -p "$OUT"
echo "results in $OUT" >&2
if [ $# -eq 0 ]; then set -- benchmarks/cpu-*.toml; fi
for scenario in "$@"; do
  name=$(basename "$scenario" .toml)
  echo "== $scenario" >&2
  kvstage bench --scenario "$scenario" --json "$OUT/$name.json" --csv "$OUT/$name.csv" \
    --plot "$OUT/$name.png" --markdown "$OUT/$name.md" | tee "$OUT/$name.txt"
done
