"""The gathered-key-list masked attention (`kvpop_jax.gathered_attention`, back end "xla_sparse")
against the blockwise reference, values and gradients, on fresh random inputs."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import kvpop_mask_np, masked_attention_np, random_qkv, random_ranks, running_cutoffs_np
from kvpop_jax.attention import KVPOP_ATTENTION, kvpop_attention, kvpop_attention_reference
from kvpop_jax.gathered_attention import keys_per_query, kvpop_attention_gathered, list_length

CASES = [
    # S, sinks, window, topk, Hq, Hkv, block_q
    (37, 2, 5, 4, 4, 2, 16),  # S not a multiple of the block
    (24, 0, 1, 3, 2, 2, 8),  # w = 1, no sinks
    (20, 3, 4, 0, 4, 1, 64),  # k = 0, one block larger than S
    (12, 4, 9, 2, 2, 1, 5),  # S <= s + w + k: nothing is ever evicted
    (48, 1, 3, 40, 4, 4, 16),  # k >= |E(q)| everywhere: sentinel S, lists as long as S
    (50, 60, 4, 3, 2, 1, 16),  # every key a sink
    (200, 4, 16, 20, 4, 2, 16),  # long sequence, several saturated blocks
    (131, 3, 7, 9, 6, 2, 32),  # G = 3, ragged last block
    (96, 2, 40, 5, 2, 1, 8),  # window much longer than the block
]


def _loss_weights(rng, q, hq):
    b, s = q.shape[:2]
    return (jnp.asarray(rng.standard_normal(q.shape), jnp.float32),
            jnp.asarray(rng.standard_normal((b, hq, s)), jnp.float32))


def _grads(fn, w_out, w_lse, q, k, v):
    """Gradients of a random linear function of (out, lse), in one compiled call."""

    def loss(q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _gathered(ranks, cut, **kw):
    kw.setdefault("fallback", kvpop_attention_reference)
    return lambda q, k, v: kvpop_attention_gathered(q, k, v, jnp.asarray(ranks), jnp.asarray(cut), **kw)


def _reference(ranks, cut, **kw):
    return lambda q, k, v: kvpop_attention_reference(q, k, v, jnp.asarray(ranks), jnp.asarray(cut), **kw)


@pytest.mark.parametrize("seq, sinks, window, topk, hq, hkv, block_q", CASES)
def test_matches_reference_values_and_gradients(rng, seq, sinks, window, topk, hq, hkv, block_q):
    b, d = 2, 8
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    kw = dict(sinks=sinks, window=window)
    got = _gathered(ranks, cut, topk=topk, block_q=block_q, **kw)
    want = _reference(ranks, cut, **kw)
    out, lse = jax.jit(got)(q, k, v)
    want_out, want_lse = masked_attention_np(q, k, v, kvpop_mask_np(ranks, cut, **kw))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, seq) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    w_out, w_lse = _loss_weights(rng, q, hq)
    for g_got, g_want in zip(_grads(got, w_out, w_lse, q, k, v), _grads(want, w_out, w_lse, q, k, v)):
        assert np.all(np.isfinite(np.asarray(g_got)))
        np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("topk, fallback", [(2, kvpop_attention_reference), (2, None), (70, kvpop_attention_reference)])
def test_random_cutoffs_take_the_fallback_or_fit(rng, topk, fallback):
    """Non-monotone cutoffs (not a running top-k): lists may overflow k + block; exact either way
    (fallback, or lists of length S without one)."""
    b, seq, hq, hkv, d, sinks, window = 2, 70, 4, 2, 8, 3, 4
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = rng.integers(-1, seq + 1, (b, hkv, seq)).astype(np.int32)
    kw = dict(sinks=sinks, window=window, scale=0.3)
    want = _reference(ranks, cut, **kw)
    got = _gathered(ranks, cut, topk=topk, block_q=16, fallback=fallback, **kw)
    for x, y in zip(jax.jit(got)(q, k, v), jax.jit(want)(q, k, v)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    w_out, w_lse = _loss_weights(rng, q, hq)
    for x, y in zip(_grads(got, w_out, w_lse, q, k, v), _grads(want, w_out, w_lse, q, k, v)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_fallback_runs_only_when_a_list_overflows(rng):
    """The reference branch is taken exactly when some block keeps more than k + block keys."""
    b, seq, hq, hkv, d, sinks, window, topk = 1, 64, 2, 1, 8, 1, 2, 3
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    calls = []

    def marked_reference(*args, **kw):
        out, lse = kvpop_attention_reference(*args, **kw)
        return out + 1.0, lse  # visibly different: tells which branch ran

    @jax.jit
    def both(cut):
        got = kvpop_attention_gathered(q, k, v, jnp.asarray(ranks), cut, sinks=sinks, window=window,
                                       topk=topk, block_q=16, fallback=marked_reference)[0]
        return got, kvpop_attention_reference(q, k, v, jnp.asarray(ranks), cut, sinks=sinks, window=window)[0]

    def branch(cut):
        got, want = both(jnp.asarray(cut, jnp.int32))
        calls.append(bool(np.allclose(got, want + 1.0, atol=1e-5)))

    branch(running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk))  # a running top-k: fits
    branch(np.full((b, hkv, seq), seq, np.int32))  # keep everything: lists of up to S - w - s
    assert calls == [False, True]


def test_bf16_runs_in_bf16(rng):
    b, seq, hq, hkv, d, sinks, window, topk = 1, 40, 2, 1, 16, 1, 3, 4
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d, jnp.bfloat16)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    out, lse = jax.jit(_gathered(ranks, cut, sinks=sinks, window=window, topk=topk, block_q=16))(q, k, v)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    want_out, want_lse = masked_attention_np(q, k, v, kvpop_mask_np(ranks, cut, sinks=sinks, window=window))
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(_gathered(ranks, cut, sinks=sinks, window=window, topk=topk,
                                                       block_q=16)(q, k, v)[0].astype(jnp.float32)),
                     argnums=(0, 1, 2)))(q, k, v)
    assert all(g.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads)


def test_work_is_linear_in_seq_len():
    """Nothing of size S × S, nor S × (S / block) floats, in the forward or backward jaxpr."""
    b, seq, hq, hkv, d, block = 1, 2048, 2, 1, 8, 64
    q = jax.ShapeDtypeStruct((b, seq, hq, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, seq, hkv, d), jnp.float32)
    ints = jax.ShapeDtypeStruct((b, hkv, seq), jnp.int32)

    def loss(q, k, v, ranks, cut):
        out, lse = kvpop_attention_gathered(q, k, v, ranks, cut, sinks=4, window=16, topk=32, block_q=block,
                                            fallback=lambda *a, **kw: (jnp.zeros(q.shape), jnp.zeros((b, hq, seq))))
        return jnp.sum(out) + jnp.sum(lse)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv, ints, ints)

    def largest_float(jaxpr):
        size = 0
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                aval = getattr(var, "aval", None)
                if aval is not None and jnp.issubdtype(getattr(aval, "dtype", jnp.int32), jnp.floating):
                    size = max(size, int(np.prod(aval.shape)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                size = max(size, largest_float(sub))
        return size

    assert largest_float(jaxpr.jaxpr) <= max(seq * hq * d, 4 * block * keys_per_query(seq, sinks=4, window=16, topk=32))


def test_static_sizes():
    assert list_length(4096, 384, 64) == 448 and list_length(100, 384, 64) == 128 and list_length(100, None) == 128
    assert keys_per_query(4096, sinks=4, window=128, topk=384, block_q=64) == 4 + 191 + 448


def test_dispatcher_prefers_it_where_it_is_cheaper(rng, monkeypatch):
    monkeypatch.delenv(KVPOP_ATTENTION.env_var, raising=False)
    select = lambda seq, topk: KVPOP_ATTENTION.select(  # noqa: E731
        None, jax.ShapeDtypeStruct((1, seq, 2, 8), jnp.float32), None, None, None, None, sinks=4, window=128,
        topk=topk)
    assert select(4096, 384) == "xla_sparse"
    assert select(1024, 384) == "xla"  # 4 + 191 + 448 keys of 1024: not worth the gathers
    assert select(4096, None) == "xla"  # lists need topk
    # Through the dispatcher, with a saturated running top-k: the same numbers as the reference.
    b, seq, hq, hkv, d, sinks, window, topk = 1, 256, 2, 1, 8, 2, 8, 6
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    kw = dict(sinks=sinks, window=window, topk=topk)
    args = (q, k, v, jnp.asarray(ranks), jnp.asarray(cut))
    assert KVPOP_ATTENTION.select(None, *args, **kw) == "xla_sparse"
    run = jax.jit(lambda *a: (kvpop_attention(*a, **kw), kvpop_attention(*a, implementation="xla", **kw)))
    for x, y in zip(*run(*args)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
