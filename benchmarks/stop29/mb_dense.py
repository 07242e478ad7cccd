import time, jax, jax.numpy as jnp
from kvpop_jax import attention as A
def bench(f, *a, n=3):
    jax.block_until_ready(f(*a)); t = time.perf_counter()
    for _ in range(n): jax.block_until_ready(f(*a))
    return (time.perf_counter() - t) / n
for B, S in [(50, 1024), (50, 2048), (4, 1024)]:
    q = jax.random.normal(jax.random.key(0), (B, S, 4, 64)); k = jax.random.normal(jax.random.key(1), (B, S, 2, 64)); v = jax.random.normal(jax.random.key(2), (B, S, 2, 64))
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    ref = jax.jit(lambda q, k, v: A.dense_attention_reference(q, k, v, q_positions=pos, kv_positions=pos))
    blk = jax.jit(lambda q, k, v: A.dense_attention_blockwise(q, k, v, q_positions=pos, kv_positions=pos, block_q=256))
    def causal_blocks(q, k, v, bq=256):
        outs, lses = [], []
        qg = A.group_queries(q, 2)
        for i in range(0, S, bq):
            e = i + bq
            m = A._dense_mask(pos[:, i:e], pos[:, :e], None, None, None)
            o, l = A.attend(qg[:, i:e], k[:, :e], v[:, :e], m, 64**-0.5)
            outs.append(o); lses.append(l)
        return jnp.concatenate(outs, 1).reshape(q.shape), jnp.concatenate(lses, -1)
    cb = jax.jit(causal_blocks)
    r = ref(q, k, v)[0]; c = cb(q, k, v)[0]
    print(B, S, "ref %.3f s" % bench(ref, q, k, v), "blockwise %.3f s" % bench(blk, q, k, v), "causal-blocks %.3f s" % bench(cb, q, k, v), "diff", float(jnp.abs(r - c).max()), flush=True)
