import os, sys, time, jax, jax.numpy as jnp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvpop_jax import baselines as bl
from decode2 import decode2
B, H, G, D, P = 50, 2, 2, 64, 1024
for method, n in [("streaming", 256), ("h2o", 256), ("tova", 123)]:
    cfg = bl.BaselineConfig(method, n, sinks=4 if method == "streaming" else 0)
    q = jax.random.normal(jax.random.key(0), (P, B, 1, H * G, D)); k = jax.random.normal(jax.random.key(1), (P, B, 1, H, D))
    v = jax.random.normal(jax.random.key(2), (P, B, 1, H, D))
    lc = bl.init_layer_cache(cfg, B, H, D)
    res = {}
    for name, fn in (("old", bl.decode), ("new", decode2)):
        @jax.jit
        def run(lc, q, k, v):
            def body(c, x):
                lc, i = c
                out, lc = fn(cfg, lc, x[0], x[1], x[2], i)
                return (lc, i + 1), out
            (lc, _), outs = jax.lax.scan(body, (lc, jnp.int32(0)), (q, k, v))
            return lc, outs
        jax.block_until_ready(run(lc, q, k, v))
        t = time.perf_counter(); r = jax.block_until_ready(run(lc, q, k, v)); dt = time.perf_counter() - t
        res[name] = r
        print(method, n, name, f"{dt / P * 1e3:.2f} ms/step (one layer)")
    (a, oa), (b_, ob) = res["old"], res["new"]
    print("  pos equal", bool((a.pos == b_.pos).all()), "k equal", bool((a.k == b_.k).all()), "out maxdiff", float(jnp.abs(oa - ob).max()))
