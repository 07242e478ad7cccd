"""The package seams: no import cycles (function-level imports included) and one direction,
pallas_kernels <- kvpop_jax <- demo <- eval <- train (README, "Layout"). kvpop_torch, the PyTorch
serving side, stands alone: it imports no project package and no JAX, so torch + transformers
are all it needs; only eval's benchmarks reach it, from inside a function."""

import ast
import importlib
import os
import subprocess
import sys

import pytest

from helpers import REPO

PACKAGES = ("pallas_kernels", "kvpop_jax", "kvpop_torch", "demo", "eval", "train")
# What each package may import from the project (its own modules aside).
ALLOWED = {
    "pallas_kernels": set(),
    "kvpop_jax": {"pallas_kernels"},
    "kvpop_torch": set(),
    "demo": {"pallas_kernels", "kvpop_jax"},
    "eval": {"pallas_kernels", "kvpop_jax", "demo", "kvpop_torch"},
    "train": {"pallas_kernels", "kvpop_jax", "demo", "eval"},
}
# Heavy optional dependencies a function may import when (and only when) it needs them.
LAZY_OK = {"datasets", "transformers", "tokenizers", "torch", "matplotlib", "math_verify", "kvpop_torch",
           "tensorboardX"}  # tensorboardX: only a run that writes events needs it (GPU images may lack it)
# What kvpop_torch must never pull in: a user with only torch + transformers runs it.
JAX_STACK = {"jax", "jaxlib", "flax", "optax", "orbax", "chex"}
KERNEL_DEPS = {"jax", "__future__", "contextlib", "dataclasses", "functools", "inspect", "numbers", "math"}


def modules() -> dict[str, str]:
    """module name -> file for every module of the five packages."""
    out = {}
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), REPO)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(root, f)
    return out


def imports(path: str, name: str) -> list[tuple[str, bool]]:
    """(imported module, inside a function?) for every import statement of a file.

    `from pkg import a` yields `pkg.a` (a submodule, or a name the resolver walks back to
    `pkg`), not `pkg` itself: a package's __init__ always runs before its submodules.
    """
    tree = ast.parse(open(path).read())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against the package
                    base = name.rsplit(".", child.level)[0]
                    mod = f"{base}.{child.module}" if child.module else base
                else:
                    mod = child.module
                found.extend((f"{mod}.{a.name}", in_function) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


def project_edges() -> dict[str, set[str]]:
    mods = modules()
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        for target, _ in imports(path, m):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m:
                edges[m].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    color, stack = {}, []

    def dfs(u):
        color[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if color.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if color.get(v) is None:
                cycle = dfs(v)
                if cycle:
                    return cycle
        color[u] = 2
        stack.pop()
        return None

    for u in sorted(edges):
        if color.get(u) is None:
            cycle = dfs(u)
            if cycle:
                return cycle
    return None


def test_no_module_cycle():
    cycle = find_cycle(project_edges())
    assert cycle is None, " -> ".join(cycle)


def test_no_package_cycle_and_one_direction():
    packages = {p: set() for p in PACKAGES}
    for m, targets in project_edges().items():
        for t in targets:
            src, dst = m.split(".")[0], t.split(".")[0]
            if src != dst:
                packages[src].add(dst)
                assert dst in ALLOWED[src], f"{m} imports {t}: {src} may import only {sorted(ALLOWED[src])}"
    assert find_cycle(packages) is None


def test_kernels_import_only_jax():
    for m, path in modules().items():
        if m.startswith("pallas_kernels"):
            for target, _ in imports(path, m):
                top = target.split(".")[0]
                assert top in KERNEL_DEPS | {"pallas_kernels"}, f"{m} imports {target}"


def test_kvpop_torch_imports_no_jax():
    for m, path in modules().items():
        if m.startswith("kvpop_torch"):
            for target, _ in imports(path, m):
                top = target.split(".")[0]
                assert top not in JAX_STACK and (top == "kvpop_torch" or top not in PACKAGES), f"{m} imports {target}"
    # Transitively too (transformers must not drag JAX in): a fresh interpreter.
    code = ("import sys, kvpop_torch; bad = sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:])); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code, *JAX_STACK, *(p for p in PACKAGES if p != "kvpop_torch")],
                   cwd=REPO, check=True)


def test_imports_inside_functions_are_heavy_optional_dependencies():
    for m, path in modules().items():
        for target, in_function in imports(path, m):
            if in_function:
                assert target.split(".")[0] in LAZY_OK, f"{m} imports {target} inside a function"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_imports(package):
    """Each module imports on its own (a fresh interpreter would find a hidden cycle at import)."""
    for m in sorted(x for x in modules() if x.split(".")[0] == package):
        if m.endswith("__main__"):
            continue
        importlib.import_module(m)
    assert package in sys.modules
