"""Time every piece of the recipe's evaluation on an already-trained run dir."""
import functools
import os
import sys
import time

import train.recipe as rec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_generate  # noqa: E402

time_generate()
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
