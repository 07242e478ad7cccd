"""Dense causal attention skipping masked key blocks by position (general), vs the reference."""
import time, jax, jax.numpy as jnp
from kvpop_jax import attention as A
NEG = -1e30
def flash_skip(q, k, v, qpos, kpos, bq=256, bk=256):
    b, s, hq, d = q.shape; t, hkv = k.shape[1], k.shape[2]; g = hq // hkv
    qg = A.group_queries(q, hkv).reshape(b, s // bq, bq, hkv, g, d)
    kb = k.reshape(b, t // bk, bk, hkv, d); vb = v.reshape(b, t // bk, bk, hkv, d)
    qp = qpos.reshape(b, s // bq, bq); kp = kpos.reshape(b, t // bk, bk)
    kmin = kp.min(axis=(0, 2))  # [nk]
    def qblock(args):
        qb, qpb = args  # [b, bq, hkv, g, d], [b, bq]
        qmax = qpb.max()
        def kstep(j, carry):
            m, l, acc = carry
            def do(c):
                m, l, acc = c
                kj, vj, kpj = kb[:, j], vb[:, j], kp[:, j]
                x = jnp.einsum("bqhgd,bthd->bhgqt", qb, kj) * d**-0.5
                mask = (kpj[:, None, :] <= qpb[:, :, None])[:, None, None]
                x = jnp.where(mask, x, NEG)
                mn = jnp.maximum(m, x.max(-1))
                p = jnp.exp(x - mn[..., None]); corr = jnp.exp(m - mn)
                return mn, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum("bhgqt,bthd->bhgqd", p, vj)
            return jax.lax.cond(kmin[j] <= qmax, do, lambda c: c, (m, l, acc))
        init = (jnp.full((b, hkv, g, bq), NEG), jnp.zeros((b, hkv, g, bq)), jnp.zeros((b, hkv, g, bq, d)))
        m, l, acc = jax.lax.fori_loop(0, t // bk, kstep, init)
        return acc / l[..., None], m + jnp.log(l)
    out, lse = jax.lax.map(qblock, (jnp.moveaxis(qg, 1, 0), jnp.moveaxis(qp, 1, 0)))
    out = jnp.moveaxis(out, 0, 3)  # [b, hkv, g, nq, bq, d]
    return out.reshape(b, hkv * g, s, d).transpose(0, 2, 1, 3), jnp.moveaxis(lse, 0, 3).reshape(b, hq, s)
def bench(f, *a, n=3):
    jax.block_until_ready(f(*a)); t = time.perf_counter()
    for _ in range(n): jax.block_until_ready(f(*a))
    return (time.perf_counter() - t) / n
for B, S in [(50, 1024), (4, 1024), (8, 1024)]:
    q = jax.random.normal(jax.random.key(0), (B, S, 4, 64)); k = jax.random.normal(jax.random.key(1), (B, S, 2, 64)); v = jax.random.normal(jax.random.key(2), (B, S, 2, 64))
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    ref = jax.jit(lambda q, k, v: A.dense_attention_reference(q, k, v, q_positions=pos, kv_positions=pos))
    fl = jax.jit(lambda q, k, v: flash_skip(q, k, v, pos, pos))
    r, f = ref(q, k, v), fl(q, k, v)
    print(B, S, "ref %.3f s" % bench(ref, q, k, v), "flash-skip %.3f s" % bench(fl, q, k, v),
          "out diff %.1e lse diff %.1e" % (float(jnp.abs(r[0] - f[0]).max()), float(jnp.abs(r[1] - f[1]).max())), flush=True)
    g = jax.jit(jax.grad(lambda q, k, v, fn: jnp.sum(fn(q, k, v)[0] ** 2), argnums=(0, 1, 2)), static_argnums=3)
    if B <= 8:
        print("   fwd+bwd: ref %.3f s, flash-skip %.3f s" % (bench(lambda *a: g(*a, ref), q, k, v), bench(lambda *a: g(*a, fl), q, k, v)), flush=True)
