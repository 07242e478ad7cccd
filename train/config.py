"""The run configuration of `python -m train.main`: frozen, validated dataclasses.

Built only by `train/configure.py` from the flags; every error is a `FlagError` naming the flag.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

import jax.numpy as jnp
from absl import flags as absl_flags

from kvpop_jax import dms as dms_lib
from kvpop_jax.config import DMSConfig, KVpopConfig, Qwen3Config
from kvpop_jax.fileio import check_writable_dir
from train.packing import DataConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_CONFIG_DIR = os.path.join(REPO_ROOT, "configs", "models")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class FlagError(ValueError):
    """A flag value (or combination) that cannot work; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Two parameter groups (Table 3): base weights and new params (KVpop scorers and decay, DMS gates)."""

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
        for name in ("base_lr", "new_lr", "new_lr_final", "weight_decay", "clip_norm", "eps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise FlagError(f"--{'adam_eps' if name == 'eps' else name} must be a finite number >= 0, got {value}")
        if not 0 <= self.warmup_steps:
            raise FlagError(f"--warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise FlagError(f"--adam_{name} must be in [0, 1), got {getattr(self, name)}")


# Retrofit variants of `--variants`: KVpopConfig overrides; StreamingLLM+ keeps B and drops k;
# dms is the DMS retrofit at the same memory (`variant_dms`).
VARIANTS = ("kvpop-mlstm", "kvpop-mlp", "streamingllm+", "kvpop-mlstm-max", "dms")
RETROFITS = ("kvpop", "dms")  # what a single run (`--retrofit`) trains


def variant_kvpop(kvpop: KVpopConfig, name: str, head_dim: int) -> KVpopConfig:
    """The KVpopConfig of retrofit variant `name` built from the flags' `kvpop`, at the same memory
    per KV head (`KVpopConfig.memory`): the flags' scorer state counts, so a stateless scorer gets
    the mLSTM state's memory as extra long-range slots (the paper's memory-matched comparison) and
    StreamingLLM+ (k = 0) gets it as window."""
    if name in ("kvpop-mlstm", "kvpop-mlp"):
        return kvpop.memory_matched(name.removeprefix("kvpop-"), head_dim)
    if name == "kvpop-mlstm-max":  # the max-over-future-queries target (not the paper's)
        return dataclasses.replace(kvpop.memory_matched("mlstm", head_dim), target_reduce="max")
    if name == "streamingllm+":
        return dataclasses.replace(kvpop, scorer="mlp", window=kvpop.memory(head_dim) - kvpop.sinks, topk=0)
    if name == "dms":
        raise FlagError("dms is not a KVpop variant: its settings come from variant_dms")
    raise FlagError(f"--variants: unknown variant {name!r}; known: {', '.join(VARIANTS)}")


def variant_dms(kvpop: KVpopConfig, head_dim: int, seq_len: int, *, window: int | None = None,
                **knobs) -> DMSConfig:
    """The DMS retrofit compared with the flags' KVpop (`kvpop_jax/dms.py`): the same memory per KV
    head M = `kvpop.memory(head_dim)` and window (unless `window`), the target eviction rate whose
    mean occupancy at `seq_len` is M, a gate with the KVpop head's parameter count per KV head, and
    the same distillation. `knobs`: other DMSConfig fields (temperature, ramp_fraction, ...)."""
    memory, window = kvpop.memory(head_dim), kvpop.window if window is None else window  # 0 is not None
    return DMSConfig(window=window, budget=memory, target_eviction=DMSConfig.eviction_for_memory(memory, window, seq_len),
                     gate_hidden=dms_lib.matched_gate_hidden(kvpop, head_dim), kl_topk=kvpop.kl_topk,
                     kl_temperature=kvpop.kl_temperature, **knobs)


def variant_retrofit(cfg: "TrainConfig", name: str) -> KVpopConfig | DMSConfig:
    """The retrofit config (KVpop or DMS) that variant `name` trains, from the run's flags (`kvpop`:
    a single run's own KVpop settings)."""
    if name == "dms":
        return cfg.dms
    return cfg.kvpop if name == "kvpop" else variant_kvpop(cfg.kvpop, name, cfg.head_dim)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The demo comparison after training (`--eval_*`): greedy pass@1 on held-out demo problems."""

    methods: tuple[str, ...]
    problems: int = 100
    compression_ratios: tuple[float, ...] = (0.75, 0.88)
    prompt_len: int = 1024
    batch: int = 50
    recall_sequences: int = 8
    tasks: tuple[str, ...] = ("read_once",)  # the first is the main task
    long_len: int = 0  # length generalization: the main task at this prompt length too (0: off)
    long_methods: tuple[str, ...] = ()  # the trained variants evaluated at long_len
    stream_prompt: bool = True  # the baselines evict token by token through the prompt (eval.accuracy)


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
    head_dim: int  # of the model (sizes the mLSTM state in memory-matched comparisons)
    tokenizer: str | None
    seed: int
    kvpop: KVpopConfig
    data: DataConfig
    demo_examples: int  # > 0: `data.data` is generated (demo:N) into run_dir/data
    demo_seq_len: int
    demo_tasks: tuple[str, ...]
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
    overwrite: bool = False  # start over in a run_dir that holds a run (train/run_dir.py)
    quick: bool = False  # --quick: a quarter of the steps and problems into RUN_DIR-quick (`recipe.quick_notice`)
    divergence_factor: float = 100.0  # stop when a loss term exceeds this x its running median (0: off)
    divergence_warmup: int = 3  # steps of history before the divergence guard checks
    retrofit: str = "kvpop"  # what this run trains: kvpop (the `kvpop` settings) or dms (`dms`)
    dms: DMSConfig | None = None  # the DMS settings (memory-matched to `kvpop`), when a run or variant needs them
    scan_layers: bool = False  # the decoder layers as one lax.scan in the train step (one layer compiled)

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

    def model_retrofit(self, model_config: Qwen3Config) -> Qwen3Config:
        """The dense architecture with this run's retrofit set."""
        if self.retrofit == "dms":
            return dataclasses.replace(model_config, kvpop=None, dms=self.dms)
        return dataclasses.replace(model_config, kvpop=self.kvpop, dms=None)

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
        raise FlagError(f"model config {name_or_path!r} not found (looked at {path}); known names: "
                        f"{shipped_model_configs()}")
    return path


def shipped_model_configs() -> list[str]:
    """The --model_config names configs/models/ holds."""
    if not os.path.isdir(MODEL_CONFIG_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(MODEL_CONFIG_DIR) if f.endswith(".json"))


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
    try:
        configs = [Qwen3Config.from_hf(s) for s in sources]
    except (ValueError, FileNotFoundError) as e:  # not an object, a missing field, ...: named, one line
        raise FlagError(f"--init_checkpoint/--model_config: {e}") from e
    base = [dataclasses.replace(c, kvpop=None, dms=None) for c in configs]
    for src, c in zip(sources[1:], base[1:]):
        # the same architecture up to special tokens and the documented context (a valid placeholder: 1)
        arch = lambda x: dataclasses.replace(x, bos_token_id=None, eos_token_id=None,  # noqa: E731
                                             max_position_embeddings=1)
        if arch(c) != arch(base[0]):
            ours, theirs = arch(base[0]), arch(c)
            diffs = "; ".join(f"{f.name}: {getattr(ours, f.name)!r} and {getattr(theirs, f.name)!r}"
                              for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name))
            raise FlagError(f"--model_config {sources[0]} and {src} describe different architectures ({diffs}): "
                            f"give the --model_config of that checkpoint (shipped: {shipped_model_configs()}) "
                            "or the checkpoint this one describes")
    return base[-1]


def check_export_dir(export_dir: str, init_checkpoint: str | None, checkpoint_dir: str | None = None, *,
                     flag: str = "--export_dir") -> None:
    """The export must not land on (or inside) the init checkpoint, which it would replace, nor inside
    the run's checkpoint folder, whose clean-up would delete it with an old step. `flag`: the export
    folder's name in the errors (train.export's is --out)."""
    export = os.path.realpath(export_dir)

    def inside(folder: str) -> bool:
        folder = os.path.realpath(folder)
        return export == folder or export.startswith(folder.rstrip(os.sep) + os.sep)

    if checkpoint_dir and inside(checkpoint_dir):
        raise FlagError(f"{flag}={export_dir} is inside the run's checkpoint folder {checkpoint_dir}, which "
                        "keeps only the latest --keep_checkpoints steps (an export there is deleted with its step); "
                        f"choose another {flag}")
    if not init_checkpoint:
        return
    if init_checkpoint.startswith("random:"):  # built in RUN_DIR/init: replaced, the run could never resume
        if checkpoint_dir and inside(os.path.join(os.path.dirname(checkpoint_dir), "init")):
            init = os.path.join(os.path.dirname(checkpoint_dir), "init")
            raise FlagError(f"{flag}={export_dir} is the folder {init} the run's --init_checkpoint={init_checkpoint} "
                            f"is built in, or inside it: the export would overwrite the model the run starts from (a "
                            f"resume would then be refused); choose another {flag}")
        return
    if inside(init_checkpoint):
        raise FlagError(f"{flag}={export_dir} is the run's --init_checkpoint={init_checkpoint} or inside it: the "
                        f"export would overwrite the model the run starts from; choose another {flag}")


def parse_flags(argv):
    """absl's flag parse for `app.run(main, flags_parser=parse_flags)`: a bad flag value (an unknown
    --scorer, a non-integer --steps) is one `error:` line and exit 2, like every refused flag
    (absl's own prints FATAL and exits 1)."""
    try:
        return absl_flags.FLAGS(argv)
    except absl_flags.Error as e:
        message = str(e).removeprefix("ERROR:: ")  # absl's own prefix: "error: ERROR:: Unable to open ..."
        if message.startswith("Unable to open flagfile") and os.path.realpath(os.getcwd()) != REPO_ROOT:
            message += (f"; a --flagfile path, also one inside a flagfile (the recipes' configs/...), is read from the "
                        f"working directory {os.getcwd()}: run from the repo root {REPO_ROOT}")
        print(f"error: {message}\nPass --helpfull to see every flag.", file=sys.stderr)
        sys.exit(2)
    except UnicodeDecodeError as e:  # absl reads a flagfile as text: a binary or Latin-1 one was a traceback
        print(f"error: the flagfile {_flagfile_being_read(e)} is not UTF-8 text ({e})", file=sys.stderr)
        sys.exit(2)


def _flagfile_being_read(error: BaseException) -> str:
    """The file absl's flagfile reader had open when `error` was raised ('?' if none is found)."""
    tb, name = error.__traceback__, "?"
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_get_flag_file_lines":
            name = tb.tb_frame.f_locals.get("filename", name)
        tb = tb.tb_next
    return name


def check_output_dir(path: str, flag: str, *, swapped: bool = False) -> None:
    """A folder the run will create or write into: refused by flag if it is a file, lies under a
    file, or its nearest existing folder cannot be written (checked before any work is done);
    `swapped`: an export folder, replaced whole, whose parent must be writable too."""
    try:
        check_writable_dir(path, flag, swapped=swapped)
    except ValueError as e:
        raise FlagError(f"{e}; choose another {flag}") from None


def check_devices(cfg: TrainConfig, num_devices: int, mesh_shape: dict[str, int]) -> None:
    """The batch must split evenly over the data-parallel devices (data x fsdp)."""
    dp = mesh_shape["data"] * mesh_shape["fsdp"]
    if cfg.micro_batch % dp:
        raise FlagError(
            f"--micro_batch={cfg.micro_batch} (global_batch {cfg.global_batch} / accumulation {cfg.grad_accum}) "
            f"is not divisible by the {dp} data-parallel devices (mesh data={mesh_shape['data']} x "
            f"fsdp={mesh_shape['fsdp']} of {num_devices} devices): data x fsdp must divide {cfg.micro_batch}; "
            "pick --mesh_data/--mesh_fsdp/--mesh_tensor to fit (a resumed run keeps --micro_batch)"
        )
