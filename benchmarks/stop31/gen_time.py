"""Times every generate call of `python -m eval.main accuracy` (first call: trace, compile and run;
later calls: run only). Usage, from the repository root with the venv active:

    python benchmarks/stop31/gen_time.py accuracy --checkpoints dense=...,kvpop-mlstm=... --methods ... (as eval.main)

Prints one `GEN <cache> <method> <budget> ... <seconds>` line per call (BENCHMARKS.md, stop 31).
"""
import sys, time, jax
import eval.accuracy as acc
orig = acc.generate
def timed(model, params, prompts, **kw):
    t = time.perf_counter()
    out = orig(model, params, prompts, **kw)
    jax.block_until_ready(out)
    c = kw["cache"]
    print(f"GEN {type(c).__name__ if not isinstance(c, str) else c} {getattr(c,'method','')} {getattr(c,'budget','')} "
          f"kv={getattr(model.config.kvpop,'topk',None) if model.config.kvpop else None} dms={model.config.dms is not None} "
          f"stream={kw.get('stream_prompt')} shape={prompts.shape} {time.perf_counter()-t:.2f}s", flush=True)
    return out
acc.generate = timed
from eval.main import main
sys.argv = ["eval.main"] + sys.argv[1:]
main()
