"""Compile every kernel for an H100 on a CPU-only machine and report its launch configuration.

    pip install "jax-cuda12-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')" \\
        "jax-cuda12-pjrt==$(python -c 'import jaxlib; print(jaxlib.__version__)')"
    JAX_PLATFORMS=cpu python benchmarks/h100_compile_report.py [--recipe qwen3_8b_cr88]

XLA's GPU compiler (the jax-cuda12-plugin) compiles each kernel at the recipe's shapes for the
H100 of `tests/data/h100_target_config.txtpb` (`pallas_kernels.compat.compile_for_gpu`), with
register spills as errors: Pallas' Triton IR -> PTX (sm_90a) with XLA's pinned Triton -> ptxas;
Mosaic GPU's kernel through its own pipeline. XLA's dump (`--xla_dump_to`) lists each Triton
kernel's grid, threads and shared memory. (`MOSAIC_GPU_DUMP_PTXAS=1` makes Mosaic GPU print its
ptxas report: registers, spills.) Prints a markdown table.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
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
    shapes = recipe_shapes(args.recipe)
    print(f"jax {jax.__version__}; recipe {args.recipe}: {shapes}", file=sys.stderr)
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
                                 r"\s+shared_memory: (\d+) bytes", open(path).read()):
                launches[m.group(1)] = (m.group(2), m.group(3), int(m.group(4)))
        names = sorted(launches) or ["(custom call)"]
        for name in names:
            grid, threads, smem = launches.get(name, ("—", "—", None))
            rows.append(f"| {kernel} | {name} | {status} | {seconds:.1f} | {grid} | {threads} | "
                        f"{'—' if smem is None else f'{smem / 1024:.0f} KiB'} |")
    print("| kernel | launch | compile (no spills) | s | grid | threads | shared memory |")
    print("|---|---|---|---:|---|---|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
