"""Several retrofits of one teacher, then the demo comparison: what README command 1 runs.

`python -m train.main --flagfile=configs/tiny_cpu.flags` trains each of `--variants`
(kvpop-mlstm, kvpop-mlp, streamingllm+, kvpop-mlstm-max, dms) from the same dense checkpoint with
the same data, memory per KV head and schedule, one after another into RUN_DIR/NAME (each a
normal, resumable `train.loop.train` run with its own checkpoints, metrics and export), then,
with `--eval_methods`, decodes fresh held-out demo problems of every `--eval_tasks` task
(`demo/task.py`, test split) with every method at every compression ratio and prints the paper's
Table-1-style comparison per task, the oracles, the recall, length generalization and the targets:

    RUN_DIR/eval/TASK/accuracy.md|png|json, samples.jsonl   per task (`eval.accuracy`)
    RUN_DIR/eval/long/...                                  the main task at --eval_long_len
    RUN_DIR/eval/recall_NAME_B{B}/                         teacher-retention recall per KVpop variant and budget
    RUN_DIR/eval/dms_patterns/                             DMS's eviction ratio per layer and head (Fig. 8)
    RUN_DIR/eval/training.png                              loss, boundary accuracy / AUC curves
    RUN_DIR/eval/summary.md                                everything printed (`train/recipe_report.py`)
    RUN_DIR/teacher_topk/                                  the teacher's top-k logits, shared (below)

The variants read the same rows in the same order, so the frozen teacher's top-k logits are the
same for all of them: when they fit in `SHARED_TEACHER_MAX_BYTES` (the demo: 126 MB), the
teacher runs once over the training batches (`train.teacher_cache`, files checked against each
row) and every variant distills from those files instead of running the teacher at every step
(about 0.4 s of a 0.8 s demo step: the teacher's dense S x S forward). Larger recipes run the
teacher inline as before.

Decoding is greedy (one rollout per problem), so the tables are deterministic. The dense
checkpoint serves dense, StreamingLLM, TOVA and H2O; the variants are decoded with their
bounded caches, retargeted to each CR's memory budget B = (1 - CR) * prompt_len
(`KVpopConfig.retarget`: k changes, or w for StreamingLLM+; an mLSTM's state counts against B;
DMS keeps its trained gates and gets a pool of B entries per KV head, `DMSConfig.retarget`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging

from demo.oracles import oracle_recovery
from demo.task import generate_dataset, make_config, write_jsonl
from eval.accuracy import JOURNAL_NAME, run_accuracy
from eval.benchmarks import DemoSpec
from eval.dms_patterns import run_dms_patterns
from eval.outputs import journal_file
from eval.recall import run_recall
from kvpop_jax.baselines import METHODS as TRAINING_FREE
from kvpop_jax.checkpoint import checkpoint_fingerprint
from kvpop_jax.config import KVpopConfig, memory_words
from kvpop_jax.fileio import LOCK_FILE, locked_elsewhere
from kvpop_jax.sampling import SamplingConfig
from train.checkpointing import Checkpointer
from train.config import FlagError, TrainConfig, variant_kvpop, variant_retrofit
from train.loop import train
from train.recipe_report import plot_training, write_summary
from train.run_dir import (INIT_FINGERPRINT_KEY, TRAIN_CONFIG_FILE, checkpoint_steps, held_run, lock_run_dir,
                           training_changes)
from train.setup import info, prepare_init_checkpoint, run_tokenizer, stale_demo_data
from train.teacher_cache import step_files, write_teacher_logits

SHARED_TEACHER_MAX_BYTES = 1 << 30  # teacher top-k files the recipe writes once and shares between variants


def teacher_topk_bytes(cfg: TrainConfig) -> int:
    """Disk the teacher's top-k of a whole run takes: float32 value + int32 index per entry."""
    return cfg.steps * cfg.global_batch * cfg.seq_len * cfg.kvpop.kl_topk * 8


def shared_teacher_dir(cfg: TrainConfig) -> str | None:
    """RUN_DIR/teacher_topk when the variants should share one teacher pass, else None."""
    if len(cfg.variants) < 2 or cfg.teacher_logits_dir or teacher_topk_bytes(cfg) > SHARED_TEACHER_MAX_BYTES:
        return None
    return os.path.join(cfg.run_dir, "teacher_topk")


def variant_config(cfg: TrainConfig, name: str, init_dir: str, tokenizer_dir: str,
                   teacher_dir: str | None = None) -> TrainConfig:
    """The TrainConfig of one variant: its KVpop settings, RUN_DIR/NAME, the shared init and tokenizer
    (and the shared teacher top-k files, if any)."""
    run_dir = os.path.join(cfg.run_dir, name)
    retrofit = {"retrofit": "dms"} if name == "dms" else {"kvpop": variant_kvpop(cfg.kvpop, name, cfg.head_dim),
                                                           "retrofit": "kvpop"}
    return dataclasses.replace(cfg, **retrofit, run_dir=run_dir,
                               export_dir=os.path.join(run_dir, "export"), init_checkpoint=init_dir,
                               tokenizer=tokenizer_dir, variants=(), evaluation=None, export=True,
                               teacher_logits_dir=teacher_dir or cfg.teacher_logits_dir)


def describe(cfg: TrainConfig) -> str:
    """The retrofit's budget in one line."""
    if cfg.retrofit == "dms":
        d = cfg.dms
        return (f"DMS: w {d.window}, target eviction {d.target_eviction:.3f} (compression {d.target_compression:.1f}x) for a "
                f"mean occupancy of {d.budget} entries at {cfg.seq_len} tokens, gate width {d.gate_hidden}")
    kv = cfg.kvpop
    return f"s {kv.sinks}, w {kv.window}, k {kv.topk}: {memory_words(kv.budget, kv.memory(cfg.head_dim))}"


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Trains every variant (or the single run of the flags), then evaluates if asked; holds RUN_DIR's
    lock throughout (each variant's run also locks RUN_DIR/NAME)."""
    with lock_run_dir(cfg.run_dir):
        return _run(cfg)


def _run(cfg: TrainConfig) -> dict[str, Any]:
    start = time.perf_counter()
    if cfg.quick:  # said first, not only in the summary at the end
        info(quick_notice(cfg))
    held = {n: what for n in cfg.variants
            if (what := held_run(dataclasses.replace(cfg, run_dir=os.path.join(cfg.run_dir, n))))}
    if held and not cfg.resume and not cfg.overwrite:  # before any work; a finished variant was skipped without a word
        runs = [f"{os.path.join(cfg.run_dir, n)} (a run's {what})" for n, what in held.items()]
        raise FlagError(f"--noresume would start over in {', '.join(runs)}; pass --overwrite to retrain every "
                        "variant, resume without --noresume, or choose another --run_dir")
    if cfg.variants and not cfg.overwrite and stale_demo_data(cfg):
        trained, topk = list(held), shared_teacher_dir(cfg)
        if trained or (topk and step_files(topk)):
            raise FlagError(f"--data=demo:{cfg.demo_examples}: {cfg.data.data} holds traces the demo generator no "
                            "longer writes (the library changed since), and "
                            + (f"{', '.join(trained)} trained" if trained else f"the teacher top-k in {topk} was "
                               "computed") + " on them: pass --overwrite to retrain every variant on the new traces, "
                            "or choose another --run_dir")
    init_dir = prepare_init_checkpoint(cfg)
    _, tokenizer_dir = run_tokenizer(cfg, init_dir)
    exports, times, teacher_seconds = {}, {}, None
    teacher_dir = shared_teacher_dir(cfg)
    if teacher_dir and cfg.overwrite and os.path.isdir(teacher_dir):
        shutil.rmtree(teacher_dir)  # written for the old flags (another teacher, data or kl_topk): recomputed
    done = {n: not cfg.overwrite and finished(variant_config(cfg, n, init_dir, tokenizer_dir)) for n in cfg.variants}
    if teacher_dir and not all(done.values()):
        info(f"teacher top-k of the {cfg.steps} training batches, shared by the variants: {teacher_dir} "
             f"({teacher_topk_bytes(cfg) / 2**20:.0f} MiB)")
        t0 = time.perf_counter()
        write_teacher_logits(dataclasses.replace(cfg, init_checkpoint=init_dir, tokenizer=tokenizer_dir,
                                                 teacher_logits_dir=teacher_dir))
        teacher_seconds = time.perf_counter() - t0
    for name in cfg.variants:
        vcfg = variant_config(cfg, name, init_dir, tokenizer_dir, teacher_dir)
        exports[name] = vcfg.export_dir
        if done[name]:  # a rerun after a crash skips what is done
            info(f"[{name}] already trained: {vcfg.export_dir}")
            continue
        info(f"[{name}] training into {vcfg.run_dir} ({describe(vcfg)})")
        t0 = time.perf_counter()
        train(vcfg)
        times[name] = time.perf_counter() - t0
    if not cfg.variants:
        train(cfg)
        exports = {cfg.retrofit: cfg.export_dir}
    summary: dict[str, Any] = {"exports": exports, "train_seconds": times}
    if cfg.evaluation is not None:
        t0 = time.perf_counter()
        summary["evaluation"] = evaluate(cfg, init_dir, tokenizer_dir, exports)
        times["evaluation"] = time.perf_counter() - t0
    shared = {} if teacher_seconds is None else {"shared teacher top-k": teacher_seconds}
    info("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in {**shared, **times}.items())
         + f"; total {time.perf_counter() - start:.0f} s")
    return summary


def quick_notice(cfg: TrainConfig) -> str:
    """The first line of a --quick run (a recipe's, or a single training's: `train.main`)."""
    problems = "" if cfg.evaluation is None else f" and {cfg.evaluation.problems} problems per task"
    return (f"--quick: {cfg.steps} training steps{problems} (a quarter of the flags') into {cfg.run_dir}; rougher "
            "numbers, not comparable with a full run's")


def finished(cfg: TrainConfig) -> bool:
    """Whether a run's last checkpoint is its final step and its export is written; a FlagError
    when that run was trained under other settings than `cfg`, or from other teacher weights (its export is not
    this one's)."""
    last = max(checkpoint_steps(cfg), default=-1)
    done = last >= cfg.steps and os.path.isfile(os.path.join(cfg.export_dir, "config.json"))
    if not done:
        return False
    saved = os.path.join(cfg.run_dir, TRAIN_CONFIG_FILE)
    run = {}
    if os.path.isfile(saved):
        with open(saved) as f:
            run = json.load(f)
        changes = training_changes(run, cfg)
        if changes:
            raise FlagError(f"{cfg.run_dir} holds a finished run trained with other settings: {'; '.join(changes)}. "
                            "Rerun with the old values to reuse its export, pass --overwrite to retrain every "
                            "variant, or choose another --run_dir")
    # The teacher's weights, which the settings do not show (a `git pull` replaces the shipped teacher).
    trained_from = run.get(INIT_FINGERPRINT_KEY) or _checkpoint_init_fingerprint(cfg, last)
    if trained_from and trained_from != checkpoint_fingerprint(cfg.init_checkpoint):
        raise FlagError(f"{cfg.run_dir} holds a finished run distilled from other weights than "
                        f"--init_checkpoint={cfg.init_checkpoint} holds now (the teacher changed since, e.g. by a "
                        "git pull): its export would be compared with the new teacher's. Pass --overwrite to "
                        "retrain every variant, or choose another --run_dir")
    return True


def _checkpoint_init_fingerprint(cfg: TrainConfig, step: int) -> str | None:
    """The teacher fingerprint in checkpoint `step`'s meta item (runs whose train_config.json predates it);
    None where it has none."""
    if not os.path.isdir(os.path.join(cfg.checkpoint_dir, str(step), "meta")):
        return None
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's "Given directory is read only", once per variant
    try:
        ckpt = Checkpointer(cfg.checkpoint_dir, read_only=True)
        try:
            return ckpt.restore_meta(step).get("init_fingerprint")
        except FlagError as e:
            raise FlagError(f"{cfg.run_dir} holds a finished run whose last checkpoint cannot be read ({e}); pass "
                            "--overwrite to retrain every variant, or choose another --run_dir") from e
        finally:
            ckpt.manager.close()
    finally:
        absl_logging.set_verbosity(verbosity)


def oracle_rates(spec: DemoSpec, budgets: dict[float, int], sinks: int, window: int) -> dict[float, dict[str, float]]:
    """CR -> idealized policy -> share of the spec's problems it could answer (`demo.oracles`)."""
    examples = generate_dataset(spec.n, spec.seed, spec.split, task=spec.task, seq_len=spec.len)
    out = {}
    for cr, budget in budgets.items():
        recovered = [oracle_recovery(ex, budget, s=sinks, w=window) for ex in examples]
        out[cr] = {name: float(np.mean([r[name] for r in recovered])) for name in recovered[0]}
    return out


EARLIER_DIR = "earlier"  # RUN_DIR/eval/earlier/STAMP/: an earlier evaluation's reports this one did not rewrite


def _is_report(path: str) -> bool:
    """Whether an entry of RUN_DIR/eval is one the recipe writes: a task's (or the long pass's) accuracy
    folder (or the journal of a killed one), a recall folder or its problems, the DMS patterns."""
    name = os.path.basename(path)
    if os.path.isdir(path):
        return (name.startswith("recall_") or name == "dms_patterns"
                or any(os.path.isfile(os.path.join(path, f))
                       for f in ("accuracy.json", "accuracy.md", journal_file(JOURNAL_NAME))))
    return name.startswith("recall_") and name.endswith(".jsonl")


def set_aside_earlier_reports(out: str, ours: set[str]) -> str | None:
    """Moves the reports in `out` that this evaluation did not write (an earlier run's with other --eval_tasks,
    --eval_long_len, --eval_crs or variants) into OUT/earlier/STAMP/, so that OUT holds only what its
    summary.md describes; nothing is deleted; a folder another process holds (its run.lock) stays, with a line.
    Returns that folder (relative to `out`), or None."""
    stale = sorted(n for n in os.listdir(out) if n not in ours and _is_report(os.path.join(out, n)))
    # A folder an `eval.main --out_dir RUN_DIR/eval/X` is writing now: moving it would send that report elsewhere.
    live = {n: pid for n in stale if (pid := locked_elsewhere(os.path.join(out, n, LOCK_FILE))) is not None}
    for name, pid in live.items():
        info(f"left in place: {os.path.join(out, name)}, a report another process (PID {pid or '?'}) writes now; "
             "it is not this evaluation's")
    stale = [n for n in stale if n not in live]
    if not stale:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = os.path.join(out, EARLIER_DIR, stamp)
    suffix = 1
    while os.path.exists(dest):  # two evaluations in one second
        dest, suffix = os.path.join(out, EARLIER_DIR, f"{stamp}-{suffix}"), suffix + 1
    os.makedirs(dest)
    for name in stale:
        os.replace(os.path.join(out, name), os.path.join(dest, name))
    rel = os.path.relpath(dest, out)
    info(f"an earlier evaluation's reports this one did not rewrite, moved to {os.path.join(out, rel)}: "
         + ", ".join(stale))
    return rel


def evaluate(cfg: TrainConfig, init_dir: str, tokenizer_dir: str, exports: dict[str, str]) -> dict[str, Any]:
    """Greedy pass@1 of every method x CR on every task, oracles, recall, length generalization,
    plots and the summary."""
    ev = cfg.evaluation
    out = os.path.join(cfg.run_dir, "eval")
    checkpoints = {"dense": init_dir, **{m: exports[m] for m in ev.methods if m not in TRAINING_FREE}}
    budgets = {cr: KVpopConfig.budget_at(cr, ev.prompt_len) for cr in ev.compression_ratios}

    def accuracy(task: str, prompt_len: int, methods, name: str) -> list[dict]:
        spec = DemoSpec(task, "test", cfg.seed, ev.problems, prompt_len)
        info(f"evaluating {', '.join(methods)} at CR {', '.join(f'{c:.0%}' for c in ev.compression_ratios)} "
             f"on {ev.problems} held-out {task} problems of {prompt_len} tokens ({spec})")
        completion = make_config(task=task, seq_len=prompt_len).completion_tokens + 2
        # At another length the same B is another CR: CR' = 1 - B / prompt_len (rows keep their B).
        crs = ev.compression_ratios if prompt_len == ev.prompt_len else [
            1.0 - budgets[cr] / prompt_len for cr in ev.compression_ratios]
        return run_accuracy(methods, checkpoints, str(spec), n_rollouts=1, compression_ratios=crs,
                            context_len=prompt_len, max_new_tokens=completion, sampling=SamplingConfig.greedy(),
                            out_dir=os.path.join(out, name), tokenizer=tokenizer_dir, sinks=cfg.kvpop.sinks,
                            problem_batch=ev.batch, dtype=jnp.float32, progress=cfg.progress,
                            stream_prompt=ev.stream_prompt, notes=False,
                            # a rerun after a crash decodes only what no report of these inputs holds yet
                            resume=cfg.resume and not cfg.overwrite, keep_journal=True)

    memory = cfg.kvpop.memory(cfg.head_dim)
    others = [f"CR {cr:.0%} (B {b})" for cr, b in budgets.items() if b != memory]
    if others and any(m not in TRAINING_FREE and m != "dense" for m in ev.methods):
        info(f"the retrofits were trained at memory B {memory} per KV head; at "
             f"{', '.join(others)} each runs with the slots that memory leaves (KVpopConfig.retarget; accuracy.md "
             "names them)")
    results = {}
    for task in ev.tasks:
        spec = DemoSpec(task, "test", cfg.seed, ev.problems, ev.prompt_len)
        results[task] = dict(rows=accuracy(task, ev.prompt_len, ev.methods, task), spec=str(spec),
                             oracles=oracle_rates(spec, budgets, cfg.kvpop.sinks, cfg.kvpop.window))
    long_rows = None
    if ev.long_len:
        long_rows = accuracy(ev.tasks[0], ev.long_len, ["dense", *ev.long_methods], "long")
    recall = {}
    if ev.recall_sequences:
        data = os.path.join(out, f"recall_{ev.tasks[0]}_s{cfg.seed}_{ev.prompt_len}.jsonl")
        # written each time (a few problems): a file an older demo generator wrote was measured on without a word
        os.makedirs(out, exist_ok=True)
        examples = generate_dataset(ev.recall_sequences, cfg.seed, "test", task=ev.tasks[0], seq_len=ev.prompt_len)
        write_jsonl(data, examples)  # atomic
        for name in (m for m in ev.methods if m in exports and m != "dms"
                     and variant_retrofit(cfg, m).topk > 0):
            recall[name] = {}
            for cr, budget in budgets.items():  # at every CR's memory B (the paper's Fig. 7: CR 75%)
                # One row per problem, its prompt (the first prompt_len tokens of its text): the rows the
                # accuracy columns decode, not a stream cut across problems (BENCHMARKS.md, stop 34).
                result = run_recall(exports[name], data, num_sequences=ev.recall_sequences, seq_len=ev.prompt_len,
                                    out_dir=os.path.join(out, f"recall_{name}_B{budget}"), progress=cfg.progress,
                                    budget=budget, rows="documents")
                recall[name][cr] = result.global_mean
    dms_stats = None
    if "dms" in ev.methods and "dms" in exports and ev.recall_sequences:
        dms_stats = run_dms_patterns(exports["dms"], data, num_sequences=ev.recall_sequences, seq_len=ev.prompt_len,
                                     out_dir=os.path.join(out, "dms_patterns"), rows="documents")
    plot_training(cfg, list(exports), os.path.join(out, "training.png"))
    ours = {*results, *(["long"] if long_rows is not None else []), *(["dms_patterns"] if dms_stats else []),
            *(f"recall_{name}_B{budget}" for name in recall for budget in budgets.values()),
            *([os.path.basename(data)] if ev.recall_sequences else [])}
    earlier = set_aside_earlier_reports(out, ours)
    summary = write_summary(cfg, results, recall, long_rows, budgets, os.path.join(out, "summary.md"),
                            dms_stats=dms_stats, earlier=earlier)
    print(summary, flush=True)
    return {"tasks": results, "long": long_rows, "recall": recall, "out_dir": out}
