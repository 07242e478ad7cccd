"""Export a training checkpoint to a HF-style directory that `load_pretrained` reads as KVpop.

    python -m train.export --checkpoint RUN_DIR/checkpoints/2000 --out DIR [--dtype bfloat16]
    python -m train.export --checkpoint RUN_DIR --out DIR          # the latest checkpoint

Writes base weights under HF names, the KVpop tensors (scorers, decay) under
`model.layers.{i}.self_attn.kvpop.*`, and config.json carrying the KVpop settings; the
tokenizer is copied when the run recorded one. Only the parameters are read (never
the optimizer state).
"""

from __future__ import annotations

import os
import sys

import jax
from absl import app, flags
from absl import logging as absl_logging
from jax.experimental import multihost_utils

from kvpop_jax import fileio, save_pretrained
from kvpop_jax.checkpoint import TOKENIZER_FILES, checkpoint_fingerprint
from kvpop_jax.config import Qwen3Config
from kvpop_jax.modeling import abstract_params
from train import checkpointing
from train.config import DTYPES, check_export_dir, parse_flags
from train.run_dir import check_no_live_run_inside, step_folders


def tokenizer_files(source_dir: str | None) -> dict[str, str]:
    """name -> path of the tokenizer files in `source_dir` (none when it is not a directory)."""
    if not source_dir or not os.path.isdir(source_dir):
        return {}
    return {name: os.path.join(source_dir, name) for name in TOKENIZER_FILES
            if os.path.isfile(os.path.join(source_dir, name))}


def export_params(config: Qwen3Config, params, out: str, *, dtype=None, tokenizer_dir: str | None = None) -> None:
    """save_pretrained(config, params) with the tokenizer, gathering sharded arrays to the host (atomic: a
    killed export leaves the previous one)."""
    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() != 0:
        return
    params = jax.device_get(params)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    save_pretrained(config, params, out, extra_files=tokenizer_files(tokenizer_dir))


def check_out(out: str, checkpoints: str) -> None:
    """Refuses an --out that cannot hold the export (not a folder, the working directory) and one that is or
    holds the run's checkpoints folder, or lies inside it: the export replaces its folder whole (carrying
    the old entries over), so what a live run wrote there meanwhile would be lost, and a step folder would
    get weights orbax does not know. Touches nothing."""
    real = fileio.check_replaceable_dir(out, "--out")
    if os.path.lexists(real) and not os.path.isdir(real):
        raise NotADirectoryError(f"--out={out}: it exists and is not a folder")
    fileio.check_writable_dir(out, "--out", swapped=True)  # a read-only disk: before the restore, not after it
    check_no_live_run_inside(out, "--out")
    checkpoints = os.path.realpath(checkpoints)
    if os.path.commonpath([real, checkpoints]) in (real, checkpoints):
        where = "is or holds" if os.path.commonpath([real, checkpoints]) == real else "lies inside"
        run = os.path.dirname(checkpoints)  # RUN_DIR of RUN_DIR/checkpoints, or the folder above any other
        raise ValueError(f"--out={out} {where} the checkpoints folder {checkpoints}; the export replaces its "
                         f"folder whole: name a folder of its own (e.g. {os.path.join(run, 'export')})")


def check_not_init(out: str, meta: dict) -> None:
    """Refuses an --out that is the run's --init_checkpoint or inside it (by path), or holds the weights the
    run started from (by fingerprint, wherever the run was launched from): the export would replace the
    model the run starts from, and the run could no longer resume. train.main refuses the same --export_dir."""
    init = (meta.get("train_config") or {}).get("init_checkpoint") or ""
    check_export_dir(out, init, flag="--out")  # by path, as train.main checks its --export_dir
    real = os.path.realpath(out)
    fingerprint = meta.get("init_fingerprint")
    if fingerprint and os.path.isdir(real) and any(f.endswith(".safetensors") for f in os.listdir(real)):
        if checkpoint_fingerprint(real) == fingerprint:
            raise ValueError(f"--out={out} holds the weights the run started from (its --init_checkpoint={init}): "
                             "the export would overwrite them; name a folder of its own")


def export_checkpoint(checkpoint: str, out: str, *, dtype: str | None = None) -> tuple[Qwen3Config, int]:
    """Exports `checkpoint` (a step directory, a checkpoints dir or a run dir) to `out`; dtype: one of DTYPES'
    names, or None to keep the trained dtype."""
    if dtype is not None and dtype not in DTYPES:  # was a bare KeyError after the restore
        raise ValueError(f"--dtype={dtype}: expected one of {', '.join(DTYPES)} (or none: as trained)")
    directory, step = checkpointing.split_step_dir(checkpoint)
    if not os.path.isdir(directory):
        what = ("a file; give the run folder (or its checkpoints/ or a step folder in it)" if os.path.isfile(checkpoint)
                else "no such directory")
        raise FileNotFoundError(f"--checkpoint={checkpoint}: {what}")
    check_out(out, directory)  # before the (long) restore
    ckpt = checkpointing.Checkpointer(directory, read_only=True)
    if step is None:
        step = ckpt.latest_step()
        if step is None:  # a recipe's RUN_DIR holds one run folder per variant
            runs = sorted(d for d in os.listdir(directory) if step_folders(os.path.join(directory, d, "checkpoints")))
            hint = (f" (it holds the runs {', '.join(runs)}: name one, e.g. --checkpoint="
                    f"{os.path.join(directory, runs[0])})" if runs else "")
            raise FileNotFoundError(f"--checkpoint={checkpoint}: no checkpoint steps in {directory}{hint}")
    elif step not in ckpt.all_steps():
        raise FileNotFoundError(f"--checkpoint={checkpoint}: step {step} not found (have {ckpt.all_steps()})")
    meta = ckpt.restore_meta(step)
    check_not_init(out, meta)  # before the (long) params restore
    config = checkpointing.model_config_from_meta(meta, os.path.join(directory, str(step)))
    param_dtype = DTYPES[meta.get("param_dtype", "float32")]
    device = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          abstract_params(config, param_dtype))
    params = ckpt.restore_params(step, target)
    ckpt.close()
    tokenizer_dir = meta.get("tokenizer_dir")
    if tokenizer_dir and not os.path.isdir(tokenizer_dir):
        print(f"warning: the run's tokenizer folder {tokenizer_dir!r} (recorded in the checkpoint) is not there"
              + ("" if os.path.isabs(tokenizer_dir) else " from this folder") + ": the export has no tokenizer "
              "files; copy them in (tokenizer.json, tokenizer_config.json, ...)", file=sys.stderr)
    export_params(config, params, out, dtype=DTYPES[dtype] if dtype else None, tokenizer_dir=tokenizer_dir)
    return config, step


FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "RUN_DIR/checkpoints/<step>, RUN_DIR/checkpoints or RUN_DIR (latest).")
flags.DEFINE_string("out", None, "Output directory (HF-style safetensors + config.json).")
flags.DEFINE_enum("dtype", None, list(DTYPES), "Cast the weights (default: as trained).")


def main(argv):
    del argv
    # orbax logs every read at INFO and warns that a read-only checkpoint folder is read-only: its own errors only
    absl_logging.set_verbosity(absl_logging.ERROR)
    missing = [f"--{name}" for name in ("checkpoint", "out") if not FLAGS[name].value]
    if missing:  # one line and exit 2, as train.main (absl's UsageError printed the whole docstring, exit 1)
        print(f"error: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: python -m "
              "train.export --checkpoint RUN_DIR --out EXPORT_DIR [--dtype bfloat16]", file=sys.stderr)
        sys.exit(2)
    try:
        FLAGS.checkpoint, FLAGS.out = os.path.expanduser(FLAGS.checkpoint), os.path.expanduser(FLAGS.out)  # ~/x
        config, step = export_checkpoint(FLAGS.checkpoint, FLAGS.out, dtype=FLAGS.dtype)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full, read-only or failing disk: the export is swapped in whole or not at all
        print(f"error: exporting to {FLAGS.out} failed ({e}); any export there before is unchanged", file=sys.stderr)
        sys.exit(2)
    kind = "kvpop" if config.kvpop is not None else "dms" if config.dms is not None else "dense"
    print(f"exported step {step} ({config.num_hidden_layers} layers, {kind}) to {FLAGS.out}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
