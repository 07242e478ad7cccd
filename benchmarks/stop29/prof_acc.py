"""`python benchmarks/stop29/prof_acc.py accuracy ...`: eval.main with each generate call timed."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_generate  # noqa: E402

time_generate()
from eval import main as em  # noqa: E402

em.main(sys.argv[1:])
