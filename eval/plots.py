"""Shared helpers of the evaluation reports: matplotlib (Agg), markdown tables, checkpoints.

Every `eval` command writes a markdown report and PNGs into one output directory; these
helpers keep the look of those files the same across commands.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or the GPU machine

import matplotlib.pyplot as plt  # noqa: E402

__all__ = [
    "checkpoint_tokenizer",
    "format_number",
    "load_model",
    "markdown_table",
    "plt",
    "save_figure",
    "strip_kvpop",
    "timestamp",
    "write_text",
]


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> str:
    """Writes `fig` as a PNG (directories created) and closes it; returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def write_text(path: str | os.PathLike, text: str) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def format_number(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> str:
    """A GitHub markdown table; floats get `digits` decimals, `|` in cells is escaped."""
    cell = lambda x: format_number(x, digits).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def timestamp() -> str:
    """UTC date and time, second resolution (for report headers)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def strip_kvpop(config, params):
    """The dense model inside a KVpop checkpoint: config without `kvpop`, params without
    the per-layer `self_attn/kvpop` subtrees."""
    if config.kvpop is None:
        return config, params
    out = {}
    for name, sub in params.items():
        if name.startswith("layers_") and "kvpop" in sub.get("self_attn", {}):
            attn = {k: v for k, v in sub["self_attn"].items() if k != "kvpop"}
            sub = {**sub, "self_attn": attn}
        out[name] = sub
    return dataclasses.replace(config, kvpop=None), out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def checkpoint_tokenizer(checkpoint):
    """The checkpoint directory's tokenizer, or None when it ships none.

    Checked by file first: transformers 5 otherwise builds an empty tokenizer of the
    model type's class from config.json alone.
    """
    if not isinstance(checkpoint, (str, os.PathLike)):
        return None
    if not any(os.path.isfile(os.path.join(checkpoint, f)) for f in TOKENIZER_FILES):
        return None
    from train.data import load_tokenizer

    return load_tokenizer(checkpoint)


def load_model(checkpoint, *, require_kvpop: bool = False, dtype=None):
    """(config, params) from a checkpoint directory (params in `dtype`, default float32), or
    passed through when given as a `(config, params)` pair."""
    if isinstance(checkpoint, tuple):
        config, params = checkpoint
    else:
        import jax.numpy as jnp

        from kvpop_jax import load_pretrained

        config, params = load_pretrained(checkpoint, jnp.float32 if dtype is None else dtype)
    if require_kvpop and config.kvpop is None:
        raise ValueError(
            f"{checkpoint if not isinstance(checkpoint, tuple) else 'the model'} is a dense checkpoint; "
            "this analysis needs a KVpop export (config.json with a 'kvpop' entry)"
        )
    return config, params
