"""Benchmarks: problems (id, prompt, answer) from local files or the HF hub."""

from __future__ import annotations

import json
import os

PROMPT_FIELDS = ("prompt", "problem", "question")


def load_benchmark(source: str, *, split: str = "test", limit: int | None = None) -> list[dict]:
    """Problems as dicts (id, prompt, answer) from a JSONL/JSON file, a local data file
    `datasets` reads (parquet, csv), or a HF hub dataset name (`split`)."""
    if source.endswith((".jsonl", ".json")) and os.path.isfile(source):
        with open(source) as f:
            text = f.read()
        rows = json.loads(text) if source.endswith(".json") and text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        import datasets  # heavy: only for non-JSONL sources

        ext = os.path.splitext(source)[1].lstrip(".")
        if os.path.exists(source) and ext in ("parquet", "csv"):
            rows = datasets.load_dataset(ext, data_files=source, split="train")
        else:
            rows = datasets.load_dataset(source, split=split)
        rows = [dict(r) for r in rows]
    problems = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        field = next((f for f in PROMPT_FIELDS if f in row), None)
        if field is None or "answer" not in row:
            raise ValueError(f"{source!r} row {i} needs one of {PROMPT_FIELDS} and 'answer', has {sorted(row)}")
        problems.append(dict(id=str(row.get("id", i)), prompt=row[field], answer=str(row["answer"])))
    if not problems:
        raise ValueError(f"benchmark {source!r} has no problems")
    return problems


def benchmark_name(source: str) -> str:
    return os.path.splitext(os.path.basename(source.rstrip("/")))[0] or source
