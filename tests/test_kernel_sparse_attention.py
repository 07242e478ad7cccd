"""The Pallas sparse-attention kernel (interpret mode) against the XLA reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.compat import export_for_cuda
from kvpop_jax.attention import kvpop_attention, kvpop_attention_reference
from pallas_kernels import sparse_attention as sa
from helpers import (INTERPRET, SMALL_BLOCKS, TRITON_TARGETS, assert_close, kernel_backend, kvpop_mask_np, random_qkv,
                     random_ranks, running_cutoffs_np)
from pallas_kernels.sparse_attention import kvpop_attention_pallas as sparse_attention

def make_cutoffs(rng, ranks, mode, *, sinks, window, topk):
    b, h, s = ranks.shape
    if mode == "topk":
        return running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    if mode == "none":  # k = 0: every long-range key masked
        return np.full((b, h, s), -1, np.int32)
    if mode == "all":  # huge k: sentinel S everywhere
        return np.full((b, h, s), s, np.int32)
    return rng.integers(-1, s + 1, (b, h, s)).astype(np.int32)  # "random", not monotone


def inputs(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk):
    q, k, v = random_qkv(rng, 1, seq, hq, hkv, d, dtype)
    ranks = random_ranks(rng, 1, hkv, seq)
    cut = make_cutoffs(rng, ranks, mode, sinks=sinks, window=window, topk=topk)
    return q, k, v, jnp.asarray(ranks), jnp.asarray(cut)


FORWARD_CASES = [
    # S, Hq, Hkv, D, dtype, cutoffs, sinks, window, topk, blocks
    (75, 2, 2, 16, jnp.float32, "topk", 3, 8, 6, SMALL_BLOCKS),  # S % block != 0, many skipped tiles
    (40, 4, 2, 32, jnp.float32, "random", 2, 5, 0, {}),  # S < default block 64
    (96, 4, 1, 16, jnp.float32, "none", 4, 16, 0, SMALL_BLOCKS),  # GQA 4, k = 0
    (50, 4, 2, 16, jnp.float32, "all", 1, 4, 0, SMALL_BLOCKS),  # huge k == dense causal
    (70, 4, 2, 32, jnp.bfloat16, "topk", 2, 6, 10, SMALL_BLOCKS),
    (24, 2, 1, 20, jnp.float32, "topk", 0, 1, 3, {}),  # odd head dim (padded to 32), w = 1, s = 0
]


@pytest.mark.parametrize("seq, hq, hkv, d, dtype, mode, sinks, window, topk, blocks", FORWARD_CASES)
def test_forward_matches_reference(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk, blocks):
    q, k, v, ranks, cut = inputs(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk)
    kw = dict(sinks=sinks, window=window)
    out, lse = sparse_attention(q, k, v, ranks, cut, interpret=INTERPRET, **blocks, **kw)
    want_out, want_lse = kvpop_attention_reference(q, k, v, ranks, cut, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert_close(out, want_out, tol)
    assert_close(lse, want_lse, tol)


GRAD_CASES = [
    (75, 4, 2, 16, jnp.float32, "topk", 3, 8, 6, SMALL_BLOCKS),  # several q/k blocks, GQA 2
    (33, 4, 1, 16, jnp.float32, "random", 1, 3, 0, {}),  # one block, GQA 4
    (48, 2, 2, 16, jnp.bfloat16, "topk", 2, 4, 5, SMALL_BLOCKS),
]


@pytest.mark.parametrize("seq, hq, hkv, d, dtype, mode, sinks, window, topk, blocks", GRAD_CASES)
def test_gradients_match_reference(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk, blocks):
    """dq, dk, dv through both outputs (the LSE cotangent folds into the softmax backward)."""
    q, k, v, ranks, cut = inputs(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk)
    w_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((1, hq, seq)), jnp.float32)
    kw = dict(sinks=sinks, window=window)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v, ranks, cut)
            return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)

        return f

    kernel = lambda *a: sparse_attention(*a, interpret=INTERPRET, **blocks, **kw)  # noqa: E731
    reference = lambda *a: kvpop_attention_reference(*a, **kw)  # noqa: E731
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, g_got, g_want in zip("qkv", got, want):
        assert g_got.dtype == dtype, name
        assert_close(g_got, g_want, tol)


def test_tile_skipping_is_sound_and_used(rng):
    """A tile the kernel skips never holds a kept entry, and sparse inputs do skip tiles."""
    seq, sinks, window, topk, bq, bk = 256, 4, 16, 8, 16, 16
    ranks = random_ranks(rng, 1, 1, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    mask = kvpop_mask_np(ranks, cut, sinks=sinks, window=window)[0, 0]
    st = sa.StaticArgs(1.0, sinks, window, seq, 1, bq, bk, bq, bk, 4, 2, True)
    may_keep = jax.jit(
        lambda qs, ks, r, c: sa.tile_may_keep(qs, ks, ks + jnp.arange(bk), r, c, bq, bk, st)
    )
    skipped = causal_tiles = 0
    for qs in range(0, seq, bq):
        for ks in range(0, qs + bq, bk):
            keep = bool(may_keep(qs, ks, ranks[0, 0, ks : ks + bk], cut[0, 0, qs : qs + bq]))
            causal_tiles += 1
            if not keep:
                skipped += 1
                assert not mask[qs : qs + bq, ks : ks + bk].any(), (qs, ks)
    assert skipped > causal_tiles // 4, (skipped, causal_tiles)


def test_dispatcher_runs_kernel(rng):
    q, k, v, ranks, cut = inputs(rng, 30, 2, 1, 16, jnp.float32, "topk", 1, 4, 3)
    kw = dict(sinks=1, window=4)
    got = kvpop_attention(q, k, v, ranks, cut, implementation=kernel_backend("pallas"), **kw)
    want = kvpop_attention_reference(q, k, v, ranks, cut, **kw)
    assert_close(got[0], want[0], 1e-5)
    assert_close(got[1], want[1], 1e-5)


# Pallas' Triton custom call target: "__gpu$xla.gpu.triton" up to jaxlib 0.10.2 (Triton IR
# handed to XLA), "triton_kernel_call_ffi" (compiled kernels) in later versions.
@pytest.mark.parametrize(
    "hq, hkv, d, dtype", [(4, 2, 64, jnp.bfloat16), (4, 4, 128, jnp.float32), (6, 2, 64, jnp.bfloat16)]
)
def test_lowers_for_cuda(hq, hkv, d, dtype):
    """Forward and VJP lower through Pallas' Triton path for CUDA on a CPU-only machine."""
    b, seq = 2, 200
    spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    kv, ints = spec(b, seq, hkv, d), spec(b, hkv, seq, dt=jnp.int32)
    args = (spec(b, seq, hq, d), kv, kv, ints, ints)

    def forward(q, k, v, ranks, cut):
        return sparse_attention(q, k, v, ranks, cut, sinks=4, window=32)

    def vjp(q, k, v, ranks, cut):
        (out, lse), pullback = jax.vjp(lambda q, k, v: forward(q, k, v, ranks, cut), q, k, v)
        return pullback((out, jnp.ones_like(lse)))

    for fn, kernels in ((forward, {"fwd"}), (vjp, {"fwd", "dq", "dkdv"})):
        exported = export_for_cuda(fn, *args)
        text = exported.mlir_module()
        targets = set(re.findall(r"custom_call @([^(\s]+)\(", text))
        assert targets and targets <= set(TRITON_TARGETS), targets
        names = set(re.findall(r'name = "kvpop_sparse_attention_(\w+)"', text))
        assert names == kernels, names
