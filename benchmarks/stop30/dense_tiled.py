"""Dense causal attention per layer (4 query heads, 2 KV heads of 64): the whole-matrix reference
against the tiled path (`kvpop_jax.tiled_attention`, tiles of 256 and of 128), forward and
forward + backward (a loss on out and lse, so each forward runs twice in the backward's timing).

    python benchmarks/stop30/dense_tiled.py [ROWSxS ...]   (default: 4x1024 4x512 50x1024)
"""
import os
import sys

import jax
import jax.numpy as jnp

from kvpop_jax import attention as A
from kvpop_jax.tiled_attention import dense_attention_tiled

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stop29"))
from timing import bench  # noqa: E402

cases = [tuple(map(int, c.split("x"))) for c in sys.argv[1:]] or [(4, 1024), (4, 512), (50, 1024)]
for b, s in cases:
    q = jax.random.normal(jax.random.key(0), (b, s, 4, 64))
    k = jax.random.normal(jax.random.key(1), (b, s, 2, 64))
    v = jax.random.normal(jax.random.key(2), (b, s, 2, 64))
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    fns = {
        "reference": lambda q, k, v: A.dense_attention_reference(q, k, v, q_positions=pos, kv_positions=pos),
        "tiled 256": lambda q, k, v: dense_attention_tiled(q, k, v, q_positions=pos, kv_positions=pos),
        "tiled 128": lambda q, k, v: dense_attention_tiled(q, k, v, q_positions=pos, kv_positions=pos,
                                                           block_q=128, block_k=128),
    }
    for name, fn in fns.items():
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)[0] ** 2) + jnp.sum(fn(q, k, v)[1]),
                                argnums=(0, 1, 2)))
        print(f"{b} x {s} {name}: forward {bench(jax.jit(fn), q, k, v):.3f} s, "
              f"forward + backward {bench(grad, q, k, v):.3f} s", flush=True)
