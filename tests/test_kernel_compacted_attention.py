"""The compacted-key-list kernel (interpret mode) against the XLA reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (INTERPRET, SMALL_BLOCKS, TRITON_TARGETS, assert_close, kernel_backend, random_qkv, random_ranks,
                     running_cutoffs_np)
from pallas_kernels.compat import export_for_cuda
from kvpop_jax.attention import kvpop_attention_reference
from pallas_kernels.compacted_attention import (
    kvpop_attention_pallas_compacted as compacted_sparse_attention,
    forward_key_tiles,
    long_range_key_lists,
)


def test_key_lists_match_brute_force_and_bound(rng):
    seq, hkv, sinks, window, topk, bq = 128, 2, 3, 8, 10, 16
    ranks = random_ranks(rng, 1, hkv, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    keys, counts = long_range_key_lists(
        jnp.asarray(ranks), jnp.asarray(cut), sinks=sinks, window=window, block_q=bq, length=seq
    )
    for h in range(hkv):
        for i in range(seq // bq):
            q0, q1 = i * bq, i * bq + bq - 1
            kept = {
                t for q in range(q0, q1 + 1) for t in range(sinks, q - window + 1) if ranks[0, h, t] <= cut[0, h, q]
            }
            want = [t for t in range(sinks, q1 - window + 1) if ranks[0, h, t] <= cut[0, h, q0:q1 + 1].max()]
            assert kept <= set(want)
            n = int(counts[0, h, i])
            assert n == len(want) <= topk + bq - 1
            assert list(np.asarray(keys[0, h, i, :n])) == want


CASES = [
    # S, Hq, Hkv, D, dtype, cutoffs, sinks, window, topk (None: full-length list)
    (90, 4, 2, 16, jnp.float32, "topk", 3, 8, 6),  # compacted lists, S % block != 0
    (90, 2, 1, 16, jnp.float32, "random", 2, 5, 6),  # bound broken: block-skipping fallback
    (64, 2, 2, 32, jnp.bfloat16, "topk", 0, 4, 12),
    (40, 4, 1, 16, jnp.float32, "random", 1, 3, None),
]


@pytest.mark.parametrize("seq, hq, hkv, d, dtype, mode, sinks, window, topk", CASES)
def test_forward_matches_reference(rng, seq, hq, hkv, d, dtype, mode, sinks, window, topk):
    q, k, v = random_qkv(rng, 1, seq, hq, hkv, d, dtype)
    ranks = random_ranks(rng, 1, hkv, seq)
    if mode == "topk":
        cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    else:
        cut = rng.integers(-1, seq + 1, (1, hkv, seq)).astype(np.int32)
    if mode == "random" and topk is not None:  # the fallback branch must be the one taken
        pad = (-seq) % 16
        _, counts = long_range_key_lists(
            jnp.pad(jnp.asarray(ranks), ((0, 0), (0, 0), (0, pad)), constant_values=2**30),
            jnp.pad(jnp.asarray(cut), ((0, 0), (0, 0), (0, pad)), constant_values=-1),
            sinks=sinks, window=window, block_q=16, length=16,
        )
        assert int(counts.max()) > topk + 16
    ranks, cut = jnp.asarray(ranks), jnp.asarray(cut)
    kw = dict(sinks=sinks, window=window)
    out, lse = compacted_sparse_attention(q, k, v, ranks, cut, interpret=INTERPRET, topk=topk, **SMALL_BLOCKS, **kw)
    want_out, want_lse = kvpop_attention_reference(q, k, v, ranks, cut, **kw)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert_close(out, want_out, tol)
    assert_close(lse, want_lse, tol)


def test_dispatcher_selects_compacted_kernel_by_name_and_work_model(rng):
    from kvpop_jax.attention import KVPOP_ATTENTION, kvpop_attention
    from pallas_kernels.compacted_attention import compacted_is_cheaper

    # The work-model table of BENCHMARKS.md: cheaper at long S / small B, not when nothing is evicted.
    assert compacted_is_cheaper(16384, sinks=4, window=256, topk=1788)
    assert not compacted_is_cheaper(4096, sinks=4, window=256, topk=3836)
    seq, sinks, window, topk = 64, 2, 6, 5
    q, k, v = random_qkv(rng, 1, seq, 4, 2, 16)
    ranks = random_ranks(rng, 1, 2, seq)
    cut = jnp.asarray(running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk))
    ranks = jnp.asarray(ranks)
    kw = dict(sinks=sinks, window=window)
    backend = kernel_backend("pallas_compacted")
    out, lse = kvpop_attention(q, k, v, ranks, cut, topk=topk, implementation=backend, **kw)
    want_out, want_lse = kvpop_attention_reference(q, k, v, ranks, cut, **kw)
    assert_close(out, want_out, 1e-5)
    assert_close(lse, want_lse, 1e-5)
    with pytest.raises(ValueError, match="needs topk"):
        kvpop_attention(q, k, v, ranks, cut, implementation=backend, **kw)
    if jax.default_backend() == "cpu":  # the automatic choice there is the reference
        assert KVPOP_ATTENTION.select(None, q, k, v, ranks, cut, topk=topk, **kw) == "xla"


def test_gradients_match_reference(rng):
    seq, hq, hkv, d, sinks, window, topk = 80, 4, 2, 16, 2, 6, 5
    q, k, v = random_qkv(rng, 1, seq, hq, hkv, d)
    ranks = random_ranks(rng, 1, hkv, seq)
    ranks, cut = jnp.asarray(ranks), jnp.asarray(running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk))
    w_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((1, hq, seq)), jnp.float32)
    kw = dict(sinks=sinks, window=window)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v, ranks, cut)
            return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

        return f

    kernel = lambda *a: compacted_sparse_attention(  # noqa: E731
        *a, interpret=INTERPRET, topk=topk, **SMALL_BLOCKS, **kw)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda *a: kvpop_attention_reference(*a, **kw)), argnums=(0, 1, 2))(q, k, v)
    for g_got, g_want in zip(got, want):
        assert_close(g_got, g_want, 1e-5)


def test_compacted_work_is_smaller_for_long_sequences(rng):
    seq, sinks, window, topk = 1024, 4, 32, 64
    ranks = random_ranks(rng, 1, 1, seq)
    cut = running_cutoffs_np(ranks, sinks=sinks, window=window, topk=topk)
    causal, skipping, compacted = forward_key_tiles(
        jnp.asarray(ranks), jnp.asarray(cut), sinks=sinks, window=window, block_q=32, block_k=32
    )
    assert compacted < 0.4 * causal and skipping <= causal
    # Budget ≥ S: nothing to compact, both are the causal triangle or close to it.
    all_cut = jnp.full((1, 1, seq), seq, jnp.int32)
    causal, skipping, _ = forward_key_tiles(
        jnp.asarray(ranks), all_cut, sinks=sinks, window=window, block_q=32, block_k=32
    )
    assert skipping == causal


def test_lowers_for_cuda():
    b, seq, hq, hkv, d = 1, 300, 4, 2, 64
    spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    kv, ints = spec(b, seq, hkv, d), spec(b, hkv, seq, dt=jnp.int32)
    args = (spec(b, seq, hq, d), kv, kv, ints, ints)

    def forward(q, k, v, ranks, cut):
        return compacted_sparse_attention(q, k, v, ranks, cut, sinks=4, window=16, topk=32)

    def vjp(q, k, v, ranks, cut):
        (out, lse), pullback = jax.vjp(lambda q, k, v: forward(q, k, v, ranks, cut), q, k, v)
        return pullback((out, jnp.ones_like(lse)))

    backward = {"compacted_attention_fwd", "compacted_attention_dq", "sparse_attention_dkdv"}
    for fn, kernels in ((forward, {"compacted_attention_fwd"}), (vjp, backward)):
        text = export_for_cuda(fn, *args).mlir_module()
        assert set(re.findall(r"custom_call @([^(\s]+)\(", text)) <= set(TRITON_TARGETS)
        assert kernels <= set(re.findall(r'name = "kvpop_(\w+)"', text))
