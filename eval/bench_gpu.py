"""`python -m eval.main bench gpu`: what a GPU node should measure first, in one run (~10 min on one H200).

Stages, in order (`--stages` picks some), each a markdown table; together they are appended
to BENCHMARKS.md as one section:

  kernel_tests  pytest tests/test_kernel_*.py + tests/test_gpu_readiness.py with
                KVPOP_KERNEL_TESTS=native: the kernel tests run compiled on the GPU, not interpreted
  dry_run       `python -m train.main --flagfile=configs/qwen3_8b_cr88.flags --dry_run --scan_layers`: per-device
                memory (scanned: one compiled layer; unscanned, 8B had not compiled in 205 s on an H200)
  train         `python -m train.throughput`: a few steps of a random 4-layer model of Qwen3-8B's width with
                the cr88 recipe's settings (S 16384, B 2276, mLSTM, bf16, remat): tokens/s and MFU; then one
                more step profiled (`--profile_dir`): device time per XLA op (eval/profile_ops.py)
  train_scan    the same with --scan_layers (is the scanned step as fast? the recipes leave it off until known)
  kernels       `bench kernels` (eval/bench_kernels.py): every kernel vs its XLA reference vs dense
                attention (XLA and cuDNN), forward and forward + backward, S = 4k / 16k, B = 2048 / 4096
  decode        `bench decode` (eval/bench_decode.py) to 131k tokens, dense vs KVpop vs DMS (the pool at the
                KVpop memory), 8 layers of Qwen3-8B's shape at the cr88 budget (GPU_DECODE_MODEL)

The first four run in subprocesses (eval never imports train), the last two in this process,
after them: JAX keeps the device memory it has used, and the subprocesses need the GPUs' memory.
For the same reason `eval.main` turns JAX's preallocation off for this command
(`XLA_PYTHON_CLIENT_PREALLOCATE=false`, `PARENT_ENV`).

On CPU (or with `--dry`) every stage runs on tiny shapes in seconds (the path the test suite
checks); the tables then say so. A failing stage is recorded and the next one runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from eval.bench_common import append_benchmarks, check_markdown_out, cli_command, default_command, device_description
from eval.bench_decode import bench_markdown, run_bench_decode, tiny_config
from eval.bench_kernels import run_bench_kernels
from eval.outputs import holds_out_dir, out_dir_arg
from kvpop_jax.fileio import atomic_write_bytes
from kvpop_jax.runtime import backend_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("kernel_tests", "dry_run", "train", "train_scan", "kernels", "decode")
# Set before JAX starts in the process that runs this command (eval.main does).
PARENT_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
RECIPE = "configs/qwen3_8b_cr88.flags"
DECODE_LENGTHS = (1024, 4096, 16384, 32768, 65536, 131072)
# The decode stage's model on a GPU: 8 layers of Qwen3-8B's shape (Hq 32, Hkv 8, D 128, MLP 12288),
# a 32k vocabulary, the cr88 recipe's budget and scorer (B = 4 + 256 + 2016). About 1.8B parameters
# (3.6 GB in bf16), so that a step reads enough memory for the cache's growth to show: the first
# H200 run (BENCHMARKS.md, 2026-12-04) used the CPU benchmark's 256-wide model, and every method
# sat at the ~0.7 ms a step costs in launches whatever the length.
GPU_DECODE_MODEL = dict(layers=8, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=32768,
                        window=256, topk=2016, scorer="mlstm")
# The dry path's model and recipe overrides: two tiny layers (so that --scan_layers scans), float32, no remat
# (compiles in seconds).
DRY_ARCH = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
DRY_RECIPE = ("--seq_len=128", "--window=16", "--topk=16", "--global_batch=1", "--micro_batch=1", "--loss_chunk=0",
              "--num_query_samples=8", "--kl_topk=8", "--remat=none", "--compute_dtype=float32",
              "--teacher_dtype=float32", "--scorer=mlp")


@dataclasses.dataclass
class Stage:
    name: str
    status: str  # "ok", "failed", "skipped"
    seconds: float
    summary: str  # one line
    markdown: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    dry: bool
    out_dir: str
    report_dir: str  # where the markdown goes (image links are relative to it)
    timeout_s: int  # per subprocess


def _run(cmd: Sequence[str], plan: Plan, log: str, **env) -> subprocess.CompletedProcess:
    """Runs `cmd` in its own process group, its output saved to out_dir/LOG.log. Past the plan's
    limit the whole group is killed (pytest-xdist workers too, which hold GPU memory) and the
    output so far is returned with return code -9 and a line saying so. An interrupt of this
    process (Ctrl-C, SIGTERM from `timeout`) kills the group too before it propagates."""
    environ = dict(os.environ, PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=os.path.join(plan.out_dir, "jax_cache"),
                   PYTHONUNBUFFERED="1", **env)  # unbuffered: a killed child's output so far is kept
    proc = subprocess.Popen(list(cmd), cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)

    def kill_group():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    try:
        out, err = proc.communicate(timeout=plan.timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group()
        out, err = proc.communicate()
        err += f"\nbench gpu: killed after the {plan.timeout_s} s limit (--timeout_s)\n"
        code = -9
    except BaseException:
        kill_group()
        raise
    with open(os.path.join(plan.out_dir, f"{log}.log"), "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n--- stderr ---\n{err}")
    return subprocess.CompletedProcess(list(cmd), code, out, err)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _code(text: str) -> str:
    return f"```\n{text.strip()}\n```"


def stage_kernel_tests(plan: Plan) -> Stage:
    """The kernel and readiness tests, compiled on the GPU (dry: one quick CPU test, to check the plumbing)."""
    tests = sorted(glob.glob(os.path.join(REPO, "tests", "test_kernel_*.py")))
    if not tests:
        return Stage("kernel_tests", "skipped", 0.0, f"no tests/ next to {REPO} (not a source checkout)")
    if plan.dry:
        args, env = ["-q", os.path.join(REPO, "tests", "test_kernel_topk_cutoff.py"), "-k", "rejects"], {}
    else:
        args = tests + [os.path.join(REPO, "tests", "test_gpu_readiness.py")]
        env = dict(KVPOP_KERNEL_TESTS="native")  # tests/conftest.py then leaves JAX_PLATFORMS alone
        workers = _test_workers()
        if workers > 1:  # Triton and ptxas compiles are host work: spread them over the cores
            args = ["-n", str(workers), *args]
        args = ["-v", *args]  # each outcome in kernel_tests.log as it comes, for a run cut off by --timeout_s
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--tb=short", *args]
    proc = _run(cmd, plan, "kernel_tests", **env)
    counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|xfailed|deselected).*?)(?: =+)?$",
                        proc.stdout, re.M)
    summary = counts[-1] if counts else f"pytest exited with {proc.returncode}"
    if "killed after the" in proc.stderr:
        summary = f"killed after {plan.timeout_s} s (--timeout_s); " + (counts[-1] if counts else "no summary")
    failures = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    if not failures:  # a run killed before its summary: the -v progress lines name them
        failures = [f"{kind} {test}" for kind, test in re.findall(r"\] (FAILED|ERROR) (\S+)", proc.stdout)]
    rel = " ".join(os.path.relpath(a, REPO) if os.path.isabs(a) else a for a in args)
    env_text = " ".join(f"{k}={v}" for k, v in env.items())
    md = "\n".join([f"`{env_text} python -m pytest {rel}`".replace("` ", "`"), "", f"Result: **{summary}**"]
                   + ([f"- {f}" for f in failures[:40]] or []))
    status = "ok" if proc.returncode == 0 else "failed"
    if proc.returncode not in (0, 1):  # collection or usage error: show the tail
        md += "\n\n" + _code(_tail(proc.stdout + proc.stderr))
    return Stage("kernel_tests", status, 0.0, summary, md)


def _test_workers() -> int:
    """pytest-xdist workers for the native kernel tests: one per 2 host cores, at most 8 (they share
    the GPU; each JAX process takes memory as it goes, PARENT_ENV); 1 without pytest-xdist."""
    if importlib.util.find_spec("xdist") is None:
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def stage_kernels(plan: Plan) -> Stage:
    if plan.dry:
        md = run_bench_kernels(seq_lens=(128,), budgets=(64,), out_md=None, num_q_heads=4, num_kv_heads=2,
                               head_dim=32, window=16, iters=1, warmup=1, command="bench gpu --dry (kernels)")
    else:
        md = run_bench_kernels(seq_lens=(4096, 16384), budgets=(2048, 4096), out_md=None, iters=3, warmup=1,
                               command="bench gpu (kernels)")
    body = md.split("\n", 1)[1]  # drop its own heading: the section has one
    rows = [ln for ln in body.splitlines() if ln.startswith("| ")][1:]
    errors = sum("error" in row for row in rows)
    return Stage("kernels", "ok" if not errors else "failed", 0.0, f"{len(rows)} rows, {errors} with errors", body)


def stage_decode(plan: Plan) -> Stage:
    if plan.dry:
        config = tiny_config(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, window=8, topk=16)
        kw = dict(lengths=(64,), model_config=config, steps=1, warmup=0)
    else:
        kw = dict(lengths=DECODE_LENGTHS, model_config=tiny_config(**GPU_DECODE_MODEL), steps=8, warmup=2,
                  dtype=jnp.bfloat16)
    rows = run_bench_decode(methods=("dense", "kvpop", "dms"), out_dir=os.path.join(plan.out_dir, "decode"),
                            benchmarks_md=None, progress=False, command="bench gpu (decode)", **kw)
    info = json.load(open(os.path.join(plan.out_dir, "decode", "bench_decode.json")))["info"]
    md = bench_markdown(rows, info, os.path.join(plan.out_dir, "decode", "bench_decode.png"), plan.report_dir,
                        heading="####")
    longest = max(r.length for r in rows)
    at = {r.method: r for r in rows if r.length == longest}
    summary = ", ".join(f"{m} {r.ms_median:.2f} ms/token" for m, r in at.items()) + f" at {longest} tokens"
    return Stage("decode", "ok", 0.0, summary, md.split("\n", 1)[1])


def _dry_arch(plan: Plan) -> str:
    path = os.path.join(plan.out_dir, "dry_arch.json")
    with open(path, "w") as f:
        json.dump(DRY_ARCH, f)
    return path


def _recipe_argv(plan: Plan, run_name: str) -> list[str]:
    """The recipe's flags (a tiny 1-layer model and shapes in a dry run)."""
    argv = [f"--flagfile={RECIPE}", f"--run_dir={os.path.join(plan.out_dir, run_name)}"]
    if plan.dry:
        argv += [f"--model_config={_dry_arch(plan)}", *DRY_RECIPE]
    return argv


def stage_dry_run(plan: Plan) -> Stage:
    # --scan_layers: unscanned, Qwen3-8B's 36 layers had not compiled after 205 s on an H200 (2026-12-04)
    cmd = [sys.executable, "-m", "train.main", *_recipe_argv(plan, "dry_run"), "--dry_run", "--scan_layers"]
    proc = _run(cmd, plan, "dry_run")
    lines = proc.stdout.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("dry run:")), None)
    shown = " ".join(a for a in cmd[1:] if not a.startswith("--run_dir"))
    if proc.returncode or start is None:
        return Stage("dry_run", "failed", 0.0, f"exit {proc.returncode}",
                     f"`python {shown}`\n\n" + _code(_tail(proc.stdout + proc.stderr)))
    peak = next((ln.split()[1:3] for ln in lines[start:] if ln.strip().startswith("peak_estimate")), ["?", ""])
    return Stage("dry_run", "ok", 0.0, f"peak estimate {' '.join(peak)} per device (scanned layers)",
                 f"`python {shown}`\n\n" + _code("\n".join(lines[start:]))
                 + "\n\nWith `--scan_layers`, which the recipes leave off: the step holds one more copy of both "
                   "models' layer weights than the looped step the recipes run (see the README).")


def stage_train(plan: Plan, scan: bool = False) -> Stage:
    name = "train_scan" if scan else "train"
    out = os.path.join(plan.out_dir, f"{name}.json")
    argv = _recipe_argv(plan, name) + (["--scan_layers"] if scan else [f"--profile_dir={_profile_dir(plan)}"])
    if plan.dry:
        argv += [f"--init_checkpoint=random:{_dry_arch(plan)}", "--timed_steps=1"]
    else:
        devices = jax.device_count()
        argv += ["--init_checkpoint=random:qwen3_8b", "--num_layers=4", f"--micro_batch={devices}",
                 f"--global_batch={2 * devices}", "--timed_steps=3"]
    cmd = [sys.executable, "-m", "train.throughput", *argv, "--data=demo:1", f"--json_out={out}"]
    proc = _run(cmd, plan, name)
    shown = " ".join(a for a in cmd[1:] if not a.startswith(("--run_dir", "--json_out")))
    if proc.returncode or not os.path.isfile(out):
        return Stage(name, "failed", 0.0, f"exit {proc.returncode}",
                     f"`python {shown}`\n\n" + _code(_tail(proc.stdout + proc.stderr)))
    r = json.load(open(out))
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    table = "\n".join([
        "| model | S | global batch | devices | step s | tokens/s | tokens/s/device | MFU | first step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['layers']} layers, hidden {r['hidden']}, heads {r['heads']}, vocab {r['vocab']} "
        f"({r['params_matmul'] / 1e9:.2f}B matmul params); {r['budget']}, {r['scorer']}, {r['compute_dtype']}, "
        f"remat {r['remat']} | {r['seq_len']} | {r['global_batch']} | {r['devices']} | {r['step_s']:.3f} | "
        f"{r['tokens_per_s']:.0f} | {r['tokens_per_s_per_device']:.0f} | {mfu} | "
        f"{r['compile_and_first_step_s']:.1f} |",
    ])
    md = (f"`python {shown}`\n\n{table}\n\nMFU counts model FLOPs (student fwd+bwd, teacher fwd, causal attention; "
          "see train/throughput.py) against the device's dense bf16 peak.")
    summary = f"{r['tokens_per_s']:.0f} tokens/s, MFU {mfu}"
    prof = r.get("profile")
    if prof and "error" in prof:
        md += f"\n\nProfiling one more step failed: {prof['error']}"
    elif prof:
        md += (f"\n\n**Where one more step's time goes** (profiled after the timing, {prof['step_s']:.3f} s under the "
               f"profiler; `python -m eval.profile_ops {os.path.basename(_profile_dir(plan))}`):\n\n{prof['markdown']}")
        summary += f"; device busy {100 * prof['busy_s'] / max(prof['span_s'], 1e-9):.0f}% of the profiled step"
    return Stage(name, "ok", 0.0, summary, md)


def _profile_dir(plan: Plan) -> str:
    return os.path.join(plan.out_dir, "train_profile")


STAGE_FNS: dict[str, Callable[[Plan], Stage]] = {
    "kernel_tests": stage_kernel_tests, "kernels": stage_kernels, "decode": stage_decode,
    "dry_run": stage_dry_run, "train": stage_train, "train_scan": functools.partial(stage_train, scan=True),
}


@holds_out_dir("bench_gpu.md")
def run_bench_gpu(*, stages: Sequence[str] = STAGES, dry: bool | None = None, out_dir: str = "outputs/bench_gpu",
                  benchmarks_md: str | None = "BENCHMARKS.md", timeout_s: int = 600,
                  command: str | None = None) -> list[Stage]:
    """Runs the stages; writes out_dir/bench_gpu.md and appends it to `benchmarks_md` (None: don't).

    dry: tiny shapes everywhere; None = on a CPU-only machine.
    """
    unknown = [s for s in stages if s not in STAGE_FNS]
    if unknown or not stages:
        raise ValueError(f"stages must be a non-empty subset of {STAGES}, got {list(stages)}")
    if benchmarks_md:  # before the stages' minutes, not after them
        check_markdown_out(benchmarks_md, "--benchmarks_md")
    dry = jax.default_backend() == "cpu" if dry is None else dry
    os.makedirs(out_dir, exist_ok=True)
    report_dir = os.path.dirname(os.path.abspath(benchmarks_md)) if benchmarks_md else os.path.abspath(out_dir)
    plan = Plan(dry=dry, out_dir=os.path.abspath(out_dir), report_dir=report_dir, timeout_s=timeout_s)
    start = time.perf_counter()
    done: list[Stage] = []
    command = command or default_command()
    for name in stages:
        print(f"bench gpu: {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            stage = STAGE_FNS[name](plan)
        except Exception as e:  # noqa: BLE001 — one failing stage must not end the run
            stage = Stage(name, "failed", 0.0, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        stage.seconds = time.perf_counter() - t0
        print(f"bench gpu: {name} {stage.status} in {stage.seconds:.0f} s: {stage.summary}", flush=True)
        done.append(stage)
        # after every stage, so that a run stopped by a time limit keeps what it measured
        pending = [s for s in stages if s not in {d.name for d in done}]
        md = report_markdown(done, time.perf_counter() - start, dry=dry, command=command, pending=pending)
        atomic_write_bytes(os.path.join(out_dir, "bench_gpu.md"), md.encode())
    if benchmarks_md:
        append_benchmarks(benchmarks_md, md)
    print(md, flush=True)
    return done


def report_markdown(stages: Sequence[Stage], total_s: float, *, dry: bool, command: str,
                    pending: Sequence[str] = ()) -> str:
    dev = device_description()
    title = "GPU bench" + (" (dry run: tiny shapes on CPU, plumbing only)" if dry else "")
    lines = [
        f"## {title}, {time.strftime('%Y-%m-%d %H:%M %Z')}", "",
        f"- command: `{command}`",
        f"- {backend_line()}; Python {dev['python']}",
        f"- total {total_s:.0f} s", "",
        "| stage | status | seconds | summary |", "|---|---|---:|---|",
    ]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.summary} |" for s in stages]
    lines += [f"| {name} | not run yet | — | — |" for name in pending]
    for s in stages:
        if s.markdown:
            lines += ["", f"### {s.name}", "", s.markdown.strip()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m eval.main bench gpu [--dry] [--stages a,b]`."""
    ap = argparse.ArgumentParser(prog="python -m eval.main bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", default=None,
                    help="tiny shapes (default on a CPU-only machine): checks the plumbing in about a minute")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    ap.add_argument("--out_dir", default="outputs/bench_gpu", type=out_dir_arg)
    ap.add_argument("--benchmarks_md", default=None,
                    help="markdown file to append the report to (default BENCHMARKS.md, none in a dry run; '' = none)")
    ap.add_argument("--timeout_s", type=int, default=600, help="limit per subprocess (tests, dry run, training)")
    args = ap.parse_args(argv)
    dry = jax.default_backend() == "cpu" if args.dry is None else args.dry
    benchmarks_md = args.benchmarks_md if args.benchmarks_md is not None else (None if dry else "BENCHMARKS.md")
    stages = run_bench_gpu(stages=[s for s in args.stages.split(",") if s], dry=dry, out_dir=args.out_dir,
                           benchmarks_md=benchmarks_md or None, timeout_s=args.timeout_s,
                           command=cli_command(ap.prog, argv))
    if any(s.status == "failed" for s in stages):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
