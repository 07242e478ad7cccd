"""`python -m demo`: print a demo trace, its statistics and the oracle bounds (see `demo/task.py`)."""

from __future__ import annotations

import argparse
import os

import numpy as np

from demo.oracles import oracle_recovery
from demo.task import DIFFICULTY, SEED_LIMIT, SPLITS, TASKS, generate_dataset, make_config, write_jsonl
from demo.tokenizer import build_tokenizer

SINKS = 4  # the oracles' s, as in the main job


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="reuse", choices=sorted(TASKS), help="reuse (the main task) or read_once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="test", choices=sorted(SPLITS))
    parser.add_argument("--difficulty", default="medium", choices=sorted(DIFFICULTY))
    parser.add_argument("--seq_len", "--seq-len", type=int, default=1024, help="prompt tokens (the main job's 1024)")
    parser.add_argument("--n", type=int, default=200, help="examples for the stats (and --out)")
    parser.add_argument("--out", help="write the n examples to this jsonl file")
    parser.add_argument("--w", type=int, default=32, help="protected window for the oracle stats")
    args = parser.parse_args(argv)
    if args.n < 1 or not 0 <= args.seed < SEED_LIMIT or args.w < 0:  # the generator's seed is one 32-bit word
        parser.error(f"need --n >= 1, 0 <= --seed < 2**32 and --w >= 0, got {args.n}, {args.seed}, {args.w}")
    try:
        make_config(args.difficulty, args.task, seq_len=args.seq_len)
    except ValueError as e:
        parser.error(f"--seq_len {args.seq_len}: {e}")  # make_config names the shortest length
    budgets = {cr: int(round((1 - cr) * args.seq_len)) for cr in (0.75, 0.88)}
    if min(budgets.values()) < SINKS + args.w:
        parser.error(f"--w {args.w} does not fit the CR-88% budget B = {budgets[0.88]} of {args.seq_len} tokens "
                     f"(need s + w = {SINKS} + w <= B)")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out {args.out!r}: the directory {os.path.dirname(os.path.abspath(args.out))!r} does not exist")
    kw = dict(task=args.task, difficulty=args.difficulty, seq_len=args.seq_len)
    examples = generate_dataset(args.n, args.seed, args.split, **kw)

    ex = examples[0]
    lines = ex["text"].split("\n")
    print(f"--- {ex['id']} (answer {ex['answer']}): first and last lines of {len(lines)} ---")
    print("\n".join(lines[:14] + ["..."] + lines[-14:]))
    print("--- facts:", [{k: f[k] for k in ("name", "value", "value_pos", "mark_pos", "queried")}
                         for f in ex["meta"]["facts"]])

    prompt_len = np.array([e["meta"]["n_prompt_tokens"] for e in examples])
    text_len = np.array([e["meta"]["n_text_tokens"] for e in examples])
    n_values = np.array([len(e["meta"]["binding_value_positions"]) for e in examples])
    gaps = [f["mark_pos"] - f["value_pos"] for e in examples for f in e["meta"]["facts"]]
    print(f"--- {args.n} {args.split} examples, task {args.task}, difficulty {args.difficulty}")
    print(f"prompt tokens {prompt_len.min()}..{prompt_len.max()}, text tokens {text_len.min()}..{text_len.max()}")
    print(f"binding values per prompt {n_values.mean():.0f} ({(n_values / prompt_len).mean():.0%} of tokens); "
          f"mark gap {min(gaps)}..{max(gaps)} (bound {ex['meta']['max_mark_gap']})")
    tok = build_tokenizer()
    hf_len = [len(tok(e["prompt"])["input_ids"]) for e in examples[:20]]
    print(f"HF tokenizer (vocab {len(tok)}): prompt tokens of 20 examples {min(hf_len)}..{max(hf_len)}")
    for cr, budget in budgets.items():
        rec = [oracle_recovery(e, budget, s=SINKS, w=args.w) for e in examples]
        rates = {p: np.mean([r[p] for r in rec]) for p in rec[0]}
        print(f"CR {cr:.0%} (B={budget}, s={SINKS}, w={args.w}): oracle recovery "
              + ", ".join(f"{p} {v:.0%}" for p, v in rates.items()))
    if args.out:
        write_jsonl(args.out, examples)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
