"""The accuracy report: per-method rows, the Table-1-style markdown table and the bar plot."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from eval.plots import plt, save_figure


def cr_percent(cr: float) -> str:
    """A compression ratio as a percentage, whole when it is one (75%), else with the digits that
    tell it apart (99.9%, not 100%; 87.5%)."""
    pct = 100 * cr
    if abs(pct - round(pct)) < 1e-6:
        return f"{pct:.0f}%"
    digits = 1
    while digits < 6 and float(f"{pct:.{digits}f}") in (0.0, 100.0):
        digits += 1
    return f"{pct:.{digits}f}".rstrip("0").rstrip(".") + "%"


def summarize(records: Sequence[dict], benchmarks: Sequence[str]) -> list[dict]:
    """Rows (method, cr, budget, per-benchmark pass@1, abs, rel) from per-problem records.

    A record: method, cr (None for dense), budget, benchmark, id, correct (list of bools).
    abs = mean over benchmarks; rel = abs / dense abs (None without a dense row or at 0).
    """
    keys = []
    for r in records:
        if (r["method"], r["cr"]) not in keys:
            keys.append((r["method"], r["cr"]))
    rows = []
    for method, cr in keys:
        mine = [r for r in records if r["method"] == method and r["cr"] == cr]
        per = {b: float(np.mean([np.mean(r["correct"]) for r in mine if r["benchmark"] == b]))
               for b in benchmarks if any(r["benchmark"] == b for r in mine)}
        rows.append(dict(method=method, cr=cr, budget=mine[0]["budget"], scores=per,
                         abs=float(np.mean(list(per.values())))))
    dense = next((r["abs"] for r in rows if r["method"] == "dense"), None)
    for r in rows:
        r["rel"] = r["abs"] / dense if dense else None
    return rows


def format_table(rows: Sequence[dict], benchmarks: Sequence[str]) -> str:
    head = ["CR", "B", "Method", *benchmarks, "Abs.", "Rel."]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    order = sorted(rows, key=lambda r: (r["cr"] is not None, r["cr"] or 0.0))
    for r in order:
        cr = "—" if r["cr"] is None else cr_percent(r["cr"])
        budget = "full" if r["budget"] is None else str(r["budget"])
        cells = [f"{r['scores'][b]:.2f}" if b in r["scores"] else "—" for b in benchmarks]
        rel = "—" if r["rel"] is None else f"{r['rel']:.2f}"
        lines.append("| " + " | ".join([cr, budget, "dense (teacher)" if r["method"] == "dense" else r["method"],
                                          *cells, f"{r['abs']:.2f}", rel]) + " |")
    return "\n".join(lines) + "\n"


def plot_bars(rows: Sequence[dict], path: str) -> None:
    crs = sorted({r["cr"] for r in rows if r["cr"] is not None})
    methods = list(dict.fromkeys(r["method"] for r in rows if r["cr"] is not None))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(crs) * max(1, len(methods))), 3.6))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [next((r["abs"] for r in rows if r["method"] == m and r["cr"] == cr), np.nan) for cr in crs]
        ax.bar(np.arange(len(crs)) + (j - (len(methods) - 1) / 2) * width, vals, width, label=m)
    dense = next((r["abs"] for r in rows if r["method"] == "dense"), None)
    if dense is not None:
        ax.axhline(dense, color="k", linestyle="--", linewidth=1, label="dense (teacher)")
    ax.set_xticks(np.arange(len(crs)), [f"CR {cr_percent(cr)}" for cr in crs])
    ax.set_ylabel("pass@1 (mean over benchmarks)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
