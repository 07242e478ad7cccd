"""train/throughput.py's FLOP count and peak table (its run is exercised by tests/test_bench_gpu.py)."""

import dataclasses

import pytest

from kvpop_jax.config import Qwen3Config
from train.config import resolve_model_config
from train.throughput import matmul_params, model_flops_per_token, peak_flops


def test_matmul_params_match_qwen3_8b():
    """Qwen3-8B: 6.95B non-embedding parameters (its model card) + the untied lm_head 151936 x 4096."""
    config = Qwen3Config.from_hf(resolve_model_config("qwen3_8b"))
    assert matmul_params(config) == pytest.approx(6.95e9 + 151936 * 4096, rel=0.01)
    four = dataclasses.replace(config, num_hidden_layers=4)
    assert matmul_params(four) == pytest.approx(4 / 36 * 6.95e9 + 151936 * 4096, rel=0.01)


def test_model_flops_per_token():
    config = Qwen3Config.from_hf(resolve_model_config("qwen3_8b"))
    n = matmul_params(config)
    attention = 8 * 36 * 32 * 128 * 16384  # 8·L·Hq·D·S
    assert model_flops_per_token(config, 16384) == pytest.approx(8 * n + attention)


def test_peak_flops_by_device_kind():
    assert peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_flops("cpu") is None


def _main(monkeypatch, argv):
    """train.throughput's main on its own FlagValues (the module's FLAGS stay undefined in tests)."""
    from absl import flags

    import train.throughput as tp

    fv = flags.FlagValues()
    tp.define_throughput_flags(fv)
    fv(["throughput", "--flagfile=configs/tiny_cpu.flags", "--data=demo:1", *argv])
    monkeypatch.setattr(tp, "FLAGS", fv)
    ran = []
    monkeypatch.setattr(tp, "measure_throughput", lambda cfg, **kw: ran.append(kw) or (_ for _ in ()).throw(
        SystemExit("measured")))
    with pytest.raises(SystemExit) as exit_info:
        tp.main(["throughput"])
    return exit_info.value.code, ran


def test_cli_refuses_what_it_cannot_do_before_any_work(monkeypatch, tmp_path, capsys):
    run = f"--run_dir={tmp_path / 'run'}"
    code, ran = _main(monkeypatch, [run, "--dry_run"])
    assert code == 2 and not ran and "--dry_run compiles without running a step" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    code, ran = _main(monkeypatch, [run, f"--json_out={tmp_path}"])
    assert code == 2 and not ran and f"--json_out={tmp_path} is a folder, not a file" in capsys.readouterr().err
    code, ran = _main(monkeypatch, [run, f"--json_out={tmp_path / 'file' / 'x.json'}"])
    assert code == 2 and not ran and "lies under the file" in capsys.readouterr().err
    # the recipe's variants and evaluation are named as unused; the run itself goes ahead
    code, ran = _main(monkeypatch, [run, f"--json_out={tmp_path / 'new' / 'r.json'}", "--timed_steps=2"])
    err = capsys.readouterr().err
    assert code == "measured" and ran == [dict(num_layers=0, timed_steps=2, profile_dir=None)]
    assert "note: train.throughput times one train step of the flags' own retrofit (kvpop, scorer mlstm, k 70); " \
           "--variants, --eval_methods and what they imply are not used here" in err


def test_step_counts_and_depth_are_checked():
    from train.config import FlagError
    from train.throughput import measure_throughput
    from helpers import parse

    cfg = parse(["--flagfile=configs/tiny_cpu.flags", "--data=demo:1", "--variants=", "--eval_methods="])
    with pytest.raises(FlagError, match=r"--timed_steps must be >= 1 .* got 0"):
        measure_throughput(cfg, timed_steps=0)
    for layers in (-1, 3):
        with pytest.raises(FlagError, match=rf"--num_layers must be in \[0, 2\] .* got {layers}"):
            measure_throughput(cfg, num_layers=layers)


def test_a_recipe_without_its_weights_is_pointed_at_its_random_architecture_and_stray_words_are_one_line(
        monkeypatch, tmp_path, capsys):
    """The shipped 8B recipe names checkpoints/Qwen3-8B; train.throughput times a random model anyway, and the
    old hint (from train.main) said random:tiny, a 2-layer toy, instead of the recipe's own architecture."""
    from absl import flags

    import train.throughput as tp

    fv = flags.FlagValues()
    tp.define_throughput_flags(fv)
    fv(["throughput", "--flagfile=configs/qwen3_8b_cr88.flags", f"--run_dir={tmp_path / 'run'}",
        f"--init_checkpoint={tmp_path / 'Qwen3-8B'}"])
    monkeypatch.setattr(tp, "FLAGS", fv)
    monkeypatch.setattr(tp, "measure_throughput", lambda cfg, **kw: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_info:
        tp.main(["throughput"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "pass --init_checkpoint=random:qwen3_8b" in err
    with pytest.raises(SystemExit) as exit_info:
        tp.main(["throughput", "qwen3_8b"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: unexpected arguments ['qwen3_8b']")
    assert len(err.splitlines()) == 1


def test_a_gpu_recipe_timed_on_a_cpu_warns_as_train_main_does(monkeypatch, tmp_path, capsys):
    """A GPU node with the CPU build of jax timed the 8B recipe's step on the CPU without a word."""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the warning is for a CPU")
    code, ran = _main(monkeypatch, [f"--run_dir={tmp_path / 'run'}", "--compute_dtype=bfloat16"])
    assert code == "measured" and ran
    assert "WARNING: this throughput run is GPU work (bfloat16 compute)" in capsys.readouterr().err
