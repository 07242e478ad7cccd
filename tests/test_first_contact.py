"""First-contact commands of a GPU user: `train.main --dry_run` and `train.throughput` on the shipped flagfiles."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DRY = ["--init_checkpoint=random:tiny", "--dry_run", "--seq_len=256", "--sinks=4", "--window=32", "--topk=64",
            "--global_batch=2", "--steps=2", "--warmup_steps=1", "--kl_topk=32"]


def _interrupted_once_compiling(argv) -> str:
    """Runs `argv` (a CPU run) and sends one SIGINT a second after its backend line (flags checked, about to
    compile); asserts that the signal ended it at once and returns its stderr."""
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("jax ")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, (proc.returncode, out, err)
    return err


def test_ctrl_c_stops_a_dry_run_at_once_and_promises_no_resume(tmp_path):
    """A dry run writes nothing: one Ctrl-C ends it, also inside the compile (Python defers a handler until XLA
    returns, minutes for Qwen3-8B, and jax's GC callback can swallow the KeyboardInterrupt)."""
    err = _interrupted_once_compiling([sys.executable, "-m", "train.main", f"--run_dir={tmp_path / 'run'}", *TINY_DRY])
    assert "resume" not in err and not (tmp_path / "run").exists()


@pytest.mark.long  # a whole run in a subprocess at XLA's defaults: ~30 s on 2 cores
def test_a_cpu_dry_run_says_its_bytes_are_for_this_machines_mesh_not_a_gpu_nodes(tmp_path):
    """On a 1-CPU login node the paper recipe's dry run printed 226 GiB "per-device" for one device holding all
    8 rows of the micro-batch and the whole model, with nothing saying so or how to see an 8-GPU node."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", "train.main", f"--run_dir={tmp_path / 'run'}", *TINY_DRY],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "mesh of 1 device(s), each holding 2 of the micro-batch's 2 rows" in proc.stdout
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in proc.stdout


def test_a_dry_run_names_an_init_checkpoint_the_training_would_stop_on(tmp_path, monkeypatch, capsys):
    """The dry run compiles from the architecture alone, so a missing, truncated or partial --init_checkpoint
    went unmentioned until the training, after its data was prepared (a note, not an error: --model_config
    is all a dry run needs)."""
    import jax

    from kvpop_jax import modeling, save_pretrained
    from kvpop_jax.config import Qwen3Config
    from train import dry_run as dry

    class Compiling(Exception):
        pass

    def compiling(*args, **kw):
        raise Compiling

    def dry_run_notes(argv) -> str:
        cfg = _config(argv)
        capsys.readouterr()  # the flags' own notes
        with pytest.raises(Compiling):
            dry.dry_run(cfg)
        return capsys.readouterr().err

    monkeypatch.setattr(dry, "jitted_step", compiling)
    init = str(tmp_path / "init")
    config = Qwen3Config.from_hf(os.path.join(REPO, "configs", "models", "tiny.json"))
    save_pretrained(config, modeling.init_params(config, jax.random.PRNGKey(0)), init)
    flags = [a for a in TINY_DRY if not a.startswith("--init_checkpoint")]
    flags += ["--model_config=tiny", "--num_query_samples=64"]
    argv = [*flags, f"--run_dir={tmp_path / 'run'}", f"--init_checkpoint={init}"]
    assert dry_run_notes(argv) == ""  # whole: nothing to say
    weights = os.path.join(init, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    for where in (init, str(tmp_path / "not_downloaded")):
        argv[-1] = f"--init_checkpoint={where}"
        err = dry_run_notes(argv)
        assert err.startswith(f"note: --init_checkpoint={where}: ") and err.endswith(
            "This dry run needs only the architecture; the training would stop here\n"), err
        assert ("model.safetensors" if where == init else "does not exist") in err


def _config(argv):
    from absl import flags

    from train.configure import config_from_flags
    from train.flags import define_flags

    fv = flags.FlagValues()
    define_flags(fv)
    fv(["train", *argv])
    return config_from_flags(fv, on_accelerator=True)


def test_a_negative_steps_override_of_a_recipe_names_steps_not_warmup(tmp_path):
    from train.config import FlagError

    recipe = ["--flagfile=configs/qwen3_8b_cr88.flags", f"--run_dir={tmp_path / 'run'}", "--dry_run"]
    for steps in ("-5", "0"):
        with pytest.raises(FlagError, match=f"^--steps must be >= 1, got {steps}$"):
            _config([*recipe, f"--steps={steps}"])


def test_a_few_documents_under_many_steps_are_named_as_repeated_passes(tmp_path, capsys):
    """A sample file under a paper recipe trained silently on the same few documents over and over."""
    from train.setup import prepare_data, run_tokenizer

    data = tmp_path / "sample.jsonl"
    data.write_text('{"text": "a short document"}\n{"text": "another one"}\n')
    cfg = _config(["--init_checkpoint=random:tiny", "--tokenizer=demo", f"--run_dir={tmp_path / 'run'}",
                   f"--data={data}", "--seq_len=256", "--sinks=4", "--window=32", "--topk=64", "--global_batch=2",
                   "--steps=50", "--warmup_steps=0", "--kl_topk=32"])
    tokenizer, _ = run_tokenizer(cfg, None)
    batches = prepare_data(cfg, tokenizer)
    err = capsys.readouterr().err
    assert f"the 2 kept documents hold {batches.num_tokens} tokens" in err
    assert f"read {50 * 2 * 256} token slots: about {50 * 2 * 256 / batches.num_tokens:.0f} passes" in err


def test_a_tensor_axis_that_does_not_divide_the_heads_is_refused_by_flag(tmp_path):
    """tiny has 4 query and 2 KV heads: --mesh_tensor=4 compiled a step whose attention ran whole on every device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "train.main", f"--run_dir={tmp_path / 'run'}", *TINY_DRY,
                           "--mesh_fsdp=1", "--mesh_tensor=4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "error: --mesh_tensor=4 does not divide the model's num_key_value_heads=2" in proc.stderr


def test_a_recipe_run_from_outside_the_repo_root_says_where_nested_flagfiles_are_read(tmp_path):
    """configs/qwen3_8b_cr88.flags includes configs/paper_common.flags, a path absl reads from the working
    directory: from elsewhere the error named only that path (after a doubled 'error: ERROR::')."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "train.main", f"--flagfile={REPO}/configs/qwen3_8b_cr88.flags",
                           "--dry_run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: Unable to open flagfile") and "configs/paper_common.flags" in first
    assert f"working directory {tmp_path}: run from the repo root {REPO}" in first


def test_a_flagfile_that_is_not_utf8_is_named_in_one_line(tmp_path):
    """absl reads flagfiles as text; a binary one (or one saved as Latin-1) was a UnicodeDecodeError traceback."""
    (tmp_path / "inner.flags").write_bytes(b"--steps=3  # \xe9t\xe9\n")
    (tmp_path / "outer.flags").write_text(f"--flagfile={tmp_path / 'inner.flags'}\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "train.main", f"--flagfile={tmp_path / 'outer.flags'}", "--dry_run"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: the flagfile {tmp_path / 'inner.flags'} is not UTF-8 text ("), proc.stderr


def test_an_unknown_variant_is_named_once(tmp_path):
    from train.config import FlagError

    with pytest.raises(FlagError) as info:
        _config(["--flagfile=configs/qwen3_4b_cr88.flags", f"--run_dir={tmp_path / 'run'}", "--dry_run",
                 "--variants=kvpop-mlstm,foo"])
    assert str(info.value) == ("--variants=foo: unknown variant 'foo'; known: kvpop-mlstm, kvpop-mlp, streamingllm+, "
                               "kvpop-mlstm-max, dms")


def test_learning_rates_that_train_nothing_are_refused(tmp_path):
    """Every learning rate 0 (or the new ones 0 under --freeze_base) ran 2000 steps that changed nothing."""
    from train.config import FlagError

    recipe = ["--flagfile=configs/qwen3_8b_cr88.flags", f"--run_dir={tmp_path / 'run'}", "--dry_run",
              "--new_lr=0", "--new_lr_final=0"]
    for extra, base in ((["--base_lr=0"], "--base_lr=0"), (["--freeze_base"], "--freeze_base")):
        with pytest.raises(FlagError, match=f"^--new_lr=0 and --new_lr_final=0 with {base}: no parameter would "
                                            "change in 2000 steps"):
            _config([*recipe, *extra])
    assert _config(recipe).optim.base_lr == 8e-5  # the base weights still train: allowed


def test_bad_dms_overrides_of_a_dms_recipe_name_their_flags(tmp_path):
    from train.config import FlagError

    recipe = ["--flagfile=configs/dms_qwen3_4b_cr88.flags", f"--run_dir={tmp_path / 'run'}", "--dry_run"]
    with pytest.raises(FlagError, match=r"^DMS needs its window < its memory per KV head M < --seq_len=16384, got "
                                        r"window 5000 \(--dms_window, default --window\) and M = 2309 "):
        _config([*recipe, "--dms_window=5000"])
    for flag, value in (("dms_window", "0"), ("dms_ramp_fraction", "2"), ("dms_temperature", "0")):
        with pytest.raises(FlagError, match=f"^bad DMS flags: --{flag} must be"):
            _config([*recipe, f"--{flag}={value}"])


@pytest.mark.long  # a whole run in a subprocess at XLA's defaults: ~30 s on 2 cores
def test_ctrl_c_stops_a_throughput_run_at_once_and_a_json_out_lands_in_a_new_folder(tmp_path):
    """train.throughput writes nothing until its result: one Ctrl-C ends it, also inside the compile (it had no
    handling: Python waited for XLA). A --json_out in a folder that does not exist yet passed the up-front
    check and then failed with FileNotFoundError after the whole measurement; it is now written there."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    argv = [sys.executable, "-m", "train.throughput", f"--run_dir={tmp_path / 'run'}", *TINY_DRY[:1], *TINY_DRY[2:],
            "--timed_steps=1", "--num_layers=1", "--data=demo:1"]
    json_out = tmp_path / "new" / "folder" / "tp.json"
    _interrupted_once_compiling([*argv, f"--json_out={json_out}"])
    assert not json_out.exists() and not (tmp_path / "run").exists()
    done = subprocess.run([*argv, f"--json_out={json_out}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(json_out.read_text())["tokens_per_s"] > 0
