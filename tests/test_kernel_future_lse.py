"""The Pallas transposed future-LSE kernel (interpret mode) against the XLA references."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import CPU_ONLY_REASON, INTERPRET, NATIVE_KERNELS, TRITON_TARGETS, kernel_backend
from pallas_kernels.compat import export_for_cuda
from kvpop_jax import targets
from pallas_kernels.future_lse import future_attention_log_mass_pallas as future_lse

# Pallas' Triton custom call target: "__gpu$xla.gpu.triton" up to jaxlib 0.10.2, then
# "triton_kernel_call_ffi" (as in test_kernel_sparse_attention.py).


def random_inputs(rng, seq, hq, hkv, d, dtype, lse_kind):
    q = jnp.asarray(rng.standard_normal((2, seq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((2, seq, hkv, d)), dtype)
    if lse_kind == "dense":  # the natural normalizer: log-masses in [−∞, log S]
        lse = targets.dense_lse(q, k)
    else:  # arbitrary normalizers, as a sparse LSE may be (m̄ can exceed 1)
        lse = jnp.asarray(rng.normal(2.0, 2.0, (2, hq, seq)), jnp.float32)
    return q, k, lse


def assert_log_mass_close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    empty = np.isneginf(want)
    np.testing.assert_array_equal(np.isneginf(got), empty)  # −inf exactly where no future query
    assert np.all(np.isfinite(got[~empty]))
    got, want = got[~empty], want[~empty]
    err = np.abs(got - want) / np.maximum(np.abs(want), 1.0)
    assert err.size == 0 or err.max() <= tol, f"relative error {err.max():.3g} > {tol}"


CASES = [
    # S, Hq, Hkv, D, dtype, window, lse, blocks
    (75, 2, 2, 16, jnp.float32, 5, "dense", dict(block_k=16, block_q=16)),  # S % block != 0, GQA 1
    (40, 4, 2, 32, jnp.float32, 1, "random", {}),  # S < default block, GQA 2, w = 1
    (90, 4, 1, 16, jnp.float32, 0, "dense", dict(block_k=32, block_q=16)),  # GQA 4, w = 0, bk > bq
    (70, 4, 2, 16, jnp.float32, 37, "random", dict(block_k=16, block_q=32)),  # bk < bq, w > bq
    (33, 2, 1, 20, jnp.float32, 33, "dense", {}),  # w >= S: every key −inf; odd head dim
    (50, 4, 2, 16, jnp.float32, 49, "random", dict(block_k=16, block_q=16)),  # only t = 0 has a future
    (70, 4, 2, 32, jnp.bfloat16, 6, "dense", dict(block_k=16, block_q=16)),
    (24, 4, 1, 64, jnp.bfloat16, 3, "random", {}),
    (75, 2, 1, 16, jnp.float32, 15, "dense", dict(block_k=16, block_q=16)),  # w = bq - 1: the first query, last in
]


@pytest.mark.parametrize("seq, hq, hkv, d, dtype, window, lse_kind, blocks", CASES)
def test_kernel_matches_references(rng, seq, hq, hkv, d, dtype, window, lse_kind, blocks):
    q, k, lse = random_inputs(rng, seq, hq, hkv, d, dtype, lse_kind)
    got = future_lse(q, k, lse, window=window, interpret=INTERPRET, **blocks)
    assert got.shape == (2, hq, seq) and got.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert_log_mass_close(got, targets.future_attention_log_mass_dense(q, k, lse, window=window), tol)
    assert_log_mass_close(got, targets.future_attention_log_mass_reference(q, k, lse, window=window, block_size=16), tol)


@pytest.mark.parametrize("seq, window", [(75, 5), (40, 1), (33, 33)])
def test_kernel_max_reduction_matches_references(rng, seq, window):
    """reduce="max": the strongest single future read, by the kernel and both references."""
    q, k, lse = random_inputs(rng, seq, 4, 2, 16, jnp.float32, "random")
    got = future_lse(q, k, lse, window=window, reduce="max", interpret=INTERPRET, block_k=16, block_q=16)
    want = targets.future_attention_log_mass_dense(q, k, lse, window=window, reduce="max")
    assert_log_mass_close(got, want, 1e-5)
    assert_log_mass_close(got, targets.future_attention_log_mass_reference(q, k, lse, window=window, reduce="max",
                                                                           block_size=16), 1e-5)
    via = targets.future_attention_log_mass(q, k, lse, window=window, reduce="max",
                                            implementation=kernel_backend("pallas"))
    assert_log_mass_close(via, want, 1e-5)


@pytest.mark.parametrize("seq, window, lookahead, blocks", [(75, 5, 0, (16, 16)), (75, 5, 20, (16, 32)),
                                                            (64, 3, 200, (32, 16)), (40, 1, 7, (16, 16))])
def test_kernel_lookahead_matches_references(rng, seq, window, lookahead, blocks):
    q, k, lse = random_inputs(rng, seq, 4, 2, 16, jnp.float32, "dense")
    kw = dict(window=window, lookahead=lookahead)
    got = future_lse(q, k, lse, interpret=True, block_k=blocks[0], block_q=blocks[1], **kw)
    assert_log_mass_close(got, targets.future_attention_log_mass_dense(q, k, lse, **kw), 1e-5)
    assert_log_mass_close(got, targets.future_attention_log_mass_reference(q, k, lse, block_size=16, **kw), 1e-5)


def test_scale_and_log_mass_of_dense_lse(rng):
    """Custom scale; with the dense LSE and w = 0 the masses of each query sum to one."""
    seq, hq, hkv, d, scale = 37, 2, 1, 16, 0.37
    q, k, _ = random_inputs(rng, seq, hq, hkv, d, jnp.float32, "dense")
    lse = targets.dense_lse(q, k, scale=scale)
    got = future_lse(q, k, lse, window=0, scale=scale, interpret=INTERPRET, block_k=16, block_q=16)
    want = targets.future_attention_log_mass_dense(q, k, lse, window=0, scale=scale)
    assert_log_mass_close(got, want, 1e-5)
    # Σ_t m̄_t = Σ_d Σ_{t<=d} p(d, t) = S, a check independent of both implementations.
    np.testing.assert_allclose(np.exp(np.asarray(got, np.float64)).sum(-1), seq, rtol=1e-5)


def test_target_through_dispatcher(rng):
    """`future_attention_target` with the kernel as `log_mass_fn` equals the default path."""
    q, k, lse = random_inputs(rng, 45, 4, 2, 16, jnp.float32, "dense")
    kw = dict(window=6, eps=1e-6)
    fn = functools.partial(targets.future_attention_log_mass, implementation=kernel_backend("pallas"))
    for aggregate in ("max", "mean"):
        got = targets.future_attention_target(q, k, lse, aggregate=aggregate, log_mass_fn=fn, **kw)
        want = targets.future_attention_target(q, k, lse, aggregate=aggregate, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(NATIVE_KERNELS, reason=CPU_ONLY_REASON)
def test_dispatcher_choice(rng, monkeypatch):
    """xla on CPU by default; `$KVPOP_FUTURE_LSE_IMPL` and `implementation` pick the kernel."""
    calls = []
    kernel = targets.future_attention_log_mass_pallas
    monkeypatch.setattr(targets, "future_attention_log_mass_pallas",
                        lambda *a, **kw: calls.append(kw["interpret"]) or kernel(*a, **kw))
    q, k, lse = random_inputs(rng, 20, 2, 1, 16, jnp.float32, "random")
    want = targets.future_attention_log_mass_reference(q, k, lse, window=3)
    env = targets.FUTURE_ATTENTION_LOG_MASS.env_var
    monkeypatch.delenv(env, raising=False)
    assert_log_mass_close(targets.future_attention_log_mass(q, k, lse, window=3), want, 1e-5)
    assert calls == []
    monkeypatch.setenv(env, "pallas_interpret")
    assert_log_mass_close(targets.future_attention_log_mass(q, k, lse, window=3), want, 1e-5)
    assert calls == [True]
    assert_log_mass_close(targets.future_attention_log_mass(q, k, lse, window=3, implementation="xla"), want, 1e-5)
    assert calls == [True]
    monkeypatch.setenv(env, "cuda")
    with pytest.raises(ValueError, match="KVPOP_FUTURE_LSE_IMPL"):
        targets.future_attention_log_mass(q, k, lse, window=3)


def test_rejects_bad_inputs(rng):
    q, k, lse = random_inputs(rng, 16, 4, 2, 16, jnp.float32, "random")
    with pytest.raises(ValueError, match="lse"):
        future_lse(q, k, lse[:, :2], window=1, interpret=True)
    with pytest.raises(ValueError, match="window"):
        future_lse(q, k, lse, window=-1, interpret=True)
    with pytest.raises(ValueError, match="multiple"):
        future_lse(q[:, :, :3], k, lse[:, :3], window=1, interpret=True)


@pytest.mark.parametrize(
    "seq, hq, hkv, d, dtype",
    [(200, 8, 2, 128, jnp.bfloat16), (256, 4, 4, 64, jnp.float32), (77, 4, 1, 20, jnp.bfloat16)],
)
def test_lowers_for_cuda(seq, hq, hkv, d, dtype):
    """The kernel lowers through Pallas' Triton path for CUDA on a CPU-only machine."""
    args = (
        jax.ShapeDtypeStruct((2, seq, hq, d), dtype),
        jax.ShapeDtypeStruct((2, seq, hkv, d), dtype),
        jax.ShapeDtypeStruct((2, hq, seq), jnp.float32),
    )
    fn = functools.partial(targets.future_attention_log_mass, window=32, implementation="pallas")
    exported = export_for_cuda(fn, *args)
    text = exported.mlir_module()
    targets_called = set(re.findall(r"custom_call @([^(\s]+)\(", text))
    assert targets_called and targets_called <= set(TRITON_TARGETS), targets_called
    assert re.findall(r'name = "(kvpop_\w+)"', text) == ["kvpop_future_lse"]
    assert exported.out_avals[0].shape == (2, hq, seq) and exported.out_avals[0].dtype == jnp.float32
