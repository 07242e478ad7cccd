"""eval/accuracy.py: answer extraction and checking, the table math, and a run on a tiny checkpoint."""

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval.accuracy import parse_checkpoints, run_accuracy
from eval.answers import extract_answer, is_correct, normalize_answer
from eval.benchmarks import load_benchmark
from eval.report import format_table, summarize
from kvpop_jax import KVpopConfig, Qwen3Config, load_pretrained, save_pretrained
from kvpop_jax.config import DMSConfig
from kvpop_jax.fileio import LOCK_FILE
from kvpop_jax.modeling import abstract_params, init_params, retrofit_params
from kvpop_jax.sampling import SamplingConfig


def test_extraction_and_checking():
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1} then \\boxed{{a}+{b}}") == "{a}+{b}"  # last box, nested braces
    assert extract_answer("x=3\n#### 7") == "7"  # the demo task's other format
    assert extract_answer("no answer here") is None
    assert extract_answer("\\boxed{unclosed") is None
    assert is_correct("\\boxed{007}", "7") == (True, "007")
    assert is_correct("\\boxed{ 1,000. }", 1000)[0]
    assert is_correct("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}")[0]
    assert is_correct("\\boxed{\\text{(B)}}", "(B)")[0]
    assert not is_correct("\\boxed{8}", "7")[0]
    assert not is_correct("7", "7")[0]  # nothing boxed: no answer
    assert normalize_answer("2.50") == "2.5" and normalize_answer("1,2") == "1,2"


def test_checking_survives_degenerate_numbers():
    # a collapsed method can box thousands of digits: int() refused them (4300) and float() overflowed,
    # ending the run after every decode
    many = "1" * 5000
    assert is_correct(f"\\boxed{{{many}}}", "7") == (False, many)
    assert is_correct(f"#### 00{many}", many)[0] and not is_correct(f"\\boxed{{{many}2}}", many)[0]
    assert not is_correct("\\boxed{" + "9" * 400 + ".5}", "7")[0]
    assert [normalize_answer(a) for a in ("-007", "-0", "+3", "2.50")] == ["-7", "0", "3", "2.5"]
    assert [normalize_answer(a) for a in ("\uff17", "-\u0660", "\u0967\u0968")] == ["7", "0", "12"]  # as int() reads


def test_math_verify_checks_run_on_the_main_thread_only(monkeypatch, tmp_path):
    # its timeouts are SIGALRM alarms: off the main thread every check raised inside it and fell back, silently,
    # to the string compare while the report said math_verify
    import eval.answers as answers

    monkeypatch.setattr(answers, "_math_verify", lambda: (str, lambda gold, pred: True))  # installed, says yes
    assert answers.is_correct("\\boxed{1}", "2") == (True, "1")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match=r"Math-Verify, whose timeouts \(SIGALRM\) work only in the main "
                                               r"thread, not in thread '.*': grade on the main thread \(or call "
                                               r"math_verify's parse and verify yourself with parsing_timeout=None"):
            pool.submit(answers.is_correct, "\\boxed{1}", "2").result()
        with pytest.raises(RuntimeError, match="only in the main thread"):  # before any checkpoint loads
            pool.submit(run_accuracy, ["dense"], {"dense": str(tmp_path)}, "b.jsonl", out_dir=str(tmp_path)).result()
        monkeypatch.setattr(answers.os, "name", "nt")  # Windows: Math-Verify times out in a child process instead
        assert pool.submit(answers.is_correct, "\\boxed{1}", "2").result() == (True, "1")


def test_budget_table_and_specs():
    assert KVpopConfig.budget_at(0.75, 16384) == 4096 and KVpopConfig.budget_at(0.88, 16384) == 1966
    kv = KVpopConfig(sinks=4, window=8, topk=20)
    assert kv.retarget(64).topk == 52
    assert dataclasses.replace(kv, topk=0).retarget(64).window == 60  # StreamingLLM+
    with pytest.raises(ValueError, match="< s \\+ w"):
        kv.retarget(10)
    spec = parse_checkpoints("dense=/a, kvpop-mlp@0.75=/b,kvpop-mlp@0.88=/c")
    assert spec == {"dense": "/a", "kvpop-mlp": {0.75: "/b", 0.88: "/c"}}
    records = [
        dict(method="dense", cr=None, budget=None, benchmark="x", id="0", correct=[True, True]),
        dict(method="dense", cr=None, budget=None, benchmark="x", id="1", correct=[True, False]),
        dict(method="tova", cr=0.5, budget=8, benchmark="x", id="0", correct=[True, False]),
        dict(method="tova", cr=0.5, budget=8, benchmark="x", id="1", correct=[False, False]),
    ]
    rows = summarize(records, ["x"])
    assert rows[0]["abs"] == 0.75 and rows[1]["abs"] == 0.25
    assert rows[1]["rel"] == pytest.approx(1 / 3)
    table = format_table(rows, ["x"])
    from eval.report import cr_percent
    assert [cr_percent(c) for c in (0.75, 0.88, 0.999, 0.875, 0.0, 0.99999, 1 - 123 / 2048)] == [
        "75%", "88%", "99.9%", "87.5%", "0%", "99.999%", "94%"]
    assert "| 50% | 8 | tova | 0.25 | 0.25 | 0.33 |" in table and "dense (teacher)" in table


def test_summarize_and_format_table_equal_a_numpy_reduction_over_benchmarks_of_unequal_sizes(rng):
    """pass@1 per benchmark is the mean over its problems of the share of correct rollouts; Abs. is the mean over
    benchmarks (each weighs the same, whatever its problem count); Rel. is Abs. over dense's; the table lists
    dense first, then the CRs in increasing order. The old test had one benchmark and one CR: pooling every
    problem of every benchmark, or listing the CRs backwards, went unseen."""
    n_rollouts = int(rng.integers(2, 6))
    sizes = {"a": int(rng.integers(2, 5)), "b": int(rng.integers(7, 12)), "c": int(rng.integers(3, 9))}
    settings = [("dense", None, None)] + [(m, cr, round((1 - cr) * 64)) for cr in rng.permutation([0.5, 0.75, 0.875])
                                         for m in ("tova", "kvpop-mlp")]
    correct = {(m, cr, b): rng.random((n, n_rollouts)) < rng.uniform(0.2, 0.9)
               for m, cr, _ in settings for b, n in sizes.items()}
    records = [dict(method=m, cr=cr, budget=budget, benchmark=b, id=str(i),
                    correct=[bool(x) for x in correct[m, cr, b][i]])
               for m, cr, budget in settings for b, n in sizes.items() for i in range(n)]
    rows = summarize(records, list(sizes))
    assert [(r["method"], r["cr"], r["budget"]) for r in rows] == settings
    dense_abs = np.mean([correct["dense", None, b].mean() for b in sizes])
    for r, (m, cr, _) in zip(rows, settings):
        per = {b: correct[m, cr, b].mean(axis=1).mean() for b in sizes}
        assert r["scores"] == pytest.approx(per)
        assert r["abs"] == pytest.approx(np.mean(list(per.values())))
        assert r["rel"] == pytest.approx(r["abs"] / dense_abs)
    lines = format_table(rows, list(sizes)).splitlines()[2:]
    assert "dense (teacher)" in lines[0]
    listed = [float(line.split("|")[1].strip().rstrip("%")) for line in lines[1:]]
    assert listed == sorted(listed) and len(set(listed)) == 3


@pytest.mark.long
def test_run_accuracy_on_tiny_checkpoints(tmp_path):
    from demo.atoms import VOCAB
    from demo.tokenizer import save_tokenizer

    base = Qwen3Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
                       eos_token_id=VOCAB["<eos>"])
    params = init_params(base, jax.random.key(0))
    save_pretrained(base, params, tmp_path / "dense")
    save_tokenizer(tmp_path / "dense")
    kv_config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=2, window=4, topk=4))
    save_pretrained(kv_config, retrofit_params(kv_config, params, jax.random.key(1)), tmp_path / "kvpop")
    bench = tmp_path / "bench.jsonl"
    problems = [("x3y5\nask x\n", "3"), ("p7q1\nask q\n", "1"), ("m2n8\nask m\n", "2")]  # equal token lengths
    bench.write_text("".join(json.dumps(dict(problem=p, answer=a)) + "\n" for p, a in problems))
    out = tmp_path / "out"
    rows = run_accuracy(
        ["dense", "streaming", "tova", "h2o", "kvpop-mlp"],
        {"dense": str(tmp_path / "dense"), "kvpop-mlp": str(tmp_path / "kvpop")},
        str(bench), n_rollouts=2, compression_ratios=(0.5,), context_len=16, max_new_tokens=6,
        sampling=SamplingConfig(temperature=1.0, top_p=1.0, top_k=0), out_dir=str(out), progress=False,
    )
    assert [(r["method"], r["cr"], r["budget"]) for r in rows] == [
        ("dense", None, None), ("streaming", 0.5, 8), ("tova", 0.5, 8), ("h2o", 0.5, 8), ("kvpop-mlp", 0.5, 8)]
    assert all(0.0 <= r["abs"] <= 1.0 for r in rows)
    for name in ("accuracy.md", "accuracy.png", "accuracy.json", "samples.jsonl"):
        assert os.path.getsize(out / name) > 0, name
    assert "| 50% | 8 | kvpop-mlp |" in (out / "accuracy.md").read_text()
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5 * 3 * 2
    assert {(s["method"], s["cr"], s["budget"]) for s in samples} == {("dense", None, None)} | {
        (m, 0.5, 8) for m in ("streaming", "tova", "h2o", "kvpop-mlp")}  # the budget a row ran at, as the records

    # one greedy rollout per problem: decoding equal-length problems together changes nothing
    greedy = dict(n_rollouts=1, compression_ratios=(0.5,), context_len=16, max_new_tokens=6,
                  sampling=SamplingConfig.greedy(), progress=False)
    checkpoints = {"dense": str(tmp_path / "dense"), "kvpop-mlp": str(tmp_path / "kvpop")}
    methods = ["dense", "tova", "kvpop-mlp"]
    one = run_accuracy(methods, checkpoints, str(bench), out_dir=str(tmp_path / "one"), **greedy)
    two = run_accuracy(methods, checkpoints, str(bench), out_dir=str(tmp_path / "two"), problem_batch=2, **greedy)
    assert [r["abs"] for r in one] == [r["abs"] for r in two]
    read = lambda d: [json.loads(x)["completion"] for x in (tmp_path / d / "samples.jsonl").read_text().splitlines()]
    assert read("one") == read("two") and len(read("one")) == 3 * 3


def test_compile_ahead_compiles_each_next_setting_in_the_background(tmp_path):
    """Every setting after the first compiles its decode in the worker thread while the previous one
    decodes, and the completions equal a run without it (shapes of their own, so no other test's
    compiles are reused: rope_theta 12345)."""
    from helpers import logged_compiles

    dense, base = _dense_checkpoint(tmp_path / "dense", rope_theta=12_345.0)
    kv_config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=2, window=4, topk=4, scorer="mlstm"))
    params = load_pretrained(dense)[1]
    save_pretrained(kv_config, retrofit_params(kv_config, params, jax.random.key(1)), tmp_path / "kvpop")
    bench = tmp_path / "bench.jsonl"
    problems = [("x3y5z1\nask x\n", "3"), ("p7q1r4\nask q\n", "1"), ("m2n8o6\nask m\n", "2")]
    bench.write_text("".join(json.dumps(dict(problem=p, answer=a)) + "\n" for p, a in problems))
    checkpoints = {"dense": dense, "kvpop-mlstm": str(tmp_path / "kvpop")}
    methods = ["dense", "tova", "streaming", "kvpop-mlstm"]
    kwargs = dict(n_rollouts=1, compression_ratios=(0.5, 0.6), context_len=32, max_new_tokens=5, problem_batch=3,
                  sampling=SamplingConfig.greedy(), progress=False, stream_prompt=True)
    with logged_compiles() as seen:
        ahead = run_accuracy(methods, checkpoints, str(bench), out_dir=str(tmp_path / "ahead"), **kwargs)
    decodes = [thread for thread, fn in seen if fn in ("jit(_generate)", "jit(_generate_fed)", "jit(_reply)")]
    # dense here (while the worker already compiles the next), 3 methods x 2 CRs there (TOVA and StreamingLLM stream
    # these prompts, not a power of two long, as a padded tail: `_generate_fed`)
    assert sorted(decodes) == ["MainThread"] + ["compile-ahead_0"] * 6, decodes
    # dense and KVpop read these prompts (not a power of two long) in blocks: dense's reads here, the two CRs' there
    reads = [thread for thread, fn in seen if fn in ("jit(_read)", "jit(_read_owned)")]
    assert reads.count("compile-ahead_0") == 2 * reads.count("MainThread") > 0, seen
    plain = run_accuracy(methods, checkpoints, str(bench), out_dir=str(tmp_path / "plain"), compile_ahead=False,
                         **kwargs)
    assert ahead == plain
    read = lambda d: (tmp_path / d / "samples.jsonl").read_text()  # noqa: E731
    assert read("ahead") == read("plain")


def test_problem_groups():
    from eval.accuracy import _problem_groups

    assert _problem_groups([[1, 2], [3, 4], [5], [6], [7], [8, 9]], 2) == [[0, 1], [2, 3], [4], [5]]
    # equal lengths batch together however they are spread (one compile per shape, not per run of a length)
    assert _problem_groups([[1], [2, 3], [4], [5, 6], [7], [8]], 2) == [[0, 2], [1, 3], [4, 5]]
    assert _problem_groups([[1], [2, 3], [4], [5, 6], [7], [8]], 3) == [[0, 2, 4], [1, 3], [5]]
    with pytest.raises(ValueError, match="problem_batch"):
        _problem_groups([[1]], 0)


def test_demo_benchmark_spec_generates_fresh_problems():
    from demo.task import make_config
    from demo.tokenizer import build_tokenizer
    from eval.benchmarks import benchmark_name, load_benchmark, parse_demo_spec

    spec = "demo:reuse:test:seed=123:n=3:len=1024"
    problems = load_benchmark(spec)
    assert len(problems) == 3 and problems == load_benchmark(spec)  # deterministic
    tok = build_tokenizer()
    assert {len(tok(p["prompt"])["input_ids"]) for p in problems} == {1024}
    assert {p["id"] for p in problems}.isdisjoint(p["id"] for p in load_benchmark("demo:reuse:test:seed=124:n=3:len=1024"))
    assert problems[0]["prompt"] != load_benchmark("demo:reuse:validation:seed=123:n=3:len=1024")[0]["prompt"]
    assert parse_demo_spec("demo:read_once").len == 1024 and benchmark_name(spec) == "reuse-test-s123-3x1024"
    assert make_config(task="reuse").n_reuse == 3
    hard = benchmark_name("demo:reuse:test:seed=123:n=3:len=1024:difficulty=easy")
    assert hard == "reuse-test-s123-3x1024-easy" and hard != benchmark_name(spec)  # they do not share a report
    for bad, message in (("demo:", "name a task"), ("demo:chess", "task must be one of"),
                         ("demo:reuse:dev", "split must be one of"), ("demo:reuse:n=x", "n='x' is not a non-negative integer"),
                         ("demo:reuse:n=+4", "n='[+]4' is not"), ("demo:reuse:n= 4", "n=' 4' is not"),
                         ("demo:reuse:n=1_0", "n='1_0' is not"), ("demo:reuse:seed=-1", "seed='-1' is not"),
                         ("demo:reuse:k=3", r"unknown key 'k' \(split, seed, n, len, difficulty\)"), ("demo:reuse:n=2:n=3", "n given twice"),
                         ("demo:reuse:test:train", "split given twice"),
                         # caught while parsing, naming the spec, not later by the generator
                         ("demo:reuse:seed=4294967296", r"^'demo:reuse:seed=4294967296': .*0 <= seed < 2\*\*32"),
                         ("demo:reuse:len=300",
                          r"len=300: .*too short.*: the shortest seq_len for task 'reuse', .* is 959$")):
        with pytest.raises(ValueError, match=message):
            load_benchmark(bad)
    for bad in ("demo:reuse:len=1048577", "demo:reuse:n=262145:len=1024"):  # ran for minutes without a word
        with pytest.raises(ValueError, match=r"generator makes len <= 1,048,576 \(2\*\*20\) and at most 268,435,456"):
            load_benchmark(bad)
    with pytest.raises(ValueError, match=r"n=262145 problems of len=1024 tokens, 268,436,480 in all"):
        parse_demo_spec("demo:reuse:n=262145")
    assert parse_demo_spec("demo:reuse:n=262144").n == 262144  # the limit itself is taken
    with pytest.raises(ValueError, match="a demo spec names its own split"):
        load_benchmark("demo:reuse:n=2", split="validation")
    with pytest.raises(ValueError, match="note the colon"):
        load_benchmark("demo")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_benchmark(spec, limit=0)


def test_a_demo_spec_generated_in_chunks_is_the_same_problems(monkeypatch, capsys):
    """Large specs are generated a chunk at a time under a progress bar: problem i is the same either way."""
    import eval.benchmarks as benchmarks
    from demo.task import generate_dataset

    spec = benchmarks.parse_demo_spec("demo:read_once:validation:seed=7:n=5:len=1024")
    whole = [dict(id=ex["id"], prompt=ex["prompt"], answer=ex["answer"])
             for ex in generate_dataset(5, 7, "validation", task="read_once", seq_len=1024)]
    assert spec.problems() == whole
    monkeypatch.setattr(benchmarks, "GENERATE_CHUNK_TOKENS", 512)  # one problem a chunk; the bar from 4 KiB on
    assert spec.problems() == whole
    assert "generating demo:read_once:validation:seed=7:n=5:len=1024" in capsys.readouterr().err
    assert spec.problems(progress=False) == whole and capsys.readouterr().err == ""
    assert spec.problems(limit=2) == whole[:2] and spec.problems(limit=9) == whole  # only those are generated
    capsys.readouterr()
    assert benchmarks.load_benchmark(str(spec), limit=5, progress=False) == whole[:5]
    assert capsys.readouterr().err == ""


def test_run_accuracy_decodes_a_dms_export_in_its_pool(tmp_path):
    from demo.atoms import VOCAB
    from demo.tokenizer import save_tokenizer
    from eval.accuracy import method_setup

    base = Qwen3Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
                       eos_token_id=VOCAB["<eos>"])
    params = init_params(base, jax.random.key(0))
    save_pretrained(base, params, tmp_path / "dense")
    save_tokenizer(tmp_path / "dense")
    dms_config = dataclasses.replace(base, dms=DMSConfig(window=4, budget=24, gate_hidden=8))
    dms_params = retrofit_params(dms_config, params, jax.random.key(1))
    save_pretrained(dms_config, dms_params, tmp_path / "dms")
    # CR 50% of 32 tokens: B = 16 entries per KV head; the gates and window stay, the pool shrinks
    model, _, cache = method_setup("dms", dms_config, dms_params, 16, sinks=2, dtype=jnp.float32)
    assert cache == "dms" and model.config.dms == dataclasses.replace(dms_config.dms, budget=16)
    _, stripped, cache = method_setup("tova", dms_config, dms_params, 16, sinks=2, dtype=jnp.float32)  # baselines run the dense weights
    assert "dms" not in stripped["layers_0"]["self_attn"] and cache.budget == 16
    with pytest.raises(ValueError, match="needs a KVpop or DMS checkpoint"):
        method_setup("dms", base, params, 16, sinks=2, dtype=jnp.float32)
    # a KVpop export given as dms, or a DMS export under a KVpop variant's name, ran and was reported mislabelled
    kv_config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=2, window=4, topk=4, scorer="mlp", scorer_hidden=8))
    with pytest.raises(ValueError, match="method 'dms' needs a DMS export .* got a KVpop one"):
        method_setup("dms", kv_config, retrofit_params(kv_config, params, jax.random.key(2)), 16, sinks=2,
                     dtype=jnp.float32)
    for name in ("kvpop", "kvpop-mlp", "streamingllm+"):
        with pytest.raises(ValueError, match=f"method '{re.escape(name)}' names a KVpop variant .* DMS export"):
            method_setup(name, dms_config, dms_params, 16, sinks=2, dtype=jnp.float32)

    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(dict(problem=p, answer=a)) + "\n" for p, a in [("x3y5\nask x\n", "3")]))
    rows = run_accuracy(["dense", "dms"], {"dense": str(tmp_path / "dense"), "dms": str(tmp_path / "dms")},
                        str(bench), n_rollouts=1, compression_ratios=(0.5,), context_len=16, max_new_tokens=4,
                        sampling=SamplingConfig.greedy(), out_dir=str(tmp_path / "out"), progress=False)
    assert [(r["method"], r["cr"], r["budget"]) for r in rows] == [("dense", None, None), ("dms", 0.5, 8)]
    assert "| 50% | 8 | dms |" in (tmp_path / "out" / "accuracy.md").read_text()
    assert (f"Note: dms ({tmp_path / 'dms'}) was trained at memory B 24 per KV head (a pool of 24 entries, window 4) "
            "and runs at B 8 at CR 50% (pool 24 -> 8); --budgets 24 runs it as trained.") in \
        (tmp_path / "out" / "accuracy.md").read_text()


def _dense_checkpoint(path, **overrides):
    from demo.atoms import VOCAB
    from demo.tokenizer import save_tokenizer

    config = Qwen3Config(**{**dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   eos_token_id=VOCAB["<eos>"]), **overrides})
    rng = np.random.default_rng(0)  # random weights without an (eager, slow) init pass
    save_pretrained(config, jax.tree.map(lambda x: (0.1 * rng.normal(size=x.shape)).astype(x.dtype),
                                         abstract_params(config)), path)
    save_tokenizer(path)
    return str(path), config


def test_a_failed_rerun_leaves_the_previous_report_whole(tmp_path, monkeypatch, capsys):
    import eval.accuracy as accuracy

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(dict(problem=p, answer="3")) + "\n" for p in ("x3y5\nask x\n", "x3")))
    calls = []

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, **kwargs):  # decoding is not the point here
        calls.append(len(calls))
        if fail_at is not None and len(calls) > fail_at:
            raise RuntimeError("killed while decoding")
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.full(prompt_ids.shape[0], 1)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    fail_at = None
    short, _ = _dense_checkpoint(tmp_path / "short", max_position_embeddings=8)
    run_accuracy(["dense"], {"dense": short}, str(bench), n_rollouts=1, max_new_tokens=4, out_dir=str(tmp_path / "s"),
                 sampling=SamplingConfig.greedy(), progress=False)
    assert "warning: prompts plus max_new_tokens reach 14 tokens, beyond the max_position_embeddings 8" in \
        capsys.readouterr().err
    out = tmp_path / "out"
    kw = dict(n_rollouts=1, compression_ratios=(0.5,), context_len=16, max_new_tokens=4,
              sampling=SamplingConfig.greedy(), out_dir=str(out), progress=False)
    fail_at = None
    run_accuracy(["dense", "tova"], {"dense": dense}, str(bench), **kw)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    assert set(before) == {"accuracy.md", "accuracy.json", "accuracy.png", "samples.jsonl", LOCK_FILE}
    fail_at = len(calls) + 3  # the rerun dies after some samples are written
    with pytest.raises(RuntimeError, match="killed while decoding"):
        run_accuracy(["dense", "tova"], {"dense": dense}, str(bench), **kw)
    report = lambda: {f: (out / f).read_bytes() for f in os.listdir(out) if f != ".accuracy-journal.jsonl"}
    assert report() == before  # no truncated samples, no temporaries
    assert os.path.isfile(out / ".accuracy-journal.jsonl")  # what the rerun finished, for the next one
    fail_at = None  # a method that cannot run: the same
    with pytest.raises(ValueError, match="needs a KVpop or DMS checkpoint"):
        run_accuracy(["dense", "kvpop-x"], {"dense": dense, "kvpop-x": dense}, str(bench), **kw)
    assert report() == before


def test_a_killed_run_resumes_with_the_settings_it_finished_and_writes_the_unbroken_report(tmp_path, monkeypatch,
                                                                                          capsys):
    """A kill (an OOM, a preempted node) hours into a run threw away every finished method x CR: the rerun
    decoded them all again. Now each setting is journaled when it finishes and a rerun with the same inputs
    decodes only the rest, into the report an unbroken run writes, byte for byte."""
    import eval.accuracy as accuracy

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(dict(problem=p, answer=a)) + "\n"
                             for p, a in (("x3y5\nask x\n", "3"), ("p7q1\nask q\n", "1"), ("m2n8\nask m\n", "2"))))
    real_generate, calls, fail_at = accuracy.generate, [], [None]

    def counted_generate(model, params, prompt_ids, **kwargs):
        calls.append(kwargs["cache"])
        if fail_at[0] is not None and len(calls) > fail_at[0]:
            raise RuntimeError("killed while decoding")
        return real_generate(model, params, prompt_ids, **kwargs)

    monkeypatch.setattr(accuracy, "generate", counted_generate)
    methods, checkpoints = ["dense", "streaming", "tova"], {"dense": dense}
    kw = dict(n_rollouts=2, compression_ratios=(0.5,), context_len=16, max_new_tokens=4, progress=False,
              sampling=SamplingConfig(temperature=1.0, top_p=1.0, top_k=0),  # sampled: the keys must match too
              batch_size=np.int64(2))  # a numpy count, as a script computes it

    def report(out):
        return {f: (out / f).read_bytes() for f in sorted(os.listdir(out)) if f != LOCK_FILE}

    run_accuracy(methods, checkpoints, str(bench), out_dir=str(tmp_path / "whole"), **kw)
    whole, per_setting = report(tmp_path / "whole"), len(calls) // 3
    assert set(whole) == {"accuracy.md", "accuracy.json", "accuracy.png", "samples.jsonl"}  # no journal left
    out = tmp_path / "out"
    calls.clear()
    fail_at[0] = per_setting + 1  # dies in the second setting, after the first is done
    with pytest.raises(RuntimeError, match="killed while decoding"):
        run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **kw)
    assert set(os.listdir(out)) - {LOCK_FILE} == {".accuracy-journal.jsonl"}  # no report, no temporaries
    capsys.readouterr()
    calls.clear()
    fail_at[0] = None
    run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **kw)
    assert len(calls) == 2 * per_setting and "dense" not in calls  # only streaming and tova decoded
    assert "1 of 3 method x CR settings are done" in capsys.readouterr().err
    assert report(out) == whole

    # killed in the last setting with a line the kill cut short: the two whole ones are kept
    calls.clear()
    fail_at[0] = 2 * per_setting + 1
    with pytest.raises(RuntimeError, match="killed while decoding"):
        run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **kw)
    with open(out / ".accuracy-journal.jsonl", "a") as f:
        f.write('{"method": "tova", "cr": 0.5, "reco')
    calls.clear()
    fail_at[0] = None
    run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **kw)
    assert len(calls) == per_setting
    assert report(out) == whole

    # other inputs (another seed; a checkpoint rewritten) or --noresume: everything decodes again
    journal = out / ".accuracy-journal.jsonl"
    stale = "holds 1 finished method x CR settings of an earlier run"
    for change, note in ((dict(seed=1), f"{stale} of other inputs (seed)"),
                         (dict(resume=False), f"{stale} passed over"),
                         ("touch", f"{stale} of other inputs (checkpoints)")):  # which: the library's code is one
        calls.clear()
        fail_at[0] = per_setting + 1
        with pytest.raises(RuntimeError):
            run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **kw)
        calls.clear()
        fail_at[0] = None
        if change == "touch":
            weights = os.path.join(dense, "model.safetensors")
            os.utime(weights, ns=(os.stat(weights).st_atime_ns, os.stat(weights).st_mtime_ns + 10**9))
        changed = {**kw, **(change if change != "touch" else {})}
        if change != "touch":  # stopped at the note, before its first setting finished: the journal is as it was
            kept = journal.read_bytes()
            fail_at[0] = 0
            with pytest.raises(RuntimeError):
                run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **changed)
            assert journal.read_bytes() == kept, change
            calls.clear()
            fail_at[0] = None
        capsys.readouterr()
        run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **changed)
        assert len(calls) == 3 * per_setting, change
        assert note in capsys.readouterr().err, change
        assert not journal.exists()

    # keep_journal (the demo recipe, rerun after a crash in a later task): a whole report's rerun decodes nothing
    # and writes the same report; other inputs decode again
    whole = report(tmp_path / "whole")  # a new checkpoint mtime, above: the report names no mtime, but redo it
    calls.clear()
    run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), keep_journal=True, **kw)
    assert len(calls) == 3 * per_setting and journal.exists()
    first = report(out)
    assert {f: b for f, b in first.items() if f != journal.name} == whole
    calls.clear()
    capsys.readouterr()
    run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), keep_journal=True, **kw)
    assert calls == [] and report(out) == first
    assert f"every method x CR setting of {out} is done for these inputs: the report is written again without " \
           f"decoding; delete {journal} to decode them again" in capsys.readouterr().err
    with monkeypatch.context() as m:  # other XLA flags: decoded again
        m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
        run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), keep_journal=True, **kw)
    assert len(calls) == 3 * per_setting
    calls.clear()
    run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), keep_journal=True, **{**kw, "seed": 1})
    assert len(calls) == 3 * per_setting and journal.exists()
    calls.clear()
    run_accuracy(methods, checkpoints, str(bench), out_dir=str(out), **{**kw, "seed": 1})  # its journal's last run
    assert calls == [] and not journal.exists()


def test_a_resume_with_two_checkpoints_swapped_decodes_again(tmp_path, monkeypatch, capsys):
    """The journal's key held the set of checkpoint folders, not which one served which setting: a run killed
    with two exports swapped by mistake, rerun with the mapping fixed, kept the rows of the wrong model."""
    import eval.accuracy as accuracy

    one, _ = _dense_checkpoint(tmp_path / "one")
    two, _ = _dense_checkpoint(tmp_path / "two", hidden_size=48)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem="x3y5\nask x\n", answer="3")) + "\n")
    real_generate, calls, kill = accuracy.generate, [], [True]

    def counted_generate(*args, **kwargs):
        calls.append(1)
        if kill[0] and len(calls) == 2:
            raise RuntimeError("killed while decoding")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(accuracy, "generate", counted_generate)
    kw = dict(n_rollouts=1, compression_ratios=(0.5, 0.25), context_len=16, max_new_tokens=4, progress=False,
              sampling=SamplingConfig.greedy(), out_dir=str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="killed while decoding"):
        run_accuracy(["streaming"], {"dense": {0.5: two, 0.25: one}}, str(bench), **kw)
    calls.clear()
    kill[0] = False
    run_accuracy(["streaming"], {"dense": {0.5: one, 0.25: two}}, str(bench), **kw)
    assert len(calls) == 2 and "finished method x CR settings of an earlier run of other inputs" in \
        capsys.readouterr().err
    (tmp_path / "folder" / ".accuracy-journal.jsonl").mkdir(parents=True)  # refused before any decode
    with pytest.raises(ValueError, match="accuracy-journal.jsonl is a folder, not a file"):
        run_accuracy(["streaming"], {"dense": one}, str(bench), **{**kw, "out_dir": str(tmp_path / "folder")})


def test_a_folder_named_like_a_report_file_is_refused_before_the_first_decode(tmp_path, monkeypatch):
    """An accuracy.json/ folder in --out_dir: the rerun decoded everything, then renamed the new samples.jsonl and
    accuracy.md over the old ones and stopped at accuracy.json (IsADirectoryError), a report of two runs. Now it
    stops before the first decode, naming the folder, and the old report is as it was."""
    import eval.accuracy as accuracy

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem="x3y5\nask x\n", answer="3")) + "\n")
    decodes = []

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, **kwargs):
        decodes.append(1)
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.full(prompt_ids.shape[0], 1)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    out = tmp_path / "out"
    kw = dict(n_rollouts=1, max_new_tokens=4, sampling=SamplingConfig.greedy(), out_dir=str(out), progress=False)
    run_accuracy(["dense"], {"dense": dense}, str(bench), **kw)
    (out / "accuracy.json").unlink()
    (out / "accuracy.json").mkdir()
    before = {f: (out / f).read_bytes() for f in os.listdir(out) if f != "accuracy.json"}
    decodes.clear()
    with pytest.raises(ValueError, match=re.escape(f"{out / 'accuracy.json'} is a folder, not a file")):
        run_accuracy(["dense"], {"dense": dense}, str(bench), **kw)
    assert not decodes
    assert {f: (out / f).read_bytes() for f in os.listdir(out) if f != "accuracy.json"} == before


def test_problems_of_equal_length_batch_together_and_report_in_order(tmp_path, monkeypatch):
    """--problem_batch grouped only consecutive problems of equal length: a benchmark of interleaved lengths ran
    one problem per decode. Now each length's problems batch together, each row's completion stays its own, and
    records and samples keep the benchmark's order."""
    import eval.accuracy as accuracy

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    prompts = ["x3y5\nask x\n", "w3y5z1w2\nask w\n", "p7q1\nask q\n", "a1b2c3d4\nask d\n", "m2n8\nask n\n"]
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(dict(id=f"p{i}", problem=p, answer="1")) + "\n" for i, p in enumerate(prompts)))
    shapes = []

    def echo(model, params, prompt_ids, *, max_new_tokens, **kwargs):  # each row answers with its own prompt
        ids = np.asarray(prompt_ids)
        shapes.append(ids.shape)
        return ids[:, :max_new_tokens], np.full(ids.shape[0], max_new_tokens)

    monkeypatch.setattr(accuracy, "generate", echo)
    kw = dict(n_rollouts=1, compression_ratios=(), max_new_tokens=4, sampling=SamplingConfig.greedy(), progress=False)
    run_accuracy(["dense"], {"dense": dense}, str(bench), out_dir=str(tmp_path / "b"), problem_batch=2, **kw)
    short, long = shapes[0][1], shapes[1][1]
    assert short != long and shapes == [(2, short), (2, long), (1, short)]  # problems 0 2 | 1 3 | 4
    samples = [json.loads(x) for x in (tmp_path / "b" / "samples.jsonl").read_text().splitlines()]
    assert [x["id"] for x in samples] == [f"p{i}" for i in range(5)]
    completions = [x["completion"] for x in samples]  # each its own prompt's first tokens: rows not mixed up
    assert len(set(completions)) == 5 and all(c and p.startswith(c) for c, p in zip(completions, prompts))
    records = json.loads((tmp_path / "b" / "accuracy.json").read_text())["records"]
    assert [r["id"] for r in records] == [f"p{i}" for i in range(5)]


def test_a_budget_that_held_every_decoded_sequence_is_reported(tmp_path, monkeypatch, capsys):
    """B < prompt + max_new_tokens passes the up-front check, but answers that stop early may
    never fill it: then the CR evicted nothing, and the report says so."""
    import eval.accuracy as accuracy

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem="x3y5\nask x\n", answer="3")) + "\n")  # 10 tokens
    prompt_len = 10

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, **kwargs):
        assert prompt_ids.shape[1] == prompt_len
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.full(prompt_ids.shape[0], stop)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    kw = dict(n_rollouts=1, compression_ratios=(0.5,), context_len=24, max_new_tokens=4,  # B 12 < 10 + 4
              sampling=SamplingConfig.greedy(), progress=False)
    for stop, warned in ((2, True), (3, False)):  # 10 + 2 <= B: nothing evicted; 10 + 3 > B
        out = tmp_path / f"out{stop}"
        monkeypatch.chdir(tmp_path)  # a benchmark given relative to the working folder is recorded absolute
        run_accuracy(["dense", "tova"], {"dense": dense}, "bench.jsonl", out_dir=str(out), **kw)
        err = capsys.readouterr().err
        report = json.loads((out / "accuracy.json").read_text())["unevicted"]
        line = "CR 0.5 (B 12): the longest prompt + completion was 12 tokens, so nothing was evicted"
        assert (f"warning: {line}" in err) == warned and bool(report) == warned
        assert (line in (out / "accuracy.md").read_text()) == warned
    md = (out / "accuracy.md").read_text()  # what the numbers were made with is in the report
    assert "seed 0; sinks 4; baselines compress the prompt in one shot" in md
    assert f"Checkpoints: dense {dense}, tova {dense}." in md
    settings = json.loads((out / "accuracy.json").read_text())["settings"]
    assert settings["stream_prompt"] is False and settings["benchmarks"] == {"bench": str(bench)}
    assert settings["checkpoints"] == [dict(method="dense", cr=None, path=dense), dict(method="tova", cr=None, path=dense)]


def test_each_batch_of_a_problems_rollouts_draws_its_own_key_the_same_for_every_method(tmp_path, monkeypatch):
    """n_rollouts in batches of batch_size: each batch of one problem's rollouts must draw other noise (a key
    that did not fold in the batch's first rollout repeated batch 0's completions in every later batch, a
    pass@1 over copies), and rollout r of problem i draws the same noise whatever the method."""
    import eval.accuracy as accuracy

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    bench = tmp_path / "bench.jsonl"
    problems = ("x3y5\nask x\n", "p7q1\nask q\n")
    bench.write_text("".join(json.dumps(dict(problem=p, answer="3")) + "\n" for p in problems))
    keys = []

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, rng, cache, **kwargs):
        keys.append((cache if isinstance(cache, str) else cache.method, prompt_ids.shape[0],
                     tuple(np.asarray(jax.random.key_data(rng)).tolist())))
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.ones(prompt_ids.shape[0], np.int32)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    run_accuracy(["dense", "tova"], {"dense": dense}, str(bench), out_dir=str(tmp_path / "out"), n_rollouts=6,
                 batch_size=2, compression_ratios=(0.5,), context_len=24, max_new_tokens=4,
                 sampling=SamplingConfig(temperature=1.0, top_p=1.0, top_k=0), progress=False)
    by_method = {m: [k for name, rows, k in keys if name == m] for m in ("dense", "tova")}
    assert all(rows == 2 for _, rows, _ in keys) and [len(v) for v in by_method.values()] == [6, 6]  # 2 x 3 batches
    assert len(set(by_method["dense"])) == 6 and by_method["dense"] == by_method["tova"]


def test_completions_cut_off_before_any_answer_are_reported(tmp_path, monkeypatch, capsys):
    """A max_new_tokens too small for the answers scores every method 0: the report says why."""
    import eval.accuracy as accuracy
    from demo.atoms import VOCAB

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(dict(problem=f"x{i}y5\nask x\n", answer=str(i))) + "\n" for i in range(4)))
    digit = VOCAB["7"]

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, **kwargs):
        rows = prompt_ids.shape[0]
        tokens = np.full((rows, max_new_tokens), VOCAB["x"], np.int32)  # no answer in any completion
        tokens[:, -1] = last
        return tokens, np.full(rows, max_new_tokens if cut else max_new_tokens - 1, np.int32)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    kw = dict(n_rollouts=1, compression_ratios=(0.5,), context_len=20, max_new_tokens=3,
              sampling=SamplingConfig.greedy(), progress=False)
    # cut at the limit with nothing extracted: warned; ending on EOS, or before the limit: not
    for name, cut, last, warned in (("cut", True, digit, True), ("eos", True, VOCAB["<eos>"], False),
                                    ("early", False, digit, False)):
        out = tmp_path / name
        monkeypatch.chdir(tmp_path)  # a benchmark given relative to the working folder is recorded absolute
        run_accuracy(["dense", "tova"], {"dense": dense}, "bench.jsonl", out_dir=str(out), **kw)
        err = capsys.readouterr().err
        report = json.loads((out / "accuracy.json").read_text())["truncated"]
        assert bool(report) == warned and len(report) == (2 if warned else 0), name
        line = "dense: 4 of 4 completions reached max_new_tokens 3 with no answer extracted"
        assert (line in err) == warned and (line in (out / "accuracy.md").read_text()) == warned, name
        assert ("tova at CR 0.5: 4 of 4" in err) == warned, name


def test_a_train_split_spec_is_flagged_as_not_held_out(tmp_path, monkeypatch, capsys):
    """demo:TASK:train regenerates the problems the demo trainings learned from (train.main's
    --data=demo:N with its seed): the warning comes before any decode, and the report carries it."""
    import eval.accuracy as accuracy
    from demo.task import generate_mixture

    # the main job's recipe (configs/tiny_cpu.flags: --seed=0, --demo_tasks=reuse,read_once): its example 0 is
    # the spec's first problem
    trained = generate_mixture(2, 0, "train", ("reuse", "read_once"), seq_len=1000)[0]
    assert load_benchmark("demo:reuse:train:n=1:len=1000")[0]["prompt"] == trained["prompt"]
    dense, _ = _dense_checkpoint(tmp_path / "dense")
    decoded = []

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, **kwargs):
        decoded.append(capsys.readouterr().err)  # what was said before the first decode
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.full(prompt_ids.shape[0], 1)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    kw = dict(n_rollouts=1, compression_ratios=(0.5,), context_len=1000, max_new_tokens=2,
              sampling=SamplingConfig.greedy(), progress=False)
    for split, flagged in (("train", True), ("validation", False), ("test", False)):
        out = tmp_path / split
        spec = f"demo:reuse:{split}:n=1:len=1000"
        decoded.clear()
        run_accuracy(["dense"], {"dense": dense}, spec, out_dir=str(out), **kw)
        line = f"'{spec}' draws its problems from the demo's train split"
        assert (f"warning: {line}" in decoded[0]) == flagged, split
        assert (line in (out / "accuracy.md").read_text()) == flagged, split
        assert bool(json.loads((out / "accuracy.json").read_text())["not_held_out"]) == flagged, split


def test_local_paths_are_checked_and_never_looked_up_on_the_hub(tmp_path, monkeypatch):
    import datasets
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("contacted the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem="p", answer="1")) + "\n")
    with pytest.raises(FileNotFoundError, match=r"checkpoint of 'dense' 'runs/nope/export': no such directory"):
        run_accuracy(["dense"], {"dense": "runs/nope/export"}, str(bench), out_dir=str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match=r"checkpoint of 'kvpop-mlp' .*/missing'"):
        run_accuracy(["kvpop-mlp"], {"kvpop-mlp": str(tmp_path / "missing")}, str(bench), out_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"benchmark 'data/aime.jsonl': no such file"):
        load_benchmark("data/aime.jsonl")
    assert os.listdir(tmp_path / "o") == [LOCK_FILE]  # nothing written but the report folder's lock


BLANK_PROBLEM = r"row 0: 'problem' must be a string with text in it \(not empty or blank\)"
BLANK_ID = r"row 0: 'id' must be a number or a string with text in it"
NOT_AN_ANSWER = r"row 0: 'answer' must be a string or a finite number, got "

def test_benchmark_file_errors_name_file_and_line(tmp_path):
    bench = tmp_path / "bench.jsonl"
    for text, message, kw in (
            ('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": \n',
             r"benchmark '.*bench.jsonl' line 2 is not valid JSON", {}),
            ("", r"bench.jsonl' is empty", {}),
            ("[1, 2]\n", r"row 0 is not a JSON object", {}),
            # str(None) would score a boxed "None" as right
            ('{"problem": "a", "answer": null}\n', r"row 0 has no answer \(None\)", {}),
            ('{"problem": "a", "answer": ["7"]}\n', NOT_AN_ANSWER + "list", {}),
            ('{"problem": "a", "answer": {"v": 7}}\n', NOT_AN_ANSWER + "dict", {}),
            ('{"problem": "a", "answer": true}\n', NOT_AN_ANSWER + "bool", {}),
            # json reads NaN and Infinity: they were graded as the strings "nan" and "inf"
            ('{"problem": "a", "answer": NaN}\n', NOT_AN_ANSWER + "float 'nan'", {}),
            ('{"problem": "a", "answer": "#### "}\n', r"row 0: 'answer' '#### ' ends in an empty answer", {}),
            ('{"problem": "", "answer": "1"}\n', BLANK_PROBLEM, {}),
            ('{"problem": " \\n\\t", "answer": "1"}\n', BLANK_PROBLEM, {}),
            ('{"id": "a", "problem": "x", "answer": "1"}\n{"id": "a", "problem": "y", "answer": "2"}\n',
             r"rows 0 and 1 share the id 'a'", {}),
            ('{"id": "1", "problem": "x", "answer": "1"}\n{"problem": "y", "answer": "2"}\n',  # row 1's id is 1
             r"rows 0 and 1 share the id '1'", {}),
            ('{"id": null, "problem": "x", "answer": "1"}\n', BLANK_ID, {}),
            ('{"id": " ", "problem": "x", "answer": "1"}\n', BLANK_ID, {}),
            ('{"problem": "a", "answer": "1"}\n',  # the split was ignored
             r"is a local file, which has no splits; split='train' is for folders and hub datasets",
             dict(split="train"))):
        bench.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_benchmark(str(bench), **kw)
    bench.write_bytes(b'{"problem": "caf\xe9", "answer": "1"}\n')  # Latin-1
    with pytest.raises(ValueError, match=r"bench.jsonl' is not UTF-8 text \(invalid continuation byte at byte 16, "
                                         r"line 1\)"):
        load_benchmark(str(bench))
    bench.write_bytes(b'\xef\xbb\xbf{"problem": "a", "answer": "1"}\n')  # UTF-8 with a byte-order mark
    assert load_benchmark(str(bench)) == [dict(id="0", prompt="a", answer="1")]
    bench.write_bytes(b'\xef\xbb\xbf{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"at byte 51, line 2\)"):  # the file's byte, not the text's after the mark
        load_benchmark(str(bench))
    bench.write_bytes(b'{"problem": "a", "answer": "1"}\r{"problem": "caf\xe9", "answer": "1"}\r')  # old Mac lines
    with pytest.raises(ValueError, match=r"at byte 48, line 2\)"):  # counted as the JSON lines are
        load_benchmark(str(bench))
    # a worked solution as the reference is graded by its answer (GSM8K's rationale; the string compare failed it)
    bench.write_text(json.dumps(dict(question="q", answer="48/2 = <<48/2=24>>24 in May.\n#### 72")) + "\n"
                     + json.dumps(dict(problem="p", answer="so $\\boxed{\\frac{1}{2}}$")) + "\n")
    assert [p["answer"] for p in load_benchmark(str(bench))] == ["72", "\\frac{1}{2}"]
    # only a line that starts with ####, or a single box, is a worked solution's answer; the rest stay as given
    # field names in any case (AIME 2024 writes Problem / Answer / ID); two spellings of one name are refused
    bench.write_text(json.dumps(dict(ID="aime-1", Problem="p", Answer=204, problem_type="x")) + "\n")
    assert load_benchmark(str(bench)) == [dict(id="aime-1", prompt="p", answer="204")]
    bench.write_text(json.dumps(dict(problem="p", Answer=1, ANSWER=2)) + "\n")
    with pytest.raises(ValueError, match=r"row 0 spells the field 'answer' 2 ways \(\['Answer', 'ANSWER'\]\)"):
        load_benchmark(str(bench))
    bench.write_text(json.dumps(dict(problem="exact", Problem="other", answer=1)) + "\n")  # the exact name wins
    assert load_benchmark(str(bench))[0]["prompt"] == "exact"
    kept = ["C####", "a####b", "\\boxed{2} \\text{ and } \\boxed{3}", "\\boxed{7", "\\boxed{5} or x####y"]
    bench.write_text("".join(json.dumps(dict(problem="p", answer=a)) + "\n" for a in kept))
    assert [p["answer"] for p in load_benchmark(str(bench))] == kept
    # CSV cells are read as written: `datasets` typed an answer beyond int64 as a float, or failed with a traceback
    table = tmp_path / "bench.csv"
    table.write_text('problem,answer,id\n"a, b",12345678901234567890,1\nc,007,x\nd,98765432109876543210987,2\n')
    assert load_benchmark(str(table)) == [dict(id="1", prompt="a, b", answer="12345678901234567890"),
                                          dict(id="x", prompt="c", answer="007"),
                                          dict(id="2", prompt="d", answer="98765432109876543210987")]
    table.write_text("problem,answer\nwhat is 999+1,1,000\n")  # an unquoted comma: the answer was "1"
    with pytest.raises(ValueError, match=r"bench.csv' row 0 has more cells than the header names \(\['000'\]"):
        load_benchmark(str(table))
    table.write_text("problem,answer,id\nwhat is 1+1,2\n")  # it read as "has no answer" or "id 'None'"
    with pytest.raises(ValueError, match=r"bench.csv' row 0 has fewer cells than the header names \(2 of 3\)"):
        load_benchmark(str(table))
    long_prompt = "word " * 40000  # over csv's default field limit of 131072 characters: refused as "not valid CSV"
    table.write_text(f'problem,answer\n"{long_prompt}",5\n')
    assert load_benchmark(str(table)) == [dict(id="0", prompt=long_prompt, answer="5")]
    folder = tmp_path / "splits"  # a folder of split files takes a split
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"problem": "t", "answer": "1"}\n')
    (folder / "test.jsonl").write_text('{"problem": "e", "answer": "2"}\n')
    assert [p["prompt"] for p in load_benchmark(str(folder), split="train")] == ["t"]


def test_a_jsonl_prompt_with_a_unicode_line_separator_is_one_record(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw inside a string; the JSONL reader cut
    lines at them too (str.splitlines), so a valid file was refused as 'line 1 is not valid JSON'."""
    rows = [dict(id=1, prompt="2 + 3 =\u2028?", answer="5"), dict(id=2, prompt="a\u2029b\x85c", answer="7")]
    bench = tmp_path / "bench.jsonl"
    bench.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    assert [(p["id"], p["prompt"]) for p in load_benchmark(str(bench))] == [("1", rows[0]["prompt"]),
                                                                             ("2", rows[1]["prompt"])]
    bench.write_bytes(bench.read_bytes() + b'{"prompt": "x\xe2\x80\xa8y", "answer": \n')
    with pytest.raises(ValueError, match=re.escape(f"benchmark {str(bench)!r} line 3 is not valid JSON")):
        load_benchmark(str(bench))


def test_a_parquet_file_is_read_and_a_hub_dataset_that_fails_to_load_is_one_line(tmp_path, monkeypatch):
    """A local parquet file goes through `datasets`; a hub dataset `datasets` cannot load (offline, gated) is one
    line naming it, its ValueError as it is."""
    import datasets
    import pandas as pd

    pd.DataFrame(dict(problem=["a", "b"], answer=["1", "20"])).to_parquet(tmp_path / "bench.parquet")
    assert load_benchmark(str(tmp_path / "bench.parquet")) == [dict(id="0", prompt="a", answer="1"),
                                                              dict(id="1", prompt="b", answer="20")]

    def unreachable(path, split):
        raise ConnectionError(f"Couldn't reach {path!r} on the Hub\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ValueError, match=r"^benchmark 'org/bench': not a local file, and loading it as a hub dataset "
                                         r"failed \(ConnectionError: Couldn't reach 'org/bench' on the Hub\)$"):
        load_benchmark("org/bench")

    def unknown_split(path, split):
        raise ValueError(f"Unknown split {split!r}")

    monkeypatch.setattr(datasets, "load_dataset", unknown_split)
    with pytest.raises(ValueError, match=r"^Unknown split 'dev'$"):
        load_benchmark("org/bench", split="dev")


def test_a_folder_of_split_files_is_read_as_its_files_are(tmp_path):
    """A local folder's split files (named as `datasets` names them) are read as a single such file is: through
    `datasets`, a CSV answer beyond int64 ended the run as "loading it as a hub dataset failed", and a split's
    shards of two formats were refused."""
    folder = tmp_path / "bench"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("# not a split\n")
    (folder / "data" / "train-00000-of-00001.csv").write_text("problem,answer\nt,1\n")
    (folder / "data" / "test-00000-of-00002.csv").write_text("problem,answer\na,12345678901234567890\nb,007\n")
    (folder / "data" / "test-00001-of-00002.jsonl").write_text('{"problem": "c", "answer": 3}\n')
    assert load_benchmark(str(folder)) == [dict(id="0", prompt="a", answer="12345678901234567890"),
                                           dict(id="1", prompt="b", answer="007"),
                                           dict(id="2", prompt="c", answer="3")]  # ids number the split's rows
    assert load_benchmark(str(folder), split="train", limit=1) == [dict(id="0", prompt="t", answer="1")]
    with pytest.raises(ValueError, match=r"folder '.*bench' has no 'validation' split \(its files make "
                                         r"\['test', 'train'\]\): name one with --split"):
        load_benchmark(str(folder), split="validation")
    # a bad row is named by its file and row there
    (folder / "data" / "test-00001-of-00002.jsonl").write_text('{"problem": "c", "answer": 3}\n{"problem": "d"}\n')
    with pytest.raises(ValueError, match=r"test-00001-of-00002.jsonl' row 1 needs one of"):
        load_benchmark(str(folder))
    (folder / "data" / "test-00001-of-00002.jsonl").write_text('{"id": 0, "problem": "c", "answer": 3}\n')
    with pytest.raises(ValueError, match=r"test-00000-of-00002.csv' row 0 and '.*test-00001-of-00002.jsonl' row 0 "
                                         r"share the id '0'"):
        load_benchmark(str(folder))
    # files whose names carry no split are the folder's one split, read without --split
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "problems.csv").write_text("problem,answer\nx,98765432109876543210987\n")
    assert load_benchmark(str(loose)) == [dict(id="0", prompt="x", answer="98765432109876543210987")]
    with pytest.raises(ValueError, match=r"has no 'test' split \(its files make \['train'\]\)"):
        load_benchmark(str(loose), split="test")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"folder '.*empty' holds no data files"):
        load_benchmark(str(empty))


def test_a_folder_datasets_cannot_read_is_one_line_naming_it(tmp_path):
    """A split with a file that is not JSON or CSV (here a LICENSE) goes to `datasets`, whose
    DatasetGenerationError (a CSV answer beyond int64) was a traceback through eval.main, naming no folder; then one
    line naming the wrapper ("An error occurred while generating the dataset") instead of its cause."""
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "problems.csv").write_text("problem,answer\nx,98765432109876543210987\n")
    (folder / "LICENSE").write_text("MIT\n")
    with pytest.raises(ValueError, match=r"benchmark folder '.*bench': `datasets` could not read its 'train' split "
                                         r"\(OverflowError: Python int too large"):
        load_benchmark(str(folder))


def test_a_folder_whose_dataset_card_names_its_splits_is_read_as_datasets_reads_it(tmp_path):
    """A hub dataset's clone names each split's files in its README's YAML `configs` (opencompass/AIME2025's
    aime2025-I.jsonl is its test split): `datasets` reads the card, and reading the file names alone took the
    folder's one split for "train" and refused --split test."""
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: test\n"
                                      "    path: aime.jsonl\n---\n# AIME\n")
    (folder / "aime.jsonl").write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n')
    want = [dict(id="0", prompt="a", answer="1"), dict(id="1", prompt="b", answer="2")]
    assert load_benchmark(str(folder)) == load_benchmark(str(folder), split="test") == want
    with pytest.raises(ValueError, match=r"Unknown split \"train\""):
        load_benchmark(str(folder), split="train")


def test_cli_generate_checks_its_seed_and_sampling_before_the_weights_load(tmp_path, capsys, monkeypatch):
    """--seed past int64 was a bare OverflowError from jax.random.key after the weights had loaded; a bad
    --top_p too was refused only then. Both are one line now, before `load_pretrained` runs."""
    import eval.main as eval_main

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    monkeypatch.setattr(eval_main, "load_pretrained", lambda *a, **k: pytest.fail("the weights were loaded"))
    for argv, message in ((["--seed", str(2**70)], f"--seed {2**70} is outside jax.random.key's int64 range"),
                          (["--top_p", "1.5"], "top_p must be in (0, 1], got 1.5")):
        with pytest.raises(SystemExit) as exit_info:
            eval_main.main(["generate", "--checkpoint", dense, "--prompt_ids", "1,5", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cli_token_ids_and_missing_checkpoints_are_one_line_errors(tmp_path, capsys):
    from eval.main import main

    dense, config = _dense_checkpoint(tmp_path / "dense")
    bad = {"1,a,3": "error: --prompt_ids: 'a' is not an integer token id",
           "1,5,500": f"error: --prompt_ids (for {dense}) holds token id 500 outside the vocabulary [0, "
                      f"{config.vocab_size})",
           "1,-5": f"error: --prompt_ids (for {dense}) holds token id -5 outside the vocabulary"}
    for ids, message in bad.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--checkpoint", dense, "--prompt_ids", ids, "--max_new_tokens", "2"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and len(err.splitlines()) == 1, err
    a_file = tmp_path / "a_file"  # --out_dir that cannot be a report folder: a usage error before any work
    a_file.write_text("x")
    for out_dir, message in ((str(a_file), f"--out_dir={a_file} is a file, not a folder"),
                             (str(a_file / "sub"), f"--out_dir={a_file}/sub lies under the file {a_file}"),
                             ("", "--out_dir is empty")):
        for argv in (["accuracy", "--checkpoints", f"dense={dense}", "--benchmark", "b.jsonl"],
                     ["recall", "--checkpoint", dense, "--data", "d.jsonl"], ["bench", "train", "--dry"]):
            with pytest.raises(SystemExit) as exit_info:
                main([*argv, "--out_dir", out_dir])
            assert exit_info.value.code == 2
            assert f"argument --out_dir: {message}" in capsys.readouterr().err
    # --prompt and --prompt_ids together: --prompt was dropped without a word; neither: a prompt of nothing
    for argv, message in ((["--prompt", "x3", "--prompt_ids", "1,5"], "argument --prompt_ids: not allowed with "
                                                                      "argument --prompt"),
                          ([], "one of the arguments --prompt --prompt_file --prompt_ids is required"),
                          (["--prompt_ids", ""], "error: --prompt_ids: '' is not an integer token id")):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--checkpoint", dense, *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    for argv, message in ((["--dtype", "float33"], "argument --dtype: invalid choice: 'float33'"),
                          (["--lengths", "abc"], "error: --lengths must be positive ints like '1k,2k,4096', "
                                                 "got 'abc'"),
                          # ignored without a word: the random model's size with a checkpoint, the budget with an
                          # export (it brings its own)
                          (["--checkpoint", dense, "--layers", "2", "--vocab", "64", "--benchmarks_md", "",
                            "--lengths", "64"],
                           f"error: --layers, --vocab: {dense} brings its own size\n"),
                          (["--checkpoint", "checkpoints/demo-kvpop-mlstm", "--topk", "8", "--scorer", "mlp",
                            "--benchmarks_md", "", "--lengths", "64"],
                           "error: --topk, --scorer: checkpoints/demo-kvpop-mlstm brings its own size and budget")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "decode", *argv, "--out_dir", str(tmp_path / "bd")])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    bare = tmp_path / "bare"  # weights and config, no tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tmp_path / "dense" / name).read_bytes())
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint", str(bare), "--prompt", "x3y5", "--max_new_tokens", "2"])
    assert exit_info.value.code == 2
    assert f"error: no tokenizer in {bare}: none of ['tokenizer.json'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["accuracy", "--checkpoints", f"dense={tmp_path / 'nope'}", "--benchmark", str(tmp_path / "b.jsonl"),
              "--out_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: checkpoint of 'dense' '{tmp_path / 'nope'}': no such directory"
    for argv, message in ((["--budgets", "2309,x"], "argument --budgets: '2309,x' is not a comma-separated list of "
                                                    "ints (e.g. 2309,4325)"),
                          (["--budgets", "8", "--compression_ratios", "0.5"], "error: give compression_ratios or "
                                                                             "budgets, not both")):
        with pytest.raises(SystemExit) as exit_info:
            main(["accuracy", "--checkpoints", f"dense={tmp_path / 'dense'}", "--benchmark", str(tmp_path / "b.jsonl"),
                  "--out_dir", str(tmp_path / "out"), *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_bad_inputs_are_refused_before_the_first_decode(tmp_path, monkeypatch):
    """Every check runs before any method decodes: a bad CR, checkpoint or budget of the last
    method must not surface after the first one's rollouts."""
    import datasets

    import eval.accuracy as accuracy

    dense, config = _dense_checkpoint(tmp_path / "dense")
    kv = dataclasses.replace(config, kvpop=KVpopConfig(sinks=2, window=4, topk=4, scorer="mlstm", mlstm_dim=8))
    save_pretrained(kv, retrofit_params(kv, init_params(config, jax.random.key(0)), jax.random.key(1)),
                    tmp_path / "kv")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "model.safetensors"):
        data = (tmp_path / "kv" / name).read_bytes()
        (corrupt / name).write_bytes(data if name == "config.json" else data[: len(data) // 2])

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded before the inputs were checked")

    monkeypatch.setattr(accuracy, "generate", no_decode)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem="x3y5\nask x\n", answer="3")) + "\n")
    kw = dict(n_rollouts=1, compression_ratios=(0.5,), context_len=16, max_new_tokens=4,
              sampling=SamplingConfig.greedy(), out_dir=str(tmp_path / "out"), progress=False)
    ckpts = {"dense": dense, "kv": str(tmp_path / "kv")}
    run = lambda methods, checkpoints=ckpts, source=str(bench), **over: run_accuracy(  # noqa: E731
        methods, checkpoints, source, **{**kw, **over})
    with pytest.raises(ValueError, match=r"compression ratio must be in \[0, 1\), got 1.0"):
        run(["dense", "tova"], compression_ratios=(0.5, 1.0))
    # decoded twice into two rows both labelled "50% | 8" before
    with pytest.raises(ValueError, match=r"compression ratios 0.5 and 0.51 both give B 8 at context_len 16: give each"):
        run(["dense", "tova"], compression_ratios=(0.5, 0.51))
    with pytest.raises(ValueError, match=r"method 'kv' at CR 0.5 \(B 8 of context_len 16\) with checkpoint .*kv'"):
        run(["dense", "tova", "kv"])  # B 8 < s + w + the mLSTM's state
    with pytest.raises(ValueError, match=r"method 'x' .* '.*dense'.*needs a KVpop or DMS checkpoint"):
        run(["dense", "x"], {"dense": dense, "x": dense})
    with pytest.raises(ValueError, match=r"corrupt safetensors file '.*corrupt/model.safetensors'"):
        run(["dense", "x"], {"dense": dense, "x": str(corrupt)})
    mismatch = tmp_path / "mismatch"  # a KVpop config over dense weights: caught from the headers
    mismatch.mkdir()
    (mismatch / "config.json").write_bytes((tmp_path / "kv" / "config.json").read_bytes())
    (mismatch / "model.safetensors").write_bytes(open(os.path.join(dense, "model.safetensors"), "rb").read())
    with pytest.raises(ValueError, match=r"mismatch' does not match the config: missing tensors \[.*kvpop"):
        run(["dense", "tova", "x"], {"dense": dense, "x": str(mismatch)})
    # an export without tokenizer files: said so, not an empty tokenizer that encodes every prompt to nothing
    with pytest.raises(ValueError, match=r"no checkpoint holds a tokenizer \('.*/kv'\): copy the tokenizer files"):
        run(["dense"], {"dense": str(tmp_path / "kv")})
    # Checkpoints with different tokenizers: every method would have been run with the first one's, silently
    # (a self-consistent model with its ids permuted scored 1.00 alone and 0.00 after dense).
    from safetensors.numpy import load_file, save_file
    from transformers import AutoTokenizer

    from demo.tokenizer import save_tokenizer

    other_tok = tmp_path / "other_tok"
    shutil.copytree(tmp_path / "kv", other_tok)
    tok = AutoTokenizer.from_pretrained(dense)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other_tok)
    with pytest.raises(ValueError, match=r"checkpoints '.*dense' and '.*other_tok' have different tokenizers"):
        run(["dense", "kv"], {"dense": dense, "kv": str(other_tok)}, compression_ratios=(0.2,))
    # A later checkpoint whose vocabulary the prompts do not fit, or whose weights hold a NaN: refused before
    # the first decode (both surfaced only when that method's turn came, losing the earlier methods' results).
    small, _ = _dense_checkpoint(tmp_path / "small", vocab_size=6)
    with pytest.raises(ValueError, match=r"the prompts encode to token id \d+, outside the vocabulary \[0, 6\) of "
                                         r"'.*small' \(methods \['dense', 'tova'\]\)"):
        run(["dense", "tova"], {"dense": small})
    nan = tmp_path / "nan"
    shutil.copytree(tmp_path / "kv", nan)
    save_tokenizer(nan)  # dense's
    tensors = load_file(nan / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name].flat[0] = np.nan
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="NaN"):
        run(["dense", "tova", "kv"], {"dense": dense, "kv": str(nan)}, compression_ratios=(0.2,))
    with pytest.raises(ValueError, match=r"method 'streaming' at CR 0.5 \(B 8 .*sinks 8 leave StreamingLLM no recent "
                                         r"window at B 8"):
        run(["dense", "streaming"], sinks=8)  # was silently cut to B - 1
    with pytest.raises(ValueError, match=r"checkpoints given for \['h2o'\]: the training-free baselines run on the dense"):
        run(["dense", "h2o"], {"dense": dense, "h2o": dense})  # was silently ignored
    # a typo'd baseline: was "no checkpoint for method 'tovaa'", the baselines unnamed
    with pytest.raises(ValueError, match=r"unknown method 'tovaa' \(did you mean 'tova'\?\): methods are dense, the "
                                         r"training-free baselines \(h2o, streaming, tova; on the dense checkpoint\) "
                                         r"and the names of the checkpoints given \(dense\)"):
        run(["dense", "tovaa"], {"dense": dense})
    with pytest.raises(ValueError, match=r"no checkpoint named 'kvpop-mlp': give the export as kvpop-mlp=DIR in "
                                         r"--checkpoints \(have dense;"):
        run(["dense", "kvpop-mlp"], {"dense": dense})  # an export left out: not a typo
    with pytest.raises(ValueError, match=r"method 'tova' runs on the dense checkpoint: give it as dense=DIR in "
                                         r"--checkpoints \(have kv\)"):
        run(["tova"], {"kv": dense})
    with pytest.raises(ValueError, match=r"method 'dense' needs the dense checkpoint"):
        run(["dense"], {"kv": dense})
    with pytest.raises(FileNotFoundError, match=r"config.json': a file; give the folder that holds it"):
        run(["dense"], {"dense": os.path.join(dense, "config.json")})  # was "no such directory"
    with pytest.raises(ValueError, match=f"seed {2**65} is outside jax.random.key's int64 range"):
        run(["dense", "tova"], seed=2**65)  # was a bare OverflowError at the first rollout, after the loads
    for name, value in (("n_rollouts", 0), ("context_len", -100), ("max_new_tokens", 0), ("problem_batch", 0)):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1, got {value}"):
            run(["dense", "tova"], **{name: value})
    for temperature in (0.0, 1e-40):  # 16 identical greedy decodes, reported as "pass@1 over 16 rollouts"
        with pytest.raises(ValueError, match=rf"temperature {temperature:g} is greedy decoding: the n_rollouts 16 "
                                             "completions of a problem would be identical; pass n_rollouts 1"):
            run(["dense", "tova"], n_rollouts=16, sampling=SamplingConfig(temperature=temperature))
    with pytest.raises(ValueError, match=r"problem_batch 8 batches problems of one rollout each; with n_rollouts 4 a "
                                         r"batch holds one problem's rollouts \(batch_size\): pass problem_batch 1"):
        run(["dense", "tova"], n_rollouts=4, problem_batch=8)  # was ignored without a word
    with pytest.raises(ValueError, match=r"CR 0.5 of context_len 64 is a budget of 32 KV entries, more than the "
                                         r"longest prompt plus max_new_tokens \(14 tokens\): nothing would be evicted"):
        run(["dense", "tova"], context_len=64)
    other = tmp_path / "other"
    other.mkdir()
    (other / "bench.jsonl").write_text(bench.read_text())
    with pytest.raises(ValueError, match="share the name 'bench'"):
        run(["dense"], source=[str(bench), str(other / "bench.jsonl")])
    with pytest.raises(ValueError, match=r"are the same generated problems \(reuse-test-s0-1x1024\): give each spec once"):
        run(["dense"], source=["demo:reuse:n=1", "demo:reuse:test:n=1"])
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got nan"):
        SamplingConfig(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"'dense@0.75=/a': dense runs once"):
        parse_checkpoints("dense@0.75=/a")
    # NAME@inf was an OverflowError traceback; @nan, @-5 failed later as "no entry for CR ...: [nan]"
    for key in ("abc", "inf", "1e400", "nan", "-inf", "-5", "1.5", ""):
        with pytest.raises(ValueError, match=rf"'kv@{key}=/a': '{key}' is neither a compression ratio in \[0, 1\) "
                                             r"\(NAME@0.88=PATH\) nor a budget, an int B >= 1"):
            parse_checkpoints(f"kv@{key}=/a")
    assert parse_checkpoints("kv@0.75=/a,kv@256=/b") == {"kv": {0.75: "/a", 256.0: "/b"}}
    for spec in ("kv@123=/a,kv@123=/b", "kv@123=/a,kv@123.0=/b", "kv@0.75=/a,kv@.75=/b"):  # the last one won
        with pytest.raises(ValueError, match=r"^kv@(123|0.75) is given twice$"):
            parse_checkpoints(spec)
    for spec in ("@123=/a", "=/a"):  # accepted, then "have , dense"
        with pytest.raises(ValueError, match="names no method"):
            parse_checkpoints(spec)

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'some_org/bench' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"'some_org/bench': not a local file, and loading it as a hub dataset "
                                         r"failed \(ConnectionError"):
        load_benchmark("some_org/bench")
    assert os.listdir(tmp_path / "out") == [LOCK_FILE]  # nothing written but the report folder's lock


def test_cli_compile_ahead_and_noresume_flags_reach_run_accuracy(tmp_path, monkeypatch):
    import eval.main as cli

    seen = []

    def fake_run_accuracy(*args, out_dir, compile_ahead, resume, **kwargs):
        seen.append((compile_ahead, resume))
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, "accuracy.md"), "w").close()  # what the CLI prints after the run

    monkeypatch.setattr(cli, "run_accuracy", fake_run_accuracy)
    base = ["accuracy", "--checkpoints", "dense=x", "--methods", "dense", "--benchmark", "b.jsonl",
            "--out_dir", str(tmp_path / "out")]
    cli.main(base)
    cli.main(base + ["--no_compile_ahead"])
    cli.main(base + ["--noresume"])
    assert seen == [(True, True), (False, True), (True, False)]
    # "a, b" as --checkpoints reads it: ' demo:reuse' went to the hub as a dataset name, ' tova' had no checkpoint
    lists = []
    monkeypatch.setattr(cli, "run_accuracy", lambda methods, checkpoints, benchmarks, **kwargs: lists.append(
        (methods, benchmarks)) or fake_run_accuracy(**kwargs))
    cli.main(["accuracy", "--checkpoints", "dense=x", "--methods", "dense, tova,", "--benchmark",
              "demo:reuse:n=1, b.jsonl ", "--out_dir", str(tmp_path / "out")])
    assert lists == [(["dense", "tova"], ["demo:reuse:n=1", "b.jsonl"])]


def test_cli_default_methods_run_the_exports_given(tmp_path, monkeypatch, capsys):
    """`--checkpoints dense=D,kvpop-mlstm=E` without --methods ran dense and the three baselines and left the export
    out without a word; an explicit --methods that leaves out an export given is noted."""
    import eval.main as cli

    ran = []

    def fake_run_accuracy(methods, checkpoints, benchmarks, *, out_dir, **kwargs):
        ran.append(methods)
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, "accuracy.md"), "w").close()

    monkeypatch.setattr(cli, "run_accuracy", fake_run_accuracy)
    base = ["accuracy", "--benchmark", "b.jsonl", "--out_dir", str(tmp_path / "out")]
    for checkpoints, methods in (("dense=x,kvpop-mlstm=y,dms@0.75=z", ["dense", "streaming", "tova", "h2o",
                                                                        "kvpop-mlstm", "dms"]),
                                 ("kvpop-mlp=y", ["kvpop-mlp"]), ("dense=x", ["dense", "streaming", "tova", "h2o"])):
        cli.main(base + ["--checkpoints", checkpoints])
        assert ran[-1] == methods and "note:" not in capsys.readouterr().err
    cli.main(base + ["--checkpoints", "dense=x,kvpop-mlstm=y,dms=z", "--methods", "dense,dms"])
    assert ran[-1] == ["dense", "dms"]
    assert capsys.readouterr().err.strip().endswith(
        "note: --checkpoints gives kvpop-mlstm, which --methods 'dense,dms' leaves out: not run")


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C in any eval.main command: one line, exit 130 (it printed a KeyboardInterrupt traceback)."""
    import eval.main as eval_main

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(eval_main.COMMANDS, "recall", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        eval_main.main(["recall"])
    assert exit_info.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == "interrupted: eval.main recall stopped; reports it had not finished were not written", err


@pytest.mark.parametrize("argv, named, got", [([], "accuracy", "none"), (["bogus"], "accuracy", "'bogus'"),
                                              (["bench"], "decode", "none"), (["bench", "bogus"], "decode", "'bogus'")])
def test_missing_or_unknown_command_is_an_error_line_and_exit_2(argv, named, got, capsys):
    """`eval.main` without a (bench) command or with an unknown one is a bad input: the usage, one `error:` line
    naming the commands, exit 2 (it exited 1 with no error line, unlike every other bad input)."""
    import eval.main as eval_main

    with pytest.raises(SystemExit) as exit_info:
        eval_main.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and named in last and last.endswith(f"got {got}"), last


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["bench", "--help"]])
def test_top_level_help_exits_0(argv, capsys):
    """`python -m eval.main --help` prints the commands and exits 0 (it exited 1, as an error)."""
    import eval.main as eval_main

    eval_main.main(argv)
    assert "usage: python -m eval.main" in capsys.readouterr().out


def test_cli_generate_names_a_prompt_that_is_not_utf8(tmp_path, capsys, monkeypatch):
    """Bytes of a --prompt that are not UTF-8 reach Python as lone surrogates (PEP 383); the tokenizer
    refused them with a bare TypeError traceback. Now one line naming the flag, before the weights load."""
    import eval.main as eval_main

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    monkeypatch.setattr(eval_main, "load_pretrained", lambda *a, **k: pytest.fail("the weights were loaded"))
    prompt = os.fsdecode(b"x3\xff\xfey5")  # what `python -m eval.main generate --prompt $'x3\xff\xfey5'` sees
    with pytest.raises(SystemExit) as exit_info:
        eval_main.main(["generate", "--checkpoint", dense, "--prompt", prompt])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.strip() == "error: --prompt is not UTF-8 text (byte 0xff at character 2)", err
    with pytest.raises(SystemExit) as exit_info:  # patterns --text took the same path to the tokenizer
        eval_main.main(["patterns", "--checkpoint", "checkpoints/demo-kvpop-mlstm", "--text", prompt,
                        "--out_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: --text is not UTF-8 text (byte 0xff at character 2)" in err, err


def test_cli_generate_reads_a_prompt_file(tmp_path, capsys):
    """--prompt_file: a prompt longer than one shell argument may be (128 KiB on Linux), read as UTF-8
    and tokenized as --prompt is: the same completion as --prompt with its text; a non-UTF-8 file named."""
    from eval.main import main

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    text = "x3y5\nask x\n"
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    outputs = []
    for argv in (["--prompt", text], ["--prompt_file", str(tmp_path / "prompt.txt")]):
        main(["generate", "--checkpoint", dense, *argv, "--max_new_tokens", "3", "--temperature", "0"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "generated ids:" in outputs[0]
    (tmp_path / "bad.txt").write_bytes(b"x3\xffy5")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint", dense, "--prompt_file", str(tmp_path / "bad.txt")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--prompt_file '{tmp_path / 'bad.txt'}' is not UTF-8 text" in err
    # a missing file or a folder is named with its flag (was a bare "[Errno 2] No such file or directory")
    for path, message in ((tmp_path / "nope.txt", "no such file"), (tmp_path, "is a folder; expected a text file")):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--checkpoint", dense, "--prompt_file", str(path)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"error: --prompt_file '{path}'" in err and message in err, err


def test_cli_generate_stops_at_the_generation_configs_eos_ids(tmp_path, capsys):
    """transformers' `generate` stops at generation_config.json's eos_token_id (Qwen3's lists
    <|im_end|> and <|endoftext|>, config.json one of them); `eval.main generate` read config.json's
    only and ran on past the second. Its ids now stop it too (with config.json's)."""
    from eval.main import main

    dense, _ = _dense_checkpoint(tmp_path / "dense", eos_token_id=None)  # no stop but the file's

    def generated(*argv):
        main(["generate", "--checkpoint", dense, "--prompt_ids", "1,30,41,7", "--max_new_tokens", "8",
              "--temperature", "0", *argv])
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("generated ids:")][0]
        return json.loads(line.split(":", 1)[1])

    free = generated()
    assert len(free) == 8
    stop = next(i for i in range(1, 8) if free[i] not in free[:i])
    (tmp_path / "dense" / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[stop]]}))
    assert generated() == free[: stop + 1]
    (tmp_path / "dense" / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**9}))
    with pytest.raises(SystemExit) as exit_info:
        generated()
    assert exit_info.value.code == 2
    assert "holds 1000000000; expected token ids in" in capsys.readouterr().err


def test_accuracy_stops_at_the_generation_configs_eos_ids_too(tmp_path, monkeypatch):
    """run_accuracy stopped at the tokenizer's and config.json's EOS ids only: a Qwen3 rollout ran past
    <|endoftext|> (generation_config.json's second id) to max_new_tokens. Its ids now stop it too."""
    import eval.accuracy as accuracy

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    (tmp_path / "dense" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem="x3y5\nask x\n", answer="3")) + "\n")
    seen = []

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, eos_ids, **kwargs):
        seen.append(eos_ids)
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.full(prompt_ids.shape[0], 1)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    run_accuracy(["dense"], {"dense": dense}, str(bench), out_dir=str(tmp_path / "out"), n_rollouts=1,
                 compression_ratios=(0.5,), context_len=24, max_new_tokens=4, sampling=SamplingConfig.greedy(),
                 progress=False, compile_ahead=False)
    from demo.atoms import VOCAB

    assert seen and all(set(eos) == {VOCAB["<eos>"], 7, 11} for eos in seen), seen


def test_chat_template_prompts_are_token_ids(tmp_path, monkeypatch):
    """--chat_template: transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding, and
    list() of it gave the prompt ['input_ids', 'attention_mask']; the prompt is now the template's ids
    (as transformers 4 returned them)."""
    import eval.accuracy as accuracy
    from kvpop_jax.checkpoint import load_tokenizer

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    problem = "x3y5\nask x\n"
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem=problem, answer="3")) + "\n")
    with pytest.raises(ValueError, match=f"^chat_template: the tokenizer of {dense} has no chat template$"):
        run_accuracy(["dense"], {"dense": dense}, str(bench), out_dir=str(tmp_path / "none"), n_rollouts=1,
                     sampling=SamplingConfig.greedy(), chat_template=True)  # transformers' error was a paragraph
    tok = load_tokenizer(dense)
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}" \
                        "{% if add_generation_prompt %}a:{% endif %}"
    tok.save_pretrained(dense)
    seen = []

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, **kwargs):
        seen.append(np.asarray(prompt_ids).tolist())
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.full(prompt_ids.shape[0], 1)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    run_accuracy(["dense"], {"dense": dense}, str(bench), out_dir=str(tmp_path / "out"), n_rollouts=1,
                 compression_ratios=(0.5,), context_len=64, max_new_tokens=2, sampling=SamplingConfig.greedy(),
                 progress=False, compile_ahead=False, chat_template=True)
    text = f"u:{problem}{accuracy.CHAT_INSTRUCTION}\na:"
    want = load_tokenizer(dense)(text, add_special_tokens=False)["input_ids"]
    assert seen == [[want]]


def test_cli_generate_wraps_a_prompt_in_the_chat_template(tmp_path, capsys):
    """--chat_template: the prompt text as one user turn of the tokenizer's chat template, with the
    assistant's opening (as `accuracy --chat_template`, without its \\boxed{} instruction); refused with
    --prompt_ids (no text to wrap) and named for a tokenizer that has no template."""
    from eval.main import main
    from kvpop_jax.checkpoint import load_tokenizer

    dense, _ = _dense_checkpoint(tmp_path / "dense")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint", dense, "--prompt", "x3", "--chat_template"])
    assert exit_info.value.code == 2 and "has no chat template" in capsys.readouterr().err
    tok = load_tokenizer(dense)
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}" \
                        "{% if add_generation_prompt %}a:{% endif %}"
    tok.save_pretrained(dense)
    main(["generate", "--checkpoint", dense, "--prompt", "x3y5\nask x\n", "--chat_template", "--max_new_tokens", "2"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("prompt ids:"))
    assert json.loads(line.split(":", 1)[1]) == tok("u:x3y5\nask x\n\na:", add_special_tokens=False)["input_ids"]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint", dense, "--prompt_ids", "1,5", "--chat_template"])
    assert exit_info.value.code == 2 and "--chat_template needs --prompt or --prompt_file" in capsys.readouterr().err
    # a template that fails (its raise_exception; an attribute the sandbox refuses) was a traceback
    for template, why in (("{{ raise_exception('no system turn') }}", "TemplateError: no system turn"),
                          ("{{ messages.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'")):
        tok.chat_template = template
        tok.save_pretrained(dense)
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--checkpoint", dense, "--prompt", "x3", "--chat_template"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"chat template failed on the prompt ({why}" in err, err


def test_accuracy_help_shows_the_paper_defaults(capsys):
    """`accuracy --help` showed no default, though 16 sampled rollouts at T 0.6 and 4096 new tokens are what a
    command without those flags runs."""
    from eval.main import main

    with pytest.raises(SystemExit):
        main(["accuracy", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 16)", "(default: 0.6)", "(default: 16384)", "(default: 4096)", "(default: 0.95)"):
        assert shown in out, shown
    assert "default: None" not in out and "default: False" not in out


def test_budgets_run_at_each_memory_given_and_an_export_run_at_another_memory_is_named(tmp_path, monkeypatch,
                                                                                        capsys):
    """`budgets` runs each memory B itself (CR 1 - B / context_len); a {B: dir} map is keyed by budget. The Qwen3
    recipes train at memory 2309 / 4325 (Table 3's k plus the mLSTM state), which no CR gives at 16384 (CR 0.88: B
    1966), so their exports ran at 17% fewer long-range slots than trained without a word: such a run is named."""
    import eval.accuracy as accuracy
    from demo.tokenizer import save_tokenizer

    dense, base = _dense_checkpoint(tmp_path / "dense")
    kv_config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=2, window=4, topk=4))  # memory 10 (MLP: no state)
    save_pretrained(kv_config, retrofit_params(kv_config, load_pretrained(dense)[1], jax.random.key(1)),
                    tmp_path / "kvpop")
    save_tokenizer(tmp_path / "kvpop")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(dict(problem="x3y5\nask x\n", answer="3")) + "\n")
    decoded = []

    def fake_generate(model, params, prompt_ids, *, max_new_tokens, cache, **kwargs):  # what runs, not its tokens
        kv = model.config.kvpop
        decoded.append(("kvpop", kv.sinks + kv.window + kv.topk) if kv is not None else (cache.method, cache.budget))
        return np.zeros((prompt_ids.shape[0], max_new_tokens), np.int32), np.full(prompt_ids.shape[0], max_new_tokens)

    monkeypatch.setattr(accuracy, "generate", fake_generate)
    kw = dict(n_rollouts=1, context_len=20, max_new_tokens=3, sampling=SamplingConfig.greedy(), progress=False,
              compile_ahead=False)
    checkpoints = {"dense": dense, "kvpop-mlp": str(tmp_path / "kvpop")}
    rows = run_accuracy(["tova", "kvpop-mlp"], checkpoints, str(bench), out_dir=str(tmp_path / "b"), budgets=(10, 12),
                        **kw)
    assert [(r["method"], r["budget"]) for r in rows] == [("tova", 10), ("tova", 12), ("kvpop-mlp", 10),
                                                          ("kvpop-mlp", 12)]
    assert [r["cr"] for r in rows] == [0.5, 1 - 12 / 20] * 2
    assert decoded == [("tova", 10), ("tova", 12), ("kvpop", 10), ("kvpop", 12)]
    note = (f"kvpop-mlp ({tmp_path / 'kvpop'}) was trained at memory B 10 per KV head (2 + 4 + 4 slots) and runs "
            "at B 12 at CR 40% (k 4 -> 6); --budgets 10 runs it as trained")
    err = capsys.readouterr().err
    assert f"note: {note}" in err and "B 10 at CR" not in err  # at its own memory: nothing to say
    assert f"Note: {note}." in (tmp_path / "b" / "accuracy.md").read_text()
    assert json.loads((tmp_path / "b" / "accuracy.json").read_text())["retargeted"] == [note]
    # the same settings by CR: the same budgets
    decoded.clear()
    by_cr = run_accuracy(["tova", "kvpop-mlp"], checkpoints, str(bench), out_dir=str(tmp_path / "c"),
                         compression_ratios=(0.5, 0.4), **kw)
    assert [r["budget"] for r in by_cr] == [r["budget"] for r in rows] and decoded[2:] == [("kvpop", 10), ("kvpop", 12)]
    # a checkpoint per budget: NAME@B=DIR
    decoded.clear()
    export = tmp_path / "kvpop"
    per_b = {"dense": dense, **parse_checkpoints(f"kvpop-mlp@10={export},kvpop-mlp@12={export}")}
    run_accuracy(["kvpop-mlp"], per_b, str(bench), out_dir=str(tmp_path / "d"), budgets=(12, 10), **kw)
    assert decoded == [("kvpop", 12), ("kvpop", 10)]
    for kwargs, message in ((dict(budgets=(10,), compression_ratios=(0.5,)), "give compression_ratios or budgets, "
                                                                             "not both"),
                            (dict(budgets=(20,)), r"budgets must be ints in \[1, context_len 20\) .*got 20"),
                            (dict(budgets=(True,)), "budgets must be ints .*got True"),
                            (dict(budgets=(10.5,)), "budgets must be ints .*got 10.5")):
        with pytest.raises(ValueError, match=message):
            run_accuracy(["kvpop-mlp"], checkpoints, str(bench), out_dir=str(tmp_path / "e"), **kwargs, **kw)
    with pytest.raises(ValueError, match=r"checkpoint kvpop-mlp@12: no budget 12 in this run \(budgets 10\)"):
        run_accuracy(["kvpop-mlp"], per_b, str(bench), out_dir=str(tmp_path / "e"), budgets=(10,), **kw)
    with pytest.raises(ValueError, match=r"checkpoint kvpop-mlp@10: a checkpoint per budget \(NAME@B=DIR\) needs "
                                         "--budgets"):
        run_accuracy(["kvpop-mlp"], per_b, str(bench), out_dir=str(tmp_path / "e"), compression_ratios=(0.5,), **kw)
    # a key for no setting of the run, two keys for one, a setting without a key: each named (the first two were
    # dropped silently, the last named "CR 0.4: [0.5]"), and advice in the run's own terms
    per_cr = {"dense": dense, "kvpop-mlp": {0.5: str(export), 0.25: str(export)}}
    capsys.readouterr()
    for checkpoints_, kwargs, message in (
            (per_cr, dict(compression_ratios=(0.5,)), r"checkpoint kvpop-mlp@0.25: no CR 0.25 in this run "
                                                      r"\(compression ratios 0.5\)"),
            ({"dense": dense, **parse_checkpoints(f"kvpop-mlp@0.5={export},kvpop-mlp@10={export}")},
             dict(budgets=(10,)), r"checkpoints kvpop-mlp@0.5 and kvpop-mlp@10 are both for one setting of this run "
                                  r"\(budgets 10\): give one"),
            ({"dense": dense, **parse_checkpoints(f"kvpop-mlp@10={export}")}, dict(budgets=(10, 12)),
             r"no checkpoint for 'kvpop-mlp' at B 12: given kvpop-mlp@10$"),
            (checkpoints, dict(budgets=(19,)), r"^budget 19 is not below the longest prompt plus max_new_tokens "
                                               r"\(\d+ tokens\): nothing would be evicted; give budgets below \d+$")):
        with pytest.raises(ValueError, match=message):
            run_accuracy(["kvpop-mlp"], checkpoints_, str(bench), out_dir=str(tmp_path / "e"), **kwargs, **kw)
    assert "note:" not in capsys.readouterr().err  # B 19 was noted as a retarget, then refused
    swapped = {"dense": dense, **parse_checkpoints(f"kvpop-mlp@12={export}")}
    run_accuracy(["kvpop-mlp"], swapped, str(bench), out_dir=str(tmp_path / "f"), budgets=(12,), **kw)
    assert f"; kvpop-mlp@10={export} under --budgets with 10 runs it as trained" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() or not (tmp_path / "e" / "accuracy.md").exists()


def test_accuracy_command_samples_as_the_paper_by_default(tmp_path, monkeypatch):
    """DESIGN (evaluation): pass@1 over 16 rollouts at temperature 0.6, top-p 0.95, top-k 20, min-p 0 unless told
    otherwise: what `eval.main accuracy` hands `run_accuracy` when no flag names them."""
    import eval.main as eval_main

    class Stop(Exception):
        pass

    seen = {}

    def fake_run(methods, checkpoints, benchmarks, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(eval_main, "run_accuracy", fake_run)
    with pytest.raises(Stop):
        eval_main.cmd_accuracy(["--checkpoints", f"dense={tmp_path}", "--benchmark", "demo:reuse",
                                "--out_dir", str(tmp_path / "out")])
    assert seen["n_rollouts"] == 16
    assert dataclasses.astuple(seen["sampling"]) == (0.6, 0.95, 20, 0.0)
