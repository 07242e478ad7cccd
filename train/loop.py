"""The training loop of `python -m train.main`: restore or init, step, log, checkpoint, export.

Resumes from the latest checkpoint in RUN_DIR/checkpoints with the same flags and reproduces
the same losses (params, optimizer, RNG and data-iterator state are saved). The run folder is
locked and checked first (`train/run_dir.py`). A step whose loss terms or updated state hold
NaN/inf (`check_finite`), or whose loss jumps above `--divergence_factor` x its running median
(`DivergenceGuard`), stops the run before that state is saved or exported.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from kvpop_jax import load_pretrained, modeling
from kvpop_jax import sharding as shd
from kvpop_jax.checkpoint import check_checkpoint, checkpoint_fingerprint
from kvpop_jax.fileio import atomic_write_bytes, make_folder
from kvpop_jax.runtime import source_digest
from train import optim
from train import step as st
from train.checkpointing import GUARD_META_KEY, Checkpointer
from train.config import FlagError, TrainConfig, check_export_dir, load_model_config
from train.export import export_params
from train.packing import DamagedDataState
from train.run_dir import (INIT_FINGERPRINT_KEY, METRICS_FILE, RESUME_CHANGES_KEY, TRAIN_CONFIG_FILE,
                           check_no_live_run_inside, check_resume, lock_run_dir, prepare_run_dir, read_metrics,
                           training_changes)
from train.setup import (build_mesh, info, jitted_step, next_rows, prepare_data, prepare_init_checkpoint,
                         run_tokenizer, step_config, to_global)
from train.teacher_cache import check_teacher_dir, read_teacher_topk

CHECKED_TERMS = ("kl", "retention_loss", "dms_loss", "loss", "grad_norm")
# Not dms_loss: it starts at 0 and grows with its target by design, a "divergence" to a median guard.
GUARDED_TERMS = ("kl", "retention_loss", "loss")
BATCH_KEYS = ("input_ids", "positions", "loss_mask", "segment_ids")


class TrainingAborted(RuntimeError):
    """The run stopped itself before saving a bad state (exit code 3 of train.main)."""


class NonFiniteLossError(TrainingAborted, FloatingPointError):
    pass


class DivergenceError(TrainingAborted):
    pass


def host_batch(cfg: TrainConfig, rows: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """This host's rows [rows, S] -> micro-batches [A, rows / A, S] (+ precomputed teacher top-k)."""
    out = {k: np.asarray(rows[k]) for k in BATCH_KEYS}
    if cfg.teacher_logits_dir:
        try:
            out.update(read_teacher_topk(cfg, step, out["input_ids"]))
        except (ValueError, FileNotFoundError) as e:  # rows of other data, a file gone since the start
            raise FlagError(str(e)) from e
    a = cfg.grad_accum
    return {k: v.reshape(a, v.shape[0] // a, *v.shape[1:]) for k, v in out.items()}


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported when a run writes events (--dry_run, throughput and
    --notensorboard runs do without the package)."""
    try:
        from tensorboardX import SummaryWriter
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"--tensorboard needs tensorboardX ({e}); `pip install tensorboardX`, "
                                  "or pass --notensorboard") from e
    return SummaryWriter


class MetricsLog:
    """metrics.jsonl (cut back to the resumed step on restart, a torn last line dropped) and TensorBoard."""

    def __init__(self, cfg: TrainConfig, start_step: int):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(cfg.run_dir, METRICS_FILE)
        self.writer = None
        written = read_metrics(self.path, sys.maxsize)
        self.records = [r for r in written if int(r["step"]) <= start_step]
        if not self.enabled:
            return
        if start_step == 0 and written:  # replaced below: said, not silent
            info(f"{self.path} holds {len(written)} records (to step {written[-1]['step']}) of a run with no "
                 "checkpoint to resume from (it stopped before its first save, or its checkpoints/ was deleted): "
                 "starting over from step 0, replacing them")
        atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        if cfg.tensorboard:
            tb = os.path.join(cfg.run_dir, "tb")
            make_folder(tb)  # a symlink to a folder not made yet (another disk): made
            self.writer = summary_writer_class()(tb, purge_step=start_step + 1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(f"train/{k}", v, step)

    def close(self, quiet: bool = False) -> None:
        """Flushes and closes the TensorBoard writer; `quiet`: an OSError doing so is dropped (another
        error is already stopping the run)."""
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:
                if not quiet:
                    raise
                _abandon_event_files(self.writer)


def _abandon_event_files(writer) -> None:
    """After a failed close (a full disk): stops tensorboardX's writer threads and marks its event files closed,
    so that its exit hook does not retry the flush and print tracebacks under the error that stopped the run.
    Best effort, on tensorboardX's internals (another version: nothing happens)."""
    for file_writer in list((getattr(writer, "all_writers", None) or {}).values()):
        events = getattr(file_writer, "event_writer", None)
        if events is None or getattr(events, "_closed", True):
            continue
        events._closed = True
        worker = getattr(events, "_worker", None)
        with contextlib.suppress(Exception):
            if worker is not None and worker.is_alive():
                worker.stop()


def check_finite(step: int, metrics: dict[str, float]) -> None:
    """Raises NonFiniteLossError naming the step and the first NaN/inf loss term, or (state_finite
    = 0) the updated parameters / optimizer state; called before the step's state is kept."""
    checked = [k for k in CHECKED_TERMS if k in metrics]  # the train step reports them all
    terms = ", ".join(f"{k}={metrics[k]}" for k in checked)
    for name in checked:
        value = metrics[name]
        if not math.isfinite(value):
            raise NonFiniteLossError(f"step {step}: {name} is {value} ({terms}); aborting without saving")
    if metrics.get("state_finite", 1.0) != 1.0:
        raise NonFiniteLossError(f"step {step}: the updated parameters or optimizer state hold NaN/inf ({terms}); "
                                 "aborting without saving")


class DivergenceGuard:
    """Stops a run whose kl, retention_loss or loss exceeds `factor` x its running median (the last
    `window` steps) once `warmup` steps are known; factor 0 turns it off. A resume seeds it from the
    checkpoint's `saved()` history (every step's terms, whatever --log_every), so that it judges like
    the uninterrupted run; `history` (metric records) seeds checkpoints written before that."""

    def __init__(self, factor: float, warmup: int, history=(), window: int = 100, saved: dict | None = None):
        self.factor, self.warmup = factor, warmup
        self.history = {t: collections.deque(maxlen=window) for t in GUARDED_TERMS}
        if saved is not None:
            for t in GUARDED_TERMS:
                self.history[t].extend(float(v) for v in saved.get(t, ()))
            return
        for record in history:
            self.add(record)

    def saved(self) -> dict[str, list[float]]:
        """The history as JSON, for a checkpoint's meta."""
        return {t: list(seen) for t, seen in self.history.items()}

    def add(self, metrics: dict[str, float]) -> None:
        for t in GUARDED_TERMS:
            if t in metrics and math.isfinite(metrics[t]):
                self.history[t].append(metrics[t])

    def check(self, step: int, metrics: dict[str, float]) -> None:
        """Raises DivergenceError naming the step and the term, else records the step."""
        for t in GUARDED_TERMS if self.factor > 0 else ():
            seen = self.history[t]
            median = float(np.median(seen)) if len(seen) >= self.warmup else 0.0
            if median > 0 and metrics[t] > self.factor * median:
                raise DivergenceError(
                    f"step {step}: {t} is {metrics[t]:.4g}, above {self.factor:g} x its running median {median:.4g} "
                    f"(--divergence_factor); the run diverged, aborting without saving (lower the learning rates)")
        self.add(metrics)


TRAINING_CODE = ("kvpop_jax", "pallas_kernels", "train", "demo")  # a resume by other code is said (`source_digest`)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs (or resumes) training in a run folder it owns (`train/run_dir.py`); returns a summary dict."""
    with lock_run_dir(cfg.run_dir):
        return _train(cfg)


def _train(cfg: TrainConfig) -> dict[str, Any]:
    if cfg.tensorboard and jax.process_index() == 0:
        summary_writer_class()  # a missing package fails here, not after minutes of loading
    check_export_dir(cfg.export_dir, cfg.init_checkpoint, cfg.checkpoint_dir)
    prepare_run_dir(cfg, delete=False)  # --noresume over a run: refused before any input is prepared
    # Every flag and input is checked (mesh, model, tokenizer, data) before --overwrite deletes anything.
    mesh = build_mesh(cfg)
    init_dir = prepare_init_checkpoint(cfg)
    if jax.process_count() > 1:  # process 0 builds RUN_DIR/init for random: models; the others read it
        multihost_utils.sync_global_devices("init checkpoint ready")
    model_config = load_model_config(dataclasses.replace(cfg, init_checkpoint=init_dir))
    try:  # the weights' headers (cheap at any size): a partial download is named here, not after the old run's
        check_checkpoint(init_dir)  # deletion, nor as a resume's "other weights"
    except (ValueError, FileNotFoundError) as e:
        raise FlagError(f"--init_checkpoint={cfg.init_checkpoint}: {e}") from e
    sc = step_config(cfg, model_config)
    kv_config = sc.model
    tokenizer, tokenizer_dir = run_tokenizer(cfg, init_dir)
    if len(tokenizer) > model_config.vocab_size:
        raise FlagError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab is {model_config.vocab_size}")
    batches = prepare_data(cfg, tokenizer)
    init_fingerprint = checkpoint_fingerprint(init_dir)  # checked on a resume, saved with every checkpoint
    if cfg.teacher_logits_dir:  # its teacher now; the steps still to train once the resume step is known
        check_teacher_dir(cfg, init_fingerprint, 0 if cfg.overwrite or not cfg.resume else None)
    prepare_run_dir(cfg, delete=jax.process_index() == 0)  # every host decides the same; one deletes
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("run folder prepared")
    tx = optim.make_optimizer(cfg.optim)
    ckpt = Checkpointer(cfg.checkpoint_dir, save_every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                        async_save=cfg.async_checkpointing)
    try:
        latest = ckpt.latest_step() if cfg.resume else None
        if latest is not None:  # before compiling or restoring: a changed shape must not reach orbax
            check_resume(ckpt.restore_meta(latest), cfg, model_config, f"{cfg.checkpoint_dir}/{latest}",
                         init_fingerprint=init_fingerprint)
            if latest > cfg.steps:
                raise FlagError(f"--steps={cfg.steps}, but {cfg.checkpoint_dir} already holds step {latest}: a resume "
                                "cannot go back (its export would be of the later step). Pass --steps >= "
                                f"{latest}, or start over with --overwrite")
        if cfg.teacher_logits_dir and cfg.resume and not cfg.overwrite:  # the others were checked from 0 above
            check_teacher_dir(cfg, init_fingerprint, latest or 0)
        summary = _run(cfg, mesh, init_dir, init_fingerprint, model_config, sc, kv_config, tx, ckpt, latest,
                       tokenizer_dir, batches)
    except BaseException:
        with contextlib.suppress(Exception):  # a failed save raises again here: the first error is the one to tell
            ckpt.close()
        raise
    ckpt.close()
    return summary


def _run(cfg, mesh, init_dir, init_fingerprint, model_config, sc, kv_config, tx, ckpt, latest, tokenizer_dir,
         batches) -> dict[str, Any]:
    step_fn, (state_sh, teacher_sh, batch_sh), (abstract_state, abstract_teacher, _) = jitted_step(
        cfg, mesh, model_config, sc, tx)

    base = teacher = None
    if latest is None or abstract_teacher is not None:
        # Base weights, placed shard by shard: the student's start and (cast) the frozen teacher.
        base_sh = shd.param_shardings(modeling.abstract_params(model_config, sc.param_dtype), mesh)
        try:
            _, base = load_pretrained(init_dir, sc.param_dtype, config=model_config, shardings=base_sh)
        except (ValueError, FileNotFoundError) as e:
            raise FlagError(f"--init_checkpoint={cfg.init_checkpoint}: {e}") from e
    if abstract_teacher is not None:
        teacher = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(sc.teacher_dtype), p),
                          out_shardings=teacher_sh)(base)
    if latest is not None:
        del base
        state, data_state, restored_meta = ckpt.restore(latest, abstract_state)
        try:
            batches.restore(data_state)
        except ValueError as e:
            advice = ("its data item was edited or damaged: move the step aside to resume from an earlier one, or "
                      "start over with --overwrite" if isinstance(e, DamagedDataState) else
                      "the data flags changed, or its data item was edited: rerun with the old flags, or start over "
                      "with --overwrite")
            raise FlagError(f"cannot resume {cfg.checkpoint_dir}/{latest}: {e} ({advice})") from e
        info(f"resumed from {cfg.checkpoint_dir}/{latest}")
    else:
        restored_meta = {}
        params = modeling.retrofit_params(kv_config, base, jax.random.PRNGKey(cfg.seed))
        del base
        state = jax.jit(lambda p: st.init_state(p, tx, cfg.seed), out_shardings=state_sh)(params)
        del params
    start = int(jax.device_get(state.step))
    run_json = json.loads(json.dumps(cfg.to_json(), default=str))
    saved_run = restored_meta.get("train_config") or {}
    history = list(saved_run.get(RESUME_CHANGES_KEY) or [])
    changes = training_changes(saved_run, cfg) if latest is not None else []
    code = source_digest(TRAINING_CODE)
    # (a finished run rerun trains no step: nothing to say; one saved by older code records no digest)
    if latest is not None and start < cfg.steps and restored_meta.get("code", code) != code:
        changes.append(f"the library's code ({', '.join(TRAINING_CODE)}; e.g. a git pull): from here its numbers may "
                       "differ in the last bits from an uninterrupted run's")
    if changes:  # accepted changes (check_resume refused the rest): said, and kept with the run
        info(f"resuming {cfg.checkpoint_dir}/{latest} with changed training settings (its first {start} steps ran "
             f"with the old ones): {'; '.join(changes)}")
        history.append({"step": start, "changes": changes})
    if history:
        run_json[RESUME_CHANGES_KEY] = history
    run_json[INIT_FINGERPRINT_KEY] = init_fingerprint  # a recipe rerun reads it without opening a checkpoint
    if jax.process_index() == 0:  # only now: a refused or failed resume leaves the old one in place
        atomic_write_bytes(os.path.join(cfg.run_dir, TRAIN_CONFIG_FILE), json.dumps(run_json, indent=2).encode())
    # The tokenizer's folder as an absolute path (train.export may run elsewhere), and what the run
    # started from, so that a resume from other weights of the same shape is refused (check_resume).
    meta = {"model_config": kv_config.to_hf(), "param_dtype": cfg.param_dtype,
            "tokenizer_dir": os.path.abspath(tokenizer_dir) if tokenizer_dir else tokenizer_dir,
            "train_config": run_json, "init_fingerprint": init_fingerprint, "code": code}

    log = MetricsLog(cfg, start)
    guard = DivergenceGuard(cfg.divergence_factor, cfg.divergence_warmup, log.records,
                            saved=restored_meta.get(GUARD_META_KEY))
    tokens_per_step = cfg.global_batch * cfg.seq_len
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step",
               disable=not cfg.progress or jax.process_index() != 0, dynamic_ncols=True)
    last = {}
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            batch = to_global(host_batch(cfg, next_rows(batches), step), batch_sh)
            state, metrics = step_fn(state, teacher, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            check_finite(step + 1, metrics)  # both before the state can be saved
            guard.check(step + 1, metrics)
            dt = time.perf_counter() - t0
            metrics["tokens_per_s"] = tokens_per_step / dt
            metrics["step_time_s"] = dt
            last = metrics
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                log.write(step + 1, metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", kl=f"{metrics['kl']:.4f}",
                            ret=f"{metrics['retention_loss']:.4f}", acc=f"{metrics['boundary_accuracy']:.3f}",
                            auc=f"{metrics['boundary_auc']:.3f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
            ckpt.save(state, batches.state(), dict(meta, **{GUARD_META_KEY: guard.saved()}),
                      force=step + 1 == cfg.steps)
        ckpt.wait()
    except BaseException:
        bar.close()
        log.close(quiet=True)  # on a full disk its flush fails too: the error that stopped the run is the one to tell
        raise
    bar.close()
    log.close()
    if cfg.export:
        if jax.process_index() == 0:  # checked at the start too: a run started in it since then (this one's own pass)
            check_no_live_run_inside(cfg.export_dir, "--export_dir")
        export_params(kv_config, state.params, cfg.export_dir, tokenizer_dir=tokenizer_dir)
        info(f"exported to {cfg.export_dir}")
    return {"steps": cfg.steps, "resumed_from": start, "last_metrics": last}
