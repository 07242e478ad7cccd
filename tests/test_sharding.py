"""Sharding: the logical-axis rules table, FSDP/tensor shardings, and a sharded train step
on 8 fake CPU devices that equals the single-device step (in a subprocess, since the device
count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from kvpop_jax import sharding as shd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeMesh:
    """Just enough of a Mesh for logical_to_spec (axis sizes)."""

    def __init__(self, **shape):
        self.shape = shape


def test_logical_to_spec_follows_rules_and_drops_indivisible_axes():
    mesh = FakeMesh(data=2, fsdp=2, tensor=2)
    assert shd.logical_to_spec(("embed", "heads", "head_dim"), mesh, (64, 4, 16)) == P("fsdp", "tensor", None)
    assert shd.logical_to_spec(("batch", None), mesh, (8, 3)) == P(("data", "fsdp"), None)
    # 6 rows do not split 4 ways: drop the innermost axis, keep data
    assert shd.logical_to_spec(("batch",), mesh, (6,)) == P("data")
    # 3 kv heads do not split over tensor=2: replicated
    assert shd.logical_to_spec(("embed", "kv_heads", "head_dim"), mesh, (64, 3, 16)) == P("fsdp", None, None)
    # size-1 mesh axes are never named
    assert shd.logical_to_spec(("embed", "mlp"), FakeMesh(data=8, fsdp=1, tensor=1), (64, 96)) == P(None, None)


@pytest.mark.parametrize("scorer", ["linear", "mlp", "mlstm"])
def test_every_parameter_has_logical_axes(scorer):
    from kvpop_jax.config import KVpopConfig, Qwen3Config
    from kvpop_jax.modeling import abstract_params

    for tied, bias in ((True, False), (False, True)):
        config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
                             attention_bias=bias, kvpop=KVpopConfig(sinks=1, window=4, topk=4, scorer=scorer))
        flat = traverse_util.flatten_dict(abstract_params(config), sep="/")
        for path, x in flat.items():
            axes = shd.param_logical_axes(path, x.ndim)
            assert len(axes) == x.ndim
            if "kvpop" in path:
                assert all(a is None for a in axes)
        assert shd.param_logical_axes("layers_0/self_attn/o_proj/kernel", 3) == ("heads", "head_dim", "embed")


def test_unknown_parameter_is_an_error():
    with pytest.raises(KeyError, match="PARAM_LOGICAL_AXES"):
        shd.param_logical_axes("layers_0/new_thing/kernel", 2)


def test_optimizer_state_follows_param_shardings():
    import optax

    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = {"embed_tokens": {"embedding": jnp.zeros((8, 4))},
              "layers_0": {"self_attn": {"kvpop": {"decay_alpha": jnp.zeros((2,))}}}}
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
    sh = shd.state_shardings_like(opt_state, params, mesh)
    mu = sh[0].mu["embed_tokens"]["embedding"]
    assert mu == shd.param_shardings(params, mesh)["embed_tokens"]["embedding"]
    assert sh[0].count.spec == P()


def test_make_mesh_errors_name_the_axes():
    with pytest.raises(ValueError, match="product must equal the device count"):
        shd.make_mesh(2, 2, 2, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="at most one"):
        shd.make_mesh(-1, -1, 1)


def test_multi_host_detection(monkeypatch):
    for name in shd.MULTI_HOST_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not shd.multi_host_detected()
    assert shd.maybe_initialize_distributed("auto") is False
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not shd.multi_host_detected()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert shd.multi_host_detected()
    with pytest.raises(ValueError, match="auto | on | off"):
        shd.maybe_initialize_distributed("yes")


SHARDED_SCRIPT = textwrap.dedent(r"""
    import functools, json, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from absl import flags
    from kvpop_jax import attention, modeling, sharding as shd
    from train import dry_run, optim, setup, step as st
    from train.config import load_model_config
    from train.configure import config_from_flags
    from train.flags import define_flags

    assert len(jax.devices()) == 8, jax.devices()
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["train"] + sys.argv[1:])
    cfg = config_from_flags(fv, on_accelerator=False)
    config = load_model_config(cfg)
    sc = setup.step_config(cfg, config)
    kv = sc.model
    tx = optim.make_optimizer(cfg.optim)
    A, b, S = cfg.grad_accum, cfg.micro_batch, cfg.seq_len
    rng = np.random.default_rng(0)
    base = jax.tree.map(lambda x: np.asarray(x) * 3.0, modeling.init_params(config, jax.random.PRNGKey(0)))
    params = jax.tree.map(np.asarray, modeling.retrofit_params(kv, base, jax.random.PRNGKey(1)))
    batch = {"input_ids": rng.integers(0, 128, (A, b, S)).astype(np.int32),
             "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (A, b, S)).copy(),
             "loss_mask": (rng.random((A, b, S)) > 0.1).astype(np.float32),
             # packed rows' padding tails of random lengths (a row's last 0..S/4 tokens)
             "segment_ids": (np.arange(S) < S - rng.integers(0, S // 4 + 1, (A, b, 1))).astype(np.int32)}
    results = {}
    for name, mesh in (("single", shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])),
                       ("sharded", setup.build_mesh(cfg))):
        abstract_state = jax.eval_shape(lambda p: st.init_state(p, tx, cfg.seed), params)
        fn, state_sh, teacher_sh, batch_sh = st.jit_train_step(
            sc, tx, mesh, abstract_state, jax.eval_shape(lambda: base), batch)
        state = jax.jit(lambda p: st.init_state(p, tx, cfg.seed), out_shardings=state_sh)(params)
        teacher = jax.device_put(base, teacher_sh)
        metrics = []
        for i in range(2):
            state, m = fn(state, teacher, jax.device_put(batch, batch_sh))
            metrics.append({k: float(v) for k, v in m.items()})
            if i == 0:
                first = jax.device_get(state.params)
        results[name] = (first, metrics)
        if name == "sharded":
            q = state.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
            mu = state.opt_state[1].inner_states["base"].inner_state[0].mu["layers_0"]["mlp"]["down_proj"]["kernel"]
            specs = {"q_proj": str(q.sharding.spec), "down_proj_mu": str(mu.sharding.spec),
                     "q_shard": list(q.addressable_shards[0].data.shape)}
    (p1, m1), (p2, m2) = results["single"], results["sharded"]
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p1, p2))
    metric_diff = max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(m1, m2) for k in a)
    moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p1, params)))

    # the kernel wrapper: shard_map over batch and heads equals the unsharded call
    mesh = shd.make_mesh(2, 2, 2)
    q = jnp.asarray(rng.normal(size=(4, 32, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(4, 32, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(4, 32, 2, 16)), jnp.float32)
    ranks = jnp.asarray(np.stack([rng.permutation(32) for _ in range(8)]).reshape(4, 2, 32), jnp.int32)
    cutoffs = jnp.full((4, 2, 32), 5, jnp.int32)
    ref = attention.kvpop_attention_reference(q, k, v, ranks, cutoffs, sinks=2, window=4)
    kernel = functools.partial(attention.kvpop_attention_reference, sinks=2, window=4)
    layouts = ("BSHD", "BSHD", "BSHD", "BHS", "BHS"), ("BSHD", "BHS")  # as attention._pallas wraps its kernels
    wrapped = jax.jit(shd.shard_kernel(kernel, *layouts, mesh))(q, k, v, ranks, cutoffs)
    kernel_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ref, wrapped))

    # --dry_run on the same flags: compiles the same sharded step on abstract arrays
    report = dry_run.dry_run(cfg)
    print(json.dumps({"param_diff": max(diffs), "metric_diff": metric_diff, "moved": moved, "specs": specs,
                      "kernel_diff": kernel_diff, "metrics": m2, "dry_run": report}))
""")


ARCH = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
FLAGS = ["--run_dir={tmp}/run", "--model_config={tmp}/arch.json", "--dry_run", "--seq_len=64", "--sinks=2",
         "--window=8", "--topk=16", "--scorer=mlp", "--num_query_samples=16", "--kl_topk=16", "--global_batch=8",
         "--micro_batch=4", "--steps=10", "--warmup_steps=2", "--compute_dtype=float32", "--teacher_dtype=float32",
         "--remat=full", "--loss_chunk=32", "--mesh_data=2", "--mesh_fsdp=2", "--mesh_tensor=2"]


@pytest.mark.long
@pytest.mark.parametrize("scan", [False, True])  # --scan_layers: its sharded step equals its single-device step
def test_sharded_step_equals_single_device_and_dry_run_reports_memory(tmp_path, scan):
    arch = dict(ARCH, num_hidden_layers=2) if scan else ARCH
    (tmp_path / "arch.json").write_text(json.dumps(arch))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
    argv = [f.format(tmp=tmp_path) for f in FLAGS] + (["--scan_layers"] if scan else [])
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT] + argv, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["moved"] > 1e-6  # the step really updated the weights
    assert out["param_diff"] <= 1e-5, out  # after one step
    assert out["metric_diff"] <= 1e-5, out  # relative, both steps
    assert out["kernel_diff"] <= 1e-5, out
    # FSDP over embed, tensor over heads; Adam moments sharded like their params
    assert out["specs"]["q_proj"] == str(P("fsdp", "tensor", None))
    assert out["specs"]["down_proj_mu"] == str(P("tensor", "fsdp"))
    assert out["specs"]["q_shard"] == [32, 2, 16]
    assert all(np.isfinite(v) for m in out["metrics"] for v in m.values())
    # dry run: per-device parameter bytes are about 1/4 of the total (fsdp x tensor = 4; norms and
    # KVpop params replicated), Adam holds two float32 copies, and the step needs scratch memory
    from kvpop_jax.config import Qwen3Config
    from kvpop_jax.modeling import abstract_params

    total = sum(x.size * 4 for x in jax.tree.leaves(abstract_params(Qwen3Config.from_hf(arch))))
    report = out["dry_run"]
    assert report["devices"] == 8
    assert total / 4 <= report["params"] < total / 2  # (+ the replicated 16 KB MLP scorer)
    assert 2 * report["params"] <= report["opt_state"] <= 2 * report["params"] + 4096
    assert report["temp_size_in_bytes"] > 0 and report["peak_estimate"] > report["params"]


@pytest.mark.long
def test_dms_dry_run_on_8_fake_devices(tmp_path):
    """`--retrofit=dms --dry_run` compiles the sharded DMS step (the DMS recipes' path) on 8 devices."""
    (tmp_path / "arch.json").write_text(json.dumps(ARCH))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
    argv = [f.format(tmp=tmp_path) for f in FLAGS] + ["--retrofit=dms", "--scorer=mlstm"]
    proc = subprocess.run([sys.executable, "-m", "train.main"] + argv, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # memory 2 + 8 + 16 + the mLSTM state (5 entries) = 31, w 8, at S = 64: target 1 - 23 / 56
    assert "DMS (w=8, memory 31 per KV head, target eviction 0.5893" in proc.stdout
    assert "on 8 cpu devices" in proc.stdout and "peak_estimate" in proc.stdout


@pytest.mark.slow  # the real Qwen3-4B / 8B step at S = 16384: minutes of compilation each on 2 CPU cores
@pytest.mark.parametrize("model,cr,memory", [("4b", "75", 4325), ("4b", "88", 2309), ("8b", "75", 4325),
                                             ("8b", "88", 2309)])
def test_dms_recipes_dry_run_on_8_fake_devices(tmp_path, model, cr, memory):
    """configs/dms_qwen3_{4b,8b}_cr{75,88}.flags compile their sharded step (FSDP over 8 devices)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    argv = [f"--flagfile=configs/dms_qwen3_{model}_cr{cr}.flags", f"--run_dir={tmp_path}/run", "--dry_run"]
    proc = subprocess.run([sys.executable, "-m", "train.main"] + argv, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    hidden = {"4b": 2560, "8b": 4096}[model]
    assert f"dry run: 36 layers, hidden {hidden}, S=16384" in proc.stdout
    assert f"DMS (w=256, memory {memory} per KV head" in proc.stdout
    assert "mesh data=1 x fsdp=8 x tensor=1 on 8 cpu devices" in proc.stdout and "peak_estimate" in proc.stdout


# train.main that exits hard (as a preempted job) right after checkpoint CRASH_AT is on disk, and prints
# how the restored parameters are placed.
PREEMPTED_MAIN = textwrap.dedent("""
    import json, os, sys
    import jax
    import train.checkpointing as C
    from absl import app
    from train import main
    from train.config import parse_flags

    crash_at = int(os.environ.get("CRASH_AT", "0"))
    save, restore = C.Checkpointer.save, C.Checkpointer.restore

    def saving(self, state, *args, **kwargs):
        saved = save(self, state, *args, **kwargs)
        if crash_at and int(jax.device_get(state.step)) == crash_at:
            self.wait()
            os._exit(9)
        return saved

    def restoring(self, step, abstract_state):
        out = restore(self, step, abstract_state)
        q = out[0].params["layers_0"]["self_attn"]["q_proj"]["kernel"]
        wrong = [jax.tree_util.keystr(p) for (p, x), a in zip(jax.tree_util.tree_leaves_with_path(out[0]),
                                                                jax.tree.leaves(abstract_state))
                 if not x.sharding.is_equivalent_to(a.sharding, x.ndim)]
        print("RESTORED " + json.dumps({"spec": str(q.sharding.spec), "devices": len(q.sharding.device_set),
                                        "shard": list(q.addressable_shards[0].data.shape), "wrong": wrong}))
        return out

    C.Checkpointer.save, C.Checkpointer.restore = saving, restoring
    app.run(main.main, flags_parser=parse_flags)
""")


@pytest.mark.long
def test_a_run_preempted_on_8_devices_resumes_on_4_with_their_shardings_and_the_4_device_losses(tmp_path):
    """A checkpoint written on one mesh restores onto another's shardings (not all on one device) and goes on
    as the uninterrupted run on the new mesh does, to float rounding (reduction order)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import TINY_ARCH, tiny_flags

    (tmp_path / "arch.json").write_text(json.dumps(TINY_ARCH))

    def run(name, devices, crash_at=0, **mesh):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", CRASH_AT=str(crash_at),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
        argv = tiny_flags(str(tmp_path / name), str(tmp_path / "arch.json"), steps=4, global_batch=8, micro_batch=4,
                          tensorboard=False, **mesh)
        return subprocess.run([sys.executable, "-c", PREEMPTED_MAIN] + argv, cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)

    four = dict(mesh_data=1, mesh_fsdp=2, mesh_tensor=2)
    full = run("full", 4, **four)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = run("moved", 8, crash_at=2, mesh_data=2, mesh_fsdp=2, mesh_tensor=2)
    assert killed.returncode == 9, killed.stderr[-3000:]
    resumed = run("moved", 4, **four)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "checkpoints/2" in resumed.stderr
    placed = json.loads(resumed.stdout.split("RESTORED ", 1)[1].splitlines()[0])
    assert placed == {"spec": str(P("fsdp", "tensor", None)), "devices": 4, "shard": [16, 2, 8], "wrong": []}

    def metrics(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    a, b = metrics("full"), metrics("moved")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b):
        for k in ("loss", "kl", "retention_loss", "grad_norm", "keep_rate", "teacher_recall", "lr_new"):
            assert mb[k] == pytest.approx(ma[k], rel=1e-5, abs=1e-6), (ma["step"], k)
    from kvpop_jax import load_pretrained

    _, pa = load_pretrained(str(tmp_path / "full" / "export"))
    _, pb = load_pretrained(str(tmp_path / "moved" / "export"))
    flat_a, flat_b = traverse_util.flatten_dict(pa), traverse_util.flatten_dict(pb)
    for key in flat_a:
        if "b2" in key:  # the MLP scorer's output bias: no gradient from the ranking losses, Adam moves it on noise
            continue
        np.testing.assert_allclose(flat_b[key], flat_a[key], rtol=1e-5, atol=1e-6, err_msg=str(key))
