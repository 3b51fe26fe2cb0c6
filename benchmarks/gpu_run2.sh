#!/usr/bin/env bash
# GPU run: fused kernels vs torch vs a d2d copy, byte-exact suite, staged vs bulk.
set -uo pipefail
OUT=${OUT:-/tmp/kvstage-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
python3 -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tee "$OUT/kernels.log"
timeout 120 python3 benchmarks/gpu_kernels.py --json "$OUT/kernels.json" 2>&1 | tee -a "$OUT/kernels.log"
timeout 240 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_transfer.py 2>&1 | tee "$OUT/pytest-gpu.log"
bench() { timeout 100 python3 -m kvstage.cli bench --device cuda "$@"; }
bench --tokens 8192 --mode staged,bulk --json "$OUT/gpu-4to1-8k.json" 2>&1 | tee "$OUT/bench.log"
bench --tokens 8192 --src-tp 1 --dst-tp 4 --mode staged,bulk --json "$OUT/gpu-1to4-8k.json" 2>&1 | tee -a "$OUT/bench.log"
bench --tokens 128 --mode staged,bulk --iters 10 --json "$OUT/gpu-4to1-128.json" 2>&1 | tee -a "$OUT/bench.log"
