"""`python -m demo`: print a demo trace, its statistics and the oracle bounds (see `demo/task.py`)."""

from __future__ import annotations

import argparse

import numpy as np

from demo.oracles import oracle_recovery
from demo.task import DIFFICULTY, SPLITS, generate_dataset, write_jsonl
from demo.tokenizer import build_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="test", choices=sorted(SPLITS))
    parser.add_argument("--difficulty", default="medium", choices=sorted(DIFFICULTY))
    parser.add_argument("--seq-len", type=int, default=1536)
    parser.add_argument("--n", type=int, default=200, help="examples for the stats (and --out)")
    parser.add_argument("--out", help="write the n examples to this jsonl file")
    parser.add_argument("--w", type=int, default=32, help="protected window for the oracle stats")
    args = parser.parse_args(argv)
    kw = dict(difficulty=args.difficulty, seq_len=args.seq_len)
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
    print(f"--- {args.n} {args.split} examples, difficulty {args.difficulty}")
    print(f"prompt tokens {prompt_len.min()}..{prompt_len.max()}, text tokens {text_len.min()}..{text_len.max()}")
    print(f"binding values per prompt {n_values.mean():.0f} ({(n_values / prompt_len).mean():.0%} of tokens); "
          f"mark gap {min(gaps)}..{max(gaps)} (bound {ex['meta']['max_mark_gap']})")
    tok = build_tokenizer()
    hf_len = [len(tok(e["prompt"])["input_ids"]) for e in examples[:20]]
    print(f"HF tokenizer (vocab {len(tok)}): prompt tokens of 20 examples {min(hf_len)}..{max(hf_len)}")
    for cr in (0.75, 0.88):
        budget = int(round((1 - cr) * args.seq_len))
        rec = [oracle_recovery(e, budget, s=4, w=args.w) for e in examples]
        rates = {p: np.mean([r[p] for r in rec]) for p in rec[0]}
        print(f"CR {cr:.0%} (B={budget}, s=4, w={args.w}): oracle recovery "
              + ", ".join(f"{p} {v:.0%}" for p, v in rates.items()))
    if args.out:
        write_jsonl(args.out, examples)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
