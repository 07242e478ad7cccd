"""Parsed flags -> a validated `TrainConfig` (`train/config.py`); every error names its flag."""

from __future__ import annotations

import math
import os

import jax
from absl import flags

from demo.task import SEED_LIMIT, TASKS, make_config
from eval.benchmarks import DemoSpec
from kvpop_jax.baselines import METHODS as TRAINING_FREE
from kvpop_jax.config import KVpopConfig, Qwen3Config
from kvpop_jax.documents import resolve_source
from kvpop_jax.generate import SEED_RANGE
from train.config import (DataConfig, EvalConfig, FlagError, MeshConfig, OptimConfig, TrainConfig,
                          check_export_dir, check_output_dir, resolve_model_config, variant_dms, variant_kvpop)
from train.run_dir import check_no_live_run_inside


def _resolve_dtype(name: str, on_accelerator: bool) -> str:
    if name == "auto":
        return "bfloat16" if on_accelerator else "float32"
    return name


# Path flags whose leading `~` is expanded (as --data's is): not by the shell in `--flag=~/x` nor in a flagfile,
# it made a folder named `~` in the working directory.
PATH_FLAGS = ("run_dir", "export_dir", "init_checkpoint", "model_config", "tokenizer", "teacher_logits_dir")


def expand_user_paths(fv: flags.FlagValues) -> None:
    """Expands a leading `~` of the PATH_FLAGS values in place (so that every later use sees the same path)."""
    for name in PATH_FLAGS:
        value = fv[name].value
        if isinstance(value, str) and value.startswith("~"):
            fv[name].value = os.path.expanduser(value)


def config_from_flags(fv: flags.FlagValues = flags.FLAGS, *, on_accelerator: bool | None = None) -> TrainConfig:
    """Maps parsed flags onto a validated TrainConfig; raises FlagError naming the flag."""
    if on_accelerator is None:
        on_accelerator = jax.default_backend() != "cpu"
    f = fv
    expand_user_paths(f)
    check_float_flags(f)
    if not f.run_dir:
        raise FlagError("--run_dir is required")
    if not f.init_checkpoint and not (f.dry_run and f.model_config):
        raise FlagError("--init_checkpoint is required (a HF Qwen3 directory or random:NAME); "
                        "--dry_run needs only --model_config")
    if f.init_checkpoint and f.init_checkpoint.startswith("random:"):
        resolve_model_config(f.init_checkpoint.removeprefix("random:"))
    elif f.init_checkpoint and os.path.isfile(f.init_checkpoint):  # its config.json, say: was "no such directory"
        raise FlagError(f"--init_checkpoint={f.init_checkpoint} is a file; pass the folder that holds the checkpoint "
                        f"({os.path.dirname(f.init_checkpoint) or '.'})")
    elif f.init_checkpoint and not f.dry_run:
        if not os.path.isdir(f.init_checkpoint):
            raise FlagError(f"--init_checkpoint={f.init_checkpoint}: no such directory (download the HF "
                            "checkpoint there, or use random:tiny)")
        if not os.path.isfile(os.path.join(f.init_checkpoint, "config.json")):
            raise FlagError(f"--init_checkpoint={f.init_checkpoint} has no config.json")
    if f.model_config:
        resolve_model_config(f.model_config)
    try:
        kvpop = KVpopConfig(
            sinks=f.sinks, window=f.window, topk=f.topk, scorer=f.scorer, scorer_hidden=f.scorer_hidden,
            scorer_keys=f.scorer_keys, scorer_position=f.scorer_position,
            mlstm_dim=f.mlstm_dim, mlstm_feature_map=f.mlstm_feature_map, mlstm_value=f.mlstm_value,
            mlstm_skip=f.mlstm_skip, mlstm_norm=f.mlstm_norm, mlstm_init=f.mlstm_init,
            mlstm_gate_softcap=f.mlstm_gate_softcap, target_lookahead=f.target_lookahead,
            gamma_min=f.gamma_min, gamma_max=f.gamma_max,
            loss_temperature=f.loss_temperature, retention_labels=f.retention_labels,
            margin_weighting=f.margin_weighting,
            balance_weighting=f.balance_weighting, normalizer=f.normalizer, aggregate=f.aggregate,
            target_reduce=f.target_reduce,
            num_query_samples=f.num_query_samples, late_bias_fraction=f.late_bias_fraction,
            target_head_samples=f.target_head_samples, rank_pairs=f.rank_pairs, rank_partners=f.rank_partners,
            keepset_queries=f.keepset_queries,
            listwise_queries=f.listwise_queries, listwise_temperature=f.listwise_temperature,
            regression_weight=f.regression_weight,
            kl_topk=f.kl_topk, kl_temperature=f.kl_temperature, retention_loss_weight=f.retention_loss_weight,
        )
    except ValueError as e:
        raise FlagError(f"bad KVpop flags: {str(e).replace('KVpopConfig.', '--')}") from e
    try:
        kvpop.check_sequence_length(f.seq_len)
    except ValueError as e:
        raise FlagError(f"--seq_len={f.seq_len}: {e} (B = --sinks + --window + --topk)") from e
    micro = f.global_batch if f.micro_batch is None else f.micro_batch  # 0 is refused, not read as "unset"
    if f.global_batch < 1 or micro < 1:
        raise FlagError(f"--global_batch and --micro_batch must be >= 1, got {f.global_batch}, {micro}")
    if f.global_batch % micro:
        raise FlagError(f"--global_batch={f.global_batch} is not divisible by --micro_batch={micro}")
    if f.loss_chunk < 0 or (f.loss_chunk and f.seq_len % f.loss_chunk):
        raise FlagError(f"--loss_chunk={f.loss_chunk} must be 0 or divide --seq_len={f.seq_len}")
    if f.write_teacher_logits and not f.teacher_logits_dir:
        raise FlagError("--write_teacher_logits needs --teacher_logits_dir (where to write)")
    if f.teacher_logits_dir and not os.path.isdir(f.teacher_logits_dir) and not (f.dry_run or f.write_teacher_logits):
        raise FlagError(f"--teacher_logits_dir={f.teacher_logits_dir}: no such directory")
    cadence = {"checkpoint_every": f.checkpoint_every, "keep_checkpoints": f.keep_checkpoints, "log_every": f.log_every}
    bad_cadence = "; ".join(f"--{k} must be >= 1, got {v}" for k, v in cadence.items() if v < 1)
    if bad_cadence:
        raise FlagError(bad_cadence)
    if f.divergence_factor < 0 or (0 < f.divergence_factor <= 1) or f.divergence_warmup < 1:
        raise FlagError(f"--divergence_factor must be 0 (off) or > 1 and --divergence_warmup >= 1, got "
                        f"{f.divergence_factor}, {f.divergence_warmup}")
    if f.mesh_data == 0 or f.mesh_fsdp == 0 or f.mesh_tensor == 0:
        raise FlagError("mesh axes (--mesh_data/--mesh_fsdp/--mesh_tensor) must be >= 1 or -1")

    variants = tuple(dict.fromkeys(v.strip() for v in f.variants if v.strip()))
    head_dim = _head_dim(f)
    try:
        kvpop.memory(head_dim)  # the scorer fits the model (e.g. an even Hedgehog feature dim)
    except ValueError as e:
        raise FlagError(f"--mlstm_dim/--mlstm_feature_map: {e}") from e
    for name in variants:
        if name == "dms":
            continue
        try:
            variant_kvpop(kvpop, name, head_dim)
        except ValueError as e:
            raise FlagError(f"--variants={name}: {str(e).removeprefix('--variants: ')}") from e
    if f.retrofit == "dms" and variants:  # the recipe sets each variant's retrofit: --retrofit would be ignored
        fix = ("the dms variant is already listed" if "dms" in variants else
               "add dms to the variants instead (--variants=...,dms)")
        raise FlagError(f"--retrofit=dms is a single run; with --variants={','.join(variants)} leave --retrofit at "
                        f"kvpop: {fix}")
    dms = None
    if f.retrofit == "dms" or "dms" in variants:
        memory, window = kvpop.memory(head_dim), f.window if f.dms_window is None else f.dms_window
        if not window < memory < f.seq_len:  # by flag, not as DMSConfig's "need window < memory < seq_len"
            raise FlagError(f"DMS needs its window < its memory per KV head M < --seq_len={f.seq_len}, got window "
                            f"{window} (--dms_window, default --window) and M = {memory} (--sinks + --window + --topk "
                            "+ the KVpop scorer's state, the memory it is matched to)")
        try:
            dms = variant_dms(kvpop, head_dim, f.seq_len, window=f.dms_window, temperature=f.dms_temperature,
                              ramp_fraction=f.dms_ramp_fraction, logit_scale=f.dms_logit_scale,
                              logit_offset=f.dms_logit_offset, aux_loss_weight=f.dms_aux_loss_weight)
        except ValueError as e:
            message = str(e)
            for name in ("window", "temperature", "ramp_fraction", "logit_scale", "logit_offset", "aux_loss_weight"):
                message = message.replace(f"DMSConfig.{name} ", f"--dms_{name} ")  # the flag the user set
            raise FlagError(f"bad DMS flags: {message}") from e
    evaluation = evaluation_from_flags(f, kvpop, variants, head_dim, dms)
    if f.steps < 1:  # before the warmup check, which would blame --warmup_steps for a negative --steps
        raise FlagError(f"--steps must be >= 1, got {f.steps}")
    steps, warmup, checkpoint_every, run_dir = f.steps, f.warmup_steps, f.checkpoint_every, f.run_dir
    if f.quick:  # its own run directory: a full run must not resume from (or into) a quick one
        steps, warmup, checkpoint_every = max(1, steps // 4), warmup // 4, max(1, checkpoint_every // 4)
        run_dir = os.path.normpath(run_dir)  # "runs/x/./" is runs/x; "." or ".." is a folder named by its own path
        run_dir = (os.path.abspath(run_dir) if os.path.basename(run_dir) in ("", ".", "..") else run_dir) + "-quick"
    if warmup > steps:
        default = "" if f["warmup_steps"].present else " (its default)"
        raise FlagError(f"--warmup_steps={f.warmup_steps}{default} exceeds --steps={f.steps}"
                        + (" (a quarter of each with --quick)" if f.quick else "")
                        + ": the learning rates would never reach their peak; pass --warmup_steps <= --steps")

    if not 0 <= f.seed < SEED_RANGE[1]:  # jax.random.PRNGKey takes an int64: past it, an OverflowError at step 1
        raise FlagError(f"--seed must be in [0, 2**63), got {f.seed}")
    demo_examples = 0
    demo_tasks = tuple(t.strip() for t in f.demo_tasks if t.strip())
    unknown = [t for t in demo_tasks if t not in TASKS] or ([] if demo_tasks else ["(none)"])
    if unknown:
        raise FlagError(f"--demo_tasks: {unknown} are not demo tasks ({', '.join(TASKS)})")
    data_path = f.data
    if not data_path and not f.dry_run:
        raise FlagError("--data is required (hub name, local jsonl/parquet/arrow path, or demo:N)")
    data_path = data_path or "unused-in-dry-run"
    if data_path.startswith("demo:"):
        try:
            demo_examples = int(data_path.removeprefix("demo:"))
        except ValueError:
            demo_examples = -1
        if demo_examples < 1:
            raise FlagError(f"--data={data_path}: demo:N needs a positive number of examples")
        if f.seed >= SEED_LIMIT:  # the generator's seed is one 32-bit word: it refused it only when writing the data
            raise FlagError(f"--data={data_path}: the demo generator takes --seed in [0, 2**32), got {f.seed}")
        for task in demo_tasks:  # before the run folder is locked and written, not while generating
            try:
                make_config(task=task, seq_len=f.demo_seq_len)
            except ValueError as e:
                raise FlagError(f"--demo_seq_len={f.demo_seq_len}: {e}") from None  # it names the shortest
        # The name holds what the traces depend on, so a changed flag regenerates them instead of reusing.
        data_path = os.path.join(run_dir, "data", f"demo_train_{'+'.join(demo_tasks)}_{demo_examples}x{f.demo_seq_len}"
                                                  f"_seed{f.seed}.jsonl")
    elif not f.dry_run:
        try:
            source = resolve_source(data_path)
        except (FileNotFoundError, PermissionError, ValueError) as e:
            raise FlagError(f"--data: {e}") from e
        if source.kind != "hub":  # recorded absolute: a resume from another folder compares the same file
            data_path = os.path.abspath(os.path.expanduser(data_path))
    try:
        data = DataConfig(
            data=data_path, seq_len=f.seq_len, batch_size=f.global_batch, text_field=f.text_field,
            split=f.data_split, subset=f.data_subset, seed=f.seed, shuffle=f.shuffle,
            split_documents=f.split_documents, min_length=f.min_length,
            max_length=f.max_length, streaming=f.streaming,
        )
        optim = OptimConfig(
            steps=steps, base_lr=f.base_lr, new_lr=f.new_lr, new_lr_final=f.new_lr_final,
            warmup_steps=warmup, b1=f.adam_b1, b2=f.adam_b2, eps=f.adam_eps,
            weight_decay=f.weight_decay, clip_norm=f.clip_norm, freeze_base=f.freeze_base,
        )
    except FlagError:
        raise
    except ValueError as e:
        raise FlagError(f"bad data flags: {e}") from e
    if f.new_lr == 0 and f.new_lr_final == 0 and (f.base_lr == 0 or f.freeze_base):
        base = "--freeze_base" if f.freeze_base else "--base_lr=0"
        raise FlagError(f"--new_lr=0 and --new_lr_final=0 with {base}: no parameter would change in {steps} steps; "
                        "give the new parameters (scorers, decay, DMS gates) or the base weights a learning rate > 0")
    export_dir = f.export_dir or os.path.join(run_dir, "export")
    check_output_dir(run_dir, "--run_dir")
    for folder in ("checkpoints", "tb") if not (variants or f.dry_run or f.write_teacher_logits) else ():
        check_output_dir(os.path.join(run_dir, folder), "--run_dir")  # a read-only one left from another user
    if variants and f.export_dir:
        raise FlagError(f"--export_dir={f.export_dir} with --variants: each variant exports into RUN_DIR/NAME/export "
                        "(see README command 1); drop --export_dir")
    if f.quick and f.export_dir and f.export:  # its rough export would replace the full run's there
        raise FlagError(f"--export_dir={f.export_dir} with --quick: a quick run exports into RUN_DIR-quick/export "
                        "(beside its own checkpoints), never over a full run's export; drop --export_dir")
    if f.export and not variants:
        check_output_dir(export_dir, "--export_dir", swapped=True)
    check_export_dir(export_dir, f.init_checkpoint, os.path.join(run_dir, "checkpoints"))
    check_no_live_run_inside(export_dir, "--export_dir")
    return TrainConfig(
        run_dir=run_dir, init_checkpoint=f.init_checkpoint, model_config=f.model_config, head_dim=head_dim,
        tokenizer=f.tokenizer, seed=f.seed, kvpop=kvpop, data=data, demo_examples=demo_examples,
        demo_seq_len=f.demo_seq_len, demo_tasks=demo_tasks, seq_len=f.seq_len, global_batch=f.global_batch,
        micro_batch=micro,
        optim=optim, mesh=MeshConfig(f.mesh_data, f.mesh_fsdp, f.mesh_tensor, f.distributed),
        teacher_dtype=_resolve_dtype(f.teacher_dtype, on_accelerator), teacher_logits_dir=f.teacher_logits_dir,
        write_teacher_logits=f.write_teacher_logits,
        param_dtype=f.param_dtype, compute_dtype=_resolve_dtype(f.compute_dtype, on_accelerator),
        remat=f.remat, loss_chunk=f.loss_chunk, checkpoint_every=checkpoint_every,
        keep_checkpoints=f.keep_checkpoints, async_checkpointing=f.async_checkpointing, resume=f.resume,
        export=f.export, export_dir=export_dir, log_every=f.log_every,
        tensorboard=f.tensorboard, progress=f.progress, dry_run=f.dry_run, variants=variants, evaluation=evaluation,
        overwrite=f.overwrite, divergence_factor=f.divergence_factor, divergence_warmup=f.divergence_warmup,
        retrofit=f.retrofit, dms=dms, scan_layers=f.scan_layers, quick=f.quick,
    )


def check_float_flags(fv: flags.FlagValues) -> None:
    """Every float flag is a finite number: NaN passes `x < 0` style checks, inf passes `x > 0`."""
    for name in sorted(fv):
        flag = fv[name]
        if flag.flag_type() == "float" and flag.value is not None and not math.isfinite(flag.value):
            raise FlagError(f"--{name}={flag.value} is not a finite number")


def _head_dim(f) -> int:
    """head_dim of the model the flags name (--model_config, random:NAME or the init checkpoint)."""
    if f.model_config:
        path = resolve_model_config(f.model_config)
    elif f.init_checkpoint and f.init_checkpoint.startswith("random:"):
        path = resolve_model_config(f.init_checkpoint.removeprefix("random:"))
    else:
        path = os.path.join(f.init_checkpoint, "config.json")
    try:
        return Qwen3Config.from_hf(path).head_dim
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FlagError(f"cannot read the model's config.json at {path}: {e}") from e


def evaluation_from_flags(f, kvpop: KVpopConfig, variants: tuple[str, ...], head_dim: int,
                          dms=None) -> EvalConfig | None:
    """The `--eval_*` flags as an EvalConfig (None without --eval_methods), checked before any training."""
    methods = tuple(dict.fromkeys(m.strip() for m in f.eval_methods if m.strip()))
    if not methods:
        return None
    trained = variants or (f.retrofit,)  # without --variants, the run itself is `kvpop` (or `dms`)
    unknown = [m for m in methods if m not in TRAINING_FREE and m not in trained]
    if unknown:
        raise FlagError(f"--eval_methods: {unknown} are neither {'/'.join(TRAINING_FREE)} nor trained here "
                        f"({', '.join(trained)}; see --variants)")
    try:
        crs = tuple(float(c) for c in f.eval_crs)
    except ValueError as e:
        raise FlagError(f"--eval_crs={','.join(f.eval_crs)}: not numbers") from e
    if not crs or any(not 0.0 < c < 1.0 for c in crs):
        raise FlagError(f"--eval_crs={','.join(f.eval_crs)}: need compression ratios in (0, 1)")
    if not 0 <= f.seed < SEED_LIMIT:  # the generator refused it only after every variant had trained
        raise FlagError(f"--eval_methods: the held-out demo problems are drawn with --seed, which the generator "
                        f"takes in [0, 2**32), got {f.seed}")
    tasks = tuple(t.strip() for t in f.eval_tasks if t.strip())
    unknown = [t for t in tasks if t not in TASKS] or ([] if tasks else ["(none)"])
    if unknown:
        raise FlagError(f"--eval_tasks: {unknown} are not demo tasks ({', '.join(TASKS)})")
    for task in tasks:
        try:
            make_config(task=task, seq_len=f.eval_prompt_len)
        except ValueError as e:
            raise FlagError(f"--eval_prompt_len={f.eval_prompt_len} does not fit task {task}: {e}") from e
    if f.eval_long_len:
        try:
            make_config(task=tasks[0], seq_len=f.eval_long_len)
        except ValueError as e:
            raise FlagError(f"--eval_long_len={f.eval_long_len}: {e}") from e
    for cr in crs:
        budget = KVpopConfig.budget_at(cr, f.eval_prompt_len)
        for m in (m for m in methods if m in trained):
            try:
                retrofit = dms if m == "dms" else (variant_kvpop(kvpop, m, head_dim) if variants else kvpop)
                retrofit.retarget(budget, head_dim)
            except ValueError as e:
                raise FlagError(f"--eval_crs={cr} at --eval_prompt_len={f.eval_prompt_len} (B = {budget}) does "
                                f"not fit {m}: {e}") from e
    if f.eval_problems < 1 or f.eval_batch < 1 or f.eval_recall_sequences < 0:
        raise FlagError("--eval_problems and --eval_batch must be >= 1, --eval_recall_sequences >= 0")
    problems = max(1, f.eval_problems // 4) if f.quick else f.eval_problems
    # The demo generator's limits (len <= 2**20, 2**28 tokens a spec), here and not after every variant has trained.
    for flag, n, length in ((f"--eval_problems={f.eval_problems} at --eval_prompt_len", problems, f.eval_prompt_len),
                            (f"--eval_problems={f.eval_problems} at --eval_long_len", problems, f.eval_long_len),
                            (f"--eval_recall_sequences={f.eval_recall_sequences} at --eval_prompt_len",
                             f.eval_recall_sequences, f.eval_prompt_len)):
        try:
            if n and length:
                DemoSpec(tasks[0], "test", f.seed, n, length)
        except ValueError as e:
            raise FlagError(f"{flag}={length}: {e}") from e
    asked = tuple(dict.fromkeys(m for m in (x.strip() for x in f.eval_long_methods) if m))
    default = list(f["eval_long_methods"].default)  # both KVpop variants: those of them that run here
    explicit = [m.strip() for m in f.eval_long_methods] != default  # tiny_cpu.flags spells the default out
    if explicit and asked and not f.eval_long_len:
        raise FlagError(f"--eval_long_methods={','.join(asked)} needs --eval_long_len (the prompt length they are "
                        "evaluated at; 0 skips that pass)")
    if f.eval_long_len and explicit:
        untrained = [m for m in asked if m not in trained]  # a typo or a baseline gave no rows, without a word
        if untrained:
            raise FlagError(f"--eval_long_methods: {untrained} are not trained here ({', '.join(trained)}): the "
                            "length check is of the trained variants")
        skipped = [m for m in asked if m not in methods]
        if skipped:
            raise FlagError(f"--eval_long_methods: {skipped} are not in --eval_methods ({', '.join(methods)})")
    long_methods = tuple(m for m in asked if m in methods and m in trained)
    return EvalConfig(methods, problems, crs, f.eval_prompt_len, min(f.eval_batch, problems), f.eval_recall_sequences,
                      tasks, f.eval_long_len, long_methods, f.eval_stream_prompt)
