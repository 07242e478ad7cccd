"""How much of the job's retention target came from a packed row's padding queries (stop 48).

The job packs each 1017-token demo trace into a 1024-token row and pads the tail (7 tokens). Until
stop 48 those padding queries counted in the future-attention target (its mass and N_t) and could be
sampled as retention queries. Here, on the job's own training rows and the shipped export's queries
and keys, the target per layer and KV head with and without `row_lengths`, for the paper's sum and
for the max over future reads:

- the share of competing tokens (s <= t, t + w < the row's real length) whose log-target moves by
  more than 0.1 nat when the padding queries are left out;
- the agreement of the teacher policy's long-range keep sets at 16 late real queries (recall of the
  padding-free set by the old one), at the training budget.

    python benchmarks/stop48/padding_queries.py --run_dir runs/tiny_cpu \
        --export checkpoints/demo-kvpop-mlstm --rows 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax import kvpop as kvpop_lib
from kvpop_jax.checkpoint import load_pretrained, load_tokenizer
from kvpop_jax.modeling import Qwen3ForCausalLM
from train.packing import DataConfig, PackedBatchIterator
from train.step import real_lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run_dir", default="runs/tiny_cpu")
    ap.add_argument("--variant", default="kvpop-mlstm")
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--queries", type=int, default=16)
    args = ap.parse_args()

    with open(os.path.join(args.run_dir, args.variant, "train_config.json")) as f:
        data = json.load(f)["data"]
    batches = PackedBatchIterator(DataConfig(**data), load_tokenizer(args.export))
    rows = []
    while sum(len(r["input_ids"]) for r in rows) < args.rows:
        rows.append(next(batches))
    batch = {k: np.concatenate([r[k] for r in rows])[:args.rows] for k in ("input_ids", "segment_ids")}
    ids = jnp.asarray(batch["input_ids"])
    lengths = real_lengths(jnp.asarray(batch["segment_ids"]))
    print(f"{args.rows} training rows of {ids.shape[1]} tokens; real lengths {np.asarray(lengths).tolist()}")

    config, params = load_pretrained(args.export)
    kv = config.kvpop
    # late real queries per row, evenly spaced over its last half (the sampler is late-biased)
    frac = (np.arange(args.queries) + 1) / args.queries
    q_np = (np.asarray(lengths)[:, None] // 2 + frac[None] * (np.asarray(lengths)[:, None] // 2 - 1)).astype(np.int32)
    q_idx = jnp.asarray(np.maximum(q_np, kv.budget))

    kinds = []
    print("| target | layer | tokens moved > 0.1 nat | keep-set recall (old vs padding-free) |")
    print("|---|---|---|---|")
    for reduce in ("sum", "max"):
        cfg = dataclasses.replace(config, kvpop=dataclasses.replace(kv, target_reduce=reduce))
        model = Qwen3ForCausalLM(cfg)
        outs = [model.apply({"params": params}, ids, query_samples=q_idx, return_policy=True, row_lengths=lens)
                for lens in (None, lengths)]
        for layer, (old, new) in enumerate(zip(outs[0].aux["layers"], outs[1].aux["layers"])):
            t = np.arange(ids.shape[1])
            competes = (t >= kv.sinks)[None, None] & (t[None, None] + kv.window < np.asarray(lengths)[:, None, None])
            moved = np.abs(np.asarray(old["target"]) - np.asarray(new["target"])) > 0.1
            share = (moved & competes).sum() / (competes.sum() * moved.shape[1])  # over rows, heads and tokens
            keep = [kvpop_lib.kept_long_range(o["teacher_ranks"], o["teacher_cutoffs"], q_idx, sinks=kv.sinks,
                                              window=kv.window) for o in (old, new)]
            recall = float(jnp.sum(keep[0] & keep[1]) / jnp.maximum(jnp.sum(keep[1]), 1))
            print(f"| {reduce} | {layer} | {share:.3f} | {recall:.3f} |")
            raised = (np.asarray(old["target"]) - np.asarray(new["target"]) > 0.1) & competes
            kinds.append((reduce, layer, raised, competes))
    # what the padding queries raised: the tokens, as a share of that token's competing occurrences
    tok = load_tokenizer(args.export)
    ids_np = np.asarray(ids)
    for reduce, layer, raised, competes in kinds:
        counts: dict[str, list[int]] = {}
        for b, h, t in zip(*np.nonzero(np.broadcast_to(competes, raised.shape))):
            text = tok.decode([int(ids_np[b, t])])
            c = counts.setdefault(text, [0, 0])
            c[0] += int(raised[b, h, t])
            c[1] += 1
        top = sorted(counts.items(), key=lambda kv_: -kv_[1][0])[:6]
        print(f"{reduce}, layer {layer}: raised most often: "
              + ", ".join(f"{text!r} {n}/{m}" for text, (n, m) in top))


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")
    main()
