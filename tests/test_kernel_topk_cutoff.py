"""The Pallas running-cutoff kernel (interpret mode) against `policy.running_topk_cutoff_reference`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import CPU_ONLY_REASON, INTERPRET, NATIVE_KERNELS, TRITON_TARGETS, random_ranks, running_cutoffs_np
from pallas_kernels.compat import export_for_cuda
from kvpop_jax import policy
from kvpop_jax.policy import running_topk_cutoff_reference as running_topk_cutoff
from pallas_kernels.topk_cutoff import running_topk_cutoff_pallas as topk_cutoff

running_topk_cutoff_auto = policy.running_topk_cutoff  # the dispatcher


def check(ranks, *, sinks, window, topk, **kernel_kw):
    ranks = np.asarray(ranks, np.int32)
    got = topk_cutoff(jnp.asarray(ranks), sinks=sinks, window=window, topk=topk, interpret=INTERPRET, **kernel_kw)
    want = running_topk_cutoff(jnp.asarray(ranks), sinks=sinks, window=window, topk=topk)
    assert got.shape == ranks.shape and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    flat = ranks.reshape(-1, 1, ranks.shape[-1])  # independent per-query sort
    np.testing.assert_array_equal(
        np.asarray(got).reshape(flat.shape), running_cutoffs_np(flat, sinks=sinks, window=window, topk=topk)
    )


CASES = [
    # S, B, Hkv, sinks, window, topk, block
    (75, 1, 2, 3, 8, 6, 16),  # S not a multiple of the block
    (40, 2, 2, 2, 5, 10, 64),  # S < block
    (96, 1, 3, 4, 16, 0, 16),  # k = 0: S, then −1
    (50, 1, 2, 1, 4, 1000, 16),  # huge k: S everywhere
    (24, 1, 1, 0, 1, 3, 16),  # w = 1, no sinks
    (30, 1, 2, 2, 40, 3, 16),  # w >= S: E(q) always empty
    (200, 1, 2, 4, 8, 1, 32),  # k = 1: many replacements, scans across blocks
    (130, 2, 1, 0, 2, 37, 16),
]


@pytest.mark.parametrize("seq, b, hkv, sinks, window, topk, block", CASES)
def test_kernel_matches_reference(rng, seq, b, hkv, sinks, window, topk, block):
    check(random_ranks(rng, b, hkv, seq), sinks=sinks, window=window, topk=topk, block=block)


@pytest.mark.parametrize("order", ["best_last", "best_first"])
def test_monotone_ranks(order):
    """Every new token enters the top-k (rank decreasing in t), or never does (increasing)."""
    seq = 150
    t = np.arange(seq)
    ranks = (seq - 1 - t if order == "best_last" else t)[None, None]
    check(ranks, sinks=3, window=5, topk=7, block=16)


def test_any_leading_dims(rng):
    ranks = random_ranks(rng, 6, 1, 45).reshape(3, 2, 45)
    check(ranks, sinks=2, window=3, topk=5, block=16)
    check(ranks[0, 0], sinks=2, window=3, topk=5, block=16)


@pytest.mark.skipif(NATIVE_KERNELS, reason=CPU_ONLY_REASON)
def test_dispatcher_choice(rng, monkeypatch):
    """xla on CPU by default; `$KVPOP_CUTOFF_IMPL` and `implementation` pick the kernel."""
    calls = []
    kernel = policy.running_topk_cutoff_pallas
    monkeypatch.setattr(policy, "running_topk_cutoff_pallas",
                        lambda *a, **kw: calls.append(kw["interpret"]) or kernel(*a, **kw))
    ranks = jnp.asarray(random_ranks(rng, 1, 2, 40))
    kw = dict(sinks=2, window=4, topk=6)
    want = running_topk_cutoff(ranks, **kw)
    monkeypatch.delenv(policy.RUNNING_TOPK_CUTOFF.env_var, raising=False)
    np.testing.assert_array_equal(running_topk_cutoff_auto(ranks, **kw), want)
    assert calls == []
    monkeypatch.setenv(policy.RUNNING_TOPK_CUTOFF.env_var, "pallas_interpret")
    np.testing.assert_array_equal(running_topk_cutoff_auto(ranks, **kw), want)
    assert calls == [True]
    np.testing.assert_array_equal(running_topk_cutoff_auto(ranks, implementation="xla", **kw), want)
    assert calls == [True]
    monkeypatch.setenv(policy.RUNNING_TOPK_CUTOFF.env_var, "triton")
    with pytest.raises(ValueError, match="KVPOP_CUTOFF_IMPL"):
        running_topk_cutoff_auto(ranks, **kw)


def test_rejects_bad_arguments():
    ranks = jnp.arange(8, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="window"):
        topk_cutoff(ranks, sinks=0, window=0, topk=1, interpret=True)
    with pytest.raises(ValueError, match="integer"):
        topk_cutoff(ranks.astype(jnp.float32), sinks=0, window=1, topk=1, interpret=True)


@pytest.mark.parametrize("shape, topk", [((2, 8, 4096), 3836), ((1, 4, 300), 0), ((3, 77), 20)])
def test_lowers_for_cuda(shape, topk):
    """The kernel lowers through Pallas' Triton path for CUDA on a CPU-only machine."""
    fn = lambda r: running_topk_cutoff_auto(r, sinks=4, window=32, topk=topk, implementation="pallas")  # noqa: E731
    exported = export_for_cuda(fn, jax.ShapeDtypeStruct(shape, jnp.int32))
    text = exported.mlir_module()
    targets_called = set(re.findall(r"custom_call @([^(\s]+)\(", text))
    assert targets_called and targets_called <= set(TRITON_TARGETS), targets_called
    assert re.findall(r'name = "(kvpop_\w+)"', text) == ["kvpop_topk_cutoff"]
    assert exported.out_avals[0].shape == shape and exported.out_avals[0].dtype == jnp.int32
