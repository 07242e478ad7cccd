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

from helpers import REPO, parse
from kvpop_jax.config import Qwen3Config
from pallas_kernels.compacted_attention import kvpop_attention_pallas_compacted
from pallas_kernels.compat import KERNEL_TARGETS, compile_for_gpu, export_for_cuda
from pallas_kernels.future_lse import future_attention_log_mass_pallas
from pallas_kernels.mosaic_attention import kvpop_attention_mosaic
from pallas_kernels.sparse_attention import kvpop_attention_pallas
from pallas_kernels.topk_cutoff import running_topk_cutoff_pallas
from train.config import resolve_model_config

H100_TARGET_CONFIG = os.path.join(REPO, "tests", "data", "h100_target_config.txtpb")
RECIPES = ("qwen3_4b_cr75", "qwen3_8b_cr88")  # both models, both k (4032, 2016)


@functools.cache
def recipe_shapes(name: str) -> dict:
    """S, s, w, k from the recipe's flagfile; heads and D from its model config."""
    cwd = os.getcwd()
    os.chdir(REPO)  # nested flagfile paths are relative to the working directory
    try:
        cfg = parse([f"--flagfile=configs/{name}.flags", "--run_dir=/tmp/unused", "--dry_run"], on_accelerator=True)
    finally:
        os.chdir(cwd)
    model = Qwen3Config.from_hf(resolve_model_config(cfg.model_config))
    return dict(seq=cfg.seq_len, hq=model.num_attention_heads, hkv=model.num_key_value_heads, d=model.head_dim,
                sinks=cfg.kvpop.sinks, window=cfg.kvpop.window, topk=cfg.kvpop.topk,
                dtype=jnp.dtype(cfg.compute_dtype))


def _with_vjp(attention):
    """forward + backward of an attention function of (q, k, v, ranks, cutoffs)."""

    def fn(q, k, v, ranks, cutoffs):
        (out, lse), pullback = jax.vjp(lambda q, k, v: attention(q, k, v, ranks, cutoffs), q, k, v)
        return pullback((out, jnp.ones_like(lse)))

    return fn


def kernel_case(kernel: str, recipe: str):
    """(function, abstract args, kernel names its lowering must contain) at the recipe's shapes."""
    r = recipe_shapes(recipe)
    seq, hq, hkv, d, dt = r["seq"], r["hq"], r["hkv"], r["d"], r["dtype"]
    spec = jax.ShapeDtypeStruct
    q, kv = spec((1, seq, hq, d), dt), spec((1, seq, hkv, d), dt)
    ints = spec((1, hkv, seq), jnp.int32)
    policy = dict(sinks=r["sinks"], window=r["window"])
    if kernel == "sparse_attention":
        fn = _with_vjp(functools.partial(kvpop_attention_pallas, **policy))
        return fn, (q, kv, kv, ints, ints), {"kvpop_sparse_attention_fwd", "kvpop_sparse_attention_dq",
                                             "kvpop_sparse_attention_dkdv"}
    if kernel == "compacted_attention":
        fn = _with_vjp(functools.partial(kvpop_attention_pallas_compacted, topk=r["topk"], **policy))
        return fn, (q, kv, kv, ints, ints), {"kvpop_compacted_attention_fwd", "kvpop_compacted_attention_dq",
                                             "kvpop_sparse_attention_dkdv"}
    if kernel == "future_lse":
        fn = functools.partial(future_attention_log_mass_pallas, window=r["window"])
        return fn, (q, kv, spec((1, hq, seq), jnp.float32)), {"kvpop_future_lse"}
    if kernel == "topk_cutoff":
        fn = functools.partial(running_topk_cutoff_pallas, topk=r["topk"], **policy)
        return fn, (ints,), {"kvpop_topk_cutoff"}
    if kernel == "mosaic_attention":
        fn = functools.partial(kvpop_attention_mosaic, **policy)
        return fn, (q, kv, kv, ints, ints), {"kvpop_mosaic_attention_fwd"}
    raise ValueError(kernel)


KERNELS = ("sparse_attention", "compacted_attention", "future_lse", "topk_cutoff", "mosaic_attention")


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
    if not _installed("jax_plugins.xla_cuda12"):
        return "the jax-cuda12-plugin / jax-cuda12-pjrt wheels (same version as jaxlib) are not installed"
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
def test_gpu_compiler_catches_shared_memory_overflow():
    """The check can fail: a Triton tile too large for 227 KiB of shared memory is rejected."""
    spec = jax.ShapeDtypeStruct
    args = (spec((1, 1024, 8, 256), jnp.bfloat16), spec((1, 1024, 2, 256), jnp.bfloat16),
            spec((1, 1024, 2, 256), jnp.bfloat16), spec((1, 2, 1024), jnp.int32), spec((1, 2, 1024), jnp.int32))
    fn = functools.partial(kvpop_attention_pallas, sinks=4, window=32, block_q=128, block_k=256, num_stages=4)
    with open(H100_TARGET_CONFIG) as f, pytest.raises(Exception, match="[Ss]hared memory"):
        compile_for_gpu(fn, *args, target_config=f.read())
