"""README's Python blocks name every variable they use (copied as written, they must not stop at a NameError)."""

import ast
import builtins
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks() -> list[str]:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _undefined_names(source: str) -> list[str]:
    """Names a block reads at module level before (or without) binding or importing them."""
    bound, missing = set(dir(builtins)), []
    for stmt in ast.parse(source).body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
                missing.append(node.id)
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return missing


def test_readme_python_blocks_define_their_names():
    blocks = _python_blocks()
    assert len(blocks) >= 3
    # The dense decoding block continues the import block before it (its config and params).
    carried = "config = params = Qwen3ForCausalLM = jnp = None\n"
    problems = {}
    for block in blocks:
        missing = _undefined_names((carried if "generate(Qwen3ForCausalLM(config), params" in block else "") + block)
        if missing:
            problems[block.splitlines()[0]] = sorted(set(missing))
    assert not problems, f"README Python blocks use names they never define: {problems}"
