"""Shared helpers of the evaluation reports: matplotlib (Agg), markdown tables, loading a model,
checking count arguments.

Every `eval` command writes a markdown report and PNGs into one output directory; these
helpers keep the look of those files the same across commands.
"""

from __future__ import annotations

import datetime
import io
import os
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or the GPU machine

import matplotlib.pyplot as plt  # noqa: E402

from kvpop_jax import load_pretrained  # noqa: E402
from kvpop_jax.fileio import atomic_write_bytes  # noqa: E402

__all__ = [
    "format_number",
    "load_model",
    "markdown_table",
    "plt",
    "save_figure",
    "timestamp",
    "write_text",
]


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> str:
    """Writes `fig` as a PNG (directories created; never a torn file) and closes it; returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def write_text(path: str | os.PathLike, text: str) -> str:
    """Writes `text` to `path` (directories created; never a torn file); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_bytes(path, text.encode())
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


def check_counts(**values: Any) -> None:
    """ValueError naming the first value that is not an integer >= 1 (checked before any work)."""
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def timestamp() -> str:
    """UTC date and time, second resolution (for report headers)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def load_model(checkpoint, *, require_kvpop: bool = False, dtype=None):
    """(config, params) from a checkpoint directory (params in `dtype`, default float32), or
    passed through when given as a `(config, params)` pair."""
    if isinstance(checkpoint, tuple):
        config, params = checkpoint
    else:
        config, params = load_pretrained(checkpoint, jnp.float32 if dtype is None else dtype)
    if require_kvpop and config.kvpop is None:
        name = checkpoint if not isinstance(checkpoint, tuple) else "the model"
        if config.dms is not None:
            raise ValueError(f"{name} is a DMS export; this analysis needs a KVpop export (for DMS's eviction "
                             "pattern use `python -m eval.main patterns`)")
        raise ValueError(
            f"{name} is a dense checkpoint; "
            "this analysis needs a KVpop export (config.json with a 'kvpop' entry)"
        )
    return config, params
