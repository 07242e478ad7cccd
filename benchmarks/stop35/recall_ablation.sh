#!/usr/bin/env bash
# KVpop-mLSTM alone with one change from the main job's recipe, then its recall at B 123 and 256 on
# the 8 validation reuse prompts, one per row (BENCHMARKS.md, stop 35).
#   bash benchmarks/stop35/recall_ablation.sh NAME [FLAGS...]   e.g. regc1 --regression_weight=1
set -euo pipefail
name=$1
shift
python -m train.main --flagfile=configs/tiny_cpu.flags --run_dir="runs/abl35/$name" --variants=kvpop-mlstm \
    --eval_methods= --progress=false "$@"
python benchmarks/stop35/recall_documents.py "runs/abl35/$name/kvpop-mlstm/export" validation
