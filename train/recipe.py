"""Several retrofits of one teacher, then the demo comparison: what README command 1 runs.

`python -m train.main --flagfile=configs/tiny_cpu.flags` trains each of `--variants`
(kvpop-mlstm, kvpop-mlp, streamingllm+) from the same dense checkpoint with the same data,
budget and schedule, one after another into RUN_DIR/NAME (each a normal, resumable
`train.main.train` run with its own checkpoints, metrics and export), then, with
`--eval_methods`, decodes held-out demo-task problems (`demo/task.py`, test split) with
every method at every compression ratio and prints the paper's Table-1-style comparison:

    RUN_DIR/eval/accuracy.md|png|json   pass@1 table, bars, all numbers (`eval.accuracy`)
    RUN_DIR/eval/samples.jsonl          every completion with its extracted answer
    RUN_DIR/eval/recall_NAME/           teacher-retention recall of each KVpop variant
    RUN_DIR/eval/training.png           loss curves of the variants
    RUN_DIR/eval/summary.md             the table, recall and the demo targets, met or not

Decoding is greedy (one rollout per problem), so the table is deterministic. The dense
checkpoint serves dense, StreamingLLM, TOVA and H2O; the variants are decoded with their
bounded caches, retargeted to each CR's budget B = (1 - CR) * prompt_len by changing k
(kvpop) or w (StreamingLLM+, k = 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax.numpy as jnp

from demo.task import generate_dataset, make_config, write_jsonl
from eval.accuracy import benchmark_name, format_table, run_accuracy
from eval.plots import plt, save_figure, write_text
from eval.recall import run_recall
from kvpop_jax.baselines import METHODS as TRAINING_FREE
from kvpop_jax.sampling import SamplingConfig
from train.config import TrainConfig, variant_kvpop
from train.loop import train
from train.run_dir import checkpoint_steps, lock_run_dir
from train.setup import info, prepare_init_checkpoint, run_tokenizer

# The demo's targets (issue 7) at the highest compression ratio: name, the methods they need, check.
TARGETS = (
    ("dense pass@1 >= 0.90", ("dense",), lambda r: r["dense"] >= 0.90),
    ("kvpop-mlstm >= 95% of dense", ("dense", "kvpop-mlstm"),
     lambda r: r["dense"] > 0 and r["kvpop-mlstm"] >= 0.95 * r["dense"]),
    ("kvpop-mlstm beats streaming and tova by >= 20 points", ("kvpop-mlstm", "streaming", "tova"),
     lambda r: r["kvpop-mlstm"] - max(r["streaming"], r["tova"]) >= 0.20),
    ("kvpop-mlstm >= kvpop-mlp", ("kvpop-mlstm", "kvpop-mlp"), lambda r: r["kvpop-mlstm"] >= r["kvpop-mlp"]),
)


def check_targets(scores: dict[str, float]) -> list[tuple[str, bool | None]]:
    """(target, met) for each of TARGETS; met is None when a method it needs was not evaluated."""
    return [(text, check(scores) if all(m in scores for m in needs) else None) for text, needs, check in TARGETS]


def variant_config(cfg: TrainConfig, name: str, init_dir: str, tokenizer_dir: str) -> TrainConfig:
    """The TrainConfig of one variant: its KVpop settings, RUN_DIR/NAME, the shared init and tokenizer."""
    run_dir = os.path.join(cfg.run_dir, name)
    return dataclasses.replace(cfg, kvpop=variant_kvpop(cfg.kvpop, name, cfg.head_dim), run_dir=run_dir,
                               export_dir=os.path.join(run_dir, "export"), init_checkpoint=init_dir,
                               tokenizer=tokenizer_dir, variants=(), evaluation=None, export=True)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Trains every variant (or the single run of the flags), then evaluates if asked; holds RUN_DIR's
    lock throughout (each variant's run also locks RUN_DIR/NAME)."""
    with lock_run_dir(cfg.run_dir):
        return _run(cfg)


def _run(cfg: TrainConfig) -> dict[str, Any]:
    start = time.perf_counter()
    init_dir = prepare_init_checkpoint(cfg)
    _, tokenizer_dir = run_tokenizer(cfg, init_dir)
    exports, times = {}, {}
    for name in cfg.variants:
        vcfg = variant_config(cfg, name, init_dir, tokenizer_dir)
        exports[name] = vcfg.export_dir
        if finished(vcfg) and not cfg.overwrite:  # a rerun after a crash skips what is done
            info(f"[{name}] already trained: {vcfg.export_dir}")
            continue
        info(f"[{name}] training into {vcfg.run_dir} (B = {vcfg.kvpop.budget}: s {vcfg.kvpop.sinks}, "
                     f"w {vcfg.kvpop.window}, k {vcfg.kvpop.topk})")
        t0 = time.perf_counter()
        train(vcfg)
        times[name] = time.perf_counter() - t0
    if not cfg.variants:
        train(cfg)
        exports = {"kvpop": cfg.export_dir}
    summary: dict[str, Any] = {"exports": exports, "train_seconds": times}
    if cfg.evaluation is not None:
        t0 = time.perf_counter()
        summary["evaluation"] = evaluate(cfg, init_dir, tokenizer_dir, exports)
        times["evaluation"] = time.perf_counter() - t0
    info("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
                 + f"; total {time.perf_counter() - start:.0f} s")
    return summary


def finished(cfg: TrainConfig) -> bool:
    """Whether a run's last checkpoint is its final step and its export is written."""
    return max(checkpoint_steps(cfg), default=-1) >= cfg.steps and os.path.isfile(os.path.join(cfg.export_dir, "config.json"))


def heldout_problems(cfg: TrainConfig, path: str) -> str:
    """Writes the held-out demo problems (test split, seed --seed) as JSONL once; returns the path."""
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        ev = cfg.evaluation
        write_jsonl(path + ".tmp", generate_dataset(ev.problems, cfg.seed, "test", seq_len=ev.prompt_len))
        os.replace(path + ".tmp", path)
    return path


def evaluate(cfg: TrainConfig, init_dir: str, tokenizer_dir: str, exports: dict[str, str]) -> dict[str, Any]:
    """Greedy pass@1 of every method x CR, recall of the KVpop variants, plots and the summary."""
    ev = cfg.evaluation
    out = os.path.join(cfg.run_dir, "eval")
    data = heldout_problems(cfg, os.path.join(out, f"demo_test_s{cfg.seed}_{ev.problems}x{ev.prompt_len}.jsonl"))
    checkpoints = {"dense": init_dir, **{m: exports[m] for m in ev.methods if m not in TRAINING_FREE}}
    info(f"evaluating {', '.join(ev.methods)} at CR {', '.join(f'{c:.0%}' for c in ev.compression_ratios)} "
                 f"on {ev.problems} held-out problems of {ev.prompt_len} tokens")
    rows = run_accuracy(ev.methods, checkpoints, data, n_rollouts=1, compression_ratios=ev.compression_ratios,
                        context_len=ev.prompt_len, max_new_tokens=make_config(seq_len=ev.prompt_len).completion_tokens + 2,
                        sampling=SamplingConfig.greedy(), out_dir=out, tokenizer=tokenizer_dir,
                        sinks=cfg.kvpop.sinks, problem_batch=ev.batch, dtype=jnp.float32, progress=cfg.progress)
    recall = {}
    if ev.recall_sequences:
        for name in (m for m in ev.methods if m in exports and variant_kvpop(cfg.kvpop, m, cfg.head_dim).topk > 0):
            result = run_recall(exports[name], data, num_sequences=ev.recall_sequences, seq_len=ev.prompt_len,
                                out_dir=os.path.join(out, f"recall_{name}"), progress=cfg.progress)
            recall[name] = result.global_mean
    plot_training(cfg, list(exports), os.path.join(out, "training.png"))
    summary = write_summary(cfg, rows, recall, benchmark_name(data), os.path.join(out, "summary.md"))
    print(summary, flush=True)
    return {"rows": rows, "recall": recall, "out_dir": out}


def scores_at(rows: list[dict], cr: float) -> dict[str, float]:
    """method -> pass@1 at compression ratio `cr` (dense has no CR and is always included)."""
    out = {r["method"]: r["abs"] for r in rows if r["cr"] is not None and abs(r["cr"] - cr) < 1e-9}
    out.update({r["method"]: r["abs"] for r in rows if r["method"] == "dense"})
    return out


def write_summary(cfg: TrainConfig, rows: list[dict], recall: dict[str, float], benchmark: str, path: str) -> str:
    ev = cfg.evaluation
    lines = [f"# Demo comparison: {ev.problems} held-out problems, {ev.prompt_len}-token prompts, greedy pass@1",
             "", format_table(rows, [benchmark]).rstrip(), ""]
    if recall:
        lines += ["Teacher-retention recall (share of the teacher's top-B tokens the policy keeps, "
                  f"{ev.recall_sequences} held-out traces at the trained budget):", ""]
        lines += [f"- {name}: {value:.3f}" for name, value in recall.items()] + [""]
    cr = max(ev.compression_ratios)
    lines += [f"Targets at CR {cr:.0%}:", ""]
    for text, ok in check_targets(scores_at(rows, cr)):
        lines.append(f"- [{'x' if ok else ' '}] {text}" + (" (not measured)" if ok is None else ""))
    if recall:
        lines.append(f"- [{'x' if min(recall.values()) >= 0.8 else ' '}] teacher-retention recall >= 0.80")
    lines.append("")
    text = "\n".join(lines)
    write_text(path, text)
    return text


def plot_training(cfg: TrainConfig, names: list[str], path: str) -> None:
    """Loss, KL and retention loss of each variant against steps (from RUN_DIR/NAME/metrics.jsonl)."""
    keys = ("loss", "kl", "retention_loss", "teacher_recall")
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8))
    for name in names:
        metrics_path = os.path.join(cfg.run_dir, name, "metrics.jsonl") if cfg.variants else os.path.join(
            cfg.run_dir, "metrics.jsonl")
        if not os.path.isfile(metrics_path):
            continue
        with open(metrics_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        for ax, key in zip(axes, keys):
            pts = [(r["step"], r[key]) for r in records if key in r]
            if pts:
                ax.plot(*zip(*pts), label=name)
    for ax, key in zip(axes, keys):
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
