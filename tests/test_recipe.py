"""train/recipe.py: --variants trains several retrofits of one teacher, --eval_methods compares them
(README command 1's shape, on a 1-layer random model)."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
from fractions import Fraction

import jax
import numpy as np
import pytest

from kvpop_jax import load_pretrained
from helpers import REPO, hold_lock, parse, tiny_flags, train_cmd, train_env
from train import recipe
from train.config import FlagError, load_model_config, variant_kvpop, variant_retrofit
from train.recipe_report import check_targets, length_generalization, paper_ordering, scores_at


def test_variant_flags(tmp_path, arch):
    cfg = parse(tiny_flags(str(tmp_path), arch, variants="kvpop-mlstm,kvpop-mlp,streamingllm+",
                           eval_methods="dense,tova,streamingllm+,kvpop-mlp", eval_problems=40, quick=True))
    assert cfg.variants == ("kvpop-mlstm", "kvpop-mlp", "streamingllm+")
    assert cfg.steps == 10 and cfg.optim.warmup_steps == 0  # --quick: a quarter of 40 steps and 2 warmup
    assert cfg.run_dir == str(tmp_path) + "-quick" and cfg.checkpoint_dir.startswith(cfg.run_dir)
    assert cfg.evaluation.problems == 10 and cfg.evaluation.compression_ratios == (0.75, 0.88)
    plus = variant_kvpop(cfg.kvpop, "streamingllm+", cfg.head_dim)
    assert (plus.topk, plus.window, plus.budget) == (0, 32, cfg.kvpop.budget)  # same B, no long-range slots
    assert variant_kvpop(cfg.kvpop, "kvpop-mlstm", cfg.head_dim).scorer == "mlstm"
    for overrides, message in ((dict(variants="kvpop-gru"), "unknown variant 'kvpop-gru'"),
                               (dict(variants="kvpop-mlp", eval_methods="dense,kvpop-mlstm"), "kvpop-mlstm"),
                               (dict(eval_methods="dense", eval_crs="0.9,1.5"), "eval_crs"),
                               (dict(eval_methods="dense", eval_prompt_len=100), "eval_prompt_len=100"),
                               (dict(variants="kvpop-mlp", eval_methods="kvpop-mlp", eval_prompt_len=160,
                                     eval_crs="0.9"), "does not fit kvpop-mlp"),
                               (dict(variants="streamingllm+", eval_methods="streamingllm+", eval_prompt_len=160,
                                     eval_crs="0.99"), "does not fit streamingllm\\+"),
                               # dropped without a word: no rows at --eval_long_len
                               (dict(variants="kvpop-mlp", eval_methods="dense,tova,kvpop-mlp", eval_long_len=2048,
                                     eval_long_methods="kvpop-mpl"), r"--eval_long_methods: \['kvpop-mpl'\] are not "
                                                                     r"trained here \(kvpop-mlp\)"),
                               (dict(variants="kvpop-mlp", eval_methods="dense,tova,kvpop-mlp", eval_long_len=2048,
                                     eval_long_methods="tova"), r"\['tova'\] are not trained here"),
                               (dict(variants="kvpop-mlp,kvpop-mlstm", eval_methods="dense,kvpop-mlp",
                                     eval_long_len=2048, eval_long_methods="kvpop-mlstm"),
                                r"--eval_long_methods: \['kvpop-mlstm'\] are not in --eval_methods "
                                r"\(dense, kvpop-mlp\)"),
                               (dict(variants="kvpop-mlp", eval_methods="dense,kvpop-mlp",
                                     eval_long_methods="kvpop-mlp"), r"--eval_long_methods=kvpop-mlp needs "
                                                                     r"--eval_long_len"),
                               # the generator refused it after every variant had trained
                               (dict(eval_methods="dense", seed=2**32), "--eval_methods: the held-out demo problems "
                                                                        "are drawn with --seed")):
        with pytest.raises(FlagError, match=message):
            parse(tiny_flags(str(tmp_path), arch, **overrides))
    assert parse(tiny_flags(str(tmp_path), arch, eval_methods="dense,kvpop")).evaluation.methods == ("dense", "kvpop")
    for given in (None, "kvpop-mlstm,kvpop-mlp"):  # the default names both KVpop variants: those run here
        default = parse(tiny_flags(str(tmp_path), arch, variants="kvpop-mlp", eval_methods="dense,kvpop-mlp",
                                   eval_long_len=2048, eval_long_methods=given))
        assert default.evaluation.long_methods == ("kvpop-mlp",)


def test_the_main_job_reruns_with_other_variants(tmp_path, monkeypatch):
    """tiny_cpu.flags spells out --eval_long_methods' default; a rerun with one variant (README) was refused
    as asking for an untrained kvpop-mlstm at --eval_long_len."""
    monkeypatch.chdir(REPO)  # the flagfile's --init_checkpoint is relative to the repository
    cfg = parse(["--flagfile=configs/tiny_cpu.flags", f"--run_dir={tmp_path / 'run'}", "--variants=kvpop-mlp",
                 "--eval_methods=dense,streaming,kvpop-mlp"])
    assert cfg.evaluation.long_methods == ("kvpop-mlp",) and cfg.evaluation.long_len == 2048


def test_a_finished_variant_trained_with_other_flags_is_not_reused(tmp_path, arch):
    """A rerun skips a finished variant only when its train_config.json shows the same training:
    a changed --topk or --base_lr would otherwise be reported with the old export's numbers."""
    from train.run_dir import TRAIN_CONFIG_FILE

    def variant(**overrides):
        cfg = parse(tiny_flags(str(tmp_path / "run"), arch, variants="kvpop-mlp", **overrides))
        return recipe.variant_config(cfg, "kvpop-mlp", str(tmp_path / "init"), str(tmp_path / "tok"))

    old = variant()
    os.makedirs(os.path.join(old.checkpoint_dir, str(old.steps)))
    os.makedirs(old.export_dir)
    open(os.path.join(old.export_dir, "config.json"), "w").write("{}")
    assert recipe.finished(old)  # no train_config.json (a run older than it): the step and export decide
    with open(os.path.join(old.run_dir, TRAIN_CONFIG_FILE), "w") as f:
        json.dump(json.loads(json.dumps(old.to_json(), default=str)), f)
    assert recipe.finished(old)
    assert recipe.finished(variant(progress=True, checkpoint_every=5))  # how, not what, it trains
    with pytest.raises(FlagError, match="micro_batch 2 -> 4"):  # per-micro-batch means and query samples: what
        recipe.finished(variant(micro_batch=4))
    assert recipe.finished(variant(dms_window=8))  # the DMS flags do not shape a KVpop variant
    os.makedirs(tmp_path / "init")  # the same folders spelled another way: the same run
    respelled = dataclasses.replace(old, init_checkpoint=str(tmp_path) + "/./init/")
    assert recipe.finished(respelled)
    with pytest.raises(FlagError, match=r"run/kvpop-mlp holds a finished run trained with other settings: "
                                        r"kvpop.topk 16 -> 12; optim.base_lr 8e-05 -> 0.0001\. .*--overwrite"):
        recipe.finished(variant(topk=12, base_lr=1e-4))
    assert not recipe.finished(variant(steps=41))  # more steps: it resumes (the resume checks its shapes)


def test_targets_are_checked_against_the_rows():
    rows = [dict(method="dense", cr=None, abs=0.9), dict(method="kvpop-mlstm", cr=0.88, abs=0.85),
            dict(method="kvpop-mlp", cr=0.88, abs=0.7), dict(method="streaming", cr=0.88, abs=0.1),
            dict(method="tova", cr=0.88, abs=0.6), dict(method="h2o", cr=0.88, abs=0.2),
            dict(method="streamingllm+", cr=0.88, abs=0.3), dict(method="kvpop-mlstm", cr=0.75, abs=0.88)]
    high, low = scores_at(rows, 0.88), scores_at(rows, 0.75)
    assert high == {"dense": 0.9, "kvpop-mlstm": 0.85, "kvpop-mlp": 0.7, "streaming": 0.1, "tova": 0.6, "h2o": 0.2,
                    "streamingllm+": 0.3}
    assert low == {"dense": 0.9, "kvpop-mlstm": 0.88}
    # 0.85 >= 0.9 x 0.9; 0.88 >= 0.95 x 0.9; tova is within 30 points; 0.85 - 0.7 >= 0.1
    assert [ok for _, ok in check_targets(high, low)] == [True, True, False, True]
    del high["h2o"], high["kvpop-mlp"]
    assert [ok for _, ok in check_targets(high)] == [True, None, None, None]  # not measured


def _exact_targets(high: dict, low: dict) -> list[bool]:
    """The main task's four targets from their text, in exact arithmetic on pass@1 fractions k/n."""
    heuristics = ("streaming", "tova", "h2o", "streamingllm+")
    return [high["dense"] > 0 and high["kvpop-mlstm"] >= Fraction(9, 10) * high["dense"],
            low["dense"] > 0 and low["kvpop-mlstm"] >= Fraction(19, 20) * low["dense"],
            all(high["kvpop-mlstm"] - high[m] >= Fraction(3, 10) for m in heuristics),
            high["kvpop-mlstm"] - high["kvpop-mlp"] >= Fraction(1, 10)]


def test_targets_equal_their_text_in_exact_arithmetic_ties_included(rng):
    """pass@1 is a fraction k/n: scores drawn around each target's bound (ties included) are judged as exact
    arithmetic judges them. A target met exactly was reported unmet by float rounding (0.21 - 0.11 < 0.10;
    0.72 < 0.9 x 0.80), and a bound or comparison changed by a little went unseen by one hand-picked case."""
    for case in range(400):
        n = int(rng.choice([10, 20, 25, 40, 50, 100]))
        dense = int(rng.integers(n // 2, n + 1))
        mlstm_low = min(n, max(0, round(dense * 0.95) + int(rng.integers(-2, 3))))
        mlstm = min(n, max(0, round(dense * 0.9) + int(rng.integers(-3, 4))))
        counts = dict(dense=dense, mlstm=mlstm, mlp=max(0, mlstm - n // 10 + int(rng.integers(-2, 3))))
        counts.update({m: max(0, mlstm - 3 * n // 10 + int(rng.integers(-2, 3)))
                       for m in ("streaming", "tova", "h2o", "streamingllm+")})
        rows = [dict(method="dense", cr=None, abs=dense / n), dict(method="kvpop-mlstm", cr=0.75, abs=mlstm_low / n)]
        rows += [dict(method={"mlstm": "kvpop-mlstm", "mlp": "kvpop-mlp"}.get(m, m), cr=0.88, abs=k / n)
                 for m, k in counts.items() if m != "dense"]
        high, low = scores_at(rows, 0.88), scores_at(rows, 0.75)
        exact_high = {m: Fraction(round(v * n), n) for m, v in high.items()}
        exact_low = {m: Fraction(round(v * n), n) for m, v in low.items()}
        got = [ok for _, ok in check_targets(high, low)]
        assert got == _exact_targets(exact_high, exact_low), (case, n, counts, mlstm_low)


def test_length_generalization_table():
    rows = [dict(method="dense", budget=None, abs=1.0), dict(method="kvpop-mlstm", budget=123, abs=0.9)]
    long_rows = [dict(method="dense", budget=None, abs=0.8), dict(method="kvpop-mlstm", budget=123, abs=0.6)]
    (row,) = length_generalization(rows, long_rows, {0.88: 123})
    assert row[:3] == ["kvpop-mlstm", 123, "88%"] and row[3:] == pytest.approx([0.9, 0.9, 0.6, 0.75, -0.15])
    # --eval_methods without dense: the job crashed here (StopIteration) after its whole evaluation
    (row,) = length_generalization(rows[1:], long_rows, {0.88: 123})
    assert row[3:5] == [0.9, "—"] and row[5:7] == pytest.approx([0.6, 0.75]) and row[7] == "—"


def test_a_quick_summary_says_it_is_one(tmp_path, arch):
    """--quick's summary.md looked like the full job's (only its problem count differed): its numbers, from a
    quarter of the steps and problems, read as comparable with the shipped benchmarks/demo_cpu/summary.md."""
    from train.recipe_report import write_summary
    rows = [dict(method="dense", cr=None, budget=None, abs=1.0, rel=1.0, scores={"t": 1.0}),
            dict(method="kvpop-mlp", cr=0.75, budget=40, abs=0.5, rel=0.5, scores={"t": 0.5})]
    results = {"reuse": dict(spec="demo:reuse", rows=rows, oracles={0.75: {name: 0.0 for name in
                                                                            ("streaming", "insertion_fifo",
                                                                             "insertion_lifo", "delayed")}})}
    flags = dict(variants="kvpop-mlp", eval_methods="dense,kvpop-mlp", eval_tasks="reuse", eval_crs="0.75",
                 eval_problems=40)
    for quick in (False, True):
        cfg = parse(tiny_flags(str(tmp_path), arch, quick=quick, **flags))
        text = write_summary(cfg, results, {}, None, {0.75: 40}, str(tmp_path / f"summary{quick}.md"))
        assert ("--quick" in text) == quick, text
    assert f"{cfg.steps} training steps" in text and "10 problems" in text and "not comparable" in text


def test_summary_recall_and_length_targets_follow_their_text(tmp_path, arch, rng):
    """The recall target is judged at CR 75% when measured, else at the lowest CR, against 0.80; the length
    target holds when kvpop-mlstm's fraction of dense moves by at most 10 points at every B. Values are drawn
    around both bounds (exact ties included) and judged in exact arithmetic; no test read these two lines."""
    from train.recipe_report import write_summary

    oracles = {name: 0.0 for name in ("streaming", "insertion_fifo", "insertion_lifo", "delayed")}
    configs = {crs: parse(tiny_flags(str(tmp_path), arch, variants="kvpop-mlstm", eval_methods="dense,kvpop-mlstm",
                                     eval_tasks="reuse", eval_crs=",".join(map(str, crs)), eval_long_len=2048))
               for crs in ((0.75, 0.88), (0.5, 0.88))}
    for case in range(40):
        crs = (0.75, 0.88) if case % 2 else (0.5, 0.88)
        cfg = configs[crs]
        budgets = {cr: round((1 - cr) * cfg.evaluation.prompt_len) for cr in crs}
        n = 40
        dense, dense_long = (int(rng.integers(20, n + 1)) for _ in range(2))
        short = {cr: int(rng.integers(0, dense + 1)) for cr in crs}
        # the long pass's count near the one that keeps the fraction of dense, +-4 points of it
        long = {cr: min(n, max(0, round(short[cr] * dense_long / dense) + int(rng.integers(-5, 6)))) for cr in crs}
        row = lambda method, cr, k: dict(method=method, cr=cr, budget=None if cr is None else budgets[cr],  # noqa: E731
                                         abs=k / n, rel=None, scores={"t": k / n})
        rows = [row("dense", None, dense)] + [row("kvpop-mlstm", cr, short[cr]) for cr in crs]
        long_rows = [row("dense", None, dense_long)] + [row("kvpop-mlstm", cr, long[cr]) for cr in crs]
        hits = {cr: int(rng.integers(30, 45)) for cr in crs}  # recall = hits / 45, around 0.80 (= 36 / 45)
        recall = {"kvpop-mlstm": {cr: h / 45 for cr, h in hits.items()}}
        results = {"reuse": dict(spec="demo:reuse", rows=rows, oracles={cr: oracles for cr in crs})}
        text = write_summary(cfg, results, recall, long_rows, budgets, str(tmp_path / "summary.md"))
        at = 0.75 if 0.75 in crs else min(crs)
        recall_met = Fraction(hits[at], 45) >= Fraction(4, 5)
        length_met = all(abs(Fraction(long[cr], dense_long) - Fraction(short[cr], dense)) <= Fraction(1, 10)
                         for cr in crs)
        assert f"- [{'x' if recall_met else ' '}] kvpop-mlstm teacher-retention recall >= 0.80 at CR {at:.0%}: " \
               f"{hits[at] / 45:.3f}" in text, (case, hits, crs)
        assert f"- [{'x' if length_met else ' '}] kvpop-mlstm at 2048 tokens keeps its fraction of dense within 10 " \
               "points" in text, (case, dense, dense_long, short, long)


def test_a_quick_run_says_so_first(tmp_path, arch, monkeypatch, capsys):
    """A --quick run said it was one only in the summary at its end: its first line now says so."""
    from train import recipe

    def stop(cfg):
        raise RuntimeError("stopped after the first lines")

    monkeypatch.setattr(recipe, "prepare_init_checkpoint", stop)
    for quick in (False, True):
        cfg = parse(tiny_flags(str(tmp_path / "run"), arch, quick=quick, variants="kvpop-mlp",
                               eval_methods="dense,kvpop-mlp", eval_tasks="reuse", eval_crs="0.75", eval_problems=40))
        with pytest.raises(RuntimeError, match="stopped after the first lines"):
            recipe._run(cfg)
        err = capsys.readouterr().err
        assert ("--quick:" in err) == quick, err
    assert f"--quick: {cfg.steps} training steps and 10 problems per task" in err and "run-quick" in err
    # without an evaluation (variants only, or one training: train.main prints recipe.quick_notice) it said nothing
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch, quick=True, variants="kvpop-mlp", eval_methods=""))
    assert cfg.evaluation is None
    with pytest.raises(RuntimeError, match="stopped after the first lines"):
        recipe._run(cfg)
    assert f"--quick: {cfg.steps} training steps (a quarter" in capsys.readouterr().err
    single = parse(tiny_flags(str(tmp_path / "one"), arch, quick=True, eval_methods=""))
    assert recipe.quick_notice(single).startswith(f"--quick: {single.steps} training steps (") and "one-quick" in \
        recipe.quick_notice(single)


@pytest.mark.long
def test_variants_then_comparison_end_to_end(tmp_path, arch, monkeypatch):
    run = str(tmp_path / "run")
    argv = tiny_flags(run, arch, steps=3, checkpoint_every=3, variants="kvpop-mlp,streamingllm+",
                      eval_methods="dense,streaming,tova,streamingllm+,kvpop-mlp", eval_problems=3,
                      eval_batch=2, eval_prompt_len=160, eval_crs="0.5,0.75", eval_recall_sequences=1,
                      eval_long_len=192, eval_long_methods="kvpop-mlp,streamingllm+")
    proc = subprocess.run(train_cmd(argv), cwd=REPO, env=train_env(tmp_path), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The two variants read the same rows: the teacher ran once, into files both distilled from.
    assert "shared by the variants" in proc.stderr
    assert sorted(os.listdir(os.path.join(run, "teacher_topk"))) == ["run.lock"] + [
        f"step_{i:08d}.npz" for i in range(3)] + ["teacher.json"]  # the writer's lock, the steps' top-k, their teacher
    for name, topk in (("kvpop-mlp", 16), ("streamingllm+", 0)):
        config, _ = load_pretrained(os.path.join(run, name, "export"))
        assert json.load(open(os.path.join(run, name, "train_config.json")))["teacher_logits_dir"] == \
            os.path.join(run, "teacher_topk")
        assert config.kvpop.topk == topk and config.kvpop.budget == 36
        assert len(open(os.path.join(run, name, "metrics.jsonl")).readlines()) == 3
    out = os.path.join(run, "eval")
    with open(os.path.join(out, "read_once", "accuracy.json")) as f:
        report = json.load(f)
    settings = {(r["method"], r["cr"]) for r in report["rows"]}
    assert settings == {("dense", None)} | {(m, cr) for m in ("streaming", "tova", "streamingllm+", "kvpop-mlp")
                                            for cr in (0.5, 0.75)}
    assert {r["budget"] for r in report["rows"] if r["cr"] == 0.75} == {40}
    assert all(len(r["correct"]) == 1 for r in report["records"]) and len(report["records"]) == 3 * 9
    with open(os.path.join(out, "read_once", "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 27 and len({s["id"] for s in samples}) == 3
    summary = open(os.path.join(out, "summary.md")).read()
    assert summary in proc.stdout and "| 75% | 40 | kvpop-mlp |" in summary and "recall" in summary
    assert "Length generalization" in summary and "Idealized policies" in summary
    with open(os.path.join(out, "long", "accuracy.json")) as f:  # the same budgets at 192 tokens
        long_report = json.load(f)
    assert {r["budget"] for r in long_report["rows"] if r["method"] != "dense"} == {80, 40}
    for budget, topk in ((80, 60), (40, 20)):  # recall at each CR's B: k = B - s - w (an MLP has no state)
        recall = json.load(open(os.path.join(out, f"recall_kvpop-mlp_B{budget}", "recall.json")))
        assert 0.0 <= np.mean(recall["recall"]) <= 1.0 and recall["settings"]["topk"] == topk
        assert recall["settings"]["rows"] == "documents" and recall["settings"]["seq_len"] == 160  # the prompts
    assert re.search(r"- kvpop-mlp: [01]\.\d{3} at CR 50% \(B 80\), [01]\.\d{3} at CR 75% \(B 40\)", summary)
    assert os.path.getsize(os.path.join(out, "training.png")) > 1000
    assert os.path.getsize(os.path.join(out, "read_once", "accuracy.png")) > 1000

    # The same command again (after a crash in a later part of the evaluation): the tasks whose reports are whole
    # for these inputs decode nothing (a rerun decoded every task again) and the reports are the same.
    reports = {t: {f: open(os.path.join(out, t, f), "rb").read() for f in ("accuracy.json", "samples.jsonl")}
               for t in ("read_once", "long")}

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr("eval.accuracy.generate", no_decode)
    recipe.run(parse(argv))
    assert {t: {f: open(os.path.join(out, t, f), "rb").read() for f in ("accuracy.json", "samples.jsonl")}
            for t in ("read_once", "long")} == reports
    assert open(os.path.join(out, "summary.md")).read() == summary
    monkeypatch.undo()

    # Rerun after a crash (in process, no evaluation): a finished variant is skipped, one killed during its
    # export resumes from its last checkpoint and exports; the run-folder lock and --overwrite rules allow it.
    rerun = tiny_flags(run, arch, steps=3, checkpoint_every=3, variants="kvpop-mlp,streamingllm+")
    # --noresume over finished variants was ignored: they were skipped as "already trained"
    with pytest.raises(FlagError, match=r"--noresume would start over in .*kvpop-mlp \(a run's checkpoints "
                                        r"\(steps 3\)\), .*streamingllm\+ .*pass --overwrite"):
        recipe.run(parse(rerun + ["--noresume"]))
    shutil.rmtree(os.path.join(run, "streamingllm+", "export"))
    summary = recipe.run(parse(rerun))
    assert list(summary["train_seconds"]) == ["streamingllm+"]
    assert load_pretrained(os.path.join(run, "streamingllm+", "export"))[0].kvpop.topk == 0
    assert len(open(os.path.join(run, "streamingllm+", "metrics.jsonl")).readlines()) == 3
    shutil.rmtree(os.path.join(run, "streamingllm+", "export"))
    with pytest.raises(FlagError, match="--noresume would start over in .*streamingllm\\+.*pass --overwrite"):
        recipe.run(parse(rerun + ["--noresume"]))
    with pytest.raises(FlagError, match="kvpop-mlp holds a finished run trained with other settings: kvpop.topk 16 -> 12"):
        recipe.run(parse(rerun + ["--topk=12"]))  # refused before the teacher pass or any training


def test_target_reduce_flag_reaches_the_config(tmp_path, arch):
    from kvpop_jax import KVpopConfig

    assert parse(tiny_flags(str(tmp_path), arch)).kvpop.target_reduce == "sum"  # the paper's default
    assert parse(tiny_flags(str(tmp_path), arch, target_reduce="max")).kvpop.target_reduce == "max"
    with pytest.raises(ValueError, match="target_reduce"):
        KVpopConfig(target_reduce="mean")


def test_dms_variant_flags(tmp_path, arch):
    cfg = parse(tiny_flags(str(tmp_path), arch, variants="kvpop-mlp,dms", eval_methods="dense,dms,kvpop-mlp"))
    memory = cfg.kvpop.memory(cfg.head_dim)  # 36 = 4 + 16 + 16 (MLP scorer, no state)
    d = variant_retrofit(cfg, "dms")
    assert d is cfg.dms and (d.window, d.budget) == (16, memory) and cfg.retrofit == "kvpop"
    assert d.mean_occupancy(cfg.seq_len) == pytest.approx(memory)  # target eviction 1 - 20 / 112
    assert d.gate_hidden == 64  # 18 x 64 + 1 parameters per KV head; the MLP scorer + decay: 18 x 64 + 2
    single = parse(tiny_flags(str(tmp_path), arch, retrofit="dms", dms_temperature=0.5, eval_methods="dense,dms"))
    assert single.retrofit == "dms" and single.dms.temperature == 0.5 and single.evaluation.methods == ("dense", "dms")
    assert single.model_retrofit(load_model_config(single)).dms == single.dms
    with pytest.raises(FlagError, match="does not fit dms"):  # B = 16 at CR 0.9 of 160 tokens: no room past w
        parse(tiny_flags(str(tmp_path), arch, variants="dms", eval_methods="dms", eval_prompt_len=160,
                         eval_crs="0.9"))
    # --dms_window=0 fell back to --window (16) silently; --retrofit=dms next to --variants was ignored
    with pytest.raises(FlagError, match="--dms_window must be a positive int, got 0"):
        parse(tiny_flags(str(tmp_path), arch, retrofit="dms", dms_window=0, eval_methods="dense,dms"))
    for variants, fix in (("kvpop-mlp", "add dms to the variants instead"),
                          ("kvpop-mlp,dms", "the dms variant is already listed")):
        with pytest.raises(FlagError, match=f"--retrofit=dms is a single run; .* leave --retrofit at kvpop: {fix}"):
            parse(tiny_flags(str(tmp_path), arch, retrofit="dms", variants=variants, eval_methods="dense"))


def test_paper_ordering():
    assert paper_ordering({"kvpop-mlstm": 0.5, "dms": 0.3, "streamingllm+": 0.1}) is True
    assert paper_ordering({"kvpop-mlstm": 0.5, "dms": 0.6, "streamingllm+": 0.1}) is False
    assert paper_ordering({"kvpop-mlstm": 0.5, "dms": 0.6}) is None


@pytest.mark.slow  # about 2 minutes on an idle core: 4 steps, then decoding and the heat map
def test_dms_variant_end_to_end(tmp_path, arch):
    run = str(tmp_path / "run")
    argv = tiny_flags(run, arch, steps=4, checkpoint_every=4, variants="dms", eval_methods="dense,dms",
                      eval_problems=2, eval_batch=2, eval_prompt_len=160, eval_crs="0.75", eval_recall_sequences=1,
                      eval_tasks="read_once")
    proc = subprocess.run(train_cmd(argv), cwd=REPO, env=train_env(tmp_path), capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    config, params = load_pretrained(os.path.join(run, "dms", "export"))
    assert config.dms is not None and config.kvpop is None and config.dms.budget == 36
    assert "dms" in params["layers_0"]["self_attn"]
    records = [json.loads(line) for line in open(os.path.join(run, "dms", "metrics.jsonl"))]
    targets = [r["target_eviction"] for r in records]
    assert len(records) == 4 and targets[0] == 0.0 and targets == sorted(targets) and targets[-1] > 0.5
    assert all(np.isfinite(r["loss"]) and r["loss"] >= r["kl"] for r in records)  # KL + the aux loss
    assert all(0.0 <= r["eviction_rate"] <= 1.0 and r["dms_loss"] >= 0.0 for r in records)
    assert any(r["dms_loss"] > 0 for r in records)
    with open(os.path.join(run, "eval", "read_once", "accuracy.json")) as f:
        rows = json.load(f)["rows"]
    assert {(r["method"], r["budget"]) for r in rows} == {("dense", None), ("dms", 40)}
    summary = open(os.path.join(run, "eval", "summary.md")).read()
    assert "| 75% | 40 | dms |" in summary and "DMS: eviction pattern and occupancy" in summary
    patterns = json.load(open(os.path.join(run, "eval", "dms_patterns", "dms_patterns.json")))
    assert len(patterns["ratio_median"]) == 1 and len(patterns["ratio_median"][0]) == 2  # 1 layer x 2 KV heads
    assert patterns["max_occupancy"] >= patterns["mean_occupancy"] >= 16


def test_a_rerun_with_fewer_tasks_sets_the_earlier_reports_aside(tmp_path, arch, monkeypatch, capsys):
    """A rerun with fewer --eval_tasks (or no long pass, other variants) left the earlier run's report folders
    beside the new summary.md, as if they were its own. They now move to eval/earlier/STAMP/, and the summary
    says so; files the recipe does not write stay where they are."""
    def fake_accuracy(methods, checkpoints, spec, *, compression_ratios, out_dir, **kw):
        assert kw["notes"] is False  # the recipe says once what each call would say per export
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "accuracy.json"), "w") as f:
            json.dump({"spec": spec}, f)
        dense = dict(method="dense", cr=None, budget=None, abs=1.0, rel=1.0, scores={"t": 1.0})
        return [dense] + [dict(method=m, cr=cr, budget=40, abs=0.5, rel=0.5, scores={"t": 0.5})
                          for m in methods if m != "dense" for cr in compression_ratios]

    monkeypatch.setattr(recipe, "run_accuracy", fake_accuracy)
    monkeypatch.setattr(recipe, "plot_training", lambda *a, **k: None)
    run = str(tmp_path / "run")
    out = os.path.join(run, "eval")
    flags = dict(variants="kvpop-mlp", eval_methods="dense,tova", eval_crs="0.75", eval_problems=40,
                 eval_prompt_len=1024, eval_recall_sequences=0)
    full = parse(tiny_flags(run, arch, eval_tasks="reuse,read_once", eval_long_len=2048, **flags))
    recipe.evaluate(full, "init", "tok", {})
    assert "the retrofits were trained" not in capsys.readouterr().err  # no retrofit evaluated: nothing to say
    assert {"reuse", "read_once", "long", "summary.md"} <= set(os.listdir(out))
    os.makedirs(os.path.join(out, "recall_kvpop-mlp_B40"))  # an earlier run's recall, with a variant now dropped
    os.makedirs(os.path.join(out, "read_twice"))  # an earlier run's task, killed before its report: its journal
    with open(os.path.join(out, "read_twice", ".accuracy-journal.jsonl"), "w") as f:
        f.write("{}\n")
    with open(os.path.join(out, "notes.txt"), "w") as f:  # the user's own file
        f.write("mine")
    live = os.path.join(out, "mine")  # an `eval.main accuracy --out_dir RUN_DIR/eval/mine` rerun, writing now:
    os.makedirs(live)
    with open(os.path.join(live, "accuracy.json"), "w") as f:
        f.write("{}")
    holder = hold_lock(live)  # moved, its report would land where its user does not look
    fewer = parse(tiny_flags(run, arch, eval_tasks="reuse", **flags))
    try:
        recipe.evaluate(fewer, "init", "tok", {})
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert f"left in place: {live}, a report another process (PID {holder.pid}) writes now" in capsys.readouterr().err
    shutil.rmtree(live)
    (stamp,) = os.listdir(os.path.join(out, "earlier"))
    assert sorted(os.listdir(os.path.join(out, "earlier", stamp))) == ["long", "read_once", "read_twice",
                                                                       "recall_kvpop-mlp_B40"]
    assert sorted(os.listdir(out)) == ["earlier", "notes.txt", "reuse", "summary.md"]
    with open(os.path.join(out, "earlier", stamp, "read_once", "accuracy.json")) as f:
        assert "read_once" in json.load(f)["spec"]  # moved whole, not rewritten
    with open(os.path.join(out, "summary.md")) as f:
        summary = f.read()
    assert f"`earlier/{stamp}/`" in summary and "read_once" not in summary
    recipe.evaluate(fewer, "init", "tok", {})  # nothing new to set aside: no second folder, no line
    assert os.listdir(os.path.join(out, "earlier")) == [stamp]
    with open(os.path.join(out, "summary.md")) as f:
        assert "earlier" not in f.read()
    # a retrofit trained at 4 + 16 + 16 and run at B 256: said once, not per export and task (the job printed 12
    # such notes)
    with_retrofit = parse(tiny_flags(run, arch, **{**flags, "eval_methods": "dense,kvpop-mlp"}))
    capsys.readouterr()
    recipe.evaluate(with_retrofit, "init", "tok", {"kvpop-mlp": "export"})
    assert capsys.readouterr().err.count("the retrofits were trained at memory B 36 per KV head; at CR 75% (B 256) "
                                         "each runs with the slots that memory leaves") == 1


def test_a_rerun_after_the_teacher_or_the_demo_generator_changed_does_not_reuse_finished_variants(tmp_path, arch):
    """A `git pull` that replaced the shipped teacher (or changed the demo generator) left the finished variants
    "already trained": their exports, distilled from the old teacher on the old traces, were evaluated beside dense
    and the baselines on the new teacher, in one table, with no word. Both are now refused until --overwrite."""
    from demo.task import read_jsonl
    from kvpop_jax import save_pretrained
    from kvpop_jax.modeling import init_params

    run = str(tmp_path / "run")
    flags = tiny_flags(run, arch, steps=2, checkpoint_every=2, variants="streamingllm+")
    recipe.run(parse(flags))
    assert recipe.run(parse(flags))["train_seconds"] == {}  # unchanged: skipped
    data = parse(flags).data.data
    kept = open(data).read()
    rows = read_jsonl(data)
    rows[0]["text"] = rows[0]["text"].replace(">", "\n")  # as an older generator wrote it
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with pytest.raises(FlagError, match=r"demo_train_read_once_24x256_seed0.jsonl holds traces the demo generator no "
                                        r"longer writes \(the library changed since\), and streamingllm\+ trained on "
                                        r"them: pass --overwrite"):
        recipe.run(parse(flags))
    with open(data, "w") as f:
        f.write(kept)
    init = os.path.join(run, "init")  # the teacher, replaced by other weights of the same shape
    config, _ = load_pretrained(init)
    save_pretrained(config, init_params(config, jax.random.key(7)), init)
    refused = (r"run/streamingllm\+ holds a finished run distilled from other weights than "
               r"--init_checkpoint=.*/run/init holds now .* Pass --overwrite")
    with pytest.raises(FlagError, match=refused):
        recipe.run(parse(flags))
    saved = os.path.join(run, "streamingllm+", "train_config.json")
    with open(saved) as f:
        older = {k: v for k, v in json.load(f).items() if k != "init_fingerprint"}
    with open(saved, "w") as f:  # a run from before train_config.json recorded it: read from its checkpoint
        json.dump(older, f)
    with pytest.raises(FlagError, match=refused):
        recipe.run(parse(flags))
    assert recipe.run(parse(flags + ["--overwrite"]))["train_seconds"].keys() == {"streamingllm+"}
    assert recipe.run(parse(flags))["train_seconds"] == {}
    # the run folder moved (another disk): its finished variants are still its own (the paths of its init, data and
    # tokenizer, recorded where they were, were read as other settings, with the advice to rerun with the old ones)
    moved = str(tmp_path / "elsewhere" / "run")
    shutil.move(run, moved)
    assert recipe.run(parse(tiny_flags(moved, arch, steps=2, checkpoint_every=2,
                                       variants="streamingllm+")))["train_seconds"] == {}


def test_a_recipe_folder_moved_or_copied_reruns_as_itself_relative_and_through_a_symlink(tmp_path, arch, monkeypatch):
    """The README's --run_dir is relative: its variants record `runs/a/init`, `runs/a/data/...`, which no longer
    exist after a `mv`, and a folder reached through a symlink records resolved paths (review of stop 70)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("real")
    os.symlink(str(tmp_path / "real"), "link")

    def rerun(run_dir):
        return recipe.run(parse(tiny_flags(run_dir, arch, steps=2, checkpoint_every=2, variants="streamingllm+")))

    assert rerun("link/a")["train_seconds"].keys() == {"streamingllm+"}
    shutil.move("link/a", "link/b")
    assert rerun("link/b")["train_seconds"] == {}
    shutil.copytree("link/b", "link/c", symlinks=True)
    assert rerun("link/c")["train_seconds"] == {}
    assert rerun("link/b")["train_seconds"] == {}  # the original, beside its copy


def test_evaluation_sizes_past_the_demo_generator_are_refused_by_flag(tmp_path, arch):
    """--eval_long_len=20000000 (a digit too many) passed the flags, trained every variant, then failed in the
    evaluation with a traceback from the demo generator's limits."""
    flags = dict(variants="kvpop-mlp", eval_methods="dense,kvpop-mlp", eval_prompt_len=1024)
    for overrides, message in (
            (dict(eval_long_len=20_000_000), r"--eval_problems=100 at --eval_long_len=20000000: demo spec asks for "
                                             r"n=100 problems of len=20000000 tokens"),
            (dict(eval_problems=300_000), r"--eval_problems=300000 at --eval_prompt_len=1024: .*307,200,000 in all"),
            (dict(eval_recall_sequences=300_000), r"--eval_recall_sequences=300000 at --eval_prompt_len=1024")):
        with pytest.raises(FlagError, match=message):
            parse(tiny_flags(str(tmp_path), arch, **flags, **overrides))
    assert parse(tiny_flags(str(tmp_path), arch, **flags, eval_problems=262_144)).evaluation.problems == 262_144
