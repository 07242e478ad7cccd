"""The baseline decode step per layer: 50 rows, a scan of 1024 steps. With OLD_BASELINES_PY (a
kvpop_jax/baselines.py of another commit, e.g. `git show a2ca3ff~1:kvpop_jax/baselines.py`) it
times that one too and compares outputs and kept positions."""
import importlib.util
import sys
import time

import jax
import jax.numpy as jnp

from kvpop_jax import baselines

versions = {"current": baselines}
if len(sys.argv) > 1:
    spec = importlib.util.spec_from_file_location("baselines_old", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    sys.modules["baselines_old"] = old  # flax.struct dataclasses look their module up
    spec.loader.exec_module(old)
    versions["old"] = old
B, H, G, D, P = 50, 2, 2, 64, 1024
for method, n in [("streaming", 256), ("h2o", 256), ("tova", 123)]:
    q = jax.random.normal(jax.random.key(0), (P, B, 1, H * G, D))
    k = jax.random.normal(jax.random.key(1), (P, B, 1, H, D))
    v = jax.random.normal(jax.random.key(2), (P, B, 1, H, D))
    res = {}
    for name, mod in versions.items():
        cfg = mod.BaselineConfig(method, n, sinks=4 if method == "streaming" else 0)

        @jax.jit
        def run(lc, q, k, v, mod=mod, cfg=cfg):
            def body(c, x):
                lc, i = c
                out, lc = mod.decode(cfg, lc, x[0], x[1], x[2], i)
                return (lc, i + 1), out
            (lc, _), outs = jax.lax.scan(body, (lc, jnp.int32(0)), (q, k, v))
            return lc.pos, outs

        lc = mod.init_layer_cache(cfg, B, H, D)
        jax.block_until_ready(run(lc, q, k, v))
        t = time.perf_counter()
        res[name] = jax.block_until_ready(run(lc, q, k, v))
        print(method, n, name, f"{(time.perf_counter() - t) / P * 1e3:.2f} ms/step (one layer)", flush=True)
    if "old" in res:
        (pa, oa), (pb, ob) = res["current"], res["old"]
        print("  kept positions equal", bool((pa == pb).all()), "out max diff", float(jnp.abs(oa - ob).max()))
