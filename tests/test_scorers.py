"""Scorers: the three mLSTM forms agree, decoding reproduces them, delayed readout is
causal, inputs are detached, zero-init is neutral, weights are headwise."""

import functools

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
    """Eq. 38-41 on the true (unstabilized) state, denominator max(|q^T n|, 1)."""
    q, k, v, i, f = (np.asarray(x, np.float64) for x in (q, k, v, i, jnp.exp(log_f)))
    s = q.shape[2]
    C = np.zeros(k.shape[:2] + (k.shape[-1], v.shape[-1]))
    n = np.zeros(k.shape[:2] + (k.shape[-1],))
    states = []
    for t in range(s):
        write = np.exp(i[:, :, t])
        kv = np.einsum("bhd,bhe->bhde", k[:, :, t], v[:, :, t])
        C = f[:, :, t, None, None] * C + write[..., None, None] * kv
        n = f[:, :, t, None] * n + write[..., None] * k[:, :, t]
        states.append((C, n))
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for u in range(s):
        C, n = states[min(u + delay, s - 1)]
        num = np.einsum("bhd,bhde->bhe", q[:, :, u], C)
        den = np.einsum("bhd,bhd->bh", q[:, :, u], n)
        out[:, :, u] = num / np.maximum(np.abs(den), 1.0)[..., None]
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
