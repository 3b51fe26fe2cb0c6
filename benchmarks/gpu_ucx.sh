#!/usr/bin/env bash
# One batch on the lent GPU machine for the UCX transport (UCXX), to set beside gpu_run.sh's NIXL
# numbers in docs/benchmarks.md: the byte-exact GPU suite over ucx, staged vs bulk 4->1 and 1->4 at
# 8k tokens (same flags as gpu_run.sh's "one" part), and a UCX_PROTO_INFO capture of the path taken.
#
# Run from the repo root in a run of its own, with .whl-ucx/ carried: UCXX's five wheels (~51 MB;
# NIXL's .whl does not fit beside them, so nothing here imports NIXL). Download them once where
# there is an index (../shared/notes/gpu-machine.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 -d .whl-ucx \
#     ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0
# Outputs: $OUT/gpu-ucx.tgz (one archive: the device tool returns few files).
set -uo pipefail
FINAL=${OUT:-/tmp/kvstage-out}
OUT=$(mktemp -d)
trap 'tar czf "$FINAL/gpu-ucx.tgz" -C "$OUT" .' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ucx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVSTAGE_TRANSPORT=ucx
nvidia-smi -L > "$OUT/gpu.txt"
step() { echo "=== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
bench() { local name=$1; shift; step "bench $name: $*"
  timeout 150 python3 -m kvstage.cli bench --device cuda --transport ucx --no-progress --json "$OUT/$name.json" "$@" \
    2>&1 | tee "$OUT/$name.log"; }
BIG="--arena-mb 2048 --slot-mb 256"

step ucxx
python3 -c 'import ucxx; print("ucxx", ucxx.__version__, "ucx", ucxx.get_ucx_version())' 2>&1 | tee "$OUT/ucxx.txt"
# the ucx transport's GPU tests only (the nixl ones need NIXL's wheels: gpu_run.sh)
step pytest
timeout 300 python3 -m pytest -m gpu -k ucx -q -p no:cacheprovider tests/test_transfer.py tests/test_transports_ucx.py \
  2>&1 | tee "$OUT/pytest-gpu-ucx.log"
bench ucx-4to1-8k --tokens 8192 --mode staged,bulk --iters 5
bench ucx-4to1-8k-big --tokens 8192 --mode staged,bulk --iters 5 $BIG
bench ucx-1to4-8k-big --tokens 8192 --src-tp 1 --dst-tp 4 --mode staged,bulk --iters 5 $BIG
# which protocol and lanes UCX took (cuda_ipc between processes sharing the GPU is the expected one)
step proto-info
UCX_PROTO_INFO=y timeout 150 python3 -m kvstage.cli bench --device cuda --transport ucx --no-progress \
  --tokens 8192 --mode staged,bulk --iters 1 --warmup 0 > "$OUT/proto-info.log" 2>&1
grep -E "tagged message|rendezvous|zero-copy|eager|cuda_ipc|cuda_copy|tcp|cma" "$OUT/proto-info.log" \
  | sed 's/^\[[^]]*\] *\[[^]]*\] *//' | sort | uniq -c | sort -rn | head -40 > "$OUT/proto-info-summary.txt"
step end
