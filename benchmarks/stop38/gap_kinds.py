"""Which of the teacher's kept tokens the Monte-Carlo conditional mean keeps and a fitted scorer
misses, by kind and age (stop 38).

Reads the npz of `scorer_offline.py --targets FILE --save OUT` (the train rows it reports on, with
their Monte-Carlo means) and counts, per [layer, KV head], the teacher's long-range keep sets at the
sampled saturated queries by the kind of token and its age at the query (q - t), with the share of
each that the conditional mean's policy keeps and the share the fitted scorer keeps.

    python benchmarks/stop38/gap_kinds.py runs/stop38/fit_mc64_scores.npz
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from demo.atoms import NAMES
from demo.task import generate_dataset
from kvpop_jax import load_pretrained
from kvpop_jax.checkpoint import checkpoint_tokenizer
from kvpop_jax.kvpop import kept_long_range, sparse_policy

KINDS = ("queried fact value", "other marked fact value", "restated fact value", "other binding value",
         "name", "other digit", "newline", "other")
AGES = ((0, 64), (64, 128), (128, 256), (256, 512), (512, 1024))


def kinds_of(example, tokens):
    meta = example["meta"]
    facts = {f["value_pos"]: f["queried"] for f in meta["facts"]}
    restated = {p for f in meta["facts"] for p in f["reuse_pos"]}
    values = set(meta["binding_value_positions"])
    out = []
    for t, tok in enumerate(tokens):
        if t in facts:
            out.append(0 if facts[t] else 1)
        elif t in restated:
            out.append(2)
        elif t in values:
            out.append(3)
        elif tok in NAMES:
            out.append(4)
        elif tok.strip().isdigit():
            out.append(5)
        elif tok == "\n":
            out.append(6)
        else:
            out.append(7)
    return np.asarray(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("saved")
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    z = np.load(args.saved)
    config, _ = load_pretrained(args.export)
    kv = config.kvpop.retarget(int(z["budget"]), config.head_dim)
    tok = checkpoint_tokenizer(args.export)
    n = z["train_ids"].shape[0]
    exs = generate_dataset(n, args.seed, "train", task="reuse", seq_len=args.seq_len)
    kinds = []
    for ex, ids in zip(exs, z["train_ids"]):
        if list(tok(ex["text"])["input_ids"][: args.seq_len]) != list(ids):
            raise SystemExit("the saved train rows are not these prompts")
        kinds.append(kinds_of(ex, tok.convert_ids_to_tokens(list(ids))))
    kinds = np.stack(kinds)  # [B, S]
    q = jnp.asarray(z["train_q"])
    s = kinds.shape[1]
    age = np.asarray(q)[:, :, None] - np.arange(s)[None, None]  # [B, Nq, S]

    def keep(scores_BxLxHxS, layer):
        ranks, cut = sparse_policy(jnp.asarray(scores_BxLxHxS[:, layer]), jnp.asarray(z["log_gamma"][layer]),
                                   kv)
        return np.asarray(kept_long_range(ranks, cut, q, sinks=kv.sinks, window=kv.window))  # [B, H, Nq, S]

    L, H = z["train_scores"].shape[1:3]
    for layer in range(L):
        teacher_all = np.asarray(kept_long_range(jnp.asarray(z["train_teacher_ranks"][:, layer]),
                                                 jnp.asarray(z["train_teacher_cutoffs"][:, layer]), q,
                                                 sinks=kv.sinks, window=kv.window))
        mc_all, fit_all = keep(z["train_mc_target"], layer), keep(z["train_scores"], layer)
        for h in range(H):
            t, m, f = teacher_all[:, h], mc_all[:, h], fit_all[:, h]  # [B, Nq, S]
            print(f"layer {layer} head {h}: teacher keeps {t.sum()} (token, query) pairs; "
                  f"recall: conditional mean {(t & m).sum() / t.sum():.3f}, fit {(t & f).sum() / t.sum():.3f}")
            print(f"  {'kind':26s} {'share':>6s} {'mean':>6s} {'fit':>6s} {'mean-only':>9s} {'fit-only':>8s}")
            kind_bq = np.broadcast_to(kinds[:, None], t.shape)
            groups = [(name, kind_bq == i) for i, name in enumerate(KINDS)]
            groups += [(f"age {lo}-{hi}", (age >= lo) & (age < hi)) for lo, hi in AGES]
            for label, group in groups:
                sel = t & group
                if sel.sum():
                    print(f"  {label:26s} {sel.sum() / t.sum():6.3f} {(sel & m).sum() / sel.sum():6.3f} "
                          f"{(sel & f).sum() / sel.sum():6.3f} {(sel & m & ~f).sum() / t.sum():9.3f} "
                          f"{(sel & f & ~m).sum() / t.sum():8.3f}")

if __name__ == "__main__":
    main()
