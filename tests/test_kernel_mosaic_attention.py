"""The Mosaic GPU (Hopper) masked-attention forward, in GPU interpret mode (on a Hopper GPU: compiled),
against the XLA reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (CPU_ONLY_REASON, INTERPRET, NATIVE_KERNELS, assert_close, kernel_backend, random_qkv, random_ranks,
                     running_cutoffs_np)
from kvpop_jax.attention import KVPOP_ATTENTION, kvpop_attention, kvpop_attention_reference, kvpop_block_mask
from pallas_kernels.compat import (MOSAIC_GPU_TARGETS, export_for_cuda, is_hopper_or_later, mosaic_gpu_interpret_params,
                                   mosaic_gpu_interpret_unavailable, mosaic_gpu_races_found)
from pallas_kernels.mosaic_attention import LIST_WIDTH, key_block_lists, kvpop_attention_mosaic

if NATIVE_KERNELS:
    WHY_NOT = None if is_hopper_or_later(jax.devices()[0]) else "the Mosaic GPU kernel needs a Hopper (sm_90+) GPU"
else:
    WHY_NOT = mosaic_gpu_interpret_unavailable()
runs_mosaic = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def inputs(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk):
    q, k, v = random_qkv(rng, 1, seq, hq, hkv, d, dtype)
    ranks = random_ranks(rng, 1, hkv, seq)
    if mode == "topk":
        cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    elif mode == "none":  # k = 0: every long-range key masked
        cut = np.full(ranks.shape, -1, np.int32)
    else:  # "random": not monotone
        cut = rng.integers(-1, seq + 1, ranks.shape).astype(np.int32)
    return q, k, v, jnp.asarray(ranks), jnp.asarray(cut)


CASES = [
    # S, Hq, Hkv, D, dtype, cutoffs, sinks, window, topk, block_k
    (100, 2, 1, 64, jnp.bfloat16, "topk", 3, 8, 10, 64),  # S % 64 != 0, GQA 2, two query blocks
    (150, 4, 2, 32, jnp.float16, "random", 2, 5, 0, 64),  # D padded to 64, three key blocks
    (128, 2, 2, 64, jnp.bfloat16, "none", 4, 16, 0, 128),  # k = 0, block_k 128
    (64, 4, 1, 128, jnp.bfloat16, "topk", 0, 1, 6, 64),  # GQA 4, D 128, s = 0, w = 1
    (384, 2, 1, 64, jnp.bfloat16, "topk", 2, 8, 2, 64),  # sparse: most long-range key blocks skipped
]


@runs_mosaic
@pytest.mark.parametrize("seq, hq, hkv, d, dtype, mode, sinks, window, topk, block_k", CASES)
def test_forward_matches_reference(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk, block_k):
    q, k, v, ranks, cut = inputs(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk)
    kw = dict(sinks=sinks, window=window)
    out, lse = kvpop_attention_mosaic(q, k, v, ranks, cut, interpret=INTERPRET, block_k=block_k, **kw)
    want_out, want_lse = kvpop_attention_reference(q, k, v, ranks, cut, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, want_out, 2e-2)
    assert_close(lse, want_lse, 1e-5)


@runs_mosaic
@pytest.mark.skipif(NATIVE_KERNELS, reason=CPU_ONLY_REASON)
def test_no_shared_memory_races(rng):
    """The two-slot K/V pipeline never writes a slot that is still being read (race detector)."""
    q, k, v, ranks, cut = inputs(rng, 192, 2, 1, 64, jnp.bfloat16, "topk", 2, 8, 12)
    params = mosaic_gpu_interpret_params(detect_races=True, on_race="raise")
    out, _ = kvpop_attention_mosaic(q, k, v, ranks, cut, sinks=2, window=8, interpret=params)
    out.block_until_ready()
    assert not mosaic_gpu_races_found()  # jax 0.11 records races rather than raising
    assert_close(out, kvpop_attention_reference(q, k, v, ranks, cut, sinks=2, window=8)[0], 2e-2)


@runs_mosaic
def test_dispatcher_forward_and_reference_gradients(rng, monkeypatch):
    """KVPOP_ATTENTION_IMPL selects it; gradients are the XLA reference's (forward-only kernel)."""
    q, k, v, ranks, cut = inputs(rng, 80, 2, 1, 64, jnp.bfloat16, "topk", 2, 8, 6)
    kw = dict(sinks=2, window=8)
    w_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(impl):
        def f(q, k, v):
            out, lse = kvpop_attention(q, k, v, ranks, cut, implementation=impl, **kw)
            return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse)

        return f

    monkeypatch.setenv(KVPOP_ATTENTION.env_var, kernel_backend("mosaic_gpu"))
    assert KVPOP_ATTENTION.select(None, q, k, v, ranks, cut, **kw) == kernel_backend("mosaic_gpu")
    got = jax.grad(loss(None), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for g_got, g_want in zip(got, want):
        assert g_got.dtype == jnp.bfloat16
        assert_close(g_got, g_want, 2e-2)


def test_key_block_lists_hold_every_tile_with_a_kept_entry_and_skip_others(rng):
    seq, hkv, sinks, window, topk, bq, bk = 2048, 2, 4, 32, 4, 64, 64
    ranks = random_ranks(rng, 1, hkv, seq)
    cut = jnp.asarray(running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk))
    ranks = jnp.asarray(ranks)
    pos = jnp.arange(seq, dtype=jnp.int32)
    mask = np.asarray(kvpop_block_mask(pos, pos, ranks, cut, sinks=sinks, window=window))  # [1, H, S, S]
    tiles = mask.reshape(1, hkv, seq // bq, bq, seq // bk, bk).any(axis=(3, 5))  # [1, H, nq, nk]
    lists = np.asarray(key_block_lists(ranks, cut, sinks=sinks, window=window, block_q=bq, block_k=bk))
    assert lists.shape[-1] == LIST_WIDTH
    lists = lists.reshape(1, hkv, seq // bq, -1)
    visited = causal = 0
    for h in range(hkv):
        for qb in range(seq // bq):
            n = lists[0, h, qb, 0]
            listed = lists[0, h, qb, 1:1 + n]
            assert np.all(np.diff(listed) > 0) and not np.any(lists[0, h, qb, 1 + n:])
            assert set(np.flatnonzero(tiles[0, h, qb])) <= set(listed.tolist()), (h, qb)
            visited += n
            causal += (qb * bq + bq - 1) // bk + 1
    assert visited < causal // 2, (visited, causal)


def test_never_chosen_automatically_and_rejects_float32(rng, monkeypatch):
    assert not any(name.startswith("mosaic") for name in KVPOP_ATTENTION.auto)
    q, k, v, ranks, cut = inputs(rng, 64, 2, 1, 64, jnp.float32, "topk", 2, 8, 6)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kvpop_attention(q, k, v, ranks, cut, sinks=2, window=8, implementation="mosaic_gpu")
    with pytest.raises(ValueError, match="block_k"):
        kvpop_attention_mosaic(q.astype(jnp.bfloat16), k, v, ranks, cut, sinks=2, window=8, block_k=32)


@pytest.mark.parametrize("block_k", [64, 128])
def test_lowers_for_cuda(block_k):
    """Mosaic GPU's real lowering (layouts, shared-memory budget) for an H100, on any host and jax."""
    b, seq, hq, hkv, d = 1, 1024, 8, 2, 128
    spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    kv, ints = spec(b, seq, hkv, d), spec(b, hkv, seq, dt=jnp.int32)
    exported = export_for_cuda(lambda *a: kvpop_attention_mosaic(*a, sinks=4, window=32, block_k=block_k),
                               spec(b, seq, hq, d), kv, kv, ints, ints)
    text = exported.mlir_module()
    assert set(re.findall(r"custom_call @([^(\s]+)\(", text)) <= set(MOSAIC_GPU_TARGETS)
    assert "kvpop_mosaic_attention_fwd" in text
    assert [a.shape for a in exported.out_avals] == [(b, seq, hq, d), (b, hq, seq)]


def test_shared_memory_overflow_is_caught_when_lowering():
    """A tile too large for an H100's 227 KiB of shared memory fails at lowering, without a GPU."""
    spec = jax.ShapeDtypeStruct
    args = (spec((1, 512, 2, 512), jnp.bfloat16), spec((1, 512, 1, 512), jnp.bfloat16),
            spec((1, 512, 1, 512), jnp.bfloat16), spec((1, 1, 512), jnp.int32), spec((1, 1, 512), jnp.int32))
    with pytest.raises(Exception, match="shared memory"):
        export_for_cuda(lambda *a: kvpop_attention_mosaic(*a, sinks=4, window=32, block_k=256), *args)
