"""Every flag of `python -m train.main`, mapped in one place onto frozen config dataclasses.

`define_flags(flag_values)` declares the flags; `config_from_flags(flag_values)` turns the
parsed values into a validated `TrainConfig` (with `KVpopConfig`, `DataConfig`,
`OptimConfig`, `MeshConfig` inside) and raises `FlagError` naming the bad flag. Nothing
else in `train/` reads flags.

Model sources (`--init_checkpoint`):
  - a HF Qwen3 directory (config.json + safetensors, plus its tokenizer);
  - `random:NAME` or `random:PATH.json`: a random dense Qwen3 built on the fly (NAME is a
    file `configs/models/NAME.json`; `random:tiny` is the CPU demo model, vocab 128 with the
    demo tokenizer). It is saved to RUN_DIR/init/ and then loaded like a real checkpoint.
`--model_config` gives the architecture without weights (what `--dry_run` needs).

Data (`--data`): a hub dataset name, a local jsonl/parquet/arrow file, directory or glob
(see `train/data.py`), or `demo:N` = N generated demo-task traces (`eval/demo_task.py`)
written to RUN_DIR/data/demo_train.jsonl.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from absl import flags

from kvpop_jax.config import AGGREGATIONS, NORMALIZERS, SCORERS, TARGET_REDUCTIONS, KVpopConfig, Qwen3Config
from train.data import DataConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_CONFIG_DIR = os.path.join(REPO_ROOT, "configs", "models")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = ("float32", "bfloat16")


class FlagError(ValueError):
    """A flag value (or combination) that cannot work; the message names the flag."""


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Declares every training flag on `fv` (tests pass their own FlagValues)."""
    d = dict(flag_values=fv)
    # --- run and model
    flags.DEFINE_string("run_dir", None, "Output directory: checkpoints/, metrics.jsonl, tb/, export/.", **d)
    flags.DEFINE_string("init_checkpoint", None,
                        "HF Qwen3 directory, or random:NAME / random:PATH.json for a random model.", **d)
    flags.DEFINE_string("model_config", None,
                        "config.json of the architecture (needed by --dry_run without weights).", **d)
    flags.DEFINE_string("tokenizer", None, "Tokenizer directory (default: the init checkpoint).", **d)
    flags.DEFINE_integer("seed", 0, "Seed of scorer init, query sampling and data shuffle.", **d)
    # --- KVpop
    flags.DEFINE_integer("sinks", 4, "s: sink tokens.", **d)
    flags.DEFINE_integer("window", 256, "w: protected recent window.", **d)
    flags.DEFINE_integer("topk", 2016, "k: long-range budget (0: StreamingLLM+, a fixed pattern).", **d)
    flags.DEFINE_enum("scorer", "mlstm", SCORERS, "Importance scorer.", **d)
    flags.DEFINE_integer("scorer_hidden", 64, "MLP scorer hidden width per KV head.", **d)
    flags.DEFINE_integer("mlstm_dim", 32, "mLSTM feature dim per head.", **d)
    flags.DEFINE_float("gamma_min", 0.999, "Decay min.", **d)
    flags.DEFINE_float("gamma_max", 0.999999, "Decay max.", **d)
    flags.DEFINE_float("loss_temperature", 1.0, "Pairwise (retention) loss temperature τ.", **d)
    flags.DEFINE_bool("margin_weighting", True, "Margin weighting of the retention loss (Eq. 23).", **d)
    flags.DEFINE_bool("balance_weighting", True, "Keep/drop balance weighting (Eq. 24).", **d)
    flags.DEFINE_enum("normalizer", "sparse", NORMALIZERS, "LSE of the future-attention target.", **d)
    flags.DEFINE_enum("aggregate", "max", AGGREGATIONS, "GQA aggregation of the target.", **d)
    flags.DEFINE_enum("target_reduce", "sum", TARGET_REDUCTIONS,
                      "Reduction of a key's future attention: sum (the paper's mass, Eq. 2, divided by "
                      "N_t) or max (its strongest single read; not in the paper).", **d)
    flags.DEFINE_integer("num_query_samples", 256, "Sampled boundary positions per sequence.", **d)
    flags.DEFINE_float("late_bias_fraction", 0.5, "Share of late-biased query samples.", **d)
    flags.DEFINE_float("retention_loss_weight", 1.0, "Weight of the retention loss.", **d)
    flags.DEFINE_integer("kl_topk", 256, "Teacher top-k logits for the KL.", **d)
    flags.DEFINE_float("kl_temperature", 1.0, "KL temperature.", **d)
    # --- data
    flags.DEFINE_string("data", None, "Hub dataset, local file/dir/glob, or demo:N (generated demo traces).", **d)
    flags.DEFINE_string("data_split", "train", "Split (hub names and saved datasets).", **d)
    flags.DEFINE_string("data_subset", None, "Hub dataset config name.", **d)
    flags.DEFINE_string("text_field", "auto", "Text field: auto, a column, or a+b.", **d)
    flags.DEFINE_bool("shuffle", True, "Shuffle documents (deterministic in --seed).", **d)
    flags.DEFINE_bool("reset_attention", False,
                      "Reset attention at packed document boundaries (the paper does not; KVpop cannot).", **d)
    flags.DEFINE_bool("split_documents", False, "Pack as one continuous stream (documents may be cut).", **d)
    flags.DEFINE_integer("min_length", 2, "Drop documents shorter than this (tokens).", **d)
    flags.DEFINE_integer("max_length", None, "Drop documents longer than this (default: seq_len).", **d)
    flags.DEFINE_bool("streaming", None, "Stream the dataset (default: hub yes, local no).", **d)
    flags.DEFINE_integer("demo_seq_len", 1536, "Prompt length of generated demo traces (demo:N).", **d)
    # --- batch and schedule
    flags.DEFINE_integer("seq_len", 16384, "S: tokens per packed row.", **d)
    flags.DEFINE_integer("global_batch", 128, "Rows per optimizer step (all devices, all micro-batches).", **d)
    flags.DEFINE_integer("micro_batch", None,
                         "Rows per forward/backward (default: global_batch); accumulation = global/micro.", **d)
    flags.DEFINE_integer("steps", 2000, "Optimizer steps.", **d)
    # --- teacher
    flags.DEFINE_enum("teacher_dtype", "auto", ("auto",) + DTYPES,
                      "Frozen teacher weights (auto: bfloat16 on GPU/TPU, float32 on CPU).", **d)
    flags.DEFINE_string("teacher_logits_dir", None,
                        "Read precomputed teacher top-k (step_{N:08d}.npz: values, indices [B, S, K]) "
                        "instead of running the teacher.", **d)
    flags.DEFINE_bool("write_teacher_logits", False,
                      "Instead of training, run the teacher over the batches of steps [0, --steps) and "
                      "write their top-k to --teacher_logits_dir (float16 values, int32 indices).", **d)
    # --- optimizer
    flags.DEFINE_float("base_lr", 8e-5, "Constant LR of the base weights.", **d)
    flags.DEFINE_float("new_lr", 1e-3, "Peak LR of new params (scorers, decay).", **d)
    flags.DEFINE_float("new_lr_final", 8e-5, "Final LR of the cosine schedule of new params.", **d)
    flags.DEFINE_integer("warmup_steps", 100, "Linear warmup steps of new params.", **d)
    flags.DEFINE_float("adam_b1", 0.9, "AdamW beta1.", **d)
    flags.DEFINE_float("adam_b2", 0.95, "AdamW beta2.", **d)
    flags.DEFINE_float("adam_eps", 1e-8, "AdamW epsilon.", **d)
    flags.DEFINE_float("weight_decay", 1e-4, "AdamW weight decay (all parameters).", **d)
    flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clipping (0: off).", **d)
    flags.DEFINE_bool("freeze_base", False, "Train only scorers and decay (base weights frozen).", **d)
    # --- precision and memory
    flags.DEFINE_enum("param_dtype", "float32", DTYPES, "Master weights and optimizer state.", **d)
    flags.DEFINE_enum("compute_dtype", "auto", ("auto",) + DTYPES,
                      "Matmul/activation dtype (auto: bfloat16 on GPU/TPU, float32 on CPU).", **d)
    flags.DEFINE_enum("remat", "none", REMAT_POLICIES, "Per-layer rematerialization policy.", **d)
    flags.DEFINE_integer("loss_chunk", 0,
                         "Compute lm_head + KL over sequence chunks of this many tokens (0: whole "
                         "sequence); avoids [B, S, V] logits.", **d)
    # --- mesh
    flags.DEFINE_integer("mesh_data", 1, "Data-parallel mesh axis (-1: the remaining devices).", **d)
    flags.DEFINE_integer("mesh_fsdp", -1, "FSDP mesh axis (-1: the remaining devices).", **d)
    flags.DEFINE_integer("mesh_tensor", 1, "Tensor-parallel mesh axis.", **d)
    flags.DEFINE_enum("distributed", "auto", ("auto", "on", "off"),
                      "jax.distributed.initialize(): auto = when a multi-host environment is detected.", **d)
    # --- checkpoints, export, logging
    flags.DEFINE_integer("checkpoint_every", 500, "Save a checkpoint every N steps (and at the end).", **d)
    flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept (older ones deleted).", **d)
    flags.DEFINE_bool("async_checkpointing", True, "Write checkpoints in the background.", **d)
    flags.DEFINE_bool("resume", True, "Resume from the latest checkpoint in run_dir/checkpoints.", **d)
    flags.DEFINE_bool("export", True, "Export HF-style safetensors to --export_dir at the end.", **d)
    flags.DEFINE_string("export_dir", None, "Export directory (default: run_dir/export).", **d)
    flags.DEFINE_integer("log_every", 1, "Write metrics every N steps.", **d)
    flags.DEFINE_bool("tensorboard", True, "Also write TensorBoard events to run_dir/tb.", **d)
    flags.DEFINE_bool("progress", True, "tqdm progress bar.", **d)
    # --- recipe: several retrofits of one teacher, then the demo comparison (train/recipe.py)
    flags.DEFINE_list("variants", [],
                      "Train these retrofits one after another, each into RUN_DIR/NAME with the flags above "
                      f"except: {', '.join(VARIANTS)} (StreamingLLM+: k = 0, w = --window + --topk, same B). "
                      "Empty: one run into RUN_DIR exactly as the flags say.", **d)
    flags.DEFINE_list("eval_methods", [],
                      "After training, pass@1 on held-out demo-task problems for these methods: dense, "
                      "streaming, tova, h2o (the init checkpoint with a training-free cache) and any of "
                      "--variants (their exports). Empty: no evaluation.", **d)
    flags.DEFINE_integer("eval_problems", 100, "Held-out demo problems (test split) for --eval_methods.", **d)
    flags.DEFINE_list("eval_crs", ["0.75", "0.88"], "Compression ratios: B = (1 - CR) * --eval_prompt_len.", **d)
    flags.DEFINE_integer("eval_prompt_len", 1024, "Prompt length of the held-out demo problems (tokens).", **d)
    flags.DEFINE_integer("eval_batch", 50, "Problems decoded per batch (greedy, one rollout each).", **d)
    flags.DEFINE_integer("eval_recall_sequences", 8,
                         "Held-out traces for the teacher-retention recall of each KVpop variant (0: skip).", **d)
    flags.DEFINE_bool("quick", False,
                      "A faster, rougher run into RUN_DIR-quick: a quarter of --steps (and of --warmup_steps, "
                      "--checkpoint_every and --eval_problems).", **d)
    flags.DEFINE_bool("dry_run", False,
                      "Compile the train step for the real shapes on abstract arrays, print per-device "
                      "memory, and exit (no weights or data needed).", **d)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Two parameter groups (Table 3): base weights and new KVpop params (scorers, decay)."""

    steps: int
    base_lr: float = 8e-5
    new_lr: float = 1e-3
    new_lr_final: float = 8e-5
    warmup_steps: int = 100
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 1e-4
    clip_norm: float = 1.0
    freeze_base: bool = False

    def __post_init__(self):
        if self.steps < 1:
            raise FlagError(f"--steps must be >= 1, got {self.steps}")
        for name in ("base_lr", "new_lr", "new_lr_final", "weight_decay", "clip_norm"):
            if getattr(self, name) < 0:
                raise FlagError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps:
            raise FlagError(f"--warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise FlagError(f"--adam_{name} must be in [0, 1), got {getattr(self, name)}")


# Retrofit variants of `--variants`: KVpopConfig overrides; StreamingLLM+ keeps B and drops k.
VARIANTS = ("kvpop-mlstm", "kvpop-mlp", "streamingllm+")
TRAINING_FREE = ("dense", "streaming", "tova", "h2o")


def variant_kvpop(kvpop: KVpopConfig, name: str) -> KVpopConfig:
    """The KVpopConfig of retrofit variant `name` built from the flags' `kvpop`."""
    if name == "kvpop-mlstm":
        return dataclasses.replace(kvpop, scorer="mlstm")
    if name == "kvpop-mlp":
        return dataclasses.replace(kvpop, scorer="mlp")
    if name == "streamingllm+":
        return dataclasses.replace(kvpop, window=kvpop.window + kvpop.topk, topk=0)
    raise FlagError(f"--variants: unknown variant {name!r}; known: {', '.join(VARIANTS)}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The demo comparison after training (`--eval_*`): greedy pass@1 on held-out demo problems."""

    methods: tuple[str, ...]
    problems: int = 100
    compression_ratios: tuple[float, ...] = (0.75, 0.88)
    prompt_len: int = 1024
    batch: int = 50
    recall_sequences: int = 8


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    distributed: str = "auto"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs, validated; built only by `config_from_flags`."""

    run_dir: str
    init_checkpoint: str | None
    model_config: str | None
    tokenizer: str | None
    seed: int
    kvpop: KVpopConfig
    data: DataConfig
    demo_examples: int  # > 0: `data.data` is generated (demo:N) into run_dir/data
    demo_seq_len: int
    seq_len: int
    global_batch: int
    micro_batch: int
    optim: OptimConfig
    mesh: MeshConfig
    teacher_dtype: str
    teacher_logits_dir: str | None
    write_teacher_logits: bool
    param_dtype: str
    compute_dtype: str
    remat: str
    loss_chunk: int
    checkpoint_every: int
    keep_checkpoints: int
    async_checkpointing: bool
    resume: bool
    export: bool
    export_dir: str
    log_every: int
    tensorboard: bool
    progress: bool
    dry_run: bool
    variants: tuple[str, ...] = ()
    evaluation: EvalConfig | None = None

    @property
    def grad_accum(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def steps(self) -> int:
        return self.optim.steps

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def random_init(self) -> str | None:
        """The architecture file of a `random:` init, else None."""
        src = self.init_checkpoint or ""
        if not src.startswith("random:"):
            return None
        return resolve_model_config(src.removeprefix("random:"))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_model_config(name_or_path: str) -> str:
    """`tiny` -> configs/models/tiny.json; a path is returned as is (must exist)."""
    path = name_or_path
    if not path.endswith(".json") and os.sep not in path:
        path = os.path.join(MODEL_CONFIG_DIR, f"{name_or_path}.json")
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(MODEL_CONFIG_DIR) if f.endswith(".json")) if os.path.isdir(
            MODEL_CONFIG_DIR) else []
        raise FlagError(f"model config {name_or_path!r} not found (looked at {path}); known names: {known}")
    return path


def _resolve_dtype(name: str, on_accelerator: bool) -> str:
    if name == "auto":
        return "bfloat16" if on_accelerator else "float32"
    return name


def load_model_config(cfg: TrainConfig) -> Qwen3Config:
    """The dense architecture: from --model_config, a random: init, or the init checkpoint."""
    sources = []
    if cfg.model_config:
        sources.append(resolve_model_config(cfg.model_config))
    if cfg.random_init:
        sources.append(cfg.random_init)
    elif cfg.init_checkpoint and os.path.isdir(cfg.init_checkpoint):
        sources.append(os.path.join(cfg.init_checkpoint, "config.json"))
    if not sources:
        raise FlagError("no architecture: pass --init_checkpoint (a HF directory or random:NAME) or --model_config")
    configs = [Qwen3Config.from_hf(s) for s in sources]
    base = [dataclasses.replace(c, kvpop=None) for c in configs]
    for src, c in zip(sources[1:], base[1:]):
        arch = lambda x: dataclasses.replace(x, bos_token_id=None, eos_token_id=None,  # noqa: E731
                                             max_position_embeddings=0)
        if arch(c) != arch(base[0]):
            raise FlagError(f"--model_config {sources[0]} and {src} describe different architectures")
    return base[-1]


def config_from_flags(fv: flags.FlagValues = flags.FLAGS, *, on_accelerator: bool | None = None) -> TrainConfig:
    """Maps parsed flags onto a validated TrainConfig; raises FlagError naming the flag."""
    if on_accelerator is None:
        import jax

        on_accelerator = jax.default_backend() != "cpu"
    f = fv
    if not f.run_dir:
        raise FlagError("--run_dir is required")
    if not f.init_checkpoint and not (f.dry_run and f.model_config):
        raise FlagError("--init_checkpoint is required (a HF Qwen3 directory or random:NAME); "
                        "--dry_run needs only --model_config")
    if f.init_checkpoint and f.init_checkpoint.startswith("random:"):
        resolve_model_config(f.init_checkpoint.removeprefix("random:"))
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
            mlstm_dim=f.mlstm_dim, gamma_min=f.gamma_min, gamma_max=f.gamma_max,
            loss_temperature=f.loss_temperature, margin_weighting=f.margin_weighting,
            balance_weighting=f.balance_weighting, normalizer=f.normalizer, aggregate=f.aggregate,
            target_reduce=f.target_reduce,
            num_query_samples=f.num_query_samples, late_bias_fraction=f.late_bias_fraction,
            kl_topk=f.kl_topk, kl_temperature=f.kl_temperature, retention_loss_weight=f.retention_loss_weight,
        )
    except ValueError as e:
        raise FlagError(f"bad KVpop flags: {e}") from e
    if kvpop.budget >= f.seq_len:
        raise FlagError(
            f"--seq_len={f.seq_len} must exceed the KVpop budget B = --sinks + --window + --topk = "
            f"{f.sinks} + {f.window} + {f.topk} = {kvpop.budget}; nothing would ever be evicted"
        )
    micro = f.micro_batch or f.global_batch
    if f.global_batch < 1 or micro < 1:
        raise FlagError(f"--global_batch and --micro_batch must be >= 1, got {f.global_batch}, {micro}")
    if f.global_batch % micro:
        raise FlagError(f"--global_batch={f.global_batch} is not divisible by --micro_batch={micro}")
    if f.reset_attention:
        raise FlagError("--reset_attention is not supported: KVpop attention runs over the whole packed row "
                        "(as in the paper); use --split_documents or shorter documents instead")
    if f.loss_chunk < 0 or (f.loss_chunk and f.seq_len % f.loss_chunk):
        raise FlagError(f"--loss_chunk={f.loss_chunk} must be 0 or divide --seq_len={f.seq_len}")
    if f.write_teacher_logits and not f.teacher_logits_dir:
        raise FlagError("--write_teacher_logits needs --teacher_logits_dir (where to write)")
    if f.teacher_logits_dir and not os.path.isdir(f.teacher_logits_dir) and not (f.dry_run or f.write_teacher_logits):
        raise FlagError(f"--teacher_logits_dir={f.teacher_logits_dir}: no such directory")
    if f.checkpoint_every < 1 or f.keep_checkpoints < 1 or f.log_every < 1:
        raise FlagError("--checkpoint_every, --keep_checkpoints and --log_every must be >= 1")
    if f.mesh_data == 0 or f.mesh_fsdp == 0 or f.mesh_tensor == 0:
        raise FlagError("mesh axes (--mesh_data/--mesh_fsdp/--mesh_tensor) must be >= 1 or -1")

    variants = tuple(dict.fromkeys(v.strip() for v in f.variants if v.strip()))
    for name in variants:
        try:
            variant_kvpop(kvpop, name)
        except ValueError as e:
            raise FlagError(f"--variants={name}: {e}") from e
    evaluation = evaluation_from_flags(f, kvpop, variants)
    steps, warmup, checkpoint_every, run_dir = f.steps, f.warmup_steps, f.checkpoint_every, f.run_dir
    if f.quick:  # its own run directory: a full run must not resume from (or into) a quick one
        steps, warmup, checkpoint_every = max(1, steps // 4), warmup // 4, max(1, checkpoint_every // 4)
        run_dir = run_dir.rstrip("/") + "-quick"

    demo_examples = 0
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
        data_path = os.path.join(run_dir, "data", "demo_train.jsonl")
    elif not f.dry_run:
        from train.data import resolve_source

        try:
            resolve_source(data_path)
        except (FileNotFoundError, PermissionError, ValueError) as e:
            raise FlagError(f"--data: {e}") from e
    try:
        data = DataConfig(
            data=data_path, seq_len=f.seq_len, batch_size=f.global_batch, text_field=f.text_field,
            split=f.data_split, subset=f.data_subset, seed=f.seed, shuffle=f.shuffle,
            reset_attention=f.reset_attention, split_documents=f.split_documents, min_length=f.min_length,
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
    return TrainConfig(
        run_dir=run_dir, init_checkpoint=f.init_checkpoint, model_config=f.model_config,
        tokenizer=f.tokenizer, seed=f.seed, kvpop=kvpop, data=data, demo_examples=demo_examples,
        demo_seq_len=f.demo_seq_len, seq_len=f.seq_len, global_batch=f.global_batch, micro_batch=micro,
        optim=optim, mesh=MeshConfig(f.mesh_data, f.mesh_fsdp, f.mesh_tensor, f.distributed),
        teacher_dtype=_resolve_dtype(f.teacher_dtype, on_accelerator), teacher_logits_dir=f.teacher_logits_dir,
        write_teacher_logits=f.write_teacher_logits,
        param_dtype=f.param_dtype, compute_dtype=_resolve_dtype(f.compute_dtype, on_accelerator),
        remat=f.remat, loss_chunk=f.loss_chunk, checkpoint_every=checkpoint_every,
        keep_checkpoints=f.keep_checkpoints, async_checkpointing=f.async_checkpointing, resume=f.resume,
        export=f.export, export_dir=f.export_dir or os.path.join(run_dir, "export"), log_every=f.log_every,
        tensorboard=f.tensorboard, progress=f.progress, dry_run=f.dry_run, variants=variants, evaluation=evaluation,
    )


def evaluation_from_flags(f, kvpop: KVpopConfig, variants: tuple[str, ...]) -> EvalConfig | None:
    """The `--eval_*` flags as an EvalConfig (None without --eval_methods), checked before any training."""
    from eval.accuracy import budget_for, retarget_kvpop
    from eval.demo_task import make_config

    methods = tuple(dict.fromkeys(m.strip() for m in f.eval_methods if m.strip()))
    if not methods:
        return None
    trained = variants or ("kvpop",)  # without --variants, the run itself is `kvpop`
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
    try:
        make_config(seq_len=f.eval_prompt_len)
    except ValueError as e:
        raise FlagError(f"--eval_prompt_len={f.eval_prompt_len}: {e}") from e
    for cr in crs:
        budget = budget_for(cr, f.eval_prompt_len)
        for m in (m for m in methods if m in trained):
            try:
                retarget_kvpop(variant_kvpop(kvpop, m) if variants else kvpop, budget)
            except ValueError as e:
                raise FlagError(f"--eval_crs={cr} at --eval_prompt_len={f.eval_prompt_len} (B = {budget}) does "
                                f"not fit {m}: {e}") from e
    if f.eval_problems < 1 or f.eval_batch < 1 or f.eval_recall_sequences < 0:
        raise FlagError("--eval_problems and --eval_batch must be >= 1, --eval_recall_sequences >= 0")
    problems = max(1, f.eval_problems // 4) if f.quick else f.eval_problems
    return EvalConfig(methods, problems, crs, f.eval_prompt_len, min(f.eval_batch, problems), f.eval_recall_sequences)


def check_devices(cfg: TrainConfig, num_devices: int, mesh_shape: dict[str, int]) -> None:
    """The batch must split evenly over the data-parallel devices (data x fsdp)."""
    dp = mesh_shape["data"] * mesh_shape["fsdp"]
    if cfg.micro_batch % dp:
        raise FlagError(
            f"--micro_batch={cfg.micro_batch} (global_batch {cfg.global_batch} / accumulation {cfg.grad_accum}) "
            f"is not divisible by the {dp} data-parallel devices (mesh data={mesh_shape['data']} x "
            f"fsdp={mesh_shape['fsdp']} of {num_devices} devices)"
        )
