"""Scorers: the three mLSTM forms agree, decoding reproduces them, delayed readout is
causal, inputs are detached, zero-init is neutral, weights are headwise."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpop_jax.config import KVpopConfig
from kvpop_jax.scorers import (
    MLSTM_MODES,
    LinearScorer,
    MLPScorer,
    MLSTMScorer,
    hedgehog,
    make_scorer,
    mlstm_chunkwise,
    mlstm_quadratic,
    mlstm_recurrent,
)

B, H, D = 2, 2, 8


def _config(**kw):
    base = dict(scorer="mlstm", scorer_hidden=16, mlstm_dim=8, mlstm_chunk=4, window=3)
    return KVpopConfig(**{**base, **kw})


def _kv(rng, s, b=B, h=H, d=D):
    return tuple(jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for _ in range(2))


def _randomized(module, rng, k, v, scale=0.5):
    """Initial variables plus noise: nonzero final projection, input-dependent gates."""
    variables = module.init(jax.random.key(0), k, v)
    return jax.tree.map(lambda x: x + jnp.asarray(scale * rng.normal(size=x.shape), jnp.float32), variables)


def _mlstm_inputs(rng, s, d=6, dv=5):
    q = hedgehog(jnp.asarray(rng.normal(size=(B, H, s, d // 2)), jnp.float32))
    k = hedgehog(jnp.asarray(rng.normal(size=(B, H, s, d // 2)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(B, H, s, dv)), jnp.float32)
    i = jnp.asarray(rng.normal(scale=3.0, size=(B, H, s)), jnp.float32)
    log_f = jax.nn.log_sigmoid(jnp.asarray(rng.normal(loc=1.0, scale=2.0, size=(B, H, s)), jnp.float32))
    return q, k, v, i, log_f


def _numpy_unstabilized(q, k, v, i, log_f, delay):
    """Eq. 38-41 on the true (unstabilized) state, denominator max(|q^T n|, 1, exp(m - 60)) with m
    the log of the largest write weight (the max-state, m_0 = 0): the floor of
    `scorers.stabilized_normalize`, which is 1 unless a gate pre-activation exceeds 60."""
    q, k, v, i, log_f = (np.asarray(x, np.float64) for x in (q, k, v, i, log_f))
    f = np.exp(log_f)
    s = q.shape[2]
    C = np.zeros(k.shape[:2] + (k.shape[-1], v.shape[-1]))
    n = np.zeros(k.shape[:2] + (k.shape[-1],))
    m = np.zeros(k.shape[:2])
    states = []
    for t in range(s):
        write = np.exp(i[:, :, t])
        kv = np.einsum("bhd,bhe->bhde", k[:, :, t], v[:, :, t])
        C = f[:, :, t, None, None] * C + write[..., None, None] * kv
        n = f[:, :, t, None] * n + write[..., None] * k[:, :, t]
        m = np.maximum(log_f[:, :, t] + m, i[:, :, t])
        states.append((C, n, m))
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for u in range(s):
        C, n, m = states[min(u + delay, s - 1)]
        num = np.einsum("bhd,bhde->bhe", q[:, :, u], C)
        den = np.einsum("bhd,bhd->bh", q[:, :, u], n)
        out[:, :, u] = num / np.maximum(np.maximum(np.abs(den), 1.0), np.exp(m - 60.0))[..., None]
    return out


# (S, delay, chunk): S < chunk, S == chunk, S not a multiple, delay 0/1, delay > S.
FORM_CASES = [(1, 0, 4), (3, 2, 4), (8, 1, 4), (7, 0, 4), (13, 3, 5), (10, 25, 4)]


@pytest.mark.parametrize("s,delay,chunk", FORM_CASES)
def test_mlstm_forms_agree_with_unstabilized_reference(rng, s, delay, chunk):
    inputs = _mlstm_inputs(rng, s)
    eff = min(delay, s - 1)
    ref = _numpy_unstabilized(*inputs, delay=eff)
    quad = jax.jit(mlstm_quadratic, static_argnames="delay")(*inputs, delay=eff)
    rec = jax.jit(mlstm_recurrent, static_argnames="delay")(*inputs, delay=eff)
    chk = jax.jit(mlstm_chunkwise, static_argnames=("delay", "chunk"))(*inputs, delay=eff, chunk=chunk)
    assert quad.shape == (B, H, s, 5)
    np.testing.assert_allclose(quad, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rec, quad, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(chk, quad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("s,window,delayed", [(3, 3, True), (11, 1, True), (6, 20, True), (9, 3, False)])
def test_mlstm_scorer_modes_agree(rng, s, window, delayed):
    module = MLSTMScorer(num_kv_heads=H, head_dim=D, config=_config(window=window, delayed_readout=delayed))
    k, v = _kv(rng, s)
    variables = _randomized(module, rng, k, v)
    apply = jax.jit(module.apply, static_argnames="mode")
    scores = {mode: apply(variables, k, v, mode=mode) for mode in MLSTM_MODES}
    assert scores["chunkwise"].shape == (B, H, s) and scores["chunkwise"].dtype == jnp.float32
    assert float(jnp.std(scores["quadratic"])) > 1e-2  # the comparison is not vacuous
    for mode in ("recurrent", "chunkwise"):
        np.testing.assert_allclose(scores[mode], scores["quadratic"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window,delayed", [(3, True), (1, True), (2, False)])
def test_decode_steps_reproduce_parallel_scores(rng, window, delayed):
    s = 10
    module = MLSTMScorer(num_kv_heads=H, head_dim=D, config=_config(window=window, delayed_readout=delayed))
    k, v = _kv(rng, s)
    variables = _randomized(module, rng, k, v)
    parallel = jax.jit(module.apply)(variables, k, v)
    w = window if delayed else 0
    state = module.apply(variables, B, method=MLSTMScorer.init_state)
    step = jax.jit(functools.partial(module.apply, method=MLSTMScorer.step))
    readout = jax.jit(functools.partial(module.apply, method=MLSTMScorer.readout))
    assert state.C.shape == (B, H, 8, 4) and state.n.shape == (B, H, 8) and state.m.shape == (B, H)
    decoded = np.full((B, H, s), np.nan, np.float32)
    for q in range(s):  # at step q: write token q, then score the newly eligible u = q - w
        state = step(variables, state, k[:, q], v[:, q])
        if q - w >= 0:
            decoded[:, :, q - w] = readout(variables, state, k[:, q - w], v[:, q - w])
    for u in range(max(s - w, 0), s):  # never eligible in-sequence: they read the final state
        decoded[:, :, u] = readout(variables, state, k[:, u], v[:, u])
    np.testing.assert_allclose(decoded, parallel, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MLSTM_MODES)
def test_delayed_readout_reads_only_tokens_up_to_u_plus_w(rng, mode):
    s, w = 12, 3
    module = MLSTMScorer(num_kv_heads=H, head_dim=D, config=_config(window=w))
    k, v = _kv(rng, s)
    variables = _randomized(module, rng, k, v)
    apply = jax.jit(functools.partial(module.apply, mode=mode))
    base = apply(variables, k, v)
    for u in (0, 2, 5):
        q = u + w
        later_k = k.at[:, q + 1:].add(jnp.asarray(rng.normal(size=k[:, q + 1:].shape), jnp.float32))
        later_v = v.at[:, q + 1:].add(jnp.asarray(rng.normal(size=v[:, q + 1:].shape), jnp.float32))
        after = apply(variables, later_k, later_v)
        np.testing.assert_allclose(after[:, :, : u + 1], base[:, :, : u + 1], rtol=1e-6, atol=1e-6)
        at_q = apply(variables, k.at[:, q].add(1.0), v.at[:, q].add(1.0))  # token q itself is read
        assert np.all(np.asarray(at_q - base)[:, :, u] != 0)


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlstm"])
def test_inputs_are_detached_but_params_get_gradients(rng, kind):
    module = make_scorer(_config(scorer=kind), H, D)
    k, v = _kv(rng, 7)
    variables = _randomized(module, rng, k, v)
    weights = jnp.asarray(rng.normal(size=(B, H, 7)), jnp.float32)

    def loss(variables, k, v):
        return jnp.sum(module.apply(variables, k, v) * weights)

    g_params, g_k, g_v = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(variables, k, v)
    assert np.all(np.asarray(g_k) == 0) and np.all(np.asarray(g_v) == 0)
    for path, g in jax.tree_util.tree_leaves_with_path(g_params):
        assert np.all(np.isfinite(g)) and np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlstm"])
def test_zero_init_gives_equal_scores(rng, kind):
    module = make_scorer(_config(scorer=kind), H, D)
    k, v = _kv(rng, 9)
    scores = np.asarray(jax.jit(module.apply)(module.init(jax.random.key(1), k, v), k, v))
    assert scores.shape == (B, H, 9) and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, np.full_like(scores, scores.flat[0]))


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlstm"])
def test_weights_are_headwise(rng, kind):
    module = make_scorer(_config(scorer=kind), H, D)
    k, v = _kv(rng, 6)
    variables = _randomized(module, rng, k, v)
    apply = jax.jit(module.apply)
    base = apply(variables, k, v)
    moved = apply(variables, k.at[:, :, 0].add(1.0), v.at[:, :, 0].add(1.0))
    assert np.all(np.abs(np.asarray(moved - base)[:, 0]) > 1e-5)
    np.testing.assert_array_equal(moved[:, 1:], base[:, 1:])


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_stateless_scorers_match_numpy_definition(rng, kind):
    """Eq. 36 per KV head on x = [k; v]: linear `w_h^T x + b_h`; MLP (Sec. 3.3) two layers with SiLU,
    `w2_h^T SiLU(W1_h x + b1_h) + b2_h`."""
    module = make_scorer(_config(scorer=kind), H, D)
    k, v = _kv(rng, 7)
    variables = _randomized(module, rng, k, v)
    p = {n: np.asarray(x, np.float64) for n, x in variables["params"].items()}
    x = np.concatenate([np.asarray(k, np.float64), np.asarray(v, np.float64)], -1)  # [B, S, H, 2D]
    if kind == "linear":
        want = np.einsum("bshi,hi->bhs", x, p["w"]) + p["b"][None, :, None]
    else:
        z = np.einsum("bshi,hie->bshe", x, p["w1"]) + p["b1"]
        want = np.einsum("bshe,he->bhs", z / (1 + np.exp(-z)), p["w2"]) + p["b2"][None, :, None]
    assert float(np.std(want)) > 1e-2
    np.testing.assert_allclose(jax.jit(module.apply)(variables, k, v), want, rtol=1e-5, atol=1e-5)


def test_make_scorer_and_shapes(rng):
    assert isinstance(make_scorer(_config(scorer="linear"), H, D), LinearScorer)
    assert isinstance(make_scorer(_config(scorer="mlp"), H, D), MLPScorer)
    module = make_scorer(_config(scorer="mlstm"), H, D)
    assert isinstance(module, MLSTMScorer)
    k, v = _kv(rng, 5)
    params = module.init(jax.random.key(0), k, v)["params"]
    assert params["w_q"].shape == (H, 2 * D, 4) and params["w_v"].shape == (H, 2 * D, 4)
    assert np.all(np.diff(np.asarray(params["b_fgate"])) > 0) and params["b_fgate"][0] == 3.0
    with pytest.raises(ValueError, match="mode"):
        module.apply({"params": params}, k, v, mode="fast")
    feats = hedgehog(jnp.asarray(rng.normal(size=(3, 4)), jnp.float32))
    np.testing.assert_allclose(feats.sum(-1), 2.0, rtol=1e-6)


# ---------------------------------------------------------------------- App. E.5 variants

VARIANTS = [
    dict(),  # the paper's main configuration
    dict(mlstm_feature_map="softmax"),
    dict(mlstm_value="cached"),
    dict(mlstm_skip=True),
    dict(mlstm_norm=True),
    dict(mlstm_gate_softcap=0.0),
    dict(mlstm_init="random"),
    dict(mlstm_feature_map="softmax", mlstm_value="cached", mlstm_skip=True, mlstm_norm=True, delayed_readout=False),
]


def _softmax_np(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _scorer_numpy(params, config, k, v):
    """The whole mLSTM scorer from its definition (Eq. 37-42), float64, unstabilized recurrence."""
    p = {name: np.asarray(x, np.float64) for name, x in params.items()}
    x = np.concatenate([np.asarray(k, np.float64), np.asarray(v, np.float64)], -1)  # [B, S, H, 2D]
    phi = ((lambda z: np.concatenate([_softmax_np(z), _softmax_np(-z)], -1))
           if config.mlstm_feature_map == "hedgehog" else _softmax_np)
    q = phi(np.einsum("bshi,hie->bhse", x, p["w_q"]))
    kk = phi(np.einsum("bshi,hie->bhse", x, p["w_k"]))
    vv = (np.einsum("bshi,hie->bhse", x, p["w_v"]) if config.mlstm_value == "projection"
          else np.moveaxis(np.asarray(v, np.float64), 1, 2))
    gates = np.einsum("bshi,hig->bhsg", x, p["w_gates"])
    cap = config.mlstm_gate_softcap
    soft = (lambda z: cap * np.tanh(z / cap)) if cap > 0 else (lambda z: z)
    i = soft(gates[..., 0] + p["b_igate"][None, :, None])
    log_f = -np.logaddexp(0.0, -soft(gates[..., 1] + p["b_fgate"][None, :, None]))
    s = x.shape[1]
    h = _numpy_unstabilized(q, kk, vv, i, log_f, delay=min(config.window, s - 1) if config.delayed_readout else 0)
    z = h
    if config.mlstm_norm:
        z = z / np.sqrt(np.mean(z * z, -1, keepdims=True) + 1e-6) * p["norm_scale"][None, :, None]
    if config.mlstm_skip:
        z = z + np.einsum("bshi,hie->bhse", x, p["w_skip"])
    return np.einsum("bhse,he->bhs", z / (1 + np.exp(-z)), p["a"]) + p["b"][None, :, None]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "main")
def test_scorer_variants_match_numpy_definition_and_decode(rng, overrides):
    s, window = 11, 3
    config = _config(window=window, **overrides)
    module = MLSTMScorer(num_kv_heads=H, head_dim=D, config=config)
    k, v = _kv(rng, s)
    variables = _randomized(module, rng, k, v)
    got = jax.jit(module.apply)(variables, k, v)
    want = _scorer_numpy(variables["params"], config, k, v)
    assert float(np.std(want)) > 1e-2  # not vacuous
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # Decoding (step, then readout of u = q - w) reproduces the parallel scores.
    w = window if config.delayed_readout else 0
    state = module.apply(variables, B, method=MLSTMScorer.init_state)
    assert state.C.shape == (B, H, config.mlstm_features(D), config.mlstm_value_dim(D))
    step = jax.jit(functools.partial(module.apply, method=MLSTMScorer.step))
    readout = jax.jit(functools.partial(module.apply, method=MLSTMScorer.readout))
    decoded = np.full((B, H, s), np.nan, np.float32)
    for q in range(s):
        state = step(variables, state, k[:, q], v[:, q])
        if q - w >= 0:
            decoded[:, :, q - w] = readout(variables, state, k[:, q - w], v[:, q - w])
    for u in range(s - w, s):
        decoded[:, :, u] = readout(variables, state, k[:, u], v[:, u])
    np.testing.assert_allclose(decoded, got, rtol=1e-5, atol=1e-5)


def test_identity_style_init_reads_the_key_and_value_pathways(rng):
    config = _config(mlstm_dim=None, mlstm_skip=True)
    module = MLSTMScorer(num_kv_heads=H, head_dim=D, config=config)
    k, v = _kv(rng, 4)
    params = module.init(jax.random.key(0), k, v)["params"]
    eye = np.eye(D, D // 2)
    for name, pathway in (("w_q", 0), ("w_k", 0), ("w_v", 1), ("w_skip", 1)):
        w = np.asarray(params[name])
        assert w.shape == (H, 2 * D, D // 2), name  # App. A: 2D -> d/2 with d = head_dim
        np.testing.assert_array_equal(w[:, pathway * D:(pathway + 1) * D], np.broadcast_to(eye, (H, D, D // 2)))
        np.testing.assert_array_equal(w[:, (1 - pathway) * D:(2 - pathway) * D], 0.0)
    q, kk, vv, _, _ = module.apply({"params": params}, k, v, method=MLSTMScorer.features)
    np.testing.assert_allclose(vv, np.asarray(v)[..., : D // 2], rtol=1e-6)  # v~ = the value's first d/2 coords
    np.testing.assert_allclose(q, hedgehog(k[..., : D // 2].astype(jnp.float32)), rtol=1e-6)
    random = MLSTMScorer(num_kv_heads=H, head_dim=D, config=_config(mlstm_init="random"))
    w = np.asarray(random.init(jax.random.key(0), k, v)["params"]["w_q"])
    assert np.all(w[:, D:] == 0) and np.abs(w[:, :D]).min() > 0  # random, on the key half only


def test_gates_start_small_with_the_paper_biases(rng):
    """E.5: gate biases set the start (input 0, forget linspace(3, 6) over heads: long memory), the
    gate weights are small, so at init every token's gates are about the biases whatever its k, v;
    the score projection starts at zero (a neutral ranking)."""
    h, d = 4, 64
    module = MLSTMScorer(num_kv_heads=h, head_dim=d, config=_config(mlstm_dim=None))
    k, v = _kv(rng, 16, h=h, d=d)
    params = module.init(jax.random.key(1), k, v)["params"]
    w = np.asarray(params["w_gates"])
    assert w.shape == (h, 2 * d, 2)
    expected_std = np.sqrt(0.01 / (2 * d))  # LeCun-normal at scale 0.01, fan_in 2d
    assert 0.8 * expected_std < w.std() < 1.25 * expected_std, w.std()
    np.testing.assert_array_equal(params["b_igate"], 0.0)
    np.testing.assert_allclose(params["b_fgate"], np.linspace(3.0, 6.0, h), rtol=1e-6)
    np.testing.assert_array_equal(params["a"], 0.0)
    np.testing.assert_array_equal(params["b"], 0.0)
    *_, i, log_f = module.apply({"params": params}, k, v, method=MLSTMScorer.features)
    assert float(jnp.abs(i).max()) < 0.5
    bias_log_f = -np.logaddexp(0.0, -np.asarray(params["b_fgate"]))  # log i, log f [B, S, Hkv]
    np.testing.assert_allclose(log_f, np.broadcast_to(bias_log_f, log_f.shape), atol=0.03)


def test_state_slots_and_memory_matched_topk():
    kv = KVpopConfig(scorer="mlstm", sinks=4, window=256, topk=2016)
    # Qwen3: d = 128 features, dv = 64: C + n + m = 8321 numbers = 32.5 entries of 2 x 128.
    assert kv.scorer_state_slots(128) == 33
    mlp = kv.memory_matched("mlp", 128)
    assert mlp.scorer == "mlp" and mlp.topk == 2016 + 33 and mlp.scorer_state_slots(128) == 0
    assert mlp.memory_matched("mlstm", 128) == kv
    cached = dataclasses.replace(kv, mlstm_value="cached")
    assert cached.scorer_state_slots(128) == -(-(128 * 128 + 129) // 256)
    with pytest.raises(ValueError, match="even"):
        KVpopConfig(scorer="mlstm", mlstm_dim=7)
    with pytest.raises(ValueError, match="mlstm_feature_map"):
        KVpopConfig(mlstm_feature_map="relu")
    with pytest.raises(ValueError, match="mlstm_gate_softcap"):
        KVpopConfig(mlstm_gate_softcap=-1.0)


@pytest.mark.parametrize("scorer,topk", [("mlstm", 7), ("mlstm", 0), ("mlp", 0), ("mlp", 7)])
def test_retarget_gives_the_memory_asked_for_by_any_path(scorer, topk):
    """retarget(B) has memory B whatever the path: at k = 0 an mLSTM config's state was left out (retarget(100)
    had memory 117, and retarget(53).retarget(60) another config than retarget(60)); a budget below s + w + state
    at k = 0 was taken. A float budget or a context length <= 0 is named."""
    d = 64
    kv = KVpopConfig(scorer=scorer, sinks=4, window=32, topk=topk)
    state = kv.scorer_state_slots(d)
    for budget in (60, 100, 123, 256):
        assert kv.retarget(budget, d).memory(d) == budget
        assert kv.retarget(budget, d).retarget(160, d) == kv.retarget(160, d)
    floor = kv.sinks + state + (kv.window if topk else 1)  # k = 0 keeps a window of at least 1
    kv.retarget(floor, d)
    with pytest.raises(ValueError, match=rf"budget {floor - 1} "):
        kv.retarget(floor - 1, d)
    with pytest.raises(ValueError, match=r"budget must be an int .*got 123.0"):
        kv.retarget(123.0, d)
    for bad in (0, -1024, 1024.7):
        with pytest.raises(ValueError, match=rf"context_len must be a positive int .*got {bad!r}"):
            KVpopConfig.budget_at(0.5, bad)
    # numpy ints are taken as BaselineConfig takes them (they were refused), and stored as Python ints
    numpy_made = KVpopConfig(scorer=scorer, sinks=np.int64(4), window=np.int32(32), topk=np.int64(topk))
    assert numpy_made == kv and all(type(getattr(numpy_made, f)) is int for f in ("sinks", "window", "topk"))
    assert json.loads(json.dumps(numpy_made.to_dict()))["topk"] == topk


def test_unrotate_inverts_rope_against_numpy(rng):
    """rope.unrotate undoes the attention's rotation at each key's position (a numpy rotation by
    -position per frequency pair), for fresh random keys and positions."""
    from kvpop_jax.rope import apply_rope, rope_cos_sin, unrotate

    b, s, h, d, theta = 2, 7, 3, 16, 10_000.0
    x = rng.normal(size=(b, s, h, d)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(b, s))
    cos, sin = rope_cos_sin(jnp.asarray(pos), d, theta)
    rotated = apply_rope(jnp.asarray(x), cos, sin)
    np.testing.assert_allclose(np.asarray(unrotate(rotated, pos, theta)), x, atol=2e-5, rtol=0)
    # numpy: pair (i, i + d/2) rotated by -pos * theta^(-2i/d)
    ang = -pos[..., None] * theta ** (-np.arange(0, d, 2) / d)  # [b, s, d/2]
    r = np.asarray(rotated, np.float64)
    lo, hi = r[..., : d // 2], r[..., d // 2:]
    c, sn = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    ref = np.concatenate([lo * c - hi * sn, hi * c + lo * sn], -1)
    # float32 angles (pos * freq, pos < 5000) against float64 ones: ~1e-4 apart; a wrong sign or pair is O(1)
    np.testing.assert_allclose(np.asarray(unrotate(rotated, pos, theta)), ref, atol=5e-4, rtol=0)


@pytest.mark.parametrize("kind", ["mlp", "mlstm"])
def test_unrotated_scorer_keys_are_position_free(rng, kind):
    """With scorer_keys="unrotated" a KVpop head's scores of a sequence do not depend on where it
    starts (the attention is shift-invariant under RoPE, so only the scorer could see absolute
    position); with the cached, rotated keys they do."""
    from kvpop_jax.kvpop import KVpopHead
    from kvpop_jax.rope import apply_rope, rope_cos_sin

    s, theta = 24, 10_000.0
    pre, v = _kv(rng, s)
    scores = {}
    variables = _randomized(KVpopHead(_config(scorer=kind), H, D, rope_theta=theta), rng, pre, v)
    for keys in ("rotated", "unrotated"):
        head = KVpopHead(_config(scorer=kind, scorer_keys=keys), H, D, rope_theta=theta)
        for offset in (0, 700):
            pos = jnp.arange(s)[None] + offset
            k = apply_rope(pre, *rope_cos_sin(jnp.broadcast_to(pos, (B, s)), D, theta))
            scores[keys, offset] = np.asarray(head.apply(variables, k, v, pos)[0])
    np.testing.assert_allclose(scores["unrotated", 0], scores["unrotated", 700], atol=1e-4, rtol=0)
    assert np.abs(scores["rotated", 0] - scores["rotated", 700]).max() > 1e-2


def test_unrotated_scorer_keys_need_rope_theta():
    from kvpop_jax.kvpop import KVpopHead

    k = jnp.zeros((1, 4, H, D))
    with pytest.raises(ValueError, match="rope_theta"):
        KVpopHead(_config(scorer_keys="unrotated"), H, D).init(jax.random.key(0), k, k)
    with pytest.raises(ValueError, match="scorer_keys must be one of"):
        _config(scorer_keys="pre_rope")


def _extreme_mlstm_inputs(rng, s, delay, gap, dv=5):
    """Gates far outside the soft-cap, as a scorer trained with `mlstm_gate_softcap=0` (or with
    weights scaled x100) produces: f ~ exp(-200), so each state holds one write; head 0 writes
    with i ~ +150 (exp(-m) underflows to 0), head 1 with i ~ -300 (exp(-m) overflows to inf).
    Features are Hedgehog maps of [c, -c] with 2|c| >= gap, so the query of u is (up to
    exp(-gap)) orthogonal to the key it reads, k_{u+delay}: q^T n ~ 4 exp(-gap) is exactly 0 for
    gap 120 (the readout was 0/0), for gap 72 a float whose square underflows (the gradient was
    inf), and for gap 30 above the floor exp(-60) (the readout is the value read, not ~0)."""
    sign = rng.choice([-1.0, 1.0], size=(B, H, s, 1))
    c = sign * (gap / 2 + 0.5 * np.abs(rng.normal(size=(B, H, s, 1))))
    z = jnp.asarray(np.concatenate([c, -c], axis=-1), jnp.float32)
    k = hedgehog(z)
    q = hedgehog(-z[:, :, np.minimum(np.arange(s) + delay, s - 1)])
    v = jnp.asarray(rng.normal(size=(B, H, s, dv)), jnp.float32)
    loc = np.array([150.0, -300.0])[None, :, None]
    i = jnp.asarray(loc + rng.normal(scale=5.0, size=(B, H, s)), jnp.float32)
    log_f = jax.nn.log_sigmoid(jnp.asarray(rng.normal(loc=-200.0, size=(B, H, s)), jnp.float32))
    return q, k, v, i, log_f


def test_stabilized_normalize_is_the_plain_readout_bit_for_bit_in_the_normal_range(rng):
    """Its guards act only where the plain `num / max(|den|, exp(-m))` or its gradient is not finite:
    elsewhere value and gradients keep their bits, so training with the default soft-cap computes
    what it did before them (the main job reproduces its shipped export)."""
    from kvpop_jax.scorers import stabilized_normalize

    num = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)
    den = jnp.asarray(rng.normal(size=(3, 4)) * 2.0, jnp.float32)
    m = jnp.asarray(rng.uniform(-20.0, 20.0, size=(3, 4)), jnp.float32)  # both sides of |den| win the max
    w = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)
    plain = lambda a, b, c: a / jnp.maximum(jnp.abs(b), jnp.exp(-c))[..., None]  # noqa: E731
    for f in (plain, stabilized_normalize):
        assert jnp.all(jnp.isfinite(f(num, den, m)))
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))  # noqa: E731
    (want, want_grads), (got, got_grads) = loss(plain)(num, den, m), loss(stabilized_normalize)(num, den, m)
    assert np.array_equal(got, want)
    # At XLA's defaults (KVPOP_TEST_XLA_FLAGS=0) -O3 contracts multiply-adds into FMAs, differently in the two
    # programs: the gradients then differ by an ulp (Python 3.12, jax 0.12.1). The suite's -O0 keeps them equal.
    exact = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    for a, b in zip(got_grads, want_grads):
        assert np.any(a != 0)
        if exact:
            assert np.array_equal(a, b)
        else:
            np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=2)


@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunkwise"])
@pytest.mark.parametrize("delay,gap", [(0, 120.0), (2, 120.0), (0, 72.0), (2, 72.0), (2, 30.0)])
def test_mlstm_forms_are_finite_at_extreme_gates(rng, form, delay, gap):
    s = 24
    inputs = _extreme_mlstm_inputs(rng, s, delay, gap)
    fn = {"quadratic": mlstm_quadratic, "recurrent": mlstm_recurrent,
          "chunkwise": functools.partial(mlstm_chunkwise, chunk=8)}[form]
    fn = jax.jit(functools.partial(fn, delay=delay))
    out = fn(*inputs)
    np.testing.assert_allclose(out, _numpy_unstabilized(*inputs, delay=delay), rtol=1e-4, atol=1e-4)
    weights = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    grads = jax.grad(lambda *x: jnp.sum(fn(*x) * weights), argnums=(0, 1, 2, 3, 4))(*inputs)
    for name, g in zip(("q", "k", "v", "i", "log_f"), grads):
        assert bool(jnp.all(jnp.isfinite(g))), f"non-finite gradient for {name}"


def test_unsoftcapped_scorer_with_large_weights_has_finite_scores_and_gradients(rng):
    """mlstm_gate_softcap=0 and weights x100: gate pre-activations in the hundreds and near one-hot
    features. The scores were NaN (0/0 readouts) in every form, so the retention loss and the
    training step were NaN."""
    s = 64
    module = MLSTMScorer(num_kv_heads=H, head_dim=16, config=_config(mlstm_gate_softcap=0.0, mlstm_chunk=16))
    k, v = _kv(rng, s, d=16)
    variables = jax.tree.map(lambda x: 100.0 * x, _randomized(module, rng, k, v))
    weights = jnp.asarray(rng.normal(size=(B, H, s)), jnp.float32)
    for mode in MLSTM_MODES:
        apply = jax.jit(functools.partial(module.apply, mode=mode))
        scores = apply(variables, k, v)
        assert bool(jnp.all(jnp.isfinite(scores))), mode
        grads = jax.jit(jax.grad(lambda p: jnp.sum(apply(p, k, v) * weights)))(variables)  # noqa: B023
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            assert bool(jnp.all(jnp.isfinite(g))), (mode, jax.tree_util.keystr(path))
