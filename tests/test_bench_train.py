"""eval.bench_train: the small path end to end (tables, plot, BENCHMARKS append), the --dry CLI, the variants."""

import dataclasses
import json

import pytest

from eval import main as eval_main
from eval.bench_decode import tiny_config
from eval.bench_train import PARTS, VARIANTS, run_bench_train, variant_config
from helpers import assert_a_failed_rerun_keeps_the_report

TOY = dict(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, sinks=2, window=8, topk=8)


def _check_outputs(out_dir, md, rows, want):
    assert {(r["kind"], r["name"], r["seq_len"]) for r in rows} == want
    for r in rows:
        assert r["ms"] > 0 and r["ratio"] > 0, r
        if r["name"] in ("dense", PARTS[0]):
            assert r["ratio"] == 1.0
    assert (out_dir / "bench_train.png").read_bytes()[:4] == b"\x89PNG"
    text = md.read_text()
    assert "Training step" in text and "bench_train.png" in text
    return text


@pytest.mark.long
def test_bench_train_small_run_writes_rows_tables_and_plot(tmp_path):
    md = tmp_path / "BENCH.md"
    parts = (PARTS[1], "cutoff")
    rows = run_bench_train(seq_lens=(40,), model_config=tiny_config(**TOY), variants=("dense",), parts=parts,
                           steps=1, warmup=0, kl_topk=8, num_query_samples=4, out_dir=tmp_path / "out",
                           benchmarks_md=md, command="python -m eval.main bench train --test", progress=False)
    saved = json.loads((tmp_path / "out" / "bench_train.json").read_text())["rows"]
    assert saved == [dataclasses.asdict(r) for r in rows]
    want = {("train", "dense", 40)} | {("part", p, 40) for p in (PARTS[0],) + parts}
    text = _check_outputs(tmp_path / "out", md, saved, want)
    assert "`python -m eval.main bench train --test`" in text and "masked attention fwd+bwd (auto)" in text
    with pytest.raises(ValueError, match="exceed the budget"):
        run_bench_train(seq_lens=(16,), model_config=tiny_config(**TOY), out_dir=tmp_path, benchmarks_md=None)


@pytest.mark.filterwarnings("error::UserWarning")  # no parts: its empty panel once warned "no artists with labels"
def test_a_failed_rerun_leaves_the_previous_bench_report_whole(tmp_path, monkeypatch):
    """bench_train.png, .json and .md were written one after another: a rerun that failed between them left a new
    plot and json beside the old table, nothing telling them apart. They are now staged and renamed together."""
    import eval.bench_train as bench_train

    timings = iter([1.0, 2.0])  # the timing is not the point here
    monkeypatch.setattr(bench_train, "time_train_steps", lambda *args, **kwargs: {"dense": (next(timings), 0.5)})
    kw = dict(seq_lens=(40,), model_config=tiny_config(**TOY), variants=("dense",), parts=(), kl_topk=8,
              num_query_samples=4, out_dir=tmp_path, benchmarks_md=None, progress=False)
    # bench_markdown runs after the plot and the json are (re)written
    assert_a_failed_rerun_keeps_the_report(tmp_path, monkeypatch, bench_train, "bench_markdown",
                                           lambda: run_bench_train(**kw), lambda: run_bench_train(**kw),
                                           {"bench_train.md", "bench_train.png", "bench_train.json"})


def test_a_dry_run_appends_to_no_benchmarks_file_unless_named():
    from eval.bench_train import benchmarks_target

    assert benchmarks_target(None, dry=True) is None and benchmarks_target(None, dry=False) == "BENCHMARKS.md"
    assert benchmarks_target("x.md", dry=True) == "x.md" and benchmarks_target("", dry=False) is None


@pytest.mark.slow
def test_bench_train_dry_cli_runs_every_variant_and_part(tmp_path):
    md = tmp_path / "BENCH.md"
    eval_main.main(["bench", "train", "--dry", "--out_dir", str(tmp_path / "out"), "--benchmarks_md", str(md)])
    rows = json.loads((tmp_path / "out" / "bench_train.json").read_text())["rows"]
    want = {("train", v, s) for v in VARIANTS for s in (64, 128)} | {("part", p, s) for p in PARTS for s in (64, 128)}
    assert "bench train --dry" in _check_outputs(tmp_path / "out", md, rows, want)


def test_variant_configs_keep_the_budget():
    config = tiny_config()
    kv = config.kvpop
    assert variant_config(config, "dense").kvpop is None
    streaming = variant_config(config, "streamingllm+").kvpop
    assert (streaming.topk, streaming.budget) == (0, kv.budget)
    for name, scorer in (("kvpop-mlp", "mlp"), ("kvpop-mlstm", "mlstm")):
        assert variant_config(config, name).kvpop == dataclasses.replace(kv, scorer=scorer)
    with pytest.raises(ValueError, match="unknown variant"):
        variant_config(config, "tova")
