"""What a training run sets up before its loop: step config, mesh, abstract state, init
checkpoint, tokenizer and data (shared by the loop, the teacher-logit cache and the dry run)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from demo.task import generate_mixture, jsonl_record, write_jsonl
from demo.tokenizer import save_tokenizer
from kvpop_jax import fileio, modeling, save_pretrained
from kvpop_jax import sharding as shd
from kvpop_jax.checkpoint import load_tokenizer
from kvpop_jax.config import Qwen3Config
from train import step as st
from train.config import DTYPES, FlagError, TrainConfig, check_devices, load_model_config
from train.packing import PackedBatchIterator
from train.run_dir import checkpoint_steps


def step_config(cfg: TrainConfig, model_config: Qwen3Config) -> st.StepConfig:
    """The step's static config; checks what needs the model (before anything compiles)."""
    if cfg.kvpop.kl_topk > model_config.vocab_size:
        raise FlagError(f"--kl_topk={cfg.kvpop.kl_topk} exceeds the model's vocab_size {model_config.vocab_size}")
    saturated = cfg.seq_len - cfg.kvpop.budget  # query positions a row can sample (Eq. 25)
    if cfg.retrofit == "kvpop" and cfg.kvpop.num_query_samples > saturated:
        info(f"note: --num_query_samples={cfg.kvpop.num_query_samples} exceeds the {saturated} saturated query "
             f"positions of a row (--seq_len={cfg.seq_len} minus B = {cfg.kvpop.budget}): positions repeat, about "
             f"{cfg.kvpop.num_query_samples / saturated:.1f} draws each, and the retention loss's memory grows with "
             "the samples (--dry_run shows it)")
    return st.StepConfig(
        model=cfg.model_retrofit(model_config),
        compute_dtype=DTYPES[cfg.compute_dtype], param_dtype=DTYPES[cfg.param_dtype],
        teacher_dtype=DTYPES[cfg.teacher_dtype], remat=cfg.remat, scan_layers=cfg.scan_layers,
        loss_chunk=cfg.loss_chunk,
        micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, seq_len=cfg.seq_len,
        precomputed_teacher=bool(cfg.teacher_logits_dir), optim=cfg.optim,
    )


def build_mesh(cfg: TrainConfig):
    try:
        mesh = shd.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    except ValueError as e:
        raise FlagError(f"--mesh_data/--mesh_fsdp/--mesh_tensor: {e}") from e
    check_devices(cfg, mesh.size, dict(mesh.shape))
    tensor = mesh.shape["tensor"]
    if tensor > 1:  # logical_to_spec drops an axis that does not divide a dim: heads whole on every device
        model = load_model_config(cfg)
        heads = {"num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads}
        bad = ", ".join(f"{k}={n}" for k, n in heads.items() if n % tensor)
        if bad:
            raise FlagError(f"--mesh_tensor={tensor} does not divide the model's {bad}: every tensor-parallel "
                            "device would hold and run those heads whole (replicated work and memory); pass a "
                            "--mesh_tensor that divides both head counts")
    return mesh


def abstract_batch(cfg: TrainConfig, model_config: Qwen3Config) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (cfg.grad_accum, cfg.micro_batch, cfg.seq_len)
    out = {"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32), "positions": jax.ShapeDtypeStruct(shape, jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32), "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32)}
    if cfg.teacher_logits_dir:
        k = cfg.kvpop.kl_topk
        out["teacher_values"] = jax.ShapeDtypeStruct(shape + (k,), jnp.float32)
        out["teacher_indices"] = jax.ShapeDtypeStruct(shape + (k,), jnp.int32)
    return out


def abstract_train_state(cfg: TrainConfig, model_config: Qwen3Config, tx):
    params = modeling.abstract_params(cfg.model_retrofit(model_config), DTYPES[cfg.param_dtype])
    return jax.eval_shape(lambda p: st.init_state(p, tx, cfg.seed), params)


def with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def jitted_step(cfg: TrainConfig, mesh, model_config: Qwen3Config, sc: st.StepConfig, tx):
    """The jitted train step, its (state, teacher, batch) shardings, and abstract (state, teacher, batch)
    arguments that carry them (the teacher None with precomputed teacher top-k)."""
    abstract_state = abstract_train_state(cfg, model_config, tx)
    abstract_teacher = None if cfg.teacher_logits_dir else modeling.abstract_params(model_config, sc.teacher_dtype)
    batch_like = abstract_batch(cfg, model_config)
    step_fn, state_sh, teacher_sh, batch_sh = st.jit_train_step(sc, tx, mesh, abstract_state, abstract_teacher,
                                                                batch_like)
    args = (with_shardings(abstract_state, state_sh),
            None if abstract_teacher is None else with_shardings(abstract_teacher, teacher_sh),
            with_shardings(batch_like, batch_sh))
    return step_fn, (state_sh, teacher_sh, batch_sh), args


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


def run_tokenizer(cfg: TrainConfig, init_dir: str):
    """(tokenizer, its directory): --tokenizer (a directory, or `demo` for the demo task's
    tokenizer) or the init checkpoint's own."""
    if cfg.tokenizer == "demo":
        path = os.path.join(cfg.run_dir, "tokenizer")
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            # Staged: the folder appears whole. Written in place, a kill between (or in) its files left a
            # folder whose tokenizer.json passes the check above with a torn or unpatched config beside it.
            with fileio.staged_directory(path) as stage:
                save_tokenizer(stage.path)
                stage.written.update(os.listdir(stage.path))
        try:
            return load_tokenizer(path), path
        except ValueError as e:  # a damaged copy (disk trouble, an edit): a traceback before
            raise FlagError(f"--tokenizer=demo: {e}; delete {path} and the run writes it again") from e
    path = cfg.tokenizer or init_dir
    try:
        return load_tokenizer(path), path
    except ValueError as e:
        raise FlagError(f"--tokenizer: {e} (pass --tokenizer=DIR, or --tokenizer=demo for the demo task)") from e


DEMO_DATA_PROBES = 2  # the first examples of a demo data file, compared with what the generator writes now


def stale_demo_data(cfg: TrainConfig) -> bool:
    """Whether the run's demo data file (--data=demo:N) exists and holds other traces than the demo generator
    writes now: the file is named by the flags that shape it, not by the code, and a `git pull` that changed the
    generator (the trace format, a task) left the old traces in use without a word. Its first examples are
    compared: a change of the trace format shows there; one confined to rarer traces may not."""
    path = cfg.data.data
    if not cfg.demo_examples or not os.path.isfile(path):
        return False
    fresh = generate_mixture(min(cfg.demo_examples, DEMO_DATA_PROBES), cfg.seed, "train", cfg.demo_tasks,
                             seq_len=cfg.demo_seq_len)
    with open(path, encoding="utf-8", errors="replace") as f:
        head = [f.readline() for _ in fresh]
    written = [json.loads(json.dumps(jsonl_record(ex))) for ex in fresh]
    try:
        return [json.loads(line) for line in head] != written
    except ValueError:  # not JSON: damaged, so not the generator's either
        return True


def prepare_data(cfg: TrainConfig, tokenizer) -> PackedBatchIterator:
    """The packed-batch iterator of the run (writes the generated demo data first for demo:N; a demo data file of
    an older generator is written again, or refused when this run already trained on it)."""
    data_config = dataclasses.replace(cfg.data, process_index=jax.process_index(), process_count=jax.process_count())
    if cfg.demo_examples:
        stale = stale_demo_data(cfg)  # every process, before any writes
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("demo data checked")
        if stale and cfg.resume and not cfg.overwrite and checkpoint_steps(cfg):
            raise FlagError(f"--data=demo:{cfg.demo_examples}: {data_config.data} holds traces the demo generator no "
                            "longer writes (the library changed since this run started on them), so a resume would "
                            "change its data mid-run: resume with the code that started it, or pass --overwrite to "
                            "start over on the new traces")
        if (stale or not os.path.isfile(data_config.data)) and jax.process_index() == 0:
            if stale:
                info(f"--data=demo:{cfg.demo_examples}: {data_config.data} holds traces an older demo generator "
                     "wrote; written again with the current one")
            os.makedirs(os.path.dirname(data_config.data), exist_ok=True)
            write_jsonl(data_config.data, generate_mixture(cfg.demo_examples, cfg.seed, "train", cfg.demo_tasks,
                                                           seq_len=cfg.demo_seq_len))  # atomic
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("demo data written")
    try:
        batches = PackedBatchIterator(data_config, tokenizer)
    except ValueError as e:  # no usable text, a bad line, an empty file: named, one line at the CLI
        raise FlagError(f"--data: {e}") from e
    if batches.num_documents is not None:  # read up front: say what was left out, once
        stats = batches.stats
        dropped = {k: v for k, v in sorted(stats.items()) if k != "kept" and v}
        if dropped:
            why = {"too_long": f"longer than {data_config.length_limit} tokens (--max_length; --split_documents "
                               "packs cut documents)",
                   "too_short": f"under --min_length={data_config.min_length} tokens",
                   "no_text": "no text in the field read"}
            info(f"data: kept {stats.get('kept', 0)} of {sum(stats.values())} documents; left out "
                 + "; ".join(f"{n} {why.get(k, k)}" for k, n in dropped.items()))
        read = cfg.optim.steps * cfg.global_batch * cfg.seq_len  # every host packs the whole global batch
        passes = read / max(1, batches.num_tokens)
        if passes >= 2:  # a sample file under a paper recipe: hours on the same few documents
            info(f"data: note: the {batches.num_documents} kept documents hold {batches.num_tokens} tokens, and "
                 f"--steps={cfg.optim.steps} x --global_batch={cfg.global_batch} x --seq_len={cfg.seq_len} read "
                 f"{read} token slots: about {passes:.0f} passes over the same documents (more --data or fewer "
                 "--steps to avoid that)")
    return batches


def next_rows(batches: PackedBatchIterator) -> dict[str, np.ndarray]:
    """The next packed batch; a data error met on the way (a stream's bad line) is a FlagError."""
    try:
        return next(batches)
    except ValueError as e:
        raise FlagError(f"--data: {e}") from e


def to_global(batch: dict[str, np.ndarray], shardings: dict) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in batch.items()}
