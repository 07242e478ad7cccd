"""One layer's parts at the main job's training shape (4 rows of 1024 tokens, s 4, w 32, k 70):
the masked attention's two back ends and the tiled dense attention (forward; forward + backward of
a loss on out and lse, so the forward runs twice there), the dense normalizer, the target, ranks
and cutoffs. Median of 5 calls after the compile.

    python benchmarks/stop30/layer_parts.py
"""
import os
import sys

import jax
import jax.numpy as jnp

from kvpop_jax import attention as A, policy, targets

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stop29"))
from timing import bench_median as bench  # noqa: E402

B,S=4,1024
q = jax.random.normal(jax.random.key(0), (B, S, 4, 64))
k = jax.random.normal(jax.random.key(1), (B, S, 2, 64))
v = jax.random.normal(jax.random.key(2), (B, S, 2, 64))
sc = jax.random.normal(jax.random.key(3),(B,2,S))
ranks = policy.ranks_from_priority(sc)
cut = policy.running_topk_cutoff(ranks, sinks=4, window=32, topk=70)
for impl in ["xla_sparse","xla"]:
    fn = lambda q,k,v: A.kvpop_attention(q,k,v,ranks,cut,sinks=4,window=32,topk=70,implementation=impl)
    g = jax.jit(jax.grad(lambda q,k,v: jnp.sum(fn(q,k,v)[0]**2)+jnp.sum(fn(q,k,v)[1]), argnums=(0,1,2)))
    print(impl, "fwd", bench(jax.jit(fn),q,k,v), "fwd+bwd", bench(g,q,k,v), flush=True)
pos=jnp.broadcast_to(jnp.arange(S),(B,S))
fn = lambda q,k,v: A.dense_attention(q,k,v,q_positions=pos,kv_positions=pos)
g = jax.jit(jax.grad(lambda q,k,v: jnp.sum(fn(q,k,v)[0]**2)+jnp.sum(fn(q,k,v)[1]), argnums=(0,1,2)))
print("dense tiled", "fwd", bench(jax.jit(fn),q,k,v), "fwd+bwd", bench(g,q,k,v), flush=True)
lse = targets.dense_lse(q,k)
print("target", bench(jax.jit(lambda q,k,l: targets.future_attention_target(q,k,l,window=32,eps=1e-6)), q, k, lse))
cutoffs = jax.jit(lambda s: policy.running_topk_cutoff(policy.ranks_from_priority(s), sinks=4, window=32, topk=70))
print("ranks+cutoff", bench(cutoffs, sc))
