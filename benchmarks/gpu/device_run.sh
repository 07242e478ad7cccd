#!/usr/bin/env bash
# One call on a lent GPU machine (the tool library's `device`): the machine's versions, then
# `python -m eval.main bench gpu` (every stage), cut off at LIMIT seconds; the report, the logs
# and the decode plot land in $OUT (default outputs/gpu_run). No install: the image's python3
# has jax, flax, optax, orbax, transformers, pytest-xdist; the repo goes on PYTHONPATH.
#
#   LIMIT=540 STAGE_LIMIT=200 bash benchmarks/gpu/device_run.sh
#   STAGES=train,train_scan,decode,dry_run LIMIT=... bash benchmarks/gpu/device_run.sh   # a subset
#
# Stage order: the kernel tests (correctness first), the training step, looped and scanned (subprocesses that need
# the GPU's memory before this process's in-process stages keep theirs), the kernel timings,
# the decode timings, and last the Qwen3-8B dry run (a long compile; it gets what time is left).
set -u
OUT=${OUT:-outputs/gpu_run}
LIMIT=${LIMIT:-540}
STAGE_LIMIT=${STAGE_LIMIT:-200}
WORK=${WORK:-/tmp/bench_gpu}
rm -rf "$WORK"  # each call measures afresh: no earlier logs, no warm compile cache
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
PY=${PY:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  $PY -c "import sys, jax, jaxlib, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
  $PY -m pip list 2>/dev/null | grep -iE "^(jax|jax-cuda|triton|transformers|orbax|pytest-xdist|numpy) " || true
  command -v ptxas || ls /usr/local/cuda/bin/ptxas || true
  nproc
} 2>&1 | tee "$OUT/env.txt"
STAGES=${STAGES:-kernel_tests,train,train_scan,kernels,decode,dry_run}
timeout -k 5 "$LIMIT" $PY -m eval.main bench gpu --stages "$STAGES" \
  --out_dir "$WORK" --benchmarks_md '' --timeout_s "$STAGE_LIMIT" 2>&1 | tee "$OUT/log.txt"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/log.txt"
# stages run their subprocesses in their own sessions: end any the time limit left behind
pkill -9 -f -- "-m (train.main|train.throughput|pytest) " 2>/dev/null
for f in bench_gpu.md kernel_tests.log train.log train_scan.log dry_run.log decode/bench_decode.png; do
  [ -f "$WORK/$f" ] && mkdir -p "$OUT/$(dirname "$f")" && cp "$WORK/$f" "$OUT/$f"  # the report's image link holds
done
# the profiled train step's trace (8 files come back at most: with kernel_tests.log this is the 9th, left out)
trace=$(ls -t "$WORK"/train_profile/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1)
[ -n "$trace" ] && [ ! -f "$OUT/kernel_tests.log" ] && cp "$trace" "$OUT/train_trace.json.gz"
ls -la "$OUT"
