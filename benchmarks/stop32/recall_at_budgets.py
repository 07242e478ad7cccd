"""Teacher-retention recall of a KVpop export at the CR-88% and CR-75% budgets (B 123 and 256 of 1024
tokens) on 8 validation reuse traces, next to its run's last-20-step boundary AUC and logged recall
(BENCHMARKS.md, stop 32).

    python benchmarks/stop32/recall_at_budgets.py RUN/kvpop-mlstm/export NAME
"""

import json
import os
import sys

from demo.task import generate_dataset, write_jsonl
from eval.recall import run_recall

DATA = "runs/stop32_recall_validation_reuse_1024.jsonl"


def main(export: str, name: str) -> None:
    if not os.path.isfile(DATA):
        write_jsonl(DATA, generate_dataset(8, 0, "validation", task="reuse", seq_len=1024))
    parts = []
    for budget in (123, 256):
        result = run_recall(export, DATA, num_sequences=8, seq_len=1024, budget=budget, progress=False,
                            out_dir=os.path.join(os.path.dirname(export), f"recall_validation_B{budget}"))
        per_head = [[round(x, 3) for x in row] for row in result.recall.tolist()]
        parts.append(f"B{budget} {result.global_mean:.3f} {per_head}")
    with open(os.path.join(os.path.dirname(export), "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-20:]
    auc = sum(r["boundary_auc"] for r in last) / len(last)
    logged = sum(r["teacher_recall"] for r in last) / len(last)
    print(name, " | ".join(parts), f"| last-20 AUC {auc:.3f} logged recall {logged:.3f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
