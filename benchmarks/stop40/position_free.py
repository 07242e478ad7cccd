"""How much of the leave-time ceiling is where the token sits in the row (stop 40).

The ceiling (recall 0.81 at B 256) ranks each token by the Monte-Carlo mean of its log-target over
futures that all end at the row's 1024 tokens, so it may use the token's absolute position: how many
queries are left, where the plan puts the marked bindings. A scorer that must rank the same way at
2048 tokens (the job's length target) cannot. This takes that out of the means, held out across
rows, and scores the teacher's keep sets again:

- `- pos P`: the means minus their group mean per position bin (P bins over the row), the groups
  fitted on the other half of the rows (two folds by row parity) and centred per row. If position
  adds to the rest, that is the conditional mean of a reader that does not know position;
- `- role x pos16 + role`: the same with the position profile taken per line role (binding name,
  value, scratch, recall, keep, ask: `benchmarks/stop39/residual_context.py`), for position that
  acts through the kind of token.

The fitted scorer (keys unrotated, as shipped) goes through the same, as a check: its own position
profile should be worth little to it.

    python benchmarks/stop40/position_free.py runs/stop39/fit64.npz runs/stop39/mc_train16.npz
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stop39"))
from residual_context import cv_group_means, kept_sets, line_roles, load_fit_and_means, teacher_kept  # noqa: E402


def without_profile(scores_NxHxS, groups_NxS, rows_NxS, competing_S, add_back=None):
    """scores minus their held-out group means over the competing tokens (per head, centred per row),
    plus the held-out group means of `add_back` groups if given. Sinks and the last window keep their
    scores (they do not compete), and so does a token whose group (or add-back group) the other
    fold's rows lack: nothing is known to take out of it."""
    out = scores_NxHxS.astype(np.float64).copy()
    rows = rows_NxS[:, competing_S].ravel()
    groups = groups_NxS[:, competing_S].ravel()
    # which tokens the other fold has seen a group of does not depend on the head
    seen = cv_group_means(np.ones(rows.size), groups, rows) > 0.5
    if add_back is not None:
        back = add_back[:, competing_S].ravel()
        seen &= cv_group_means(np.ones(rows.size), back, rows) > 0.5
    for h in range(out.shape[1]):
        y = out[:, h][:, competing_S]
        y = y - y.mean(1, keepdims=True)
        delta = -cv_group_means(y.ravel(), groups, rows)
        if add_back is not None:
            delta += cv_group_means(y.ravel(), back, rows)
        delta[~seen] = 0.0
        out[:, h][:, competing_S] += delta.reshape(y.shape)
    return out.astype(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fit", help="npz of benchmarks/stop37/scorer_offline.py --save (its train rows are scored)")
    ap.add_argument("mc", help="npz of benchmarks/stop38/mc_targets.py on the same first train rows")
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    ap.add_argument("--layers", default="0,1", help="comma-separated layers")
    args = ap.parse_args()
    z, mc, n, kv, tok = load_fit_and_means(args.fit, args.mc, args.export)
    s = z["train_ids"].shape[1]
    roles = np.stack([np.asarray(line_roles(tok.convert_ids_to_tokens(list(ids)))) for ids in z["train_ids"][:n]])
    rows = np.broadcast_to(np.arange(n)[:, None], (n, s))
    competing = (np.arange(s) >= kv.sinks) & (np.arange(s) <= s - 1 - kv.window)
    pos = {p: np.broadcast_to(np.arange(s) * p // s, (n, s)).astype(str) for p in (8, 16, 64)}
    role_pos = np.char.add(np.char.add(roles, "|"), pos[16])
    q = jnp.asarray(z["train_q"][:n])
    print(f"{n} train rows, B {kv.budget} (k {kv.topk}), recall of the teacher's long-range keep sets at "
          f"{q.shape[1]} sampled queries per row; per KV head in brackets")
    for layer in (int(x) for x in args.layers.split(",")):
        teacher = teacher_kept(z, layer, n, kv, q)

        def recall(scores):
            kept = kept_sets(scores, z["log_gamma"][layer], kv, q)
            return [float((teacher[:, h] & kept[:, h]).sum() / teacher[:, h].sum()) for h in range(teacher.shape[1])]

        print(f"\nlayer {layer}")
        for name, scores in (("the means (the ceiling)", mc["target"][:n, layer]),
                             ("the fit (keys unrotated)", z["train_scores"][:n, layer])):
            for label, variant in (("", scores),
                                   (" - pos 8", without_profile(scores, pos[8], rows, competing)),
                                   (" - pos 16", without_profile(scores, pos[16], rows, competing)),
                                   (" - pos 64", without_profile(scores, pos[64], rows, competing)),
                                   (" - role x pos16 + role", without_profile(scores, role_pos, rows, competing,
                                                                              add_back=roles))):
                r = recall(variant)
                print(f"  {name + label:48s} {np.mean(r):.3f} {np.round(r, 3).tolist()}", flush=True)


if __name__ == "__main__":
    main()
