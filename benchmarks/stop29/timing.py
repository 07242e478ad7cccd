"""Shared by the stop-29 timing scripts: a timer and a per-call timing of eval's `generate`."""
import time

import jax


def bench(f, *args, n: int = 3, median: bool = False) -> float:
    """Seconds per call of f(*args), after one call that compiles: the mean of n calls, or their
    median (each call timed on its own)."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] if median else sum(times) / n


def bench_median(f, *args, n: int = 5) -> float:
    """The stop-30 scripts' timer: the median of n calls after the compile."""
    return bench(f, *args, n=n, median=True)


def time_generate() -> None:
    """Makes `eval.accuracy` print each `generate` call's seconds (the first of a setting compiles):
    GEN (cache kind, method, budget, prompt shape, max_new_tokens, stream_prompt, seconds)."""
    import eval.accuracy as acc

    orig = acc.generate

    def timed(model, params, ids, **kw):
        t = time.perf_counter()
        out = jax.block_until_ready(orig(model, params, ids, **kw))
        c = kw["cache"]
        budget = getattr(c, "budget", model.config.kvpop.budget if model.config.kvpop else "")
        print("GEN", (c if isinstance(c, str) else type(c).__name__, getattr(c, "method", ""), budget,
                      tuple(ids.shape), kw["max_new_tokens"], kw.get("stream_prompt"),
                      round(time.perf_counter() - t, 2)), flush=True)
        return out

    acc.generate = timed
