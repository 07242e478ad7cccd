"""train/run_dir.py: a run folder is owned (lock), started over only with --overwrite, resumed only
with the settings that shaped it, and its metrics survive a torn last line (issue 13)."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO, TINY_ARCH, hold_lock, parse, tiny_flags, train_cmd, train_env
from kvpop_jax.config import Qwen3Config
from train.config import FlagError
from train.loop import train
from train.setup import stale_demo_data
from train.run_dir import LOCK_FILE, check_resume, lock_run_dir, prepare_run_dir, read_metrics, resume_advice


def test_lock_refuses_a_live_owner_at_once_and_takes_over_a_dead_ones(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    with open(os.path.join(run, LOCK_FILE), "w") as f:
        f.write("999999999\n")  # left by a killed run: no process holds the lock any more
    with lock_run_dir(run):
        assert open(os.path.join(run, LOCK_FILE)).read().strip() == str(os.getpid())
        with lock_run_dir(run):  # reentrant: the recipe holds RUN_DIR while a run in it locks it too
            pass
    holder = hold_lock(run)
    try:
        with pytest.raises(FlagError, match=f"run folder {run} in use by PID {holder.pid}"):
            with lock_run_dir(run):
                pass
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    with lock_run_dir(run):  # free again once the holder is gone
        pass


def test_two_runs_into_one_folder_the_second_fails_at_once_with_one_line(tmp_path, arch):
    run = str(tmp_path / "run")
    holder = hold_lock(run)
    try:
        proc = subprocess.run(train_cmd(tiny_flags(run, arch)), cwd=REPO, env=train_env(tmp_path),
                              capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: run folder {run} in use by PID {holder.pid} (lock {os.path.realpath(run)}/{LOCK_FILE}); wait "
        "for that run, or stop it, or choose another --run_dir")
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(os.path.join(run, "checkpoints"))


def test_a_second_teacher_top_k_writer_is_refused_before_any_work(tmp_path, arch):
    """Two --write_teacher_logits into one folder would write each step's file together."""
    from train.teacher_cache import write_teacher_logits

    teacher_dir = str(tmp_path / "teacher")
    holder = hold_lock(teacher_dir)
    try:
        cfg = parse(tiny_flags(str(tmp_path / "run"), arch, steps=2, write_teacher_logits=True,
                               teacher_logits_dir=teacher_dir))
        with pytest.raises(FlagError, match=f"teacher top-k folder {teacher_dir} in use by PID {holder.pid} .*"
                                            "choose another --teacher_logits_dir"):
            write_teacher_logits(cfg)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert os.listdir(teacher_dir) == [LOCK_FILE]


def _fake_run(run_dir):
    """A run folder as a killed run leaves it: a checkpoint step, metrics, a config and an export."""
    os.makedirs(os.path.join(run_dir, "checkpoints", "2"))
    os.makedirs(os.path.join(run_dir, "export"))
    files = {"metrics.jsonl": '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n', "train_config.json": "{}",
             "export/config.json": "{}", "data/mine.jsonl": "{}"}
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(run_dir, name)), exist_ok=True)
        with open(os.path.join(run_dir, name), "w") as f:
            f.write(text)
    return files


def test_starting_over_an_existing_run_needs_overwrite(tmp_path, arch):
    run = str(tmp_path / "run")
    files = _fake_run(run)
    with pytest.raises(FlagError, match=r"--noresume would start over in .*checkpoints \(steps 2\); pass --overwrite"):
        train(parse(tiny_flags(run, arch, resume=False)))
    for name, text in files.items():  # nothing touched
        assert open(os.path.join(run, name)).read() == text
    assert os.path.isdir(os.path.join(run, "checkpoints", "2"))
    prepare_run_dir(parse(tiny_flags(run, arch, resume=True)))  # resuming is what a rerun does: allowed
    prepare_run_dir(parse(tiny_flags(run, arch, resume=False, overwrite=True)))
    left = sorted(os.listdir(run))
    # the run's outputs are gone; its inputs and the export stay until replaced (the refused --noresume
    # above prepared nothing: it is checked before any input is)
    assert left == ["data", "export", "run.lock"], left
    prepare_run_dir(parse(tiny_flags(run, arch, resume=False)))  # nothing left to lose
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:  # killed before its first checkpoint
        f.write('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(FlagError, match=rf"^--noresume would start over in {run}, which holds a run's metrics.jsonl; "):
        prepare_run_dir(parse(tiny_flags(run, arch, resume=False)))  # was "a run's a metrics.jsonl"


def test_ctrl_c_advice_under_overwrite_depends_on_whether_it_deleted_anything(tmp_path, arch, monkeypatch):
    """Stopped before --overwrite deleted the old run (while the data was read), Ctrl-C said to rerun without
    --overwrite, which resumed and exported the old run as the new command's result."""
    import train.run_dir

    monkeypatch.setattr(train.run_dir, "_overwritten", set())
    run = str(tmp_path / "run")
    _fake_run(run)
    cfg = parse(tiny_flags(run, arch, overwrite=True))
    before = resume_advice(cfg.resume, cfg.overwrite, run)
    assert before == f"interrupted before --overwrite deleted anything in {run}; rerun the same command to start over"
    assert resume_advice(True, False, run) == f"interrupted; rerun the same command to resume from the last " \
        f"checkpoint in {run}"
    prepare_run_dir(cfg, delete=False)  # the check before the inputs are read deletes nothing
    assert resume_advice(cfg.resume, cfg.overwrite, run) == before
    prepare_run_dir(cfg)
    assert resume_advice(cfg.resume, cfg.overwrite, run) == "interrupted; rerun the command without " \
        f"--overwrite/--noresume (with them it would start over) to resume from the last checkpoint in {run}"


def test_overwrite_deletes_nothing_before_every_flag_and_input_is_checked(tmp_path, arch):
    """--overwrite with a mesh that cannot be built (or data that cannot be read) deleted the old run's
    checkpoints, metrics and config first, then stopped with the flag error."""
    run = str(tmp_path / "run")
    files = _fake_run(run)
    with pytest.raises(FlagError, match="mesh"):
        train(parse(tiny_flags(run, arch, overwrite=True, mesh_data=3)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(FlagError, match="--data: .*empty"):
        train(parse(tiny_flags(run, arch, overwrite=True, data=str(empty))))
    for name, text in files.items():  # nothing touched
        assert open(os.path.join(run, name)).read() == text
    assert os.path.isdir(os.path.join(run, "checkpoints", "2"))


def test_a_truncated_init_checkpoint_is_named_before_overwrite_deletes_or_a_resume_compares(tmp_path, arch):
    """A partial download as --init_checkpoint: --overwrite deleted the old run, then load_pretrained named the
    file; without it, the resume's fingerprint check called it "other weights" and advised --overwrite."""
    import jax

    from kvpop_jax import modeling, save_pretrained
    init = str(tmp_path / "init")
    config = Qwen3Config.from_hf(arch)
    save_pretrained(config, modeling.init_params(config, jax.random.PRNGKey(0)), init)
    run = str(tmp_path / "run")
    train(parse(tiny_flags(run, arch, init_checkpoint=init, steps=2)))  # a real run: its checkpoint's fingerprint

    def snapshot():
        return {os.path.relpath(os.path.join(d, f), run): open(os.path.join(d, f), "rb").read()
                for d, _, names in os.walk(run) for f in names}

    before = snapshot()
    weights = os.path.join(init, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    for overwrite in (True, False):
        with pytest.raises(FlagError, match=rf"--init_checkpoint={init}: .*model.safetensors"):
            train(parse(tiny_flags(run, arch, init_checkpoint=init, overwrite=overwrite, steps=4)))
        assert snapshot() == before  # nothing touched


def test_a_teacher_logits_dir_of_another_teacher_or_missing_steps_is_refused_before_training(tmp_path, arch, capsys):
    from train.teacher_cache import TEACHER_META, check_teacher_dir, claim_teacher_dir, teacher_file

    logits = tmp_path / "teacher"
    logits.mkdir()
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch, teacher_logits_dir=str(logits), steps=3))
    open(teacher_file(str(logits), 0), "wb").close()  # a file from before teacher.json: adopted, with a word
    claim_teacher_dir(str(logits), "a" * 64, "initA")
    assert "holds 1 step files without teacher.json; they are taken as --init_checkpoint=initA's" in \
        capsys.readouterr().err
    claim_teacher_dir(str(logits), "a" * 64, "initA")  # the same teacher again (a rerun): fine, silently
    assert capsys.readouterr().err == ""
    assert json.loads((logits / TEACHER_META).read_text()) == {"init_fingerprint": "a" * 64}
    with pytest.raises(FlagError, match="holds another teacher's top-k .*--init_checkpoint=initB"):
        claim_teacher_dir(str(logits), "b" * 64, "initB")
    for step in (0, 1):
        open(teacher_file(str(logits), step), "wb").close()
    with pytest.raises(FlagError, match=r"lacks the files of 1 of steps 0..2 \(the first: .*step_00000002.npz\)"):
        check_teacher_dir(cfg, "a" * 64, 0)
    check_teacher_dir(cfg, "a" * 64, None)  # the teacher alone: right
    open(teacher_file(str(logits), 2), "wb").close()
    check_teacher_dir(cfg, "a" * 64, 0)
    with pytest.raises(FlagError, match="holds the top-k of another teacher than --init_checkpoint"):
        check_teacher_dir(cfg, "b" * 64, 2)


def test_resume_check_names_each_changed_flag_with_old_and_new_values(tmp_path, arch):
    cfg = parse(tiny_flags(str(tmp_path / "run"), arch))
    model = Qwen3Config.from_hf(arch)
    saved = {"train_config": json.loads(json.dumps(cfg.to_json(), default=str)),
             "model_config": dataclasses.replace(model, kvpop=cfg.kvpop).to_hf()}
    check_resume(saved, cfg, model, "ckpt/2")
    # learning rates, loss weights and the step count may change on resume (deliberately)
    check_resume(saved, parse(tiny_flags(str(tmp_path / "run"), arch, base_lr=1e-5, steps=80,
                                         retention_loss_weight=0.5)), model, "ckpt/2")
    # and so may how it runs: the mesh, remat, scanning, checkpointing and logging cadence, the teacher's source
    os.makedirs(tmp_path / "t")
    check_resume(saved, parse(tiny_flags(str(tmp_path / "run"), arch, mesh_fsdp=1, mesh_data=-1, remat="full",
                                         scan_layers=True, checkpoint_every=5, keep_checkpoints=1, log_every=3,
                                         async_checkpointing=False, teacher_logits_dir=str(tmp_path / "t"))),
                 model, "ckpt/2")
    for overrides, message in ((dict(topk=24), "--topk 16 -> 24"), (dict(scorer="mlstm"), "--scorer 'mlp' -> 'mlstm'"),
                               (dict(window=8, topk=24), "--window 16 -> 8; --topk 16 -> 24"),
                               (dict(scorer_hidden=8), "--scorer_hidden 64 -> 8"),
                               (dict(seq_len=256, max_length=256), "--seq_len 128 -> 256"),
                               (dict(demo_seq_len=512), "--demo_seq_len 256 -> 512"),
                               (dict(target_reduce="max"), "--target_reduce 'sum' -> 'max'"),
                               # each micro-batch's KL mean and query samples: another split trains otherwise
                               (dict(micro_batch=4), "--micro_batch 2 -> 4"),
                               (dict(micro_batch=1), "--micro_batch 2 -> 1"),
                               (dict(demo_tasks="read_once,reuse", demo_seq_len=1000),
                                "--demo_seq_len 256 -> 1000; --demo_tasks \\['read_once'\\] -> "
                                "\\['read_once', 'reuse'\\]")):
        with pytest.raises(FlagError, match=f"cannot resume ckpt/2: {message}\\. A resumed run keeps"):
            check_resume(saved, parse(tiny_flags(str(tmp_path / "run"), arch, **overrides)), model, "ckpt/2")
    # a run saved before a setting existed ran with its default: changing it is refused, keeping it is not
    older = json.loads(json.dumps(saved))
    del older["train_config"]["kvpop"]["scorer_keys"]
    check_resume(older, cfg, model, "ckpt/2")
    with pytest.raises(FlagError, match="--scorer_keys 'rotated' -> 'unrotated'"):
        check_resume(older, parse(tiny_flags(str(tmp_path / "run"), arch, scorer_keys="unrotated")), model, "ckpt/2")
    with pytest.raises(FlagError, match="--retrofit 'kvpop' -> 'dms'"):
        check_resume(saved, parse(tiny_flags(str(tmp_path / "run"), arch, retrofit="dms")), model, "ckpt/2")
    dms = parse(tiny_flags(str(tmp_path / "run"), arch, retrofit="dms"))
    dms_saved = {"train_config": json.loads(json.dumps(dms.to_json(), default=str))}
    check_resume(dms_saved, parse(tiny_flags(str(tmp_path / "run"), arch, retrofit="dms", dms_temperature=0.5)),
                 model, "ckpt/2")  # the relaxation's temperature may change, the gates' shape and target not
    with pytest.raises(FlagError, match=r"--dms_window 16 -> 8; dms.target_eviction 0.82\d* -> 0.76\d*\. A res"):
        check_resume(dms_saved, parse(tiny_flags(str(tmp_path / "run"), arch, retrofit="dms", dms_window=8)),
                     model, "ckpt/2")
    # other weights of the same shape (another teacher, a fine-tuned one): the frozen teacher would change
    check_resume({**saved, "init_fingerprint": "a" * 64}, cfg, model, "ckpt/2", init_fingerprint="a" * 64)
    check_resume(saved, cfg, model, "ckpt/2", init_fingerprint="b" * 64)  # saved before fingerprints: not checked
    with pytest.raises(FlagError, match=r"cannot resume ckpt/2: --init_checkpoint=.* holds other weights than the "
                                        r"run started from \(it started from .*; the teacher would change mid-run\)"):
        check_resume({**saved, "init_fingerprint": "a" * 64}, cfg, model, "ckpt/2", init_fingerprint="b" * 64)
    # Another data file, field or split: the iterator's own check counts documents, so one of as many passed.
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (first, second):
        path.write_text('{"text": "hello"}\n')
    on_file = parse(tiny_flags(str(tmp_path / "run"), arch, data=str(first), demo_seq_len=None))
    file_saved = {"train_config": json.loads(json.dumps(on_file.to_json(), default=str))}
    check_resume(file_saved, parse(tiny_flags(str(tmp_path / "run"), arch, data=f"{tmp_path}/./a.jsonl",
                                              demo_seq_len=None)), model, "ckpt/2")  # the same file, spelled apart
    check_resume(file_saved, parse(tiny_flags(str(tmp_path / "run"), arch, data=str(first), demo_seq_len=None,
                                              demo_tasks="reuse")), model, "ckpt/2")  # unused demo flags: no matter
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # a relative --data is recorded absolute: a resume from another folder compares the same file
        assert parse(tiny_flags(str(tmp_path / "run"), arch, data="a.jsonl", demo_seq_len=None)).data.data == str(first)
    finally:
        os.chdir(cwd)
    for overrides, message in ((dict(data=str(second)), f"--data '{first}' -> '{second}'"),
                               (dict(data=str(first), text_field="body"), "--text_field 'auto' -> 'body'")):
        with pytest.raises(FlagError, match=f"cannot resume ckpt/2: {message}\\. A resumed run keeps"):
            check_resume(file_saved, parse(tiny_flags(str(tmp_path / "run"), arch, demo_seq_len=None, **overrides)),
                         model, "ckpt/2")
    wider = Qwen3Config.from_hf(dict(TINY_ARCH, hidden_size=64))
    with pytest.raises(FlagError, match=r"the model's hidden_size \(--init_checkpoint/--model_config\) 32 -> 64"):
        check_resume(saved, cfg, wider, "ckpt/2")


def test_metrics_with_bytes_that_are_not_text_name_the_line(tmp_path, rng):
    """Binary garbage in metrics.jsonl (disk trouble) stopped the resume with a UnicodeDecodeError traceback."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xc9' + rng.bytes(64).replace(b"\n", b"") + b'\n{"step": 2}\n')
    with pytest.raises(FlagError, match=r"metrics.jsonl line 2 is not a metrics record"):
        read_metrics(str(path), 2)


def test_metrics_torn_last_line_is_dropped_and_a_bad_middle_line_named(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_metrics(str(path), 2) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert "dropping its torn last line 3" in capsys.readouterr().err
    assert read_metrics(str(path), 1) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(FlagError, match=r"metrics.jsonl line 2 is not a metrics record"):
        read_metrics(str(path), 3)
    assert read_metrics(str(tmp_path / "missing.jsonl"), 3) == []


def test_tensorboard_is_imported_only_when_asked_for_and_its_absence_named(tmp_path, monkeypatch):
    """GPU images (and users) may lack tensorboardX: --dry_run and throughput must not need it."""
    from train.loop import MetricsLog

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import now fails as if not installed
    cfg = dataclasses.make_dataclass("Cfg", ["run_dir", "tensorboard"])
    MetricsLog(cfg(str(tmp_path), False), 0).write(1, {"loss": 1.0})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.0}
    with pytest.raises(ModuleNotFoundError, match=r"--tensorboard needs tensorboardX.*--notensorboard"):
        MetricsLog(cfg(str(tmp_path), True), 1)
    (tmp_path / "arch.json").write_text(json.dumps(TINY_ARCH))
    with pytest.raises(ModuleNotFoundError, match="--notensorboard"):  # before any loading
        train(parse(tiny_flags(str(tmp_path / "run"), str(tmp_path / "arch.json"))))
    assert sorted(os.listdir(tmp_path / "run")) == [LOCK_FILE]  # nothing built, loaded or written yet
    script = "import sys; sys.modules['tensorboardX'] = None; import train.main, train.throughput, train.dry_run"
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, env=train_env(tmp_path))


def test_metrics_of_a_run_with_no_checkpoint_are_replaced_with_a_line_saying_so(tmp_path, capsys):
    """A rerun whose checkpoints/ was deleted (or that stopped before its first save) started over and replaced
    the old run's metrics.jsonl without a word; a resume from a checkpoint cuts it back to that step quietly."""
    from train.loop import MetricsLog

    cfg = dataclasses.make_dataclass("Cfg", ["run_dir", "tensorboard"])(str(tmp_path), False)
    path = tmp_path / "metrics.jsonl"
    old = '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.2}\n'
    path.write_text(old)
    assert MetricsLog(cfg, 2).records == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert "starting over" not in capsys.readouterr().err
    path.write_text(old)
    assert MetricsLog(cfg, 0).records == [] and path.read_text() == ""
    assert (f"{path} holds 3 records (to step 3) of a run with no checkpoint to resume from (it stopped before its "
            "first save, or its checkpoints/ was deleted): starting over from step 0") in capsys.readouterr().err
    MetricsLog(cfg, 0)  # nothing there: nothing to say
    assert capsys.readouterr().err == ""


def test_every_kvpop_flag_named_by_the_resume_check_exists():
    from absl import flags

    from train.flags import define_flags
    from train.run_dir import KVPOP_FLAGS, RESUME_KVPOP_FIELDS

    fv = flags.FlagValues()
    define_flags(fv)
    assert [f for f in KVPOP_FLAGS if f not in fv] == []
    assert set(KVPOP_FLAGS) <= set(RESUME_KVPOP_FIELDS)


def test_checkpoints_are_saved_at_the_multiples_of_save_every_and_when_forced(tmp_path, rng):
    """`--checkpoint_every`'s cadence against its definition (no test saw a save one step off it: the runs that
    check resume save at every step or at a step they force)."""
    import jax.numpy as jnp

    from train.checkpointing import Checkpointer
    from train.step import TrainState

    every = int(rng.integers(2, 5))
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), save_every=every, keep=100, async_save=False)
    forced = int(rng.integers(1, 12))
    saved = []
    for step in range(1, 13):
        state = TrainState(step=jnp.asarray(step, jnp.int32), params={"w": jnp.asarray(rng.normal(size=3))},
                           opt_state={"m": jnp.zeros(3)}, rng=jnp.asarray([1, 2], jnp.uint32))
        if ckpt.save(state, {"pos": step}, {}, force=step == forced):
            saved.append(step)
    ckpt.close()
    want = sorted({s for s in range(1, 13) if s % every == 0} | {forced})
    assert saved == want and Checkpointer(str(tmp_path / "checkpoints"), read_only=True).all_steps() == want


def test_a_damaged_checkpoint_is_one_error_naming_it_and_the_step_to_fall_back_to(tmp_path):
    """Disk trouble or a hand edit in a saved step: not orbax's wall of tracebacks, but which step,
    what failed, and how to resume from the one before it (train and train.export alike)."""
    import shutil

    import jax.numpy as jnp
    import numpy as np

    from train.checkpointing import Checkpointer
    from train.step import TrainState

    directory = str(tmp_path / "checkpoints")
    rng = np.random.default_rng(0)
    state = lambda step: TrainState(step=jnp.asarray(step, jnp.int32),  # noqa: E731
                                    params={"w": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)},
                                    opt_state={"m": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)},
                                    rng=jnp.asarray([1, 2], jnp.uint32))
    like = state(0)

    def damage(root, how):
        if how == "empty meta":
            open(os.path.join(root, "meta", "metadata"), "w").close()
        elif how == "truncated params":
            for d, _, files in os.walk(os.path.join(root, "params")):
                for f in files:
                    if os.path.basename(d) == "d":
                        with open(os.path.join(d, f), "r+b") as fh:
                            fh.truncate(os.path.getsize(os.path.join(d, f)) // 3)
        else:
            shutil.rmtree(os.path.join(root, "params"))

    for how in ("empty meta", "truncated params", "no params"):
        shutil.rmtree(directory, ignore_errors=True)
        ckpt = Checkpointer(directory, async_save=False)
        for step in (2, 4):
            ckpt.save(state(step), {"pos": step}, {"note": "x"}, force=True)
        assert ckpt.restore(4, like)[2]["step"] == 4
        ckpt.close()
        damage(os.path.join(directory, "4"), how)
        ckpt = Checkpointer(directory, async_save=False)  # as a resume opens it
        message = (rf"checkpoint {directory}/4 cannot be read \(\w+: .*\): it is damaged or does not match this "
                   rf"run; move it aside \(`mv {directory}/4 {directory}/4.damaged`\) to resume from step 2, "
                   r"or start over with --overwrite")
        with pytest.raises(FlagError, match=message):
            ckpt.restore_meta(4) if how == "empty meta" else ckpt.restore(4, like)
        assert ckpt.restore(2, like)[2]["step"] == 2  # the step before it is whole
        ckpt.close()
        ckpt = Checkpointer(directory, read_only=True)  # as train.export opens it
        with pytest.raises(FlagError, match=r"it is damaged or does not match this run; export an earlier step \(2\)"):
            ckpt.restore_meta(4) if how == "empty meta" else ckpt.restore_params(4, like.params)
        ckpt.close()
        os.rename(os.path.join(directory, "4"), os.path.join(directory, "4.damaged"))
        assert Checkpointer(directory, read_only=True).latest_step() == 2  # the advice works


def test_a_hand_edited_meta_item_is_the_steps_damage_not_a_traceback(tmp_path):
    """A step's meta/metadata edited by hand (a model_config that is a list or a path, a train_config that is a
    string, an unknown param_dtype, a size given as a string) was a KeyError, TypeError or bare ValueError
    traceback in train.export and in a resume; now it is the damaged-checkpoint error naming the step and what is
    wrong, and train.export of a meta without a model_config names the step."""
    import jax.numpy as jnp

    from train.checkpointing import Checkpointer
    from train.export import export_checkpoint
    from train.step import TrainState

    directory = tmp_path / "checkpoints"
    state = TrainState(step=jnp.asarray(4, jnp.int32), params={"w": jnp.zeros((2, 2))}, opt_state={"m": jnp.zeros(2)},
                       rng=jnp.asarray([1, 2], jnp.uint32))
    ckpt = Checkpointer(str(directory), async_save=False)
    good = {"model_config": dict(TINY_ARCH), "param_dtype": "float32", "train_config": {"kvpop": None},
            "tokenizer_dir": None}
    ckpt.save(state, {"pos": 4}, good, force=True)
    ckpt.close()
    metadata = directory / "4" / "meta" / "metadata"
    saved = json.loads(metadata.read_text())
    wrong = r"its meta item's {} has the wrong type \({}\)"
    edits = {"model_config": ([1, 2], wrong.format("model_config", r"list: \[1, 2\]")),
             "train_config": ("x", wrong.format("train_config", "str: x")),
             "param_dtype": ("int8", r"its meta item's param_dtype is 'int8', not one of float32, bfloat16"),
             "tokenizer_dir": (5, wrong.format("tokenizer_dir", "int: 5"))}
    edits["path"] = ("model_config", str(tmp_path), wrong.format("model_config", f"str: {tmp_path}"))  # not read
    edits["size"] = ("model_config", dict(TINY_ARCH, hidden_size="32"),
                     r"Qwen3Config.hidden_size must be a positive int, got '32'")
    edits["kvpop"] = ("train_config", {"kvpop": [1]}, wrong.format("train_config.kvpop", r"list: \[1\]"))
    for rng in ("x", None, [1, -2], [2**32]):  # read by a resume's restore: a bare ValueError or TypeError
        edits[f"rng {rng}"] = ("rng", rng, rf"its meta item's rng is {re.escape(str(rng))}, not the list of uint32 "
                                           "a run saves")
    edits["history"] = ("divergence_history", {"kl": "1"}, r"its meta item's divergence_history is \{'kl': '1'\}, "
                                                           "not the lists of numbers a run saves")
    edits["step"] = ("step", "4", r"its meta item's step is '4', not an int")
    for name, edit in edits.items():
        field, value, message = edit if len(edit) == 3 else (name, *edit)
        metadata.write_text(json.dumps(dict(saved, **{field: value})))
        ckpt = Checkpointer(str(directory), read_only=True)
        for restore in (ckpt.restore_meta, lambda step: ckpt.restore(step, state)):
            with pytest.raises(FlagError, match=rf"^checkpoint {directory}/4 cannot be read \(ValueError: {message}\): "
                                                r"it is damaged or does not match this run; no earlier step is kept$"):
                restore(4)
        ckpt.close()
    metadata.write_text(json.dumps({k: v for k, v in saved.items() if k != "model_config"}))
    with pytest.raises(ValueError, match=rf"^checkpoint {directory}/4 has no model_config in its meta item \(it "
                                         r"holds param_dtype, rng, step, tokenizer_dir, train_config\)"):
        export_checkpoint(str(directory), str(tmp_path / "export"))
    assert not (tmp_path / "export").exists()


def test_a_step_folder_renamed_to_another_step_is_refused_not_exported_or_resumed_under_that_number(tmp_path):
    """checkpoints/6 renamed (or copied) to checkpoints/10: train.export said `exported step 10` for step 6's
    weights, and a resume trained from step 6 again, failed to save step 10 (it exists) and advised a rerun,
    which resumed from `10` again. Now the folder is named as not matching its meta item's step."""
    import jax.numpy as jnp

    from train.checkpointing import Checkpointer
    from train.export import export_checkpoint
    from train.step import TrainState

    directory = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(directory), async_save=False)
    for step in (4, 6):
        ckpt.save(TrainState(step=jnp.asarray(step, jnp.int32), params={"w": jnp.zeros(2)},
                             opt_state={"m": jnp.zeros(2)}, rng=jnp.asarray([1, 2], jnp.uint32)),
                  {"pos": step}, {"model_config": dict(TINY_ARCH)}, force=True)
    ckpt.close()
    os.rename(directory / "6", directory / "10")
    message = (rf"^checkpoint {directory}/10 cannot be read \(ValueError: its meta item is of step 6: the folder was "
               r"renamed, or copied from another step\): it is damaged or does not match this run; ")
    ckpt = Checkpointer(str(directory), async_save=False)  # as a resume opens it
    with pytest.raises(FlagError, match=message + rf"move it aside \(`mv {directory}/10 {directory}/10.damaged`\)"):
        ckpt.restore_meta(10)
    assert ckpt.restore_meta(4)["step"] == 4
    ckpt.close()
    with pytest.raises(FlagError, match=message + r"export an earlier step \(4\)$"):
        export_checkpoint(str(tmp_path), str(tmp_path / "export"))
    assert not (tmp_path / "export").exists()


def test_export_of_a_step_whose_meta_gives_other_shapes_names_the_parameter_before_orbax_reads(tmp_path):
    """A meta item whose model config was edited to other sizes (hidden_size 32 -> 64): orbax's `Requested shape
    ... is not compatible` came with up to a hundred lines of `RuntimeError: Event loop is closed` tracebacks at
    exit (its other reads were still in flight). The stored shapes are now compared first, by parameter."""
    import jax
    import jax.numpy as jnp

    from train.checkpointing import Checkpointer
    from train.step import TrainState

    directory = tmp_path / "checkpoints"
    params = {"embed": {"embedding": jnp.zeros((16, 8))}, "norm": jnp.ones(8)}
    ckpt = Checkpointer(str(directory), async_save=False)
    ckpt.save(TrainState(step=jnp.asarray(2, jnp.int32), params=params, opt_state={"m": jnp.zeros(2)},
                         rng=jnp.asarray([1, 2], jnp.uint32)), {"pos": 2}, {}, force=True)
    ckpt.close()
    ckpt = Checkpointer(str(directory), read_only=True)
    wider = {"embed": {"embedding": jax.ShapeDtypeStruct((16, 12), jnp.float32)},
             "norm": jax.ShapeDtypeStruct((12,), jnp.float32)}
    with pytest.raises(FlagError, match=rf"^checkpoint {directory}/2 cannot be read \(ValueError: "
                                        r"params\['embed'\]\['embedding'\] is \(16, 8\) on disk, not \(16, 12\) "
                                        r"as the model config in its meta item says\): it is damaged"):
        ckpt.restore_params(2, wider)
    same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert jax.tree.map(lambda x: x.shape, ckpt.restore_params(2, same)) == {"embed": {"embedding": (16, 8)},
                                                                               "norm": (8,)}
    ckpt.close()


def test_a_killed_saves_unfinished_step_folder_is_swept_quietly_when_the_run_reopens(tmp_path, caplog):
    """A kill during an async save leaves N.orbax-checkpoint-tmp. The resume's own save of step N then
    met it with a `W... Attempted to create temporary directory ... which already exists` line; the
    folder is now swept when a writer opens the checkpoints (before its first save), and a reader
    (train.export) leaves the folder as it is."""
    import jax.numpy as jnp
    import numpy as np

    from train.checkpointing import Checkpointer
    from train.step import TrainState

    directory = tmp_path / "checkpoints"
    rng = np.random.default_rng(1)
    state = lambda step: TrainState(step=jnp.asarray(step, jnp.int32),  # noqa: E731
                                    params={"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)},
                                    opt_state={"m": jnp.asarray(rng.normal(size=(3,)), jnp.float32)},
                                    rng=jnp.asarray([1, 2], jnp.uint32))
    ckpt = Checkpointer(str(directory), async_save=False)
    ckpt.save(state(2), {"pos": 2}, {"note": "x"}, force=True)
    ckpt.close()
    unfinished = directory / "3.orbax-checkpoint-tmp"
    (unfinished / "params").mkdir(parents=True)
    (unfinished / "params" / "part").write_bytes(rng.bytes(64))
    Checkpointer(str(directory), read_only=True).close()
    assert unfinished.is_dir()
    caplog.clear()
    ckpt = Checkpointer(str(directory), async_save=False)
    assert ckpt.latest_step() == 2
    ckpt.save(state(3), {"pos": 3}, {"note": "x"}, force=True)
    ckpt.close()
    assert sorted(os.listdir(directory)) == ["2", "3"]
    assert not [r for r in caplog.records if "already exists" in r.getMessage()], caplog.text


def test_orbax_bare_exception_on_a_damaged_array_is_the_same_one_error(tmp_path):
    """orbax wraps some failed array reads (a half-truncated data file of a real run's step) in a bare
    Exception; that is damage too. Other errors (a RuntimeError such as running out of memory) pass."""
    from train.checkpointing import Checkpointer

    ckpt = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    with pytest.raises(FlagError, match=r"checkpoint .*/checkpoints/4 cannot be read \(Exception: Encountered error "
                                        r"while reading array index.*\): it is damaged"):
        with ckpt._reading(4):
            raise Exception("Encountered error while reading array index: (slice(0, 384, 1),)")
    for passing in (RuntimeError("RESOURCE_EXHAUSTED: out of memory"), TypeError("a bug")):
        with pytest.raises(type(passing)):
            with ckpt._reading(4):
                raise passing
    ckpt.close()


def test_train_export_without_a_required_flag_says_so_in_one_line(tmp_path):
    """train.export with no --out printed absl's whole docstring and help, then the error, and exited 1."""
    for argv, missing in (([f"--checkpoint={tmp_path}"], "--out is"), ([], "--checkpoint and --out are")):
        proc = subprocess.run([sys.executable, "-m", "train.export", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {missing} required"), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    (tmp_path / "config.json").write_text("{}")  # a file given for the run folder: was "no such directory"
    proc = subprocess.run([sys.executable, "-m", "train.export", f"--checkpoint={tmp_path / 'config.json'}",
                           f"--out={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "config.json: a file; give the run folder" in proc.stderr, proc.stderr


def test_a_run_dir_named_by_a_number_is_a_run_dir_not_a_step(tmp_path):
    """train.export --checkpoint=runs/7 (a run dir of that name) read step 7 of runs/ and called it damaged."""
    from train.checkpointing import split_step_dir

    run = tmp_path / "runs" / "7"
    (run / "checkpoints" / "40").mkdir(parents=True)
    assert split_step_dir(str(run)) == (str(run / "checkpoints"), None)
    assert split_step_dir(str(run / "checkpoints" / "40")) == (str(run / "checkpoints"), 40)
    assert split_step_dir(str(run / "checkpoints")) == (str(run / "checkpoints"), None)


def test_export_of_a_recipes_run_dir_names_its_variants(tmp_path):
    """train.export --checkpoint=runs/tiny_cpu (README command 1's RUN_DIR, one run folder per variant) said only
    `no checkpoint steps in runs/tiny_cpu`; now it names the variants' run folders to choose from."""
    from train.export import export_checkpoint

    for name in ("kvpop-mlp", "dms"):
        (tmp_path / "runs" / name / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "runs" / "eval").mkdir()
    (tmp_path / "runs" / "aborted" / "checkpoints").mkdir(parents=True)  # no step saved: nothing to export
    run = str(tmp_path / "runs")
    with pytest.raises(FileNotFoundError, match=rf"^--checkpoint={run}: no checkpoint steps in {run} \(it holds the "
                                                rf"runs dms, kvpop-mlp: name one, e.g. --checkpoint={run}/dms\)$"):
        export_checkpoint(run, str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match=rf"^--checkpoint={run}/eval: no checkpoint steps in {run}/eval$"):
        export_checkpoint(f"{run}/eval", str(tmp_path / "out"))


def test_export_refuses_an_out_that_is_holds_or_lies_in_the_checkpoints_before_reading_them(tmp_path):
    """The export replaces its --out folder whole, carrying the old entries over: a step a live run saves into
    its run dir meanwhile was lost. Refused by name before the checkpoint is opened; RUN_DIR/export is fine."""
    from train.export import check_out, export_checkpoint

    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    for out, where in ((run, "is or holds"), (tmp_path, "is or holds"), (run / "checkpoints", "is or holds"),
                       (run / "checkpoints" / "4", "lies inside"), (run / "checkpoints" / "4" / "x", "lies inside")):
        with pytest.raises(ValueError, match=f"--out={out} {where} the checkpoints folder {run / 'checkpoints'}; "
                                             f".* \\(e.g. {run / 'export'}\\)"):
            export_checkpoint(str(run / "checkpoints" / "4"), str(out))
    (tmp_path / "file").write_text("mine")
    with pytest.raises(NotADirectoryError, match=f"--out={tmp_path / 'file'}: it exists and is not a folder"):
        export_checkpoint(str(run), str(tmp_path / "file"))
    assert sorted(os.listdir(run)) == ["checkpoints"] and os.listdir(run / "checkpoints") == ["4"]
    check_out(str(run / "export"), str(run / "checkpoints"))  # the end-of-run export's own place
    check_out(str(tmp_path / "elsewhere"), str(run / "checkpoints"))
    ckpts = tmp_path / "orbax_steps"  # a checkpoints folder by another name: the suggestion is beside it, and allowed
    (ckpts / "4").mkdir(parents=True)
    with pytest.raises(ValueError, match=f"lies inside the checkpoints folder {ckpts}; "
                                         f".* \\(e.g. {tmp_path / 'export'}\\)"):
        check_out(str(ckpts / "export"), str(ckpts))
    check_out(str(tmp_path / "export"), str(ckpts))


def test_export_of_a_run_dir_is_its_latest_step_as_saved_or_cast(tmp_path, rng):
    """train.export of a run folder: the latest step's parameters, as saved or cast by --dtype, against the step
    folders' own arrays (an export of the earliest step, or one that dropped --dtype, passed every test)."""
    import struct

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import traverse_util

    from kvpop_jax import load_pretrained
    from kvpop_jax.config import KVpopConfig
    from kvpop_jax.modeling import init_params
    from train.checkpointing import Checkpointer
    from train.export import export_checkpoint
    from train.step import TrainState

    config = dataclasses.replace(Qwen3Config.from_hf(dict(TINY_ARCH)),
                                 kvpop=KVpopConfig(sinks=2, window=8, topk=8, scorer="mlp"))
    directory = str(tmp_path / "run" / "checkpoints")
    ckpt = Checkpointer(directory, async_save=False)
    saved = {}
    for step in (2, 4, 6):  # fresh random weights at each step
        saved[step] = init_params(config, jax.random.key(int(rng.integers(2**31))))
        ckpt.save(TrainState(step=jnp.asarray(step, jnp.int32), params=saved[step], opt_state={"m": jnp.zeros(3)},
                             rng=jnp.asarray([1, 2], jnp.uint32)), {"pos": step},
                  {"model_config": config.to_hf(), "param_dtype": "float32"}, force=True)
    ckpt.close()
    want = traverse_util.flatten_dict(jax.device_get(saved[6]), sep="/")
    with pytest.raises(ValueError, match="--dtype=float16: expected one of float32, bfloat16"):
        export_checkpoint(str(tmp_path / "run"), str(tmp_path / "export"), dtype="float16")  # was a KeyError
    for dtype, stored in ((None, "F32"), ("bfloat16", "BF16"), ("float32", "F32")):
        out = tmp_path / f"export_{dtype}"
        assert export_checkpoint(str(tmp_path / "run"), str(out), dtype=dtype)[1] == 6
        with open(out / "model.safetensors", "rb") as f:  # the file's own header: every tensor in the cast dtype
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {stored}
        _, params = load_pretrained(str(out), jnp.float32, config=config)
        got = traverse_util.flatten_dict(jax.device_get(params), sep="/")
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            expected = np.asarray(jnp.asarray(value).astype(dtype or jnp.float32).astype(jnp.float32))
            np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_export_refuses_an_out_that_is_the_runs_init_checkpoint_or_holds_its_weights(tmp_path, hf_checkpoint):
    """train.export --out=<the run's --init_checkpoint> replaced the base model silently (and the run could not
    resume); train.main refuses the same --export_dir. A copy of those weights elsewhere is refused by fingerprint."""
    import shutil

    from kvpop_jax.checkpoint import checkpoint_fingerprint
    from train.export import check_not_init

    init, _ = hf_checkpoint("g2_untied")
    meta = {"train_config": {"init_checkpoint": init}, "init_fingerprint": checkpoint_fingerprint(init)}
    for out in (init, os.path.join(init, "sub")):
        with pytest.raises(ValueError, match=f"--out={out} is the run's --init_checkpoint={init} or inside it"):
            check_not_init(out, meta)
    copy = str(tmp_path / "copy")
    shutil.copytree(init, copy)
    with pytest.raises(ValueError, match=f"--out={copy} holds the weights the run started from"):
        check_not_init(copy, meta)
    other, _ = hf_checkpoint("g2_untied", seed=1)
    for out in (other, str(tmp_path / "new")):
        check_not_init(out, meta)
    check_not_init(init, {"train_config": {"init_checkpoint": "random:tiny"}})


def test_a_checkpoint_save_on_a_full_disk_is_one_error_naming_the_cause_and_the_step_to_resume_from(tmp_path):
    """A full disk during a save was orbax's wall of tracebacks ending in a ValueError (RESOURCE_EXHAUSTED ...
    [os_error_code='28']), or in TensorBoard's flush error, which hid it: now one FlagError naming the folder,
    the OS error and the whole step a rerun resumes from; the steps saved before stay loadable."""
    import jax.numpy as jnp

    from train.checkpointing import Checkpointer
    from train.loop import MetricsLog
    from train.step import TrainState

    directory = str(tmp_path / "checkpoints")
    state = lambda step: TrainState(step=jnp.asarray(step, jnp.int32), params={"w": jnp.ones((4, 2))},  # noqa: E731
                                    opt_state={"m": jnp.zeros((4, 2))}, rng=jnp.asarray([1, 2], jnp.uint32))
    ckpt = Checkpointer(directory, async_save=False)
    for step in (2, 4):
        ckpt.save(state(step), {"pos": step}, {"note": "x"}, force=True)
    full = ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{directory}/6.orbax-checkpoint-tmp/params/d/1": '
                      "Failed to write 25262 bytes to file 27: No space left on device [os_error_code='28']")

    def no_space(*args, **kwargs):
        raise full

    ckpt.manager.save = no_space
    message = (rf"saving a checkpoint in {directory} failed: No space left on device \(ValueError: "
               r"RESOURCE_EXHAUSTED: .*\); the steps saved before \(2, 4\) are whole: free space \(or fix the disk\) "
               r"and rerun the same command to resume from step 4$")
    with pytest.raises(FlagError, match=message):
        ckpt.save(state(6), {"pos": 6}, {"note": "x"}, force=True)
    ckpt.manager.wait_until_finished = no_space  # an async save's failure surfaces in the wait, and in close
    with pytest.raises(FlagError, match=message):
        ckpt.close()
    ckpt = Checkpointer(directory, read_only=True)
    assert ckpt.latest_step() == 4 and ckpt.restore_meta(4)["step"] == 4
    ckpt.close()
    with pytest.raises(FlagError, match=r"failed: Read-only file system \(OSError: .*\); no step was saved before it"):
        with Checkpointer(str(tmp_path / "other"), async_save=False)._writing():
            raise OSError(30, os.strerror(30))
    with pytest.raises(FlagError, match=r"failed: ValueError: Save failed: 17/18 params are missing .zarray; the "
                                        r"steps saved before \(2, 4\) are whole: fix that and rerun"):
        with ckpt._writing():  # no OS error in it (a folder swapped away under the save): no disk advice
            raise ValueError("Save failed: 17/18 params are missing .zarray")
    with pytest.raises(RuntimeError):  # not a write failure: as it was
        with ckpt._writing():
            raise RuntimeError("a bug")

    class FullWriter:
        def close(self):
            raise OSError(28, os.strerror(28))

    log = MetricsLog.__new__(MetricsLog)
    log.writer = FullWriter()
    log.close(quiet=True)  # while another error stops the run: that error is the one raised
    with pytest.raises(OSError, match="No space left"):
        log.close()


def test_overwrite_empties_a_checkpoints_folder_linked_to_another_disk_and_keeps_the_link(tmp_path, arch):
    """checkpoints/ (or tb/) as a symlink to a bigger disk: --overwrite stopped with shutil.rmtree's
    `Cannot call rmtree on a symbolic link` traceback. Now the link stays and what the run wrote in the linked
    folder (step folders, event files) is deleted, so the new run writes where the old one did; other entries
    there (another run's events in a shared TensorBoard folder) are kept."""
    run = str(tmp_path / "run")
    _fake_run(run)
    big = tmp_path / "big"
    big.mkdir()
    os.rename(os.path.join(run, "checkpoints"), big / "ckpts")
    (big / "mine.txt").write_text("not the run's")
    os.symlink(big / "ckpts", os.path.join(run, "checkpoints"))
    (big / "ckpts" / "3.orbax-checkpoint-tmp").mkdir()  # a killed save's: the run's too
    (big / "ckpts" / "notes.txt").write_text("mine")  # not the run's: kept
    shared_tb = tmp_path / "shared-tb"  # tb/ linked to a TensorBoard folder other runs write into too
    shared_tb.mkdir()
    for name in ("events.out.tfevents.1.host", "other-run"):
        (shared_tb / name).write_text("x")
    os.symlink(shared_tb, os.path.join(run, "tb"))
    os.unlink(os.path.join(run, "metrics.jsonl"))
    os.symlink(tmp_path / "gone", os.path.join(run, "metrics.jsonl"))  # a dangling link: removed
    prepare_run_dir(parse(tiny_flags(run, arch, resume=False, overwrite=True)))
    assert os.path.islink(os.path.join(run, "checkpoints")) and os.listdir(big / "ckpts") == ["notes.txt"]
    assert (big / "mine.txt").read_text() == "not the run's"
    assert os.path.islink(os.path.join(run, "tb")) and os.listdir(shared_tb) == ["other-run"]
    assert sorted(os.listdir(run)) == ["checkpoints", "data", "export", "tb"]


def test_a_run_folder_that_is_a_symlink_to_a_folder_not_made_yet_is_made(tmp_path):
    """A --run_dir (or --teacher_logits_dir, eval's --out_dir) linked to a folder on another disk that does not
    exist yet stopped at os.makedirs with `[Errno 17] File exists`; the export folder, swapped in by its real
    path, already worked that way. Now the link's target is made."""
    from eval.outputs import staged_outputs

    link = tmp_path / "run"
    os.symlink(tmp_path / "big" / "runs" / "a", link)
    with lock_run_dir(str(link)):
        assert os.path.isfile(tmp_path / "big" / "runs" / "a" / LOCK_FILE)
    os.symlink(tmp_path / "big" / "report", tmp_path / "report")
    with staged_outputs(tmp_path / "report") as out:
        with open(out.path("a.md"), "w") as f:
            f.write("x")
    assert (tmp_path / "big" / "report" / "a.md").read_text() == "x"


def test_checkpoints_and_tb_linked_to_a_folder_not_made_yet_are_made_but_a_run_is_not_resumed_without_them(
        tmp_path, arch):
    """RUN_DIR/checkpoints or tb linked to another disk's folder not made yet stopped a run with `[Errno 17] File
    exists` (orbax's and tensorboardX's makedirs); now the target is made, as for a linked --run_dir. A link whose
    target is gone in a folder that holds a run (the disk not mounted) is refused by name: made afresh, the resume
    would have started over and cut the run's metrics.jsonl."""
    import jax.numpy as jnp

    from train.checkpointing import Checkpointer
    from train.loop import MetricsLog
    from train.step import TrainState

    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoints", "tb"):
        os.symlink(tmp_path / "big" / name, run / name)
    prepare_run_dir(parse(tiny_flags(str(run), arch)))  # a fresh run
    ckpt = Checkpointer(str(run / "checkpoints"), async_save=False)
    ckpt.save(TrainState(step=jnp.asarray(2, jnp.int32), params={"w": jnp.zeros(2)}, opt_state={"m": jnp.zeros(2)},
                         rng=jnp.asarray([1, 2], jnp.uint32)), {"pos": 2}, {"note": "x"}, force=True)
    ckpt.close()
    assert os.listdir(tmp_path / "big" / "checkpoints") == ["2"]
    log = MetricsLog(parse(tiny_flags(str(run), arch, tensorboard=True)), 0)
    log.write(1, {"loss": 1.0})
    log.close()
    assert os.listdir(tmp_path / "big" / "tb")[0].startswith("events.out.tfevents.")
    os.rename(tmp_path / "big", tmp_path / "unmounted")
    with pytest.raises(FlagError, match=rf"^{run}/checkpoints links to {tmp_path}/big/checkpoints, which does not "
                                        rf"exist \(a disk not mounted\?\), and {run} holds a run's metrics.jsonl:"
                                        r" resuming would start over without its checkpoints; mount that disk"):
        prepare_run_dir(parse(tiny_flags(str(run), arch)))
    assert not (tmp_path / "big").exists() and (run / "metrics.jsonl").read_text().startswith('{"step": 1')
    os.unlink(run / "checkpoints")  # the checkpoints found again, tb's disk still gone: its events would split
    os.symlink(tmp_path / "unmounted" / "checkpoints", run / "checkpoints")
    with pytest.raises(FlagError, match=rf"^{run}/tb links to {tmp_path}/big/tb, which does not exist \(a disk not "
                                        r"mounted\?\), and .* resuming would write its TensorBoard events apart"):
        prepare_run_dir(parse(tiny_flags(str(run), arch)))
    assert not (tmp_path / "big").exists()
    os.unlink(run / "checkpoints")
    os.symlink(tmp_path / "big" / "checkpoints", run / "checkpoints")
    prepare_run_dir(parse(tiny_flags(str(run), arch, overwrite=True)))  # starting over is still possible
    assert not os.path.lexists(run / "checkpoints")


def test_train_main_tells_a_disk_error_in_one_line_with_advice_only_for_a_full_or_failing_disk(tmp_path, monkeypatch,
                                                                                                 capsys):
    import train.main as tm

    for error, advice in ((OSError(28, os.strerror(28)), True), (FileExistsError(17, os.strerror(17), "x"), False)):
        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(tm, "config_from_flags", fail)
        tm.FLAGS(["train", f"--run_dir={tmp_path}"])
        try:
            with pytest.raises(SystemExit) as stop:
                tm.main(["train"])
        finally:
            tm.FLAGS.unparse_flags()
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {error}") and ("free space" in err) == advice, err
        if advice:
            assert err.endswith(f"rerun the same command: a run resumes from the last checkpoint in {tmp_path}, whose "
                                "saved steps and export are whole")


def test_train_main_tells_out_of_memory_in_one_line_with_what_to_lower(tmp_path, monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED (a micro batch too large for the GPU) was a traceback of hundreds of lines."""
    import jax
    import train.main as tm

    for message in ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 85899345920 bytes.", "INTERNAL: x"):
        def fail(*args, message=message, **kwargs):
            raise jax.errors.JaxRuntimeError(message)

        monkeypatch.setattr(tm, "config_from_flags", fail)
        tm.FLAGS(["train", f"--run_dir={tmp_path}"])
        try:
            if message.startswith("INTERNAL"):  # any other runtime error is not dressed up as this one
                with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: x"):
                    tm.main(["train"])
                continue
            with pytest.raises(SystemExit) as stop:
                tm.main(["train"])
        finally:
            tm.FLAGS.unparse_flags()
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {message} (80.0 GiB) on {jax.default_backend()}. A step needs less with --remat or --loss_chunk, "
            f"or on more devices, and resumes from the last checkpoint in {tmp_path} with them; a smaller "
            "--micro_batch (--global_batch stays, by gradient accumulation) starts over (--overwrite: a resume keeps "
            "it); a recipe's evaluation needs less with a smaller --eval_batch")


def test_a_leading_tilde_in_a_path_flag_is_the_home_folder_not_a_folder_named_tilde(tmp_path, arch, monkeypatch):
    """`--run_dir=~/runs/x` (the shell expands no `~` after `=`, a flagfile none at all) made a folder named `~`
    in the working directory, while --data's `~` was expanded; now every path flag's is, and eval's --out_dir."""
    from eval.outputs import out_dir_arg

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = parse(tiny_flags("~/runs/x", arch, export_dir="~/exports/x", teacher_logits_dir="~/topk",
                           write_teacher_logits=True))
    home = str(tmp_path / "home")
    assert (cfg.run_dir, cfg.export_dir, cfg.teacher_logits_dir) == (f"{home}/runs/x", f"{home}/exports/x",
                                                                      f"{home}/topk")
    assert out_dir_arg("~/report") == f"{home}/report"


def test_an_export_folder_holding_another_live_run_is_refused(tmp_path, arch):
    """--export_dir (or train.export --out) a folder holding another live run's folder: the export swapped the
    folder in whole, carrying over what it had listed, so the checkpoint steps that run saved meanwhile were
    deleted with the old folder (seen: its run then died with 'Save failed', one step left of dozens)."""
    from train.export import check_out
    from train.run_dir import check_no_live_run_inside

    exports = tmp_path / "exports"
    other = exports / "team" / "other-run"
    proc = hold_lock(str(other))
    try:
        message = rf"--export_dir={exports} holds the folder {other}, in use by PID {proc.pid}: the export replaces"
        with pytest.raises(FlagError, match=message):
            parse(tiny_flags(str(tmp_path / "run"), arch, export_dir=str(exports)))
        with pytest.raises(FlagError, match=rf"--out={other} is the folder {other}, in use by PID {proc.pid}"):
            check_out(str(other), str(tmp_path / "run" / "checkpoints"))
        parse(tiny_flags(str(tmp_path / "run"), arch, export_dir=str(exports / "mine")))  # beside it: fine
    finally:
        proc.kill()
        proc.wait()
    check_no_live_run_inside(str(exports), "--export_dir")  # its owner is gone: the lock is free
    with lock_run_dir(str(exports / "run")):  # this process's own run inside the folder (train.main's own export)
        check_no_live_run_inside(str(exports), "--export_dir")


# An eval command writing its --out_dir (argv[1]), as eval's writers hold it.
EVAL_WRITING = """
import sys, time
from eval.outputs import lock_out_dir
with lock_out_dir(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_an_export_folder_holding_a_live_eval_report_folder_is_refused(tmp_path):
    """An eval command's --out_dir is locked like a run folder, so an export that would replace a folder holding
    it (and drop the report files written meanwhile) is refused the same way."""
    from train.run_dir import check_no_live_run_inside

    exports = tmp_path / "exports"
    report = exports / "eval"
    proc = hold_lock(str(report), EVAL_WRITING)
    try:
        with pytest.raises(FlagError, match=rf"--export_dir={exports} holds the folder {report}, in use by PID "
                                            rf"{proc.pid}: the export replaces"):
            check_no_live_run_inside(str(exports), "--export_dir")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    check_no_live_run_inside(str(exports), "--export_dir")  # its owner is gone


def test_a_failed_tensorboard_close_on_a_full_disk_leaves_no_exit_tracebacks(tmp_path, monkeypatch):
    """After a full disk stopped a run, tensorboardX's exit hook retried the failed flush, and its writer thread
    died, printing two tracebacks below train.main's error line; the asyncio futures of orbax's failed save did
    the same. Now the event files are marked closed (their thread stopped), and train.main's error exit silences
    asyncio's 'never retrieved' logs."""
    import logging

    import train.main as tm
    from train.loop import MetricsLog

    cfg = dataclasses.make_dataclass("Cfg", ["run_dir", "tensorboard"])(str(tmp_path), True)
    log = MetricsLog(cfg, 0)
    log.write(1, {"loss": 1.0})
    events = next(iter(log.writer.all_writers.values())).event_writer

    def full():
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(events._ev_writer, "flush", full)
    log.close(quiet=True)
    assert events._closed and not events._worker.is_alive()
    events.close()  # what the exit hook calls: nothing left to flush, no error

    monkeypatch.setattr(logging.getLogger("asyncio"), "level", logging.NOTSET)
    with pytest.raises(SystemExit):
        tm._quiet_exit(2)
    assert logging.getLogger("asyncio").level == logging.CRITICAL


def test_a_run_folder_whose_checkpoints_folder_cannot_be_written_is_refused_before_any_work(tmp_path, arch,
                                                                                               monkeypatch):
    """RUN_DIR writable but RUN_DIR/checkpoints (or tb/) not (another user's, a read-only mount): the run loaded,
    compiled and trained until its first save, then failed there."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "tb").mkdir()
    access = os.access
    for locked in ("checkpoints", "tb"):
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: os.path.realpath(p) != str(run / locked)
                            and access(p, mode, **kw))
        with pytest.raises(FlagError, match=rf"^--run_dir={run}/{locked}: the folder {run}/{locked} is not writable; "
                                            "choose another --run_dir$"):
            parse(tiny_flags(str(run), arch))
    monkeypatch.setattr(os, "access", access)
    parse(tiny_flags(str(run), arch))


def test_demo_data_an_older_generator_wrote_is_refused_on_resume_and_written_again_on_a_fresh_run(tmp_path, arch,
                                                                                                   capsys):
    """RUN_DIR/data/demo_train_*.jsonl is named by the flags that shape it, not by the code: after a `git pull` that
    changed the demo generator (the trace format), a resume, a rerun and even --overwrite trained on the old traces
    without a word. Now a resume is refused (its data would change mid-run), and a fresh run or --overwrite writes
    the file again, with a line."""
    from demo.task import generate_mixture, read_jsonl

    run = str(tmp_path / "run")
    cfg = parse(tiny_flags(run, arch, steps=2, checkpoint_every=2))
    train(cfg)
    path = cfg.data.data
    current = open(path).read()
    assert read_jsonl(path) == [{k: ex[k] for k in ("id", "prompt", "answer", "text")}
                                for ex in generate_mixture(24, 0, "train", ("read_once",), seq_len=256)]

    def as_an_older_generator_wrote_it():
        rows = read_jsonl(path)
        rows[0]["text"] = rows[0]["text"].replace(">", "\n")  # e.g. stop 16's lookups, `l0\ns3` for `>l0>s3`
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    as_an_older_generator_wrote_it()
    old = open(path).read()
    assert old != current
    with pytest.raises(FlagError, match=r"--data=demo:24: .*demo_train_read_once_24x256_seed0.jsonl holds traces the "
                                        r"demo generator no longer writes .* resume with the code that started it, "
                                        r"or pass --overwrite"):
        train(parse(tiny_flags(run, arch, steps=4, checkpoint_every=2)))
    assert open(path).read() == old  # left as the run trained on it
    capsys.readouterr()
    train(parse(tiny_flags(run, arch, steps=2, checkpoint_every=2, overwrite=True)))
    assert open(path).read() == current and "written again with the current one" in capsys.readouterr().err
    fresh = str(tmp_path / "fresh")  # no checkpoint: nothing trained on it
    os.makedirs(os.path.join(fresh, "data"))
    with open(os.path.join(fresh, "data", os.path.basename(path)), "w") as f:
        f.write(old)
    assert stale_demo_data(parse(tiny_flags(fresh, arch)))
    assert not stale_demo_data(cfg)


def test_a_resume_by_other_code_says_so_and_keeps_it_in_the_run_history(tmp_path, arch, monkeypatch, capsys):
    """A run killed, then resumed after a `git pull`, continued with other numerics without a word (a probe resumed a
    run of 800 commits back: every step from the resume on differed in the last bits from either code's own run)."""
    import train.loop as loop

    run = str(tmp_path / "run")
    train(parse(tiny_flags(run, arch, steps=2, checkpoint_every=2)))
    capsys.readouterr()
    train(parse(tiny_flags(run, arch, steps=3, checkpoint_every=1)))  # the same code: nothing said
    assert "library's code" not in capsys.readouterr().err
    monkeypatch.setattr(loop, "source_digest", lambda packages: "another")
    train(parse(tiny_flags(run, arch, steps=4, checkpoint_every=2)))
    line = ("the library's code (kvpop_jax, pallas_kernels, train, demo; e.g. a git pull): from here its numbers may "
            "differ in the last bits from an uninterrupted run's")
    assert line in capsys.readouterr().err
    with open(os.path.join(run, "train_config.json")) as f:
        assert json.load(f)["resume_changes"] == [{"step": 2, "changes": ["optim.steps 2 -> 3"]},
                                                  {"step": 3, "changes": ["optim.steps 3 -> 4", line]}]
    monkeypatch.setattr(loop, "source_digest", lambda packages: "a third")
    train(parse(tiny_flags(run, arch, steps=4, checkpoint_every=2)))  # finished: no step runs, nothing to say
    assert "library's code" not in capsys.readouterr().err
