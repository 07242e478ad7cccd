"""Flags of `python -m train.pretrain` and its main (see the package docstring)."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
from absl import flags

from demo.atoms import VOCAB
from kvpop_jax import load_pretrained
from kvpop_jax.checkpoint import check_checkpoint
from kvpop_jax.config import Qwen3Config
from kvpop_jax.modeling import init_params
from kvpop_jax.runtime import interrupt_outside_gc_callbacks
from kvpop_jax.sampling import SamplingConfig
from train.demo_teacher.config import PretrainConfig
from train.demo_teacher.data import BOS_ID, EOS_ID, parse_curriculum
from train.demo_teacher.evaluate import export, final_eval
from train.config import FlagError, check_output_dir
from train.demo_teacher.loop import check_saved_run, train

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("run_dir", "runs/demo_teacher", "Training state, metrics log (resumes from here).", **d)
    flags.DEFINE_string("out_dir", "runs/demo_teacher/export", "Exported HF-format teacher + tokenizer (a folder "
                        "that already holds a model is refused unless --overwrite_out_dir).", **d)
    flags.DEFINE_bool("overwrite_out_dir", False, "Replace the model an existing --out_dir holds (e.g. the shipped "
                      "checkpoints/demo-teacher, which configs/tiny_teacher_park_all.flags writes).", **d)
    flags.DEFINE_integer("hidden_size", 192, "Model width.", **d)
    flags.DEFINE_integer("intermediate_size", 512, "SwiGLU width.", **d)
    flags.DEFINE_integer("num_layers", 3, "Decoder layers.", **d)
    flags.DEFINE_integer("num_heads", 4, "Query heads.", **d)
    flags.DEFINE_integer("num_kv_heads", 2, "KV heads (GQA).", **d)
    flags.DEFINE_integer("head_dim", 48, "Head dimension.", **d)
    flags.DEFINE_float("rope_theta", 10_000.0, "RoPE base.", **d)
    flags.DEFINE_integer("max_position_embeddings", 4096, "Recorded in config.json.", **d)
    flags.DEFINE_string("offset_heads", "", "Comma-separated offsets: KV head i of layer 0 starts as an "
                        "offset-i-back head (sets attention_bias); e.g. 1,2. Empty: plain random init.", **d)
    flags.DEFINE_bool("recall_head", False, "Plant the recall head too (reads `q=4` lines, the recall drills' and the "
                      "reuse task's until stop 33; "
                      "train/demo_teacher/init.py); needs --lookup_circuit.", **d)
    flags.DEFINE_string("init_from", "", "Start from this exported teacher (HF dir) instead of a fresh init, "
                        "e.g. stage 2 on top of stage 1's runs/demo_teacher/export (configs/tiny_teacher_reuse.flags); "
                        "the model's shape is the checkpoint's.", **d)
    flags.DEFINE_bool("lookup_circuit", False, "Plant the lookup circuit at init (train/demo_teacher/init.py); "
                      "needs offset_heads=1,...", **d)
    flags.DEFINE_string("difficulty", "medium", "Demo task difficulty (easy|medium|hard).", **d)
    flags.DEFINE_integer("seed", 0, "Data and init seed.", **d)
    flags.DEFINE_string("curriculum", "256:1000,1024:500", "Phases LEN:STEPS[:BATCH][:KEY=VALUE/...] (prompt length, "
                        "steps, rows; overrides: demo-task fields, drill/lookup/recall/reuse row shares, park=W the "
                        "phase's parking-loss weight instead of --park_weight, difficulty=D and task=T presets).", **d)
    flags.DEFINE_integer("batch", 16, "Rows per step where a phase does not say.", **d)
    flags.DEFINE_float("lr", 3e-3, "Peak learning rate.", **d)
    flags.DEFINE_float("final_lr", 1e-4, "Learning rate at the last step (cosine).", **d)
    flags.DEFINE_integer("warmup_steps", 100, "Linear warmup steps.", **d)
    flags.DEFINE_float("weight_decay", 0.05, "AdamW decoupled weight decay (matrices only).", **d)
    flags.DEFINE_float("b1", 0.9, "Adam beta1.", **d)
    flags.DEFINE_float("b2", 0.98, "Adam beta2.", **d)
    flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clip.", **d)
    flags.DEFINE_float("prompt_weight", 1.0, "Loss weight of prompt tokens.", **d)
    flags.DEFINE_float("completion_weight", 5.0, "Loss weight of completion tokens (and <eos>).", **d)
    flags.DEFINE_integer("eval_every", 250, "Held-out greedy accuracy every N steps (0: never).", **d)
    flags.DEFINE_integer("eval_examples", 32, "Validation prompts per periodic eval.", **d)
    flags.DEFINE_integer("eval_batch", 16, "Prompts per generate call.", **d)
    flags.DEFINE_integer("final_eval_examples", 200, "Test prompts per length in the final eval.", **d)
    flags.DEFINE_string("final_eval_lens", "", "Prompt lengths of the final eval (default: the last phase's).", **d)
    flags.DEFINE_integer("checkpoint_every", 100, "Save the resumable state every N steps.", **d)
    flags.DEFINE_integer("log_every", 20, "Log metrics every N steps.", **d)
    flags.DEFINE_float("park_weight", 0.0, "Weight of the parking loss: the mean attention that a name of a "
                       "binding (whose digit no lookup can predict) pays to keys older than "
                       "--park_window, over every head (train/demo_teacher/loop.py: park_loss). 0: off.", **d)
    flags.DEFINE_enum("park_queries", "names", ["names", "all"], "Parking loss: the queries it parks, the names "
                      "of bindings, or every prompt query but the lookups.", **d)
    flags.DEFINE_bool("park_lookups", False, "Parking loss: at each lookup (a name after `>`) also the old "
                      "attention of every head but the layer's largest, so that one head reads the fact.", **d)
    flags.DEFINE_integer("park_window", 32, "Parking loss: keys this many tokens back or older count as a read "
                         "(the KVpop window of the demo recipe, whose target ignores newer keys).", **d)
    flags.DEFINE_bool("eval_only", False, "Only evaluate the exported OUT_DIR model (test split, final_eval_lens).", **d)
    flags.DEFINE_float("eval_temperature", 0.0, "eval_only: 0 = greedy; else top-p 0.95 / top-k 20 sampling.", **d)
    flags.DEFINE_enum("export_dtype", "float32", ["float32", "bfloat16"], "Dtype of the exported weights.", **d)


SHAPE_FLAGS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "rope_theta": "rope_theta",
               "max_position_embeddings": "max_position_embeddings"}


def _int_list(f: flags.FlagValues, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in getattr(f, name).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name}={getattr(f, name)!r} must be comma-separated integers") from None


def config_from_flags(f: flags.FlagValues = FLAGS) -> PretrainConfig:
    offsets = _int_list(f, "offset_heads")
    model = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=f.hidden_size, intermediate_size=f.intermediate_size,
        num_hidden_layers=f.num_layers, num_attention_heads=f.num_heads, num_key_value_heads=f.num_kv_heads,
        head_dim=f.head_dim, rope_theta=f.rope_theta, tie_word_embeddings=True, attention_bias=bool(offsets),
        max_position_embeddings=f.max_position_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    if f.init_from and not f.eval_only:  # the model is the checkpoint's; the shape flags describe a fresh init
        try:  # its config and weights' headers, before any work (a file given for the folder failed at load)
            model = check_checkpoint(f.init_from)
        except FileNotFoundError as e:
            raise FlagError(f"--init_from: {e}" + ("" if os.path.exists(f.init_from) else
                            " (a stage's --init_from is the --out_dir of the stage before it: train that one "
                            "first)")) from None
        given = [f"--{flag}={getattr(f, flag)} (the checkpoint's {getattr(model, field)})"
                 for flag, field in SHAPE_FLAGS.items()
                 if f[flag].present and getattr(f, flag) != getattr(model, field)]
        if given:  # they were ignored without a word
            raise ValueError(f"--init_from={f.init_from!r} fixes the model's shape; drop {', '.join(given)}")
    phases = parse_curriculum(f.curriculum, f.batch)
    if not phases:
        raise ValueError(f"--curriculum={f.curriculum!r} needs at least one phase LEN:STEPS[:BATCH][:KEY=VALUE/...]")
    lens = _int_list(f, "final_eval_lens") or (phases[-1].prompt_len,)
    return PretrainConfig(
        model=model, phases=phases, run_dir=f.run_dir, out_dir=f.out_dir, difficulty=f.difficulty, seed=f.seed,
        lr=f.lr, final_lr=f.final_lr, warmup_steps=f.warmup_steps, weight_decay=f.weight_decay, b1=f.b1, b2=f.b2,
        clip_norm=f.clip_norm, prompt_weight=f.prompt_weight, completion_weight=f.completion_weight,
        eval_every=f.eval_every, eval_examples=f.eval_examples, eval_batch=f.eval_batch,
        final_eval_examples=f.final_eval_examples, final_eval_lens=lens, checkpoint_every=f.checkpoint_every,
        log_every=f.log_every, export_dtype=f.export_dtype, offset_heads=offsets,
        lookup_circuit=f.lookup_circuit, recall_head=f.recall_head, init_from=f.init_from,
        park_weight=f.park_weight, park_window=f.park_window,
        park_queries=f.park_queries, park_lookups=f.park_lookups)


def check_outputs(cfg: PretrainConfig, overwrite: bool) -> None:
    """Before any step: both folders can be written, and the export would not silently replace a model."""
    check_output_dir(cfg.run_dir, "--run_dir")
    check_output_dir(cfg.out_dir, "--out_dir", swapped=True)
    held = [n for n in ("config.json", "model.safetensors") if os.path.isfile(os.path.join(cfg.out_dir, n))]
    if held and not overwrite:
        raise FlagError(f"--out_dir={cfg.out_dir} already holds a model ({', '.join(held)}): pass --overwrite_out_dir "
                        "to replace it, or another --out_dir")


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}: train.pretrain takes only flags (--name=value)",
              file=sys.stderr)
        sys.exit(2)
    interrupt_outside_gc_callbacks()
    saved_seconds = None  # training seconds of the state RUN_DIR holds
    try:  # a bad flag or input: one line, before any work
        cfg = config_from_flags(FLAGS)
        if not FLAGS.eval_only:
            check_outputs(cfg, FLAGS.overwrite_out_dir)
            saved = check_saved_run(cfg)  # a resume with other settings is refused
            saved_seconds = None if saved is None else float(saved.get("elapsed_s", 0.0))
    except (ValueError, FileNotFoundError, FlagError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        run(cfg, saved_seconds)
    except KeyboardInterrupt:  # state.msgpack is replaced atomically: the last one saved is whole
        print(f"\ninterrupted; rerun the same command to resume from the last state saved in {cfg.run_dir}",
              file=sys.stderr)
        sys.exit(130)


def run(cfg: PretrainConfig, saved_seconds: float | None = None) -> None:
    if FLAGS.eval_only:
        model_config, params = load_pretrained(cfg.out_dir)
        sampling = None if FLAGS.eval_temperature == 0 else SamplingConfig(FLAGS.eval_temperature, 0.95, 20, 0.0)
        final_eval(dataclasses.replace(cfg, model=model_config), params, sampling)
        return
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))))
    print(f"demo teacher: {n_params:,} params, {cfg.total_steps} steps in {len(cfg.phases)} phases")
    state, records = train(cfg)
    train_seconds = next((r["elapsed_s"] for r in reversed(records) if "elapsed_s" in r), None)
    if train_seconds is None:  # nothing left to train (a rerun of a finished run): the saved run's time
        train_seconds = saved_seconds
    results = final_eval(cfg, state.params)
    command = "python -m train.pretrain " + " ".join(sys.argv[1:])
    export(cfg, state.params, results, command, train_seconds)
    print(f"exported to {cfg.out_dir}")
