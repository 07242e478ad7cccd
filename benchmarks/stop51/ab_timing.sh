#!/bin/bash
# README command 1 on two commits, back to back on one box, then the evaluation alone (a rerun finds the
# trainings done), then the evaluation with JAX_LOG_COMPILES=1 to compare the compiled programs.
#   bash benchmarks/stop51/ab_timing.sh OLD_COMMIT NEW_COMMIT [WORK_DIR]
# Each log's last line is the job's "wall time:" with its parts; compare the programs with
#   grep -o "Finished XLA compilation of .* in [0-9.]* sec" WORK_DIR/A.eval2.log
set -euo pipefail
old=$1 new=$2 work=${3:-/tmp/ab}
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$work"
for t in A B; do
  commit=$([ "$t" = A ] && echo "$old" || echo "$new")
  rm -rf "${work:?}/$t" && git clone -q "$repo" "$work/$t" && git -C "$work/$t" checkout -q "$commit"
  (cd "$work/$t" && python3 -m venv .venv && . .venv/bin/activate && pip install -q -e .) > "$work/$t.setup.log" 2>&1
done
run() {  # run TAG LOG [ENV...]
  (cd "$work/$1" && . .venv/bin/activate && env "${@:3}" /usr/bin/time -v python -m train.main \
    --flagfile=configs/tiny_cpu.flags) > "$work/$1.$2.log" 2>&1
}
run B full; run A full
run A eval1; run B eval1
run B eval2 JAX_LOG_COMPILES=1; run A eval2 JAX_LOG_COMPILES=1
grep "wall time" "$work"/*.log
