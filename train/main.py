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

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging

from kvpop_jax import load_pretrained, modeling, save_pretrained
from kvpop_jax import sharding as shd
from kvpop_jax.config import Qwen3Config
from train import optim
from train import step as st
from train.flags import FlagError, TrainConfig, check_devices, config_from_flags, define_flags, load_model_config

FLAGS = flags.FLAGS
define_flags(FLAGS)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
CHECKED_TERMS = ("kl", "retention_loss", "loss", "grad_norm")
BATCH_KEYS = ("input_ids", "positions", "loss_mask")


class NonFiniteLossError(FloatingPointError):
    pass


# ------------------------------------------------------------------------------ set-up


def step_config(cfg: TrainConfig, model_config: Qwen3Config) -> st.StepConfig:
    return st.StepConfig(
        model=dataclasses.replace(model_config, kvpop=cfg.kvpop),
        compute_dtype=DTYPES[cfg.compute_dtype], param_dtype=DTYPES[cfg.param_dtype],
        teacher_dtype=DTYPES[cfg.teacher_dtype], remat=cfg.remat, loss_chunk=cfg.loss_chunk,
        micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, seq_len=cfg.seq_len,
        precomputed_teacher=bool(cfg.teacher_logits_dir), optim=cfg.optim,
    )


def build_mesh(cfg: TrainConfig):
    try:
        mesh = shd.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    except ValueError as e:
        raise FlagError(f"--mesh_data/--mesh_fsdp/--mesh_tensor: {e}") from e
    check_devices(cfg, mesh.size, dict(mesh.shape))
    return mesh


def abstract_batch(cfg: TrainConfig, model_config: Qwen3Config) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (cfg.grad_accum, cfg.micro_batch, cfg.seq_len)
    out = {"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32), "positions": jax.ShapeDtypeStruct(shape, jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32)}
    if cfg.teacher_logits_dir:
        k = cfg.kvpop.kl_topk
        out["teacher_values"] = jax.ShapeDtypeStruct(shape + (k,), jnp.float32)
        out["teacher_indices"] = jax.ShapeDtypeStruct(shape + (k,), jnp.int32)
    return out


def abstract_train_state(cfg: TrainConfig, model_config: Qwen3Config, tx):
    kv_config = dataclasses.replace(model_config, kvpop=cfg.kvpop)
    params = modeling.abstract_params(kv_config, DTYPES[cfg.param_dtype])
    return jax.eval_shape(lambda p: st.init_state(p, tx, cfg.seed), params)


def with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def info(message: str) -> None:
    """A progress message on process 0 (absl/orbax INFO logs are silenced)."""
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def prepare_init_checkpoint(cfg: TrainConfig) -> str:
    """The HF directory the run starts from; builds RUN_DIR/init for `random:` models."""
    if not cfg.random_init:
        return cfg.init_checkpoint
    path = os.path.join(cfg.run_dir, "init")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config = Qwen3Config.from_hf(cfg.random_init)
    if jax.process_index() == 0:
        info(f"building a random {config.num_hidden_layers}-layer Qwen3 from {cfg.random_init} in {path}")
        params = modeling.init_params(config, jax.random.PRNGKey(cfg.seed))
        save_pretrained(config, params, path)
    return path


def load_tokenizer(cfg: TrainConfig, init_dir: str):
    """--tokenizer (a directory, or `demo` for the demo task's tokenizer) or the checkpoint's own."""
    from train.data import load_tokenizer as load_dir

    if cfg.tokenizer == "demo":
        from eval.demo_tokenizer import save_tokenizer

        path = os.path.join(cfg.run_dir, "tokenizer")
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            save_tokenizer(path)
        return load_dir(path), path
    path = cfg.tokenizer or init_dir
    try:
        return load_dir(path), path
    except ValueError as e:
        raise FlagError(f"--tokenizer: {e} (pass --tokenizer=DIR, or --tokenizer=demo for the demo task)") from e


def prepare_data(cfg: TrainConfig, tokenizer):
    from train.data import PackedBatchIterator

    data_config = dataclasses.replace(cfg.data, process_index=jax.process_index(), process_count=jax.process_count())
    if cfg.demo_examples:
        if not os.path.isfile(data_config.data) and jax.process_index() == 0:
            from eval.demo_task import generate_dataset, write_jsonl

            os.makedirs(os.path.dirname(data_config.data), exist_ok=True)
            tmp = data_config.data + ".tmp"
            write_jsonl(tmp, generate_dataset(cfg.demo_examples, cfg.seed, "train", seq_len=cfg.demo_seq_len))
            os.replace(tmp, data_config.data)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("demo data written")
    return PackedBatchIterator(data_config, tokenizer)


def host_batch(cfg: TrainConfig, rows: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """This host's rows [rows, S] -> micro-batches [A, rows / A, S] (+ precomputed teacher top-k)."""
    out = {k: np.asarray(rows[k]) for k in BATCH_KEYS}
    if cfg.teacher_logits_dir:
        out.update(read_teacher_topk(cfg, step, len(out["input_ids"])))
    a = cfg.grad_accum
    return {k: v.reshape(a, v.shape[0] // a, *v.shape[1:]) for k, v in out.items()}


def teacher_file(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.npz")


def write_teacher_topk(directory: str, step: int, values: np.ndarray, indices: np.ndarray) -> None:
    """Stores the global batch's teacher top-k of optimizer step `step` (0-based): [B, S, K] each
    (float32 values + int32 indices: 8 bytes per entry, ~4.3 GB per step of the paper's recipe)."""
    os.makedirs(directory, exist_ok=True)
    path = teacher_file(directory, step)
    with open(path + ".tmp", "wb") as f:
        np.savez(f, values=np.asarray(values, np.float32), indices=np.asarray(indices, np.int32))
    os.replace(path + ".tmp", path)


def read_teacher_topk(cfg: TrainConfig, step: int, host_rows: int) -> dict[str, np.ndarray]:
    path = teacher_file(cfg.teacher_logits_dir, step)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--teacher_logits_dir: {path} is missing (one file per optimizer step)")
    with np.load(path) as f:
        values, indices = f["values"], f["indices"]
    want = (cfg.global_batch, cfg.seq_len, cfg.kvpop.kl_topk)
    if values.shape != want or indices.shape != want:
        raise ValueError(f"{path}: values/indices must be {want}, got {values.shape}, {indices.shape}")
    lo = jax.process_index() * host_rows
    return {"teacher_values": values[lo:lo + host_rows].astype(np.float32),
            "teacher_indices": indices[lo:lo + host_rows]}


def to_global(batch: dict[str, np.ndarray], shardings: dict) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in batch.items()}


# ------------------------------------------------------------------------------ logging


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
            from tensorboardX import SummaryWriter

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


# ------------------------------------------------------------------------------ run


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs (or resumes) training; returns a summary dict."""
    from tqdm.auto import tqdm

    from train.checkpointing import Checkpointer
    from train.export import export_params

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
    tokenizer, tokenizer_dir = load_tokenizer(cfg, init_dir)
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


def write_teacher_logits(cfg: TrainConfig) -> int:
    """Runs the frozen teacher over the batches of steps [0, steps) and writes their top-k."""
    from tqdm.auto import tqdm

    mesh = build_mesh(cfg)
    init_dir = prepare_init_checkpoint(cfg)
    model_config = load_model_config(dataclasses.replace(cfg, init_checkpoint=init_dir))
    sc = step_config(cfg, model_config)
    _, teacher = st.build_models(sc)
    teacher_sh = shd.param_shardings(modeling.abstract_params(model_config, sc.teacher_dtype), mesh)
    _, params = load_pretrained(init_dir, sc.teacher_dtype, config=model_config, shardings=teacher_sh)
    if jax.process_count() > 1:
        raise FlagError("--write_teacher_logits runs on one host (it writes the global batch from process 0)")
    rows_sh = shd.batch_sharding(mesh, 2)
    out_sh = shd.batch_sharding(mesh, 3)
    chunk = cfg.loss_chunk or cfg.seq_len

    @functools.partial(jax.jit, out_shardings=(out_sh, out_sh))
    def topk(p, ids, pos):
        with shd.activate(mesh):
            return st.teacher_topk_logits(teacher, p, ids, pos, cfg.kvpop.kl_topk, chunk)

    tokenizer, _ = load_tokenizer(cfg, init_dir)
    batches = prepare_data(cfg, tokenizer)
    b = cfg.micro_batch
    for step in tqdm(range(cfg.steps), desc="teacher top-k", disable=not cfg.progress):
        rows = next(batches)
        if os.path.isfile(teacher_file(cfg.teacher_logits_dir, step)):
            continue
        parts = []  # one micro-batch at a time, as the train step runs the teacher
        for lo in range(0, cfg.global_batch, b):
            ids, pos = (jax.device_put(rows[k][lo:lo + b], rows_sh) for k in ("input_ids", "positions"))
            parts.append(jax.device_get(topk(params, ids, pos)))
        write_teacher_topk(cfg.teacher_logits_dir, step, np.concatenate([p[0] for p in parts]),
                           np.concatenate([p[1] for p in parts]))
    return cfg.steps


# ------------------------------------------------------------------------------ dry run


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def dry_run(cfg: TrainConfig) -> dict[str, int]:
    """Lowers + compiles the step for the real shapes on abstract arrays; prints per-device bytes."""
    mesh = build_mesh(cfg)
    model_config = load_model_config(cfg)
    sc = step_config(cfg, model_config)
    tx = optim.make_optimizer(cfg.optim)
    abstract_state = abstract_train_state(cfg, model_config, tx)
    abstract_teacher = None if cfg.teacher_logits_dir else modeling.abstract_params(model_config, sc.teacher_dtype)
    batch_like = abstract_batch(cfg, model_config)
    step_fn, state_sh, teacher_sh, batch_sh = st.jit_train_step(
        sc, tx, mesh, abstract_state, abstract_teacher, batch_like)
    args = (with_shardings(abstract_state, state_sh),
            None if abstract_teacher is None else with_shardings(abstract_teacher, teacher_sh),
            with_shardings(batch_like, batch_sh))
    t0 = time.perf_counter()
    lowered = step_fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    analysis = compiled.memory_analysis()
    report = {
        "devices": mesh.size,
        "params": shd.per_device_bytes(abstract_state.params, state_sh.params),
        "opt_state": shd.per_device_bytes(abstract_state.opt_state, state_sh.opt_state),
        "teacher": 0 if abstract_teacher is None else shd.per_device_bytes(abstract_teacher, teacher_sh),
        "batch": shd.per_device_bytes(batch_like, batch_sh),
    }
    for name in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes"):
        report[name] = int(getattr(analysis, name, 0) or 0) if analysis is not None else -1
    peak = report["argument_size_in_bytes"] + report["output_size_in_bytes"] - report["alias_size_in_bytes"] \
        + report["temp_size_in_bytes"]
    report["peak_estimate"] = peak
    mesh_desc = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
    print(f"dry run: {model_config.num_hidden_layers} layers, hidden {model_config.hidden_size}, "
          f"S={cfg.seq_len}, global batch {cfg.global_batch} = {cfg.grad_accum} x micro {cfg.micro_batch}, "
          f"B={cfg.kvpop.budget} (s={cfg.kvpop.sinks}, w={cfg.kvpop.window}, k={cfg.kvpop.topk}), "
          f"scorer {cfg.kvpop.scorer}, remat {cfg.remat}, loss_chunk {cfg.loss_chunk or cfg.seq_len}, "
          f"{cfg.compute_dtype} compute, {cfg.param_dtype} params, {cfg.teacher_dtype} teacher")
    print(f"mesh {mesh_desc} on {mesh.size} {jax.devices()[0].platform} devices; "
          f"lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s")
    print("per-device bytes:")
    for name in ("params", "opt_state", "teacher", "batch", "argument_size_in_bytes", "output_size_in_bytes",
                 "alias_size_in_bytes", "temp_size_in_bytes", "peak_estimate"):
        print(f"  {name:24s} {_gb(report[name]):>12s}  ({report[name]} bytes)")
    sys.stdout.flush()
    return report


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file it writes at INFO
    try:
        shd.maybe_initialize_distributed(FLAGS.distributed)  # before anything touches a device
        cfg = config_from_flags(FLAGS, on_accelerator=True if FLAGS.dry_run else None)
        if cfg.dry_run:
            dry_run(cfg)
        elif cfg.write_teacher_logits:
            write_teacher_logits(cfg)
        elif cfg.variants or cfg.evaluation is not None:
            from train import recipe

            recipe.run(cfg, sys.modules[__name__])
        else:
            train(cfg)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    app.run(main)
