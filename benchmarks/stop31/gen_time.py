"""Times every generate call of `python -m eval.main accuracy` (first call of a setting: trace,
compile and run; later calls: run only). From the repository root with the venv active:

    python benchmarks/stop31/gen_time.py accuracy --checkpoints dense=...,kvpop-mlstm=... --methods ... (as eval.main)

Prints one `GEN <cache> <method> <budget> kv=<k> dms=<bool> stream=<bool> shape=<prompts> <seconds>`
line per call (BENCHMARKS.md, stop 31).
"""

import sys
import time

import jax

import eval.accuracy as accuracy
from eval.main import main

_generate = accuracy.generate


def timed_generate(model, params, prompts, **kwargs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(_generate(model, params, prompts, **kwargs))
    cache, kvpop = kwargs["cache"], model.config.kvpop
    name = cache if isinstance(cache, str) else type(cache).__name__
    print(f"GEN {name} {getattr(cache, 'method', '')} {getattr(cache, 'budget', '')} "
          f"kv={kvpop.topk if kvpop else None} dms={model.config.dms is not None} "
          f"stream={kwargs.get('stream_prompt')} shape={prompts.shape} {time.perf_counter() - t0:.2f}s", flush=True)
    return out


if __name__ == "__main__":
    accuracy.generate = timed_generate
    sys.argv = ["eval.main", *sys.argv[1:]]
    main()
