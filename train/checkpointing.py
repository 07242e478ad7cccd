"""Training checkpoints: an orbax CheckpointManager (async, keep-N, interval).

One checkpoint directory `RUN_DIR/checkpoints/<step>/` (step = optimizer updates done)
holds four items:

  params     the student's parameters (base + KVpop), sharded arrays
  opt_state  the optax state, sharded like the params
  data       the data iterator's state (JSON)
  meta       JSON: step, the run's RNG key, the model config (HF dict with "kvpop"),
             the parameter dtype and the training config

`train.export` needs only `params` and `meta`, so it never reads the optimizer state.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from kvpop_jax.config import Qwen3Config
from kvpop_jax.fileio import make_folder
from train.config import DTYPES, FlagError
from train.run_dir import step_folders
from train.step import TrainState

ITEMS = ("params", "opt_state", "data", "meta")


class Checkpointer:
    """Saves and restores TrainState + data-iterator state + metadata under `directory`."""

    def __init__(self, directory: str, *, save_every: int = 1, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        self.read_only = read_only
        if not read_only:  # checkpoints/ linked to a folder not made yet (another disk): made (orbax: EEXIST)
            make_folder(self.directory)
        options = ocp.CheckpointManagerOptions(  # read-only: what orbax would reset, with a warning, anyway
            max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only,  # a killed save's unfinished step folder, quietly
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, state: TrainState, data_state: dict, meta: dict, *, force: bool = False) -> bool:
        """Saves at `state.step` if it is a multiple of `save_every` (or `force`); returns whether it did."""
        step = int(jax.device_get(state.step))
        if not force and step % self.save_every:
            return False
        meta = dict(meta, step=step, rng=np.asarray(jax.device_get(state.rng)).tolist())
        with self._writing():  # an async save's failure surfaces here, at the next save, or in wait()
            return self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(state.params),
                    opt_state=ocp.args.StandardSave(state.opt_state),
                    data=ocp.args.JsonSave(data_state),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,  # the interval is decided above (orbax would also save the first step)
            )

    def saved_steps(self) -> list[int]:
        """The finished step folders on disk (what a failed save left whole); none where the disk says nothing."""
        try:
            return step_folders(self.directory)
        except OSError:
            return []

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Turns a failed save (a full disk, a read-only or failing one: orbax's wall of tracebacks and a
        ValueError such as `RESOURCE_EXHAUSTED: ... [os_error_code='28']`) into one FlagError naming the
        folder, the cause and the step a rerun resumes from. orbax writes each step into a temporary folder
        and renames it when done, so the steps saved before are whole."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - narrowed below, as in _reading
            if not (isinstance(e, (OSError, ValueError)) or type(e) is Exception):
                raise
            reason = save_error_reason(e)
            fix = "free space (or fix the disk)" if reason != _detail(e) else "fix that"
            raise FlagError(f"saving a checkpoint in {self.directory} failed: {reason}; "
                            + _resume_advice(self.saved_steps(), fix)) from e

    @contextlib.contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """Turns orbax's errors on a damaged step directory (a truncated array file, a missing item,
        an empty JSON: disk trouble or hand edits; a killed save never lands) into one FlagError
        naming the step, what failed, and the step a resume could fall back to."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - narrowed below
            # Not RuntimeError: an out-of-memory restore is no damage. A bare Exception is orbax's own
            # wrapping of a failed array read when a step holds several arrays.
            if not (isinstance(e, (OSError, ValueError, KeyError)) or type(e) is Exception):
                raise
            path = os.path.join(self.directory, str(step))
            earlier = [s for s in self.all_steps() if s < step]
            if self.read_only:  # train.export
                advice = (f"export an earlier step ({', '.join(map(str, earlier))})" if earlier else
                          "no earlier step is kept")
            else:
                advice = ((f"move it aside (`mv {path} {path}.damaged`) to resume from step {max(earlier)}, "
                           if earlier else "") + "or start over with --overwrite")
            detail = (str(e).strip().splitlines() or [""])[0][:300]
            raise FlagError(f"checkpoint {path} cannot be read ({type(e).__name__}: {detail}): it is damaged or "
                            f"does not match this run; {advice}") from e

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict, dict]:
        """Restores (state, data state, meta) at `step` onto `abstract_state`'s shapes and shardings."""
        with self._reading(step):
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(abstract_state.params),
                    opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ),
            )
            meta = restored["meta"]
            check_meta(meta, step)  # named as the step's damage here, not a bare TypeError below
        rng_sharding = getattr(abstract_state.rng, "sharding", None)
        rng = np.asarray(meta["rng"], np.uint32)
        state = TrainState(
            step=_put(np.asarray(meta["step"], np.int32), getattr(abstract_state.step, "sharding", None)),
            params=restored["params"], opt_state=restored["opt_state"], rng=_put(rng, rng_sharding),
        )
        return state, restored["data"], meta

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters (for export)."""
        with self._reading(step):
            check_stored_shapes(os.path.join(self.directory, str(step), "params"), abstract_params)
            restored = self.manager.restore(
                step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
        return restored["params"]

    def restore_meta(self, step: int) -> dict:
        """The meta item, its fields checked here (a hand edit or damage is named as the step's, not met later as
        a KeyError or TypeError where train.export or a resume reads it)."""
        with self._reading(step):
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            check_meta(meta, step)
        return meta

    def wait(self) -> None:
        with self._writing():
            self.manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self.manager.close()


def check_stored_shapes(directory: str, abstract: Any) -> None:
    """Raises ValueError naming the first parameter whose shape in orbax's metadata of `directory` is not
    `abstract`'s (a model config edited in the meta item): orbax's own error left its other reads in flight,
    and their callbacks printed tracebacks under the error at exit."""
    is_array = lambda x: hasattr(x, "shape")  # noqa: E731
    stored = ocp.StandardCheckpointHandler().metadata(epath.Path(directory))
    shapes = {jax.tree_util.keystr(k): tuple(x.shape) for k, x in jax.tree_util.tree_leaves_with_path(stored, is_array)}
    for key, want in jax.tree_util.tree_leaves_with_path(abstract, is_array):
        have = shapes.get(jax.tree_util.keystr(key))
        if have is not None and have != tuple(want.shape):
            raise ValueError(f"params{jax.tree_util.keystr(key)} is {have} on disk, not {tuple(want.shape)} as the "
                             "model config in its meta item says")


def save_error_reason(e: BaseException) -> str:
    """What made a save fail, short: the OS error (`No space left on device`) where the exception carries one
    (an OSError's errno, or the `os_error_code` of tensorstore's message), then the exception's first line."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    found = re.search(r"os_error_code='?(\d+)", str(e))
    code = code or (int(found.group(1)) if found else None)
    return f"{os.strerror(code)} ({_detail(e)})" if code else _detail(e)


def _detail(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def _resume_advice(steps: list[int], fix: str) -> str:
    """What to do after a failed save: `fix` (the disk, or the cause the error names), then rerun."""
    if not steps:
        return f"no step was saved before it: {fix} and rerun the command"
    return (f"the steps saved before ({', '.join(map(str, steps))}) are whole: {fix} and "
            f"rerun the same command to resume from step {steps[-1]}")


def _put(x: np.ndarray, sharding) -> jax.Array:
    return jax.device_put(x, sharding) if sharding is not None else jax.numpy.asarray(x)


GUARD_META_KEY = "divergence_history"  # a checkpoint's meta: train.loop.DivergenceGuard.saved()
# The meta item's fields that train.export and a resume read -> the types a run saves (None: not set).
META_TYPES = {"model_config": dict, "train_config": dict, "tokenizer_dir": (str, type(None)), "code": str}
TRAIN_CONFIG_TYPES = {"kvpop": (dict, type(None)), "dms": (dict, type(None)), "optim": (dict, type(None)),
                      "data": (dict, type(None)), "init_checkpoint": (str, type(None))}


def check_meta(meta: dict, step: int) -> None:
    """Raises ValueError naming the first field of the meta item of checkpoint `step` that cannot be what the run
    saved: a step that is not the folder's, META_TYPES (a model_config string would be read as a path), a
    model_config that is no valid config, a param_dtype not in DTYPES, an rng or divergence history of another
    form."""
    if not isinstance(meta, dict) or "step" not in meta:
        raise ValueError(f"its meta item is not a training checkpoint's ({str(meta)[:80]})")
    if type(meta["step"]) is not int:
        raise ValueError(f"its meta item's step is {str(meta['step'])[:20]!r}, not an int")
    if meta["step"] != step:  # a resume would train from meta's step and meet this folder again when saving
        raise ValueError(f"its meta item is of step {meta['step']}: the folder was renamed, or copied from another "
                         "step")
    fields = [(k, meta[k], kind) for k, kind in META_TYPES.items() if k in meta]
    run = meta.get("train_config") if isinstance(meta.get("train_config"), dict) else {}
    fields += [(f"train_config.{k}", run[k], kind) for k, kind in TRAIN_CONFIG_TYPES.items() if k in run]
    for name, value, kind in fields:
        if not isinstance(value, kind):
            raise ValueError(f"its meta item's {name} has the wrong type ({type(value).__name__}: {str(value)[:80]})")
    rng = meta.get("rng", [0])
    if not isinstance(rng, list) or not rng or any(type(x) is not int or not 0 <= x < 2**32 for x in rng):
        raise ValueError(f"its meta item's rng is {str(rng)[:80]}, not the list of uint32 a run saves")
    history = meta.get(GUARD_META_KEY, {})
    if not isinstance(history, dict) or any(not isinstance(v, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) for v in history.values()):
        raise ValueError(f"its meta item's {GUARD_META_KEY} is {str(history)[:80]}, not the lists of numbers a run "
                         "saves")
    if not isinstance(meta.get("param_dtype", "float32"), str) or meta.get("param_dtype", "float32") not in DTYPES:
        raise ValueError(f"its meta item's param_dtype is {meta['param_dtype']!r}, not one of {', '.join(DTYPES)}")
    if "model_config" in meta:
        Qwen3Config.from_hf(meta["model_config"])  # each field's type and range


def model_config_from_meta(meta: dict, where: str) -> Qwen3Config:
    """The model config of checkpoint `where` (its meta item, checked by Checkpointer.restore_meta)."""
    if "model_config" not in meta:
        raise ValueError(f"checkpoint {where} has no model_config in its meta item (it holds "
                         f"{', '.join(sorted(meta))}): it is damaged or was edited by hand")
    return Qwen3Config.from_hf(meta["model_config"])


def split_step_dir(path: str) -> tuple[str, int | None]:
    """`RUN_DIR/checkpoints/<step>` -> (checkpoints dir, step); a run dir or checkpoints dir -> (dir, None)."""
    path = os.path.abspath(path)
    base = os.path.basename(path.rstrip(os.sep))
    if os.path.isdir(os.path.join(path, "checkpoints")):  # first: a run dir may be named by a number (runs/7)
        return os.path.join(path, "checkpoints"), None
    if base.isdigit() and os.path.isdir(path):
        return os.path.dirname(path), int(base)
    return path, None
