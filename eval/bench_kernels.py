"""Kernel benchmark: each Pallas kernel vs its XLA reference and vs dense attention.

`run_bench_kernels` times, per sequence length S and cache budget B (s = 4 sinks, w = 256,
k = B − s − w, Qwen3-4B-like heads: Hq = 32, Hkv = 8, D = 128, batch 1):

  * sparse attention forward, and forward + backward (`kvpop_jax.attention.kvpop_attention`);
  * the transposed future-LSE pass (`targets.future_attention_log_mass`);
  * the running top-k cutoff (`policy.running_topk_cutoff`);

each by every back end its dispatcher has: the XLA reference ("xla", O(S²)), the plain-XLA fast
path ("xla_sparse": gathered key lists for attention, a band for the future LSE), the Pallas
(Triton) kernels ("pallas", and for attention "pallas_compacted"), and for attention the Mosaic
GPU forward ("mosaic_gpu": Hopper, bf16/f16; its backward is the XLA reference's), beside dense
causal `jax.nn.dot_product_attention` (XLA's implementation, and cuDNN's on GPU; forward or
forward + backward to match the row). Kernels run only on GPU; elsewhere their cells read
"n/a (<backend>)"; "—" is a back end the op does not have. The table is printed and
appended, with the command, date, device and versions, to a markdown file.

`python -m eval.bench_kernels --seq_lens 1024,2048 --budgets 512,1024` runs it directly.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import jaxlib

from eval.bench_common import append_benchmarks, check_markdown_out, cli_command, default_command
from eval.bench_decode import parse_lengths
from kvpop_jax.attention import kvpop_attention
from kvpop_jax.policy import ranks_from_priority, running_topk_cutoff, static_priority
from kvpop_jax.targets import future_attention_log_mass
from pallas_kernels.compat import is_hopper_or_later

# The table's back-end columns: every KVPOP_ATTENTION back end (the attention rows); the other ops have
# a subset ("—" in the rest).
COLUMNS = ("xla", "xla_sparse", "pallas", "pallas_compacted", "mosaic_gpu")
GPU_SEQ_LENS = (4096, 16384)
GPU_BUDGETS = (2048, 4096)
# A few minutes on a 2-core CPU (the XLA paths do O(S²) work at S = 16k per head).
CPU_SEQ_LENS = (1024, 2048)
CPU_BUDGETS = (512, 1024)


def _time_call(fn: Callable, args, iters: int, warmup: int) -> float:
    """Median wall time of `fn(*args)` in ms, after `warmup` calls (the first compiles)."""
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _fmt(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _guarded(fn: Callable, args, iters: int, warmup: int):
    """Time `fn`, or return a short error string (one failing cell must not end the run)."""
    try:
        return _time_call(fn, args, iters, warmup)
    except Exception as e:  # noqa: BLE001 — recorded in the table instead
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def _grad_of_sum(attend: Callable) -> Callable:
    """jit(grad of Σ out) w.r.t. q, k, v: forward + backward."""

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _inputs(seed: int, seq: int, batch: int, hq: int, hkv: int, d: int, dtype):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq, hq, d), dtype)
    k = jax.random.normal(keys[1], (batch, seq, hkv, d), dtype)
    v = jax.random.normal(keys[2], (batch, seq, hkv, d), dtype)
    scores = jax.random.normal(keys[3], (batch, hkv, seq), jnp.float32)
    return q, k, v, scores


def run_bench_kernels(
    seq_lens: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
    out_md: str | None = "BENCHMARKS.md",
    *,
    batch: int = 1,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    sinks: int = 4,
    window: int = 256,
    dtype: str | None = None,
    iters: int = 3,
    warmup: int = 1,
    pallas: bool | None = None,
    mosaic: bool | None = None,
    seed: int = 0,
    command: str | None = None,
) -> str:
    """Times the kernels and their references; returns (and appends to `out_md`) the markdown.

    Args:
      seq_lens, budgets: S and B = s + w + k values; None picks (4096, 16384) and
        (2048, 4096) on GPU, (1024, 2048) and (512, 1024) elsewhere. Budgets with
        k = B − s − w < 0 are rejected.
      out_md: markdown file the report is appended to (None: print only).
      batch, num_q_heads, num_kv_heads, head_dim: the attention shape (Qwen3-4B-like).
      sinks, window: s and w.
      dtype: "bfloat16" or "float32"; None: bfloat16 on GPU, float32 elsewhere.
      iters, warmup: timed calls (median reported) and untimed calls before them.
      pallas: time the Pallas kernels; None: only on GPU (they need Triton).
      mosaic: time the Mosaic GPU attention forward; None: only on a Hopper (or later) GPU
        with a bf16/f16 dtype.
      seed: input RNG seed.
      command: the command line to record; default reconstructed from sys.argv.

    Returns:
      The markdown section (header + table).
    """
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    seq_lens = tuple(seq_lens or (GPU_SEQ_LENS if on_gpu else CPU_SEQ_LENS))
    budgets = tuple(budgets or (GPU_BUDGETS if on_gpu else CPU_BUDGETS))
    check_kernel_settings(seq_lens, budgets, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, sinks=sinks, window=window, iters=iters, warmup=warmup)
    if out_md:  # before minutes of timing, not after them
        check_markdown_out(out_md, "--out_md")
    dtype = jnp.dtype(dtype or ("bfloat16" if on_gpu else "float32"))
    run_pallas = on_gpu if pallas is None else pallas
    half = dtype in (jnp.bfloat16, jnp.float16)
    run_mosaic = (is_hopper_or_later(jax.devices()[0]) and half) if mosaic is None else mosaic
    na = f"n/a ({backend.upper()})"
    na_mosaic = na if not on_gpu else "n/a (needs Hopper, bf16)"
    policy = dict(sinks=sinks, window=window)

    rows = []
    for seq in seq_lens:
        q, k, v, scores = _inputs(seed, seq, batch, num_q_heads, num_kv_heads, head_dim, dtype)
        ranks = ranks_from_priority(static_priority(scores, jnp.float32(-1e-3)))
        dense_ms = {}
        for impl in ("xla", "cudnn"):
            if impl == "cudnn" and not on_gpu:
                dense_ms[impl, "fwd"] = dense_ms[impl, "fwd+bwd"] = na
                continue
            dense = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl)
            dense_ms[impl, "fwd"] = _guarded(jax.jit(dense), (q, k, v), iters, warmup)
            dense_ms[impl, "fwd+bwd"] = _guarded(_grad_of_sum(dense), (q, k, v), iters, warmup)
        for budget in budgets:
            topk = budget - sinks - window
            cut = running_topk_cutoff(ranks, topk=topk, implementation="xla", **policy)
            _, lse = kvpop_attention(q, k, v, ranks, cut, implementation="xla", **policy)

            def attend(impl):
                return lambda q, k, v: kvpop_attention(q, k, v, ranks, cut, implementation=impl, topk=topk,
                                                       **policy)[0]

            def lse_fn(impl):
                return jax.jit(lambda q, k, lse: future_attention_log_mass(q, k, lse, window=window,
                                                                           implementation=impl))

            def cutoff_fn(impl):
                return jax.jit(lambda r: running_topk_cutoff(r, topk=topk, implementation=impl, **policy))

            # name, {column: fn or None (not applicable)}, args, dense column
            cases = [
                ("sparse attention fwd", {c: jax.jit(attend(c)) for c in COLUMNS},
                 (q, k, v), "fwd"),
                ("sparse attention fwd+bwd", {c: _grad_of_sum(attend(c)) for c in COLUMNS},
                 (q, k, v), "fwd+bwd"),
                ("future LSE", {c: lse_fn(c) for c in ("xla", "xla_sparse", "pallas")}, (q, k, lse), "fwd"),
                ("top-k cutoff", {"xla": cutoff_fn("xla"), "pallas": cutoff_fn("pallas")}, (ranks,), None),
            ]
            for name, fns, args, dense_key in cases:
                cells = {}
                for column in COLUMNS:
                    if column not in fns:
                        cells[column] = "—"
                    elif column.startswith("pallas") and not run_pallas:
                        cells[column] = na
                    elif column == "mosaic_gpu" and not run_mosaic:
                        cells[column] = na_mosaic
                    else:
                        cells[column] = _guarded(fns[column], args, iters, warmup)
                kernels = [cells[c] for c in ("pallas", "pallas_compacted") if isinstance(cells[c], float)]
                speedup = (f"{cells['xla'] / min(kernels):.1f}x" if kernels and isinstance(cells["xla"], float)
                           else "—")
                dense_cells = [dense_ms[impl, dense_key] if dense_key else "—" for impl in ("xla", "cudnn")]
                rows.append((name, seq, budget, topk, *(cells[c] for c in COLUMNS), *dense_cells, speedup))
                print(f"  {name:26s} S={seq:6d} B={budget:5d}: "
                      + ", ".join(f"{c} {_fmt(cells[c])}" for c in COLUMNS), flush=True)

    device = jax.devices()[0]
    header = [
        f"## Kernel benchmark, {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        "",
        f"- command: `{command or default_command()}`",
        f"- device: {device.device_kind} ({backend}, {jax.device_count()} device(s)); "
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        f"- shape: batch {batch}, Hq {num_q_heads}, Hkv {num_kv_heads}, D {head_dim}, {dtype.name}; "
        f"s = {sinks}, w = {window}, k = B − s − w; median of {iters} calls after {max(warmup, 1)} warm-up",
        "- dense = `jax.nn.dot_product_attention(is_causal=True)` with `implementation=\"xla\"` / "
        "`\"cudnn\"`, forward or forward + backward as the row; Mosaic GPU fwd+bwd = its forward + the "
        "XLA reference's backward; best Pallas vs XLA = the XLA reference's time over the faster Triton kernel's "
        "(Mosaic GPU not counted); times in ms",
        "",
        "| op | S | B | k | XLA reference | XLA sparse | Pallas (Triton) | Pallas compacted | Mosaic GPU | dense XLA "
        "| dense cuDNN | best Pallas vs XLA |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    table = [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | " + " | ".join(_fmt(x) for x in r[4:]) + " |" for r in rows]
    report = "\n".join(header + table) + "\n"
    print(report, flush=True)
    if out_md:
        append_benchmarks(out_md, report)
    return report


def check_kernel_settings(seq_lens: Sequence[int], budgets: Sequence[int], *, batch: int, num_q_heads: int,
                          num_kv_heads: int, head_dim: int, sinks: int, window: int, iters: int, warmup: int) -> None:
    """Refuses by name what used to end in a traceback (S <= 0: an MLIR error), in a table of error cells
    appended to BENCHMARKS.md (--iters 0: every median of nothing) or in rows that time no eviction at
    all (a budget above S keeps every token)."""
    for name, value, low in (("batch", batch, 1), ("num_q_heads", num_q_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                             ("head_dim", head_dim, 1), ("sinks", sinks, 0), ("window", window, 1),
                             ("iters", iters, 1), ("warmup", warmup, 0)):
        if value < low:
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"--num_q_heads {num_q_heads} must be a multiple of --num_kv_heads {num_kv_heads}")
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"--seq_lens must be positive ints, got {list(seq_lens)}")
    for budget in budgets:
        if budget - sinks - window < 0:
            raise ValueError(f"budget {budget} is below s + w = {sinks + window}")
        if budget > min(seq_lens):
            raise ValueError(f"--budgets {budget} exceeds S = {min(seq_lens)}: a budget past the sequence times "
                             f"slots no token fills; want s + w = {sinks + window} <= B <= every S")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.main bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--seq_lens", default="", help="comma-separated S values, e.g. 1k,2048 (k = 1024)")
    parser.add_argument("--budgets", default="", help="comma-separated B values, e.g. 512,1k")
    parser.add_argument("--out_md", default="BENCHMARKS.md", help="markdown file to append to ('' = none)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--num_q_heads", type=int, default=32)
    parser.add_argument("--num_kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    # "1k,2k" as bench decode / train read it (a bare int() parse refused it as "invalid _ints value")
    seq_lens = parse_lengths(args.seq_lens, "seq_lens") if args.seq_lens.strip() else None
    budgets = parse_lengths(args.budgets, "budgets") if args.budgets.strip() else None
    run_bench_kernels(**{**vars(args), "seq_lens": seq_lens, "budgets": budgets, "out_md": args.out_md or None},
                      command=cli_command(parser.prog, argv))


if __name__ == "__main__":
    main()
