"""Memory features of the model: per-layer remat, hidden-state output with a chunkable head,
blockwise and tiled dense attention, and the Pallas kernels under shard_map (8 fake CPU devices,
in a subprocess since the device count is fixed when JAX starts)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpop_jax import attention
from kvpop_jax.config import DMSConfig, KVpopConfig, Qwen3Config
from kvpop_jax.modeling import REMAT_POLICIES, Qwen3ForCausalLM, init_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(tied=True, kvpop=True):
    return Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
        kvpop=KVpopConfig(sinks=2, window=4, topk=4, scorer="mlp", num_query_samples=8) if kvpop else None,
    )


# ------------------------------------------------------------------------------ remat


@pytest.mark.parametrize("tied", [True, False])
def test_remat_keeps_the_parameter_tree(tied):
    config = tiny_config(tied)
    want = init_params(config, jax.random.PRNGKey(0))
    ids = jnp.zeros((1, 1), jnp.int32)
    for policy in REMAT_POLICIES:
        got = Qwen3ForCausalLM(config, remat_policy=policy).init(jax.random.PRNGKey(0), ids)["params"]
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), policy
        jax.tree.map(np.testing.assert_array_equal, got, want)
    assert "layers_1" in want and ("lm_head" in want) == (not tied)


def test_unknown_remat_policy_is_an_error():
    with pytest.raises(ValueError, match="remat_policy"):
        model = Qwen3ForCausalLM(tiny_config(), remat_policy="everything")
        model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))


@pytest.mark.long
def test_remat_gives_the_same_loss_and_gradients():
    config = tiny_config(tied=False)
    params = jax.tree.map(lambda x: x * 3.0, init_params(config, jax.random.PRNGKey(0)))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 24), 0, 96)
    q_samples = jnp.broadcast_to(jnp.arange(12, 24, dtype=jnp.int32), (2, 12))

    def loss(p, policy):
        out = Qwen3ForCausalLM(config, remat_policy=policy).apply({"params": p}, ids, query_samples=q_samples)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0]) + out.aux["retention_loss"]

    want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, "none")))(params)
    for policy in ("full", "dots_saveable"):
        got_loss, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, policy)))(params)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
        # recomputation reorders float32 sums: compare each leaf to its own scale
        for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-7 + 1e-5 * float(np.max(np.abs(b))))


# ------------------------------------------------------------------------------ scanned layers


def _perturbed(params, seed):
    """Fresh random weights everywhere (the retrofit's identity-like inits included): + 0.3 N(0, 1)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), params)


def _scan_config(kind):
    kvpop = {"dense": None, "mlp": KVpopConfig(sinks=2, window=4, topk=4, scorer="mlp", num_query_samples=8),
             "mlstm": KVpopConfig(sinks=2, window=4, topk=4, scorer="mlstm", mlstm_dim=16, mlstm_chunk=8,
                                  num_query_samples=8)}[kind]
    return dataclasses.replace(tiny_config(tied=False, kvpop=False), num_hidden_layers=3, kvpop=kvpop)


@pytest.mark.parametrize("kind, policy", [("dense", "none"), *(pytest.param(*c, marks=pytest.mark.long)  # mlstm ~40 s
                                                                 for c in (("mlstm", "dots_saveable"),
                                                                           ("mlp", "full")))])
def test_scanned_layers_equal_the_loop(kind, policy):
    """--scan_layers compiles one layer for all: same parameter tree, same logits, aux, policy and
    gradients as the Python loop (fresh random weights, the retrofit's scorers included)."""
    config = _scan_config(kind)
    init = init_params(config, jax.random.PRNGKey(0))
    params = _perturbed(init, 7)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 24), 0, 96)
    q_samples = jnp.broadcast_to(jnp.arange(12, 24, dtype=jnp.int32), (2, 12)) if config.kvpop else None
    scanned = Qwen3ForCausalLM(config, remat_policy=policy, scan_layers=True)
    got_tree = scanned.init(jax.random.PRNGKey(0), ids[:, :1])["params"]
    assert jax.tree_util.tree_structure(got_tree) == jax.tree_util.tree_structure(init)

    def run(p, scan):
        model = Qwen3ForCausalLM(config, remat_policy=policy, scan_layers=scan)
        return model.apply({"params": p}, ids, query_samples=q_samples, return_policy=config.kvpop is not None)

    def loss(p, scan):
        out = run(p, scan)
        extra = out.aux["retention_loss"] if config.kvpop else 0.0
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 3]) + extra

    dots = [str(jax.make_jaxpr(lambda p, scan=scan: run(p, scan))(params)).count("dot_general")
            for scan in (False, True)]
    assert dots[1] < dots[0], dots  # the scanned program traces the layer once, not three times
    want, got = jax.jit(lambda p: run(p, False))(params), jax.jit(lambda p: run(p, True))(params)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert jax.tree_util.tree_structure(got.aux) == jax.tree_util.tree_structure(want.aux)
    for a, b in zip(jax.tree.leaves(got.aux), jax.tree.leaves(want.aux)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    want_grads = jax.jit(jax.grad(lambda p: loss(p, False)))(params)
    got_grads = jax.jit(jax.grad(lambda p: loss(p, True)))(params)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 + 1e-5 * float(np.max(np.abs(b))))


def test_scanned_dms_layers_equal_the_loop_and_train_with_their_noise():
    config = dataclasses.replace(_scan_config("dense"), dms=DMSConfig(window=4, budget=8, gate_hidden=8))
    params = _perturbed(init_params(config, jax.random.PRNGKey(0)), 3)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 96)
    loop, scanned = (Qwen3ForCausalLM(config, scan_layers=scan) for scan in (False, True))
    want, got = (jax.jit(m.apply)({"params": params}, ids) for m in (loop, scanned))
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)  # hard gates: no noise
    np.testing.assert_allclose(got.aux["metrics"]["eviction_rate"], want.aux["metrics"]["eviction_rate"])

    def soft_loss(p, key):  # relaxed gates: one noise key per layer, drawn from the "dms" stream
        out = scanned.apply({"params": p}, ids, rngs={"dms": key})
        return jnp.mean(out.logits[..., 0]) + jnp.mean(out.aux["dms_frac"])

    grads = jax.jit(jax.grad(soft_loss))(params, jax.random.PRNGKey(5))
    gate_grads = [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "dms" in jax.tree_util.keystr(path)]
    assert gate_grads and all(np.isfinite(g).all() for g in gate_grads)
    assert any(np.abs(g).max() > 0 for g in gate_grads)


def test_scanned_layers_leave_intermediates_to_the_loop():
    config = _scan_config("dense")
    params = init_params(config, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, 8), 0, 96)
    model = Qwen3ForCausalLM(config, scan_layers=True)
    _, inter = model.apply({"params": params}, ids, mutable=["intermediates"])
    assert len(inter["intermediates"]) == config.num_hidden_layers  # sown per layer: the loop ran
    want = Qwen3ForCausalLM(config).apply({"params": params}, ids).logits
    np.testing.assert_allclose(model.apply({"params": params}, ids).logits, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ hidden states


@pytest.mark.parametrize("tied", [True, False])
def test_hidden_states_and_head_equal_logits(tied):
    config = tiny_config(tied, kvpop=False)
    model = Qwen3ForCausalLM(config)
    params = init_params(config, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 96)
    full = model.apply({"params": params}, ids)
    out = model.apply({"params": params}, ids, return_hidden=True)
    assert out.logits is None and out.hidden.shape == (2, 16, 32)
    chunks = [model.apply({"params": params}, out.hidden[:, i:i + 4], method=Qwen3ForCausalLM.logits_from_hidden)
              for i in range(0, 16, 4)]
    logits = jnp.concatenate(chunks, axis=1)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, full.logits, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ blockwise dense attention


def random_attention_inputs(seed, b, s, t, hq, hkv, d):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((b, s, hq, d), (b, t, hkv, d), (b, t, hkv, d)))
    return rng, q, k, v


@pytest.mark.parametrize("s,block_q", [(37, 8), (64, 16), (5, 512)])
def test_blockwise_dense_attention_equals_reference(s, block_q):
    rng, q, k, v = random_attention_inputs(0, 2, s, s, 4, 2, 8)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, s)), axis=1), jnp.int32)
    for kw in (dict(q_positions=pos, kv_positions=pos),
               dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, scale=0.3)):
        want = attention.dense_attention_reference(q, k, v, **kw)
        got = attention.dense_attention_blockwise(q, k, v, block_q=block_q, **kw)
        for a, w in zip(got, want):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)

        def loss(fn, q, k, v, **extra):
            out, lse = fn(q, k, v, **kw, **extra)
            return jnp.sum(out * out) + jnp.sum(jnp.sin(lse))

        g_want = jax.grad(lambda *a: loss(attention.dense_attention_reference, *a), argnums=(0, 1, 2))(q, k, v)
        g_got = jax.grad(lambda *a: loss(attention.dense_attention_blockwise, *a, block_q=block_q),
                         argnums=(0, 1, 2))(q, k, v)
        for a, w in zip(g_got, g_want):
            np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5)


def test_blockwise_dense_attention_against_a_cache():
    """New queries against a longer key range with empty slots (kv_valid), as in decoding."""
    rng, q, k, v = random_attention_inputs(1, 2, 13, 40, 4, 2, 8)
    q_pos = jnp.broadcast_to(20 + jnp.arange(13, dtype=jnp.int32), (2, 13))
    kv_pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    kw = dict(q_positions=q_pos, kv_positions=kv_pos, kv_valid=kv_pos < 33)
    want = attention.dense_attention_reference(q, k, v, **kw)
    got = attention.dense_attention_blockwise(q, k, v, block_q=4, **kw)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


def test_dense_attention_goes_tiled_from_the_threshold(monkeypatch):
    _, q, k, v = random_attention_inputs(2, 1, 24, 24, 4, 2, 8)
    pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (1, 24))
    want = attention.dense_attention_reference(q, k, v, q_positions=pos, kv_positions=pos)

    def no_reference(*args, **kwargs):
        raise AssertionError("built the S x T logits")

    monkeypatch.setattr(attention, "dense_attention_reference", no_reference)
    with pytest.raises(AssertionError, match="S x T"):  # 24 queries: below the threshold
        attention.dense_attention(q, k, v, q_positions=pos, kv_positions=pos)
    monkeypatch.setattr(attention, "DENSE_TILED_MIN_QUERIES", 16)
    got = attention.dense_attention(q, k, v, q_positions=pos, kv_positions=pos)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl must be one of"):
        attention.dense_attention(q, k, v, q_positions=pos, kv_positions=pos, impl="flash")


# ------------------------------------------------------------------------------ kernels under shard_map


SHARDED_KERNELS_SCRIPT = textwrap.dedent(r"""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from kvpop_jax import attention, policy, sharding as shd, targets
    future_attention_log_mass_auto = targets.future_attention_log_mass
    running_topk_cutoff_auto = policy.running_topk_cutoff

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    B, S, HQ, HKV, D = 4, 32, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(B, S, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, S, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, S, HKV, D)), jnp.float32)
    ranks = jnp.asarray(np.stack([rng.permutation(S) for _ in range(B * HKV)]).reshape(B, HKV, S), jnp.int32)
    impl = "pallas_interpret"

    def run(q, k, v, ranks):
        cutoffs = running_topk_cutoff_auto(ranks, sinks=2, window=4, topk=6, implementation=impl)
        out, lse = attention.kvpop_attention(q, k, v, ranks, cutoffs, sinks=2, window=4, implementation=impl)
        log_mass = future_attention_log_mass_auto(q, k, lse, window=4, implementation=impl)
        return cutoffs, out, lse, jnp.where(jnp.isfinite(log_mass), log_mass, 0.0)

    def grad(q, k, v, ranks):
        cutoffs = running_topk_cutoff_auto(ranks, sinks=2, window=4, topk=6, implementation=impl)
        loss = lambda q, k, v: jnp.sum(jnp.sin(attention.kvpop_attention(
            q, k, v, ranks, cutoffs, sinks=2, window=4, implementation=impl)[0]))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    want = jax.jit(run)(q, k, v, ranks) + jax.jit(grad)(q, k, v, ranks)
    ref_cutoffs = policy.running_topk_cutoff_reference(ranks, sinks=2, window=4, topk=6)
    results = {"cutoffs_vs_xla": int(jnp.sum(want[0] != ref_cutoffs))}
    for mesh_shape in ((2, 2, 2), (1, 4, 2), (1, 1, 8)):
        mesh = shd.make_mesh(*mesh_shape)
        # The mesh is read while tracing and is not part of jit's cache key: fresh functions.
        with shd.activate(mesh):
            jaxpr = str(jax.make_jaxpr(lambda *a: run(*a))(q, k, v, ranks))
            sharded = jax.jit(lambda *a: run(*a))(q, k, v, ranks) + jax.jit(lambda *a: grad(*a))(q, k, v, ranks)
        results[str(mesh_shape)] = {
            "shard_maps": jaxpr.count("shard_map"),
            "max_diff": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(sharded, want)),
        }
    print(json.dumps(results))
""")


@pytest.mark.long
def test_pallas_kernels_under_shard_map_equal_unsharded(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
    proc = subprocess.run([sys.executable, "-c", SHARDED_KERNELS_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["cutoffs_vs_xla"] == 0
    for mesh_shape in ("(2, 2, 2)", "(1, 4, 2)"):
        assert out[mesh_shape]["shard_maps"] >= 3, out  # cutoff, attention, future LSE
        assert out[mesh_shape]["max_diff"] <= 1e-5, out
    # tensor = 8 divides no head count here and batch 4 does not split 8 ways: runs unsharded
    assert out["(1, 1, 8)"]["shard_maps"] == 0, out
    assert out["(1, 1, 8)"]["max_diff"] <= 1e-5, out
