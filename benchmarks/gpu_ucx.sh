#!/usr/bin/env bash
# GPU run of the UCX transport (UCXX): byte-exact GPU suite over ucx, then staged vs bulk
# 4->1 and 1->4 at 8k tokens, and one UCX_PROTO_INFO capture of the path the bytes take.
#
# Run on the lent H200 from the repo root, in a run of its own: UCXX's five wheels travel in
# .whl-ucx (~51 MB; NIXL's .whl does not fit beside them, so nothing here imports NIXL).
# Download them once on a machine with an index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 -d .whl-ucx \
#     ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0
# and carry .whl-ucx. Logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvstage-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ucx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVSTAGE_TRANSPORT=ucx
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import ucxx; print("ucxx", ucxx.__version__, "ucx", ucxx.get_ucx_version()); print(sorted(ucxx.get_active_transports()))' \
  2>&1 | tee "$OUT/ucxx.txt"
# the GPU tests of the ucx transport only (the nixl ones need NIXL's wheels: gpu_run3.sh)
timeout 300 python3 -m pytest -m gpu -k ucx -q -p no:cacheprovider tests/test_transfer.py tests/test_transports_ucx.py \
  2>&1 | tee "$OUT/pytest-gpu-ucx.log"
bench() { timeout 150 python3 -m kvstage.cli bench --device cuda --transport ucx "$@"; }
bench --tokens 8192 --mode staged,bulk --json "$OUT/gpu-ucx-4to1-8k.json" 2>&1 | tee "$OUT/bench-ucx.log"
bench --tokens 8192 --src-tp 1 --dst-tp 4 --mode staged,bulk --json "$OUT/gpu-ucx-1to4-8k.json" 2>&1 | tee -a "$OUT/bench-ucx.log"
# which UCX protocol and lanes the bytes took (cuda_ipc expected between processes sharing the GPU)
UCX_PROTO_INFO=y bench --tokens 8192 --mode staged,bulk --iters 1 --warmup 0 --json "$OUT/gpu-ucx-4to1-8k-protoinfo.json" \
  > "$OUT/proto-info-ucx.log" 2>&1
grep -E "cuda|zero-copy|rndv|tcp|cma" "$OUT/proto-info-ucx.log" | sort | uniq -c | sort -rn | head -40 > "$OUT/proto-info-ucx-summary.txt"
