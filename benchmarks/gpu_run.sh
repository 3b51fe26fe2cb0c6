#!/usr/bin/env bash
# One batch on the lent GPU machine (docs/benchmarks.md quotes its outputs):
# kernels beside a d2d copy, staged vs bulk vs per-slice on one GPU, the same
# across two GPUs when there are two, the byte-exact GPU suite.
#   run with .whl/ carried (NIXL wheels, ../shared/notes/gpu-machine.md); outputs in $OUT
#   PARTS="kernels x2 long one mps trace spy pytest ab" (the default: all but ab, smoke, tracex2, trace1g, x2slots, spy128, prearm, peer, host, warmth, turns, chain, contexts and stamps) picks parts;
#   spy and spy128 need .whl-spy/ (the py-spy wheel) carried too; peer needs .peer/ (benchmarks/fetch_peer.sh). ab: the same one-GPU runs for this
#   tree and for every other tree under ab/NAME/kvstage (untracked copies, e.g. from
#   `git archive`), alternating (AB_ROUNDS rounds, 2), so a change is measured against its base in one run;
#   AB_CASES picks its cases (default "4to1-128 4to1-8k-big"; also 1to4-128, 1to4-8k-big, 4to1-8k-1g:
#   1 GiB slots, one chunk per request; 4to1-8k-1g-long and 1to4-128-long: the same with 20 and 100
#   iterations, so each row's median rests on more samples; 1to2-128-long, 1to1-128-long (NHD -> HND) and
#   1to1-128-x2on (the destination alone on GPU 1, KVSTAGE_MAPPED=on) likewise). mapped: one-GPU runs with KVSTAGE_MAPPED=auto (the
#   sources gather straight into the destination's arena over CUDA IPC) and =off (a NIXL write per
#   chunk), alternating (AB_ROUNDS rounds); mappedx2: =on (auto maps no other GPU's arena) against
#   =off across two GPUs. slots: 4->1 8k with 512 MiB and 1 GiB slots
#   (fewer, larger chunks). BENCH_TIMEOUT (120) and PYTEST_TIMEOUT (300) bound each step, in seconds;
#   PYTEST_K narrows the pytest part (a -k expression, e.g. "across_two_gpus").
set -uo pipefail
FINAL=${OUT:-/tmp/kvstage-out}
OUT=$(mktemp -d)  # everything lands here and travels back as one archive (the device tool returns few files)
trap 'tar czf "$FINAL/gpu-run.tgz" -C "$OUT" .' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
nvidia-smi -L > "$OUT/gpu.txt"
GPUS=$(nvidia-smi -L | wc -l)
step() { echo "=== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
bench() { local name=$1; shift; step "bench $name: $*"
  timeout "${BENCH_TIMEOUT:-120}" python3 -m kvstage.cli bench --device cuda --no-progress --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"; }

BIG="--arena-mb 2048 --slot-mb 256"
PARTS=${PARTS:-kernels x2 long one mps trace spy pytest}
want() { [[ " $PARTS " == *" $1 "* ]]; }
# smoke: the GPU tests of the kernel, the landing words, send's own wait and the fences alone, first, so a
# broken launch shows before any bench
# faulthandler_timeout: a test stuck in a CUDA call (signals cannot interrupt it) prints every thread's stack
want smoke && step smoke && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=45 tests/test_cuda_copy.py \
  tests/test_landing.py tests/test_send_wait.py tests/test_fence.py 2>&1 | tee "$OUT/pytest-smoke.log"
abcase() { case $1 in
  4to1-128) echo "--tokens 128 --iters 30 --warmup 3" ;;
  1to4-128) echo "--tokens 128 --src-tp 1 --dst-tp 4 --iters 30 --warmup 3" ;;
  4to1-8k-big) echo "--tokens 8192 --iters 5 $BIG" ;;
  1to4-8k-big) echo "--tokens 8192 --src-tp 1 --dst-tp 4 --iters 5 $BIG" ;;
  4to1-8k-1g) echo "--tokens 8192 --iters 5 --arena-mb 2048 --slot-mb 1024" ;;
  4to1-8k-1g-long) echo "--tokens 8192 --iters 20 --warmup 2 --arena-mb 2048 --slot-mb 1024" ;;
  1to4-128-long) echo "--tokens 128 --src-tp 1 --dst-tp 4 --iters 100 --warmup 5" ;;
  1to2-128-long) echo "--tokens 128 --src-tp 1 --dst-tp 2 --iters 100 --warmup 5" ;;
  1to1-128-long) echo "--tokens 128 --src-tp 1 --dst-tp 1 --dst-layout hnd --iters 100 --warmup 5" ;;
  1to1-128-x2on) echo "--tokens 128 --src-tp 1 --dst-tp 1 --dst-layout hnd --iters 100 --warmup 5 --src-gpu 0 --dst-gpu 1" ;;
  *) echo "unknown ab case $1" >&2; return 1 ;;
esac; }
abenv() { case $1 in *-x2on) echo "KVSTAGE_MAPPED=on" ;; *) echo "KVSTAGE_MAPPED=auto" ;; esac; }  # a case's settings
if want ab; then  # python -m puts the working directory first on sys.path: each tree runs from its own
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for c in ${AB_CASES:-4to1-128 4to1-8k-big}; do
      args=$(abcase "$c") || continue
      for tree in . ab/*/; do
        name=$(basename "$(cd "$tree" && pwd)"); [ "$tree" = . ] && name=this
        # shellcheck disable=SC2086  # the case's arguments split into words on purpose
        (cd "$tree" && export $(abenv "$c") && bench "ab-$name-$c-r$round" --mode staged,bulk $args)
      done
    done
  done
fi
if want mapped; then
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for m in auto off; do
      KVSTAGE_MAPPED=$m bench "map-$m-4to1-128-r$round" --tokens 128 --mode staged,bulk --iters 30 --warmup 3
      KVSTAGE_MAPPED=$m bench "map-$m-4to1-8k-r$round" --tokens 8192 --mode staged,bulk --iters 5
      KVSTAGE_MAPPED=$m bench "map-$m-4to1-8k-big-r$round" --tokens 8192 --mode staged,bulk --iters 5 $BIG
    done
  done
  bench map-auto-1to4-8k-big --tokens 8192 --src-tp 1 --dst-tp 4 --mode staged,bulk --iters 5 $BIG
  bench map-auto-1to4-128 --tokens 128 --src-tp 1 --dst-tp 4 --mode staged,bulk --iters 30 --warmup 3
fi
if want mappedx2 && [ "$GPUS" -ge 2 ]; then
  X="--src-gpu 0 --dst-gpu 1 --mode staged,bulk"
  for m in on off; do
    KVSTAGE_MAPPED=$m bench "mapx2-$m-2to1-8k" --tokens 8192 --src-tp 2 --dst-tp 1 $X --iters 5 $BIG
    KVSTAGE_MAPPED=$m bench "mapx2-$m-1to2-8k" --tokens 8192 --src-tp 1 --dst-tp 2 $X --iters 5 $BIG
  done
  for m in on off; do
    KVSTAGE_MAPPED=$m bench "mapx2-$m-2to1-32k" --tokens 32768 --src-tp 2 --dst-tp 1 $X --iters 3 $BIG
    KVSTAGE_MAPPED=$m bench "mapx2-$m-4to1-128" --tokens 128 $X --iters 30 --warmup 3
  done
fi
# prearm: queued scatters (KVSTAGE_PREARM=1, staging.landing) against scatters launched on `landed` (=0),
# alternating (AB_ROUNDS rounds); one GPU, then across two with mapped=on (the gather stores over NVLink)
if want prearm; then
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for q in 1 0; do
      KVSTAGE_PREARM=$q bench "prearm$q-4to1-128-r$round" --tokens 128 --mode staged,bulk --iters 30 --warmup 3
      KVSTAGE_PREARM=$q bench "prearm$q-1to4-128-r$round" --tokens 128 --src-tp 1 --dst-tp 4 --mode staged,bulk --iters 30 --warmup 3
      KVSTAGE_PREARM=$q bench "prearm$q-4to1-8k-1g-r$round" --tokens 8192 --mode staged,bulk --iters 5 --arena-mb 2048 --slot-mb 1024
      if [ "$GPUS" -ge 2 ]; then
        KVSTAGE_PREARM=$q KVSTAGE_MAPPED=on bench "prearm$q-x2-1to2-8k-r$round" --tokens 8192 --src-tp 1 --dst-tp 2 \
          --src-gpu 0 --dst-gpu 1 --mode staged,bulk --iters 5 $BIG
      fi
    done
  done
fi
# turns: a small copy in each of 1 or 4 processes sharing the GPU, as a kernel and as a memcpy (benchmarks/context_turns.py)
want turns && step turns && timeout 150 python3 benchmarks/context_turns.py --json "$OUT/context_turns.json" 2>&1 | tee "$OUT/context_turns.log"
# contexts: 128-token requests (100 each) by how many decode processes share one GPU: 1->1 (staged by
# an NHD -> HND change), 1->2 and 1->4, every rank on GPU 0, and the destinations alone on GPU 1 (mapped=on:
# the source's gather stores over NVLink; auto: NIXL writes), alternating (AB_ROUNDS rounds)
if want contexts && [ "$GPUS" -ge 2 ]; then
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for tp in 1 2 4; do
      L=""; [ "$tp" = 1 ] && L="--dst-layout hnd"
      C="--tokens 128 --src-tp 1 --dst-tp $tp $L --mode staged,bulk --iters 100 --warmup 5"
      bench "ctx-1to$tp-gpu0-r$round" $C
      KVSTAGE_MAPPED=on bench "ctx-1to$tp-x2on-r$round" $C --src-gpu 0 --dst-gpu 1
      bench "ctx-1to$tp-x2auto-r$round" $C --src-gpu 0 --dst-gpu 1
    done
  done
fi
# stamps: where a 128-token request's time goes, step by step, without debug logging: a copy of this tree's
# kvstage with benchmarks/stamps.patch applied marks each step (perf_counter, kept in memory, written at exit);
# 1->1 (NHD -> HND) with the destination alone on GPU 1 (mapped=on), 1->2 and 1->4 on GPU 0; benchmarks/stamps.py reads them
if want stamps; then
  S=$(mktemp -d); cp -r kvstage "$S/" && (cd "$S" && patch -p1 -s < "$OLDPWD/benchmarks/stamps.patch") || exit 1
  stamped() { local name=$1; shift; mkdir -p "$OUT/stamps/$name"  # bench, run from the patched copy (as the ab trees)
    (cd "$S" && KVSTAGE_STAMPS="$OUT/stamps/$name" bench "stamps-$name" --mode staged,bulk --tokens 128 --src-tp 1 \
      --iters 100 --warmup 5 "$@"); }
  for round in $(seq "${AB_ROUNDS:-2}"); do
    [ "$GPUS" -ge 2 ] && KVSTAGE_MAPPED=on stamped "1to1-x2on-r$round" --dst-tp 1 --dst-layout hnd --src-gpu 0 --dst-gpu 1
    stamped "1to2-gpu0-r$round" --dst-tp 2
    stamped "1to4-gpu0-r$round" --dst-tp 4
  done
  python3 benchmarks/stamps.py "$OUT/stamps" | tee "$OUT/stamps.txt"
fi
# chain: a 1->4 source's gather to its four destinations' scatters, by a message per destination (as kvstage
# does) or by a word in shared host memory that the source's stream sets (benchmarks/landing_chain.py)
want chain && step chain && timeout 150 python3 benchmarks/landing_chain.py --json "$OUT/landing_chain.json" 2>&1 | tee "$OUT/landing_chain.log"
# host: what waking a sleeping thread or process costs on this host (no GPU work; docs/benchmarks.md, session 10)
want host && step host && timeout 120 python3 benchmarks/host_wakeup.py --json "$OUT/host_wakeup.json" 2>&1 | tee "$OUT/host_wakeup.log"
# warmth: a destination's per-chunk host steps after a sleep, after 20 µs polls (poll_us), after spinning, after polls
# that each touch the CUDA driver (sessions 16-17)
want warmth && step warmth && timeout 120 python3 benchmarks/step_warmth.py --json "$OUT/step_warmth.json" 2>&1 | tee "$OUT/step_warmth.log"
# peer: SGLang 0.5.23's staging kernels beside kvstage's, same buffers and pages (needs .peer/ carried:
# benchmarks/fetch_peer.sh), 4->1 and 1->4 at 128 and 8k tokens
want peer && step peer && timeout 200 python3 benchmarks/peer_kernels.py --json "$OUT/peer.json" 2>&1 | tee "$OUT/peer.log"
want kernels && step kernels && timeout 150 python3 benchmarks/gpu_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
if want x2 && [ "$GPUS" -ge 2 ]; then  # sources on GPU 0, destinations on GPU 1: NVLink (the multi-GPU issue)
  X="--src-gpu 0 --dst-gpu 1 --mode staged,bulk"
  bench x2-2to1-8k --tokens 8192 --src-tp 2 --dst-tp 1 $X --iters 5 $BIG
  bench x2-1to2-8k --tokens 8192 --src-tp 1 --dst-tp 2 $X --iters 5 $BIG
  bench x2-2to1-32k --tokens 32768 --src-tp 2 --dst-tp 1 $X --iters 3 $BIG
  bench x2-1to2-32k --tokens 32768 --src-tp 1 --dst-tp 2 $X --iters 3 $BIG
  bench x2-4to1-32k --tokens 32768 $X --iters 3 $BIG
  bench x2-1to4-32k --tokens 32768 --src-tp 1 --dst-tp 4 $X --iters 3 $BIG
  bench x2-4to1-128 --tokens 128 $X --iters 30 --warmup 3
fi
if want x2slots && [ "$GPUS" -ge 2 ]; then  # smaller slots across GPUs: a shorter first gather and last scatter
  X="--src-gpu 0 --dst-gpu 1 --mode staged,bulk --arena-mb 2048"
  for mb in 64 128 256; do
    bench "x2slots-2to1-8k-$mb" --tokens 8192 --src-tp 2 --dst-tp 1 $X --iters 5 --slot-mb $mb
    bench "x2slots-1to2-8k-$mb" --tokens 8192 --src-tp 1 --dst-tp 2 $X --iters 5 --slot-mb $mb
  done
fi
if want long && [ "$GPUS" -ge 2 ]; then  # long prompts: the per-request start-up and drain weigh less
  X="--src-gpu 0 --dst-gpu 1 --mode staged,bulk"
  bench x2-1to2-128k --tokens 131072 --src-tp 1 --dst-tp 2 $X --iters 2 $BIG
  bench x2-2to1-128k --tokens 131072 --src-tp 2 --dst-tp 1 $X --iters 2 $BIG
  bench x2-1to2-64k --tokens 65536 --src-tp 1 --dst-tp 2 $X --iters 3 $BIG
fi
if want x2 && [ "$GPUS" -ge 2 ]; then
  step probe
  timeout 120 python3 -m kvstage.cli probe --device cuda --facts --json "$OUT/probe-x2.json" 2>&1 | tee "$OUT/probe-x2.log"
fi
# one GPU, all ranks on GPU 0 (the GPU-speed issue's targets)
want one && {
bench 4to1-8k --tokens 8192 --mode staged,bulk --iters 5
bench 4to1-8k-big --tokens 8192 --mode staged,bulk --iters 5 $BIG
bench 1to4-8k-big --tokens 8192 --src-tp 1 --dst-tp 4 --mode staged,bulk --iters 5 $BIG
bench 4to1-128 --tokens 128 --mode staged,bulk --iters 30 --warmup 3
bench 4to1-2k-all --tokens 2048 --mode all --iters 2
KVSTAGE_ARENA=host bench 4to1-8k-hostarena --tokens 8192 --mode staged,bulk --iters 3
}
want slots && {
bench 4to1-8k-slot512 --tokens 8192 --mode staged,bulk --iters 5 --arena-mb 2048 --slot-mb 512
bench 4to1-8k-slot1024 --tokens 8192 --mode staged,bulk --iters 5 --arena-mb 2048 --slot-mb 1024
}
# where a small request's time goes: every endpoint event, host-clock stamped (benchmarks/timeline.py reads them)
trace() { local name=$1; shift; step "trace $name: $*"
  KVSTAGE_LOG_LEVEL=DEBUG timeout 120 python3 -m kvstage.cli bench --device cuda --no-progress --json "$OUT/$name.json" \
    --mode staged,bulk "$@" 2> "$OUT/$name.err" | tee "$OUT/$name.log"; }
want trace && {
trace trace-4to1-128 --tokens 128 --iters 10 --warmup 2
trace trace-1to4-128 --tokens 128 --src-tp 1 --dst-tp 4 --iters 10 --warmup 2
trace trace-4to1-8k-big --tokens 8192 --iters 2 $BIG
[ "$GPUS" -ge 2 ] && trace trace-x2-1to2-32k --tokens 32768 --src-tp 1 --dst-tp 2 --src-gpu 0 --dst-gpu 1 --iters 2 $BIG
}
# tracex2: one 8k request each way across two GPUs, every endpoint event (the NVLink target's fixed cost)
want tracex2 && [ "$GPUS" -ge 2 ] && {
trace trace-x2-2to1-8k --tokens 8192 --src-tp 2 --dst-tp 1 --src-gpu 0 --dst-gpu 1 --iters 3 $BIG
trace trace-x2-1to2-8k --tokens 8192 --src-tp 1 --dst-tp 2 --src-gpu 0 --dst-gpu 1 --iters 3 $BIG
}
# trace1g: one-chunk 8k requests (1 GiB slots), scatters launched on `landed` and queued ahead (prearm)
want trace1g && for pa in 0 1; do
  KVSTAGE_PREARM=$pa trace "trace-4to1-8k-1g-prearm$pa" --tokens 8192 --iters 3 --arena-mb 2048 --slot-mb 1024
done
# where the endpoints' host time goes: py-spy samples every rank (no pauses) over a longer run
{ want spy || want spy128; } && python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl-spy/*.whl && {
spy() { local name=$1; shift; step "spy $name: $*"
  timeout 150 /tmp/spy/bin/py-spy record --nonblocking --subprocesses -r 400 -f raw -o "$OUT/$name.txt" -- \
    python3 -m kvstage.cli bench --device cuda --no-progress --mode staged "$@" 2>&1 | grep -E "^│|py-spy>" | tee "$OUT/$name.log"; }
want spy && {
spy spy-4to1-8k-big --tokens 8192 --iters 20 $BIG
[ "$GPUS" -ge 2 ] && spy spy-x2-1to2-32k --tokens 32768 --src-tp 1 --dst-tp 2 --src-gpu 0 --dst-gpu 1 --iters 8 $BIG
}
# spy128: the same for small requests, where host work is the latency (one GPU)
want spy128 && spy spy-1to4-128 --tokens 128 --src-tp 1 --dst-tp 4 --iters 400 --warmup 5
}
# -k "not ucx": the ucx cases need UCXX's wheels, which travel in a run of their own (gpu_ucx.sh)
want pytest && step pytest && timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -m gpu -k "not ucx${PYTEST_K:+ and ($PYTEST_K)}" -v \
  --durations=10 -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/test_cuda_copy.py tests/test_endpoint.py tests/test_fence.py tests/test_landing.py tests/test_mapped.py tests/test_send_wait.py \
  tests/test_transfer.py 2>&1 \
  | tee "$OUT/pytest-gpu.log"
# one GPU under CUDA MPS (a private daemon, its pipe in a temp dir; quit at the end): the five
# ranks' kernels and copies run side by side instead of in time slices of one context each
if want mps; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  if nvidia-cuda-mps-control -d; then
    step "mps daemon up"
    bench mps-4to1-8k-big --tokens 8192 --mode staged,bulk --iters 5 $BIG
    bench mps-4to1-8k --tokens 8192 --mode staged,bulk --iters 5
    bench mps-1to4-8k-big --tokens 8192 --src-tp 1 --dst-tp 4 --mode staged,bulk --iters 5 $BIG
    bench mps-4to1-128 --tokens 128 --mode staged,bulk --iters 30 --warmup 3
    bench mps-4to1-8k-1g --tokens 8192 --mode staged,bulk --iters 5 --arena-mb 2048 --slot-mb 1024
    bench mps-1to4-128 --tokens 128 --src-tp 1 --dst-tp 4 --mode staged,bulk --iters 30 --warmup 3
    echo quit | nvidia-cuda-mps-control
    cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log"
  else
    step "mps: the daemon did not start"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
step end
