"""Precomputed teacher top-k logits (`--write_teacher_logits`, `--teacher_logits_dir`).

One file per optimizer step, `step_{N:08d}.npz` with `values` float32 and `indices` int32 of
shape [global batch, S, kl_topk]: the global batch's teacher top-k, so a run can distill
without holding the teacher. Each file also holds `row_hashes` uint64 [global batch], a hash of
every row's token ids: a run whose data differs from the one the file was written for (another
--data, seed, seq_len or batch) stops with an error instead of distilling from the wrong rows.
The demo recipe writes one such directory and shares it between its variants (`train.recipe`).
`teacher.json` records the teacher's weights (`checkpoint_fingerprint` of --init_checkpoint): a run
from other weights, or a write of another teacher's files into it, is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys

import jax
import numpy as np
from tqdm.auto import tqdm

from kvpop_jax import load_pretrained, modeling
from kvpop_jax import sharding as shd
from kvpop_jax.checkpoint import checkpoint_fingerprint
from kvpop_jax.fileio import atomic_file, atomic_write_bytes
from train import step as st
from train.config import FlagError, TrainConfig, load_model_config
from train.run_dir import lock_run_dir
from train.setup import build_mesh, next_rows, prepare_data, prepare_init_checkpoint, run_tokenizer, step_config


TEACHER_META = "teacher.json"  # {"init_fingerprint": ...}: the weights the files were computed with


def teacher_file(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.npz")


def step_files(directory: str) -> list[str]:
    """The step files in a teacher top-k directory (none where there is no directory)."""
    return sorted(f for f in os.listdir(directory) if f.startswith("step_")) if os.path.isdir(directory) else []


def _recorded_fingerprint(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, TEACHER_META)) as f:
            return json.load(f).get("init_fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _same_teacher(directory: str, init_fingerprint: str, refusal: str) -> str | None:
    """The fingerprint `directory` records (None: none recorded); FlagError(refusal) if it is another teacher's."""
    recorded = _recorded_fingerprint(directory)
    if recorded is not None and recorded != init_fingerprint:
        raise FlagError(refusal)
    return recorded


def claim_teacher_dir(directory: str, init_fingerprint: str, init_checkpoint: str | None) -> None:
    """Records which teacher writes into `directory`, or refuses one holding another teacher's top-k
    (a run would then distill from the wrong model without a word)."""
    refusal = (f"--teacher_logits_dir={directory} holds another teacher's top-k (other weights than "
               f"--init_checkpoint={init_checkpoint}); choose another directory or empty it")
    if _same_teacher(directory, init_fingerprint, refusal) is None:
        older = step_files(directory)
        if older:  # written before teacher.json was: nothing says by which teacher
            print(f"warning: --teacher_logits_dir={directory} holds {len(older)} step files without {TEACHER_META}; "
                  f"they are taken as --init_checkpoint={init_checkpoint}'s (empty the directory if not)",
                  file=sys.stderr)
        os.makedirs(directory, exist_ok=True)
        atomic_write_bytes(os.path.join(directory, TEACHER_META),
                           json.dumps({"init_fingerprint": init_fingerprint}).encode())


def check_teacher_dir(cfg: TrainConfig, init_fingerprint: str, start: int | None) -> None:
    """Before a run distills from `--teacher_logits_dir`: the files were written by this run's teacher
    (where the directory records it) and every step from `start` on has its file (None: not checked)."""
    directory = cfg.teacher_logits_dir
    _same_teacher(directory, init_fingerprint, f"--teacher_logits_dir={directory} holds the top-k of another teacher "
                  f"than --init_checkpoint={cfg.init_checkpoint}: rewrite it with --write_teacher_logits")
    if start is None:
        return
    if not os.path.isdir(directory):
        raise FlagError(f"--teacher_logits_dir={directory} does not exist; write it first with --write_teacher_logits")
    missing = [step for step in range(start, cfg.steps) if not os.path.isfile(teacher_file(directory, step))]
    if missing:
        raise FlagError(f"--teacher_logits_dir={directory} lacks the files of {len(missing)} of steps {start}.."
                        f"{cfg.steps - 1} (the first: {teacher_file(directory, missing[0])}); write them with "
                        f"--write_teacher_logits --steps={cfg.steps}")


def row_hashes(input_ids: np.ndarray) -> np.ndarray:
    """uint64 [rows]: an 8-byte BLAKE2b digest of each row's int32 token ids."""
    rows = np.ascontiguousarray(np.asarray(input_ids, np.int32))
    return np.asarray([int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little") for r in rows],
                      np.uint64)


def write_teacher_topk(directory: str, step: int, values: np.ndarray, indices: np.ndarray,
                       input_ids: np.ndarray) -> None:
    """Stores the global batch's teacher top-k of optimizer step `step` (0-based): [B, S, K] each
    (float32 values + int32 indices: 8 bytes per entry, ~4.3 GB per step of the paper's recipe),
    with the hashes of the rows `input_ids` [B, S] it was computed from. Atomic (a synced tmp + rename: a
    crash never leaves a torn file under the name a rerun takes as written); a failed write (a full disk)
    removes its partial tmp, which would otherwise hold on to the space a rerun needs."""
    os.makedirs(directory, exist_ok=True)
    path = teacher_file(directory, step)
    with atomic_file(path, tmp=path + ".tmp") as f:  # the folder's lock makes this writer the name's owner
        np.savez(f, values=np.asarray(values, np.float32), indices=np.asarray(indices, np.int32),
                 row_hashes=row_hashes(input_ids))


def read_teacher_topk(cfg: TrainConfig, step: int, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """This host's rows of step `step`'s teacher top-k, checked against the rows it trains on:
    input_ids [host rows, S] must be the rows the file was written for."""
    path = teacher_file(cfg.teacher_logits_dir, step)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--teacher_logits_dir: {path} is missing (one file per optimizer step)")
    with np.load(path) as f:
        values, indices = f["values"], f["indices"]
        hashes = f["row_hashes"] if "row_hashes" in f.files else None
    want = (cfg.global_batch, cfg.seq_len, cfg.kvpop.kl_topk)
    if values.shape != want or indices.shape != want:
        raise ValueError(f"{path}: values/indices must be {want}, got {values.shape}, {indices.shape}")
    host_rows = len(input_ids)
    lo = jax.process_index() * host_rows
    if hashes is None:
        raise ValueError(f"{path} has no row_hashes: it was written before they were recorded, so nothing shows "
                         "it matches this run's data; rewrite it with --write_teacher_logits")
    if not np.array_equal(hashes[lo:lo + host_rows], row_hashes(input_ids)):
        raise ValueError(f"{path} was written for other rows than step {step} of this run trains on (another "
                         "--data, seed, seq_len or batch?); rewrite --teacher_logits_dir with --write_teacher_logits")
    return {"teacher_values": values[lo:lo + host_rows].astype(np.float32),
            "teacher_indices": indices[lo:lo + host_rows]}


def write_teacher_logits(cfg: TrainConfig) -> int:
    """Runs the frozen teacher over the batches of steps [0, steps) and writes their top-k, holding
    the directory's lock: a second writer is refused at once (two would write one step's file
    together)."""
    with lock_run_dir(cfg.teacher_logits_dir, what="teacher top-k folder", flag="--teacher_logits_dir"):
        return _write_teacher_logits(cfg)


def _write_teacher_logits(cfg: TrainConfig) -> int:
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

    claim_teacher_dir(cfg.teacher_logits_dir, checkpoint_fingerprint(init_dir), cfg.init_checkpoint)
    tokenizer, _ = run_tokenizer(cfg, init_dir)
    batches = prepare_data(cfg, tokenizer)
    b = cfg.micro_batch
    for step in tqdm(range(cfg.steps), desc="teacher top-k", disable=not cfg.progress):
        rows = next_rows(batches)
        if os.path.isfile(teacher_file(cfg.teacher_logits_dir, step)):
            continue
        parts = []  # one micro-batch at a time, as the train step runs the teacher
        for lo in range(0, cfg.global_batch, b):
            ids, pos = (jax.device_put(rows[k][lo:lo + b], rows_sh) for k in ("input_ids", "positions"))
            parts.append(jax.device_get(topk(params, ids, pos)))
        write_teacher_topk(cfg.teacher_logits_dir, step, np.concatenate([p[0] for p in parts]),
                           np.concatenate([p[1] for p in parts]), rows["input_ids"])
    return cfg.steps
