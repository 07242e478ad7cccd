"""Future-attention target: blockwise transposed pass == dense reference == Eq. 2–3 in numpy."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpop_jax import targets

B, D = 2, 8


def _qk(rng, s, hkv, g):
    q = rng.normal(size=(B, s, hkv * g, D)).astype(np.float32) * 2.0
    k = rng.normal(size=(B, s, hkv, D)).astype(np.float32) * 2.0
    return q, k


def _np_logits(q, k, scale=None):
    """[B, Hq, S(d), S(t)] float64 logits, query head h*G + g reads KV head h."""
    g = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_rep = np.repeat(k.astype(np.float64), g, axis=2)
    return np.einsum("bdhx,bthx->bhdt", q.astype(np.float64), k_rep) * scale


def _np_dense_probs(q, k):
    logits = _np_logits(q, k)
    s = q.shape[1]
    causal = np.tril(np.ones((s, s), bool))
    logits = np.where(causal, logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)  # [B, Hq, d, t], Eq. 29


def _np_target(mass_bar, hkv, window, eps, aggregate, normalize):
    """Eq. 2–3 (ε after dividing by N_t) from per-query-head masses m̄ [B, Hq, S]."""
    b, hq, s = mass_bar.shape
    n_t = np.maximum(1, s - (np.arange(s) + window))
    m = mass_bar / n_t if normalize else mass_bar
    m = m.reshape(b, hkv, hq // hkv, s)
    agg = m.max(axis=2) if aggregate == "max" else m.mean(axis=2)
    return np.log(eps + agg)


@pytest.mark.parametrize(
    "s, block, window, hkv, g",
    [
        (37, 8, 3, 2, 2),  # S not a multiple of the block
        (16, 8, 1, 1, 1),  # w = 1, MHA
        (5, 16, 2, 1, 4),  # S < block
        (12, 4, 12, 2, 2),  # w = S: no key has a future query
        (9, 4, 30, 1, 1),  # w > S
    ],
)
def test_blockwise_log_mass_matches_dense_reference(rng, s, block, window, hkv, g):
    q, k = _qk(rng, s, hkv, g)
    lse = rng.normal(size=(B, hkv * g, s)).astype(np.float32) * 3.0  # any normalizer
    want = targets.future_attention_log_mass_dense(q, k, lse, window=window)
    banded = targets.future_attention_log_mass_banded(q, k, lse, window=window, block_size=block)
    got = targets.future_attention_log_mass_reference(q, k, lse, window=window, block_size=block)
    for x in (got, banded):
        assert x.shape == (B, hkv * g, s) and x.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(x), np.asarray(want), rtol=1e-5, atol=1e-5)
    t = np.arange(s)
    empty = t + window >= s
    assert np.all(np.isneginf(np.asarray(got)[..., empty]))  # documented: −inf, exact log 0
    assert np.all(np.isfinite(np.asarray(got)[..., ~empty]))
    # Independent check against Eq. 31 in float64 numpy.
    ell = _np_logits(q, k) - lse[..., None].astype(np.float64)  # [B, Hq, d, t]
    future = t[:, None] >= t[None, :] + window
    mass = np.where(future, np.exp(ell), 0.0).sum(axis=2)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(np.asarray(got), np.log(mass), rtol=1e-4, atol=1e-4)


def test_dense_lse_matches_numpy(rng):
    s, hkv, g = 21, 2, 2
    q, k = _qk(rng, s, hkv, g)
    got = targets.dense_lse(q, k, block_size=8)
    logits = np.where(np.tril(np.ones((s, s), bool)), _np_logits(q, k), -np.inf)
    mx = logits.max(-1)
    want = mx + np.log(np.exp(logits - mx[..., None]).sum(-1))
    assert got.shape == (B, hkv * g, s) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregate", ["max", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_target_with_dense_lse_matches_softmax_probabilities(rng, aggregate, normalize):
    s, hkv, g, window, eps = 19, 2, 3, 3, 1e-6
    q, k = _qk(rng, s, hkv, g)
    lse = targets.dense_lse(q, k, block_size=8)
    got = targets.future_attention_target(q, k, lse, window=window, eps=eps, aggregate=aggregate, normalize=normalize)
    p = _np_dense_probs(q, k)
    t = np.arange(s)
    future = t[:, None] >= t[None, :] + window  # [d, t]: Eq. 2's sum over d = t+w .. S−1
    mass_bar = np.where(future, p, 0.0).sum(axis=2)
    want = _np_target(mass_bar, hkv, window, eps, aggregate, normalize)
    assert got.shape == (B, hkv, s) and got.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    # Keys without future queries get exactly log ε.
    np.testing.assert_allclose(np.asarray(got)[..., t + window >= s], math.log(eps), rtol=1e-6)


def test_target_with_sparse_lse(rng):
    """Any per-query normalizer works (Eq. 9): here the LSE over a random causal subset."""
    s, hkv, g, window, eps = 23, 2, 2, 2, 1e-6
    q, k = _qk(rng, s, hkv, g)
    logits = _np_logits(q, k)
    keep = np.tril(rng.random((B, hkv * g, s, s)) < 0.4) | np.eye(s, dtype=bool)
    masked = np.where(keep, logits, -np.inf)
    mx = masked.max(-1)
    sparse_lse = (mx + np.log(np.exp(masked - mx[..., None]).sum(-1))).astype(np.float32)
    got = targets.future_attention_target(q, k, sparse_lse, window=window, eps=eps)
    t = np.arange(s)
    future = t[:, None] >= t[None, :] + window
    mass_bar = np.where(future, np.exp(logits - sparse_lse[..., None]), 0.0).sum(axis=2)
    want = _np_target(mass_bar, hkv, window, eps, "max", True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    dense = targets.future_attention_target(q, k, targets.dense_lse(q, k), window=window, eps=eps)
    assert not np.allclose(np.asarray(got), np.asarray(dense), atol=1e-3)  # the normalizer matters


def test_max_vs_mean_aggregation(rng):
    s, hkv, g, window = 17, 2, 4, 2
    q, k = _qk(rng, s, hkv, g)
    lse = targets.dense_lse(q, k)
    kw = dict(window=window, eps=1e-6)
    r_max = np.asarray(targets.future_attention_target(q, k, lse, aggregate="max", **kw))
    r_mean = np.asarray(targets.future_attention_target(q, k, lse, aggregate="mean", **kw))
    assert np.all(r_max >= r_mean - 1e-6)
    assert np.any(r_max > r_mean + 1e-3)
    # With one query head per KV head both aggregations agree.
    q1 = q[:, :, ::g]
    lse1 = targets.dense_lse(q1, k)
    np.testing.assert_allclose(
        np.asarray(targets.future_attention_target(q1, k, lse1, aggregate="max", **kw)),
        np.asarray(targets.future_attention_target(q1, k, lse1, aggregate="mean", **kw)),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("aggregate", ["max", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_aggregation_and_normalization_of_given_log_mass(rng, aggregate, normalize):
    """Eq. 2–3 on a known log m̄ (injected through log_mass_fn), including empty futures."""
    s, hkv, g, window, eps = 10, 2, 3, 4, 1e-3
    q, k = _qk(rng, s, hkv, g)
    log_mass = rng.normal(size=(B, hkv * g, s)) * 3.0
    log_mass[..., s - window :] = -np.inf

    def fake_log_mass(q_, k_, lse_, *, window, scale, reduce, lookahead):
        assert window == 4 and scale is None and reduce == "sum" and lookahead is None
        return jnp.asarray(log_mass, jnp.float32)

    got = targets.future_attention_target(
        q, k, np.zeros((B, hkv * g, s), np.float32), window=window, eps=eps,
        aggregate=aggregate, normalize=normalize, log_mass_fn=fake_log_mass,
    )
    want = _np_target(np.exp(log_mass), hkv, window, eps, aggregate, normalize)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(targets.future_query_count(s, window)), np.maximum(1, s - (np.arange(s) + window))
    )


def test_log_mass_fn_hook_and_jit(rng):
    s, hkv, g, window = 13, 2, 2, 2
    q, k = _qk(rng, s, hkv, g)
    lse = targets.dense_lse(q, k)
    fn = jax.jit(functools.partial(targets.future_attention_target, window=window, eps=1e-5))
    got = fn(q, k, lse)
    ref = targets.future_attention_target(
        q, k, lse, window=window, eps=1e-5, log_mass_fn=targets.future_attention_log_mass_dense
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_target_is_a_constant_and_accepts_bf16(rng):
    s, hkv, g, window = 11, 1, 2, 2
    q, k = _qk(rng, s, hkv, g)
    lse = targets.dense_lse(q, k)

    def total(q, k, lse):
        return targets.future_attention_target(q, k, lse, window=window, eps=1e-6).sum()

    grads = jax.grad(total, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), lse)
    for grad in grads:
        assert np.all(np.asarray(grad) == 0)
    got16 = targets.future_attention_target(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), lse, window=window, eps=1e-6
    )
    assert got16.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(got16),
        np.asarray(targets.future_attention_target(q, k, lse, window=window, eps=1e-6)),
        atol=0.3,
    )


def test_bad_inputs_raise(rng):
    q, k = _qk(rng, 8, 2, 2)
    lse = rng.normal(size=(B, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="aggregate"):
        targets.future_attention_target(q, k, lse, window=2, eps=1e-6, aggregate="sum")
    with pytest.raises(ValueError, match="lse"):
        targets.future_attention_log_mass(q, k, lse[:, :2], window=2)
    with pytest.raises(ValueError, match="window"):
        targets.future_attention_log_mass(q, k, lse, window=-1)
    with pytest.raises(ValueError, match="multiple"):
        targets.dense_lse(q[:, :, :3], k)
    # Named, not a bare TypeError / AttributeError from inside the pass.
    with pytest.raises(ValueError, match=r"window must be an int >= 0, got None"):
        targets.future_attention_log_mass(q, k, lse, window=None)
    with pytest.raises(ValueError, match=r"lse must be an array float \[B, Hq, S\], got NoneType"):
        targets.future_attention_log_mass(q, k, None, window=2)
    with pytest.raises(ValueError, match=r"scale must be None or a finite Python number"):
        targets.future_attention_log_mass(q, k, lse, window=2, scale=jnp.ones(()))
    # A numpy int is an int (it was refused as "must be an int >= 0, got np.int64(2)").
    np.testing.assert_array_equal(targets.future_attention_log_mass(q, k, lse, window=np.int64(2)),
                                  targets.future_attention_log_mass(q, k, lse, window=2))


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_a_nan_query_reaches_exactly_the_keys_it_reads(rng, reduce):
    """A NaN in query d makes log m̄_t NaN for the keys it is a future query of (t + w <= d), on every
    implementation, and nowhere else. Before, every implementation read the NaN sum as "no future
    query" and returned −inf, hiding it."""
    s, window = 20, 3
    q, k = _qk(rng, s, 2, 2)
    q[1, 12, 3, 0] = np.nan  # row 1, query head 3 (KV head 1)
    lse = np.asarray(targets.dense_lse(jnp.asarray(np.nan_to_num(q)), k))
    want = np.zeros((B, 4, s), bool)
    want[1, 3, : 12 - window + 1] = True
    for impl in ("xla", "xla_sparse", "pallas_interpret"):
        got = targets.future_attention_log_mass(q, k, lse, window=window, reduce=reduce, implementation=impl)
        np.testing.assert_array_equal(np.isnan(np.asarray(got)), want, err_msg=impl)
    got = targets.future_attention_log_mass_dense(q, k, lse, window=window, reduce=reduce)
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), want, err_msg="dense")


@pytest.mark.parametrize("s, block, window", [(37, 8, 3), (12, 4, 12), (16, 16, 1)])
def test_max_reduction_matches_reference_and_numpy(rng, s, block, window):
    """reduce="max": log of the largest single future read, blockwise == dense == numpy."""
    hkv, g = 2, 2
    q, k = _qk(rng, s, hkv, g)
    lse = rng.normal(size=(B, hkv * g, s)).astype(np.float32) * 3.0
    got = targets.future_attention_log_mass_reference(q, k, lse, window=window, block_size=block, reduce="max")
    want = targets.future_attention_log_mass_dense(q, k, lse, window=window, reduce="max")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    banded = targets.future_attention_log_mass_banded(q, k, lse, window=window, block_size=block, reduce="max")
    np.testing.assert_allclose(np.asarray(banded), np.asarray(want), rtol=1e-5, atol=1e-5)
    t = np.arange(s)
    ell = _np_logits(q, k) - lse[..., None].astype(np.float64)  # [B, Hq, d, t]
    future = t[:, None] >= t[None, :] + window
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(np.asarray(got), np.where(future, ell, -np.inf).max(axis=2), rtol=1e-4, atol=1e-4)
    # the target: log(ε + max_g max_d p), never divided by N_t; a one-off strong read beats many weak ones
    eps = 1e-6
    dense = targets.dense_lse(q, k, block_size=8)
    tgt = targets.future_attention_target(q, k, dense, window=window, eps=eps, reduce="max")
    p = np.where(future, _np_dense_probs(q, k), 0.0).max(axis=2).reshape(B, hkv, g, s).max(axis=2)
    np.testing.assert_allclose(np.asarray(tgt), np.log(eps + p), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="reduce"):
        targets.future_attention_target(q, k, dense, window=window, eps=eps, reduce="mean")


# (37, 8, 7, 4): w = 7 with blocks of 8, so a key block's first future query is the last of a query block (a loop
# started one block late lost it, and no other case could tell)
@pytest.mark.parametrize("s, block, window, lookahead", [(37, 8, 3, 0), (37, 8, 3, 5), (20, 4, 2, 40), (16, 16, 1, 7),
                                                         (37, 8, 7, 4)])
def test_lookahead_limits_the_future_queries(rng, s, block, window, lookahead):
    """App. B.2: only queries t + w <= d <= t + w + L count, and N_t is clipped to L + 1."""
    hkv, g, eps = 2, 2, 1e-4
    q, k = _qk(rng, s, hkv, g)
    p = _np_dense_probs(q, k)  # [B, Hq, d, t]
    d, t = np.arange(s)[:, None], np.arange(s)[None, :]
    band = (d >= t + window) & (d <= t + window + lookahead)
    mass = np.where(band, p, 0.0).sum(axis=2)  # [B, Hq, t]
    with np.errstate(divide="ignore"):
        want = np.log(mass)
    lse = targets.dense_lse(q, k)
    for fn in (functools.partial(targets.future_attention_log_mass_reference, block_size=block),
               functools.partial(targets.future_attention_log_mass_banded, block_size=block),
               targets.future_attention_log_mass_dense):
        got = np.asarray(fn(q, k, lse, window=window, lookahead=lookahead))
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), finite)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    count = np.minimum(np.maximum(1, s - (np.arange(s) + window)), lookahead + 1)
    np.testing.assert_array_equal(np.asarray(targets.future_query_count(s, window, lookahead)), count)
    target = targets.future_attention_target(q, k, lse, window=window, eps=eps, lookahead=lookahead)
    m = (mass / count).reshape(B, hkv, g, s).max(axis=2)
    np.testing.assert_allclose(np.asarray(target), np.log(eps + m), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="lookahead"):
        targets.future_attention_log_mass(q, k, lse, window=window, lookahead=-1)


@pytest.mark.parametrize("reduce, lookahead", [("sum", None), ("max", None), ("sum", 70)])
def test_banded_pass_is_the_dispatchers_choice_off_gpu(rng, monkeypatch, reduce, lookahead):
    """Past one block the dispatcher takes the banded pass; it equals the reference (fresh inputs)."""
    monkeypatch.delenv(targets.FUTURE_ATTENTION_LOG_MASS.env_var, raising=False)
    s, hkv, g, window = 300, 2, 2, 5
    q, k = _qk(rng, s, hkv, g)
    lse = rng.normal(size=(B, hkv * g, s)).astype(np.float32) * 3.0
    kw = dict(window=window, reduce=reduce, lookahead=lookahead)
    assert targets.FUTURE_ATTENTION_LOG_MASS.select(None, q, k, lse, **kw) == "xla_sparse"
    assert targets.FUTURE_ATTENTION_LOG_MASS.select(None, q[:, :100], k[:, :100], lse[..., :100], **kw) == "xla"
    got = np.asarray(targets.future_attention_log_mass(q, k, lse, **kw))
    want = np.asarray(targets.future_attention_log_mass_reference(q, k, lse, **kw))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "xla_sparse", "pallas_interpret", "dense"])
@pytest.mark.parametrize("reduce, normalize, lookahead", [("sum", True, None), ("sum", False, None),
                                                          ("max", True, None), ("sum", True, 6)])
def test_padding_queries_count_for_nothing(rng, impl, reduce, normalize, lookahead):
    """With `lengths`, each row's target is the one the row has alone, cut at its length (numpy, float64,
    straight from Eq. 2–3 on the cut row); keys past it, or with only padding ahead, get log ε."""
    s, hkv, g, window, eps = 41, 2, 2, 3, 1e-6
    lengths = np.array([29, 41])  # row 0 has 12 padding tokens at its tail, row 1 none
    q, k = _qk(rng, s, hkv, g)
    lse = rng.normal(size=(B, hkv * g, s)).astype(np.float32) * 3.0
    fn = (functools.partial(targets.future_attention_log_mass_dense) if impl == "dense" else
          functools.partial(targets.future_attention_log_mass, implementation=impl))
    got = np.asarray(targets.future_attention_target(
        q, k, lse, window=window, eps=eps, aggregate="max", normalize=normalize, reduce=reduce,
        lookahead=lookahead, log_mass_fn=fn, lengths=jnp.asarray(lengths, jnp.int32)))
    for b, n in enumerate(lengths):
        logits = _np_logits(q[b:b + 1, :n], k[b:b + 1, :n]) - lse[b:b + 1, :, :n, None].astype(np.float64)
        d, t = np.arange(n)[:, None], np.arange(n)[None, :]
        future = (d >= t + window) & (True if lookahead is None else d <= t + window + lookahead)
        p = np.where(future, np.exp(logits), 0.0)  # [1, Hq, d, t]
        mass = p.max(axis=2) if reduce == "max" else p.sum(axis=2)
        n_t = np.maximum(1, n - (np.arange(n) + window))
        if lookahead is not None:
            n_t = np.minimum(n_t, lookahead + 1)
        m = mass / n_t if normalize and reduce == "sum" else mass
        want = np.log(eps + m.reshape(1, hkv, g, n).max(axis=2))[0]
        np.testing.assert_allclose(got[b, :, :n], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(got[b, :, n:], np.float32(np.log(eps)))


def test_padding_lengths_are_checked(rng):
    q, k = _qk(rng, 8, 1, 1)
    lse = np.zeros((B, 1, 8), np.float32) + rng.normal(size=(B, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"lengths must be int \[B\] = \[2\]"):
        targets.future_attention_target(q, k, lse, window=2, eps=1e-6, lengths=jnp.array([3.0, 4.0]))
    with pytest.raises(ValueError, match=r"lengths must be int \[B\]"):
        targets.future_attention_target(q, k, lse, window=2, eps=1e-6, lengths=jnp.array([3]))
