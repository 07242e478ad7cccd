"""A run folder belongs to one run: a lock, an explicit `--overwrite`, and a resume that keeps its shapes.

    with lock_run_dir(cfg.run_dir):      # "run folder ... in use by PID 1234" if another process holds it
        prepare_run_dir(cfg)             # --overwrite clears it; --noresume over a run is refused
        check_resume(saved, cfg, model)  # a changed budget/scorer/width/seq_len/model is refused by flag

The lock is `RUN_DIR/run.lock` (`kvpop_jax.fileio.lock_folder`, which eval's report folders use too): an
exclusive `flock` (released by the kernel when its process dies, so a stale lock of a dead PID is simply
taken over) holding the owner's PID for the message. It is reentrant within a process (the recipe holds
RUN_DIR while each variant holds RUN_DIR/NAME).

`read_metrics` reads RUN_DIR/metrics.jsonl for a resume: a torn last line (a kill mid-write) is
dropped; a bad line before the last is an error naming the file and line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
from typing import Any

from kvpop_jax.config import KVpopConfig, Qwen3Config
from kvpop_jax.fileio import LOCK_FILE, lock_folder, locked_elsewhere
from train.config import FlagError, TrainConfig

METRICS_FILE = "metrics.jsonl"
TRAIN_CONFIG_FILE = "train_config.json"
INIT_FINGERPRINT_KEY = "init_fingerprint"  # in train_config.json: the teacher a finished run distilled from
# train_config.json's record of settings changed at resumes: [{"step": N, "changes": ["FIELD OLD -> NEW", ...]}].
RESUME_CHANGES_KEY = "resume_changes"
# What a run writes into its folder and --overwrite deletes (init/, data/ and tokenizer/ are inputs).
RUN_OUTPUTS = ("checkpoints", METRICS_FILE, "tb", TRAIN_CONFIG_FILE)

# Settings a resumed run must keep: the KVpop fields that shape the parameters or the policy
# (flag name, or the field for those without a flag), the sequence length, batch and dtype.
RESUME_KVPOP_FIELDS = ("sinks", "window", "topk", "scorer", "scorer_hidden", "scorer_keys", "mlstm_dim",
                       "mlstm_feature_map", "mlstm_value", "mlstm_skip", "mlstm_norm", "mlstm_init", "mlstm_chunk", "mlstm_gate_softcap",
                       "delayed_readout", "gamma_min", "gamma_max", "decay_step", "eps", "aggregate",
                       "count_normalize", "normalizer", "target_reduce", "target_lookahead")
KVPOP_FLAGS = ("sinks", "window", "topk", "scorer", "scorer_hidden", "scorer_keys", "mlstm_dim", "mlstm_feature_map",
               "mlstm_value", "mlstm_skip", "mlstm_norm", "mlstm_init", "mlstm_gate_softcap", "gamma_min", "gamma_max", "aggregate",
               "normalizer", "target_reduce", "target_lookahead")
# --micro_batch too: the KL is a mean of per-micro-batch means, each micro-batch with its own query
# samples, so another split trains other weights (a resume would silently leave the uninterrupted run).
RESUME_RUN_FIELDS = ("seq_len", "global_batch", "micro_batch", "param_dtype", "demo_examples", "demo_seq_len",
                     "demo_tasks", "retrofit")
# Where the documents come from (train_config.json's `data` block) -> its flag. The data iterator's own
# fingerprint counts documents, so another file with as many kept documents would pass without these.
RESUME_DATA_FIELDS = {"data": "--data", "text_field": "--text_field", "split": "--data_split",
                      "subset": "--data_subset"}
# A DMS run (--retrofit=dms) also keeps the DMS fields that shape its gates or its eviction target.
RESUME_DMS_FIELDS = ("window", "budget", "target_eviction", "gate_hidden", "logit_scale", "logit_offset")
DMS_FLAGS = {"window": "--dms_window", "logit_scale": "--dms_logit_scale", "logit_offset": "--dms_logit_offset"}
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
               "attention_bias")

_overwritten: set[str] = set()  # run folders whose outputs --overwrite deleted in this process


def lock_run_dir(run_dir: str, what: str = "run folder",
                 flag: str = "--run_dir") -> contextlib.AbstractContextManager[None]:
    """Holds RUN_DIR/run.lock (creating RUN_DIR; `kvpop_jax.fileio.lock_folder`, reentrant) or raises
    FlagError naming the PID that holds it (the folder called `what`, chosen by `flag`)."""
    return lock_folder(run_dir, what, flag, error=FlagError)


def check_no_live_run_inside(folder: str, flag: str, depth: int = 3) -> None:
    """Refuses (FlagError) an export folder that is or holds a folder another live process has locked (a run, a
    teacher top-k folder; `depth` levels down, checkpoint trees skipped): the export replaces its folder whole,
    carrying over what it finds, so what that process writes in the meantime (a checkpoint step) would be lost."""
    real = os.path.realpath(folder)
    for root, dirs, files in os.walk(real) if os.path.isdir(real) else ():
        if root[len(real):].count(os.sep) >= depth:
            dirs[:] = []
        dirs[:] = [d for d in dirs if d != "checkpoints"]
        pid = locked_elsewhere(os.path.join(root, LOCK_FILE)) if LOCK_FILE in files else None
        if pid is not None:
            where = "is" if root == real else "holds"
            raise FlagError(f"{flag}={folder} {where} the folder {root}, in use by PID {pid or '?'}: the export "
                            f"replaces {real} whole, so what that process writes there meanwhile would be lost; "
                            f"choose another {flag}, or wait for that process")


def resume_advice(resume: bool, overwrite: bool, run_dir: str) -> str:
    """What Ctrl-C prints: how to rerun the command (`--resume`, `--overwrite` as given) to go on where it
    stopped. With --overwrite that depends on whether it has deleted a run's outputs yet: stopped before (while
    it read the data, say), the folder still holds the old run, which a rerun without --overwrite would resume
    (and export) as if it were the new one."""
    if overwrite and not _overwritten:
        return f"interrupted before --overwrite deleted anything in {run_dir}; rerun the same command to start over"
    how = ("the same command" if resume and not overwrite else
           "the command without --overwrite/--noresume (with them it would start over)")
    return f"interrupted; rerun {how} to resume from the last checkpoint in {run_dir}"


def step_folders(directory: str) -> list[int]:
    """The finished step folders under a checkpoint folder (orbax's layout: an unfinished save is
    `N.orbax-checkpoint-tmp`), read from disk without opening orbax."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def checkpoint_steps(cfg: TrainConfig) -> list[int]:
    """Step directories under RUN_DIR/checkpoints."""
    return step_folders(cfg.checkpoint_dir)


def prepare_run_dir(cfg: TrainConfig, *, delete: bool = True) -> None:
    """--overwrite deletes the run's outputs (where `delete`: process 0); without it, --noresume over
    a run is refused."""
    if cfg.overwrite:
        for name in RUN_OUTPUTS if delete else ():
            _overwritten.add(os.path.realpath(cfg.run_dir))  # from the first deletion on
            _delete_output(os.path.join(cfg.run_dir, name))
        return
    if not cfg.resume and (held := held_run(cfg)):  # a resume need not list the folder
        raise FlagError(f"--noresume would start over in {cfg.run_dir}, which holds a run's {held}; pass "
                        "--overwrite to delete it, resume without --noresume, or choose another --run_dir")
    for link, lost in ((cfg.checkpoint_dir, "start over without its checkpoints"),
                       (os.path.join(cfg.run_dir, "tb"), "write its TensorBoard events apart from the earlier ones")):
        # linked to another disk, not mounted now: what the run wrote there is there, not lost
        if os.path.islink(link) and not os.path.exists(link) and (held := held_run(cfg)):
            raise FlagError(f"{link} links to {os.readlink(link)}, which does not exist (a disk not mounted?), and "
                            f"{cfg.run_dir} holds a run's {held}: resuming would {lost}; mount that disk (or fix "
                            "the link) and rerun, or pass --overwrite to start over")


def held_run(cfg: TrainConfig) -> str | None:
    """What of a run RUN_DIR holds ("checkpoints (steps 30, 60)" or "metrics.jsonl"), or None."""
    steps = checkpoint_steps(cfg)
    if steps:
        return f"checkpoints (steps {', '.join(map(str, steps))})"
    metrics = os.path.join(cfg.run_dir, METRICS_FILE)
    return METRICS_FILE if os.path.isfile(metrics) and os.path.getsize(metrics) > 0 else None


# In a RUN_OUTPUTS folder that is a symlink (to another disk, or a shared TensorBoard folder): what the run wrote
# there (orbax's step folders `N` and unfinished `N.orbax-checkpoint-tmp`; tensorboardX's event files).
LINKED_OUTPUTS = {"checkpoints": lambda entry: entry.split(".", 1)[0].isdigit(),
                  "tb": lambda entry: entry.startswith("events.out.tfevents.")}


def _delete_output(path: str) -> None:
    """Deletes one of a run's outputs. A symlink to a folder (checkpoints/ on a bigger disk) keeps the link and
    loses what the run wrote in it (LINKED_OUTPUTS; anything else there is kept, with a note): the new run writes
    where the old one did (shutil.rmtree refuses a link, which stopped --overwrite with a traceback)."""
    if os.path.islink(path) and os.path.isdir(path):
        ours = LINKED_OUTPUTS.get(os.path.basename(path), lambda entry: False)
        kept = []
        for entry in sorted(os.listdir(path)):
            if ours(entry):
                _delete_output_entry(os.path.join(path, entry))
            else:
                kept.append(entry)
        if kept:
            print(f"--overwrite: kept {len(kept)} entries of {path} -> {os.path.realpath(path)} that are not the "
                  f"run's ({', '.join(kept[:5])}{', ...' if len(kept) > 5 else ''})", file=sys.stderr)
    else:
        _delete_output_entry(path)


def _delete_output_entry(path: str) -> None:
    """A folder (not a link to one) with its contents, or a file or a link."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _same_path(value):
    """One file or folder however it is spelled (relative, absolute, a trailing slash); other values as they are."""
    return os.path.realpath(value) if isinstance(value, str) and value and os.path.exists(value) else value


def check_resume(saved: dict[str, Any], cfg: TrainConfig, model_config: Qwen3Config, where: str,
                 init_fingerprint: str | None = None) -> None:
    """Refuses to resume a checkpoint (its meta: `saved`) under changed shape- or policy-relevant settings,
    or from other initial weights (`kvpop_jax.checkpoint.checkpoint_fingerprint` of --init_checkpoint,
    where both the checkpoint and the caller have one): the frozen teacher would change mid-run."""
    old_run = saved.get("train_config") or {}
    changes = []
    old_fingerprint = saved.get("init_fingerprint")
    if old_fingerprint and init_fingerprint and old_fingerprint != init_fingerprint:
        changes.append(f"--init_checkpoint={cfg.init_checkpoint} holds other weights than the run started from "
                       f"(it started from {old_run.get('init_checkpoint')!r}; the teacher would change mid-run)")
    old_kvpop = old_run.get("kvpop") or {}
    new_kvpop = dataclasses.asdict(cfg.kvpop)
    defaults = {f.name: f.default for f in dataclasses.fields(KVpopConfig)}
    for field in RESUME_KVPOP_FIELDS if old_kvpop else ():
        old = old_kvpop.get(field, defaults[field])  # a field newer than the saved run: it ran with the default
        if old != new_kvpop[field]:
            name = f"--{field}" if field in KVPOP_FLAGS else f"kvpop.{field}"
            changes.append(f"{name} {old!r} -> {new_kvpop[field]!r}")
    old_dms, new_dms = old_run.get("dms") or {}, dataclasses.asdict(cfg.dms) if cfg.dms is not None else {}
    for field in RESUME_DMS_FIELDS if cfg.retrofit == "dms" else ():
        if field in old_dms and old_dms[field] != new_dms[field]:
            changes.append(f"{DMS_FLAGS.get(field, f'dms.{field}')} {old_dms[field]!r} -> {new_dms[field]!r}")
    new_run = json.loads(json.dumps(cfg.to_json(), default=str))
    on_demo = bool(old_run.get("demo_examples"))  # generated data: its flags say what it is, not its file's path
    for field in RESUME_RUN_FIELDS:
        if field.startswith("demo_") and field != "demo_examples" and not on_demo:
            continue  # a run on its own data: the demo generator's flags do not shape it
        if field in old_run and old_run[field] != new_run[field]:
            name = "--data=demo:N" if field == "demo_examples" else f"--{field}"
            changes.append(f"{name} {old_run[field]!r} -> {new_run[field]!r}")
    # --freeze_base drops the base weights' Adam moments: the saved optimizer state has another structure.
    old_frozen = (old_run.get("optim") or {}).get("freeze_base")
    if old_frozen is not None and old_frozen != cfg.optim.freeze_base:
        changes.append(f"--freeze_base {old_frozen!r} -> {cfg.optim.freeze_base!r} (the optimizer state's structure)")
    old_data, new_data = old_run.get("data") or {}, new_run.get("data") or {}
    for field, name in RESUME_DATA_FIELDS.items():
        if field == "data" and on_demo:
            continue
        if field in old_data and _same_path(old_data[field]) != _same_path(new_data.get(field)):
            changes.append(f"{name} {old_data[field]!r} -> {new_data.get(field)!r}")
    if saved.get("model_config"):
        old_arch = Qwen3Config.from_hf(saved["model_config"])
        for field in ARCH_FIELDS:
            a, b = getattr(old_arch, field), getattr(model_config, field)
            if a != b:
                changes.append(f"the model's {field} (--init_checkpoint/--model_config) {a!r} -> {b!r}")
    if changes:
        raise FlagError(f"cannot resume {where}: {'; '.join(changes)}. A resumed run keeps its budget, scorer, "
                        "widths, sequence length, batch split and model: rerun with the old values, or start over "
                        "with --overwrite (or another --run_dir)")


# TrainConfig fields (to_json) that change how a run is carried out, not what it trains: a finished
# run's export is still that of the new flags when only these differ.
OPERATIONAL_FIELDS = ("run_dir", "export_dir", "checkpoint_every", "keep_checkpoints", "async_checkpointing",
                      "resume", "export", "log_every", "tensorboard", "progress", "dry_run", "variants", "evaluation",
                      "overwrite", "divergence_factor", "divergence_warmup", "mesh", "remat", "scan_layers", "loss_chunk",
                      "teacher_logits_dir", "write_teacher_logits")
# Not operational: --micro_batch (the KL is a mean of per-micro-batch means, each with its own query samples).


def training_changes(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """'FIELD OLD -> NEW' for each setting that shapes what a run trains (all but OPERATIONAL_FIELDS;
    nested ones as `kvpop.topk`, `optim.base_lr`) whose value differs from `saved`, a finished run's
    train_config.json. A field newer than the saved run is compared with nothing and skipped."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    # The retrofit's own block only: a KVpop run is not shaped by the DMS flags, nor a DMS run by the
    # KVpop training knobs (its memory-matched budget is in its own block).
    skip = set(OPERATIONAL_FIELDS) | {"dms" if cfg.retrofit == "kvpop" else "kvpop"}

    now = json.loads(json.dumps(cfg.to_json(), default=str))
    new = {k: _same_path(v) for k, v in flat({k: v for k, v in now.items() if k not in skip})}
    raw = dict(flat({k: v for k, v in saved.items() if k not in skip}))
    old = {k: _same_path(v) for k, v in raw.items()}
    moves = _moves(saved.get("run_dir"), cfg.run_dir)
    return [f"{k} {old[k]!r} -> {new[k]!r}" for k in new
            if k in old and old[k] != new[k] and new[k] not in (_moved(raw[k], moves), _moved(old[k], moves))]


def _spellings(path: str) -> set[str]:
    """A folder as a run may have recorded it: as given (relative to where it ran), absolute, and resolved."""
    spelled = {os.path.normpath(path), os.path.abspath(path)}
    return spelled | {os.path.realpath(path)} if os.path.exists(path) else spelled


def _moves(old_run_dir: Any, run_dir: str) -> list[tuple[str, str]]:
    """(old, new) folder pairs of a run folder moved or copied elsewhere, each old one in every spelling a recorded
    path may start with (and its parent's, where a recipe keeps the init, tokenizer and data its variants share:
    RUN_DIR/NAME moved with RUN_DIR), the new one resolved; longest first."""
    if not isinstance(old_run_dir, str) or not old_run_dir:
        return []
    old, new = os.path.normpath(old_run_dir), os.path.realpath(run_dir)
    if os.path.realpath(old) == new:
        return []
    pairs = [(old, new)]
    if os.path.basename(old) == os.path.basename(new) and os.path.dirname(old) and os.path.dirname(new):
        pairs.append((os.path.dirname(old), os.path.dirname(new)))
    moves = {(spelled, to) for was, to in pairs for spelled in _spellings(was)}
    return sorted(moves, key=lambda move: -len(move[0]))


def _moved(value: Any, moves: list[tuple[str, str]]) -> Any:
    """A path inside a moved folder (`_moves`), resolved where it lies now; other values as they are."""
    if isinstance(value, str) and value:
        path = os.path.normpath(value)
        for old, new in moves:
            if path == old or path.startswith(old.rstrip(os.sep) + os.sep):
                return _same_path(new + path[len(old):])
    return value


def read_metrics(path: str, upto_step: int) -> list[dict[str, Any]]:
    """The records of metrics.jsonl up to `upto_step` (the resumed step). A torn last line is
    dropped (with a note); any other line that is not a JSON record is an error naming it."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:  # bytes that are not text: a line named below
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as e:
            if number == len(lines):
                print(f"{path}: dropping its torn last line {number} ({line[:60]!r})", file=sys.stderr)
                break
            raise FlagError(f"{path} line {number} is not a metrics record ({e}): {line[:80]!r}; fix or delete "
                            "that line to resume") from None
        if step <= upto_step:
            records.append(record)
    return records


__all__ = ["RESUME_CHANGES_KEY", "check_no_live_run_inside", "check_resume", "checkpoint_steps", "held_run",
           "lock_run_dir", "prepare_run_dir", "read_metrics", "resume_advice", "step_folders", "training_changes"]
