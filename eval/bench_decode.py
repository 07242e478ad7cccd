"""Decode benchmark: per-token latency and memory vs generated length (paper Section 4.1, Fig. 4).

For every method (dense, kvpop, and the training-free baselines at the same budget B) and
every length L, one jitted single-token decode step (batch 1 by default) is timed in the
state it has after L tokens:

- dense: a dense cache (`cache.init_dense_cache` layout) of capacity L + warmup + steps whose first L slots are
  filled with random keys/values and `length = L`. A fixed-shape dense cache costs what
  its capacity costs, so its capacity is L (plus the few timed steps), as in a decode
  loop sized for exactly L tokens.
- kvpop and baselines (streaming, tova, h2o): the bounded cache, filled by the prefill of
  a short random prompt (B + 1 tokens, so every slot is taken), with `length` moved to L.
  The step then runs at RoPE position L with the ring buffer and eviction at position L.
  Its shapes, hence its cost, do not depend on L or on the cached values.
- dms: DMS's pool of Hkv x B entries per layer (`dms_cache.py`, the KVpop memory B =
  `KVpopConfig.memory` per KV head, window w), built the same way. With a random model the
  gates are fresh (they evict nothing, so the pool is full and every step takes the overflow
  path); the step's shapes and work do not depend on the decisions either.

Building the state directly instead of decoding L steps is what lets the CPU reach 32k
tokens in minutes; the step timed is the exact step a real decode runs at length L.
After a warmup (the first call compiles; `compile_s` is reported), `steps` steps are timed
one by one (`block_until_ready` on the new token and cache; the cache is donated, so it is
updated in place as in `generate`) and the median is reported.

Memory: `cache MiB` is the size of the cache pytree (all layers, k/v plus bookkeeping);
on CPU also the process RSS after the steps (VmRSS of /proc/self/status; process-wide,
params and compiled code included); on GPU the device's `bytes_in_use` after the steps and
`peak_bytes_in_use` (a process-lifetime peak: bounded methods run first and dense last,
lengths ascending, so each row's peak is its own).

    rows = run_bench_decode(lengths=(1024, 32768), methods=("dense", "kvpop"), out_dir="eval_out/bench")

Writes `bench_decode.md`, `bench_decode.png`, `bench_decode.json` to `out_dir` and appends
the table with the command, date, device and versions to `benchmarks_md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import inspect
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from eval import bench_torch
from eval.bench_common import (MIB, append_benchmarks, check_markdown_out, cli_command, default_command,
                                device_description, rss_bytes)
from eval.outputs import holds_out_dir, out_dir_arg, staged_outputs
from eval.plots import load_model, markdown_table, plt, save_figure, timestamp, write_text
from kvpop_jax import baselines, dms_cache
from kvpop_jax.cache import Cache, DenseLayerCache, init_cache
from kvpop_jax.config import DMSConfig, KVpopConfig, Qwen3Config, memory_words
from kvpop_jax.dms import matched_gate_hidden
from kvpop_jax.modeling import RETROFIT_SUBTREES, Qwen3ForCausalLM, init_params, retrofit_params, strip_kvpop

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
METHODS = ("dense", "kvpop", "dms") + baselines.BOUNDED_METHODS + bench_torch.METHODS


def tiny_config(*, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                intermediate: int | None = None, vocab: int = 1024, sinks: int = 4, window: int = 128,
                topk: int = 384, scorer: str = "mlp") -> Qwen3Config:
    """The benchmark's default random model: a few layers, B = s + w + k = 516 by default."""
    return Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=1_000_000.0, max_position_embeddings=1 << 20,
        kvpop=KVpopConfig(sinks=sinks, window=window, topk=topk, scorer=scorer),
    )


def parse_lengths(text: str, flag: str = "lengths") -> tuple[int, ...]:
    """"1k,2k,32768" -> (1024, 2048, 32768) (k = 1024); a ValueError naming `flag` otherwise."""
    out = []
    try:
        for part in text.split(","):
            part = part.strip().lower()
            if part:
                out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    except (ValueError, OverflowError):  # OverflowError: 'infk' (int of an infinite float)
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"--{flag} must be positive ints like '1k,2k,4096', got {text!r}")
    return tuple(out)


def _cache_nbytes(cache) -> int:
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)))


# ------------------------------------------------------------------------------- states


@functools.partial(jax.jit, static_argnames=("model",), donate_argnums=(2,))
def _step(model: Qwen3ForCausalLM, params, cache, tok_Bx1):
    """One greedy decode step: (next token [B, 1], new cache)."""
    out = model.apply({"params": params}, tok_Bx1, cache=cache)
    return jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)[:, None], out.cache


@functools.partial(jax.jit, static_argnames=("model",))
def _prefill(model: Qwen3ForCausalLM, params, cache, prompt_BxP):
    return model.apply({"params": params}, prompt_BxP, cache=cache).cache


@functools.partial(jax.jit, static_argnames=("config", "batch", "capacity", "dtype"))
def _dense_state(config: Qwen3Config, batch: int, length, capacity: int, dtype, key) -> Cache:
    """A dense cache of `capacity` slots per layer holding random k/v and `length` = L.

    Jitted and tiled from a small random block so building it allocates little beyond the
    cache itself (the device's peak memory must be the decode step's, not the set-up's).
    Slots >= L are masked by the step; their content does not matter.
    """
    block = min(capacity, 256)
    reps = -(-capacity // block)

    def fill(k):
        small = jax.random.normal(k, (batch, config.num_key_value_heads, block, config.head_dim), dtype)
        return jnp.tile(small, (1, 1, reps, 1))[:, :, :capacity]

    keys = jax.random.split(key, 2 * config.num_hidden_layers)
    layers = tuple(DenseLayerCache(k=fill(keys[2 * i]), v=fill(keys[2 * i + 1]))
                   for i in range(config.num_hidden_layers))
    return Cache(layers=layers, length=jnp.asarray(length, jnp.int32), started=True)


def _empty_bounded_cache(method: str, config: Qwen3Config, budget: int, sinks: int, batch: int, dtype):
    if method == "kvpop":
        return init_cache(config, batch, dtype)
    if method == "dms":
        return dms_cache.init_cache(config, batch, dtype)
    cfg = baselines.BaselineConfig(method, budget=budget, sinks=sinks)
    return baselines.init_cache(config, cfg, batch, dtype)


def _bounded_state(model, params, cache, budget: int, length: int, key):
    """The bounded cache after a (B + 1)-token random prefill, with `length` moved to L."""
    batch = jax.tree_util.tree_leaves(cache)[0].shape[0]
    p = max(1, min(length, budget + 1))
    prompt = jax.random.randint(key, (batch, p), 0, model.config.vocab_size, jnp.int32)
    cache = _prefill(model, params, cache, prompt)
    return cache.replace(length=jnp.asarray(length, jnp.int32))


# ---------------------------------------------------------------------------- benchmark


@dataclasses.dataclass
class BenchRow:
    method: str
    length: int
    ms_median: float
    ms_p10: float
    ms_p90: float
    compile_s: float
    cache_bytes: int
    rss_bytes: int | None
    device_bytes_in_use: int | None
    device_peak_bytes: int | None


def _device_memory() -> tuple[int | None, int | None]:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None, None
    stats = dev.memory_stats() or {}
    return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")


def _measure(model, params, cache, batch: int, warmup: int, steps: int) -> tuple[list[float], float, Any]:
    tok = jnp.zeros((batch, 1), jnp.int32)
    start = time.perf_counter()
    tok, cache = _step(model, params, cache, tok)
    jax.block_until_ready((tok, cache))
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        tok, cache = _step(model, params, cache, tok)
    jax.block_until_ready((tok, cache))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tok, cache = _step(model, params, cache, tok)
        jax.block_until_ready((tok, cache))
        times.append((time.perf_counter() - start) * 1e3)
    return times, compile_s, cache


def _models(checkpoint, model_config: Qwen3Config | None, kvpop: KVpopConfig | None, dtype, seed: int):
    """(kvpop config, params, dense config, params): a checkpoint (retrofitted with `kvpop`
    when it is dense) or a random model of `model_config` (default `tiny_config()`)."""
    if checkpoint is not None:
        config, params = load_model(checkpoint, dtype=dtype)
        if kvpop is not None and config.kvpop is not None and kvpop != config.kvpop:
            raise ValueError("the checkpoint is a KVpop export: its budget comes from its config, not `kvpop`")
    else:
        config = model_config or tiny_config()
        params = init_params(dataclasses.replace(config, kvpop=None), jax.random.key(seed), dtype)
        config = config if kvpop is None else dataclasses.replace(config, kvpop=kvpop)
    if config.kvpop is None and kvpop is not None:  # a dense model: fresh KVpop heads (timing ignores values)
        config = dataclasses.replace(config, kvpop=kvpop)
    if (config.kvpop is not None or config.dms is not None) and not any(
            t in params["layers_0"]["self_attn"] for t in RETROFIT_SUBTREES):
        params = retrofit_params(config, params, jax.random.key(seed + 1))
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    dense_config, dense_params = strip_kvpop(config, params)
    return config, params, dense_config, dense_params


@holds_out_dir("bench_decode.png", "bench_decode.json", "bench_decode.md")
def run_bench_decode(
    checkpoint=None,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    methods: Sequence[str] = ("dense", "kvpop"),
    out_dir: str | os.PathLike,
    benchmarks_md: str | os.PathLike | None = "BENCHMARKS.md",
    model_config: Qwen3Config | None = None,
    kvpop: KVpopConfig | None = None,
    batch: int = 1,
    warmup: int = 3,
    steps: int = 16,
    dtype=jnp.float32,
    seed: int = 0,
    command: str | None = None,
    progress: bool = True,
) -> list[BenchRow]:
    """Times one decode step per (method, length) and records cache/process/device memory.

    Args:
      checkpoint: None (a random model of `model_config`, default `tiny_config()`), a
        checkpoint directory or a `(config, params)` pair. A dense checkpoint needs `kvpop`
        (the budget; its KVpop heads are then freshly initialized: timing does not depend
        on their values). The dense method runs a KVpop checkpoint's weights densely.
      lengths: context lengths L (tokens already generated) at which a step is timed.
      methods: from METHODS; baselines run at the budget B = s + w + k of the kvpop config.
      out_dir: where bench_decode.md / .png / .json go.
      benchmarks_md: markdown file the results are appended to (None: no append).
      warmup, steps: untimed steps after the compiling one, and timed steps (median).
      command: the command line recorded with the results (default: this process's).

    Returns:
      one BenchRow per (method, length), in run order.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {list(methods)}")
    lengths = sorted({int(x) for x in lengths})
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths must be positive, got {lengths}")
    if steps < 1 or warmup < 0 or batch < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, batch >= 1; got {steps}, {warmup}, {batch}")
    if benchmarks_md is not None:  # before minutes of timing, not after them
        check_markdown_out(benchmarks_md, "--benchmarks_md")
    command = command or default_command()
    config, params, dense_config, dense_params = _models(checkpoint, model_config, kvpop, dtype, seed)
    kv = config.kvpop
    if kv is None and config.dms is None and any(m not in ("dense", "torch-dense") for m in methods):
        raise ValueError("the bounded methods need a budget: pass kvpop=KVpopConfig(...) for a dense checkpoint")
    if kv is None and "kvpop" in methods:
        raise ValueError("method kvpop needs a KVpop model (the checkpoint is a DMS export)")
    # One memory per KV head for every bounded method: KVpop's (s + w + k + scorer state), or a DMS export's.
    budget = kv.memory(config.head_dim) if kv is not None else config.dms.budget
    sinks = kv.sinks if kv is not None else 4
    dms_config = config.dms
    if dms_config is None and "dms" in methods:
        dms_config = DMSConfig(window=kv.window, budget=budget, target_eviction=0.0,
                               gate_hidden=matched_gate_hidden(kv, config.head_dim))
    max_pos = lengths[-1] + warmup + steps + 1
    if max_pos > config.max_position_embeddings:
        # RoPE has no hard limit; the field only documents the trained context.
        config = dataclasses.replace(config, max_position_embeddings=max_pos)
        dense_config = dataclasses.replace(dense_config, max_position_embeddings=max_pos)
    kvpop_model = Qwen3ForCausalLM(config, dtype=dtype) if kv is not None else None
    dense_model = Qwen3ForCausalLM(dense_config, dtype=dtype)
    dms_model = dms_params = None
    if "dms" in methods:
        dms_model = Qwen3ForCausalLM(dataclasses.replace(dense_config, dms=dms_config), dtype=dtype)
        dms_params = params if config.dms is not None else jax.tree.map(
            lambda x: x.astype(dtype), retrofit_params(dms_model.config, dense_params, jax.random.key(seed + 2)))

    # Bounded methods first, dense last: the device's peak is a process-lifetime peak (torch rows: own allocator).
    torch_methods = [m for m in methods if m in bench_torch.METHODS]
    methods = [m for m in methods if m not in bench_torch.METHODS]
    order = [m for m in methods if m != "dense"] + [m for m in methods if m == "dense"]
    rows: list[BenchRow] = []
    bar = tqdm(total=len(order) * len(lengths), desc="bench decode", unit="point", disable=not progress)
    key = jax.random.key(seed)
    for method in order:
        for length in lengths:
            bar.set_postfix_str(f"{method} L={length}")
            key, sub = jax.random.split(key)
            if method == "dense":
                model, p = dense_model, dense_params
                cache = _dense_state(dense_config, batch, length, length + warmup + steps + 1, jnp.dtype(dtype), sub)
            else:  # the baselines run the dense weights; the KVpop memory sizes their caches
                model, p = {"kvpop": (kvpop_model, params), "dms": (dms_model, dms_params)}.get(
                    method, (dense_model, dense_params))
                empty = _empty_bounded_cache(method, model.config, budget, sinks, batch, dtype)
                cache = _bounded_state(model, p, empty, budget, length, sub)
            cache_bytes = _cache_nbytes(cache)
            times, compile_s, cache = _measure(model, p, cache, batch, warmup, steps)
            in_use, peak = _device_memory()
            rows.append(BenchRow(
                method=method, length=length, ms_median=statistics.median(times),
                ms_p10=float(np.percentile(times, 10)), ms_p90=float(np.percentile(times, 90)),
                compile_s=compile_s, cache_bytes=cache_bytes, rss_bytes=rss_bytes(),
                device_bytes_in_use=in_use, device_peak_bytes=peak,
            ))
            del cache
            gc.collect()
            bar.update()
    bar.close()
    notes = []
    if torch_methods:
        torch_rows, note = bench_torch.run_torch_rows(
            torch_methods, config, params, lengths=lengths, batch=batch, warmup=warmup, steps=steps,
            dtype_name=jnp.dtype(dtype).name, seed=seed)
        rows += [BenchRow(**r) for r in torch_rows]
        notes.append(note)

    info = dict(
        command=command, date=timestamp(), device=device_description(), batch=batch, warmup=warmup, steps=steps,
        dtype=jnp.dtype(dtype).name, model=_model_summary(config, checkpoint),
        budget=None if kv is None and config.dms is None else dict(
            memory=budget, sinks=sinks, **({} if kv is None else dict(window=kv.window, topk=kv.topk,
                                                                        budget=kv.budget, scorer=kv.scorer))),
        dms=None if dms_model is None else dict(window=dms_config.window, budget=dms_config.budget,
                                                 gate_hidden=dms_config.gate_hidden),
        notes=notes,
    )
    for note in notes:
        print(note)
    out_dir = os.fspath(out_dir)
    with staged_outputs(out_dir) as out:  # the three files are replaced together or not at all
        plot_bench(rows, out.path("bench_decode.png"), on_cpu=info["device"]["platform"] == "cpu")
        png = out.final("bench_decode.png")
        write_text(out.path("bench_decode.json"),
                   json.dumps(dict(info=info, rows=[dataclasses.asdict(r) for r in rows]), indent=1))
        write_text(out.path("bench_decode.md"), bench_markdown(rows, info, png, out_dir))
    if benchmarks_md is not None:
        append_benchmarks(benchmarks_md, bench_markdown(rows, info, png, os.path.dirname(os.path.abspath(
            os.fspath(benchmarks_md))), heading="##"))
        print(f"appended the results to {os.path.abspath(os.fspath(benchmarks_md))}", file=sys.stderr)
    return rows


def _model_summary(config: Qwen3Config, checkpoint) -> str:
    name = "random" if checkpoint is None else (
        "in-memory checkpoint" if isinstance(checkpoint, tuple) else f"checkpoint `{checkpoint}`")
    return (f"{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads x {config.head_dim}, "
            f"mlp {config.intermediate_size}, vocab {config.vocab_size}")


# ------------------------------------------------------------------------------ reports


def plot_bench(rows: Sequence[BenchRow], path: str, *, on_cpu: bool) -> str:
    """Latency, cache size and process (CPU: RSS) or device (GPU: peak) memory vs length."""
    fig, (ax_t, ax_c, ax_m) = plt.subplots(1, 3, figsize=(14, 3.6), constrained_layout=True)
    for method in dict.fromkeys(r.method for r in rows):
        rs = [r for r in rows if r.method == method]
        x = [r.length for r in rs]
        line, = ax_t.plot(x, [r.ms_median for r in rs], marker="o", label=method)
        ax_t.fill_between(x, [r.ms_p10 for r in rs], [r.ms_p90 for r in rs], color=line.get_color(), alpha=0.15)
        ax_c.plot(x, [r.cache_bytes / MIB for r in rs], marker="o", color=line.get_color(), label=method)
        other = [r.rss_bytes if on_cpu else r.device_peak_bytes for r in rs]
        if all(v is not None for v in other):
            ax_m.plot(x, [v / MIB for v in other], marker="o", color=line.get_color(), label=method)
    titles = ("Decode latency", "KV cache size", "Process RSS" if on_cpu else "Peak device memory")
    ylabels = ("ms / token (median, p10-p90 band)", "MiB", "MiB")
    for ax, title, ylabel in zip((ax_t, ax_c, ax_m), titles, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def bench_markdown(rows: Sequence[BenchRow], info: dict, png: str, relative_to: str, heading: str = "#") -> str:
    dev = info["device"]
    on_cpu = dev["platform"] == "cpu"
    b = info["budget"]
    mem_cols = ["RSS MiB"] if on_cpu else ["device in use MiB", "device peak MiB"]
    table = []
    for r in rows:
        mem = [r.rss_bytes / MIB if r.rss_bytes is not None else "n/a"] if on_cpu else [
            r.device_bytes_in_use / MIB if r.device_bytes_in_use is not None else "n/a",
            r.device_peak_bytes / MIB if r.device_peak_bytes is not None else "n/a"]
        table.append([r.method, r.length, r.ms_median, r.ms_p90, r.cache_bytes / MIB, *mem, r.compile_s])
    png_rel = os.path.relpath(png, relative_to)
    where = f"{dev['platform']} ({dev['device_kind']}" + (f", {dev['cpu_count']} cores)" if on_cpu else ")")
    return "\n".join([
        f"{heading} Decode latency and memory vs length ({info['date']})\n",
        f"- Command: `{info['command']}`",
        f"- Device: {where}; jax {dev['jax']}, jaxlib {dev['jaxlib']}, Python {dev['python']}",
        f"- Model: {info['model']}; {info['dtype']}, batch {info['batch']}",
        _budget_line(b, info.get("dms")),
        f"- Method: the decode step at context length L is timed in the state it has after L tokens, built "
        f"directly (dense: a cache of capacity ≈ L filled with random k/v; bounded caches: a (B+1)-token prefill "
        f"with the length moved to L, same shapes and cost as after L real steps). Median of {info['steps']} "
        f"steps after compile + {info['warmup']} warmup steps; cache MiB = bytes of the cache pytree; "
        + ("RSS = VmRSS of the process after the steps." if on_cpu else
           "device memory from `memory_stats()` (peak is process-lifetime; dense runs last)."),
        *[f"- {note}" for note in info.get("notes", ())],
        "",
        markdown_table(["method", "length", "ms/token (median)", "ms/token (p90)", "cache MiB", *mem_cols,
                        "first step s (compile)"], table, digits=2),
        f"![decode latency and memory]({png_rel})\n",
    ])


def _budget_line(b: dict | None, dms: dict | None) -> str:
    if b is None:
        return "- Budget: none (dense only)"
    if "topk" in b:
        line = (f"- Budget: s={b['sinks']}, w={b['window']}, k={b['topk']}: {memory_words(b['budget'], b['memory'])}, "
                f"scorer {b['scorer']}; baselines at the same memory")
    else:
        line = f"- Budget: memory {b['memory']} entries per KV head (the DMS export's); baselines at the same memory"
    if dms is not None:
        line += (f"; dms: window {dms['window']}, a pool of Hkv x {dms['budget']} entries per layer, gate width "
                 f"{dms['gate_hidden']}")
    return line


SIZE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
BUDGET_FLAGS = ("sinks", "window", "topk")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m eval.bench_decode [flags]` (also reachable as `python -m eval.main bench decode`)."""
    d = dict(inspect.signature(tiny_config).parameters)
    ap = argparse.ArgumentParser(prog="python -m eval.main bench decode", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (default: a random tiny model)")
    ap.add_argument("--lengths", default="1k,2k,4k,8k,16k,32k")
    ap.add_argument("--methods", default="dense,kvpop", help=f"comma-separated subset of {METHODS}")
    ap.add_argument("--out_dir", default="outputs/bench_decode", type=out_dir_arg)
    ap.add_argument("--benchmarks_md", default="BENCHMARKS.md",
                    help="markdown file the results are appended to, with the command (default %(default)s, the "
                         "project's record of performance claims; '' = none)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    for name in SIZE_FLAGS + BUDGET_FLAGS:
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"random model size / budget (budget also used with a dense --checkpoint; default "
                             f"{d[name].default})")
    ap.add_argument("--scorer", default=None, help=f"with --sinks etc. (default {d['scorer'].default})")
    args = ap.parse_args(argv)
    # The size flags build the random model; a checkpoint has its own. The budget flags retrofit a dense
    # checkpoint; a KVpop or DMS export brings its own. Either, given, was ignored without a word.
    retrofitted = args.checkpoint is not None and (lambda c: c.kvpop or c.dms)(Qwen3Config.from_hf(args.checkpoint))
    dense_checkpoint = args.checkpoint is not None and not retrofitted
    ignored = (SIZE_FLAGS if args.checkpoint is not None else ()) + (BUDGET_FLAGS + ("scorer",) if retrofitted else ())
    given = [f"--{name}" for name in ignored if getattr(args, name) is not None]
    if given:
        ap.error(f"{', '.join(given)}: {args.checkpoint} brings its own "
                 + ("size and budget (a KVpop or DMS export)" if retrofitted else "size"))
    sizes = {k: d[k].default if getattr(args, k) is None else getattr(args, k) for k in d}
    model_config = tiny_config(**sizes)
    rows = run_bench_decode(
        args.checkpoint, lengths=parse_lengths(args.lengths), methods=tuple(args.methods.split(",")),
        out_dir=args.out_dir, benchmarks_md=args.benchmarks_md or None, model_config=model_config,
        kvpop=model_config.kvpop if dense_checkpoint else None, batch=args.batch, warmup=args.warmup,
        steps=args.steps, dtype=jnp.dtype(args.dtype), command=cli_command(ap.prog, argv),
    )
    for r in rows:
        print(f"{r.method:>9} L={r.length:>6}  {r.ms_median:8.3f} ms/token  cache {r.cache_bytes / MIB:9.2f} MiB")


if __name__ == "__main__":
    main()


__all__ = ["DEFAULT_LENGTHS", "METHODS", "BenchRow", "bench_markdown", "parse_lengths", "plot_bench",
           "run_bench_decode", "tiny_config"]
