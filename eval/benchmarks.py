"""Benchmarks: problems (id, prompt, answer) from local files or the HF hub."""

from __future__ import annotations

import json
import os

PROMPT_FIELDS = ("prompt", "problem", "question")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")


def load_benchmark(source: str, *, split: str = "test", limit: int | None = None) -> list[dict]:
    """Problems as dicts (id, prompt, answer) from a JSONL/JSON file, a local data file
    `datasets` reads (parquet, csv), or a HF hub dataset name (`split`)."""
    if source.endswith((".jsonl", ".json")) and os.path.isfile(source):
        with open(source) as f:
            text = f.read()
        if not text.strip():
            raise ValueError(f"benchmark {source!r} is empty (no JSON records)")
        rows = _json_rows(source, text)
    elif not os.path.exists(source) and (os.path.splitext(source)[1] in LOCAL_SUFFIXES
                                         or source.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"benchmark {source!r}: no such file (a local path is never looked up on the hub)")
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
        if not isinstance(row, dict):
            raise ValueError(f"{source!r} row {i} is not a JSON object: {str(row)[:80]!r}")
        field = next((f for f in PROMPT_FIELDS if f in row), None)
        if field is None or "answer" not in row:
            raise ValueError(f"{source!r} row {i} needs one of {PROMPT_FIELDS} and 'answer', has {sorted(row)}")
        problems.append(dict(id=str(row.get("id", i)), prompt=row[field], answer=str(row["answer"])))
    if not problems:
        raise ValueError(f"benchmark {source!r} has no problems")
    return problems


def _json_rows(source: str, text: str) -> list:
    """A JSON array, or JSON lines; a bad line is named by its number."""
    if source.endswith(".json") and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"benchmark {source!r} line {e.lineno} is not valid JSON ({e.msg})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"benchmark {source!r} line {number} is not valid JSON ({e.msg}): "
                             f"{line.strip()[:80]!r}") from None
    return rows


def benchmark_name(source: str) -> str:
    return os.path.splitext(os.path.basename(source.rstrip("/")))[0] or source
