"""`--dry_run`: compile the train step for the real shapes on abstract arrays and print the
per-device memory, without weights or data."""

from __future__ import annotations

import sys
import time

import jax

from kvpop_jax import sharding as shd
from kvpop_jax.checkpoint import check_checkpoint
from kvpop_jax.config import memory_words
from train import optim
from train.config import TrainConfig, load_model_config
from train.setup import build_mesh, jitted_step, step_config


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _retrofit(cfg: TrainConfig) -> str:
    if cfg.retrofit == "dms":
        d = cfg.dms
        return (f"DMS (w={d.window}, memory {d.budget} per KV head, target eviction {d.target_eviction:.4f}, "
                f"gate width {d.gate_hidden})")
    kv = cfg.kvpop
    return (f"s={kv.sinks}, w={kv.window}, k={kv.topk}: {memory_words(kv.budget, kv.memory(cfg.head_dim))}, "
            f"scorer {kv.scorer}")


def dry_run(cfg: TrainConfig) -> dict[str, int]:
    """Lowers + compiles the step for the real shapes on abstract arrays; prints per-device bytes."""
    mesh = build_mesh(cfg)
    model_config = load_model_config(cfg)
    if cfg.init_checkpoint and not cfg.random_init:  # not needed here; a training would stop on it
        try:
            check_checkpoint(cfg.init_checkpoint)
        except (ValueError, FileNotFoundError) as e:
            print(f"note: --init_checkpoint={cfg.init_checkpoint}: {e}. This dry run needs only the architecture; "
                  "the training would stop here", file=sys.stderr)
    sc = step_config(cfg, model_config)
    tx = optim.make_optimizer(cfg.optim)
    step_fn, (state_sh, teacher_sh, batch_sh), args = jitted_step(cfg, mesh, model_config, sc, tx)
    abstract_state, abstract_teacher, batch_like = args
    t0 = time.perf_counter()
    lowered = step_fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    analysis = compiled.memory_analysis()
    report = {
        "devices": mesh.size,
        "params": shd.per_device_bytes(abstract_state.params, state_sh.params),
        "opt_state": shd.per_device_bytes(abstract_state.opt_state, state_sh.opt_state),
        "teacher": 0 if abstract_teacher is None else shd.per_device_bytes(abstract_teacher, teacher_sh),
        "batch": shd.per_device_bytes(batch_like, batch_sh),
    }
    for name in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes"):
        report[name] = int(getattr(analysis, name, 0) or 0) if analysis is not None else -1
    peak = report["argument_size_in_bytes"] + report["output_size_in_bytes"] - report["alias_size_in_bytes"] \
        + report["temp_size_in_bytes"]
    report["peak_estimate"] = peak
    mesh_desc = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
    print(f"dry run: {model_config.num_hidden_layers} layers, hidden {model_config.hidden_size}, "
          f"S={cfg.seq_len}, global batch {cfg.global_batch} = {cfg.grad_accum} x micro {cfg.micro_batch}, "
          f"{_retrofit(cfg)}, remat {cfg.remat}{', scanned layers' if cfg.scan_layers else ''}, "
          f"loss_chunk {cfg.loss_chunk or cfg.seq_len}, "
          f"{cfg.compute_dtype} compute, {cfg.param_dtype} params, {cfg.teacher_dtype} teacher")
    print(f"mesh {mesh_desc} on {mesh.size} {jax.devices()[0].platform} devices; "
          f"lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s")
    print("per-device bytes:")
    for name in ("params", "opt_state", "teacher", "batch", "argument_size_in_bytes", "output_size_in_bytes",
                 "alias_size_in_bytes", "temp_size_in_bytes", "peak_estimate"):
        print(f"  {name:24s} {_gb(report[name]):>12s}  ({report[name]} bytes)")
    if jax.devices()[0].platform == "cpu":  # a CPU login node: say what the numbers are not
        dp = mesh.shape["data"] * mesh.shape["fsdp"]
        print(f"note: XLA:CPU's sizes for this machine's mesh of {mesh.size} device(s), each holding "
              f"{cfg.micro_batch // dp} of the micro-batch's {cfg.micro_batch} rows and 1/{mesh.shape['fsdp']} of "
              "the FSDP-sharded weights; not a GPU node's. For a node of N GPUs run it again with "
              "XLA_FLAGS=--xla_force_host_platform_device_count=N (XLA:GPU's temporaries still differ from "
              "XLA:CPU's).")
    sys.stdout.flush()
    return report
