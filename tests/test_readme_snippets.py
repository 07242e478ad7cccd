"""README's Python blocks name every variable they use (copied as written, they must not stop at a NameError),
and the functions its code section points at exist."""

import ast
import builtins
import importlib
import importlib.util
import os
import re

import kvpop_jax.baselines
import kvpop_jax.cache
import kvpop_jax.config
import kvpop_jax.kvpop
import kvpop_jax.scorers

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
    # The dense decoding block continues the import block before it (its config and params), and the
    # conversation block both (its prompt_ids too).
    carried = "config = params = Qwen3ForCausalLM = jnp = None\n"
    chat_carried = carried + "prompt_ids = None\n"
    problems = {}
    for block in blocks:
        prefix = carried if "generate(Qwen3ForCausalLM(config), params" in block else ""
        missing = _undefined_names((chat_carried if "Conversation(model, params" in block else prefix) + block)
        if missing:
            problems[block.splitlines()[0]] = sorted(set(missing))
    assert not problems, f"README Python blocks use names they never define: {problems}"


def _section(title: str) -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _resolve(dotted: str) -> bool:
    """`module.name` (a kvpop_jax module or pallas_kernels), or `Class.attr` of a kvpop_jax class."""
    first, *rest = dotted.removeprefix("kvpop_jax.").split(".")
    if first == "pallas_kernels":
        obj, rest = importlib.import_module(".".join([first, rest[0]])), rest[1:]
    elif importlib.util.find_spec(f"kvpop_jax.{first}") is not None:
        obj = importlib.import_module(f"kvpop_jax.{first}")
    else:
        owners = [m for m in (kvpop_jax.kvpop, kvpop_jax.config, kvpop_jax.cache, kvpop_jax.scorers,
                              kvpop_jax.baselines) if hasattr(m, first)]
        if not owners:
            return False
        obj = getattr(owners[0], first)
    for name in rest:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def test_readme_code_section_names_exist():
    # "How KVpop works in code" maps the paper's steps to functions: a reader looks each one up.
    rows = [line for line in _section("How KVpop works in code").splitlines() if line.startswith("|")]
    names = {d for code in re.findall(r"`([^`\n]+)`", "\n".join(rows))
             for d in re.findall(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", code)}
    assert {"policy.running_topk_cutoff", "KVpopHead.prefill_cache"} <= names
    missing = sorted(d for d in names if not _resolve(d))
    assert not missing, f"README's 'How KVpop works in code' names what kvpop_jax does not define: {missing}"
