"""Compile every kernel for an H100 on a CPU-only machine and report its shared memory and registers.

    pip install "jax-cuda12-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')" \\
        "jax-cuda12-pjrt==$(python -c 'import jaxlib; print(jaxlib.__version__)')"
    JAX_PLATFORMS=cpu python benchmarks/h100_compile_report.py [--recipe qwen3_8b_cr88]

XLA's GPU compiler (the jax-cuda12-plugin) compiles each kernel at the recipe's shapes for the
H100 of `tests/data/h100_target_config.txtpb` (`pallas_kernels.compat.compile_for_gpu`): Pallas'
Triton IR -> PTX (sm_90a) with XLA's pinned Triton, Mosaic GPU's own pipeline for its kernel.
With `--xla_dump_to` XLA writes the PTX and the launch table (grid, threads, shared memory per
kernel); `ptxas -v` on that PTX reports registers and spills. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="qwen3_8b_cr88")
    ap.add_argument("--kernels", default=None, help="comma-separated subset")
    args = ap.parse_args()
    dump = tempfile.mkdtemp(prefix="h100_compile_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax  # noqa: E402  (after XLA_FLAGS)

    from pallas_kernels.compat import compile_for_gpu
    from helpers import H100_TARGET_CONFIG, KERNELS, kernel_case, recipe_shapes

    target = open(H100_TARGET_CONFIG).read()
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    shapes = recipe_shapes(args.recipe)
    print(f"jax {jax.__version__}; recipe {args.recipe}: {shapes}; ptxas {ptxas}", file=sys.stderr)
    rows = []
    for kernel in (args.kernels.split(",") if args.kernels else KERNELS):
        before = set(glob.glob(os.path.join(dump, "*")))
        fn, avals, _ = kernel_case(kernel, args.recipe)
        t0 = time.perf_counter()
        try:
            compile_for_gpu(fn, *avals, target_config=target, fail_on_register_spill=True)
            status = "ok"
        except Exception as e:  # noqa: BLE001 — reported in the table
            status = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        seconds = time.perf_counter() - t0
        new = sorted(set(glob.glob(os.path.join(dump, "*"))) - before)
        launches = {}
        for path in (p for p in new if p.endswith("thunk_sequence.txt")):
            for m in re.finditer(r"kCustomKernel.*?(\w*kvpop_\w+).*?grid: \[([^\]]*)\] threads: \[([^\]]*)\]"
                                 r" shared_memory: (\d+) bytes", open(path).read()):
                launches[m.group(1)] = (m.group(2), m.group(3), int(m.group(4)))
        registers = {}
        for path in (p for p in new if p.endswith(".ptx")):
            out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                                 capture_output=True, text=True).stderr
            for m in re.finditer(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", out, re.S):
                spills = re.search(r"Function properties for " + m.group(1) + r"\s+(\d+) bytes stack frame, "
                                   r"(\d+) bytes spill stores", out)
                registers[m.group(1)] = (int(m.group(2)), spills.group(2) if spills else "?")
        names = sorted(set(launches) | {n for n in registers if "kvpop" in n}) or ["—"]
        for name in names:
            grid, threads, smem = launches.get(name, ("?", "?", None))
            regs, spill = registers.get(name, ("?", "?"))
            rows.append(f"| {kernel} | {name} | {status} | {seconds:.1f} | {grid} | {threads} | "
                        f"{'?' if smem is None else f'{smem / 1024:.0f} KiB'} | {regs} | {spill} |")
    print("| kernel | launch | compile | s | grid | threads | shared memory | registers | spill stores (B) |")
    print("|---|---|---|---:|---|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
