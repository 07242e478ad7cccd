import sys, time
import jax
import eval.accuracy as acc
orig = acc.generate
def timed(model, params, ids, **kw):
    t = time.perf_counter()
    out = jax.block_until_ready(orig(model, params, ids, **kw))
    c = kw['cache']
    print("GEN", getattr(c, 'method', c), getattr(c, 'budget', ''), tuple(ids.shape), round(time.perf_counter() - t, 2), flush=True)
    return out
acc.generate = timed
from eval import main as em
sys.argv = ["x", *sys.argv[1:]]
em.main() if hasattr(em, 'main') else None
