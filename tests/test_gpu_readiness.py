"""GPU readiness without a GPU: every kernel at the paper recipes' shapes, for an H100.

1. Lowering (every supported jax, any host): `jax.export` for CUDA runs Pallas' Triton
   lowering (to Triton IR) and Mosaic GPU's whole lowering (layouts, shared-memory budget)
   at Qwen3-4B / Qwen3-8B heads (Hq 32, Hkv 8, D 128), S = 16384, bf16, batch 1 per device.
2. Compilation (where the jax-cuda12-plugin wheels and a `ptxas` are installed): XLA's own GPU
   compiler compiles the same functions for an H100 (`compat.compile_for_gpu`): Triton IR ->
   PTX for sm_90 -> ptxas, failing on shared-memory overflow and on register spills.
   `.ci/run` installs the plugin into its Python 3.12 venv for this.

Neither runs a kernel: numerics are the interpret-mode tests' job (tests/test_kernel_*.py).
"""

import functools
import importlib.util
import os
import re
import shutil

import jax
import jax.numpy as jnp
import pytest

from helpers import H100_TARGET_CONFIG, KERNELS, RECIPES, kernel_case
from pallas_kernels.compat import KERNEL_TARGETS, compile_for_gpu, export_for_cuda
from pallas_kernels.sparse_attention import kvpop_attention_pallas


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_lowers_for_h100_at_recipe_shapes(kernel, recipe):
    fn, args, names = kernel_case(kernel, recipe)
    text = export_for_cuda(fn, *args).mlir_module()
    calls = set(re.findall(r"custom_call @([^(\s]+)\(", text))
    assert calls and calls <= set(KERNEL_TARGETS), calls
    missing = {n for n in names if n not in text}
    assert not missing, f"kernels missing from the lowering: {missing}"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _gpu_compiler_missing() -> str | None:
    if not (_installed("jax_plugins.xla_cuda12") or _installed("jax_plugins.xla_cuda13")):
        return "no jax-cuda12 (or -cuda13) plugin / pjrt wheels (same version as jaxlib) are installed"
    if not (shutil.which("ptxas") or os.path.exists("/usr/local/cuda/bin/ptxas")
            or _installed("nvidia.cuda_nvcc")):
        return "no ptxas (CUDA toolkit, or the nvidia-cuda-nvcc-cu12 wheel)"
    return None


needs_gpu_compiler = pytest.mark.skipif(_gpu_compiler_missing() is not None, reason=str(_gpu_compiler_missing()))


@needs_gpu_compiler
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_h100_without_spills(kernel, recipe):
    """Triton IR -> PTX (sm_90) -> ptxas by XLA's GPU compiler: no shared-memory overflow, no spills."""
    fn, args, _ = kernel_case(kernel, recipe)
    with open(H100_TARGET_CONFIG) as f:
        compiled = compile_for_gpu(fn, *args, target_config=f.read(), fail_on_register_spill=True)
    assert compiled.as_text()


@needs_gpu_compiler
@pytest.mark.parametrize("blocks, spills, error", [
    (dict(block_q=128, block_k=256, num_stages=4), False, "Shared memory size limit exceeded"),  # 321 > 227 KiB
    (dict(block_q=128, block_k=128, num_stages=3), True, "register spilling"),
])
def test_gpu_compiler_catches_overflows(blocks, spills, error):
    """The checks can fail: D = 256 tiles too large for an H100's shared memory, or its registers."""
    spec = jax.ShapeDtypeStruct
    args = (spec((1, 1024, 8, 256), jnp.bfloat16), spec((1, 1024, 2, 256), jnp.bfloat16),
            spec((1, 1024, 2, 256), jnp.bfloat16), spec((1, 2, 1024), jnp.int32), spec((1, 2, 1024), jnp.int32))
    fn = functools.partial(kvpop_attention_pallas, sinks=4, window=32, **blocks)
    with open(H100_TARGET_CONFIG) as f, pytest.raises(Exception, match=error):
        compile_for_gpu(fn, *args, target_config=f.read(), fail_on_register_spill=spills)


@pytest.mark.parametrize("implementation", ["pallas", "pallas_compacted"])
def test_mixed_dtypes_lower_forward_and_backward(implementation):
    """q, k and v of different dtypes reach the Triton kernels in their common dtype: before, Triton's
    lowering failed ("a and b must have the same element type, but got: bf16 and f32") on GPU only,
    for the forward when q and k differed and for the backward when v did. CPU and interpret mode
    accepted the same call."""
    from kvpop_jax.attention import kvpop_attention

    spec = jax.ShapeDtypeStruct
    f = functools.partial(kvpop_attention, sinks=1, window=4, topk=8, implementation=implementation)
    ints = (spec((1, 1, 128), jnp.int32), spec((1, 1, 128), jnp.int32))
    for dtypes in [(jnp.bfloat16, jnp.float32, jnp.float32), (jnp.float32, jnp.float32, jnp.bfloat16)]:
        qkv = tuple(spec(shape, dt) for shape, dt in zip([(1, 128, 2, 64)] + [(1, 128, 1, 64)] * 2, dtypes))
        assert export_for_cuda(f, *qkv, *ints).out_avals[0].dtype == dtypes[0]

        def loss(q, k, v, ranks, cutoffs):
            out, lse = f(q, k, v, ranks, cutoffs)
            return out.astype(jnp.float32).sum() + lse.sum()

        grads = export_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *qkv, *ints).out_avals
        assert [g.dtype for g in grads] == list(dtypes)
