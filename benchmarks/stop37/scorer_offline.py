"""Can the shipped scorer's architecture reach the recall target when optimized for long? (stop 37)

Freezes the shipped KVpop-mLSTM export's base model and decay, caches what its scorers read (the
KVpop forward's keys, unrotated, and values per layer) and its own future-attention target on
train-split reuse prompts, then trains a fresh scorer of the export's shape on them alone, for many
more steps than the job can afford, by the centred squared-error fit (`--regression_weight`'s loss:
its minimum is the conditional mean the ceiling ranks by) or the paper-style pieces are left out. Prints
the teacher-retention recall (the job's definition: `eval.recall.recall_counts` at 64 sampled saturated
queries per row) on validation prompts as training goes, next to the export's own.

    python benchmarks/stop37/scorer_offline.py --train 128 --steps 4000 --budget 256

A diagnosis of what the scorer can represent, not a training method.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from demo.task import generate_dataset
from eval.recall import policy_arrays, recall_counts, sample_saturated_queries
from kvpop_jax import load_pretrained
from kvpop_jax.checkpoint import checkpoint_tokenizer
from kvpop_jax.kvpop import KVpopHead, sparse_policy
from kvpop_jax.losses import regression_loss
from kvpop_jax.modeling import Attention, Qwen3ForCausalLM
from kvpop_jax.rope import apply_rope, rope_cos_sin, unrotate
from kvpop_jax.policy import decay_log_gamma


def query_weights(q, k):
    """[B, Hkv, S(query d), S(key t)]: exp(q_d . k_t / sqrt(D) - lse_d), lse_d the causal softmax's
    normalizer of query d, query heads of a KV head averaged: the causal attention weights for t <= d,
    and what query d would give a later key. q [B, S, Hq, D], k [B, S, Hkv, D] as the layer attends."""
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    logits = jnp.einsum("bshd,bthd->bhst", q, jnp.repeat(k, g, 2)) / np.sqrt(d)
    lse = jax.nn.logsumexp(jnp.where(np.tril(np.ones((s, s), bool)), logits, -1e30), -1, keepdims=True)
    return jnp.exp(logits - lse).reshape(b, hq // g, g, s, s).mean(2)


def window_attention(q, k, window: int):
    """[B, Hkv, S]: log of the mean causal attention weight token t gets from the w queries t+1..t+w:
    what attention-history methods know of t when it leaves the window."""
    offset = np.arange(q.shape[1])[:, None] - np.arange(q.shape[1])[None, :]  # query - key
    inside = jnp.asarray((offset >= 1) & (offset <= window), jnp.float32)
    return jnp.log((query_weights(q, k) * inside).sum(2) / window + 1e-6)


def prefix_attention(q, k, window: int):
    """[B, Hkv, S]: log of the mean weight token t would get from every query d <= t + w of the row, the
    ones before it included. Everything in it is known when t leaves the window: how the row's queries
    so far match t's key, a stand-in for the queries to come."""
    s = q.shape[1]
    seen = jnp.asarray(np.arange(s)[:, None] <= np.arange(s)[None, :] + window, jnp.float32)  # d <= t + w
    return jnp.log((query_weights(q, k) * seen).sum(2) / seen.sum(0) + 1e-6)


FEATURES = {"window": window_attention, "prefix": prefix_attention}


def cache_rows(config, params, ids, q_idx, batch=8, feature=None):
    """Per row: k (unrotated), v [L, S, H, D]; the export's target, scores, teacher ranks/cutoffs; with
    `feature` ("window" or "prefix", `FEATURES`), that attention statistic of each token [L, H, S]."""
    model = Qwen3ForCausalLM(config)
    out = {"k": [], "v": [], "target": [], "scores": [], "teacher_ranks": [], "teacher_cutoffs": []}
    if feature:
        out["feature"] = []
    @jax.jit
    def run(ids_b, q_b):
        arr = policy_arrays(model, params, ids_b, q_b)
        _, inter = model.apply({"params": params}, ids_b, capture_intermediates=lambda m, name: (
            isinstance(m, Attention) and name == "project_qkv"), mutable=["intermediates"])
        return arr, inter

    for lo in range(0, len(ids), batch):
        arr, inter = run(jnp.asarray(ids[lo:lo + batch]), jnp.asarray(q_idx[lo:lo + batch]))
        ks, vs, fs = [], [], []
        for layer in range(config.num_hidden_layers):
            q, k, v = inter["intermediates"][f"layers_{layer}"]["self_attn"]["project_qkv"][0]
            ks.append(unrotate(k, jnp.arange(k.shape[1])[None], config.rope_theta)), vs.append(v)
            if feature:
                fs.append(FEATURES[feature](q, k, config.kvpop.window))
        if feature:
            out["feature"].append(np.asarray(jnp.stack(fs, 1)))
        out["k"].append(np.asarray(jnp.stack(ks, 1))), out["v"].append(np.asarray(jnp.stack(vs, 1)))
        for key in ("target", "scores", "teacher_ranks", "teacher_cutoffs"):
            out[key].append(np.asarray(jnp.moveaxis(arr[key], 0, 1)))  # [B, L, H, S]
    return {k: np.concatenate(v) for k, v in out.items()}


INPUTS = ("layer", "rotated", "layers", "layers+tokens")


def scorer_inputs(split, inputs: str, vocab: int, rope_theta: float):
    """[N, L, S, H, D'] key and value halves of each layer's scorer input: `layer`, its own cached k, v (the
    method); `rotated`, the same with the keys rotated at their absolute positions, as the layer attends
    (what a scorer that reads absolute position sees); `layers`, layer i's k, v followed by layer i-1's
    (zeros for layer 0); `layers+tokens`, also the one-hot token id after the keys and the previous
    token's after the values."""
    k, v = split["k"], split["v"]
    if inputs == "layer":
        return k, v
    if inputs == "rotated":
        n, layers, s = k.shape[:3]
        cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(s), (n * layers, s)), k.shape[-1], rope_theta)
        return np.asarray(apply_rope(jnp.asarray(k).reshape(n * layers, *k.shape[2:]), cos, sin)).reshape(k.shape), v
    prev_k = np.concatenate([np.zeros_like(k[:, :1]), k[:, :-1]], 1)
    prev_v = np.concatenate([np.zeros_like(v[:, :1]), v[:, :-1]], 1)
    k, v = np.concatenate([k, prev_k], -1), np.concatenate([v, prev_v], -1)
    if inputs == "layers+tokens":
        n, layers, s, h = k.shape[:4]
        ids = split["ids"]
        one_hot = np.eye(vocab, dtype=np.float32)
        tok = np.broadcast_to(one_hot[ids][:, None, :, None], (n, layers, s, h, vocab))
        prev = np.broadcast_to(one_hot[np.concatenate([ids[:, :1] * 0, ids[:, :-1]], 1)][:, None, :, None],
                               (n, layers, s, h, vocab))
        k, v = np.concatenate([k, tok], -1), np.concatenate([v, prev], -1)
    return k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    ap.add_argument("--train", type=int, default=128)
    ap.add_argument("--valid", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--valid_len", type=int, default=None,
                    help="validation prompts of this length instead (the fit's recall at another length, same B)")
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=("scorer", "attn"), default="scorer",
                    help="scorer: a fresh scorer of the export's shape; attn: a delayed softmax-attention reader "
                         "(history + window with per-offset biases) and an MLP, far more expressive")
    ap.add_argument("--heads", type=int, default=4, help="attn: reader heads of width 32")
    ap.add_argument("--hidden", type=int, default=128, help="attn: MLP width")
    ap.add_argument("--inputs", choices=INPUTS, default="layer",
                    help="what the fresh scorer reads (scorer_inputs); pass --set mlstm_dim=64 to keep its width")
    ap.add_argument("--window_attn", type=int, default=0,
                    help="add a learned bias per head and bin (of 14 / N nats) of the log window attention the "
                         "token got, as H2O or TOVA know it when it leaves the window: do the layer's queries tell "
                         "what its [k; v] do not? (0: off)")
    ap.add_argument("--prefix_attn", action="store_true",
                    help="--window_attn's bins read prefix_attention instead: how every query of the row so far "
                         "(d <= t + w) matches the token's key")
    ap.add_argument("--pos_bins", type=int, default=0,
                    help="add a learned bias per head and position bin (of S / pos_bins tokens) to the scores: "
                         "what absolute position at a fixed row length is worth (0: off)")
    ap.add_argument("--loss", choices=("regression", "listwise"), default="regression")
    ap.add_argument("--tau", type=float, default=1.0, help="listwise: target temperature")
    ap.add_argument("--set", nargs="*", default=[], help="KVpopConfig overrides of the fresh scorer, key=value")
    ap.add_argument("--seen", type=int, default=8,
                    help="train rows the recall is also reported on, and --save writes (the first N)")
    ap.add_argument("--save", default=None,
                    help="write the fitted scorer's scores on the reported train rows and on validation, with what "
                         "they are scored against, to this npz (for benchmarks/stop38/gap_kinds.py)")
    ap.add_argument("--targets", default=None,
                    help="an npz of benchmarks/stop38/mc_targets.py (same rows, budget): fit its Monte-Carlo "
                         "conditional-mean targets instead of the realized ones")
    args = ap.parse_args()

    config, params = load_pretrained(args.export)
    config = dataclasses.replace(config, kvpop=config.kvpop.retarget(args.budget, config.head_dim))
    kv = config.kvpop
    tok = checkpoint_tokenizer(args.export)

    lengths = {"train": args.seq_len, "validation": args.valid_len or args.seq_len}
    if lengths["validation"] != args.seq_len and (args.model == "attn" or args.pos_bins):
        raise SystemExit("--valid_len needs --model scorer without --pos_bins (both are built for one length)")

    def rows(split, n):
        exs = generate_dataset(n, args.seed, split, task="reuse", seq_len=lengths[split])
        return np.stack([tok(e["text"])["input_ids"][: lengths[split]] for e in exs]).astype(np.int32)

    if args.prefix_attn and not args.window_attn:
        raise SystemExit("--prefix_attn needs --window_attn N (the bins)")
    feature = ("prefix" if args.prefix_attn else "window") if args.window_attn else None
    t0 = time.time()
    data = {}
    for split, n in (("train", args.train), ("validation", args.valid)):
        ids = rows(split, n)
        q = sample_saturated_queries(np.random.default_rng(args.seed), n, seq_len=lengths[split], budget=kv.budget,
                                     num=64)
        data[split] = cache_rows(config, params, ids, q, feature=feature) | {"q": q, "ids": ids}
        if feature is None:  # the score's binned bias is off; it still takes the (unread) array
            data[split]["feature"] = np.zeros_like(data[split]["target"])
    print(f"cached {args.train} train / {args.valid} validation rows in {time.time() - t0:.0f} s", flush=True)

    overrides = {}
    for item in args.set:
        key, value = item.split("=", 1)
        if not hasattr(kv, key):
            raise SystemExit(f"--set {item}: KVpopConfig has no field {key!r}")
        overrides[key] = {"true": True, "false": False}.get(value, value)
        for kind in (int, float):
            try:
                overrides[key] = kind(value)
                break
            except ValueError:
                pass
    fresh_kv = dataclasses.replace(kv, **overrides)
    L = config.num_hidden_layers
    for split in data.values():  # what each layer's fresh scorer reads, as the "k" and "v" halves of its x
        split["xk"], split["xv"] = scorer_inputs(split, args.inputs, config.vocab_size, config.rope_theta)
    head = KVpopHead(fresh_kv, config.num_key_value_heads, data["train"]["xk"].shape[-1], rope_theta=config.rope_theta)
    log_gamma = [decay_log_gamma(params[f"layers_{i}"]["self_attn"]["kvpop"]["decay_alpha"], gamma_min=kv.gamma_min,
                                 gamma_max=kv.gamma_max) for i in range(L)]

    tr = data["train"]
    if args.targets:
        mc = np.load(args.targets)
        if mc["ids"].shape != tr["ids"].shape or not np.array_equal(mc["ids"], tr["ids"]):
            raise SystemExit(f"--targets {args.targets}: its rows are not these {args.train} train rows")
        if int(mc["budget"]) != args.budget:
            raise SystemExit(f"--targets {args.targets}: made at --budget {int(mc['budget'])}, not {args.budget}")
        tr["mc_target"] = mc["target"].astype(np.float32)  # [N, L, H, S]
    fit_target = tr["mc_target"] if args.targets else tr["target"]
    k_tr, v_tr, r_tr = jnp.asarray(tr["xk"]), jnp.asarray(tr["xv"]), jnp.asarray(fit_target)
    wa_tr = jnp.asarray(tr["feature"])
    s = args.seq_len
    competing = (np.arange(s) >= kv.sinks) & (np.arange(s) <= s - 1 - kv.window)
    comp = jnp.asarray(competing, jnp.float32)

    H, D, w = config.num_key_value_heads, config.head_dim, kv.window
    offset = np.arange(s)[None, :] - np.arange(s)[:, None]  # j - t
    # the reader of token t sees j <= t + w: history j <= t without bias, the window j - t in 1..w with a
    # learned bias per offset (and per reader head)
    visible = jnp.asarray(offset <= w)
    window_slot = jnp.asarray(np.clip(offset, 0, w))  # 0: history (bias 0), 1..w: the window offsets

    def attn_init(key):
        ks = jax.random.split(key, 5)
        n = lambda k_, shape, fan: jax.random.normal(k_, shape) / np.sqrt(fan)  # noqa: E731
        return {"wq": n(ks[0], (H, 2 * D, args.heads, 32), 2 * D), "wk": n(ks[1], (H, 2 * D, args.heads, 32), 2 * D),
                "wv": n(ks[2], (H, 2 * D, args.heads, 32), 2 * D), "bias": jnp.zeros((H, args.heads, w + 1)),
                "w1": n(ks[3], (H, 2 * D + 32 * args.heads, args.hidden), 2 * D + 32 * args.heads),
                "b1": jnp.zeros((H, args.hidden)), "w2": jnp.zeros((H, args.hidden)), "b2": jnp.zeros((H,))}

    def attn_score(p, k, v):  # a delayed softmax-attention reader: [B, S, H, D] -> [B, H, S]
        x = jnp.concatenate([k, v], -1)
        q_, k_, v_ = (jnp.einsum("bshi,hirc->bhrsc", x, p[n]) for n in ("wq", "wk", "wv"))
        logits = jnp.einsum("bhrtc,bhrjc->bhrtj", q_, k_) / np.sqrt(32)
        logits = logits + jnp.where(window_slot > 0, p["bias"][..., window_slot], 0.0)[None]
        att = jax.nn.softmax(jnp.where(visible, logits, -1e30), -1)
        h = jnp.einsum("bhrtj,bhrjc->bhtrc", att, v_).reshape(*att.shape[:2], s, -1)
        xh = jnp.concatenate([jnp.moveaxis(x, 1, 2), h], -1)  # [x_u; readout]
        z = jax.nn.silu(jnp.einsum("bhti,hie->bhte", xh, p["w1"]) + p["b1"][:, None])
        return jnp.einsum("bhte,he->bht", z, p["w2"]) + p["b2"][:, None]

    pos_bin = jnp.asarray(np.arange(s) * max(args.pos_bins, 1) // s)

    def scorer_params(key):
        if args.model == "attn":
            ps = [attn_init(jax.random.fold_in(key, i)) for i in range(L)]
        else:
            ps = [head.init(jax.random.fold_in(key, i), k_tr[:1, i], v_tr[:1, i])["params"]["scorer"] for i in range(L)]
        return [{"scorer": p_, "pos": jnp.zeros((H, max(args.pos_bins, 1))),
                 "feature": jnp.zeros((H, max(args.window_attn, 1)))} for p_ in ps]

    def score(p_layer, k, v, wa):  # k, v [B, S, H, D], window attention [B, H, S] -> [B, H, S]
        if args.model == "attn":
            out = attn_score(p_layer["scorer"], k, v)
        else:
            out = head.apply({"params": {"scorer": p_layer["scorer"], "decay_alpha": jnp.zeros(H)}}, k, v,
                             method=KVpopHead.score)
        if args.window_attn:
            wa_bin = jnp.clip(((wa + 14.0) * args.window_attn / 14.0).astype(jnp.int32), 0, args.window_attn - 1)
            out = out + p_layer["feature"][jnp.arange(H)[:, None], wa_bin]  # [H, N] at [B, H, S]
        return out + (p_layer["pos"][:, pos_bin][None] if args.pos_bins else 0.0)

    def loss_fn(p, k, v, r, wa):
        total = 0.0
        for i in range(L):
            pred, tgt = score(p[i], k[:, i], v[:, i], wa[:, i]), r[:, i]
            if args.loss == "listwise":  # cross-entropy of softmax(pred) against softmax(target / tau)
                pt = jax.nn.softmax(jnp.where(comp > 0, tgt / args.tau, -jnp.inf), -1)
                lp = jax.nn.log_softmax(jnp.where(comp > 0, pred, -jnp.inf), -1)
                total = total - jnp.sum(jnp.where(comp > 0, pt * lp, 0.0), -1).mean()
            else:  # --regression_weight's loss
                total = total + regression_loss(pred, tgt, sinks=kv.sinks, window=kv.window)[0]
        return total / L

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adam(optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.1)))
    p = scorer_params(jax.random.key(args.seed))
    opt = tx.init(p)

    @jax.jit
    def step(p, opt, idx):
        loss, g = jax.value_and_grad(loss_fn)(p, k_tr[idx], v_tr[idx], r_tr[idx], wa_tr[idx])
        upd, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, upd), opt, loss

    va = data["validation"]
    n_seen = min(args.seen, args.train)  # train rows the recall is also reported on (what the fit has seen)
    seen = {key: tr[key][:n_seen]
            for key in ("xk", "xv", "teacher_ranks", "teacher_cutoffs", "q", "target", "feature")}
    if args.targets:
        seen["mc_target"] = tr["mc_target"][:n_seen]

    @functools.partial(jax.jit, static_argnums=1)
    def scores_of(p, name):
        split = {"validation": va, "train": seen}[name]
        return jnp.stack([score(p[i], jnp.asarray(split["xk"][:, i]), jnp.asarray(split["xv"][:, i]),
                                jnp.asarray(split["feature"][:, i]))
                          for i in range(L)])

    def policy_of(scores_LxBxHxS):
        return tuple(jnp.stack(a) for a in zip(*(sparse_policy(scores_LxBxHxS[i], log_gamma[i], kv)
                                                  for i in range(L))))

    def recall_of(scores_LxBxHxS, split=None, teacher=None):
        """Per layer and KV head, against the split's realized teacher or the policy of `teacher` scores."""
        split = va if split is None else split
        ranks, cut = policy_of(scores_LxBxHxS)
        if teacher is None:
            tr_, tc_ = (jnp.asarray(np.moveaxis(split[key], 1, 0)) for key in ("teacher_ranks", "teacher_cutoffs"))
        else:
            tr_, tc_ = policy_of(teacher)
        h, t = recall_counts(ranks, cut, tr_, tc_, jnp.asarray(split["q"]), sinks=kv.sinks, window=kv.window)
        rec = np.asarray(h).sum(1) / np.maximum(np.asarray(t).sum(1), 1)
        return rec

    shipped = [params[f"layers_{i}"]["self_attn"]["kvpop"]["scorer"] for i in range(L)]  # a check of the cache
    check = KVpopHead(kv, config.num_key_value_heads, config.head_dim, rope_theta=config.rope_theta)
    again = np.stack([np.asarray(check.apply({"params": {"scorer": shipped[i], "decay_alpha": jnp.zeros(2)}},
                                             jnp.asarray(va["k"][:, i]), jnp.asarray(va["v"][:, i]),
                                             method=KVpopHead.score)) for i in range(L)], 1)
    diff = np.abs(again - va["scores"]).max()
    print(f"the export's scorer on the cached inputs vs its forward: max |diff| {diff:.2e}")
    exp_rec = recall_of(jnp.asarray(np.moveaxis(va["scores"], 1, 0)))
    oracle = recall_of(jnp.asarray(np.moveaxis(va["target"], 1, 0)))
    print(f"export recall {exp_rec.mean():.3f} {np.round(exp_rec, 3).tolist()}; own target {oracle.mean():.3f}")
    if args.targets:
        mc_rec = recall_of(jnp.asarray(np.moveaxis(seen["mc_target"], 1, 0)), seen)
        print(f"the Monte-Carlo means on {n_seen} train rows (their ceiling): {mc_rec.mean():.3f} "
              f"{np.round(mc_rec, 3).tolist()}")
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    for i in range(args.steps + 1):
        if i % args.eval_every == 0:
            rec = recall_of(scores_of(p, "validation"))
            on_train = scores_of(p, "train")
            extra = f"; on {n_seen} train rows {recall_of(on_train, seen).mean():.3f}"
            if args.targets:
                mc_t = jnp.asarray(np.moveaxis(seen["mc_target"], 1, 0))
                extra += f", against the fitted means' own policy {recall_of(on_train, seen, mc_t).mean():.3f}"
            print(f"step {i:5d} ({time.time() - t0:5.0f} s): recall {rec.mean():.3f} {np.round(rec, 3).tolist()}"
                  + extra, flush=True)
        if i < args.steps:
            idx = jnp.asarray(rng.choice(args.train, args.batch, replace=False))
            p, opt, loss = step(p, opt, idx)
    if args.save:
        out = {"budget": args.budget, "log_gamma": np.stack([np.asarray(g) for g in log_gamma])}
        for name, split in (("train", seen), ("validation", va)):
            out[f"{name}_scores"] = np.moveaxis(np.asarray(scores_of(p, name)), 0, 1)  # [B, L, H, S]
            for key in ("teacher_ranks", "teacher_cutoffs", "q", "target", "mc_target"):
                if key in split:
                    out[f"{name}_{key}"] = split[key]
        out["train_ids"], out["validation_ids"] = tr["ids"][:n_seen], va["ids"]
        np.savez(args.save, **out)
        print(f"wrote {args.save}")


if __name__ == "__main__":
    main()
