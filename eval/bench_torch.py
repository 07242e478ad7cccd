"""`bench decode` rows for PyTorch: transformers' dense cache vs kvpop_torch's bounded KVpopCache.

Methods `torch-dense` and `torch-kvpop` time one greedy decode step of `transformers`'
Qwen3ForCausalLM with the same weights as the JAX rows (written once with `save_pretrained`
to a temporary export and loaded by `kvpop_torch.load`), in the state it has after L tokens,
built as the JAX rows build theirs:

- torch-dense: a `DynamicCache` holding L random keys/values per layer ("sdpa" attention);
  each step appends one token, as transformers' own decode loop does.
- torch-kvpop: a `KVpopCache` after the prefill of a random (B + 1)-token prompt, with its
  token count moved to L ("kvpop" attention): the step runs at RoPE position L with the
  eviction at position L, and its cost does not depend on L.

torch and transformers are imported inside the functions that need them: without them the
rows are skipped with a note (`pip install -e ".[torch]"`).
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from typing import Sequence

import numpy as np

from eval.bench_common import rss_bytes
from kvpop_jax import save_pretrained
from kvpop_jax.config import Qwen3Config

METHODS = ("torch-dense", "torch-kvpop")
SKIP_NOTE = "torch-dense / torch-kvpop rows skipped: torch is not installed (pip install -e \".[torch]\")"


def torch_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def run_torch_rows(methods: Sequence[str], config: Qwen3Config, params, *, lengths: Sequence[int], batch: int,
                   warmup: int, steps: int, dtype_name: str, seed: int) -> tuple[list[dict], str]:
    """Times `methods` (a subset of METHODS) at every length.

    config/params: the model (with `config.kvpop` for torch-kvpop). Returns (one dict of
    `bench_decode.BenchRow` fields per (method, length), a note for the report: what ran, or
    why nothing did).
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"torch methods must be in {METHODS}, got {unknown}")
    if "torch-kvpop" in methods and config.kvpop is None:
        raise ValueError("torch-kvpop needs a KVpop budget (config.kvpop)")
    if not torch_available():
        return [], SKIP_NOTE
    import torch
    import transformers

    import kvpop_torch

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as export:
        save_pretrained(config, params, export)
        model, make_cache = kvpop_torch.load(export, dtype=getattr(torch, dtype_name), device=device)
        for method in methods:
            for length in lengths:
                if method == "torch-dense":
                    model.set_attn_implementation("sdpa")
                    cache = _dense_state(model, batch, length)
                else:
                    model.set_attn_implementation(kvpop_torch.ATTENTION_NAME)
                    cache = _kvpop_state(model, make_cache(), config.kvpop.budget, batch, length)
                cache_bytes = _cache_bytes(cache)
                times, first_s = _measure(model, cache, batch, warmup, steps)
                in_use, peak = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) \
                    if device == "cuda" else (None, None)
                rows.append(dict(
                    method=method, length=length, ms_median=statistics.median(times),
                    ms_p10=float(np.percentile(times, 10)), ms_p90=float(np.percentile(times, 90)),
                    compile_s=first_s, cache_bytes=cache_bytes, rss_bytes=rss_bytes(),
                    device_bytes_in_use=in_use, device_peak_bytes=peak,
                ))
                del cache
    note = (f"torch rows (`eval/bench_torch.py`): torch {torch.__version__}, transformers {transformers.__version__} "
            f"on {device}, the same weights; torch-dense grows a DynamicCache (sdpa), torch-kvpop is "
            f"kvpop_torch.KVpopCache; memory columns: " + ("torch's allocator" if device == "cuda" else "RSS"))
    return rows, note


def _dense_state(model, batch: int, length: int):
    """transformers' DynamicCache holding `length` random keys/values per layer."""
    import torch
    from transformers import DynamicCache

    c = model.config
    param = next(model.parameters())
    cache = DynamicCache(config=c)
    shape = (batch, c.num_key_value_heads, length, c.head_dim)
    for i in range(c.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=param.dtype, device=param.device),
                     torch.randn(shape, dtype=param.dtype, device=param.device), i)
    return cache


def _kvpop_state(model, cache, budget: int, batch: int, length: int):
    """The KVpopCache after a random (B + 1)-token prefill, its token count moved to `length`."""
    import torch

    prompt_len = max(2, min(length, budget + 1))
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=next(model.parameters()).device)
    with torch.inference_mode():
        model(prompt, cache=cache)
    for layer in cache.layers:
        layer.seen = length
    return cache


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return int(sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values)))


def _measure(model, cache, batch: int, warmup: int, steps: int) -> tuple[list[float], float]:
    """(ms per timed step, seconds of the first step): greedy, one token per step."""
    import torch

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tok = torch.zeros((batch, 1), dtype=torch.long, device=device)

    def step(tok):
        out = model(tok, cache=cache, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return nxt

    times = []
    with torch.inference_mode():
        start = time.perf_counter()
        tok = step(tok)
        first_s = time.perf_counter() - start
        for _ in range(warmup):
            tok = step(tok)
        for _ in range(steps):
            start = time.perf_counter()
            tok = step(tok)
            times.append((time.perf_counter() - start) * 1e3)
    return times, first_s
