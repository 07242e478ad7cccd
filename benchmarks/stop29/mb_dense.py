"""Dense causal attention per layer: the reference, the blockwise path, causal key slicing per
256-query block (exact only when positions increase with the index), and a general version that
skips masked key blocks by position (online softmax, `lax.cond`); forward, and forward + backward
at small batches."""
import os
import sys

import jax
import jax.numpy as jnp

from kvpop_jax import attention as A

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import bench  # noqa: E402

NEG = -1e30


def causal_blocks(q, k, v, pos, bq=256):
    outs, lses = [], []
    qg = A.group_queries(q, k.shape[2])
    for i in range(0, q.shape[1], bq):
        e = i + bq
        m = A._dense_mask(pos[:, i:e], pos[:, :e], None, None, None)
        o, l = A.attend(qg[:, i:e], k[:, :e], v[:, :e], m, q.shape[-1] ** -0.5)
        outs.append(o)
        lses.append(l)
    return jnp.concatenate(outs, 1).reshape(q.shape), jnp.concatenate(lses, -1).reshape(q.shape[0], q.shape[2], -1)


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
for B, S in [(50, 1024), (50, 2048), (8, 1024), (4, 1024)]:
    q = jax.random.normal(jax.random.key(0), (B, S, 4, 64))
    k = jax.random.normal(jax.random.key(1), (B, S, 2, 64))
    v = jax.random.normal(jax.random.key(2), (B, S, 2, 64))
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    fns = {
        "reference": lambda q, k, v: A.dense_attention_reference(q, k, v, q_positions=pos, kv_positions=pos),
        "blockwise": lambda q, k, v: A.dense_attention_blockwise(q, k, v, q_positions=pos, kv_positions=pos,
                                                                 block_q=256),
        "causal blocks": lambda q, k, v: causal_blocks(q, k, v, pos),
        "flash-skip": lambda q, k, v: flash_skip(q, k, v, pos, pos),
    }
    ref = jax.jit(fns["reference"])(q, k, v)
    for name, fn in fns.items():
        f = jax.jit(fn)
        got = f(q, k, v)
        diff = max(float(jnp.abs(ref[0] - got[0]).max()), float(jnp.abs(ref[1] - got[1]).max()))
        line = f"{B} x {S} {name}: forward {bench(f, q, k, v):.3f} s (max diff to the reference {diff:.1e})"
        if B <= 8 and name in ("reference", "flash-skip"):
            g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)[0] ** 2), argnums=(0, 1, 2)))
            line += f", forward + backward {bench(g, q, k, v):.3f} s"
        print(line, flush=True)
