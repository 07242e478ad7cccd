"""`python -m train.main --flagfile=configs/tiny_cpu.flags`: the KVpop retrofit, end to end.

Loads (or builds) the dense checkpoint, adds KVpop scorers and decay, distills from the
frozen dense teacher with the retention loss (`train/step.py`), checkpoints with orbax
(resuming from the latest checkpoint in RUN_DIR with the same flags), logs to tqdm,
RUN_DIR/metrics.jsonl and TensorBoard, and exports a HF-style directory at the end.
`--dry_run` compiles the step for the real shapes on abstract arrays and prints the
per-device memory instead. Flags: `train/flags.py`.

Outputs under RUN_DIR: train_config.json, checkpoints/<step>/, metrics.jsonl, tb/,
export/ (or --export_dir), and init/ + data/ for `random:` models and `demo:N` data.
With `--variants` (e.g. kvpop-mlstm,kvpop-mlp,streamingllm+) each variant is such a run in
RUN_DIR/NAME, and `--eval_methods` then prints the demo comparison (`train/recipe.py`).
"""

from __future__ import annotations

import errno
import logging
import os
import sys

import jax
from absl import app, flags
from absl import logging as absl_logging

from kvpop_jax import sharding as shd
from kvpop_jax.runtime import (ctrl_c_kills, exit_at_once_on_interrupt, gpu_workload_reasons, out_of_memory,
                               interrupt_outside_gc_callbacks, report_backend)
from train import recipe
from train.config import FlagError, parse_flags
from train.configure import config_from_flags
from train.dry_run import dry_run
from train.flags import define_flags
from train.loop import TrainingAborted, train
from train.run_dir import resume_advice
from train.setup import info
from train.teacher_cache import write_teacher_logits

FLAGS = flags.FLAGS
define_flags(FLAGS)


def main(argv):
    if len(argv) > 1:  # one line and exit 2, as a bad flag (absl's UsageError prints the whole docstring)
        print(f"error: unexpected arguments {argv[1:]}: train.main takes only flags (--name=value)", file=sys.stderr)
        sys.exit(2)
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file it writes at INFO
    interrupt_outside_gc_callbacks()
    cfg = None
    try:
        try:
            shd.maybe_initialize_distributed(FLAGS.distributed)  # before anything touches a device
        except (ValueError, RuntimeError) as e:  # no coordinator: a one-host run in a multi-host-looking env
            seen = [f"{k}={os.environ[k]}" for k in shd.MULTI_HOST_ENV if os.environ.get(k)]
            raise FlagError(f"--distributed={FLAGS.distributed}: jax.distributed.initialize() failed ({e}); "
                            f"multi-host variables seen: {seen or 'none'}. If this is one host, pass "
                            "--distributed=off") from e
        cfg = config_from_flags(FLAGS, on_accelerator=True if FLAGS.dry_run else None)
        # the flag as given: "auto" means float32 on CPU, an explicit bfloat16 means a GPU recipe
        reasons = gpu_workload_reasons(compute_dtype=FLAGS.compute_dtype, seq_len=cfg.seq_len)
        if cfg.dry_run:  # it writes nothing: Ctrl-C stops it at once, even inside XLA's minutes-long compile
            with ctrl_c_kills():
                report_backend(reasons, what="this dry run (it compiles for this machine's devices)")
                dry_run(cfg)
        else:
            report_backend(reasons, what="this training run")
            if cfg.write_teacher_logits:
                write_teacher_logits(cfg)
            elif cfg.variants or cfg.evaluation is not None:
                recipe.run(cfg)
            else:
                if cfg.quick:
                    info(recipe.quick_notice(cfg))
                train(cfg)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        _quiet_exit(2)
    except KeyboardInterrupt:  # checkpoints already saved stay whole (orbax's writes land atomically)
        run_dir = cfg.run_dir if cfg is not None else FLAGS.run_dir  # --quick runs in RUN_DIR-quick
        print(f"\n{resume_advice(FLAGS.resume, FLAGS.overwrite, run_dir)}", file=sys.stderr)
        sys.exit(130)
    except jax.errors.JaxRuntimeError as e:  # an out-of-memory traceback, hundreds of lines, said in one
        if (line := out_of_memory(e)) is None:
            raise
        run_dir = cfg.run_dir if cfg is not None else FLAGS.run_dir
        print(f"error: {line} on {jax.default_backend()}. A step needs less with --remat or --loss_chunk, or on more "
              f"devices, and resumes from the last checkpoint in {run_dir} with them; a smaller --micro_batch "
              "(--global_batch stays, by gradient accumulation) starts over (--overwrite: a resume keeps it); a "
              "recipe's evaluation needs less with a smaller --eval_batch", file=sys.stderr)
        _quiet_exit(2)
    except TrainingAborted as e:  # NaN/inf or divergence: stopped before saving that state
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    except OSError as e:  # a full, read-only or failing disk (metrics, export, teacher top-k): no traceback
        run_dir = cfg.run_dir if cfg is not None else FLAGS.run_dir
        rerun = ("it writes the steps whose files are missing" if FLAGS.write_teacher_logits else
                 f"a run resumes from the last checkpoint in {run_dir}, whose saved steps and export are whole")
        disk = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
        print(f"error: {e}" + (f"; free space (or fix the disk) and rerun the same command: {rerun}" if disk else ""),
              file=sys.stderr)
        _quiet_exit(2)


def _quiet_exit(code: int) -> None:
    """Exits after the `error:` line without the asyncio `... exception was never retrieved` tracebacks that a
    failed orbax save's leftover futures print when they are collected at exit, under that line."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.exit(code)


if __name__ == "__main__":
    # Ctrl-C: the run's files are closed and its lock released, but the interrupted step may still be computing
    exit_at_once_on_interrupt(lambda: app.run(main, flags_parser=parse_flags))
