#!/usr/bin/env bash
# Median training step of the main job's recipe with one change: 30 steps, no evaluation, then the
# median `step_time_s` of steps 6-30 from metrics.jsonl (BENCHMARKS.md, stop 35, "What a step costs").
#   bash benchmarks/stop35/step_time.sh NAME VARIANT [FLAGS...]   e.g. nolist kvpop-mlstm --listwise_queries=0
set -euo pipefail
name=$1
variant=$2
shift 2
rm -rf "runs/steps35/$name"
python -m train.main --flagfile=configs/tiny_cpu.flags --run_dir="runs/steps35/$name" --variants="$variant" \
    --eval_methods= --progress=false --steps=30 --checkpoint_every=1000 "$@" > /dev/null
python - "runs/steps35/$name/$variant/metrics.jsonl" "$name" <<'PY'
import json
import sys

import numpy as np

rows = [json.loads(line) for line in open(sys.argv[1])]
times = [r["step_time_s"] for r in rows if "step_time_s" in r][5:]
print(f"{sys.argv[2]}: median step {np.median(times):.3f} s over {len(times)} steps")
PY
