#!/usr/bin/env bash
# The peer's staging kernels for benchmarks/peer_kernels.py: SGLang 0.5.23's wheel, of which
# only the two modules that script loads are unpacked, into .peer/sglang-0.5.23 (ignored by git;
# carry it to the GPU machine, which has no internet).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 -d "$tmp" sglang==0.5.23
mkdir -p .peer/sglang-0.5.23
python3 -m zipfile -e "$tmp"/sglang-0.5.23-*.whl "$tmp/x"
for f in sglang/srt/disaggregation/common/staging_buffer.py sglang/kernels/ops/memory/ptr_table.py; do
  mkdir -p ".peer/sglang-0.5.23/$(dirname "$f")"
  cp "$tmp/x/$f" ".peer/sglang-0.5.23/$f"
done
echo "unpacked: $(find .peer/sglang-0.5.23 -name '*.py' | tr '\n' ' ')"
