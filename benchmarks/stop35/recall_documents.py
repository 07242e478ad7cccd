"""Recall of one KVpop export at B 123 and 256 on 8 demo reuse prompts of a split, one per row
(BENCHMARKS.md, stop 35).

    python benchmarks/stop35/recall_documents.py EXPORT [validation|test]
"""
import os
import sys

from demo.task import generate_dataset, write_jsonl
from eval.recall import run_recall

export = sys.argv[1]
split = sys.argv[2] if len(sys.argv) > 2 else "validation"
data = f"runs/abl35/{split}_reuse_1024.jsonl"
if not os.path.isfile(data):
    os.makedirs(os.path.dirname(data), exist_ok=True)
    write_jsonl(data, generate_dataset(8, 0, split, task="reuse", seq_len=1024))
out = []
for budget in (123, 256):
    r = run_recall(export, data, num_sequences=8, seq_len=1024, budget=budget, progress=False, rows="documents",
                   out_dir=os.path.join(export, os.pardir, f"recall_{split}_{budget}"))
    out.append(f"B{budget} {r.global_mean:.3f} {r.recall.round(3).tolist()}")
print(export, split, " | ".join(out), flush=True)
