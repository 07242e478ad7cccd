"""KVpop-masked attention (XLA reference and dispatcher) against a numpy brute force."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import kvpop_mask_np, masked_attention_np, random_qkv, random_ranks, running_cutoffs_np
from kvpop_jax.attention import KVPOP_ATTENTION, dense_attention, kvpop_attention, kvpop_attention_reference

KVPOP_IMPL_ENV = KVPOP_ATTENTION.env_var


# --- tests --------------------------------------------------------------------------------

CASES = [
    # S, sinks, window, topk, Hq, Hkv, block_q
    (37, 2, 5, 4, 4, 2, 16),  # S not a multiple of the block
    (24, 0, 1, 3, 2, 2, 8),  # w = 1, no sinks
    (20, 3, 4, 0, 4, 1, 64),  # k = 0, one block larger than S
    (12, 4, 9, 2, 2, 1, 5),  # S <= s + w + k: nothing is ever evicted
    (48, 1, 3, 40, 4, 4, 16),  # k >= |E(q)| everywhere: sentinel S
]


@pytest.mark.parametrize("seq, sinks, window, topk, hq, hkv, block_q", CASES)
def test_reference_matches_brute_force(rng, seq, sinks, window, topk, hq, hkv, block_q):
    b, d = 2, 8
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    mask = kvpop_mask_np(ranks, cut, sinks=sinks, window=window)
    assert mask.sum(-1).max() <= sinks + window + topk
    out, lse = kvpop_attention_reference(
        q, k, v, jnp.asarray(ranks), jnp.asarray(cut), sinks=sinks, window=window, block_q=block_q
    )
    want_out, want_lse = masked_attention_np(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, hq, seq) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_reference_random_cutoffs_and_scale(rng):
    """Arbitrary (non-monotone) cutoffs in [-1, S] and a custom scale follow the same mask."""
    b, seq, hq, hkv, d, sinks, window = 1, 29, 4, 2, 16, 3, 4
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = rng.integers(-1, seq + 1, (b, hkv, seq)).astype(np.int32)
    out, lse = kvpop_attention_reference(
        q, k, v, jnp.asarray(ranks), jnp.asarray(cut), sinks=sinks, window=window, scale=0.3, block_q=8
    )
    mask = kvpop_mask_np(ranks, cut, sinks=sinks, window=window)
    want_out, want_lse = masked_attention_np(q, k, v, mask, 0.3)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_infinite_budget_is_dense(rng):
    b, seq, hq, hkv, d = 2, 33, 4, 2, 16
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = jnp.asarray(random_ranks(rng, b, hkv, seq))
    cut = jnp.full((b, hkv, seq), seq, jnp.int32)  # sentinel: keep every eligible key
    out, lse = kvpop_attention_reference(q, k, v, ranks, cut, sinks=2, window=3, block_q=16)
    pos = jnp.broadcast_to(jnp.arange(seq), (b, seq))
    want_out, want_lse = dense_attention(q, k, v, q_positions=pos, kv_positions=pos)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_rows_with_every_long_range_key_masked(rng):
    """Cutoff −1 drops all of E(q): only sinks and the window remain."""
    b, seq, hq, hkv, d, sinks, window = 1, 30, 2, 1, 8, 2, 4
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = np.full((b, hkv, seq), -1, np.int32)
    out, lse = kvpop_attention_reference(
        q, k, v, jnp.asarray(ranks), jnp.asarray(cut), sinks=sinks, window=window, block_q=8
    )
    t, qq = np.arange(seq)[None, :], np.arange(seq)[:, None]
    local = (t <= qq) & ((t < sinks) | (qq - t < window))
    want_out, want_lse = masked_attention_np(q, k, v, np.broadcast_to(local, (b, hkv, seq, seq)))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(lse)))


def test_gradients_match_full_mask_and_are_finite(rng):
    """Blockwise + checkpointed autodiff == autodiff of a one-shot S×S masked softmax."""
    b, seq, hq, hkv, d, sinks, window, topk = 1, 26, 4, 2, 8, 2, 3, 4
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    mask = jnp.asarray(np.repeat(kvpop_mask_np(ranks, cut, sinks=sinks, window=window), hq // hkv, axis=1))
    w_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((b, hq, seq)), jnp.float32)

    def full_mask(q, k, v):
        g = hq // hkv
        logits = jnp.einsum("bqhd,bthd->bhqt", q, jnp.repeat(k, g, 2)) * d**-0.5
        logits = jnp.where(mask, logits, -1e30)
        lse = jax.nn.logsumexp(logits, -1)
        out = jnp.einsum("bhqt,bthd->bqhd", jnp.exp(logits - lse[..., None]), jnp.repeat(v, g, 2))
        return out, lse

    def blockwise(q, k, v):
        return kvpop_attention_reference(
            q, k, v, jnp.asarray(ranks), jnp.asarray(cut), sinks=sinks, window=window, block_q=8
        )

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

        return f

    got = jax.grad(loss(blockwise), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(full_mask), argnums=(0, 1, 2))(q, k, v)
    for g_got, g_want in zip(got, want):
        assert np.all(np.isfinite(np.asarray(g_got)))
        np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-5)


def test_no_seq_by_seq_intermediate():
    """Forward and backward jaxprs hold nothing of size S×S per head (block_q << S)."""
    b, seq, hq, hkv, d = 1, 1024, 2, 1, 8
    q = jax.ShapeDtypeStruct((b, seq, hq, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, seq, hkv, d), jnp.float32)
    ints = jax.ShapeDtypeStruct((b, hkv, seq), jnp.int32)

    def loss(q, k, v, ranks, cut):
        out, lse = kvpop_attention_reference(q, k, v, ranks, cut, sinks=4, window=16, block_q=64)
        return jnp.sum(out) + jnp.sum(lse)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv, ints, ints)

    def largest(jaxpr):
        size = 0
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                size = max(size, int(np.prod(getattr(var.aval, "shape", ()))))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                size = max(size, largest(sub))
        return size

    assert largest(jaxpr.jaxpr) < seq * seq // 4


def test_bf16_runs_in_bf16(rng):
    b, seq, hq, hkv, d = 1, 20, 2, 1, 16
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d, jnp.bfloat16)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = running_cutoffs_np(ranks, sinks=1, window=3, topk=4)
    out, lse = kvpop_attention_reference(q, k, v, jnp.asarray(ranks), jnp.asarray(cut), sinks=1, window=3)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    want_out, want_lse = masked_attention_np(q, k, v, kvpop_mask_np(ranks, cut, sinks=1, window=3))
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)


def test_dispatcher_picks_xla_on_cpu_and_honours_env(rng, monkeypatch):
    b, seq, hq, hkv, d = 1, 16, 2, 1, 16
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = jnp.asarray(random_ranks(rng, b, hkv, seq))
    cut = jnp.asarray(running_cutoffs_np(np.asarray(ranks), sinks=1, window=2, topk=3))
    kw = dict(sinks=1, window=2)
    monkeypatch.delenv(KVPOP_IMPL_ENV, raising=False)
    want = kvpop_attention_reference(q, k, v, ranks, cut, **kw)
    got = kvpop_attention(q, k, v, ranks, cut, **kw)
    np.testing.assert_array_equal(got[0], want[0])
    monkeypatch.setenv(KVPOP_IMPL_ENV, "pallas_interpret")
    got = kvpop_attention(q, k, v, ranks, cut, **kw)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(KVPOP_IMPL_ENV, "cuda")
    with pytest.raises(ValueError, match="KVPOP_ATTENTION_IMPL"):
        kvpop_attention(q, k, v, ranks, cut, **kw)
    # An explicit argument wins over the environment.
    got = kvpop_attention(q, k, v, ranks, cut, implementation="xla", **kw)
    np.testing.assert_array_equal(got[0], want[0])


def test_rejects_bad_arguments(rng):
    q, k, v = random_qkv(rng, 1, 8, 2, 1, 16)
    ranks = jnp.zeros((1, 1, 8), jnp.int32)
    with pytest.raises(ValueError, match="window"):
        kvpop_attention_reference(q, k, v, ranks, ranks, sinks=1, window=0)
    with pytest.raises(ValueError, match="ranks"):
        kvpop_attention_reference(q, k, v, ranks[..., :4], ranks, sinks=1, window=2)
    with pytest.raises(ValueError, match="multiple"):
        q3, k2, v2 = q[:, :, :1].repeat(3, 2), k.repeat(2, 2), v.repeat(2, 2)
        kvpop_attention_reference(q3, k2, v2, ranks, ranks, sinks=1, window=2)


def test_mixed_dtypes_agree_across_back_ends(rng):
    """bf16 q with float32 k, v (and float32 q, k with bf16 v): every back end agrees with the reference,
    returns out in q's dtype and each gradient in its input's. (The GPU failure this session fixed, Triton's
    lowering refusing mixed element types, is guarded by test_gpu_readiness's export test: interpret
    mode accepted the mix before too.)"""
    b, seq, hq, hkv, d, sinks, window, topk = 1, 40, 4, 2, 16, 2, 5, 6
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = jnp.asarray(running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk))
    ranks = jnp.asarray(ranks)
    for dtypes in [(jnp.bfloat16, jnp.float32, jnp.float32), (jnp.float32, jnp.float32, jnp.bfloat16)]:
        args = [x.astype(dt) for x, dt in zip((q, k, v), dtypes)]

        def loss(q, k, v, implementation):
            out, lse = kvpop_attention(q, k, v, ranks, cut, sinks=sinks, window=window, topk=topk,
                                       implementation=implementation)
            return (out.astype(jnp.float32) ** 2).sum() + lse.sum(), out

        results = {}
        for impl in ("xla", "xla_sparse", "pallas_interpret", "pallas_compacted_interpret"):
            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*args, impl)
            assert out.dtype == dtypes[0] and [g.dtype for g in grads] == list(dtypes), impl
            results[impl] = (out, grads)
        want_out, want_grads = results["xla"]
        for impl, (out, grads) in results.items():
            np.testing.assert_allclose(np.float32(out), np.float32(want_out), rtol=2e-2, atol=2e-2, err_msg=impl)
            for g, w in zip(grads, want_grads):
                np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=5e-2, atol=5e-2, err_msg=impl)


@pytest.mark.parametrize("impl", ["xla", "xla_sparse", "pallas_interpret", "pallas_compacted_interpret"])
def test_a_nan_key_gives_nan_not_the_empty_row_sentinel(rng, impl):
    """A NaN in a key makes the LSE of every query that reads it NaN on every back end. The kernels
    turned it into -1e30 (the "no key" sentinel), which the sparse normalizer of the target would
    have read as a real value, hiding the NaN."""
    b, seq, hq, hkv, d, sinks, window, topk = 1, 24, 2, 1, 16, 1, 4, 4
    q, k, v = random_qkv(rng, b, seq, hq, hkv, d)
    k = k.at[0, 5, 0, 0].set(jnp.nan)
    ranks = random_ranks(rng, b, hkv, seq)
    cut = jnp.asarray(running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk))
    mask = kvpop_mask_np(ranks, cut, sinks=sinks, window=window)  # [B, Hkv, S, S]
    _, lse = kvpop_attention(q, k, v, jnp.asarray(ranks), cut, sinks=sinks, window=window, topk=topk,
                             implementation=impl)
    reads = np.repeat(mask[:, :, :, 5], hq // hkv, axis=1)  # [B, Hq, S]: query reads key 5
    assert reads.any() and (~reads).any()
    np.testing.assert_array_equal(np.isnan(lse), reads)


def test_rejects_nonsense_by_name(rng):
    """What a notebook user gets wrong is refused by name, on every back end alike (before, non-int
    budgets gave back ends different answers or unrelated errors, and integer inputs were truncated)."""
    q, k, v = random_qkv(rng, 1, 16, 2, 1, 16)
    ranks = jnp.asarray(random_ranks(rng, 1, 1, 16))
    cut = jnp.asarray(running_cutoffs_np(np.asarray(ranks), sinks=1, window=2, topk=3))
    kw = dict(sinks=1, window=2, topk=3)
    bad = [
        (dict(sinks=2.5), "sinks must be an int >= 0, got 2.5"),
        (dict(window=4.0), "window must be an int >= 1, got 4.0"),
        (dict(topk=-200), "topk must be an int >= 0, got -200"),
        (dict(scale=jnp.float32(0.3) + jnp.zeros(())), "scale must be None or a finite Python number"),
        (dict(scale=float("nan")), "scale must be None or a finite Python number"),
        (dict(implementation=""), "implementation must be one of"),
    ]
    for impl in ("xla", "xla_sparse", "pallas_interpret", "pallas_compacted_interpret"):
        for change, message in bad:
            args = {**kw, "implementation": impl, **change}
            with pytest.raises(ValueError, match=re.escape(message)):
                kvpop_attention(q, k, v, ranks, cut, **args)
    calls = [
        ((q[0], k, v, ranks, cut), "q must be [B, S, Hq, D], got shape (16, 2, 16)"),
        ((q.astype(jnp.int32), k, v, ranks, cut), "q must be a float array, got dtype int32"),
        ((q, k, v, np.asarray(ranks).tolist(), cut), "ranks must be an array int [B, Hkv, S], got list"),
        ((q[:, :0], k[:, :0], v[:, :0], ranks[..., :0], cut[..., :0]), "need at least one row, query and key"),
    ]
    for args, message in calls:
        with pytest.raises(ValueError, match=re.escape(message)):
            kvpop_attention(*args, **kw)
    with pytest.raises(ValueError, match="block_q must be an int >= 1, got 0"):
        kvpop_attention_reference(q, k, v, ranks, cut, sinks=1, window=2, block_q=0)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "tiled"])
def test_dense_attention_refuses_mismatched_inputs(rng, impl):
    """Every dense implementation refuses what the reference refused: the tiled one padded a short v
    with zeros, and dropped the keys a short kv_positions left out, silently."""
    seq = 64
    q, k, v = random_qkv(rng, 1, seq, 2, 2, 16)
    pos = jnp.arange(seq)[None]
    kw = dict(q_positions=pos, kv_positions=pos, impl=impl)
    bad = [
        ((q, k, v[:, :40]), {}, "k and v must be [B, T, Hkv, D] matching q"),
        ((q, k, v), dict(kv_positions=pos[:, :40]), "kv_positions must be int [B, T] = (1, 64), got int32(1, 40)"),
        ((q, k, v), dict(q_positions=pos[0]), "q_positions must be int [B, S] = (1, 64), got shape (64,)"),
        ((q, k, v), dict(kv_positions=pos.astype(jnp.float32)), "kv_positions must be int [B, T]"),
        ((q, k, v), dict(kv_valid=jnp.ones((1, seq), jnp.int32)), "kv_valid must be bool [B, T]"),
        ((q, k, v), dict(q_segment_ids=pos), "give q_segment_ids and kv_segment_ids together"),
        ((q[:, :, :1].repeat(3, 2), k, v), {}, "query heads 3 must be a multiple of KV heads 2"),
        ((q.astype(jnp.int32), k, v), {}, "q must be a float array"),
    ]
    for args, change, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            dense_attention(*args, **{**kw, **change})


def test_dense_attention_takes_positions_shared_by_every_row(rng):
    """Positions (and segment ids, kv_valid) with a batch axis of 1 serve every row on every impl, equal to
    the same arrays broadcast (what `modeling.layer_qkv` passes)."""
    seq = 70  # the tiled impl from 64 queries on
    q, k, v = random_qkv(rng, 2, seq, 2, 1, 16)
    pos = jnp.asarray(rng.permutation(seq))[None]
    seg = jnp.asarray(np.repeat([0, 1], [30, seq - 30]))[None]
    valid = jnp.asarray(rng.random(seq) > 0.2)[None]
    full = lambda x: jnp.broadcast_to(x, (2, seq))  # noqa: E731
    for impl in ("reference", "blockwise", "tiled"):
        got = dense_attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                              kv_valid=valid, impl=impl)
        want = dense_attention(q, k, v, q_positions=full(pos), kv_positions=full(pos), q_segment_ids=full(seg),
                               kv_segment_ids=full(seg), kv_valid=full(valid), impl="reference")
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=impl)
