"""What a scorer's inputs can reach: recall of policies that score each test token by the mean
log-target of its key (token, token pair, pair and position bin, ...) over train prompts
(BENCHMARKS.md, stop 35). The log-targets are the export's own, as `run_recall`'s teacher's.

    python benchmarks/stop35/recall_lookup.py [EXPORT] [BUDGET] [TRAIN_PROMPTS]
    (defaults: checkpoints/demo-kvpop-mlstm 256 64; 8 test reuse prompts, 64 saturated queries each)
"""
import collections
import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

from demo.task import generate_dataset
from eval.recall import policy_arrays, recall_counts, sample_saturated_queries
from kvpop_jax import load_pretrained
from kvpop_jax.checkpoint import checkpoint_tokenizer
from kvpop_jax.modeling import Qwen3ForCausalLM
from kvpop_jax.policy import ranks_from_priority, running_topk_cutoff, static_priority

path = sys.argv[1] if len(sys.argv) > 1 else "checkpoints/demo-kvpop-mlstm"
budget = int(sys.argv[2]) if len(sys.argv) > 2 else 256
n_train = int(sys.argv[3]) if len(sys.argv) > 3 else 64
config, params = load_pretrained(path)
config = dataclasses.replace(config, kvpop=config.kvpop.retarget(budget, config.head_dim))
kv, model = config.kvpop, Qwen3ForCausalLM(config)
tokenizer, seq_len, layers = checkpoint_tokenizer(path), 1024, config.num_hidden_layers
heads = config.num_key_value_heads


def prompts(split, n):
    return np.asarray([tokenizer(e["prompt"])["input_ids"]
                       for e in generate_dataset(n, 0, split, task="reuse", seq_len=seq_len)], np.int32)


KEYS = {
    "token": lambda ids, t: ids[t],
    "(previous, token)": lambda ids, t: (ids[t - 1], ids[t]),
    "(two before, previous, token)": lambda ids, t: (ids[t - 2], ids[t - 1], ids[t]),
    "(previous, token, next)": lambda ids, t: (ids[t - 1], ids[t], ids[t + 1]),
    "(previous, token, position // 128)": lambda ids, t: (ids[t - 1], ids[t], t // 128),
}
competing = range(kv.sinks, seq_len - kv.window)
train, test = prompts("train", n_train), prompts("test", 8)
sums = {name: collections.defaultdict(lambda: np.zeros((layers, heads, 2))) for name in KEYS}
any_q = jnp.asarray(sample_saturated_queries(np.random.default_rng(1), 1, seq_len=seq_len, budget=kv.budget, num=8))
for ids in train:
    target = np.asarray(policy_arrays(model, params, jnp.asarray(ids[None]), any_q)["target"])[:, 0]  # [L, H, S]
    for name, key in KEYS.items():
        for t in competing:
            acc = sums[name][key(ids, t)]
            acc[..., 0] += target[:, :, t]
            acc[..., 1] += 1

q_idx = sample_saturated_queries(np.random.default_rng(0), len(test), seq_len=seq_len, budget=kv.budget, num=64)
hits, total = collections.defaultdict(float), 0
for row, ids in enumerate(test):
    q = jnp.asarray(q_idx[row: row + 1])
    arr = policy_arrays(model, params, jnp.asarray(ids[None]), q)
    fallback = np.asarray(arr["target"])[:, 0].mean(-1)  # a key unseen in training: the row's mean
    policies = {"the export": (arr["ranks"], arr["cutoffs"])}
    for name, key in KEYS.items():
        score = np.zeros((layers, 1, heads, seq_len), np.float32)
        for t in competing:
            acc = sums[name].get(key(ids, t))
            score[:, 0, :, t] = acc[..., 0] / acc[..., 1] if acc is not None else fallback
        ranks = [ranks_from_priority(static_priority(jnp.asarray(score[layer]), arr["log_gamma"][layer]))
                 for layer in range(layers)]
        policies[name] = (jnp.stack(ranks), jnp.stack([running_topk_cutoff(r, sinks=kv.sinks, window=kv.window,
                                                                           topk=kv.topk) for r in ranks]))
    for name, (ranks, cutoffs) in policies.items():
        h, tot = recall_counts(ranks, cutoffs, arr["teacher_ranks"], arr["teacher_cutoffs"], q,
                               sinks=kv.sinks, window=kv.window)
        hits[name] = hits[name] + np.asarray(h)[:, 0]
    total = total + np.asarray(tot)[:, 0]
print(f"{path}: recall per [layer, kv head] at B {budget}, 8 test reuse prompts; lookup tables from {n_train} "
      "train prompts")
for name, h in hits.items():
    r = h / total
    print(f"  {name:36s}: {r.round(3).tolist()}  mean {r.mean():.3f}")
