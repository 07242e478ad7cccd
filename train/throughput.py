"""`python -m train.throughput --flagfile=configs/qwen3_8b_cr88.flags --num_layers=4`: tokens/s and MFU.

Times the real train step (`train/step.py`: teacher forward, KVpop student forward + backward,
retention and KL losses, AdamW) of a randomly initialized model with a recipe's settings, on
random token ids, with no data pipeline, checkpoints or disk I/O. `--num_layers` cuts the
architecture's depth (e.g. 4 layers of Qwen3-8B's width) so a few steps fit in a minute.
The first step compiles; the median of the others is reported.

MFU = model FLOPs per step / step time / (peak bf16 FLOP/s x devices), counting per token the
student's forward + backward (6N) and the teacher's forward (2N), N = matmul parameters
(lm_head included, embedding lookup not), plus dense causal attention: 4·L·Hq·D·S/2 per
forward (QKᵀ and PV over S/2 keys on average), x3 for the student and x1 for the teacher,
8·L·Hq·D·S in all. Rematerialization, the scorers and the target pass are not counted (they are
overhead, not model work). Peak: `PEAK_BF16_FLOPS` by device kind; unknown kinds (and CPUs)
report no MFU.

    python -m train.throughput --flagfile=configs/qwen3_8b_cr88.flags --init_checkpoint=random:qwen3_8b \
        --data=demo:1 --run_dir=/tmp/throughput --num_layers=4 --global_batch=8 --micro_batch=8
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from absl import app, flags

from eval import profile_ops
from kvpop_jax import modeling
from kvpop_jax.fileio import atomic_write_bytes, check_writable_file
from kvpop_jax.config import Qwen3Config
from kvpop_jax.runtime import ctrl_c_kills, gpu_workload_reasons, report_backend
from train import optim
from train import step as st
from train.config import FlagError, TrainConfig, load_model_config, parse_flags
from train.configure import config_from_flags
from train.flags import define_flags
from train.setup import build_mesh, jitted_step, step_config, to_global

# Dense bf16 tensor-core peak per device (vendor datasheets, SXM parts), matched by substring.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "GH200": 989.4e12, "B200": 2250e12, "A100": 312e12}

FLAGS = flags.FLAGS


def define_throughput_flags(fv: flags.FlagValues) -> None:
    """train.main's flags plus this command's own (declared when run, so that importing is free)."""
    define_flags(fv)
    flags.DEFINE_integer("num_layers", 0, "Use this many layers of the architecture (0: all).", flag_values=fv)
    flags.DEFINE_integer("timed_steps", 3, "Steps timed after the compiling one.", flag_values=fv)
    flags.DEFINE_string("json_out", None, "Also write the result as JSON here.", flag_values=fv)
    flags.DEFINE_string("profile_dir", None, "After the timed steps, profile one more step into this directory "
                        "(jax.profiler, with a perfetto trace) and print where its time goes per XLA op "
                        "(eval/profile_ops.py). The timed steps are not profiled.", flag_values=fv)


def matmul_params(config: Qwen3Config) -> int:
    """N: weights a token multiplies with (q/k/v/o, MLP, lm_head), per the Qwen3 architecture."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * h * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp) + h * config.vocab_size


def model_flops_per_token(config: Qwen3Config, seq_len: int) -> float:
    """Student forward + backward and teacher forward, causal attention (see the module docstring)."""
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len / 2
    return 8 * matmul_params(config) + 4 * attention  # (6N + 3·attn) + (2N + attn)


def peak_flops(device_kind: str) -> float | None:
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device_kind:
            return flops
    return None


def _random_batch(cfg: TrainConfig, vocab: int, seed: int) -> dict[str, np.ndarray]:
    shape = (cfg.grad_accum, cfg.micro_batch, cfg.seq_len)
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, vocab, shape, dtype=np.int32),
            "positions": np.broadcast_to(np.arange(cfg.seq_len, dtype=np.int32), shape).copy(),
            "loss_mask": np.ones(shape, np.float32), "segment_ids": np.ones(shape, np.int32)}


def random_state(cfg: TrainConfig, model_config: Qwen3Config, sc: st.StepConfig, tx, shardings):
    """(train state, teacher params) of a random model (seed `cfg.seed`), built on the devices with
    the step's (state, teacher) shardings: the student retrofitted, both in the step's dtypes."""

    def init(key):
        base = modeling.init_params(model_config, key)
        params = modeling.retrofit_params(sc.model, base, jax.random.fold_in(key, 1))
        params = jax.tree.map(lambda x: x.astype(sc.param_dtype), params)
        teacher = jax.tree.map(lambda x: x.astype(sc.teacher_dtype), base)
        return st.init_state(params, tx, cfg.seed), teacher

    return jax.jit(init, out_shardings=tuple(shardings))(jax.random.PRNGKey(cfg.seed))


def measure_throughput(cfg: TrainConfig, *, num_layers: int = 0, timed_steps: int = 3,
                       profile_dir: str | None = None) -> dict:
    """Runs 1 + timed_steps train steps of a random model; returns tokens/s, MFU and the setup.
    profile_dir: then one more step under `jax.profiler.trace`; the result's "profile" holds its op
    table (`eval.profile_ops`) and the trace's path."""
    if cfg.teacher_logits_dir:
        raise FlagError("the throughput run computes the teacher on the fly: drop --teacher_logits_dir")
    if timed_steps < 1:
        raise FlagError(f"--timed_steps must be >= 1 (the first step compiles and is not timed), got {timed_steps}")
    model_config = load_model_config(cfg)
    if not 0 <= num_layers <= model_config.num_hidden_layers:
        raise FlagError(f"--num_layers must be in [0, {model_config.num_hidden_layers}] (0: all of the architecture's "
                        f"{model_config.num_hidden_layers} layers), got {num_layers}")
    if num_layers:
        model_config = dataclasses.replace(model_config, num_hidden_layers=num_layers)
    mesh = build_mesh(cfg)
    sc = step_config(cfg, model_config)
    tx = optim.make_optimizer(cfg.optim)
    step_fn, (state_sh, teacher_sh, batch_sh), _ = jitted_step(cfg, mesh, model_config, sc, tx)
    state, teacher = random_state(cfg, model_config, sc, tx, (state_sh, teacher_sh))
    times = []
    for i in range(1 + timed_steps):
        batch = to_global(_random_batch(cfg, model_config.vocab_size, cfg.seed + i), batch_sh)
        t0 = time.perf_counter()
        state, metrics = step_fn(state, teacher, batch)
        metrics = jax.device_get(metrics)
        times.append(time.perf_counter() - t0)
    if not all(np.isfinite(float(metrics[k])) for k in ("loss", "kl", "retention_loss")):
        raise FloatingPointError(f"non-finite loss in the throughput run: {metrics}")
    step_s = statistics.median(times[1:]) if timed_steps else times[0]
    profile = None
    if profile_dir:  # after the timing: a profiler that fails (no CUPTI, say) costs only its table
        batch = to_global(_random_batch(cfg, model_config.vocab_size, cfg.seed + 1 + timed_steps), batch_sh)
        try:
            with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
                t0 = time.perf_counter()
                state, _ = step_fn(state, teacher, batch)
                jax.block_until_ready(state)
                profiled_s = time.perf_counter() - t0
            path = profile_ops.find_trace(profile_dir)
            ops = profile_ops.op_profile(path)
        except Exception as e:  # noqa: BLE001 - reported, the throughput stands
            profile = {"error": f"{type(e).__name__}: {e}"}
        else:
            profile = {"trace": path, "step_s": profiled_s, "markdown": profile_ops.markdown(ops),
                       "busy_s": ops.busy_us / 1e6, "span_s": ops.span_us / 1e6,
                       "by_category_s": {k: v / 1e6 for k, v in ops.by_category.items()}}
    tokens = cfg.global_batch * cfg.seq_len
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind)
    flops = model_flops_per_token(model_config, cfg.seq_len) * tokens
    return {
        "device_kind": device.device_kind, "platform": device.platform, "devices": mesh.size,
        "layers": model_config.num_hidden_layers, "hidden": model_config.hidden_size,
        "heads": f"{model_config.num_attention_heads}/{model_config.num_key_value_heads}x{model_config.head_dim}",
        "vocab": model_config.vocab_size, "params_matmul": matmul_params(model_config),
        "seq_len": cfg.seq_len, "global_batch": cfg.global_batch, "micro_batch": cfg.micro_batch,
        "budget": f"DMS w={cfg.dms.window} memory={cfg.dms.budget}" if cfg.retrofit == "dms" else
                  f"s={cfg.kvpop.sinks} w={cfg.kvpop.window} k={cfg.kvpop.topk}",
        "scorer": f"dms gate {cfg.dms.gate_hidden}" if cfg.retrofit == "dms" else cfg.kvpop.scorer,
        "compute_dtype": cfg.compute_dtype, "remat": cfg.remat, "scan_layers": cfg.scan_layers,
        "compile_and_first_step_s": times[0], "step_s": step_s, "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_device": tokens / step_s / mesh.size, "model_tflops_per_step": flops / 1e12,
        "mfu": None if peak is None else flops / step_s / (peak * mesh.size),
        "loss": float(metrics["loss"]), "profile": profile,
    }


def main(argv):
    if len(argv) > 1:  # one line and exit 2, as train.main (absl's UsageError prints the docstring and every flag)
        print(f"error: unexpected arguments {argv[1:]}: train.throughput takes only flags (--name=value)",
              file=sys.stderr)
        sys.exit(2)
    try:
        ckpt = FLAGS.init_checkpoint  # the recipes name the HF weights, which a GPU node may not have yet
        if ckpt and not ckpt.startswith("random:") and not os.path.isdir(ckpt):
            raise FlagError(f"--init_checkpoint={ckpt}: {'a file' if os.path.isfile(ckpt) else 'no such directory'}; "
                            "train.throughput times a random model "
                            f"anyway, so pass --init_checkpoint=random:{FLAGS.model_config or 'NAME'} (the "
                            "architecture, configs/models/NAME.json)")
        if FLAGS.dry_run:
            raise FlagError("--dry_run compiles without running a step, and train.throughput times steps: drop it "
                            "(python -m train.main ... --dry_run reports the compile and per-device memory)")
        if FLAGS.json_out:  # checked before minutes of compiling, not after
            try:
                check_writable_file(FLAGS.json_out, "--json_out")
            except ValueError as e:
                raise FlagError(str(e)) from None
        cfg = config_from_flags(FLAGS, on_accelerator=None)
        unused = [f"--{name}" for name, value in (("variants", cfg.variants), ("eval_methods", cfg.evaluation),
                                                    ("quick", FLAGS.quick)) if value]
        if unused:
            print(f"note: train.throughput times one train step of the flags' own retrofit ({cfg.retrofit}"
                  + ("" if cfg.retrofit == "dms" else f", scorer {cfg.kvpop.scorer}, k {cfg.kvpop.topk}")
                  + f"); {', '.join(unused)} and what they imply are not used here", file=sys.stderr)
        # the flag as given (auto is float32 on a CPU): a recipe's bfloat16 or 16k rows on a CPU warn, as in train.main
        report_backend(gpu_workload_reasons(compute_dtype=FLAGS.compute_dtype, seq_len=cfg.seq_len),
                       what="this throughput run")
        with ctrl_c_kills():  # it writes nothing until the end: Ctrl-C stops it at once, compile included
            result = measure_throughput(cfg, num_layers=FLAGS.num_layers, timed_steps=FLAGS.timed_steps,
                                        profile_dir=FLAGS.profile_dir)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    mfu = "n/a (unknown peak)" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    print(f"throughput: {result['tokens_per_s']:.0f} tokens/s ({result['tokens_per_s_per_device']:.0f} per device), "
          f"step {result['step_s']:.3f} s, MFU {mfu}")
    if result["profile"] and "error" in result["profile"]:
        print(f"profiling failed: {result['profile']['error']}", file=sys.stderr)
    elif result["profile"]:
        print(f"profiled step ({result['profile']['step_s']:.3f} s under the profiler), trace "
              f"{result['profile']['trace']}:\n{result['profile']['markdown']}")
    print(json.dumps(result))
    if FLAGS.json_out:  # whole or not at all; its folder was checked creatable before the work
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
        atomic_write_bytes(FLAGS.json_out, json.dumps(result, indent=1).encode())


if __name__ == "__main__":
    define_throughput_flags(FLAGS)
    app.run(main, flags_parser=parse_flags)
