#!/usr/bin/env bash
# The GPU run behind docs/benchmarks.md: byte-exact suite on CUDA, then the
# benchmark. Run on the lent H200 from the repo root with NIXL's wheels in
# .whl (see the project notes); logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvstage-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_transfer.py 2>&1 | tee "$OUT/pytest-gpu.log"
bench() { python3 -m kvstage.cli bench --device cuda "$@"; }
bench --tokens 8192 --mode staged,bulk --json "$OUT/gpu-4to1-8k.json" 2>&1 | tee "$OUT/bench.log"
bench --tokens 8192 --src-tp 1 --dst-tp 4 --mode staged,bulk --json "$OUT/gpu-1to4-8k.json" 2>&1 | tee -a "$OUT/bench.log"
bench --tokens 2048 --mode all --iters 2 --json "$OUT/gpu-4to1-2k-all.json" 2>&1 | tee -a "$OUT/bench.log"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench --tokens 8192 --mode staged,bulk --iters 2 \
  --json "$OUT/gpu-4to1-8k-expandable.json" 2>&1 | tee -a "$OUT/bench.log"
