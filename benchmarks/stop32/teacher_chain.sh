#!/usr/bin/env bash
# The shipped demo teacher's four stages, one after the other, into runs/chain32/s1..s4 (never over
# checkpoints/demo-teacher), with the seconds from the first start after each stage (BENCHMARKS.md, stop 32).
#   bash benchmarks/stop32/teacher_chain.sh [RUN_ROOT]
set -euo pipefail
root=${1:-runs/chain32}
start=$(date +%s)
prev=""
stage=0
for flags in tiny_teacher tiny_teacher_reuse tiny_teacher_park tiny_teacher_park_all; do
    stage=$((stage + 1))
    init=()
    if [[ -n "$prev" ]]; then init=(--init_from="$prev"); fi
    python -m train.pretrain --flagfile="configs/$flags.flags" --run_dir="$root/s$stage" \
        --out_dir="$root/s$stage/export" "${init[@]}"
    prev="$root/s$stage/export"
    echo "stage $stage ($flags) done at $(( $(date +%s) - start )) s"
done
