"""Training benchmark: a compiled training step per retrofit variant, and each part of a KVpop layer,
as ratios to dense, at sequence lengths S and one budget B.

Two measurements per S (batch `batch`, the random `bench_decode.tiny_config` model by default:
4 layers, 4 heads / 2 KV heads x 64, B = s + w + k = 4 + 128 + 384 = 516):

- **train step**: one jitted optimizer update (AdamW, params and optimizer state donated) of
  a teacher-distillation step as `train/step.py` runs it: the frozen dense teacher's top-K
  logits, the student's forward with query samples, KL(teacher top-K || student) plus the
  retention loss, backward, update. Variants (`VARIANTS`): `dense` (dense distillation: the
  student is the dense model), `streamingllm+` (window B - s, k = 0), `kvpop-mlp`,
  `kvpop-mlstm`; all at the same B (not memory-matched). Ratio = ms / dense step's ms.
- **layer parts** (`PARTS`), each jitted alone on random q/k/v/scores of one layer's shapes:
  dense attention fwd+bwd (the dense model's path; the denominator of every ratio),
  masked attention fwd+bwd as the dispatcher picks it (`auto`) and as the XLA reference
  (`xla`), the future-attention target, ranks (priority + sort), the running cutoff, the
  teacher boundary, and the scorers (MLP, mLSTM) fwd+bwd.

The package direction keeps eval/ from importing train/, so the step is rebuilt here from
the library (no micro-batching, no loss chunking: one micro-batch, whole-sequence logits).
Timings: median of `steps` calls after `warmup` calls (the first compiles). Writes
`bench_train.md`, `.png`, `.json` to `out_dir` and appends the tables with the command to
`benchmarks_md`.

    python -m eval.main bench train --seq_lens 1k,2k,4k,8k --batch 1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import os
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from tqdm.auto import tqdm

from eval.bench_common import append_benchmarks, check_markdown_out, cli_command, default_command, device_description
from eval.bench_decode import parse_lengths, tiny_config
from eval.outputs import holds_out_dir, out_dir_arg, staged_outputs
from eval.plots import markdown_table, plt, save_figure, timestamp, write_text
from kvpop_jax import attention as attn_lib
from kvpop_jax import losses, policy, targets
from kvpop_jax.config import Qwen3Config
from kvpop_jax.kvpop import KVpopHead, sparse_policy
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params, retrofit_params

VARIANTS = ("dense", "streamingllm+", "kvpop-mlp", "kvpop-mlstm")
PARTS = ("dense attention fwd+bwd", "masked attention fwd+bwd (auto)", "masked attention fwd+bwd (xla)",
         "target", "ranks", "cutoff", "boundary", "scorer mlp fwd+bwd", "scorer mlstm fwd+bwd")
DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192)


def median_ms(fn: Callable, args, *, steps: int, warmup: int) -> tuple[float, float]:
    """(median ms of `steps` calls, seconds of the first call = compile + run). `fn` returns
    (new args or None, result): a donating step hands its new state back this way."""
    start = time.perf_counter()
    new, out = fn(*args)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - start
    args = new if new is not None else args
    for _ in range(warmup):
        new, out = fn(*args)
        args = new if new is not None else args
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        new, out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3)
        args = new if new is not None else args
    return statistics.median(times), first_s


def variant_config(config: Qwen3Config, name: str) -> Qwen3Config:
    """The student config of variant `name`, at the budget B of `config.kvpop`."""
    kv = config.kvpop
    if name == "dense":
        return dataclasses.replace(config, kvpop=None)
    if name == "streamingllm+":
        return dataclasses.replace(config, kvpop=dataclasses.replace(kv, scorer="mlp", window=kv.budget - kv.sinks,
                                                                     topk=0))
    if name in ("kvpop-mlp", "kvpop-mlstm"):
        return dataclasses.replace(config, kvpop=dataclasses.replace(kv, scorer=name.removeprefix("kvpop-")))
    raise ValueError(f"unknown variant {name!r}; known: {VARIANTS}")


# ----------------------------------------------------------------------------- train step


def make_train_step(student: Qwen3ForCausalLM, teacher: Qwen3ForCausalLM, tx, *, kl_topk: int,
                    retention_weight: float, num_query_samples: int):
    """step(params, opt_state, teacher_params, ids [B, S], rng) -> ((params, opt_state), loss), jitted
    with params and optimizer state donated."""
    kv = student.config.kvpop

    def loss_fn(params, teacher_params, ids, rng):
        t_logits = teacher.apply({"params": jax.lax.stop_gradient(teacher_params)}, ids).logits
        t_values, t_indices = losses.teacher_topk(jax.lax.stop_gradient(t_logits), kl_topk)
        q_samples = None
        if kv is not None and kv.topk > 0:
            q_samples = losses.sample_query_positions(rng, batch=ids.shape[0], seq_len=ids.shape[1],
                                                      num=num_query_samples, min_q=kv.budget,
                                                      late_bias_fraction=kv.late_bias_fraction)
        out = student.apply({"params": params}, ids, query_samples=q_samples)
        loss = losses.topk_kl_loss(out.logits, t_values, t_indices)
        if q_samples is not None:
            loss = loss + retention_weight * out.aux["retention_loss"]
        return loss

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, teacher_params, ids, rng):
        loss, grads = jax.value_and_grad(loss_fn)(params, teacher_params, ids, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def call(params, opt_state, teacher_params, ids, rng):
        params, opt_state, loss = step(params, opt_state, teacher_params, ids, rng)
        return (params, opt_state, teacher_params, ids, rng), loss

    return call


def time_train_steps(config: Qwen3Config, seq_len: int, batch: int, *, variants: Sequence[str], steps: int,
                     warmup: int, kl_topk: int, num_query_samples: int, seed: int) -> dict[str, tuple[float, float]]:
    """{variant: (median ms, first-call s)} of one training step at `seq_len`."""
    dense_config = variant_config(config, "dense")
    teacher_params = init_params(dense_config, jax.random.key(seed))
    teacher = Qwen3ForCausalLM(dense_config)
    ids = jax.random.randint(jax.random.key(seed + 1), (batch, seq_len), 0, config.vocab_size, jnp.int32)
    tx = optax.adamw(1e-4)
    out = {}
    for name in variants:
        cfg = variant_config(config, name)
        params = teacher_params if cfg.kvpop is None else retrofit_params(cfg, teacher_params, jax.random.key(seed))
        params = jax.tree.map(jnp.copy, params)  # donated: never the teacher's buffers
        step = make_train_step(Qwen3ForCausalLM(cfg), teacher, tx, kl_topk=min(kl_topk, config.vocab_size),
                               retention_weight=1.0 if cfg.kvpop is None else cfg.kvpop.retention_loss_weight,
                               num_query_samples=num_query_samples)
        out[name] = median_ms(step, (params, tx.init(params), teacher_params, ids, jax.random.key(seed + 2)),
                              steps=steps, warmup=warmup)
    return out


# ----------------------------------------------------------------------------- layer parts


def _fwd_bwd(fn: Callable, argnums) -> Callable:
    """jit(grad of <fn(*args), cotangent>) w.r.t. argnums; the cotangent is the last argument."""
    def loss(*args):
        *xs, cot = args
        return jnp.vdot(fn(*xs).astype(jnp.float32), cot)

    return jax.jit(jax.grad(loss, argnums=argnums))


def part_functions(config: Qwen3Config, seq_len: int, batch: int, seed: int) -> dict[str, tuple[Callable, tuple]]:
    """{part: (jitted fn, args)} on random inputs of one layer's shapes at `seq_len`."""
    kv = config.kvpop
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (batch, seq_len, hq, d))
    k = jax.random.normal(keys[1], (batch, seq_len, hkv, d))
    v = jax.random.normal(keys[2], (batch, seq_len, hkv, d))
    cot = jax.random.normal(keys[3], q.shape)
    scores = jax.random.normal(keys[4], (batch, hkv, seq_len))
    log_gamma = jnp.full((hkv,), -1e-3, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    ranks, cutoffs = jax.jit(functools.partial(sparse_policy, config=kv))(scores, log_gamma)
    masked = functools.partial(attn_lib.kvpop_attention, sinks=kv.sinks, window=kv.window, topk=kv.topk)
    _, lse = jax.jit(masked)(q, k, v, ranks, cutoffs)
    sizes = dict(sinks=kv.sinks, window=kv.window, topk=kv.topk)

    parts = {
        "dense attention fwd+bwd": (
            _fwd_bwd(lambda q, k, v: attn_lib.dense_attention(q, k, v, q_positions=pos, kv_positions=pos)[0],
                     (0, 1, 2)), (q, k, v, cot)),
        "masked attention fwd+bwd (auto)": (
            _fwd_bwd(lambda q, k, v: masked(q, k, v, ranks, cutoffs)[0], (0, 1, 2)), (q, k, v, cot)),
        "masked attention fwd+bwd (xla)": (
            _fwd_bwd(lambda q, k, v: masked(q, k, v, ranks, cutoffs, implementation="xla")[0], (0, 1, 2)),
            (q, k, v, cot)),
        "target": (jax.jit(lambda q, k, lse: targets.future_attention_target(
            q, k, lse, window=kv.window, eps=kv.eps, aggregate=kv.aggregate, normalize=kv.count_normalize,
            reduce=kv.target_reduce, lookahead=kv.target_lookahead)), (q, k, lse)),
        "ranks": (jax.jit(lambda s, g: policy.ranks_from_priority(policy.static_priority(s, g))),
                  (scores, log_gamma)),
        "cutoff": (jax.jit(lambda r: policy.running_topk_cutoff(r, **sizes)), (ranks,)),
        "boundary": (jax.jit(lambda r, c: policy.teacher_boundary(r, cutoffs=c, **sizes)), (ranks, cutoffs)),
    }
    for scorer in ("mlp", "mlstm"):
        head = KVpopHead(dataclasses.replace(kv, scorer=scorer), hkv, d, rope_theta=config.rope_theta)
        params = head.init(jax.random.key(seed), k[:, :8], v[:, :8])
        parts[f"scorer {scorer} fwd+bwd"] = (
            _fwd_bwd(lambda p, k, v, head=head: head.apply(p, k, v)[0], 0), (params, k, v, scores))
    return parts


def time_parts(config: Qwen3Config, seq_len: int, batch: int, *, parts: Sequence[str], steps: int, warmup: int,
               seed: int) -> dict[str, tuple[float, float]]:
    """{part: (median ms, first-call s)} at `seq_len`, for `parts` (dense attention always: the denominator)."""
    out = {}
    for name, (fn, args) in part_functions(config, seq_len, batch, seed).items():
        if name != PARTS[0] and name not in parts:
            continue
        out[name] = median_ms(lambda *a, fn=fn: (None, fn(*a)), args, steps=steps, warmup=warmup)
    return out


# ------------------------------------------------------------------------------ benchmark


@dataclasses.dataclass
class Row:
    kind: str  # "train" or "part"
    name: str
    seq_len: int
    ms: float
    ratio: float  # ms / the dense row's ms at the same seq_len (dense step, or dense attention fwd+bwd)
    first_s: float


@holds_out_dir("bench_train.png", "bench_train.json", "bench_train.md")
def run_bench_train(
    *,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    batch: int = 1,
    model_config: Qwen3Config | None = None,
    variants: Sequence[str] = VARIANTS,
    parts: Sequence[str] = PARTS,
    steps: int = 3,
    warmup: int = 1,
    kl_topk: int = 256,
    num_query_samples: int = 256,
    seed: int = 0,
    out_dir: str | os.PathLike,
    benchmarks_md: str | os.PathLike | None = "BENCHMARKS.md",
    command: str | None = None,
    progress: bool = True,
) -> list[Row]:
    """Times the train steps of `variants` and the KVpop layer `parts` (none: `()`) at every S in
    `seq_lens`; dense (step, attention) always runs: it is the ratios' denominator. Returns the
    rows in run order."""
    config = model_config or tiny_config()
    if config.kvpop is None:
        raise ValueError("model_config needs kvpop set (the budget B of the KVpop variants)")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be a subset of {VARIANTS}, got {list(variants)}")
    if any(p not in PARTS for p in parts):
        raise ValueError(f"parts must be a subset of {PARTS}, got {list(parts)}")
    variants = ("dense",) + tuple(v for v in variants if v != "dense")
    seq_lens = sorted({int(s) for s in seq_lens})
    if not seq_lens or seq_lens[0] <= config.kvpop.budget:
        raise ValueError(f"every S must exceed the budget s + w + k = {config.kvpop.budget} (the retention loss "
                         f"samples saturated queries), got {seq_lens}")
    if steps < 1 or warmup < 0 or batch < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, batch >= 1; got {steps}, {warmup}, {batch}")
    if not 1 <= kl_topk <= config.vocab_size or num_query_samples < 1:  # named here, not as the library's k / num
        raise ValueError(f"need 1 <= --kl_topk <= vocab {config.vocab_size} and --num_query_samples >= 1; got "
                         f"{kl_topk}, {num_query_samples}")
    if benchmarks_md is not None:  # before minutes of timing, not after them
        check_markdown_out(benchmarks_md, "--benchmarks_md")
    command = command or default_command()
    rows: list[Row] = []
    bar = tqdm(total=len(seq_lens) * (1 + bool(parts)), desc="bench train", unit="point", disable=not progress)
    for s in seq_lens:
        groups = [("train", time_train_steps(config, s, batch, variants=variants, steps=steps, warmup=warmup,
                                             kl_topk=kl_topk, num_query_samples=num_query_samples, seed=seed),
                   "dense")]
        bar.update()
        if parts:
            timed = time_parts(config, s, batch, parts=parts, steps=steps, warmup=warmup, seed=seed)
            groups.append(("part", timed, PARTS[0]))
            bar.update()
        for kind, timed, base in groups:
            for name, (ms, first_s) in timed.items():
                rows.append(Row(kind, name, s, ms, ms / timed[base][0], first_s))
    bar.close()

    kv = config.kvpop
    info = dict(command=command, date=timestamp(), device=device_description(), batch=batch, steps=steps,
                warmup=warmup, budget=dict(sinks=kv.sinks, window=kv.window, topk=kv.topk, budget=kv.budget),
                model=(f"random: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                       f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads x "
                       f"{config.head_dim}, vocab {config.vocab_size}"),
                attention_impl=os.environ.get("KVPOP_ATTENTION_IMPL", "auto"))
    out_dir = os.fspath(out_dir)
    with staged_outputs(out_dir) as out:  # the three files are replaced together or not at all
        plot_bench(rows, out.path("bench_train.png"))
        png = out.final("bench_train.png")
        write_text(out.path("bench_train.json"),
                   json.dumps(dict(info=info, rows=[dataclasses.asdict(r) for r in rows]), indent=1))
        write_text(out.path("bench_train.md"), bench_markdown(rows, info, png, out_dir))
    if benchmarks_md is not None:
        append_benchmarks(benchmarks_md, bench_markdown(
            rows, info, png, os.path.dirname(os.path.abspath(os.fspath(benchmarks_md))), heading="##"))
    return rows


# -------------------------------------------------------------------------------- reports


def plot_bench(rows: Sequence[Row], path: str) -> str:
    """Ratio to dense vs S: train steps (left), layer parts (right, log scale)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), constrained_layout=True)
    for ax, kind, title in zip(axes, ("train", "part"), ("Training step / dense step",
                                                          "KVpop layer part / dense attention fwd+bwd")):
        for name in dict.fromkeys(r.name for r in rows if r.kind == kind):
            rs = [r for r in rows if r.kind == kind and r.name == name]
            ax.plot([r.seq_len for r in rs], [r.ratio for r in rs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        if kind == "part":
            ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("ratio to dense (same S, one run)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_lines():  # --no_parts leaves the right panel empty: no legend (matplotlib warned)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="gray")
    return save_figure(fig, path)


def bench_markdown(rows: Sequence[Row], info: dict, png: str, relative_to: str, heading: str = "#") -> str:
    dev = info["device"]
    on_cpu = dev["platform"] == "cpu"
    seq_lens = sorted({r.seq_len for r in rows})
    b = info["budget"]
    where = f"{dev['platform']} ({dev['device_kind']}" + (f", {dev['cpu_count']} cores)" if on_cpu else ")")

    def table(kind: str) -> str:
        by = {(r.name, r.seq_len): r for r in rows if r.kind == kind}
        names = list(dict.fromkeys(r.name for r in rows if r.kind == kind))
        body = [[n] + [f"{by[n, s].ms:.1f} ({by[n, s].ratio:.2f}x)" if (n, s) in by else "" for s in seq_lens]
                for n in names]
        return markdown_table(["ms (ratio to dense)"] + [f"S = {s}" for s in seq_lens], body)

    lines = [
        f"{heading} Training step and KVpop layer parts vs dense ({info['date']})\n",
        f"- Command: `{info['command']}`",
        f"- Device: {where}; jax {dev['jax']}, jaxlib {dev['jaxlib']}, Python {dev['python']}",
        f"- Model: {info['model']}; float32, batch {info['batch']}; budget s={b['sinks']}, w={b['window']}, "
        f"k={b['topk']}: {b['budget']} slots for every KVpop variant; "
        f"`KVPOP_ATTENTION_IMPL` = {info['attention_impl']}",
        f"- Method: median of {info['steps']} calls after compile + {info['warmup']} warmup; ratios are within "
        "this run. Train step: teacher top-K + student forward/backward + AdamW (eval/bench_train.py).",
        "",
        "Training step (ratio to dense distillation):\n",
        table("train"),
    ]
    if any(r.kind == "part" for r in rows):
        lines += ["", "KVpop layer parts, one layer (ratio to dense attention fwd+bwd):\n", table("part")]
    lines += ["", f"![training step and layer parts]({os.path.relpath(png, relative_to)})\n"]
    return "\n".join(lines)


def benchmarks_target(flag: str | None, dry: bool) -> str | None:
    """The file the tables are appended to: --benchmarks_md ('' = none), else BENCHMARKS.md, but
    none for a --dry run (toy sizes: its numbers belong in no record)."""
    if flag is not None:
        return flag or None
    return None if dry else "BENCHMARKS.md"


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m eval.bench_train [flags]` (also `python -m eval.main bench train`)."""
    d = dict(inspect.signature(tiny_config).parameters)
    ap = argparse.ArgumentParser(prog="python -m eval.main bench train", description=__doc__.splitlines()[0])
    ap.add_argument("--seq_lens", default="1k,2k,4k,8k")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    ap.add_argument("--no_parts", action="store_true", help="train steps only")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--kl_topk", type=int, default=256)
    ap.add_argument("--num_query_samples", type=int, default=256)
    ap.add_argument("--out_dir", default="outputs/bench_train", type=out_dir_arg)
    ap.add_argument("--benchmarks_md", default=None,
                    help="where the tables are appended (default BENCHMARKS.md; with --dry, nowhere); '' to skip")
    ap.add_argument("--dry", action="store_true",
                    help="a smoke run of the plumbing (about a minute on 2 cores, nearly all compiles): a 1-layer "
                         "toy model, S = 64,128, one step (overrides the sizes); its numbers measure nothing, so "
                         "it appends to no BENCHMARKS.md unless --benchmarks_md names one")
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "sinks", "window", "topk"):
        ap.add_argument(f"--{name}", type=int, default=d[name].default, help="random model size / budget")
    args = ap.parse_args(argv)
    sizes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "sinks",
                                           "window", "topk")}
    seq_lens, steps, warmup, kl_topk, samples = (parse_lengths(args.seq_lens, "seq_lens"), args.steps, args.warmup,
                                                 args.kl_topk, args.num_query_samples)
    if args.dry:
        sizes = dict(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, sinks=2, window=8, topk=8)
        seq_lens, steps, warmup, kl_topk, samples = (64, 128), 1, 0, 8, 8
    rows = run_bench_train(
        seq_lens=seq_lens, batch=args.batch, model_config=tiny_config(**sizes),
        variants=tuple(v for v in args.variants.split(",") if v), parts=() if args.no_parts else PARTS, steps=steps,
        warmup=warmup, kl_topk=kl_topk, num_query_samples=samples, out_dir=args.out_dir,
        benchmarks_md=benchmarks_target(args.benchmarks_md, args.dry),
        # The flags this function was given, not the host process's argv (pytest's, when called in-process).
        command=cli_command(ap.prog, argv),
    )
    for r in rows:
        print(f"{r.kind:>5} {r.name:>34} S={r.seq_len:>6} {r.ms:10.2f} ms  {r.ratio:6.2f}x dense")


if __name__ == "__main__":
    main()


__all__ = ["PARTS", "VARIANTS", "Row", "bench_markdown", "run_bench_train", "variant_config"]
