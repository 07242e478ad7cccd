"""What the fitted scorer misses of the conditional mean, by the token's place in the trace (stop 39).

Stop 38 found that a scorer fitted to the Monte-Carlo conditional means stops at 0.755 recall where the
means reach 0.815, and that position and (previous, token) pairs explain little of the difference. This
breaks the difference down by finer context: the kind of line a token sits in and its role there, and,
for a binding's name and value, the name's history and what the window shows of it when the token
leaves (known to a leave-time scorer), beside what only the future holds (not known, a check).

Two readouts per [layer, KV head]:
- how much of the residual (means minus the best-scaled fit, centred per row) each feature's group
  means explain, two-fold cross-validated over rows, next to how much of the means themselves;
- the teacher's long-range keep sets at the sampled queries by feature value, with the share the means
  keep and the share the fit keeps (`gap_kinds.py`'s table for these features).

    python benchmarks/stop38/mc_targets.py --train 16 --out runs/stop39/mc_train16.npz
    python benchmarks/stop37/scorer_offline.py --train 64 --steps 2000 --seen 16 --save runs/stop39/fit64.npz
    python benchmarks/stop39/residual_context.py runs/stop39/fit64.npz runs/stop39/mc_train16.npz
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stop38"))
from gap_kinds import kinds_of  # noqa: E402

from demo.atoms import NAMES  # noqa: E402
from demo.task import generate_dataset  # noqa: E402
from kvpop_jax import load_pretrained  # noqa: E402
from kvpop_jax.checkpoint import checkpoint_tokenizer  # noqa: E402
from kvpop_jax.kvpop import kept_long_range, sparse_policy  # noqa: E402


def line_roles(tokens):
    """Per token: '<line type>:<role>' with line types binding / scratch / recall / keep / ask."""
    roles, start = [], 0
    while start < len(tokens):
        if tokens[start] == "<bos>":
            roles.append("bos")
            start += 1
            continue
        end = tokens.index("\n", start) + 1 if "\n" in tokens[start:] else len(tokens)
        line = tokens[start:end]
        if line[0] == ">":
            kind = "scratch" if "=" in line else "recall"
            roles += [f"{kind}:" + {0: ">", 1: "name", 2: "digit"}.get(i, "newline" if tok == "\n" else "arith")
                      for i, tok in enumerate(line)]
        elif line[0] == "keep":
            roles += ["keep:" + ("name" if tok in NAMES else "newline" if tok == "\n" else "word") for tok in line]
        elif line[0] == "ask":
            roles += ["ask:" + ("name" if tok in NAMES else "other") for tok in line]
        else:
            roles += ["binding:" + ("newline" if tok == "\n" else "name" if i % 2 == 0 else "value")
                      for i, tok in enumerate(line)]
        start = end
    return roles


def binding_history(tokens, roles, window):
    """Per token of a binding (its name or value; others -1): features of its name.

    prior: earlier bindings of the name (0, 1, 2, 3+); rebound_w: bound again within the w tokens after
    (what a leave-time scorer sees); looked_w: a scratch or recall line reads the name within those w;
    next_bind: the next binding of the name after leave time, bins of 128 tokens (future, a check);
    looks_later: lookups of the name after leave time (future, a check)."""
    s = len(tokens)
    binds, looks = {}, {}
    for t, r in enumerate(roles):
        if r == "binding:name":
            binds.setdefault(tokens[t], []).append(t)
        elif r in ("scratch:name", "recall:name"):
            looks.setdefault(tokens[t], []).append(t)
    feats = {key: np.full(s, -1) for key in ("prior", "rebound_w", "looked_w", "next_bind", "looks_later")}
    for t, r in enumerate(roles):
        if r not in ("binding:name", "binding:value"):
            continue
        n = t if r == "binding:name" else t - 1
        name = tokens[n]
        b = np.asarray(binds[name])
        lk = np.asarray(looks.get(name, []), int)
        feats["prior"][t] = min(int((b < n).sum()), 3)
        feats["rebound_w"][t] = int(((b > n) & (b <= t + window)).any())
        feats["looked_w"][t] = int(((lk > n) & (lk <= t + window)).any())
        later = b[b > t + window]
        feats["next_bind"][t] = min(int((later[0] - t) // 128), 4) if len(later) else 5
        feats["looks_later"][t] = min(int((lk > t + window).sum()), 3)
    return feats


def cv_group_means(y, groups, rows):
    """Each element's group mean over the other fold's rows (two folds by row parity), 0 for unseen groups."""
    out = np.zeros_like(y)
    for fold in (0, 1):
        fit_rows, test_rows = rows % 2 != fold, rows % 2 == fold
        means = {g: y[fit_rows & (groups == g)].mean() for g in np.unique(groups[fit_rows])}
        out[test_rows] = [means.get(g, 0.0) for g in groups[test_rows]]
    return out


def cv_r2(y, groups, rows):
    """Share of y's variance that group means explain on held-out rows (`cv_group_means`)."""
    return 1.0 - ((y - cv_group_means(y, groups, rows)) ** 2).sum() / (y ** 2).sum()


def load_fit_and_means(fit_path, mc_path, export):
    """(fit npz, means npz, n, kv, tokenizer): `scorer_offline.py --save` and `mc_targets.py` files on
    the same first n train rows and budget (checked), with the export's KVpop settings at that budget."""
    z, mc = np.load(fit_path), np.load(mc_path)
    n = min(z["train_ids"].shape[0], mc["ids"].shape[0])
    if not np.array_equal(z["train_ids"][:n], mc["ids"][:n]):
        raise SystemExit("the two files' train rows differ")
    if int(z["budget"]) != int(mc["budget"]):
        raise SystemExit(f"budgets differ: {int(z['budget'])} and {int(mc['budget'])}")
    config, _ = load_pretrained(export)
    return z, mc, n, config.kvpop.retarget(int(z["budget"]), config.head_dim), checkpoint_tokenizer(export)


def kept_sets(scores, log_gamma, kv, q):
    """[N, H, Nq, S] the long-range tokens a policy ranking by `scores` [N, H, S] keeps at queries q."""
    ranks, cut = sparse_policy(jnp.asarray(scores), jnp.asarray(log_gamma), kv)
    return np.asarray(kept_long_range(ranks, cut, q, sinks=kv.sinks, window=kv.window))


def teacher_kept(z, layer, n, kv, q):
    """[N, H, Nq, S] the teacher's long-range keep sets of layer `layer` on the fit file's first n rows."""
    return np.asarray(kept_long_range(jnp.asarray(z["train_teacher_ranks"][:n, layer]),
                                      jnp.asarray(z["train_teacher_cutoffs"][:n, layer]), q,
                                      sinks=kv.sinks, window=kv.window))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fit", help="npz of scorer_offline.py --save (its train rows are scored)")
    ap.add_argument("mc", help="npz of mc_targets.py on the same first train rows")
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default="1", help="comma-separated layers to report")
    args = ap.parse_args()
    z, mc, n, kv, tok = load_fit_and_means(args.fit, args.mc, args.export)
    exs = generate_dataset(n, args.seed, "train", task="reuse", seq_len=args.seq_len)
    s = args.seq_len
    feats = {"role": [], "kind": [], "pos16": []}
    for ex, ids in zip(exs, z["train_ids"][:n]):
        tokens = tok.convert_ids_to_tokens(list(ids))
        roles = line_roles(tokens)
        feats["role"].append(np.asarray(roles))
        feats["kind"].append(kinds_of(ex, tokens))
        feats["pos16"].append(np.arange(s) * 16 // s)
        for key, value in binding_history(tokens, roles, kv.window).items():
            feats.setdefault(key, []).append(value)
    feats = {key: np.stack(v) for key, v in feats.items()}  # [N, S]
    rb = feats["role"]
    for key in ("prior", "rebound_w", "looked_w", "next_bind", "looks_later"):  # joint with the role
        feats[f"role+{key}"] = np.char.add(np.char.add(rb, "|"), feats[key].astype(str))
    feats["role+prior+rebound_w+looked_w"] = np.char.add(np.char.add(feats["role+prior"], "|"), np.char.add(
        feats["rebound_w"].astype(str), feats["looked_w"].astype(str)))
    feats["role+pos16"] = np.char.add(np.char.add(rb, "|"), feats["pos16"].astype(str))

    competing = (np.arange(s) >= kv.sinks) & (np.arange(s) <= s - 1 - kv.window)
    rows = np.broadcast_to(np.arange(n)[:, None], (n, s))[:, competing].ravel()
    q = jnp.asarray(z["train_q"][:n])
    age = np.asarray(q)[:, :, None] - np.arange(s)[None, None]
    old = (age >= 256) & (age < 512)  # the (query, token) pairs the keep-set tables count
    for layer in (int(x) for x in args.layers.split(",")):
        mc_l, fit_l = mc["target"][:n, layer].astype(np.float64), z["train_scores"][:n, layer].astype(np.float64)
        for h in range(mc_l.shape[1]):
            m = mc_l[:, h][:, competing]
            f = fit_l[:, h][:, competing]
            m = m - m.mean(1, keepdims=True)
            f = f - f.mean(1, keepdims=True)
            a = (m * f).sum() / (f * f).sum()
            r = (m - a * f).ravel()
            print(f"\nlayer {layer} head {h}: the fit explains {1 - (r ** 2).sum() / (m ** 2).sum():.3f} of the "
                  f"means' variance ({n} rows)")
            print(f"  {'feature':34s} {'groups':>6s} {'means R2':>9s} {'residual R2':>12s}")
            for key, value in feats.items():
                g = value[:, competing].ravel()
                print(f"  {key:34s} {len(np.unique(g)):6d} {cv_r2(m.ravel(), g, rows):9.3f} "
                      f"{cv_r2(r, g, rows):12.3f}")

        def keep(scores):
            return kept_sets(scores, z["log_gamma"][layer], kv, q)

        teacher = teacher_kept(z, layer, n, kv, q)
        mean_keep, fit_keep = keep(mc["target"][:n, layer]), keep(z["train_scores"][:n, layer])
        # the fit plus each feature's residual group means (cross-validated): what the feature is worth in recall
        print(f"\nlayer {layer}: recall of the fit plus a feature's held-out residual group means (means - fit)")
        fit_c = z["train_scores"][:n, layer].astype(np.float64)
        res = mc["target"][:n, layer].astype(np.float64) - fit_c
        res = res - np.where(competing, res, 0).sum(-1, keepdims=True) / competing.sum()
        for key in ("none", "role", "pos16", "role+prior", "role+pos16", "role+prior+rebound_w+looked_w"):
            corrected = fit_c.copy()
            if key != "none":
                g = feats[key][:, competing].ravel()
                for h in range(fit_c.shape[1]):
                    corrected[:, h][:, competing] += cv_group_means(res[:, h][:, competing].ravel(), g, rows).reshape(
                        n, -1)
            ck = keep(corrected.astype(np.float32))
            rec = [(teacher[:, h] & ck[:, h]).sum() / teacher[:, h].sum() for h in range(teacher.shape[1])]
            print(f"  {key:34s} {np.mean(rec):.3f} {np.round(rec, 3).tolist()}")
        for h in range(teacher.shape[1]):
            t, mk, fk = teacher[:, h], mean_keep[:, h], fit_keep[:, h]
            print(f"\nlayer {layer} head {h}: teacher keeps {t.sum()} (token, query) pairs; recall: means "
                  f"{(t & mk).sum() / t.sum():.3f}, fit {(t & fk).sum() / t.sum():.3f}; pairs 256-512 old")
            print(f"  {'role | feature':40s} {'share':>6s} {'means':>6s} {'fit':>6s} {'mean-only':>9s} "
                  f"{'fit-only':>8s}")
            for key in ("role", "role+prior", "role+rebound_w", "role+looked_w", "role+next_bind",
                        "role+looks_later"):
                vals = np.broadcast_to(feats[key][:, None], t.shape)
                for v in np.unique(vals[t & old]):
                    sel = t & old & (vals == v)
                    if sel.sum() / t.sum() < 0.003:
                        continue
                    print(f"  {key + ' ' + v:40s} {sel.sum() / t.sum():6.3f} {(sel & mk).sum() / sel.sum():6.3f} "
                          f"{(sel & fk).sum() / sel.sum():6.3f} {(sel & mk & ~fk).sum() / t.sum():9.3f} "
                          f"{(sel & fk & ~mk).sum() / t.sum():8.3f}")


if __name__ == "__main__":
    main()
