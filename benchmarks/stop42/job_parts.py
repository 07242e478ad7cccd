"""Where a README-command-1 job's seconds go, part by part, on the box it runs on (stop 42).

Times, at the job's shapes, each piece of the scorer variants' training step and of one evaluation
call, from a finished job's run directory (its exports and shared teacher files are only read):

- step parts, per layer, 4 rows x 1024 tokens (medians of `--calls` calls after the first, whose
  seconds are mostly the compile; `eval.bench_train`'s parts): dense attention and the masked
  attention as the dispatcher picks it, forward + backward, the retention objective with its
  gradient in the shipped configuration and with each loss option beyond the paper switched off,
  the mLSTM and MLP scorers forward + backward, the dense normalizer, the target, ranks, the running cutoff and the boundary;
- one evaluation call of each `--methods` at B (50 problems of 1024 random tokens, greedy,
  18 new tokens, the baselines' prompt streamed as the job does): first call, steady call, and for
  the KVpop exports the prefill alone, and its compile.

    python benchmarks/stop42/job_parts.py runs/tiny_cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.accuracy import method_setup
from eval.bench_train import PARTS, median_ms, time_parts
from kvpop_jax import load_pretrained, losses, targets
from kvpop_jax.baselines import BOUNDED_METHODS
from kvpop_jax.generate import generate, init_generation_cache
from kvpop_jax.kvpop import retention_objective, sparse_policy
from kvpop_jax.sampling import SamplingConfig


def timed(fn, *args, calls: int) -> tuple[float, float]:
    """(first call s, median ms of `calls` later calls), by `eval.bench_train.median_ms`."""
    ms, first = median_ms(lambda *a: (None, fn(*a)), args, steps=calls, warmup=0)
    return first, ms


def step_parts(export: str, calls: int) -> list[tuple[str, float, float]]:
    config, _ = load_pretrained(export)  # the export keeps its training knobs (num_query_samples, ...)
    kv = config.kvpop
    parts = time_parts(config, 1024, 4, parts=[p for p in PARTS if "(xla)" not in p], steps=calls, warmup=0, seed=0)
    rows = [(name, first, ms) for name, (ms, first) in parts.items()]
    b, s, hq, hkv, d = 4, 1024, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = jax.random.normal(keys[0], (b, s, hq, d)), jax.random.normal(keys[1], (b, s, hkv, d))
    lse = jax.random.normal(keys[2], (b, hq, s)) + 5.0
    scores, log_gamma = jax.random.normal(keys[3], (b, hkv, s)), jnp.full((hkv,), -1e-3)
    rows.append(("dense normalizer (dense_lse)", *timed(jax.jit(targets.dense_lse), q, k, calls=calls)))
    options = {
        "retention objective + grad, as trained": kv,
        "  listwise off": dataclasses.replace(kv, listwise_queries=0),
        "  rank pairs off": dataclasses.replace(kv, rank_pairs=0),
        "  64 query samples": dataclasses.replace(kv, num_query_samples=64),
        "  sparse normalizer": dataclasses.replace(kv, normalizer="sparse"),
        "  all four": dataclasses.replace(kv, normalizer="sparse", rank_pairs=0, listwise_queries=0,
                                          num_query_samples=64),
    }
    for name, c in options.items():
        def objective(scores, log_gamma, rng, c=c):
            q_idx = losses.sample_query_positions(rng, batch=b, seq_len=s, num=c.num_query_samples, min_q=c.budget,
                                                  late_bias_fraction=c.late_bias_fraction)
            ranks, cutoffs = sparse_policy(scores, log_gamma, c)
            loss = lambda sc, lg: retention_objective(q, k, lse, sc, lg, ranks, cutoffs, q_idx, c)[0]  # noqa: E731
            return jax.grad(loss, argnums=(0, 1))(scores, log_gamma)

        rows.append((name, *timed(jax.jit(objective), scores, log_gamma, jax.random.key(1), calls=calls)))
    return rows


def eval_call(method: str, checkpoint: str, budget: int, calls: int) -> list[tuple[str, float, float]]:
    config, params = load_pretrained(checkpoint)
    model, mparams, cache = method_setup(method, config, params, budget, sinks=4, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (50, 1024)), jnp.int32)
    run = functools.partial(generate, model, mparams, ids, cache=cache, max_new_tokens=18,
                            sampling=SamplingConfig.greedy(), eos_ids=(2,), stream_prompt=method in BOUNDED_METHODS)
    rows = [(f"{method} B {budget}: generate", *timed(run, calls=calls))]
    if cache != "kvpop":
        return rows

    def prefill(mparams, ids):
        state = init_generation_cache(model.config, cache, ids.shape[0], ids.shape[1] + 18)
        return model.apply({"params": mparams}, ids, cache=state)

    t0 = time.perf_counter()
    compiled = jax.jit(prefill).lower(mparams, ids).compile()
    rows.append((f"{method} B {budget}: prefill compile (s)", time.perf_counter() - t0, float("nan")))
    rows.append((f"{method} B {budget}: prefill", *timed(compiled, mparams, ids, calls=calls)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a finished job's run directory (runs/tiny_cpu)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--methods", default="kvpop-mlstm,kvpop-mlp,tova,h2o,dense")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--dense", default="checkpoints/demo-teacher", help="the dense checkpoint (the job's teacher)")
    args = ap.parse_args()
    mlstm = os.path.join(args.run_dir, "kvpop-mlstm", "export")
    rows = step_parts(mlstm, args.calls)
    for method in filter(None, args.methods.split(",")):
        checkpoint = (args.dense if method in ("dense", *BOUNDED_METHODS)
                      else os.path.join(args.run_dir, method, "export"))
        rows += eval_call(method, checkpoint, args.budget, max(2, args.calls // 5))
    print("| part | first call s | median ms |\n|---|---|---|")
    for name, first, ms in rows:
        print(f"| {name} | {first:.2f} | {ms:.1f} |")


if __name__ == "__main__":
    main()
