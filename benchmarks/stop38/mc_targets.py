"""Monte-Carlo conditional-mean targets for train prompts (stop 38).

For each of the first N train-split reuse prompts (the rows `benchmarks/stop37/scorer_offline.py`
caches), the shipped export's log-target averaged over drawn futures of what came before each token
leaves the window, with the plan redrawn where the prefix does not show it: the quantity
`eval.diagnose ceiling --replan` ranks by (`eval.diagnose.conditional_log_target`). Saved as
`target` [N, L, H, S] with the rows' `ids`, for `scorer_offline.py --targets FILE`: does a scorer
fitted to these means, instead of the realized targets, reach the ceiling?

    python benchmarks/stop38/mc_targets.py --train 64 --out runs/stop38/mc_train64.npz

About 25 s a prompt on 2 cores at the defaults (8 futures, a cut every 16 tokens; 64 prompts: 25 min).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np
from tqdm import tqdm

from demo.task import example_seed, generate_example
from eval.diagnose import conditional_log_target
from kvpop_jax import load_pretrained
from kvpop_jax.checkpoint import checkpoint_tokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    ap.add_argument("--train", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--futures", type=int, default=8)
    ap.add_argument("--cut_step", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--future_seed", type=int, default=38,
                    help="salt of the drawn futures: another value gives an independent estimate of the same means")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    config, params = load_pretrained(args.export)
    config = dataclasses.replace(config, kvpop=config.kvpop.retarget(args.budget, config.head_dim))
    tok = checkpoint_tokenizer(args.export)
    s = args.seq_len

    def text_ids(ex):
        return np.asarray(tok(ex["text"])["input_ids"][:s], np.int32)

    ids, targets = [], []
    for row in tqdm(range(args.train), desc="prompts", unit="prompt"):
        seed = example_seed(args.seed, "train", row)
        row_ids = text_ids(generate_example(seed, task="reuse", seq_len=s))

        def draw(c, j):
            future_seed = int(np.random.SeedSequence([args.seed, row, c, j, args.future_seed]).generate_state(1)[0])
            return text_ids(generate_example(seed, task="reuse", seq_len=s, resample=(c, future_seed), replan=True))

        ids.append(row_ids)
        targets.append(conditional_log_target(config, params, row_ids, draw, futures=args.futures,
                                              cut_step=args.cut_step)[:, 0])  # [L, H, S]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp.npz"
    np.savez(tmp, target=np.stack(targets), ids=np.stack(ids), budget=args.budget, futures=args.futures,
             cut_step=args.cut_step, future_seed=args.future_seed)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(ids)} prompts")


if __name__ == "__main__":
    main()
