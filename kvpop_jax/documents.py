"""Documents from a hub dataset or local files, as text: the source side of training data.

    spec = DocumentSpec(data="nvidia/Nemotron-Math-v2", split="high_part00")
    for text in load_documents(spec, tokenizer): ...

Sources (`data`): a hub name (streamed by default), or local .jsonl/.json/.parquet/.arrow files
given as one file, a directory (searched recursively; a `save_to_disk` directory is loaded as
such) or a glob. `split`/`subset` apply to hub names and saved datasets; local files are one
split. Several splits, comma-separated (`high_part00,high_part01,high_part02`, the paper's
Nemotron-Math-v2 high-effort parts), are interleaved example by example (round robin, until
every split is exhausted), a fixed order that resumes exactly.

Text (`text_field`): "auto" takes the first of `text`, `messages`, `prompt+completion`,
`prompt+answer` the columns have. A field holding a list of {role, content} is a chat, rendered
with the tokenizer's chat template (`role: content` lines when it has none) and tokenized without
added special tokens (the template has them); plain text is tokenized with them (e.g. a <bos>).
"a+b" concatenates fields as-is. EOS is appended unless the ids already end with it.

Packing documents into training rows is `train/packing.py`'s job; evaluation reads documents
through the same functions.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Iterator

import numpy as np

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_AUTO_FIELDS = ("text", "messages", "prompt+completion", "prompt+answer")
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


@dataclasses.dataclass(frozen=True)
class DocumentSpec:
    """Where documents come from: `data` (hub name or local path), the text field, split/subset
    (hub names and saved datasets), streaming (None: hub yes, local no) and the HF cache dir."""

    data: str
    text_field: str = "auto"
    split: str = "train"
    subset: str | None = None
    streaming: bool | None = None
    cache_dir: str | None = None

    def __post_init__(self):
        if not self.data:
            raise ValueError("data must name a hub dataset or a local path, got ''")
        if not all(self.text_field.split("+")):
            raise ValueError(f"text_field must be 'auto', a field name or 'a+b', got {self.text_field!r}")


@dataclasses.dataclass(frozen=True)
class _Source:
    kind: str  # "hub", "files" or "saved" (a save_to_disk directory)
    location: str
    builder: str | None = None
    files: tuple[str, ...] = ()


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def resolve_source(data: str) -> _Source:
    """Decides what `data` names; raises FileNotFoundError naming it when a path matches nothing."""
    path = os.path.expanduser(data)
    if os.path.isdir(path):
        if all(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "state.json")) or \
                os.path.isfile(os.path.join(path, "dataset_dict.json")):  # save_to_disk: a Dataset or DatasetDict
            return _Source("saved", path)
        files = [f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                 if os.path.isfile(f) and _extension(f) in _FORMATS]
        if not files:
            raise FileNotFoundError(f"data={data}: the directory holds no {'/'.join(_FORMATS)} files")
    elif os.path.isfile(path):
        files = [path]
    elif any(c in path for c in "*?["):
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
        if not files:
            raise FileNotFoundError(f"data={data}: no file matches this pattern")
    elif not _HUB_NAME.fullmatch(data) or _extension(data) in _FORMATS or data.startswith("."):
        raise FileNotFoundError(f"data={data}: no such file or directory")
    else:
        return _Source("hub", data)
    files = sorted(files)
    unknown = [f for f in files if _extension(f) not in _FORMATS]
    formats = {_FORMATS.get(_extension(f)) for f in files}
    if unknown:
        raise ValueError(f"data={data}: unsupported file {unknown[0]} (use {'/'.join(_FORMATS)})")
    if len(formats) > 1:
        raise ValueError(f"data={data}: mixes file formats {sorted(formats)}; point it at one format")
    for f in files:
        if not os.access(f, os.R_OK):
            raise PermissionError(f"data={data}: cannot read {f}")
    return _Source("files", data, formats.pop(), tuple(files))


def open_dataset(config: DocumentSpec, source: _Source | None = None):
    """A `datasets.Dataset` (read up front) or `IterableDataset` (streamed)."""
    import datasets

    source = source or resolve_source(config.data)
    streaming = source.kind == "hub" if config.streaming is None else config.streaming
    splits = [s.strip() for s in config.split.split(",") if s.strip()]
    try:
        if source.kind == "files":
            return datasets.load_dataset(source.builder, data_files=list(source.files), split="train",
                                         streaming=streaming, cache_dir=config.cache_dir)
        if source.kind == "saved":
            saved = datasets.load_from_disk(source.location)
            if isinstance(saved, datasets.DatasetDict):
                missing = [s for s in splits if s not in saved]
                if missing:
                    raise ValueError(f"split {missing[0]!r} not in {sorted(saved)}")
                parts = [saved[s] for s in splits]
            else:
                parts = [saved]
            parts = [p.to_iterable_dataset() if streaming else p for p in parts]
        else:
            parts = [datasets.load_dataset(source.location, config.subset, split=s, streaming=streaming,
                                           cache_dir=config.cache_dir) for s in splits]
        if len(parts) == 1:
            return parts[0]
        return datasets.interleave_datasets(parts, stopping_strategy="all_exhausted_without_replacement")
    except Exception as e:  # datasets raises many types; the user needs the path and the cause
        where = ", ".join(source.files) if source.files else source.location
        raise ValueError(f"data={config.data}: could not read {where}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------- text

@dataclasses.dataclass(frozen=True)
class TextSpec:
    fields: tuple[str, ...]
    chat: bool


def text_spec(config: DocumentSpec, columns: list[str], first: dict) -> TextSpec:
    if config.text_field == "auto":
        found = [f for f in _AUTO_FIELDS if all(p in columns for p in f.split("+"))]
        if not found:
            raise ValueError(f"data={config.data}: none of the text fields {list(_AUTO_FIELDS)} is present; "
                             f"available columns: {columns}; set text_field")
        field = found[0]
    else:
        field = config.text_field
        missing = [p for p in field.split("+") if p not in columns]
        if missing:
            raise ValueError(f"data={config.data}: text field {missing[0]!r} not found; "
                             f"available columns: {columns}")
    fields = tuple(field.split("+"))
    return TextSpec(fields, chat=len(fields) == 1 and isinstance(first[fields[0]], list))


def render(example: dict, spec: TextSpec, tokenizer) -> str:
    if not spec.chat:
        return "".join("" if example[f] is None else str(example[f]) for f in spec.fields)
    # Arrow gives every message every key seen in the column; drop the absent (None) ones.
    messages = [{k: v for k, v in m.items() if v is not None} for m in example[spec.fields[0]]]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def tokenize(texts: list[str], tokenizer, chat: bool) -> list[np.ndarray]:
    """Token ids of each text, EOS-terminated, int32 [L]."""
    eos = tokenizer.eos_token_id
    out = []
    for ids in tokenizer(texts, add_special_tokens=not chat, return_attention_mask=False)["input_ids"]:
        if not ids or ids[-1] != eos:
            ids = list(ids) + [eos]
        out.append(np.asarray(ids, np.int32))
    return out


def chunks(iterable, size: int) -> Iterator[list]:
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def columns_and_first(config: DocumentSpec, ds) -> tuple[list[str], dict]:
    first = next(iter(ds), None)
    if first is None:
        raise ValueError(f"data={config.data}: the dataset is empty")
    return list(ds.column_names or first.keys()), first


def load_documents(config: DocumentSpec, tokenizer=None) -> Iterator[str]:
    """The source's document texts in stored order (no shuffle, no filter), as they are tokenized."""
    ds = open_dataset(config)
    spec = text_spec(config, *columns_and_first(config, ds))
    return (render(example, spec, tokenizer) for example in ds)
