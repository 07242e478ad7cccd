"""`python -m eval.main diagnose <what>`: why a retrofit does or does not keep the demo's facts.

Each diagnostic reads held-out demo problems (`demo/task.py`, test split) and prints one
small table; each takes under a minute on CPU but `ceiling` (about 5 minutes for 8 problems).

  keep    per layer / KV head: share of problems whose queried facts the trained policy keeps
          at the last prompt token, and the share its future-attention target's top-k holds
  target  the same for the target alone, under every target setting (aggregation, normalizer,
          count normalization), on one export
  read    the dense teacher's attention on each queried fact at the completion step that reads it
  maxtgt  mean vs max over future queries: does the target's top-k hold both facts (dense
          teacher, one head)?
  rank    per layer / KV head: AUC of the policy's ranking (and its target's) of the queried
          facts against every other binding value eligible at the last prompt token (1: the
          facts rank above all look-alikes, 0.5: chance)
  probe   is the keep cue visible in the cache a scorer reads? Per layer / KV head of the dense
          teacher: AUC of the facts against the other binding values for the best delayed feature
          a [k; v] scorer could compute by matching (max cosine of a token's key, or value, with
          those of the w tokens after it) next to the attention-free insertion-time baseline (0.5)
  shift   does a scorer read absolute position? Per export, the rank of each queried fact among the
          tokens eligible at the last prompt token in one layer / KV head (`--layer`, `--kv_head`),
          with the prompt's positions started at 0 and at each `--offsets`: the dense attention and
          every hidden state are the same under RoPE, only the keys' rotation moves, so a change
          comes from the scorer alone (`KVpopConfig.scorer_keys="unrotated"` cannot change)
  margin  how far the future-attention target puts the facts above the rest: per normalizer, in one
          layer / KV head of an export, the queried facts' log-target minus that of the 1st, 10th,
          30th, k-th and 200th other eligible token at the last prompt token (median over facts)
  reads   what the future-attention target rewards: per kind of eligible token (queried fact, other
          marked fact, binding value whose name recurs later, one whose name does not, newline,
          other) in one layer / KV head of the dense teacher at the last prompt token, the tokens per
          problem, how many the exact (dense-normalizer) target's top-k holds, their log-target
          (median, and 10th-90th percentile), and the median share of their future attention that comes from later occurrences of
          their name (the name token or the one after it: a lookup of that name)
  parks   where a name's lookup goes: per kind of name occurrence (binding, scratch restatement, keep
          mark, recall, question, completion) and per query head of one layer / KV head of the dense
          teacher, the mean attention on the first token (a sink), on the window (not counted by the
          target yet), on older digits and older other tokens, and the largest single older key. A
          binding's name has nothing to look up unless the name was bound before; what its query
          reads there, the future-attention target counts
  noise   how exactly must a scorer match its target for the teacher-retention recall (Fig. 7) to be
          high? Per export and per layer / KV head, at 64 sampled saturated queries of each problem's
          prompt: the export's own recall of its teacher's keep sets, next to the recall of the teacher
          against itself with Gaussian noise of each `--sigmas` (nats) added to its log-target: a
          scorer whose log-priorities are off by that much matches the teacher that well; then what the
          target follows per head: its spread, the share of its variance that token identity, the
          (previous, current) token pair and position explain, and how the scorer's priority correlates
  ceiling how much of the target can a scorer predict when a token leaves the window? Per export and
          per layer / KV head, at the saturated queries `noise` uses: the export's recall next to that of
          a policy ranking each token by its log-target averaged over `--futures` continuations of the
          prompt drawn from the task generator after each cut (`--cut_step` tokens apart; a cut sees
          up to cut_step - 1 tokens more than the scorer, and the generator keeps its plan unless `--replan`): the
          conditional mean a squared-error fit approaches, an estimate of the best a delayed scorer can do
  learn   can a scorer learn the cue at all? Trains a fresh scorer of the demo recipe's shape
          (`--scorer` mlstm or mlp, `--scorer_keys`, s, w of the flags) on one layer / KV head of the dense teacher
          with the answer given directly (`--labels told`: balanced logistic loss, marked facts 1 vs
          the other binding values 0), or by a squared-error fit of that head's exact
          future-attention target (`--labels target_values`: over the eligible binding values,
          `target_all`: over every eligible token; no labels) or a listwise cross-entropy against
          softmax(target / `--tau`) over the eligible tokens (`target_listwise`, top-heavy at small
          tau), or a balanced logistic loss on membership of the target's own top k = B - s - w
          (`target_topk`), on train-split problems; prints the AUC of the facts on validation
          problems as it goes, and how often the facts all make the scorer's top k (what a policy
          needs). A diagnosis, not a training method.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import shlex
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from demo.atoms import ASK, DIGITS, KEEP, NAMES, VOCAB
from demo.task import TASKS, example_seed, generate_dataset, generate_example, min_seq_len
from eval.bench_common import append_benchmarks, check_markdown_out
from eval.recall import policy_arrays, recall_counts, sample_saturated_queries
from kvpop_jax import load_pretrained
from kvpop_jax.checkpoint import check_checkpoint, checkpoint_tokenizer
from kvpop_jax.config import KVpopConfig
from kvpop_jax.kvpop import KVpopHead, kept_long_range, sparse_policy
from kvpop_jax.policy import ranks_from_priority, running_topk_cutoff, static_priority
from kvpop_jax.modeling import Qwen3ForCausalLM, dense_attention_probs, layer_qkv
from kvpop_jax.rope import unrotate
from kvpop_jax.scorers import make_scorer


def _problems(args):
    return generate_dataset(args.problems, args.seed, "test", task=args.task, seq_len=args.prompt_len)


def _needed(example) -> list[int]:
    """The queried facts' own value tokens (restatements aside: the facts are what must be kept)."""
    return [f["value_pos"] for f in example["meta"]["facts"] if f["queried"]]


def _kept_shares(config, params, tokenizer, problems):
    """Per [layer, KV head]: shares of problems whose queried facts are all kept by the policy / the
    target's top-k, and the target's per-fact share, at the last prompt token."""
    kv, model = config.kvpop, Qwen3ForCausalLM(config)
    shape = (config.num_hidden_layers, config.num_key_value_heads)
    policy_all, target_all, target_fact = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for ex in problems:
        ids = tokenizer(ex["text"])["input_ids"]
        q = jnp.asarray([[ex["meta"]["n_prompt_tokens"] - 1]])
        arr = policy_arrays(model, params, jnp.asarray([ids]), q)
        need = _needed(ex)
        for layer in range(config.num_hidden_layers):
            kept = lambda r, c: np.asarray(kept_long_range(r, c, q, sinks=kv.sinks, window=kv.window))[0, :, 0]  # noqa: E731
            mine = kept(arr["ranks"][layer], arr["cutoffs"][layer])
            target = kept(arr["teacher_ranks"][layer], arr["teacher_cutoffs"][layer])
            policy_all[layer] += mine[:, need].all(-1)
            target_all[layer] += target[:, need].all(-1)
            target_fact[layer] += target[:, need].mean(-1)
    n = len(problems)
    return policy_all / n, target_all / n, target_fact / n


def keep(args) -> None:
    for path in args.exports:
        config, params = load_pretrained(path)
        config = dataclasses.replace(config, kvpop=config.kvpop.retarget(args.budget, config.head_dim))
        policy_all, target_all, _ = _kept_shares(config, params, checkpoint_tokenizer(path), _problems(args))
        print(f"{path}: share of {args.problems} problems whose queried facts are all kept at the last prompt "
              "token, per [layer, kv head]:")
        print("  policy              :", policy_all.round(2).tolist())
        print("  target's top-k      :", target_all.round(2).tolist())


def target(args) -> None:
    config0, params = load_pretrained(args.exports[0])
    tokenizer, problems = checkpoint_tokenizer(args.exports[0]), _problems(args)
    print(f"{args.exports[0]} at B {args.budget}: per target setting, the share of {args.problems} {args.task} "
          "problems whose queried facts are all in the target's top-k at the last prompt token (all facts), and "
          "of the facts (per fact), per [layer, kv head]:")
    for aggregate in ("max", "mean"):
        for normalizer in ("sparse", "dense"):
            for count_normalize in (True, False):
                kv = dataclasses.replace(config0.kvpop.retarget(args.budget, config0.head_dim), aggregate=aggregate,
                                         normalizer=normalizer, count_normalize=count_normalize)
                _, target_all, target_fact = _kept_shares(dataclasses.replace(config0, kvpop=kv), params, tokenizer,
                                                          problems)
                print(aggregate, normalizer, "count_norm" if count_normalize else "sum", "all facts:",
                      target_all.round(2).tolist(), "per fact:", target_fact.round(2).tolist(), flush=True)


def read(args) -> None:
    config, params = load_pretrained(args.teacher)
    tokenizer = checkpoint_tokenizer(args.teacher)
    for ex in _problems(args):
        ids = tokenizer(ex["text"])["input_ids"]
        n = ex["meta"]["n_prompt_tokens"]
        toks = [tokenizer.decode([t]) for t in ids]
        facts = [f for f in ex["meta"]["facts"] if f["queried"]]
        print("completion:", repr("".join(toks[n:])), "facts at",
              [(f["value_pos"], toks[f["value_pos"] - 1] + toks[f["value_pos"]]) for f in facts])
        probs = [np.asarray(dense_attention_probs(config, params, jnp.asarray([ids]), layer))[0]
                 for layer in range(config.num_hidden_layers)]
        for f in facts:
            name = toks[f["value_pos"] - 1]
            reads = [i for i in range(n, len(ids) - 1) if toks[i] == name]  # the step that emits the digit next
            for qpos in reads[:1]:
                for layer, p in enumerate(probs):
                    row = p[:, qpos]
                    top = [(int(j), toks[j - 1] + toks[j], round(float(row[0, j]), 2)) for j in np.argsort(-row[0])[:3]]
                    print(f"  fact {name}{toks[f['value_pos']]} query {qpos} L{layer}: mass on the fact per head",
                          np.round(row[:, f["value_pos"]], 2).tolist(), "top of head 0:", top)


def maxtgt(args) -> None:
    config, params = load_pretrained(args.teacher)
    tokenizer = checkpoint_tokenizer(args.teacher)
    k = args.budget - args.sinks - args.window
    hits = {"mean": [], "max": []}
    for ex in _problems(args):
        ids = tokenizer(ex["text"])["input_ids"]
        s, q = len(ids), ex["meta"]["n_prompt_tokens"] - 1
        probs = group_probs(config, params, jnp.asarray([ids]), args.layer, args.kv_head)
        strongest = np.where(future_mask(s, args.window), probs[0], 0).max(1)
        eligible = np.arange(args.sinks, q - args.window + 1)
        for name, value in (("mean", exact_log_target(probs, args.window)[0]), ("max", strongest.max(0))):
            top = set(eligible[np.argsort(-value[eligible])[:k]])
            hits[name].append(all(x in top for x in _needed(ex)))
    print({name: float(np.mean(v)) for name, v in hits.items()},
          f"share of {args.problems} problems with every queried fact in the target's top-{k} "
          f"(layer {args.layer}, KV head {args.kv_head})")


def _fact_pairs(example, sinks: int, window: int) -> tuple[list[int], list[int]]:
    """(queried facts, other binding values) eligible at the last prompt token (s <= t <= last - w): what
    `rank` and `probe` compare. Either may be empty (a short prompt, a problem with one binding)."""
    last = example["meta"]["n_prompt_tokens"] - 1
    eligible = lambda p: sinks <= p <= last - window  # noqa: E731
    needed = [p for p in _needed(example) if eligible(p)]
    return needed, [p for p in example["meta"]["binding_value_positions"] if eligible(p) and p not in needed]


def _print_auc(lines: dict[str, np.ndarray], n: int, skipped: int) -> None:
    """Mean AUCs over the `n` problems that had pairs, and how many had none (their AUC is undefined: they
    printed nan, which averaged every other problem's away)."""
    if skipped:
        print(f"  ({skipped} problems skipped: no eligible queried fact or no other eligible binding value)")
    for name, value in lines.items():
        print(f"  {name:7s}:", (value / n).round(3).tolist() if n else "undefined (no problem had a pair)")


def _auc(ranks_H_S, needed, others) -> np.ndarray:
    """Per head: share of (needed, other) pairs where the needed token ranks better (lower)."""
    r = np.asarray(ranks_H_S)
    wins = r[:, needed][:, :, None] < r[:, others][:, None, :]
    return wins.mean(axis=(1, 2))


def rank(args) -> None:
    for path in args.exports:
        config, params = load_pretrained(path)
        kv = config.kvpop.retarget(args.budget, config.head_dim)
        model = Qwen3ForCausalLM(dataclasses.replace(config, kvpop=kv))
        tokenizer = checkpoint_tokenizer(path)
        shape = (config.num_hidden_layers, config.num_key_value_heads)
        policy_auc, target_auc, n, skipped = np.zeros(shape), np.zeros(shape), 0, 0
        for ex in _problems(args):
            needed, others = _fact_pairs(ex, kv.sinks, kv.window)
            if not needed or not others:
                skipped += 1
                continue
            ids = tokenizer(ex["text"])["input_ids"]
            last = ex["meta"]["n_prompt_tokens"] - 1
            arr = policy_arrays(model, params, jnp.asarray([ids]), jnp.asarray([[last]]))
            for layer in range(config.num_hidden_layers):
                policy_auc[layer] += _auc(arr["ranks"][layer][0], needed, others)
                target_auc[layer] += _auc(arr["teacher_ranks"][layer][0], needed, others)
            n += 1
        print(f"{path}: AUC of the queried facts against the other eligible binding values at the last prompt "
              f"token ({n} {args.task} problems), per [layer, kv head]:")
        _print_auc({"policy": policy_auc, "target": target_auc}, n, skipped)


def fact_ranks(config, params, ids, needed, layer: int, kv_head: int, offset: int = 0) -> list[int]:
    """How many tokens eligible at the last of `ids` outrank each of `needed` in the KVpop export's
    static priority (scorer + decay) of one layer / KV head, with the positions started at `offset`."""
    kv = config.kvpop
    _, k, v = layer_qkv(config, params, jnp.asarray([ids]), layer, offset)
    head = KVpopHead(kv, config.num_key_value_heads, config.head_dim, rope_theta=config.rope_theta)
    pos = jnp.arange(len(ids))[None] + offset
    scores, log_gamma = head.apply({"params": params[f"layers_{layer}"]["self_attn"]["kvpop"]}, k, v, pos)
    priority = np.asarray(static_priority(scores[0], log_gamma, pos))[kv_head]  # Eq. 20 at the shifted t
    t = np.arange(len(ids))
    eligible = (t >= kv.sinks) & (t <= len(ids) - 1 - kv.window)
    return [int(np.sum(eligible & (priority > priority[n]))) for n in needed]


def shift(args) -> None:
    offsets = list(dict.fromkeys([0, *args.offsets]))  # each once: a repeat was measured (and printed) again
    for path in args.exports:
        config, params = load_pretrained(path)
        tokenizer, k = checkpoint_tokenizer(path), config.kvpop.retarget(args.budget, config.head_dim).topk
        ranks = {o: [] for o in offsets}
        for ex in _problems(args):
            ids = tokenizer(ex["text"])["input_ids"][: ex["meta"]["n_prompt_tokens"]]
            for o in offsets:
                ranks[o] += fact_ranks(config, params, ids, _needed(ex), args.layer, args.kv_head, o)
        print(f"{path} ({config.kvpop.scorer_keys} keys): tokens outranking a queried fact at the last prompt token "
              f"(layer {args.layer}, KV head {args.kv_head}, {args.problems} {args.task} problems), prompt positions "
              f"starting at each offset: median, and share of facts within the k = {k} of B = {args.budget}")
        for o in offsets:
            r = np.asarray(ranks[o])
            print(f"  offset {o:5d}: median {np.median(r):6.1f}, within k {np.mean(r < k):.2f}", flush=True)


def noise_recall(config, params, ids_NxS: np.ndarray, sigmas: Sequence[float], seed: int, num_queries: int = 64,
                 older_first: float = 0.0, progress: bool = False):
    """(student, perturbed, position): recall [L, Hkv] of the export's keep sets against its
    teacher's; {sigma: recall [L, Hkv]} of the teacher's keep sets under log-target + sigma * N(0, 1)
    against the teacher's own; and, with `older_first` > 0, {"oldest first": ..., "export + older
    first": ...}: a policy that keeps the oldest tokens, and the export's priority minus
    `older_first` * t (nats per token; a probe of how much position explains, not a method). At
    `num_queries` saturated queries per row, sampled as `eval.recall.run_recall` samples them.
    `progress`: a bar over the rows on stderr (minutes for the default 24 prompts on CPU)."""
    kv, model = config.kvpop, Qwen3ForCausalLM(config)
    n, s = ids_NxS.shape
    q_idx = sample_saturated_queries(np.random.default_rng(seed), n, seq_len=s, budget=kv.budget, num=num_queries)
    noise_rng = np.random.default_rng(seed + 1)
    layers = range(config.num_hidden_layers)
    t = jnp.arange(s, dtype=jnp.float32)

    def policy(priorities):  # per layer [1, H, S] -> the running top-k's (ranks, cutoffs) [L, 1, H, S]
        ranks = [ranks_from_priority(p) for p in priorities]
        return jnp.stack(ranks), jnp.stack([running_topk_cutoff(r, sinks=kv.sinks, window=kv.window, topk=kv.topk)
                                            for r in ranks])

    hits, total = {}, 0
    for row in tqdm(range(n), desc="noise", unit="prompt", disable=not progress):
        q = jnp.asarray(q_idx[row: row + 1])
        arr = policy_arrays(model, params, jnp.asarray(ids_NxS[row: row + 1]), q)
        noisy = {(layer, sg): np.asarray(arr["target"][layer]) + sg * noise_rng.standard_normal(
            arr["target"][layer].shape).astype(np.float32) for layer in layers for sg in sigmas}  # log-target + noise
        candidates = {None: (arr["ranks"], arr["cutoffs"]),
                      **{sg: policy([static_priority(jnp.asarray(noisy[layer, sg]), arr["log_gamma"][layer])
                                     for layer in layers]) for sg in sigmas}}
        if older_first > 0:
            candidates["oldest first"] = policy([-jnp.broadcast_to(t, arr["scores"][layer].shape) for layer in layers])
            candidates["export + older first"] = policy([
                static_priority(arr["scores"][layer], arr["log_gamma"][layer]) - older_first * t for layer in layers])
        for name, (ranks, cutoffs) in candidates.items():
            h, tot = recall_counts(ranks, cutoffs, arr["teacher_ranks"], arr["teacher_cutoffs"], q,
                                   sinks=kv.sinks, window=kv.window)
            hits[name] = hits.get(name, 0) + np.asarray(h)[:, 0]
        total = total + np.asarray(tot)[:, 0]
    total = np.maximum(total, 1)
    probes = [k for k in hits if isinstance(k, str)]
    return hits[None] / total, {sg: hits[sg] / total for sg in sigmas}, {k: hits[k] / total for k in probes}


def _cuts(kv: KVpopConfig, s: int, *, futures: int, cut_step: int) -> list[int]:
    """Where `conditional_log_target` cuts a row of s tokens: every cut_step tokens after the first
    query that has a long-range token, and at the end. Checks the Monte-Carlo settings."""
    if futures < 1 or cut_step < 1:
        raise ValueError(f"futures and cut_step must be >= 1, got {futures} and {cut_step}")
    if s <= kv.sinks + kv.window:
        raise ValueError(f"a row of {s} tokens has none that leaves the window: need more than sinks + window = "
                         f"{kv.sinks + kv.window}")
    return sorted({min(c, s) for c in range(kv.sinks + kv.window + 1, s + cut_step, cut_step)})


FUTURES_PER_FORWARD = 8  # the forward's batch: its dense attention is [batch, Hq, S, S], so --futures 1000 ran out
# of memory in one batch; the default --futures 8 is one forward, as before


def conditional_log_target(config, params, ids_S: np.ndarray, draw, *, futures: int, cut_step: int,
                           q_idx_Q: np.ndarray | None = None, on_cut=None,
                           per_forward: int = FUTURES_PER_FORWARD) -> np.ndarray:
    """[L, 1, H, S]: each token's log-target averaged over `futures` drawn continuations of what came
    before it leaves the window (the conditional mean a squared-error scorer fits; see `ceiling_recall`).

    The row is cut every `cut_step` tokens; at cut c, `draw(c, j)` (j < futures) returns a row of the
    same length whose first c tokens are this row's (checked) and the rest a draw of the future; the
    export's target on each draw, averaged, scores the tokens that leave the window by query c - 1
    (t <= c - 1 - w). Tokens that never leave it keep 0. `q_idx_Q`: the saturated queries the forward
    samples (the target does not depend on them; default the last position). `on_cut()` is called
    after each cut. The draws go through the model `per_forward` at a time (memory is linear in it)."""
    kv, model = config.kvpop, Qwen3ForCausalLM(config)
    s = ids_S.shape[0]
    cuts = _cuts(kv, s, futures=futures, cut_step=cut_step)
    q = jnp.asarray(np.repeat(np.asarray([s - 1] if q_idx_Q is None else q_idx_Q, np.int32)[None], futures, 0))
    predicted = np.zeros((config.num_hidden_layers, 1, config.num_key_value_heads, s), np.float32)
    lo = 0
    for c in cuts:
        drawn = [np.asarray(draw(c, j), np.int32) for j in range(futures)]
        if any(d.shape != (s,) or not np.array_equal(d[:c], ids_S[:c]) for d in drawn):
            raise ValueError(f"draw(c={c}, j) must return {s} tokens starting with the row's first {c}")
        target = np.concatenate([
            np.asarray(policy_arrays(model, params, jnp.asarray(np.stack(drawn[i: i + per_forward])),
                                     q[i: i + per_forward])["target"])
            for i in range(0, futures, per_forward)], axis=1)  # [L, futures, H, S]
        hi = c - kv.window  # t + w <= c - 1: left the window by query c - 1
        predicted[..., lo:hi] = target[..., lo:hi].mean(1, keepdims=True)
        lo = max(lo, hi)
        if on_cut is not None:
            on_cut()
    return predicted


def ceiling_recall(config, params, ids_NxS: np.ndarray, draw, *, futures: int, cut_step: int, seed: int,
                   num_queries: int = 64, progress: bool = False):
    """(export, conditional): recall [L, Hkv] of the export's keep sets against its teacher's, and of a
    policy that ranks each token by the mean of its log-target over `futures` drawn continuations of
    what came before it: an estimate of the best recall a scorer that decides when the token leaves
    the window can reach (squared error fits that mean; it beats E[log r]'s rivals in practice).

    Each row is cut every `cut_step` tokens; at cut c, `draw(row, c, j)` (j < futures) returns a row
    of the same length whose first c tokens are this row's (checked) and the rest a draw of the future
    (`conditional_log_target`). Such a token's score sees up to cut_step - 1 tokens past its leave time,
    and the draws whatever the sampler keeps of the past (the demo generator keeps its plan unless
    asked to replan), both more than a scorer gets; the Monte-Carlo noise of a finite mean, less. At
    the same saturated queries as `noise_recall` and `eval.recall.run_recall` (seed)."""
    kv, model = config.kvpop, Qwen3ForCausalLM(config)
    n, s = ids_NxS.shape
    n_cuts = len(_cuts(kv, s, futures=futures, cut_step=cut_step))  # checks the settings before any work
    q_idx = sample_saturated_queries(np.random.default_rng(seed), n, seq_len=s, budget=kv.budget, num=num_queries)
    layers = range(config.num_hidden_layers)
    hits, total = {}, 0
    bar = tqdm(total=n * n_cuts, desc="ceiling", unit="cut", disable=not progress)
    for row in range(n):
        q = jnp.asarray(q_idx[row: row + 1])
        arr = policy_arrays(model, params, jnp.asarray(ids_NxS[row: row + 1]), q)
        try:
            predicted = conditional_log_target(config, params, ids_NxS[row], lambda c, j: draw(row, c, j),
                                               futures=futures, cut_step=cut_step, q_idx_Q=q_idx[row],
                                               on_cut=bar.update)
        except ValueError as e:
            raise ValueError(f"row {row}: {e}") from None
        conditional = [sparse_policy(jnp.asarray(predicted[layer]), arr["log_gamma"][layer], kv) for layer in layers]
        for name, (r, c) in (("export", (arr["ranks"], arr["cutoffs"])),
                             ("conditional", tuple(jnp.stack(a) for a in zip(*conditional)))):
            h, tot = recall_counts(r, c, arr["teacher_ranks"], arr["teacher_cutoffs"], q,
                                   sinks=kv.sinks, window=kv.window)
            hits[name] = hits.get(name, 0) + np.asarray(h)[:, 0]
        total = total + np.asarray(tot)[:, 0]
    bar.close()
    total = np.maximum(total, 1)
    return hits["export"] / total, hits["conditional"] / total


def explained_share(y: np.ndarray, groups: Sequence) -> float:
    """R^2 of predicting y by the mean of its group: 1 - var(y - group mean) / var(y)."""
    y = np.asarray(y, np.float64)
    keys = {}
    index = np.asarray([keys.setdefault(g, len(keys)) for g in groups])
    means = np.bincount(index, weights=y) / np.bincount(index)
    if np.var(y) == 0:
        return float("nan")  # nothing to explain
    return float(1.0 - np.var(y - means[index]) / np.var(y))


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho (ties get distinct ranks: the policies' ranks_from_priority breaks them too)."""
    rank = lambda x: np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64)  # noqa: E731
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


def target_structure(config, params, ids_NxS: np.ndarray, min_future: int = 64) -> list[dict]:
    """Per (layer, KV head), over the tokens t with at least `min_future` queries after the window
    (s <= t < S - w - min_future): the log-target's standard deviation (nats), the share of its variance
    explained by the token's id, by (previous id, id), by its position (bins of 64) and by (id, bin of
    128); the rank correlation of the scorer's static priority with the teacher's (the target's under the
    same decay: what the two policies rank by), and the correlation of the position t with the target."""
    kv, model = config.kvpop, Qwen3ForCausalLM(config)
    n, s = ids_NxS.shape
    lo, hi = max(kv.sinks, 1), s - kv.window - min_future + 1  # t has S - t - w queries q >= t + w
    if hi <= lo:
        raise ValueError(f"prompts of {s} tokens leave no token with {min_future} future queries past the window")
    tgt, pri, t_pri = [], [], []
    for row in range(n):
        arr = policy_arrays(model, params, jnp.asarray(ids_NxS[row: row + 1]), jnp.asarray([[s - 1]]))
        tgt.append(np.asarray(arr["target"])[:, 0])  # [L, H, S]
        priority = lambda x: np.stack([np.asarray(static_priority(x[layer], arr["log_gamma"][layer]))[0]  # noqa: E731
                                       for layer in range(config.num_hidden_layers)])
        pri.append(priority(arr["scores"]))
        t_pri.append(priority(arr["target"]))
    tgt, pri, t_pri = (np.stack(a, 1)[..., lo:hi] for a in (tgt, pri, t_pri))  # [L, N, H, T]
    token = ids_NxS[:, lo:hi].ravel()
    pair = list(zip(ids_NxS[:, lo - 1: hi - 1].ravel(), token))
    pos = np.broadcast_to(np.arange(lo, hi), (n, hi - lo)).ravel()
    rows = []
    for layer in range(config.num_hidden_layers):
        for h in range(config.num_key_value_heads):
            y = tgt[layer, :, h].ravel()
            rows.append(dict(layer=layer, kv_head=h, sd=float(y.std()), token=explained_share(y, token),
                             pair=explained_share(y, pair), position=explained_share(y, pos // 64),
                             token_position=explained_share(y, list(zip(token, pos // 128))),
                             corr=rank_correlation(pri[layer, :, h].ravel(), t_pri[layer, :, h].ravel()),
                             corr_position=float(np.corrcoef(pos, y)[0, 1])))
    return rows


def noise(args) -> None:
    for path in args.exports:
        config, params = load_pretrained(path)
        config = dataclasses.replace(config, kvpop=config.kvpop.retarget(args.budget, config.head_dim))
        tokenizer = checkpoint_tokenizer(path)
        ids = np.asarray([tokenizer(ex["text"])["input_ids"][: args.prompt_len] for ex in _problems(args)], np.int32)
        student, perturbed, position = noise_recall(config, params, ids, args.sigmas, args.seed,
                                                    older_first=args.older_first, progress=True)
        queries = min(64, ids.shape[1] - config.kvpop.budget)
        print(f"{path}: teacher-retention recall per [layer, kv head] at B {args.budget} (k {config.kvpop.topk}), "
              f"{args.problems} {args.task} prompts, {queries} saturated queries each")
        print(f"  the export           : {student.round(3).tolist()}  mean {student.mean():.3f}")
        for sg, r in perturbed.items():
            print(f"  teacher + N(0, {sg:4g}^2): {r.round(3).tolist()}  mean {r.mean():.3f}", flush=True)
        for name, r in position.items():
            label = name if name == "oldest first" else f"export - {args.older_first:g} * t"
            print(f"  {label:21s}: {r.round(3).tolist()}  mean {r.mean():.3f}", flush=True)
        print("  what the log-target follows (tokens with >= 64 later queries): its sd, the share of its variance "
              "explained by token id / (previous id, id) / position (bins of 64) / (id, position bin of 128), and "
              "the rank correlation of the scorer's priority with the teacher's, and the correlation of t with it")
        for r in target_structure(config, params, ids):
            print(f"    layer {r['layer']} kv head {r['kv_head']}: sd {r['sd']:.2f}, R2 id {r['token']:.2f}, "
                  f"pair {r['pair']:.2f}, position {r['position']:.2f}, id+position {r['token_position']:.2f}; "
                  f"rank corr(priority, teacher's) {r['corr']:.2f}, corr(t, target) {r['corr_position']:.2f}",
                  flush=True)


def ceiling(args) -> None:
    for path in args.exports:
        config, params = load_pretrained(path)
        config = dataclasses.replace(config, kvpop=config.kvpop.retarget(args.budget, config.head_dim))
        tokenizer = checkpoint_tokenizer(path)
        ids = np.asarray([tokenizer(ex["text"])["input_ids"][: args.prompt_len] for ex in _problems(args)], np.int32)

        def draw(row: int, c: int, j: int) -> list[int]:  # problem `row` up to token c, then a fresh future
            future_seed = int(np.random.SeedSequence([args.seed, row, c, j]).generate_state(1)[0])
            ex = generate_example(example_seed(args.seed, "test", row), task=args.task, seq_len=args.prompt_len,
                                  resample=(c, future_seed), replan=args.replan)
            return tokenizer(ex["text"])["input_ids"][: args.prompt_len]

        export, conditional = ceiling_recall(config, params, ids, draw, futures=args.futures,
                                             cut_step=args.cut_step, seed=args.seed, progress=True)
        queries = min(64, ids.shape[1] - config.kvpop.budget)
        print(f"{path}: teacher-retention recall per [layer, kv head] at B {args.budget} (k {config.kvpop.topk}), "
              f"{args.problems} {args.task} prompts, {queries} saturated queries each")
        print(f"  the export                              : {export.round(3).tolist()}  mean {export.mean():.3f}")
        print(f"  mean log-target over {args.futures:3d} drawn futures: {conditional.round(3).tolist()}  "
              f"mean {conditional.mean():.3f}  (cut every {args.cut_step} tokens; "
              f"{'plan redrawn where the prefix does not show it' if args.replan else 'the plan kept'})", flush=True)


def margin(args) -> None:
    config0, params = load_pretrained(args.exports[0])
    tokenizer, problems = checkpoint_tokenizer(args.exports[0]), _problems(args)
    kv0 = config0.kvpop.retarget(args.budget, config0.head_dim)
    nth = [1, 10, 30, kv0.topk, 200]
    for normalizer in ("sparse", "dense"):
        config = dataclasses.replace(config0, kvpop=dataclasses.replace(kv0, normalizer=normalizer))
        model, gaps = Qwen3ForCausalLM(config), []
        for ex in problems:
            ids = tokenizer(ex["text"])["input_ids"]
            last = ex["meta"]["n_prompt_tokens"] - 1
            arr = policy_arrays(model, params, jnp.asarray([ids]), jnp.asarray([[last]]))
            target = np.asarray(arr["target"])[args.layer, 0, args.kv_head]
            t = np.arange(len(ids))
            facts = [f["value_pos"] for f in ex["meta"]["facts"]]  # queried or not: not "others"
            others = np.sort(target[(t >= kv0.sinks) & (t <= last - kv0.window) & ~np.isin(t, facts)])[::-1]
            if not len(others):
                continue  # nothing else eligible to compare with (prompt within the budget)
            gaps += [[target[n] - others[min(i, len(others)) - 1] for i in nth] for n in _needed(ex)]
        print(f"{normalizer:6s} target, layer {args.layer} KV head {args.kv_head} of {args.exports[0]} at B {args.budget}: "
              f"queried fact's log-target minus the {', '.join(map(str, nth))}-th other eligible token "
              f"(median over {len(gaps)} facts):", [round(float(x), 2) + 0.0 for x in np.median(gaps, 0)], flush=True)


KINDS = ("queried fact", "other marked fact", "binding value, name recurs", "binding value, name does not",
         "newline", "other")


def token_kinds(example, tokens: list[str], sinks: int, window: int) -> dict[str, list[int]]:
    """The positions eligible at the last prompt token (s <= t <= last - w), by kind (`KINDS`).
    A binding value's name is the token before it; it recurs if that token appears again later in
    the prompt."""
    last = example["meta"]["n_prompt_tokens"] - 1
    facts = {f["value_pos"]: f["queried"] for f in example["meta"]["facts"]}
    values = set(example["meta"]["binding_value_positions"])
    kinds = {kind: [] for kind in KINDS}
    for t in range(sinks, last - window + 1):
        if t in facts:
            kind = KINDS[0] if facts[t] else KINDS[1]
        elif t in values:
            kind = KINDS[2] if tokens[t - 1] in tokens[t + 1: last + 1] else KINDS[3]
        else:
            kind = KINDS[4] if tokens[t] == "\n" else KINDS[5]
        kinds[kind].append(t)
    return kinds


def name_read_share(probs_H_S_S, tokens: list[str], t: int, window: int) -> float:
    """Share of token t's future attention (queries d >= t + w, summed over the heads) that comes from
    queries at a later occurrence of the name bound before it (the name token, or the token after it)."""
    s = len(tokens)
    mass = np.asarray(probs_H_S_S)[:, t + window:s, t].sum(0)  # [d - t - w]
    name = tokens[t - 1]
    at_name = np.array([tokens[d] == name or tokens[d - 1] == name for d in range(t + window, s)])
    return float(mass[at_name].sum() / max(mass.sum(), 1e-30))


def reads(args) -> None:
    config, params = load_pretrained(args.teacher)
    tokenizer = checkpoint_tokenizer(args.teacher)
    k = args.budget - args.sinks - args.window
    table = {kind: {"n": 0, "top": 0, "target": [], "share": []} for kind in KINDS}
    problems = _problems(args)
    for ex in problems:
        ids = tokenizer(ex["text"])["input_ids"][: ex["meta"]["n_prompt_tokens"]]
        tokens = [tokenizer.decode([i]) for i in ids]
        probs = group_probs(config, params, jnp.asarray([ids]), args.layer, args.kv_head)
        log_target = exact_log_target(probs, args.window)[0]
        probs = probs[0]
        kinds = token_kinds(ex, tokens, args.sinks, args.window)
        eligible = np.concatenate([np.asarray(v, int) for v in kinds.values()])
        top = set(eligible[np.argsort(-log_target[eligible])[:k]].tolist())
        for kind, positions in kinds.items():
            row = table[kind]
            row["n"] += len(positions)
            row["top"] += sum(t in top for t in positions)
            row["target"] += log_target[positions].tolist()
            if kind in KINDS[:4]:
                row["share"] += [name_read_share(probs, tokens, t, args.window) for t in positions]
    n = len(problems)
    print(f"{args.teacher}, layer {args.layer} KV head {args.kv_head}, {n} {args.task} problems, last prompt token: "
          f"eligible tokens by kind, the exact target's top-{k} (B {args.budget}), and the share of their future "
          "attention from later lookups of their own name")
    print(f"  {'kind':30s} {'per problem':>11s} {'in top-k':>8s} {'log-target: median [p10, p90]':>30s} "
          f"{'from name':>9s}")
    for kind, row in table.items():
        share = f"{np.median(row['share']):9.2f}" if row["share"] else f"{'-':>9s}"
        spread = (f"{np.median(row['target']):8.2f} [{np.percentile(row['target'], 10):6.2f}, "
                  f"{np.percentile(row['target'], 90):6.2f}]") if row["target"] else "-"
        print(f"  {kind:30s} {row['n'] / n:11.1f} {row['top'] / n:8.1f} {spread:>30s} {share}", flush=True)


def probe(args) -> None:
    config, params = load_pretrained(args.teacher)
    tokenizer = checkpoint_tokenizer(args.teacher)
    w = args.window
    shape = (config.num_hidden_layers, config.num_key_value_heads)
    auc = {"key": np.zeros(shape), "value": np.zeros(shape)}
    n, skipped = 0, 0
    for ex in _problems(args):
        needed, others = _fact_pairs(ex, args.sinks, w)
        if not needed or not others:
            skipped += 1
            continue
        n += 1
        ids = tokenizer(ex["text"])["input_ids"]
        cand = np.asarray(needed + others)
        for layer in range(config.num_hidden_layers):
            k, v = (np.asarray(x[0]) for x in layer_qkv(config, params, jnp.asarray([ids]), layer)[1:])  # [S, Hkv, D]
            for name, x in (("key", k), ("value", v)):
                x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-9)
                later = np.stack([x[t + 1: t + w + 1] for t in cand])  # [C, w, Hkv, D]
                feature = np.einsum("chd,cjhd->chj", x[cand], later).max(-1)  # [C, Hkv]
                for h in range(config.num_key_value_heads):
                    auc[name][layer, h] += _auc(-feature[None, :, h], list(range(len(needed))),
                                                list(range(len(needed), len(cand))))[0]
    print(f"{args.teacher}: AUC of the queried facts against the other eligible binding values for the max cosine "
          f"of a token's cached key / value with the {w} tokens after it ({n} {args.task} problems), "
          "per [layer, kv head]:")
    _print_auc(auc, n, skipped)


def group_probs(config, params, ids_BxS, layer: int, kv_head: int) -> np.ndarray:
    """Dense attention weights of the query heads sharing one KV head: float [B, G, S, S]."""
    g = config.num_attention_heads // config.num_key_value_heads
    return np.asarray(dense_attention_probs(config, params, ids_BxS, layer))[:, kv_head * g:(kv_head + 1) * g]


def future_mask(s: int, window: int) -> np.ndarray:
    """bool [d, t]: query d counts in key t's future attention (d >= t + w, Eq. 2)."""
    return np.arange(s)[:, None] >= np.arange(s)[None] + window


def exact_log_target(probs_BxGxSxS: np.ndarray, window: int) -> np.ndarray:
    """The future-attention target of one KV head with the exact (dense) normalizer, float [B, S]:
    log of the max over its query heads of the mean attention from queries d >= t + w (Eqs. 2-3
    with count normalization, no decay, eps 1e-30)."""
    s = probs_BxGxSxS.shape[-1]
    count = np.maximum(1, s - (np.arange(s) + window))  # N_t
    mean = np.where(future_mask(s, window), probs_BxGxSxS, 0).sum(2) / count  # [B, G, t]
    return np.log(mean.max(1) + 1e-30)


def _learn_data(config, params, tokenizer, problems, layer: int, kv_head: int, sinks: int, window: int,
                unrotated: bool = False, with_target: bool = True, progress: str | None = None):
    """k, v [N, S, 1, D] of one KV head (k with its RoPE undone when `unrotated`), labels y (marked
    facts), candidates m (binding values eligible at the last prompt token), eligible e (every token
    eligible there) and the exact log-target r of that head (zeros unless `with_target`), each [N, S].
    `progress`: a bar of that name over the problems on stderr (minutes for `learn`'s default 36 on CPU)."""
    ks, vs, ys, ms, es, rs = [], [], [], [], [], []
    for ex in tqdm(problems, desc=progress, unit="problem", disable=progress is None):
        ids = tokenizer(ex["text"])["input_ids"][: ex["meta"]["n_prompt_tokens"]]
        _, k, v = layer_qkv(config, params, jnp.asarray([ids]), layer)
        if unrotated:
            k = unrotate(k, jnp.arange(len(ids))[None], config.rope_theta)
        last = len(ids) - 1
        y, m, e = (np.zeros(len(ids), np.float32) for _ in range(3))
        m[[p for p in ex["meta"]["binding_value_positions"] if sinks <= p <= last - window]] = 1
        e[sinks:last - window + 1] = 1
        y[[f["value_pos"] for f in ex["meta"]["facts"]]] = 1
        ks.append(k[0, :, kv_head:kv_head + 1]), vs.append(v[0, :, kv_head:kv_head + 1])
        ys.append(y), ms.append(np.maximum(m, y)), es.append(e)
        rs.append(exact_log_target(group_probs(config, params, jnp.asarray([ids]), layer, kv_head), window)[0]
                  if with_target else np.zeros(len(ids), np.float32))
    return (jnp.stack(ks), jnp.stack(vs), jnp.asarray(np.stack(ys)), jnp.asarray(np.stack(ms)),
            jnp.asarray(np.stack(es)), jnp.asarray(np.stack(rs), jnp.float32))


def target_topk_labels(r, e, topk: int):
    """1 where an eligible token (e > 0) is among the `topk` largest exact log-targets r of its row
    (ties at the k-th value count in), else 0; r, e [N, S]. The labels of `learn --labels target_topk`."""
    kth = jnp.sort(jnp.where(e > 0, r, -jnp.inf), -1)[:, -topk][:, None]
    return ((r >= kth) & (e > 0)).astype(jnp.float32)


def facts_in_topk(scores, y, m, e, topk: int) -> tuple[float, float, float]:
    """Over rows of scores [N, S] with the marked facts y, the binding values m (facts included) and
    the eligible tokens e: the share of rows whose facts all score within the top `topk` eligible
    tokens (ties count in), and the medians of how many other binding values and how many other
    eligible tokens score above the row's lowest fact."""
    scores, y, m, e = (np.asarray(a) for a in (scores, y, m, e))
    y, m, e = y > 0, m > 0, e > 0
    kept, values, others = [], [], []
    for s_, y_, m_, e_ in zip(scores, y, m, e):
        low = s_[y_].min()
        kept.append(bool(np.all(s_[y_] >= np.sort(s_[e_])[-topk])))
        values.append(int(np.sum(s_[e_ & m_ & ~y_] > low)))
        others.append(int(np.sum(s_[e_ & ~m_] > low)))
    return float(np.mean(kept)), float(np.median(values)), float(np.median(others))


def learn(args) -> dict[str, list]:
    """Prints the AUC lines; returns {"loss": the loss of every step, "auc": (step, train, validation),
    "kept": (split, share of problems with every fact in the scorer's top k, binding values and other
    tokens above the lowest fact, medians), at each AUC line}."""
    if args.labels == "target_listwise" and not args.tau > 0:
        raise ValueError(f"--tau must be > 0, got {args.tau}")
    config, params = load_pretrained(args.teacher)
    tokenizer = checkpoint_tokenizer(args.teacher)
    data = {split: _learn_data(config, params, tokenizer,
                               generate_dataset(n, args.seed, split, task=args.task, seq_len=args.prompt_len),
                               args.layer, args.kv_head, args.sinks, args.window, args.scorer_keys == "unrotated",
                               with_target=args.labels != "told", progress=f"learn: {split} problems")
            for split, n in (("train", args.problems), ("validation", max(8, args.problems // 2)))}
    kv = KVpopConfig(sinks=args.sinks, window=args.window, topk=args.budget - args.sinks - args.window,
                     scorer=args.scorer)
    scorer = make_scorer(kv, 1, config.head_dim)
    k_tr, v_tr, y_tr, m_tr, e_tr, r_tr = data["train"]
    weights = scorer.init(jax.random.key(args.seed), k_tr[:1], v_tr[:1])
    tx = optax.adam(1e-2)
    opt = tx.init(weights)

    def loss_fn(w, k, v, y, m, e, r):
        logits = scorer.apply(w, k, v)[:, 0]
        if args.labels == "told":
            balance = jnp.where(y > 0, 0.5 / jnp.maximum(y.sum(), 1), 0.5 / jnp.maximum((m - y).sum(), 1)) * m
            return jnp.sum(balance * optax.sigmoid_binary_cross_entropy(logits, y))
        if args.labels == "target_topk":  # balanced logistic: in the exact target's own top-k of the eligible, or not
            t = target_topk_labels(r, e, args.label_k or kv.topk)
            balance = jnp.where(t > 0, 0.5 / jnp.maximum(t.sum(), 1), 0.5 / jnp.maximum((e - t).sum(), 1)) * e
            return jnp.sum(balance * optax.sigmoid_binary_cross_entropy(logits, t))
        if args.labels == "target_listwise":  # cross-entropy of softmax(score) against softmax(r / tau)
            p = jax.nn.softmax(jnp.where(e > 0, r / args.tau, -jnp.inf), -1)
            return -jnp.sum(p * jax.nn.log_softmax(jnp.where(e > 0, logits, -jnp.inf), -1).clip(-1e9)) / len(r)
        over = m if args.labels == "target_values" else e  # regress the exact log-target, unweighted
        return jnp.sum(over * (logits - r) ** 2) / jnp.maximum(over.sum(), 1)

    @jax.jit
    def step(w, opt, i):
        idx = (jnp.arange(8) + 8 * i) % k_tr.shape[0]
        loss, g = jax.value_and_grad(loss_fn)(w, k_tr[idx], v_tr[idx], y_tr[idx], m_tr[idx], e_tr[idx], r_tr[idx])
        updates, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, updates), opt, loss

    def auc(w, split) -> float:  # ties count 1/2 (a fresh mLSTM scores every token alike)
        k, v, y, m = data[split][:4]
        scores, y, m = np.asarray(scorer.apply(w, k, v))[:, 0], np.asarray(y) > 0, np.asarray(m) > 0
        per = []
        for s_, y_, m_ in zip(scores, y, m):
            diff = s_[y_][:, None] - s_[m_ & ~y_][None, :]
            per.append(np.mean((diff > 0) + 0.5 * (diff == 0)))
        kept, values, others = facts_in_topk(scores, y, m, data[split][4], kv.topk)
        history["kept"].append((split, kept, values, others))
        print(f"    {split}: facts all in the scorer's top {kv.topk} in {kept:.2f} of problems; above the lowest "
              f"fact, median: {values:g} binding values, {others:g} other tokens")
        return float(np.mean(per))

    taught = {"told": "told which binding values are marked",
              "target_values": "regressing the exact log-target of the eligible binding values",
              "target_all": "regressing the exact log-target of every eligible token",
              "target_topk": f"balanced logistic on membership of the exact target's top {args.label_k or kv.topk}",
              "target_listwise": f"listwise cross-entropy against softmax(exact log-target / {args.tau})"}[args.labels]
    print(f"{args.scorer} scorer ({args.scorer_keys} keys) on layer {args.layer}, KV head {args.kv_head} of "
          f"{args.teacher}, {taught} ({args.task}, {args.problems} train problems): AUC of the marked facts "
          "against the other eligible binding values")
    history = {"loss": [], "auc": [], "kept": []}
    for i in range(args.steps + 1):
        if i % max(1, args.steps // 4) == 0:
            history["auc"].append((i, auc(weights, "train"), auc(weights, "validation")))
            print(f"  step {i:4d}: train {history['auc'][-1][1]:.3f}, validation {history['auc'][-1][2]:.3f}",
                  flush=True)
        if i < args.steps:
            weights, opt, loss = step(weights, opt, i)
            history["loss"].append(float(loss))
    return history


NAME_KINDS = ("binding", "scratch restatement", "keep mark", "recall", "question", "completion")


def name_kind(tokens: Sequence[str], d: int, n_prompt: int) -> str | None:
    """What the name at position d of a demo text does (`NAME_KINDS`), None if it is not a name.
    A binding's name is followed by its digit; a scratch line restates `>name digit`; a recall line is
    `>name digit` alone on its line; `keep name` marks a fact; `ask a+b` asks; the completion looks names up."""
    if tokens[d] not in NAMES:
        return None
    if d >= n_prompt:
        return "completion"
    prev, before = tokens[d - 1], tokens[d - 2] if d >= 2 else ""
    nxt = tokens[d + 1] if d + 1 < len(tokens) else ""
    if prev == ">":  # a lookup: a recall line `>q4` ends after its digit, a scratch line goes on `>q4+3=7`
        after = tokens[d + 2] if d + 2 < len(tokens) else ""
        return "recall" if after == "\n" else "scratch restatement"
    if prev == " " and before == KEEP:
        return "keep mark"
    if prev == "+" or (prev == " " and before == ASK):
        return "question"
    return "binding" if nxt in DIGITS else None


def park_shares(probs_SxS: np.ndarray, is_digit_S: np.ndarray, d: int, window: int) -> np.ndarray:
    """Where query d's attention goes, float [5]: the first token, the window (keys t > d - w, which
    the future-attention target does not count yet), digits (`is_digit_S`, bool per position) and other
    tokens older than that (1 <= t <= d - w), and the largest single older key."""
    row = probs_SxS[d, : d + 1]
    cut = max(1, d - window + 1)  # the first key inside the window
    old = np.arange(1, cut)
    digit = is_digit_S[old]
    return np.asarray([row[0], row[cut:].sum(), row[old[digit]].sum(), row[old[~digit]].sum(),
                       row[old].max() if len(old) else 0.0])


def parks(args) -> None:
    config, params = load_pretrained(args.teacher)
    tokenizer = checkpoint_tokenizer(args.teacher)
    g = config.num_attention_heads // config.num_key_value_heads
    sums = {(kind, h): np.zeros(5) for kind in NAME_KINDS for h in range(g)}
    counts = dict.fromkeys(NAME_KINDS, 0)
    for ex in _problems(args):
        ids = tokenizer(ex["text"])["input_ids"]
        tokens = [tokenizer.decode([i]) for i in ids]
        probs = group_probs(config, params, jnp.asarray([ids]), args.layer, args.kv_head)[0]  # [G, S, S]
        is_digit = np.isin(tokens, DIGITS)  # once per problem, not per query and head
        for d in range(1, len(ids)):
            kind = name_kind(tokens, d, ex["meta"]["n_prompt_tokens"])
            if kind is None:
                continue
            counts[kind] += 1
            for h in range(g):
                sums[kind, h] += park_shares(probs[h], is_digit, d, args.window)
    print(f"{args.teacher}, layer {args.layer} KV head {args.kv_head}, {args.problems} {args.task} problems: where "
          f"the attention of a name goes, by what the name does (mean over its occurrences; w {args.window})")
    print(f"  {'name':20s} {'per problem':>11s} {'head':>4s} {'first token':>11s} {'window':>6s} "
          f"{'older digits':>12s} {'older other':>11s} {'largest older':>13s}")
    for kind in NAME_KINDS:
        for h in range(g):
            if counts[kind]:
                m = sums[kind, h] / counts[kind]
                print(f"  {kind:20s} {counts[kind] / args.problems:11.1f} {h:4d} {m[0]:11.3f} {m[1]:6.3f} {m[2]:12.3f} "
                      f"{m[3]:11.3f} {m[4]:13.3f}")


DIAGNOSTICS = {"keep": keep, "target": target, "read": read, "maxtgt": maxtgt, "rank": rank, "probe": probe,
               "learn": learn, "shift": shift, "margin": margin, "reads": reads, "parks": parks, "noise": noise,
               "ceiling": ceiling}


TEACHER_DIAGNOSTICS = ("read", "maxtgt", "probe", "learn", "reads", "parks")  # the rest read --exports
# The export diagnostics whose numbers are about the keep set at --budget (shift's ranks are not: it stays free)
BUDGET_DIAGNOSTICS = ("keep", "target", "margin", "noise", "ceiling")
OWN_POLICY_DIAGNOSTICS = ("maxtgt", "learn", "reads", "probe")  # eligible tokens s <= t <= last - w (parks: below)


def check_args(args) -> None:
    """Bad values refused by name before anything loads: counts, the budget against s + w, and
    --layer / --kv_head against the models' config.json (an export for the export diagnostics)."""
    if args.out:  # before a diagnostic of minutes, not after it
        check_markdown_out(args.out, "--out")
    for name, low in (("problems", 1), ("steps", 0), ("sinks", 0), ("window", 0), ("seed", 0), ("futures", 1),
                      ("cut_step", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    shortest = min_seq_len(args.task)
    if args.prompt_len < shortest:
        raise ValueError(f"--prompt_len {args.prompt_len} is too short for {args.task}: the shortest is {shortest}")
    if not 0 <= args.older_first < float("inf"):
        raise ValueError(f"--older_first must be finite and >= 0 (nats per token), got {args.older_first}")
    if any(not 0 <= sg < float("inf") for sg in args.sigmas):
        raise ValueError(f"--sigmas must be finite and >= 0 (noise in nats), got {args.sigmas}")
    if any(o < 0 for o in args.offsets):
        raise ValueError(f"--offsets must be >= 0 (prompt positions start there), got {args.offsets}")
    top = 2**31 - args.prompt_len  # positions are int32: past it they wrapped (or an OverflowError traceback)
    if any(o > top for o in args.offsets):
        raise ValueError(f"--offsets {max(args.offsets)} puts the last of a {args.prompt_len}-token prompt past the "
                         f"int32 positions (2**31 - 1); want offsets <= {top}")
    uses_teacher = args.what in TEACHER_DIAGNOSTICS
    if args.what in OWN_POLICY_DIAGNOSTICS:  # a prompt is --prompt_len tokens; s <= t <= last - w are eligible
        eligible = args.prompt_len - args.sinks - args.window
        if eligible < 1:
            raise ValueError(f"--sinks {args.sinks} + --window {args.window} leave no token eligible at the last of a "
                             f"{args.prompt_len}-token prompt (--prompt_len): want s + w < {args.prompt_len}")
        if args.what == "probe" and args.window < 1:
            raise ValueError("--window 0 leaves probe nothing to match: it compares a token's key / value with the w "
                             "tokens after it; want --window >= 1")
        if args.what == "learn" and args.budget - args.sinks - args.window > eligible:
            raise ValueError(f"--budget {args.budget} exceeds the {args.prompt_len}-token prompt: learn counts the "
                             f"facts in the scorer's top k = B - s - w of the {eligible} eligible tokens; want B <= "
                             "--prompt_len")
        if args.what in ("maxtgt", "reads") and args.budget >= args.prompt_len:
            raise ValueError(f"--budget {args.budget} keeps every token of a {args.prompt_len}-token prompt "
                             f"(--prompt_len): nothing would be evicted; want B < {args.prompt_len}")
        if args.what == "learn" and not 0 <= args.label_k <= eligible:
            raise ValueError(f"--label_k {args.label_k} is out of range: the target's top k among the {eligible} "
                             f"eligible tokens of a {args.prompt_len}-token prompt; want 0 (k = B - s - w) to "
                             f"{eligible}")
    if args.what in ("maxtgt", "reads", "learn") and args.budget - args.sinks - args.window < 1:
        raise ValueError(f"--budget {args.budget} leaves no long-range slot: {args.what} measures k = B - s - w = "
                         f"{args.budget} - {args.sinks} - {args.window}, which must be >= 1")
    paths = [args.teacher] if uses_teacher else args.exports
    if args.what == "parks" and args.window >= args.prompt_len:  # every key in the window: all 'window', 1.000
        raise ValueError(f"--window {args.window} covers the whole {args.prompt_len}-token prompt: parks splits "
                         f"attention into the window and older keys; want --window < {args.prompt_len}")
    if args.what in ("target", "margin") and len(paths) > 1:  # they read one export
        print(f"warning: diagnose {args.what} reads the first of the {len(paths)} --exports, {paths[0]!r}; "
              f"not measured: {', '.join(map(repr, paths[1:]))}", file=sys.stderr)
    if not paths:
        raise ValueError(f"diagnose {args.what} needs --exports")
    for path in paths:
        config = check_checkpoint(path)
        tokenizer = checkpoint_tokenizer(path)  # the problems' token positions are the demo tokenizer's
        if tokenizer is None:
            raise ValueError(f"{path!r} ships no tokenizer: diagnose tokenizes the demo problems with the checkpoint's "
                             "own, which must be the demo's (demo/tokenizer.py: save_tokenizer)")
        if tokenizer.get_vocab() != VOCAB:
            raise ValueError(f"{path!r} has a tokenizer other than the demo's (its vocabulary differs from "
                             "demo.atoms.VOCAB): the demo problems' token positions would not be its tokens")
        if uses_teacher and (config.kvpop is not None or config.dms is not None):
            raise ValueError(f"diagnose {args.what} reads the dense teacher's attention; {path!r} is a "
                             f"{'KVpop' if config.kvpop is not None else 'DMS'} export (--teacher), whose base weights "
                             "were fine-tuned in the retrofit: name the dense checkpoint it was made from")
        if not uses_teacher and config.kvpop is None:
            raise ValueError(f"diagnose {args.what} reads a KVpop export's policy; {path!r} is "
                             f"{'a DMS' if config.dms is not None else 'a dense'} checkpoint (--exports)")
        if not uses_teacher:
            try:
                kv = config.kvpop.retarget(args.budget, config.head_dim)
            except ValueError as e:  # below s + w + state: "budget 10 < s + w + ..." named as the flag
                raise ValueError(f"--{e} ({path!r})") from None
            topk, slots = kv.topk, kv.budget  # k, and the s + w + k token slots
            if args.what in ("noise", "ceiling", "margin") and topk < 1:
                measures = ("the facts' margin over the k-th other token" if args.what == "margin" else
                            "the recall of the k long-range slots")
                raise ValueError(f"--budget {args.budget} leaves no long-range slot in {path!r} (k = 0): "
                                 f"{args.what} measures {measures}")
            if args.what in BUDGET_DIAGNOSTICS and slots >= args.prompt_len:
                raise ValueError(f"--budget {args.budget} keeps every token of a {args.prompt_len}-token prompt in "
                                 f"{path!r} (s + w + k = {slots} slots): nothing would be evicted; want --budget "
                                 f"below {args.budget - slots + args.prompt_len}, or a longer --prompt_len")
            first = config.kvpop.sinks + config.kvpop.window + 1  # `_cuts`: the first cut with a long-range token
            if args.what == "ceiling" and first + args.cut_step >= args.prompt_len:
                raise ValueError(f"--cut_step {args.cut_step} draws no future: after the first cut (token {first} of "
                                 f"{path!r}) the next is the {args.prompt_len}-token prompt's end, whose 'futures' are "
                                 "the prompt itself, so the ceiling would be the exact target's recall (about 1.0); "
                                 f"want --cut_step < {args.prompt_len - first}")
        longest = args.prompt_len + (max(args.offsets, default=0) if args.what == "shift" else 0)
        if longest > config.max_position_embeddings:  # RoPE runs past it, but the model never trained there
            plus = " plus the largest --offsets" if args.what == "shift" else ""
            print(f"warning: --prompt_len {args.prompt_len}{plus} reaches position {longest}, beyond the "
                  f"max_position_embeddings {config.max_position_embeddings} of {path!r}", file=sys.stderr)
        if not 0 <= args.layer < config.num_hidden_layers:
            raise ValueError(f"--layer {args.layer} is out of range: {path!r} has layers 0..{config.num_hidden_layers - 1}")
        if not 0 <= args.kv_head < config.num_key_value_heads:
            raise ValueError(f"--kv_head {args.kv_head} is out of range: {path!r} has KV heads "
                             f"0..{config.num_key_value_heads - 1}")


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.main diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=sorted(DIAGNOSTICS))
    parser.add_argument("--exports", default="runs/tiny_cpu/kvpop-mlstm/export,runs/tiny_cpu/kvpop-mlp/export",
                        help="comma-separated KVpop exports (keep; target uses the first)")
    parser.add_argument("--teacher", default="checkpoints/demo-teacher", help="dense teacher (read, maxtgt, probe, learn, reads, parks)")
    parser.add_argument("--problems", type=int, default=24)
    parser.add_argument("--task", default="read_once", choices=sorted(TASKS), help="demo task of the problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt_len", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=123,
                        help="B at which keep sets are measured (maxtgt, reads: k = B - s - w)")
    parser.add_argument("--sinks", type=int, default=4, help="maxtgt, learn, reads, probe: s")
    parser.add_argument("--window", type=int, default=32, help="maxtgt, learn, reads, probe, parks: w")
    parser.add_argument("--layer", type=int, default=1, help="maxtgt, learn, reads, shift, margin, parks: the layer")
    parser.add_argument("--kv_head", type=int, default=0,
                        help="maxtgt, learn, reads, shift, margin, parks: the KV head")
    parser.add_argument("--scorer", default="mlstm", choices=["mlstm", "mlp"], help="learn: the scorer")
    parser.add_argument("--steps", type=int, default=200, help="learn: optimizer steps (8 problems each)")
    parser.add_argument("--scorer_keys", default="rotated", choices=["rotated", "unrotated"],
                        help="learn: the keys the scorer reads (KVpopConfig.scorer_keys)")
    parser.add_argument("--tau", type=float, default=1.0, help="learn --labels target_listwise: temperature (> 0)")
    parser.add_argument("--labels", default="told",
                        choices=["told", "target_values", "target_all", "target_topk", "target_listwise"],
                        help="learn: told (balanced logistic, marked facts vs the other binding values), a "
                             "squared-error fit of the exact future-attention target (no labels) over the "
                             "eligible binding values (target_values) or every eligible token (target_all), or "
                             "target_listwise: cross-entropy of softmax(score) against softmax(target / --tau) "
                             "over every eligible token, or target_topk: balanced logistic on membership of the "
                             "target's own top k among the eligible")
    parser.add_argument("--label_k", type=int, default=0,
                        help="learn --labels target_topk: the labels' top k (default 0: k = B - s - w)")
    parser.add_argument("--offsets", default="512,1024", help="shift: comma-separated position offsets")
    parser.add_argument("--older_first", type=float, default=0.0,
                        help="noise: also the recall of keeping the oldest tokens, and of the export's priority "
                             "minus this many nats per token of position (a probe; 0: off)")
    parser.add_argument("--futures", type=int, default=8,
                        help="ceiling: continuations drawn per cut (the Monte-Carlo sample of the mean)")
    parser.add_argument("--cut_step", type=int, default=16,
                        help="ceiling: tokens between cuts (a cut's scores see up to this many - 1 tokens past "
                             "leave time)")
    parser.add_argument("--replan", action="store_true",
                        help="ceiling: the drawn futures also redraw the parts of the generator's plan the prefix "
                             "does not show (the question, marked values to come, recalls to come), so the mean "
                             "conditions on the prefix alone, as a scorer must")
    parser.add_argument("--sigmas", default="0.1,0.25,0.5,1,2",
                        help="noise: comma-separated noise levels (nats) added to the teacher's log-target")
    parser.add_argument("--out", default="",
                        help="also append the printed table, with this command and the date, to this markdown "
                             "file (e.g. BENCHMARKS.md); created if missing, never truncated")
    args = parser.parse_args(argv)
    args.exports = [e for e in args.exports.split(",") if e]
    try:
        args.offsets = [int(o) for o in args.offsets.split(",") if o.strip()]
    except ValueError:
        raise ValueError(f"--offsets must be comma-separated integers, got {args.offsets!r}") from None
    try:
        args.sigmas = [float(x) for x in args.sigmas.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sigmas must be comma-separated numbers, got {args.sigmas!r}") from None
    check_args(args)
    if not args.out:
        DIAGNOSTICS[args.what](args)
        return
    printed = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
        DIAGNOSTICS[args.what](args)
    section = (f"## diagnose {args.what}, {time.strftime('%Y-%m-%d %H:%M %Z')}\n\n"
               f"- command: `python -m eval.main diagnose {shlex.join(argv)}`\n\n```\n{printed.getvalue().rstrip()}\n```")
    print(f"appended to {append_benchmarks(args.out, section)}")


class _Tee(io.TextIOBase):
    """A stream that writes to several (the terminal and the --out buffer)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
