"""`python -m train.pretrain --flagfile=configs/tiny_teacher.flags`: trains the demo teacher.

The job lives in `train/demo_teacher/` (its package docstring describes it).
"""

from absl import app

from kvpop_jax.runtime import exit_at_once_on_interrupt
from train.config import parse_flags
from train.demo_teacher.main import define_flags, main

if __name__ == "__main__":
    define_flags()
    exit_at_once_on_interrupt(lambda: app.run(main, flags_parser=parse_flags))
