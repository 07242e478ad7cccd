"""`eval.main bench {kernels,decode,train,gpu}`: what used to fail only after the timing (an unwritable or
non-markdown results file), in a traceback (S <= 0) or in a table of error cells (--iters 0) is refused
by name before any work, and a results file that is not markdown is left as it was."""

import shlex

import pytest

from eval import bench_decode, bench_gpu, bench_kernels, bench_train
from eval.main import main as eval_main

SMALL = ["--num_q_heads", "2", "--num_kv_heads", "1", "--head_dim", "8", "--window", "16"]


@pytest.fixture
def no_timing(monkeypatch):
    def timed(*args, **kwargs):
        raise AssertionError("timed something before the arguments were checked")

    monkeypatch.setattr(bench_kernels, "_time_call", timed)
    monkeypatch.setattr(bench_decode, "_models", timed)
    monkeypatch.setattr(bench_train, "time_train_steps", timed)
    monkeypatch.setattr(bench_gpu, "STAGE_FNS", {name: timed for name in bench_gpu.STAGE_FNS})


def _refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        eval_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_bench_kernels_refuses_bad_settings_and_results_files_before_timing(no_timing, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text("{}\n")
    base = ["bench", "kernels", "--seq_lens", "64", "--budgets", "40", *SMALL]
    for extra, message in (
        (["--iters", "0", "--out_md", ""], "--iters must be >= 1, got 0"),
        (["--seq_lens", "-64", "--out_md", ""], "--seq_lens must be positive ints"),
        (["--budgets", "400", "--out_md", ""], "--budgets 400 exceeds S = 64: a budget past the sequence"),
        (["--num_kv_heads", "3", "--out_md", ""], "--num_q_heads 2 must be a multiple of --num_kv_heads 3"),
        (["--out_md", str(tmp_path)], f"--out_md={tmp_path} is a folder, not a file"),
        (["--out_md", str(config)], f"--out_md={config} is not a markdown file"),
    ):
        _refused(base + extra, message, capsys)
    assert config.read_text() == "{}\n"
    with pytest.raises(ValueError, match=r"--seq_lens must be positive ints, got \[-64\]"):  # the API, unparsed
        bench_kernels.run_bench_kernels((-64,), (40,), out_md=None, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                        window=16)


def test_bench_kernels_appends_into_a_new_folder_and_after_an_unterminated_line(monkeypatch, tmp_path):
    """--out_md in a folder not made yet is created (it was a FileNotFoundError after the timing)."""
    monkeypatch.setattr(bench_kernels, "_time_call", lambda *args, **kwargs: 1.0)
    out = tmp_path / "new" / "BENCH.md"
    bench_kernels.run_bench_kernels((64,), (40,), out_md=str(out), num_q_heads=2, num_kv_heads=1, head_dim=8,
                                    window=16, iters=1, warmup=1, command="test")
    out.write_text(out.read_text() + "last line")
    bench_kernels.run_bench_kernels((64,), (40,), out_md=str(out), num_q_heads=2, num_kv_heads=1, head_dim=8,
                                    window=16, iters=1, warmup=1, command="test")
    text = out.read_text()
    assert text.startswith("# Benchmarks\n") and text.count("\n## Kernel benchmark, ") == 2
    assert "last line\n\n## Kernel benchmark, " in text


def test_bench_decode_train_gpu_check_benchmarks_md_before_timing(no_timing, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text("{}\n")
    for argv in (["bench", "decode", "--lengths", "64", "--out_dir", str(tmp_path / "d")],
                 ["bench", "train", "--dry", "--out_dir", str(tmp_path / "t")],
                 ["bench", "gpu", "--dry", "--out_dir", str(tmp_path / "g")]):
        _refused(argv + ["--benchmarks_md", str(tmp_path)], f"--benchmarks_md={tmp_path} is a folder", capsys)
        _refused(argv + ["--benchmarks_md", str(config)], f"--benchmarks_md={config} is not a markdown file", capsys)
    assert config.read_text() == "{}\n"


def test_bench_kernels_reads_lengths_as_decode_and_train_do(monkeypatch, capsys):
    """--seq_lens 1k (bench decode / train's format) was an argparse 'invalid _ints value' error."""
    got = {}
    monkeypatch.setattr(bench_kernels, "run_bench_kernels", lambda **kw: got.update(kw))
    eval_main(["bench", "kernels", "--seq_lens", "1k,2048", "--budgets", "0.5k", "--out_md", ""])
    assert got["seq_lens"] == (1024, 2048) and got["budgets"] == (512,) and got["out_md"] is None
    eval_main(["bench", "kernels"])
    assert got["seq_lens"] is None and got["budgets"] is None and got["out_md"] == "BENCHMARKS.md"
    _refused(["bench", "kernels", "--seq_lens", "1k,abc"], "--seq_lens must be positive ints like '1k,2k,4096', "
             "got '1k,abc'", capsys)


def test_bench_train_names_kl_topk_and_num_query_samples(no_timing, tmp_path, capsys):
    """They surfaced from the library mid-run as 'k must be in [1, vocab=64]' / 'batch and num must be >= 1'."""
    base = ["bench", "train", "--seq_lens", "64", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv_heads",
            "1", "--head_dim", "16", "--vocab", "64", "--sinks", "2", "--window", "8", "--topk", "8",
            "--out_dir", str(tmp_path), "--benchmarks_md", ""]
    _refused(base + ["--kl_topk", "-1"], "need 1 <= --kl_topk <= vocab 64 and --num_query_samples >= 1; got -1, 256",
             capsys)
    _refused(base + ["--num_query_samples", "0"], "got 256, 0", capsys)


def test_parse_lengths_refuses_infinite_lengths_by_name():
    """'infk' was an OverflowError traceback (int of float('inf') * 1024), not the flag's error."""
    for text in ("infk", "1e400k", "nank"):
        with pytest.raises(ValueError, match=f"--lengths must be positive ints like '1k,2k,4096', got '{text}'"):
            bench_decode.parse_lengths(text)


@pytest.mark.parametrize("bench", ["kernels", "decode", "train", "gpu"])
def test_help_and_errors_name_the_command_to_run(bench, capsys):
    """Each bench's usage line is the command a user types (decode and train printed `usage: main.py`)."""
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["bench", bench, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: python -m eval.main bench {bench} [-h]" in capsys.readouterr().out


@pytest.mark.parametrize("bench,runner,flags", [
    ("kernels", (bench_kernels, "run_bench_kernels"), ["--seq_lens", "1k", "--out_md", ""]),
    ("decode", (bench_decode, "run_bench_decode"), ["--lengths", "64,128", "--steps", "2", "--benchmarks_md", ""]),
    ("train", (bench_train, "run_bench_train"), ["--dry", "--variants", "kvpop-mlp", "--benchmarks_md", ""]),
    ("gpu", (bench_gpu, "run_bench_gpu"), ["--dry", "--stages", "kernels", "--benchmarks_md", "my notes.md"]),
])
def test_the_recorded_command_is_the_one_given(bench, runner, flags, monkeypatch):
    """An in-process call (a notebook, pytest) recorded the host process's argv as the benchmark's command
    (decode, kernels and gpu read sys.argv; train alone used the flags it was given)."""
    got = {}
    monkeypatch.setattr(*runner, lambda *args, **kw: got.update(kw) or [])
    monkeypatch.setattr("sys.argv", ["/usr/bin/pytest", "-k", "something else"])
    eval_main(["bench", bench, *flags])
    assert got["command"] == f"python -m eval.main bench {bench} " + shlex.join(flags)
