"""The training loop of `python -m train.main`: restore or init, step, log, checkpoint, export.

Resumes from the latest checkpoint in RUN_DIR/checkpoints with the same flags and reproduces
the same losses (params, optimizer, RNG and data-iterator state are saved).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tqdm.auto import tqdm

from kvpop_jax import load_pretrained, modeling
from kvpop_jax import sharding as shd
from train import optim
from train import step as st
from train.checkpointing import Checkpointer
from train.config import FlagError, TrainConfig, load_model_config
from train.export import export_params
from train.setup import (abstract_batch, abstract_train_state, build_mesh, info, prepare_data,
                         prepare_init_checkpoint, run_tokenizer, step_config, to_global, with_shardings)
from train.teacher_cache import read_teacher_topk

CHECKED_TERMS = ("kl", "retention_loss", "loss", "grad_norm")
BATCH_KEYS = ("input_ids", "positions", "loss_mask")


class NonFiniteLossError(FloatingPointError):
    pass


def host_batch(cfg: TrainConfig, rows: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """This host's rows [rows, S] -> micro-batches [A, rows / A, S] (+ precomputed teacher top-k)."""
    out = {k: np.asarray(rows[k]) for k in BATCH_KEYS}
    if cfg.teacher_logits_dir:
        out.update(read_teacher_topk(cfg, step, len(out["input_ids"])))
    a = cfg.grad_accum
    return {k: v.reshape(a, v.shape[0] // a, *v.shape[1:]) for k, v in out.items()}


class MetricsLog:
    """metrics.jsonl (truncated to the resumed step on restart) and TensorBoard."""

    def __init__(self, cfg: TrainConfig, start_step: int):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(cfg.run_dir, "metrics.jsonl")
        self.writer = None
        if not self.enabled:
            return
        kept = []
        if os.path.isfile(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        if cfg.tensorboard:
            self.writer = SummaryWriter(os.path.join(cfg.run_dir, "tb"), purge_step=start_step + 1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(f"train/{k}", v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def check_finite(step: int, metrics: dict[str, float]) -> None:
    for name in CHECKED_TERMS:
        value = metrics[name]
        if not math.isfinite(value):
            terms = ", ".join(f"{k}={metrics[k]}" for k in CHECKED_TERMS)
            raise NonFiniteLossError(f"step {step}: {name} is {value} ({terms}); aborting without saving")


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs (or resumes) training; returns a summary dict."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    mesh = build_mesh(cfg)
    init_dir = prepare_init_checkpoint(cfg)
    model_config = load_model_config(dataclasses.replace(cfg, init_checkpoint=init_dir))
    sc = step_config(cfg, model_config)
    kv_config = sc.model
    tx = optim.make_optimizer(cfg.optim)
    if jax.process_index() == 0:
        with open(os.path.join(cfg.run_dir, "train_config.json"), "w") as f:
            json.dump(cfg.to_json(), f, indent=2, default=str)

    abstract_state = abstract_train_state(cfg, model_config, tx)
    abstract_teacher = None if cfg.teacher_logits_dir else modeling.abstract_params(model_config, sc.teacher_dtype)
    batch_like = abstract_batch(cfg, model_config)
    step_fn, state_sh, teacher_sh, batch_sh = st.jit_train_step(
        sc, tx, mesh, abstract_state, abstract_teacher, batch_like)
    tokenizer, tokenizer_dir = run_tokenizer(cfg, init_dir)
    if len(tokenizer) > model_config.vocab_size:
        raise FlagError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab is {model_config.vocab_size}")
    batches = prepare_data(cfg, tokenizer)

    ckpt = Checkpointer(cfg.checkpoint_dir, save_every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                        async_save=cfg.async_checkpointing)
    latest = ckpt.latest_step() if cfg.resume else None
    base = teacher = None
    if latest is None or abstract_teacher is not None:
        # Base weights, placed shard by shard: the student's start and (cast) the frozen teacher.
        base_sh = shd.param_shardings(modeling.abstract_params(model_config, sc.param_dtype), mesh)
        _, base = load_pretrained(init_dir, sc.param_dtype, config=model_config, shardings=base_sh)
    if abstract_teacher is not None:
        teacher = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(sc.teacher_dtype), p),
                          out_shardings=teacher_sh)(base)
    if latest is not None:
        del base
        state, data_state, _ = ckpt.restore(latest, with_shardings(abstract_state, state_sh))
        batches.restore(data_state)
        info(f"resumed from {cfg.checkpoint_dir}/{latest}")
    else:
        params = modeling.retrofit_params(kv_config, base, jax.random.PRNGKey(cfg.seed))
        del base
        state = jax.jit(lambda p: st.init_state(p, tx, cfg.seed), out_shardings=state_sh)(params)
        del params
    start = int(jax.device_get(state.step))
    meta = {"model_config": kv_config.to_hf(), "param_dtype": cfg.param_dtype, "tokenizer_dir": tokenizer_dir,
            "train_config": json.loads(json.dumps(cfg.to_json(), default=str))}

    log = MetricsLog(cfg, start)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step",
               disable=not cfg.progress or jax.process_index() != 0, dynamic_ncols=True)
    last = {}
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            batch = to_global(host_batch(cfg, next(batches), step), batch_sh)
            state, metrics = step_fn(state, teacher, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            check_finite(step + 1, metrics)
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
            ckpt.save(state, batches.state(), meta, force=step + 1 == cfg.steps)
        ckpt.wait()
    finally:
        bar.close()
        log.close()
        ckpt.close()
    if cfg.export:
        export_params(kv_config, state.params, cfg.export_dir, tokenizer_dir=tokenizer_dir)
        info(f"exported to {cfg.export_dir}")
    return {"steps": cfg.steps, "resumed_from": start, "last_metrics": last}
