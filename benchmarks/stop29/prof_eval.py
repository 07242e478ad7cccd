"""Time every piece of the recipe's evaluation on an already-trained run dir."""
import sys, time, functools
import jax
import eval.accuracy as acc
import train.recipe as rec
LOG = []
orig = acc.generate
def timed(model, params, ids, **kw):
    t = time.perf_counter()
    out = jax.block_until_ready(orig(model, params, ids, **kw))
    LOG.append((type(kw['cache']).__name__ if not isinstance(kw['cache'], str) else kw['cache'],
                getattr(kw['cache'], 'method', ''), getattr(kw['cache'], 'budget', model.config.kvpop.budget if model.config.kvpop else ''),
                tuple(ids.shape), kw['max_new_tokens'], kw.get('stream_prompt'), round(time.perf_counter() - t, 2)))
    print("GEN", LOG[-1], flush=True)
    return out
acc.generate = timed
def wrap(mod, name):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); print("PIECE", name, round(time.perf_counter() - t, 1), flush=True); return r
    setattr(mod, name, g)
for n in ("run_accuracy", "oracle_rates", "run_recall", "run_dms_patterns", "plot_training", "write_summary"):
    wrap(rec, n)
from train import main as tm
from absl import app
sys.argv = ["x", "--flagfile=configs/tiny_cpu.flags", "--run_dir=" + (sys.argv[1] if len(sys.argv) > 1 else "runs/tiny_cpu"), "--noprogress"] 
app.run(tm.main)
