"""The training job: flags -> configs, optimizer groups, chunked KL, checkpoint/resume after a
kill (subprocesses), export, NaN abort."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags

from helpers import REPO, TINY_ARCH, parse, tiny_flags, train_cmd, train_env
from train import optim
from train import step as st
from train.config import FlagError, OptimConfig, check_devices, load_model_config
from train.configure import config_from_flags
from train.flags import define_flags
from train.loop import DivergenceError, DivergenceGuard, NonFiniteLossError, check_finite, host_batch, train
from train.teacher_cache import write_teacher_topk

# ------------------------------------------------------------------------------ flags


def test_flags_map_onto_configs(tmp_path, arch):
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch))
    assert cfg.kvpop.budget == 36 and cfg.kvpop.scorer == "mlp"
    assert cfg.grad_accum == 2 and cfg.data.batch_size == 4 and cfg.data.seq_len == 128
    assert cfg.data.data.endswith("data/demo_train_read_once_24x256_seed0.jsonl") and cfg.demo_examples == 24
    # generated data cached in the run folder is keyed on what it depends on: a change regenerates it
    assert parse(tiny_flags(str(tmp_path / "run"), arch, demo_seq_len=384)).data.data.endswith("_24x384_seed0.jsonl")
    assert cfg.optim.base_lr == 8e-5 and cfg.optim.new_lr == 1e-3 and cfg.optim.b2 == 0.95
    assert parse(tiny_flags(str(tmp_path / "run"), arch, compute_dtype="auto"), on_accelerator=True).compute_dtype \
        == "bfloat16"
    json.dumps(cfg.to_json(), default=str)


@pytest.mark.parametrize("overrides, message", [
    (dict(topk=200), "must exceed the KVpop budget"),
    (dict(seq_len=36), "must exceed the KVpop budget"),
    (dict(global_batch=6, micro_batch=4), "not divisible by --micro_batch"),
    (dict(micro_batch=0), "--global_batch and --micro_batch must be >= 1, got 4, 0"),
    (dict(data="/nonexistent/data.jsonl"), "--data"),
    (dict(data="demo:0"), "demo:N"),
    (dict(init_checkpoint="/nonexistent/ckpt"), "--init_checkpoint"),
    (dict(init_checkpoint="random:no_such_model"), "not found"),
    (dict(loss_chunk=100), "--loss_chunk"),
    (dict(gamma_min=0.9999999), "gamma_min"),
    (dict(steps=0), "--steps"),
    # cadence flags a resume may lower: the bad one named with its value
    (dict(keep_checkpoints=0), "--keep_checkpoints must be >= 1, got 0"),
    (dict(checkpoint_every=-2), "--checkpoint_every must be >= 1, got -2"),
    (dict(log_every=0, keep_checkpoints=0), "--keep_checkpoints must be >= 1, got 0; --log_every must be >= 1, got 0"),
    (dict(warmup_steps=41), "--warmup_steps=41 exceeds --steps=40: the learning rates would never reach their peak"),
    (dict(warmup_steps=None, steps=50), r"--warmup_steps=100 \(its default\) exceeds --steps=50"),
    # issue 13: every float flag is finite (NaN slips through `< 0`, inf through `> 0`), named
    (dict(base_lr="nan"), "--base_lr=nan is not a finite number"),
    (dict(new_lr="inf"), "--new_lr=inf is not a finite number"),
    (dict(kl_temperature="inf"), "--kl_temperature=inf is not a finite number"),
    (dict(loss_temperature="-inf"), "--loss_temperature=-inf is not a finite number"),
    (dict(retention_loss_weight="nan"), "--retention_loss_weight=nan is not a finite number"),
    (dict(gamma_min="nan"), "--gamma_min=nan is not a finite number"),
    (dict(adam_eps="nan"), "--adam_eps=nan is not a finite number"),
    (dict(divergence_factor="inf"), "--divergence_factor=inf is not a finite number"),
    (dict(retention_loss_weight=-1), "--retention_loss_weight must be >= 0, got -1.0"),
    (dict(weight_decay=-0.1), "--weight_decay must be a finite number >= 0"),
    (dict(divergence_factor=0.5), "--divergence_factor must be 0 \\(off\\) or > 1"),
    # a bare ValueError from the demo generator, and an OverflowError from jax.random.PRNGKey, at the first step
    (dict(seed=2**32), r"--data=demo:24: the demo generator takes --seed in \[0, 2\*\*32\), got 4294967296"),
    (dict(seed=2**70), r"--seed must be in \[0, 2\*\*63\), got 1180591620717411303424"),
])
def test_bad_flags_raise_clear_errors(tmp_path, arch, overrides, message):
    with pytest.raises(FlagError, match=message.replace("-", r"\-")):
        parse(tiny_flags(str(tmp_path / "run"), arch, **overrides))


def test_an_init_checkpoint_that_is_a_file_is_named(tmp_path, arch):
    """--init_checkpoint=CKPT/config.json read CKPT/config.json/config.json and said no config.json is there."""
    with pytest.raises(FlagError, match=r"--init_checkpoint=.*tiny_arch.json is a file; pass the folder that holds"):
        parse(tiny_flags(str(tmp_path / "run"), arch, init_checkpoint=arch))
    with pytest.raises(FlagError, match=r"--init_checkpoint=.*tiny_arch.json is a file; pass the folder that holds"):
        parse(tiny_flags(str(tmp_path / "run"), arch, init_checkpoint=arch, dry_run=True))  # read X/config.json/...


def test_export_dir_may_not_be_or_lie_inside_the_init_checkpoint(tmp_path, arch):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(open(arch).read())
    for export_dir in (teacher, teacher / "export", str(teacher) + "/"):
        with pytest.raises(FlagError, match="--export_dir=.* is the run's --init_checkpoint=.* or inside it"):
            parse(tiny_flags(str(tmp_path / "run"), arch, init_checkpoint=str(teacher), export_dir=export_dir))
    parse(tiny_flags(str(tmp_path / "run"), arch, init_checkpoint=str(teacher), export_dir=str(teacher) + "-kvpop"))
    # nor inside the run's checkpoint folder, whose clean-up deletes old steps with whatever is in them
    for export_dir in (tmp_path / "run" / "checkpoints", tmp_path / "run" / "checkpoints" / "4"):
        with pytest.raises(FlagError, match="--export_dir=.* is inside the run's checkpoint folder"):
            parse(tiny_flags(str(tmp_path / "run"), arch, export_dir=str(export_dir)))
    parse(tiny_flags(str(tmp_path / "run"), arch, export_dir=str(tmp_path / "run" / "checkpoints-export")))
    # a random: model is built in RUN_DIR/init: an export there replaced it, and every resume was then refused
    for export_dir in (tmp_path / "run" / "init", tmp_path / "run" / "init" / "x", tmp_path / "link"):
        if export_dir.name == "link":
            os.symlink(tmp_path / "run" / "init", export_dir)
        with pytest.raises(FlagError, match=rf"--export_dir={export_dir} is the folder {tmp_path}/run/init the run's "
                                            r"--init_checkpoint=random:.* is built in, or inside it"):
            parse(tiny_flags(str(tmp_path / "run"), arch, export_dir=str(export_dir)))
    parse(tiny_flags(str(tmp_path / "run"), arch, export_dir=str(tmp_path / "run" / "init-export")))


def test_quick_refuses_an_explicit_export_dir(tmp_path, arch):
    """--quick trains into RUN_DIR-quick so that a full run is never resumed from or into it, but an explicit
    --export_dir was kept: the quick run's rough export silently replaced the full run's there."""
    export = str(tmp_path / "exports" / "model")
    with pytest.raises(FlagError, match=f"--export_dir={export} with --quick: .*RUN_DIR-quick/export"):
        parse(tiny_flags(str(tmp_path / "run"), arch, quick=True, export_dir=export))
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch, quick=True))
    assert cfg.export_dir == str(tmp_path / "run-quick" / "export")
    parse(tiny_flags(str(tmp_path / "run"), arch, quick=True, export_dir=export, export=False))  # nothing exported


def test_quick_names_its_run_dir_after_the_folder(tmp_path, arch, monkeypatch):
    """--run_dir=. --quick trained into a hidden '.-quick' in the working folder (and runs/x/./ into runs/x/.-quick),
    not beside the folder as RUN_DIR-quick."""
    (tmp_path / "work" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "sub")
    for run_dir, want in ((".", str(tmp_path / "work" / "sub-quick")), ("..", str(tmp_path / "work-quick")),
                          ("runs/x/./", "runs/x-quick"), ("runs/x//", "runs/x-quick")):
        assert parse(tiny_flags(run_dir, arch, quick=True)).run_dir == want, run_dir


def _step_4_checkpointer(meta):
    """A stand-in for train.checkpointing.Checkpointer over a run whose last step is 4: its meta is `meta`
    (None: reading it fails the test), and reading its parameters always fails the test (the --out checks
    come first)."""

    class FakeCheckpointer:
        def __init__(self, directory, read_only=False):
            pass

        def latest_step(self):
            return 4

        def all_steps(self):
            return [4]

        def restore_meta(self, step):
            if meta is None:
                raise AssertionError("the checkpoint was read before the --out check")
            return meta

        def restore_params(self, step, target):
            raise AssertionError("the parameters were read before the --out check")

        def close(self):
            pass

    return FakeCheckpointer


def test_train_export_may_not_overwrite_the_init_checkpoint_or_land_in_the_checkpoints(tmp_path, arch, monkeypatch):
    """train.export wrote wherever --out said: over the base model the run started from (its weights, which
    the run changed, lost) or inside the checkpoint folder that the run's clean-up deletes. Refused before
    any parameter is read, as train.main's --export_dir."""
    from train import checkpointing, export

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(open(arch).read())
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)

    meta = {"model_config": json.loads(open(arch).read()), "train_config": {"init_checkpoint": str(teacher)}}
    monkeypatch.setattr(checkpointing, "Checkpointer", _step_4_checkpointer(meta=meta))
    for out in (teacher, teacher / "sub"):
        with pytest.raises(ValueError, match="--out=.* is the run's --init_checkpoint=.* or inside it"):
            export.export_checkpoint(str(run), str(out))
    with pytest.raises(ValueError, match="--out=.* lies inside the checkpoints folder"):
        export.export_checkpoint(str(run / "checkpoints" / "4"), str(run / "checkpoints" / "export"))
    assert sorted(os.listdir(teacher)) == ["config.json"]


def test_a_demo_trace_length_too_short_for_a_task_is_a_flag_error(tmp_path):
    with pytest.raises(FlagError, match=r"--demo_seq_len=256: .*too short.*: the shortest seq_len for task "
                                        r"'reuse', difficulty 'medium' is 959$"):
        parse(["--flagfile=configs/tiny_cpu.flags", f"--run_dir={tmp_path / 'run'}", "--demo_seq_len=256"])


def test_an_init_checkpoint_without_tokenizer_files_is_named(tmp_path, arch):
    """Not an empty tokenizer built from config.json that leaves no document to train on."""
    from train.setup import run_tokenizer

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(open(arch).read())
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch, init_checkpoint=str(teacher), tokenizer=""))
    with pytest.raises(FlagError, match=r"--tokenizer: no tokenizer in .*teacher: none of .* \(pass --tokenizer=DIR"):
        run_tokenizer(cfg, str(teacher))


def test_a_demo_tokenizer_save_cut_short_leaves_no_folder_a_rerun_takes_for_whole(tmp_path, arch, monkeypatch):
    """RUN_DIR/tokenizer is staged: a kill between its files (here: while the config is rewritten) left a
    tokenizer.json beside an empty tokenizer_config.json, which every rerun then failed to load."""
    import demo.tokenizer
    from train.setup import run_tokenizer

    class Cut(Exception):
        pass

    def cut(*args, **kwargs):
        raise Cut

    cfg = parse(tiny_flags(str(tmp_path / "run"), arch))
    with monkeypatch.context() as m:
        m.setattr(demo.tokenizer.json, "dump", cut)
        with pytest.raises(Cut):
            run_tokenizer(cfg, None)
    assert not os.path.exists(tmp_path / "run" / "tokenizer")
    tokenizer, path = run_tokenizer(cfg, None)
    assert len(tokenizer) > 0 and path == str(tmp_path / "run" / "tokenizer")
    with open(tmp_path / "run" / "tokenizer" / "tokenizer_config.json") as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert os.listdir(tmp_path / "run") == ["tokenizer"]  # no temporary left beside it


def test_output_folders_that_cannot_be_written_are_refused_before_any_work(tmp_path, arch, monkeypatch):
    """Not a traceback from os.makedirs in the lock, or from the export after the whole run trained."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    locked = tmp_path / "locked"  # read-only; faked, since root (as here and in CI) writes anywhere
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != str(locked) and real_access(p, mode))
    for overrides, message in [
            (dict(run_dir=str(a_file)), f"--run_dir={a_file} is a file, not a folder"),
            (dict(run_dir=str(a_file / "run")), f"--run_dir={a_file}/run lies under the file {a_file}"),
            (dict(run_dir=str(locked / "run")), f"--run_dir={locked}/run: the folder {locked} is not writable"),
            (dict(export_dir=str(a_file)), f"--export_dir={a_file} is a file, not a folder"),
            (dict(export_dir=str(a_file / "x" / "y")), f"lies under the file {a_file}"),
            (dict(export_dir=str(locked / "e")), f"the folder {locked} is not writable"),
            (dict(variants="kvpop-mlp", export_dir=str(tmp_path / "e")), "--export_dir=.* with --variants")]:
        with pytest.raises(FlagError, match=message):
            parse(tiny_flags(overrides.pop("run_dir", str(tmp_path / "run")), arch, **overrides))
    parse(tiny_flags(str(tmp_path / "new" / "deeper" / "run"), arch))  # a folder still to be made is fine


def test_removed_reset_attention_flag_is_rejected_by_name(tmp_path, arch):
    """KVpop attention cannot reset at packing boundaries, so the flag is gone (it always raised)."""
    with pytest.raises(flags.UnrecognizedFlagError, match="reset_attention"):
        parse(tiny_flags(str(tmp_path / "run"), arch, reset_attention=True))


def test_unknown_scorer_is_rejected_at_parse_time(tmp_path, arch):
    with pytest.raises(flags.IllegalFlagValueError, match="scorer"):
        parse(tiny_flags(str(tmp_path / "run"), arch, scorer="transformer"))


def test_batch_must_divide_over_data_parallel_devices(tmp_path, arch):
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch))
    check_devices(cfg, 2, {"data": 1, "fsdp": 2, "tensor": 1})
    with pytest.raises(FlagError, match="not divisible by the 4 data-parallel devices"):
        check_devices(cfg, 8, {"data": 2, "fsdp": 2, "tensor": 2})
    # a resume on fewer devices keeps --micro_batch (check_resume refuses another): say which mesh fits it
    with pytest.raises(FlagError, match=r"data x fsdp must divide 2.*--mesh_fsdp.*a resumed run keeps --micro_batch"):
        check_devices(cfg, 3, {"data": 1, "fsdp": 3, "tensor": 1})


def test_paper_recipes_parse(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # nested flagfile paths are relative to the working directory
    for name, topk, window in (("qwen3_4b_cr75", 4032, 256), ("qwen3_4b_cr88", 2016, 256),
                               ("qwen3_8b_cr75", 4032, 256), ("qwen3_8b_cr88", 2016, 256),
                               ("streamingllm_plus", 0, 2305)):
        fv = flags.FlagValues()
        define_flags(fv)
        fv(["train", f"--flagfile={REPO}/configs/{name}.flags", f"--run_dir={tmp_path}", "--dry_run"])
        cfg = config_from_flags(fv, on_accelerator=True)
        assert (cfg.kvpop.sinks, cfg.kvpop.window, cfg.kvpop.topk) == (4, window, topk), name
        assert cfg.seq_len == 16384 and cfg.global_batch == 128 and cfg.steps == 2000, name
        assert cfg.optim.weight_decay == 1e-4 and cfg.optim.clip_norm == 1.0 and cfg.kvpop.kl_topk == 256
        assert cfg.compute_dtype == "bfloat16" and cfg.teacher_dtype == "bfloat16"
        # §4: Qwen3-4B-Instruct-2507 (RoPE base 5e6, 256k context) and Qwen3-8B; the 4B recipes named the
        # original Qwen3-4B (RoPE base 1e6), whose checkpoint the paper did not retrofit
        model = "Qwen3-8B" if "8b" in name else "Qwen3-4B-Instruct-2507"
        assert cfg.init_checkpoint == f"checkpoints/{model}", name
        assert load_model_config(cfg).rope_theta == (1e6 if "8b" in name else 5e6), name
    # the original Qwen3-4B's checkpoint under a 4B recipe: which fields differ, and the flag that fits it
    original = tmp_path / "Qwen3-4B"
    original.mkdir()
    (original / "config.json").write_text(open(f"{REPO}/configs/models/qwen3_4b.json").read())
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["train", f"--flagfile={REPO}/configs/qwen3_4b_cr88.flags", f"--run_dir={tmp_path}/run", "--dry_run",
        f"--init_checkpoint={original}"])
    with pytest.raises(FlagError, match=r"qwen3_4b_instruct_2507.json and .*/Qwen3-4B/config.json describe different "
                                        r"architectures \(rope_theta: 5000000.0 and 1000000.0\): give the "
                                        r"--model_config of that checkpoint \(shipped: \[.*'qwen3_4b',"):
        load_model_config(config_from_flags(fv, on_accelerator=True))


def test_paper_recipes_follow_app_a_and_mlp_recipes_are_memory_matched(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)

    def recipe(name):
        fv = flags.FlagValues()
        define_flags(fv)
        fv(["train", f"--flagfile={REPO}/configs/{name}.flags", f"--run_dir={tmp_path}", "--dry_run"])
        return config_from_flags(fv, on_accelerator=True)

    for model in ("4b", "8b"):
        for cr in ("75", "88"):
            mlstm, mlp = recipe(f"qwen3_{model}_cr{cr}"), recipe(f"qwen3_{model}_cr{cr}_mlp")
            assert mlstm.head_dim == 128 and mlstm.kvpop.mlstm_features(128) == 128  # App. A: d = head_dim
            assert mlstm.kvpop.mlstm_value_dim(128) == 64 and mlstm.kvpop.mlstm_init == "identity"
            assert mlstm.data.split == "high_part00,high_part01,high_part02"
            assert mlp.kvpop.scorer == "mlp" and mlp.kvpop.topk == mlstm.kvpop.topk + 33
            assert mlp.kvpop.memory(128) == mlstm.kvpop.memory(128)
    # StreamingLLM+ gets the mLSTM state's 33 entries as window, as the --variants recipe does
    streaming, mlstm = recipe("streamingllm_plus"), recipe("qwen3_4b_cr88")
    assert streaming.kvpop.topk == 0 and streaming.kvpop.memory(128) == mlstm.kvpop.memory(128)


def test_dms_recipes_are_memory_matched_to_the_kvpop_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)

    def recipe(name):
        fv = flags.FlagValues()
        define_flags(fv)
        fv(["train", f"--flagfile={REPO}/configs/{name}.flags", f"--run_dir={tmp_path}", "--dry_run"])
        return config_from_flags(fv, on_accelerator=True)

    for model in ("4b", "8b"):
        for cr, target in (("75", 0.7477), ("88", 0.8727)):
            kvpop, dms = recipe(f"qwen3_{model}_cr{cr}"), recipe(f"dms_qwen3_{model}_cr{cr}")
            d = dms.dms
            assert dms.retrofit == "dms" and kvpop.retrofit == "kvpop"
            flagfile = open(f"{REPO}/configs/dms_qwen3_{model}_cr{cr}.flags").read()
            assert f"--run_dir=runs/dms_qwen3_{model}_cr{cr}\n" in flagfile  # (the parse overrides --run_dir)
            assert d.budget == kvpop.kvpop.memory(128) and d.window == 256 and d.target_eviction == pytest.approx(
                target, abs=1e-4)
            assert d.mean_occupancy(16384) == pytest.approx(d.budget)  # the mean occupancy at S is KVpop's memory
            assert d.gate_hidden == 193 and (d.kl_topk, d.temperature) == (256, 0.1)
            assert (dms.steps, dms.seq_len, dms.global_batch, dms.data) == (
                kvpop.steps, kvpop.seq_len, kvpop.global_batch, kvpop.data)
            model_config = dms.model_retrofit(load_model_config(dms))
            assert model_config.dms == d and model_config.kvpop is None


# ------------------------------------------------------------------------------ optimizer


def test_two_param_groups_and_schedules():
    cfg = OptimConfig(steps=2000)
    new = optim.new_params_schedule(cfg)
    assert float(new(0)) == 0.0
    np.testing.assert_allclose(float(new(100)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(new(2000)), 8e-5, rtol=1e-5)
    assert 8e-5 < float(new(1000)) < 1e-3
    assert float(optim.learning_rates(cfg, 1234)["lr_base"]) == pytest.approx(8e-5)
    params = {"layers_0": {"mlp": {"kernel": jnp.ones((2, 2))},
                           "self_attn": {"kvpop": {"decay_alpha": jnp.zeros((2,))}}},
              "layers_1": {"self_attn": {"dms": {"w1": jnp.zeros((2, 2))}}}}
    labels = optim.param_labels(params)
    assert labels["layers_0"]["mlp"]["kernel"] == "base"
    assert labels["layers_0"]["self_attn"]["kvpop"]["decay_alpha"] == "new"
    assert labels["layers_1"]["self_attn"]["dms"]["w1"] == "new"  # DMS gates are new params too


@pytest.mark.parametrize("freeze", [False, True])
def test_freeze_base_and_clipping(freeze):
    cfg = OptimConfig(steps=10, warmup_steps=0, freeze_base=freeze, weight_decay=0.0)
    tx = optim.make_optimizer(cfg)
    params = {"w": jnp.ones((3,)), "kvpop": {"a": jnp.ones((2,))}}
    grads = {"w": jnp.full((3,), 100.0), "kvpop": {"a": jnp.full((2,), -100.0)}}
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    # Adam's first step moves each weight by ~lr against the gradient sign
    np.testing.assert_allclose(new["kvpop"]["a"], 1.0 + 1e-3, rtol=1e-5)
    np.testing.assert_allclose(new["w"], 1.0 if freeze else 1.0 - 8e-5, rtol=1e-6)
    clipped, _ = optax.clip_by_global_norm(1.0).update(grads, None)
    assert float(optax.global_norm(clipped)) == pytest.approx(1.0)


def _lr_new_reference(cfg: OptimConfig, t: int) -> float:
    """The new params' LR at optimizer step t: linear from 0 over the warmup, then a cosine to new_lr_final at
    `steps`, constant after."""
    if t < cfg.warmup_steps:
        return cfg.new_lr * t / cfg.warmup_steps
    frac = min(1.0, (t - cfg.warmup_steps) / (max(cfg.steps, cfg.warmup_steps + 1) - cfg.warmup_steps))
    return cfg.new_lr_final + (cfg.new_lr - cfg.new_lr_final) * 0.5 * (1 + math.cos(math.pi * frac))


def _adamw_reference(cfg: OptimConfig, params: dict, grads_per_step: list[dict]) -> dict:
    """Table 3's optimizer in numpy: the gradient clipped by its global norm over both groups, then AdamW per
    group (bias-corrected moments, eps outside the square root, decoupled decay scaled by the LR); the base LR
    constant (0 and no update when frozen), the new params' (names starting "kvpop") `_lr_new_reference`."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_per_step):
        g = {k: np.asarray(x, np.float64) for k, x in grads.items()}
        norm = math.sqrt(sum(float((x ** 2).sum()) for x in g.values()))
        if cfg.clip_norm > 0 and norm > cfg.clip_norm:
            g = {k: x * cfg.clip_norm / norm for k, x in g.items()}
        for k in p:
            new = k.startswith("kvpop")
            if not new and cfg.freeze_base:
                continue
            lr = _lr_new_reference(cfg, t) if new else cfg.base_lr
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g[k]
            v[k] = cfg.b2 * v[k] + (1 - cfg.b2) * g[k] ** 2
            m_hat, v_hat = m[k] / (1 - cfg.b1 ** (t + 1)), v[k] / (1 - cfg.b2 ** (t + 1))
            p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + cfg.eps) + cfg.weight_decay * p[k])
    return p


@pytest.mark.parametrize("freeze", [False, True])
def test_optimizer_equals_a_numpy_adamw_over_several_steps(rng, freeze):
    """Several steps of gradients of very different norms (some clipped, some not) against `_adamw_reference`.
    One Adam step moves each weight by ~lr whatever b1, b2, eps, the decay or the clipping, so the old
    one-step test let b1 and b2 swapped, the decay or eps dropped and the clipping skipped all pass."""
    cfg = OptimConfig(steps=7, warmup_steps=3, base_lr=3e-2, new_lr=5e-2, new_lr_final=1e-2, b1=0.8, b2=0.9,
                      eps=1e-2, weight_decay=0.3, clip_norm=2.0, freeze_base=freeze)
    shapes = {"w": (3, 4), "b": (5,), "kvpop_a": (4,), "kvpop_b": (2, 3)}
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: (rng.normal(size=s) * scale).astype(np.float32) for k, s in shapes.items()}
             for scale in rng.choice([0.05, 0.3, 3.0, 20.0], size=9)]
    def tree(flat):
        return {"w": flat["w"], "b": flat["b"], "kvpop": {"a": flat["kvpop_a"], "b": flat["kvpop_b"]}}

    tx = optim.make_optimizer(cfg)
    state_params = jax.tree.map(jnp.asarray, tree(params))
    opt_state = tx.init(state_params)
    for g in grads:
        updates, opt_state = tx.update(jax.tree.map(jnp.asarray, tree(g)), opt_state, state_params)
        state_params = optax.apply_updates(state_params, updates)
    want = tree(_adamw_reference(cfg, params, grads))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=1e-6), state_params, want)
    for t in range(9):  # the logged LRs are the applied ones
        lrs = optim.learning_rates(cfg, t)
        assert float(lrs["lr_base"]) == pytest.approx(0.0 if freeze else cfg.base_lr)
        assert float(lrs["lr_new"]) == pytest.approx(_lr_new_reference(cfg, t), rel=1e-5)


# ------------------------------------------------------------------------------ loss pieces


def test_chunked_kl_equals_full_kl():
    from kvpop_jax import losses
    from kvpop_jax.config import Qwen3Config
    from kvpop_jax.modeling import init_params
    from train import step as st

    config = Qwen3Config(**{k: v for k, v in TINY_ARCH.items() if k != "model_type"})
    params = init_params(config, jax.random.PRNGKey(0))
    model = st.Model(config)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 32, 32)), jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(2, 32, 128)) * 3, jnp.float32)
    values, indices = losses.teacher_topk(teacher, 8)
    mask = jnp.asarray(rng.random((2, 32)) > 0.3, jnp.float32)
    def full_kl(p):
        logits = model.apply({"params": p}, x, method=st.Model.logits_from_hidden)
        return losses.topk_kl_loss(logits, values, indices, mask=mask)

    def chunked_kl(p):
        return st.chunked_kl(model, p, x, values, indices, mask, temperature=1.0, chunk=8)

    np.testing.assert_allclose(float(chunked_kl(params)), float(full_kl(params)), rtol=1e-5)
    g_full, g_chunk = jax.jit(jax.grad(full_kl))(params), jax.jit(jax.grad(chunked_kl))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g_full, g_chunk)


def test_a_teacher_topk_write_on_a_full_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    """--write_teacher_logits on a full disk left step_N.npz.tmp behind, a partial file (up to ~4 GB a step of
    the paper's recipe) that kept the disk full for the rerun; and the file was renamed into place unsynced,
    so a crash could leave a torn step file under the name a rerun skips as written."""
    import train.teacher_cache as tc

    values, indices = np.zeros((2, 8, 4), np.float32), np.zeros((2, 8, 4), np.int32)
    ids = np.zeros((2, 8), np.int32)
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or fsync(fd))
    write_teacher_topk(str(tmp_path), 0, values, indices, ids)
    assert synced and sorted(os.listdir(tmp_path)) == ["step_00000000.npz"]

    def full(f, **arrays):
        f.write(b"PK" * 1000)
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(tc.np, "savez", full)
    with pytest.raises(OSError, match="No space left on device"):
        write_teacher_topk(str(tmp_path), 1, values, indices, ids)
    assert sorted(os.listdir(tmp_path)) == ["step_00000000.npz"]


def test_teacher_topk_files_round_trip(tmp_path, arch):
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch, teacher_logits_dir=str(tmp_path)))
    values = np.random.default_rng(0).normal(size=(4, 128, 16)).astype(np.float32)
    indices = np.random.default_rng(1).integers(0, 128, (4, 128, 16)).astype(np.int32)
    ids = np.random.default_rng(2).integers(0, 128, (4, 128)).astype(np.int32)
    write_teacher_topk(str(tmp_path), 3, values, indices, ids)
    rows = {"input_ids": ids, "positions": np.zeros((4, 128), np.int32),
            "loss_mask": np.ones((4, 128), np.float32), "segment_ids": np.ones((4, 128), np.int32)}
    batch = host_batch(cfg, rows, 3)
    assert batch["teacher_values"].shape == (2, 2, 128, 16)
    np.testing.assert_array_equal(batch["teacher_indices"].reshape(4, 128, 16), indices)
    with pytest.raises(FlagError, match="step_00000004.npz is missing"):  # one line at the CLI, not a traceback
        host_batch(cfg, rows, 4)
    # Rows other than those the file was written for (another --data or seed): refused, not distilled from.
    other = dict(rows, input_ids=np.roll(ids, 1, axis=0))
    with pytest.raises(ValueError, match="written for other rows"):
        host_batch(cfg, other, 3)
    np.savez(str(tmp_path / "step_00000005.npz"), values=values, indices=indices)  # an old file: no hashes
    with pytest.raises(ValueError, match="no row_hashes"):
        host_batch(cfg, rows, 5)


def test_non_finite_loss_names_step_and_term():
    check_finite(3, {"kl": 1.0, "retention_loss": 0.5, "loss": 1.5, "grad_norm": 2.0})
    with pytest.raises(NonFiniteLossError, match=r"step 7: retention_loss is nan"):
        check_finite(7, {"kl": 1.0, "retention_loss": float("nan"), "loss": float("nan"), "grad_norm": 2.0})
    with pytest.raises(NonFiniteLossError, match=r"step 2: grad_norm is inf"):
        check_finite(2, {"kl": 1.0, "retention_loss": 0.5, "loss": 1.5, "grad_norm": float("inf")})
    with pytest.raises(NonFiniteLossError, match=r"step 4: dms_loss is nan"):  # DMS's auxiliary loss
        check_finite(4, {"kl": 1.0, "retention_loss": 0.0, "dms_loss": float("nan"), "loss": float("nan"),
                         "grad_norm": 2.0})


def test_non_finite_updated_state_is_named_even_when_the_loss_is_finite():
    ok = {"kl": 1.0, "retention_loss": 0.5, "loss": 1.5, "grad_norm": 2.0}
    check_finite(1, dict(ok, state_finite=1.0))
    with pytest.raises(NonFiniteLossError, match=r"step 1: the updated parameters or optimizer state hold NaN/inf"):
        check_finite(1, dict(ok, state_finite=0.0))


def test_divergence_guard_names_step_and_term_after_its_warmup():
    steps = [{"kl": 2.0, "retention_loss": 0.7, "loss": 2.7}, {"kl": 1.9, "retention_loss": 0.6, "loss": 2.5},
             {"kl": 1.8, "retention_loss": 0.0, "loss": 1.8}]
    guard = DivergenceGuard(100.0, 3)
    guard.check(1, {"kl": 2.0, "retention_loss": 1e9, "loss": 1e9})  # no history yet: warm-up
    guard = DivergenceGuard(100.0, 3, history=steps)
    guard.check(4, {"kl": 150.0, "retention_loss": 0.9, "loss": 151.0})  # below 100 x the median
    with pytest.raises(DivergenceError, match=r"step 5: retention_loss is 4e\+18, above 100 x its running median 0.6"):
        guard.check(5, {"kl": 1.8, "retention_loss": 4e18, "loss": 4e18})
    DivergenceGuard(0.0, 3, history=steps).check(5, {"kl": 1e30, "retention_loss": 1e30, "loss": 1e30})  # off
    zero = DivergenceGuard(100.0, 2, history=[{"kl": 1.0, "retention_loss": 0.0, "loss": 1.0}] * 3)
    zero.check(4, {"kl": 1.0, "retention_loss": 0.5, "loss": 1.5})  # a term that was 0 (StreamingLLM+) is not judged


# ------------------------------------------------------------------------------ end to end (in process)


def _steps(run_dir):
    path = os.path.join(run_dir, "checkpoints")
    return sorted(int(s) for s in os.listdir(path) if s.isdigit()) if os.path.isdir(path) else []


@pytest.mark.long  # a run, then resumes of it: ~14 s on 2 cores
def test_resume_refuses_changed_settings_before_restoring_and_drops_a_torn_metrics_line(tmp_path, arch, capsys):
    run = str(tmp_path / "run")
    train(parse(tiny_flags(run, arch, steps=2, checkpoint_every=2)))
    saved_config = open(os.path.join(run, "train_config.json")).read()
    for overrides, message in ((dict(topk=24), "--topk 16 -> 24"), (dict(scorer="mlstm"), "--scorer 'mlp' -> 'mlstm'"),
                               (dict(scorer_keys="unrotated"), "--scorer_keys 'rotated' -> 'unrotated'"),
                               (dict(demo_seq_len=384), "--demo_seq_len 256 -> 384"),
                               (dict(freeze_base=True), "--freeze_base False -> True")):
        with pytest.raises(FlagError, match=f"cannot resume {run}/checkpoints/2: {message}"):
            train(parse(tiny_flags(run, arch, steps=3, **overrides)))
        assert open(os.path.join(run, "train_config.json")).read() == saved_config  # not overwritten
    with pytest.raises(FlagError, match="--kl_topk=100000 exceeds the model's vocab_size 128"):  # before compiling
        train(parse(tiny_flags(run, arch, steps=3, kl_topk=100000)))
    with pytest.raises(FlagError, match=rf"--steps=1, but {run}/checkpoints already holds step 2: a resume cannot go back"):
        train(parse(tiny_flags(run, arch, steps=1, warmup_steps=0, checkpoint_every=2)))  # it exported step 2
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "loss": 2.6')  # a kill mid-write
    data_item = os.path.join(run, "checkpoints", "2", "data", "metadata")
    data_state = open(data_item).read()
    with open(data_item, "w") as f:  # a hand edit: named as such, not blamed on the flags
        f.write(json.dumps(dict(json.loads(data_state), offset=-5)))
    with pytest.raises(FlagError, match=rf"cannot resume {run}/checkpoints/2: the data state is not one a run saved: "
                                        r"its offset -5 is not an int >= 0 \(its data item was edited or damaged"):
        train(parse(tiny_flags(run, arch, steps=3)))
    with open(data_item, "w") as f:
        f.write(data_state)
    # the same flags resume (nothing left to train: no second compile; the subprocess test resumes mid-run)
    out = train(parse(tiny_flags(run, arch, steps=2, checkpoint_every=2, log_every=2)))
    assert out["resumed_from"] == 2 and _steps(run) == [2]
    assert [m["step"] for m in _metrics(run)] == [1, 2]  # the torn line is gone
    assert all(m["state_finite"] == 1.0 for m in _metrics(run))
    saved = json.load(open(os.path.join(run, "train_config.json")))
    assert saved["log_every"] == 2 and "resume_changes" not in saved  # rewritten after the restore; no training change
    # a finished run given more --steps goes on and exports again; a lowered keep count prunes once it saves
    from safetensors.numpy import load_file

    exported = os.path.join(run, "export", "model.safetensors")
    before = load_file(exported)
    capsys.readouterr()
    out = train(parse(tiny_flags(run, arch, steps=3, checkpoint_every=2, keep_checkpoints=1, clip_norm=0.5)))
    assert out["resumed_from"] == 2 and _steps(run) == [3]
    # the accepted changes are said (cadence is not a training change) and kept with the run
    said = [line for line in capsys.readouterr().err.splitlines() if "changed training settings" in line]
    assert said == [f"resuming {run}/checkpoints/2 with changed training settings (its first 2 steps ran with the old "
                    "ones): optim.steps 2 -> 3; optim.clip_norm 1.0 -> 0.5"]
    record = json.load(open(os.path.join(run, "train_config.json")))
    assert record["resume_changes"] == [{"step": 2, "changes": ["optim.steps 2 -> 3", "optim.clip_norm 1.0 -> 0.5"]}]
    assert record["optim"]["clip_norm"] == 0.5
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3]
    after = load_file(exported)
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    train(parse(tiny_flags(run, arch, steps=4, checkpoint_every=2, keep_checkpoints=1, clip_norm=0.5, export=False)))
    record = json.load(open(os.path.join(run, "train_config.json")))  # the history goes on from the checkpoint's
    assert record["resume_changes"] == [{"step": 2, "changes": ["optim.steps 2 -> 3", "optim.clip_norm 1.0 -> 0.5"]},
                                        {"step": 3, "changes": ["optim.steps 3 -> 4"]}]


def test_non_finite_updated_state_aborts_without_saving_or_exporting(tmp_path, arch):
    """The issue's --base_lr=nan --steps=1: the loss of step 1 is finite, the updated weights are not."""
    run = str(tmp_path / "run")
    cfg = parse(tiny_flags(run, arch, steps=1, warmup_steps=1, checkpoint_every=1))
    object.__setattr__(cfg.optim, "base_lr", float("nan"))  # what the flags now refuse, e.g. from a library caller
    with pytest.raises(NonFiniteLossError, match="step 1: the updated parameters or optimizer state hold NaN/inf"):
        train(cfg)
    assert _steps(run) == [] and not os.path.exists(os.path.join(run, "export"))


def test_divergence_stops_the_run_naming_step_and_term(tmp_path, arch):
    """The issue's --new_lr=1e6: the loss climbs to 4e18 while staying finite."""
    run = str(tmp_path / "run")
    with pytest.raises(DivergenceError, match=r"step 3: retention_loss is .*, above 100 x its running median"):
        train(parse(tiny_flags(run, arch, new_lr=1e6, steps=8, checkpoint_every=4, divergence_warmup=2)))
    assert _steps(run) == [] and not os.path.exists(os.path.join(run, "export"))
    assert [m["step"] for m in _metrics(run)] == [1, 2]


@pytest.mark.long  # a run and its resume: ~11 s on 2 cores
def test_a_resume_seeds_the_divergence_guard_with_every_step_whatever_log_every(tmp_path, arch, monkeypatch):
    """With --log_every=2 the metrics hold every other step; the guard's history comes from the
    checkpoint, so the resumed run judges step 3 against steps 1 and 2, as the uninterrupted run does."""
    from train import loop
    from train.checkpointing import Checkpointer

    run = str(tmp_path / "run")
    train(parse(tiny_flags(run, arch, steps=2, checkpoint_every=2, log_every=2, export=False)))
    assert [m["step"] for m in _metrics(run)] == [2]
    saved = Checkpointer(os.path.join(run, "checkpoints")).restore_meta(2)[loop.GUARD_META_KEY]
    assert all(len(saved[t]) == 2 and all(math.isfinite(v) and v >= 0 for v in saved[t]) for t in loop.GUARDED_TERMS)
    assert all(saved[t][1] == _metrics(run)[0][t] for t in loop.GUARDED_TERMS)
    seeded = []

    class Recording(loop.DivergenceGuard):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seeded.append(self.saved())

    monkeypatch.setattr(loop, "DivergenceGuard", Recording)
    train(parse(tiny_flags(run, arch, steps=3, checkpoint_every=2, log_every=2, export=False)))
    assert seeded == [saved]


def test_pair_accuracy_and_regression_rmse_are_logged_only_with_their_losses(tmp_path, arch):
    from train import step as st
    from train.setup import step_config

    run = str(tmp_path / "run")
    train(parse(tiny_flags(run, arch, rank_pairs=2, regression_weight=0.5, steps=2, checkpoint_every=2,
                           export=False)))
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["pair_accuracy"] <= 1.0 for m in metrics)
    assert all(0.0 < m["regression_rmse"] < 100.0 for m in metrics)
    plain = parse(tiny_flags(run, arch))
    keys = st.metric_keys(step_config(plain, load_model_config(plain)))
    assert "pair_accuracy" not in keys and "regression_rmse" not in keys


# ------------------------------------------------------------------------------ end to end (subprocesses)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


LOSS_KEYS = ("loss", "kl", "retention_loss", "grad_norm", "boundary_accuracy", "keep_rate", "teacher_recall",
             "lr_base", "lr_new", "tokens")


@pytest.mark.long
def test_resume_after_kill_matches_uninterrupted_run_precomputed_teacher_and_export(tmp_path, arch):
    env = train_env(tmp_path)
    full_dir, killed_dir = str(tmp_path / "full"), str(tmp_path / "killed")
    # one flagfile, nested, as users run it
    flagfile = tmp_path / "tiny.flags"
    flagfile.write_text("\n".join(tiny_flags("UNUSED", arch)) + "\n")

    full = subprocess.run(train_cmd([f"--flagfile={flagfile}", f"--run_dir={full_dir}"]), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-4000:]
    assert " on cpu: " in full.stdout and "WARNING" not in full.stderr  # start-up line; float32 is CPU work

    # start the same run, kill -9 it once checkpoint 2 is on disk, restart with the same flags
    proc = subprocess.Popen(train_cmd([f"--flagfile={flagfile}", f"--run_dir={killed_dir}"]), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not os.path.isdir(os.path.join(killed_dir, "checkpoints", "2")):
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    killed_at = max(int(s) for s in os.listdir(os.path.join(killed_dir, "checkpoints")) if s.isdigit())
    assert not os.path.isdir(os.path.join(killed_dir, "export")), "the run finished before it was killed"

    resumed = subprocess.run(train_cmd([f"--flagfile={flagfile}", f"--run_dir={killed_dir}"]), cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stderr
    assert killed_at < 40

    a, b = _metrics(full_dir), _metrics(killed_dir)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 41))
    for ma, mb in zip(a, b):
        for k in LOSS_KEYS:
            assert ma[k] == pytest.approx(mb[k], rel=1e-6, abs=1e-7), (ma["step"], k)
    assert all(np.isfinite(m[k]) for m in a for k in LOSS_KEYS)
    assert a[0]["lr_new"] == 0.0 and a[2]["lr_new"] == pytest.approx(1e-3, rel=1e-5)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(full_dir, "tb")))
    assert sorted(int(s) for s in os.listdir(os.path.join(full_dir, "checkpoints")) if s.isdigit()) == [36, 38, 40]

    # precomputed teacher top-k: written by --write_teacher_logits, read instead of running the teacher
    logits_dir = str(tmp_path / "teacher")
    for name, extra in (("write", ["--write_teacher_logits"]), ("pre", ["--noexport"])):
        proc = subprocess.run(train_cmd([f"--flagfile={flagfile}", f"--run_dir={tmp_path / name}",
                                          f"--teacher_logits_dir={logits_dir}"] + extra),
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
    assert sorted(os.listdir(logits_dir)) == ["run.lock"] + [f"step_{i:08d}.npz" for i in range(40)] + ["teacher.json"]
    with np.load(os.path.join(logits_dir, "step_00000000.npz")) as f:
        assert f["values"].shape == (4, 128, 16) and f["indices"].dtype == np.int32
        assert np.all(np.diff(f["values"], axis=-1) <= 0)  # best first
    for ma, mp in zip(a, _metrics(str(tmp_path / "pre"))):
        for k in LOSS_KEYS:
            assert ma[k] == pytest.approx(mp[k], rel=1e-5, abs=1e-6), (ma["step"], k)

    # the end-of-run export reloads as a KVpop model; train.export of the last checkpoint matches it
    from kvpop_jax import load_pretrained
    from train.export import export_checkpoint

    config, params = load_pretrained(os.path.join(full_dir, "export"))
    assert config.kvpop is not None and config.kvpop.topk == 16 and config.kvpop.scorer == "mlp"
    assert "kvpop" in params["layers_0"]["self_attn"]
    assert os.path.isfile(os.path.join(full_dir, "export", "tokenizer.json"))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # from another folder: the run recorded its tokenizer's folder as an absolute path
    try:
        _, step = export_checkpoint(os.path.join(full_dir, "checkpoints", "40"), str(tmp_path / "exported"))
    finally:
        os.chdir(cwd)
    assert step == 40 and os.path.isfile(tmp_path / "exported" / "tokenizer.json")
    _, params2 = load_pretrained(str(tmp_path / "exported"))
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    # the killed-and-resumed run ends with the same weights
    _, params3 = load_pretrained(os.path.join(killed_dir, "export"))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), params, params3)


@pytest.mark.long  # four train.main subprocesses: ~20 s on 2 cores
def test_missing_flag_exits_with_message(tmp_path):
    proc = subprocess.run(train_cmd([f"--run_dir={tmp_path}", "--init_checkpoint=random:tiny"]), cwd=REPO,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--data is required" in proc.stderr
    proc = subprocess.run(train_cmd([f"--run_dir={tmp_path}", "--scorer=transformer"]), cwd=REPO,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: flag --scorer=transformer: value should be one of")
    proc = subprocess.run(train_cmd([f"--run_dir={tmp_path}", "stray"]), cwd=REPO,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == ("error: unexpected arguments ['stray']: train.main takes "
                                                             "only flags (--name=value)")
    # A one-host run in an environment that looks multi-host (a SLURM allocation): the hint, not a traceback.
    proc = subprocess.run(train_cmd([f"--run_dir={tmp_path}", "--init_checkpoint=random:tiny", "--data=demo:4"]),
                          cwd=REPO, env=dict(train_env(tmp_path), SLURM_NTASKS="2"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: --distributed=auto: jax.distributed.initialize() failed (")
    assert "multi-host variables seen: ['SLURM_NTASKS=2']. If this is one host, pass --distributed=off" in proc.stderr


@pytest.mark.parametrize("tied", [True, False])
def test_teacher_tiled_attention_equals_dense_model(monkeypatch, tied):
    from kvpop_jax import attention, losses
    from kvpop_jax.config import Qwen3Config
    from kvpop_jax.modeling import Qwen3ForCausalLM, init_params
    from train import step as st

    arch = {k: v for k, v in TINY_ARCH.items() if k != "model_type"}
    config = Qwen3Config(**dict(arch, tie_word_embeddings=tied))
    params = jax.tree.map(lambda x: x * 4.0, init_params(config, jax.random.PRNGKey(0)))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 48), 0, 128)
    pos = jnp.broadcast_to(jnp.arange(48), (2, 48))
    logits = Qwen3ForCausalLM(config).apply({"params": params}, ids).logits

    def no_dense(*args, **kwargs):
        raise AssertionError("the teacher built the S x S dense attention")

    monkeypatch.setattr(attention, "DENSE_TILED_MIN_QUERIES", 16)  # S = 48 counts as long
    monkeypatch.setattr(attention, "dense_attention_reference", no_dense)
    values, indices = st.teacher_topk_logits(st.Model(config), params, ids, pos, 8, 16)
    ref_values, ref_indices = losses.teacher_topk(logits, 8)
    np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(indices, ref_indices)


def test_ctrl_c_is_one_line_saying_how_to_resume(tmp_path, arch, monkeypatch, capsys):
    """Not a KeyboardInterrupt traceback: which folder to resume from (RUN_DIR-quick under --quick),
    and not to rerun with --overwrite once it has deleted the old run (it would start over again), but
    to rerun it while it has not (without it, the old run would be resumed and exported as the new one)."""
    import train.main as train_main
    import train.run_dir

    def interrupted(cfg):
        if deleted:
            train.run_dir.prepare_run_dir(cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_main, "train", interrupted)
    monkeypatch.setattr(train.run_dir, "_overwritten", set())
    run = str(tmp_path / "run")
    resume = f" to resume from the last checkpoint in {run}-quick"
    try:
        for extra, deleted, line in (
                ([], False, "interrupted; rerun the same command" + resume),
                (["--overwrite"], False, f"interrupted before --overwrite deleted anything in {run}-quick; rerun the "
                                         "same command to start over"),
                (["--overwrite"], True, "interrupted; rerun the command without --overwrite/--noresume (with them it "
                                        "would start over)" + resume)):
            train_main.FLAGS.unparse_flags()
            train_main.FLAGS(["train", *tiny_flags(run, arch, quick=True), *extra])
            with pytest.raises(SystemExit) as exit_info:
                train_main.main(["train"])
            assert exit_info.value.code == 130
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1] == line, err
    finally:
        train_main.FLAGS.unparse_flags()


@pytest.mark.long  # two whole train steps of a 3-layer model compiled: ~30 s on 2 cores
@pytest.mark.parametrize("scorer, remat", [("mlstm", "full")])  # the paper recipes' settings
def test_scan_layers_flag_gives_the_train_step_of_the_loop(tmp_path, scorer, remat):
    """--scan_layers reaches both models of the step, and one step (teacher, student, losses, AdamW)
    gives the loop's loss, metrics and updated parameters on fresh random weights and tokens."""
    from train.setup import build_mesh, jitted_step, step_config, to_global
    from train.throughput import _random_batch, random_state

    arch = tmp_path / "arch.json"
    arch.write_text(json.dumps(dict(TINY_ARCH, num_hidden_layers=3)))
    results = []
    for scan in (False, True):
        cfg = parse(tiny_flags(str(tmp_path / f"run_{scan}"), str(arch), scan_layers=scan, scorer=scorer, remat=remat))
        model_config = load_model_config(cfg)
        sc = step_config(cfg, model_config)
        assert cfg.scan_layers is scan and sc.scan_layers is scan
        assert [m.scan_layers for m in st.build_models(sc)] == [scan, scan]  # student and teacher
        tx = optim.make_optimizer(cfg.optim)
        mesh = build_mesh(cfg)
        step_fn, (state_sh, teacher_sh, batch_sh), _ = jitted_step(cfg, mesh, model_config, sc, tx)
        state, teacher = random_state(cfg, model_config, sc, tx, (state_sh, teacher_sh))
        batch = to_global(_random_batch(cfg, model_config.vocab_size, 11), batch_sh)
        state, metrics = step_fn(state, teacher, batch)
        results.append((jax.device_get(metrics), jax.device_get(state.params)))
    (want_m, want_p), (got_m, got_p) = results
    for k in ("loss", "kl", "retention_loss"):
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_documents_left_out_of_the_data_are_reported(tmp_path, arch, capsys):
    """Documents longer than --max_length (or without text) were dropped with only an absl INFO log,
    which the run silences: 36 of 40 could vanish without a word."""
    from train.setup import prepare_data, run_tokenizer

    data = tmp_path / "docs.jsonl"
    rows = [{"text": "q4 " * 400}] * 3 + [{"text": "q4 =7"}] * 2 + [{"body": "no text field"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch, data=str(data), demo_seq_len=None, split_documents=False,
                           max_length=None, text_field="text"))
    tokenizer, _ = run_tokenizer(cfg, None)
    batches = prepare_data(cfg, tokenizer)
    assert batches.stats == {"kept": 2, "too_long": 3, "no_text": 1}
    err = capsys.readouterr().err
    assert "data: kept 2 of 6 documents; left out 1 no text in the field read; 3 longer than 128 tokens" in err
    kept_only = tmp_path / "kept.jsonl"
    kept_only.write_text("".join(json.dumps(r) + "\n" for r in rows[3:5]))
    prepare_data(parse(tiny_flags(str(tmp_path / "run"), arch, data=str(kept_only), demo_seq_len=None,
                                  split_documents=False, max_length=None)), tokenizer)
    assert "left out" not in capsys.readouterr().err  # nothing left out, nothing said


def test_more_query_samples_than_saturated_positions_gets_a_note(tmp_path, arch, capsys):
    """--num_query_samples has no hard bound (positions are drawn with replacement), but past a row's S - B
    saturated positions every extra sample repeats one and only costs memory: said once, before compiling."""
    from train.setup import step_config

    for num, noted in ((92, False), (93, True)):  # seq_len 128, B = 4 + 16 + 16 = 36: 92 positions
        cfg = parse(tiny_flags(str(tmp_path / "run"), arch, num_query_samples=num))
        step_config(cfg, load_model_config(cfg))
        err = capsys.readouterr().err
        assert ("--num_query_samples=93 exceeds the 92 saturated query positions" in err) is noted, err
    dms = parse(tiny_flags(str(tmp_path / "dms"), arch, num_query_samples=500, retrofit="dms"))
    step_config(dms, load_model_config(dms))
    assert "num_query_samples" not in capsys.readouterr().err  # DMS samples no queries


def test_train_export_prints_its_result_not_orbaxs_logs(tmp_path, arch):
    """`python -m train.export` after a run printed some 36 lines of orbax INFO and read-only warnings on stderr
    (train.main silences them); now only its own lines."""
    import sys

    run = str(tmp_path / "run")
    train(parse(tiny_flags(run, arch, steps=2, checkpoint_every=2, export=False)))
    proc = subprocess.run([sys.executable, "-m", "train.export", f"--checkpoint={run}", f"--out={tmp_path / 'out'}"],
                          cwd=REPO, env=train_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"exported step 2 (1 layers, kvpop) to {tmp_path / 'out'}"
    assert proc.stderr.strip() == "", proc.stderr[-3000:]


def test_train_export_to_a_read_only_folder_or_a_full_disk_is_one_line(tmp_path, arch, monkeypatch, capsys):
    """--out on a read-only disk was found only after the parameters were restored, as os.mkdir's traceback
    (the stage is built beside --out); a full disk mid-write was a traceback too. Now the first is refused
    before anything is read, the second is one line saying the export there before is unchanged."""
    from train import checkpointing, export

    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    monkeypatch.setattr(checkpointing, "Checkpointer", _step_4_checkpointer(meta=None))
    read_only = tmp_path / "ro"
    (read_only / "export").mkdir(parents=True)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: os.path.realpath(p) != str(read_only)
                        and access(p, mode, **kw))
    with pytest.raises(ValueError, match=rf"^--out={read_only}/export: the folder {read_only} is not writable$"):
        export.export_checkpoint(str(run), str(read_only / "export"))  # the export folder itself is writable
    with pytest.raises(FlagError, match=rf"^--export_dir={read_only}/export: the folder {read_only} is not writable"):
        parse(tiny_flags(str(tmp_path / "run2"), arch, export_dir=str(read_only / "export")))  # train.main's too

    def full(*args, **kwargs):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(export, "export_checkpoint", full)
    export.FLAGS(["export", f"--checkpoint={run}", f"--out={tmp_path / 'out'}"])
    try:
        with pytest.raises(SystemExit) as stop:
            export.main([])
    finally:
        export.FLAGS.unparse_flags()
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"error: exporting to {tmp_path / 'out'} failed ([Errno 28] No space left on "
                                       "device); any export there before is unchanged\n")


@pytest.mark.long
def test_ctrl_c_mid_training_exits_130_with_one_line(tmp_path):
    """README: Ctrl-C stops a run with one line saying how to resume it (exit 130). It segfaulted instead (SIGSEGV,
    exit 139): the interpreter's teardown freed the buffers of the step still computing. On the demo teacher,
    whose first step compiles and runs for seconds, so the Ctrl-C lands in it; SIGINT's default handler, as from a
    terminal."""
    run_dir = tmp_path / "run"
    argv = ["train.main", "--init_checkpoint=checkpoints/demo-teacher", "--data=demo:16", "--demo_seq_len=1000",
            "--seq_len=1024", "--global_batch=2", "--steps=40", "--warmup_steps=1", "--sinks=4", "--window=32",
            "--topk=70", "--scorer=mlstm", "--kl_topk=32", "--log_every=1", "--param_dtype=float32",
            "--compute_dtype=float32", "--teacher_dtype=float32", f"--run_dir={run_dir}"]
    script = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              f"sys.argv = {argv!r}; runpy.run_module('train.main', run_name='__main__')")
    # as users run it, without the suite's XLA / JAX settings (fast compiles, JAX_PLATFORMS) that hid the crash
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)), "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (run_dir / "train_config.json").is_file():  # written once the run has started, before its first step
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.time() < deadline, "the run did not start within 300 s"
        time.sleep(0.05)
    time.sleep(5.0)  # inside the first step (its compile)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-4000:])
    assert "interrupted; rerun the same command" in err and "Segmentation fault" not in err


def test_dry_run_and_recipe_print_the_slots_and_memory_b(tmp_path, arch):
    """B is memory per KV head (README, reports, `eval.main generate`); --dry_run printed "B=106" of the slots alone
    and the recipe "B = 106 ...; memory 123 entries"."""
    from train.dry_run import _retrofit
    from train.recipe import describe

    for scorer in ("mlstm", "mlp"):
        cfg = parse(tiny_flags(str(tmp_path / "run"), arch, scorer=scorer))
        state = cfg.kvpop.scorer_state_slots(cfg.head_dim)
        assert (state > 0) == (scorer == "mlstm")
        plus = f" + {state} of scorer state" if state else ""
        assert _retrofit(cfg) == f"s=4, w=16, k=16: 36 slots{plus} = memory B {36 + state} per KV head, scorer {scorer}"
        assert describe(cfg) == f"s 4, w 16, k 16: 36 slots{plus} = memory B {36 + state} per KV head"


def test_gradient_accumulation_applies_the_mean_of_the_micro_batch_gradients(tmp_path, arch, monkeypatch):
    """A step over A micro-batches == one optimizer update with the mean of their gradients (each micro-batch's
    loss with its own query samples, fold_in(step rng, i)), and its metrics are their means. Adam barely notices a
    gradient A times too large, so a sum in place of the mean trained on (mutation audit); grad_norm and the clip
    would not. The loss weighs the retention term by --retention_loss_weight (never tested off 1 before), and samples
    its queries where the budget is full (q >= s + w + k)."""
    from kvpop_jax import losses, modeling
    from kvpop_jax import sharding as shd
    from train import setup

    sampled = []
    sampler = losses.sample_query_positions
    monkeypatch.setattr(losses, "sample_query_positions",
                        lambda *args, **kw: sampled.append(kw) or sampler(*args, **kw))

    cfg = parse(tiny_flags(str(tmp_path / "run"), arch, global_batch=4, micro_batch=2, scorer="mlstm",
                           retention_loss_weight=0.5))
    model_config = load_model_config(cfg)
    sc = setup.step_config(cfg, model_config)
    assert sc.grad_accum == 2
    tx = optim.make_optimizer(cfg.optim)
    rng = np.random.default_rng(0)
    a, b, s = sc.grad_accum, sc.micro_batch, sc.seq_len
    base = modeling.init_params(model_config, jax.random.key(0))
    params = modeling.retrofit_params(sc.model, base, jax.random.key(1))
    batch = {"input_ids": rng.integers(3, 128, (a, b, s)).astype(np.int32),
             "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (a, b, s)).copy(),
             "loss_mask": (rng.random((a, b, s)) > 0.1).astype(np.float32),
             "segment_ids": (np.arange(s) < s - rng.integers(0, s // 4, (a, b, 1))).astype(np.int32)}
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = st.init_state(jax.tree.map(jnp.copy, params), tx, cfg.seed)  # donated by the step: its own buffers
    fn, *_ = st.jit_train_step(sc, tx, mesh, jax.eval_shape(lambda: state), jax.eval_shape(lambda: base), batch)
    step_rng = jax.random.fold_in(state.rng, state.step)
    grad_fn = jax.jit(jax.value_and_grad(st.make_loss_fn(sc), has_aux=True))
    grads, metrics = [], []
    for i in range(a):
        mb = {k: jnp.asarray(v[i]) for k, v in batch.items()}
        (_, m), g = grad_fn(params, base, mb, jax.random.fold_in(step_rng, i), state.step)
        grads.append(g)
        metrics.append(m)
    mean = jax.tree.map(lambda *g: sum(g) / a, *grads)
    updates, _ = tx.update(mean, state.opt_state, params)
    want = optax.apply_updates(params, updates)
    new_state, got = fn(state, base, batch)
    assert float(got["grad_norm"]) == pytest.approx(float(optax.global_norm(mean)), rel=1e-5)
    for key in ("loss", "kl", "retention_loss", "boundary_auc"):
        assert float(got[key]) == pytest.approx(float(sum(m[key] for m in metrics)) / a, rel=1e-5), key
    assert float(got["loss"]) == pytest.approx(float(got["kl"]) + 0.5 * float(got["retention_loss"]), rel=1e-5)
    assert sampled and all(kw["min_q"] == sc.model.kvpop.budget == 36 for kw in sampled)
    for x, y in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_a_damaged_demo_tokenizer_in_the_run_folder_is_named(tmp_path, arch):
    """RUN_DIR/tokenizer (written once, then reused) with a torn tokenizer.json was a ValueError traceback."""
    from train.setup import run_tokenizer

    cfg = parse(tiny_flags(str(tmp_path / "run"), arch))
    os.makedirs(tmp_path / "run" / "tokenizer")
    (tmp_path / "run" / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(FlagError, match=r"--tokenizer=demo: .*; delete .*run/tokenizer and the run writes it again"):
        run_tokenizer(cfg, str(tmp_path / "init"))
