"""How noisy are the Monte-Carlo means themselves? (stop 38)

Two estimates of the same conditional means (`mc_targets.py` with different `--future_seed`), on the
rows they share: the agreement of their keep sets (|A ∩ B| / |B|, at the saturated queries
`scorer_offline.py` reports on, for its `--train N`), and each one's recall of the teacher's set, with
that of their average (16 futures). A fitted scorer that agrees with one estimate on 0.83 is as close
as another estimate is if A and B agree on about as much.

    python benchmarks/stop38/mc_agreement.py runs/stop38/mc_train64.npz runs/stop38/mc_train8_seed39.npz
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

from eval.recall import policy_arrays, recall_counts, sample_saturated_queries
from kvpop_jax import load_pretrained
from kvpop_jax.kvpop import sparse_policy
from kvpop_jax.modeling import Qwen3ForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    ap.add_argument("--train", type=int, default=64, help="scorer_offline's --train: how its queries were drawn")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    a, b = np.load(args.a), np.load(args.b)
    n = min(len(a["ids"]), len(b["ids"]))
    if not np.array_equal(a["ids"][:n], b["ids"][:n]) or int(a["budget"]) != int(b["budget"]):
        raise SystemExit("the two files are not estimates for the same rows and budget")
    config, params = load_pretrained(args.export)
    config = dataclasses.replace(config, kvpop=config.kvpop.retarget(int(a["budget"]), config.head_dim))
    kv, model = config.kvpop, Qwen3ForCausalLM(config)
    s = a["ids"].shape[1]
    q = sample_saturated_queries(np.random.default_rng(args.seed), args.train, seq_len=s, budget=kv.budget,
                                 num=64)[:n]
    arr = policy_arrays(model, params, jnp.asarray(a["ids"][:n]), jnp.asarray(q))
    L = config.num_hidden_layers

    def policy(target_NxLxHxS):
        per_layer = [sparse_policy(jnp.asarray(target_NxLxHxS[:, i]), arr["log_gamma"][i], kv) for i in range(L)]
        return tuple(jnp.stack(x) for x in zip(*per_layer))

    def recall(student, teacher):
        h, t = recall_counts(*student, *teacher, jnp.asarray(q), sinks=kv.sinks, window=kv.window)
        return np.asarray(h).sum(1) / np.maximum(np.asarray(t).sum(1), 1)

    pa, pb = policy(a["target"][:n]), policy(b["target"][:n])
    avg = policy((a["target"][:n] + b["target"][:n]) / 2)
    teacher = (arr["teacher_ranks"], arr["teacher_cutoffs"])
    print(f"{n} rows, B {int(a['budget'])}, 64 saturated queries each")
    for name, r in (("agreement of A's keep sets with B's", recall(pa, pb)),
                    ("A's recall of the teacher's set", recall(pa, teacher)),
                    ("B's recall of the teacher's set", recall(pb, teacher)),
                    ("their average's recall", recall(avg, teacher))):
        print(f"  {name:38s}: {r.mean():.3f} {np.round(r, 3).tolist()}")


if __name__ == "__main__":
    main()
