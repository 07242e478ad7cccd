"""Helpers shared by the tests (fixtures live in conftest.py): tiny configs and checkpoints,
numpy brute forces of the KVpop mask, kernel-test constants, the kernels at the recipes' shapes,
and train.main command lines."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from kvpop_jax import save_pretrained
from kvpop_jax.config import Qwen3Config
from kvpop_jax.modeling import abstract_params
from pallas_kernels.compacted_attention import kvpop_attention_pallas_compacted
from pallas_kernels.compat import TRITON_TARGETS  # noqa: F401  (re-exported for the kernel tests)
from pallas_kernels.future_lse import future_attention_log_mass_pallas
from pallas_kernels.mosaic_attention import kvpop_attention_mosaic
from pallas_kernels.sparse_attention import kvpop_attention_pallas
from pallas_kernels.topk_cutoff import running_topk_cutoff_pallas
from train.config import resolve_model_config
from train.configure import config_from_flags
from train.flags import define_flags
from train.run_dir import LOCK_FILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Another process holding FOLDER/run.lock the way train.main and eval do (flock + its PID); argv[1]: FOLDER.
HOLD_LOCK = f"""
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], {LOCK_FILE!r}), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"%d\\n" % os.getpid())
print("locked", flush=True)
time.sleep(120)
"""


def hold_lock(folder: str, script: str = HOLD_LOCK) -> subprocess.Popen:
    """A child process that holds `folder`'s lock (created) by `script` until killed: it prints `locked`
    once it holds it, and gets the folder as argv[1]."""
    os.makedirs(folder, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "locked"
    return proc


# Tiny Qwen3 configs covering GQA group sizes 1/2/4, tied and untied heads, two rope
# thetas, head_dim != hidden/heads and attention biases.
TINY_HF_CONFIGS = {
    "g1_tied": dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, rope_theta=10_000.0,
                    tie_word_embeddings=True),
    "g2_untied": dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0,
                      tie_word_embeddings=False),
    "g4_bias": dict(vocab_size=89, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=500_000.0,
                    tie_word_embeddings=False, attention_bias=True),
}


@contextlib.contextmanager
def logged_compiles():
    """Yields a list that collects (thread name, function) of every XLA compile inside the block.
    jax_log_compiles is set globally (the `jax.log_compiles()` context is thread-local), so a
    worker thread's compiles show too."""
    seen = []

    class Handler(logging.Handler):
        def emit(self, record):
            match = re.match(r"Finished XLA compilation of (\S+)", record.getMessage())
            if match:
                seen.append((record.threadName, match.group(1)))

    handler, logger = Handler(), logging.getLogger("jax")
    logger.addHandler(handler)
    before = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield seen
    finally:
        jax.config.update("jax_log_compiles", before)
        logger.removeHandler(handler)


def make_hf_checkpoint(path, seed: int = 0, **overrides):
    """Saves a random HF Qwen3ForCausalLM to `path` and returns the torch model.

    Weights are re-drawn with a larger scale than HF's init (std 0.02 gives near-constant
    logits, which would let a wrong implementation pass), norms away from 1.
    """
    import torch
    import transformers

    kwargs = dict(TINY_HF_CONFIGS["g2_untied"], max_position_embeddings=512)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


def kvpop_export(path, base, kvpop, rng):
    """A random KVpop model saved as an export (kvpop_jax.save_pretrained) -> (config, params).

    Drawn with numpy on the parameter shapes (nothing to compile): weights ~ N(0, 1/hidden),
    norm scales near 1, and every KVpop parameter ~ N(0, 1) (their own init zeroes the scorers'
    final projections: all scores equal, eviction by recency only).
    """
    config = dataclasses.replace(base, kvpop=kvpop)

    def draw(key_path, leaf):
        name = jax.tree_util.keystr(key_path)
        if "kvpop" in name:
            x = rng.normal(size=leaf.shape)
        elif "scale" in name:
            x = 1.0 + 0.3 * rng.normal(size=leaf.shape)
        else:
            x = rng.normal(size=leaf.shape) / np.sqrt(base.hidden_size)
        return jnp.asarray(x, leaf.dtype)

    params = jax.tree_util.tree_map_with_path(draw, abstract_params(config))
    save_pretrained(config, params, path)
    return config, params


# --- numpy brute force (independent of kvpop_jax.policy) ---------------------------------


def random_ranks(rng, b, hkv, s):
    """A random permutation of 0..S-1 per (batch, KV head)."""
    return np.stack([np.stack([rng.permutation(s) for _ in range(hkv)]) for _ in range(b)]).astype(np.int32)


def running_cutoffs_np(ranks, *, sinks, window, topk):
    """τ_q by a per-query sort: k-th smallest rank in E(q) = [s, q − w], or S if |E(q)| <= k."""
    b, h, s = ranks.shape
    cut = np.full((b, h, s), s, np.int32)
    for q in range(s):
        lo, hi = sinks, q - window
        if hi - lo + 1 > topk:
            cut[:, :, q] = np.sort(ranks[:, :, lo : hi + 1], axis=-1)[:, :, topk - 1] if topk > 0 else -1
    return cut


def kvpop_mask_np(ranks, cutoffs, *, sinks, window):
    """bool [B, Hkv, S, S], one (q, t) at a time, straight from the mask's definition
    (`kvpop_jax/policy.py`'s docstring)."""
    b, h, s = ranks.shape
    m = np.zeros((b, h, s, s), bool)
    for q in range(s):
        for t in range(q + 1):
            sink = t < sinks
            win = q - t < window
            long_range = (sinks <= t <= q - window) & (ranks[:, :, t] <= cutoffs[:, :, q])
            m[:, :, q, t] = sink | win | long_range
    return m


def masked_attention_np(q, k, v, mask, scale=None):
    """float64 masked softmax attention; returns out [B, S, Hq, D], lse [B, Hq, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    scale = d**-0.5 if scale is None else scale
    k = np.repeat(k, g, axis=2)
    v = np.repeat(v, g, axis=2)
    mask = np.repeat(mask, g, axis=1)  # [B, Hq, S, S]
    logits = np.einsum("bqhd,bthd->bhqt", q, k) * scale
    logits = np.where(mask, logits, -np.inf)
    mx = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - mx).sum(-1)) + mx[..., 0]
    p = np.exp(logits - lse[..., None])
    return np.einsum("bhqt,bthd->bqhd", p, v), lse


def random_qkv(rng, b, s, hq, hkv, d, dtype=jnp.float32):
    q = rng.standard_normal((b, s, hq, d))
    k = rng.standard_normal((b, s, hkv, d))
    v = rng.standard_normal((b, s, hkv, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


# --- Pallas kernels ------------------------------------------------------------------------

SMALL_BLOCKS = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
# `python -m eval.main bench gpu` sets KVPOP_KERNEL_TESTS=native: the kernel tests then run the kernels
# compiled on the GPU instead of in interpret mode, and skip what holds only on CPU.
NATIVE_KERNELS = os.environ.get("KVPOP_KERNEL_TESTS") == "native"
INTERPRET = not NATIVE_KERNELS
CPU_ONLY_REASON = "checks CPU behaviour (interpret mode, the CPU default back end)"


def kernel_backend(name: str) -> str:
    """A dispatcher back-end name run the way the kernel tests run: "pallas" or "pallas_interpret"."""
    return name if NATIVE_KERNELS else f"{name}_interpret"


# --- GPU readiness: the kernels at the paper recipes' shapes (tests/test_gpu_readiness.py,
# benchmarks/h100_compile_report.py) ------------------------------------------------------

H100_TARGET_CONFIG = os.path.join(REPO, "tests", "data", "h100_target_config.txtpb")  # an H100 SXM (XLA's text)
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


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
    assert err <= tol, f"relative error {err:.3g} > {tol}"


# --- train.main ----------------------------------------------------------------------------

TINY_ARCH = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                 tie_word_embeddings=True, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


def tiny_flags(run_dir, arch_path, **overrides) -> list[str]:
    """A train.main command line for a 1-layer random model on generated demo data (seconds per run)."""
    values = dict(
        run_dir=run_dir, init_checkpoint=f"random:{arch_path}", tokenizer="demo", data="demo:24",
        demo_seq_len=256, split_documents=True, max_length=512, seq_len=128, sinks=4, window=16, topk=16,
        scorer="mlp", num_query_samples=16, kl_topk=16, global_batch=4, micro_batch=2, steps=40, warmup_steps=2,
        checkpoint_every=2, keep_checkpoints=3, compute_dtype="float32", teacher_dtype="float32",
        progress=False, loss_chunk=64,
    )
    values.update(overrides)
    out = []
    for k, v in values.items():
        if v is None:  # the flag's own default
            continue
        if isinstance(v, bool):
            out.append(f"--{k}" if v else f"--no{k}")
        else:
            out.append(f"--{k}={v}")
    return out


def parse(argv, on_accelerator=False):
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["train"] + argv)
    return config_from_flags(fv, on_accelerator=on_accelerator)


def train_env(tmp_path):
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3",
                JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))


def train_cmd(argv):
    return [sys.executable, "-m", "train.main"] + argv


def assert_a_failed_rerun_keeps_the_report(folder, monkeypatch, module, name: str, first, again, files) -> None:
    """`first()` writes the report `files` (and the folder's lock) into `folder`; `again()`, with `module.name`
    failing after part of the report is rewritten, must leave every file byte for byte: no mix of two runs (the
    files used to be renamed one after another), no temporaries."""
    first()
    before = {f: (folder / f).read_bytes() for f in os.listdir(folder)}
    assert set(before) == set(files) | {LOCK_FILE}

    def broken(*args, **kwargs):
        raise RuntimeError("the report failed")

    monkeypatch.setattr(module, name, broken)
    with pytest.raises(RuntimeError, match="the report failed"):
        again()
    assert {f: (folder / f).read_bytes() for f in os.listdir(folder)} == before
