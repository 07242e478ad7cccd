#!/usr/bin/env bash
# KVpop-mLSTM alone with one change from the main job's recipe, then its recall at B 123 and 256 on
# validation traces (BENCHMARKS.md, stop 32).
#   bash benchmarks/stop32/recall_ablation.sh NAME [FLAGS...]   e.g. skip --mlstm_skip
set -euo pipefail
name=$1
shift
python -m train.main --flagfile=configs/tiny_cpu.flags --run_dir="runs/abl32/$name" --variants=kvpop-mlstm \
    --eval_methods= "$@"
python benchmarks/stop32/recall_at_budgets.py "runs/abl32/$name/kvpop-mlstm/export" "$name"
