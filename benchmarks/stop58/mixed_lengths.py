"""`eval.main accuracy` on a benchmark of interleaved prompt lengths (stop 58).

    python benchmarks/stop58/mixed_lengths.py [--lengths 960,1100,1250,1400,1700,2000] [--per_length 8] \
        [--out /tmp/mixed] [--methods dense,streaming,tova,h2o,kvpop-mlstm]

Writes `OUT/mixed.jsonl`: `--per_length` held-out reuse problems (test split, seed 58) at each length, interleaved
round robin (as a real benchmark's lengths come), then runs the demo teacher and KVpop-mLSTM export on it, greedy, one
rollout, `--problem_batch 8`, the baselines one-shot (`accuracy`'s default), and prints the wall time. Run it on two
checkouts (PYTHONPATH at each) to compare their code: before stop 58 each prompt length compiled its own program for
every baseline and CR, and interleaved lengths decoded one problem per call.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

from eval.benchmarks import load_benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="960,1100,1250,1400,1700,2000")
    parser.add_argument("--per_length", type=int, default=8)
    parser.add_argument("--out", default="/tmp/mixed")
    parser.add_argument("--methods", default="dense,streaming,tova,h2o,kvpop-mlstm")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    by_length = [[dict(p, id=f"len{n}-{p['id']}") for p in
                  load_benchmark(f"demo:reuse:test:seed=58:n={args.per_length}:len={n}")]
                 for n in map(int, args.lengths.split(","))]
    rows = [p for group in itertools.zip_longest(*by_length) for p in group if p is not None]
    bench = os.path.join(args.out, "mixed.jsonl")
    with open(bench, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in rows)
    cmd = [sys.executable, "-m", "eval.main", "accuracy", "--checkpoints",
           "dense=checkpoints/demo-teacher,kvpop-mlstm=checkpoints/demo-kvpop-mlstm", "--methods", args.methods,
           "--benchmark", bench, "--n_rollouts", "1", "--temperature", "0", "--context_len", "1024",
           "--max_new_tokens", "24", "--problem_batch", "8", "--out_dir", os.path.join(args.out, "report")]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"{len(rows)} problems, lengths {args.lengths}: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
