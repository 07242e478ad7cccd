"""The tiled dense attention (kvpop_jax/tiled_attention.py) against the whole-matrix reference:
values and gradients (out and lse) on fresh random inputs, for positions that grow with the index,
packed segments, permuted positions (where skipping by index would be wrong), a cache with empty
slots, and a query that sees no key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpop_jax import attention
from kvpop_jax.tiled_attention import _Tiles, _visible, dense_attention_tiled


def inputs(seed, b, s, t, hq=4, hkv=2, d=8):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((b, s, hq, d), (b, t, hkv, d), (b, t, hkv, d)))
    return rng, q, k, v


def assert_equal_to_reference(q, k, v, blocks, **kw):
    want = attention.dense_attention_reference(q, k, v, **kw)
    got = dense_attention_tiled(q, k, v, block_q=blocks[0], block_k=blocks[1], **kw)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)

    def loss(fn, q, k, v, **extra):  # out and lse both feed the loss, nonlinearly
        out, lse = fn(q, k, v, **kw, **extra)
        return jnp.sum(out * out * jnp.cos(out)) + jnp.sum(jnp.sin(jnp.maximum(lse, -1e3)))

    g_want = jax.grad(lambda *a: loss(attention.dense_attention_reference, *a), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(lambda *a: loss(dense_attention_tiled, *a, block_q=blocks[0], block_k=blocks[1]),
                     argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(g_got, g_want):
        assert float(jnp.abs(w).max()) > 1e-3  # the gradient is not trivially zero
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("s,blocks", [(37, (8, 16)), (64, (16, 16)), (40, (64, 8)), (5, (256, 256))])
def test_causal_positions(s, blocks):
    _, q, k, v = inputs(s, 2, s, s)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
    assert_equal_to_reference(q, k, v, blocks, q_positions=pos, kv_positions=pos)


def test_packed_segments_and_scale():
    rng, q, k, v = inputs(1, 2, 37, 37)
    pos = jnp.broadcast_to(jnp.arange(37, dtype=jnp.int32), (2, 37))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 37)), axis=1), jnp.int32)
    assert_equal_to_reference(q, k, v, (8, 4), q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                              kv_segment_ids=seg, scale=0.3)


def test_permuted_positions():
    """Positions that do not grow with the index: skipping must follow positions, not slots."""
    rng, q, k, v = inputs(2, 2, 37, 37)
    pos = jnp.asarray(np.stack([rng.permutation(37) for _ in range(2)]), jnp.int32)
    assert_equal_to_reference(q, k, v, (8, 8), q_positions=pos, kv_positions=pos)


def test_against_a_cache_with_empty_slots():
    _, q, k, v = inputs(3, 2, 13, 40)
    q_pos = jnp.broadcast_to(20 + jnp.arange(13, dtype=jnp.int32), (2, 13))
    kv_pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    assert_equal_to_reference(q, k, v, (4, 8), q_positions=q_pos, kv_positions=kv_pos, kv_valid=kv_pos < 33)


def test_a_query_that_sees_no_key_gets_zeros():
    _, q, k, v = inputs(4, 2, 13, 40)
    q_pos = jnp.broadcast_to(20 + jnp.arange(13, dtype=jnp.int32), (2, 13)).at[:, 0].set(-5)
    kv_pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    kw = dict(q_positions=q_pos, kv_positions=kv_pos, kv_valid=kv_pos < 33)
    out, lse = dense_attention_tiled(q, k, v, block_q=4, block_k=8, **kw)
    assert float(jnp.abs(out[:, 0]).max()) == 0.0 and float(lse[:, :, 0].max()) <= -1e29
    assert_equal_to_reference(q, k, v, (4, 8), **kw)


def test_the_upper_triangle_is_skipped():
    """Causal positions in 4 x 4 tiles: a tile is visited iff its key block starts at or before the
    query block's end, i.e. the lower triangle with the diagonal (10 of 16)."""
    pos = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (3, 64))
    visible = np.asarray(_visible(_Tiles(1.0, 16, 16), pos, pos))
    np.testing.assert_array_equal(visible, np.tri(4, dtype=bool))
    shifted = pos.at[1].add(16)  # one row's queries and keys later: the union over the batch counts
    visible = np.asarray(_visible(_Tiles(1.0, 16, 16), shifted, pos))
    np.testing.assert_array_equal(visible, np.tri(4, k=1, dtype=bool))


def test_lowers_for_gpu_and_tpu():
    """Plain XLA with its own backward: forward and gradient export for CUDA and TPU from CPU."""
    from jax import export

    _, q, k, v = inputs(5, 2, 40, 40)
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))

    def loss(q, k, v):
        out, lse = dense_attention_tiled(q, k, v, q_positions=pos, kv_positions=pos, block_q=16, block_k=16)
        return jnp.sum(out) + jnp.sum(lse)

    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda", "tpu"])(q, k, v)
    assert exported.platforms == ("cuda", "tpu") and "stablehlo.while" in exported.mlir_module()


def test_bfloat16_inputs_match_the_reference_to_bfloat16_rounding():
    """The GPU recipes' compute dtype: outputs and gradients keep the inputs' dtype, and agree with
    the reference to within bf16 rounding of their scale (the logits and sums run in float32)."""
    _, q, k, v = inputs(6, 2, 70, 70, d=16)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    pos = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32), (2, 70))
    kw = dict(q_positions=pos, kv_positions=pos)

    def loss(fn, **extra):
        return lambda q, k, v: jnp.sum(fn(q, k, v, **kw, **extra)[0].astype(jnp.float32) ** 2)

    want = attention.dense_attention_reference(q, k, v, **kw)
    got = dense_attention_tiled(q, k, v, block_q=16, block_k=16, **kw)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    g_want = jax.grad(loss(attention.dense_attention_reference), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(loss(dense_attention_tiled, block_q=16, block_k=16), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip((*got, *g_got), (*want, *g_want)):
        assert a.dtype == w.dtype
        a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
        assert np.abs(a - w).max() <= 2e-2 * np.abs(w).max()
