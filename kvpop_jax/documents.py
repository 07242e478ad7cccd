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
import itertools
import json
import os
import re
from typing import Iterable, Iterator, Sequence

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


def first_json_error(files: Sequence[str]) -> str | None:
    """Where the first of these JSON / JSON-lines files goes wrong: "FILE is empty" or "FILE line N is
    not valid JSON (...)"; None when every record parses. Run after a reader failed, to name the spot."""
    for fn in files:
        blank, whole = True, False
        with open(fn, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                blank = False
                try:
                    record = json.loads(line)
                except RecursionError:  # thousands of nested brackets: no training text, and no traceback either
                    return f"{fn} line {number} nests its JSON too deep: {line.strip()[:80]!r}"
                except json.JSONDecodeError as e:
                    if _extension(fn) == ".json":
                        whole = True  # perhaps one JSON document over many lines: parse it whole below
                        break
                    return f"{fn} line {number} is not valid JSON ({e.msg}): {line.strip()[:80]!r}"
                if not isinstance(record, dict):
                    return f"{fn} line {number} is not a JSON object: {line.strip()[:80]!r}"
        if blank:
            return f"{fn} is empty (no JSON records)"
        if whole:
            try:
                with open(fn, encoding="utf-8", errors="replace") as f:
                    json.load(f)
            except RecursionError:
                return f"{fn} nests its JSON too deep"
            except json.JSONDecodeError as e:
                return f"{fn} line {e.lineno} is not valid JSON ({e.msg})"
    return None


def read_error(config: DocumentSpec, error: Exception, source: _Source | None = None) -> ValueError:
    """A ValueError saying which file (and line) could not be read, for an exception of the reader."""
    source = source or resolve_source(config.data)
    if source.builder == "json":
        where = first_json_error(source.files)
        if where is not None:
            return ValueError(f"data={config.data}: {where}")
    where = ", ".join(source.files) if source.files else source.location
    error = reader_cause(error)
    return ValueError(f"data={config.data}: could not read {where}: {type(error).__name__}: {error}")


def reader_cause(error: BaseException) -> BaseException:
    """What went wrong in a `datasets` read: the cause of a DatasetGenerationError, whose own message ("An error
    occurred while generating the dataset") says nothing; any other error itself."""
    if type(error).__name__ == "DatasetGenerationError" and error.__cause__ is not None:
        return error.__cause__
    return error


def open_dataset(config: DocumentSpec, source: _Source | None = None):
    """A `datasets.Dataset` (read up front) or `IterableDataset` (streamed)."""
    import datasets

    source = source or resolve_source(config.data)
    if source.builder == "json":  # an empty file is a StopIteration deep inside `datasets`
        empty = [f for f in source.files if os.path.getsize(f) == 0]
        if empty:
            raise ValueError(f"data={config.data}: {empty[0]} is empty (no JSON records)")
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
    except Exception as e:  # datasets raises many types; the user needs the path (and line) and the cause
        raise read_error(config, e, source) from e


# --------------------------------------------------------------------------------- text

@dataclasses.dataclass(frozen=True)
class TextSpec:
    fields: tuple[str, ...]
    chat: bool


def text_spec(config: DocumentSpec, columns: list[str], first: dict, rows: Iterable[dict] | None = None) -> TextSpec:
    """Which field(s) hold the text, and whether it is chat: a list of messages in the first row whose
    field is not null or empty (`rows`, when given, is read for one; otherwise `first` decides)."""
    if config.text_field == "auto":
        found = [f for f in _AUTO_FIELDS if all(p in columns for p in f.split("+"))]
        if not found:
            raise ValueError(f"data={config.data}: none of the text fields {list(_AUTO_FIELDS)} is present; "
                             f"available columns: {columns}; set text_field (--text_field)")
        field = found[0]
    else:
        field = config.text_field
        missing = [p for p in field.split("+") if p not in columns]
        if missing:
            raise ValueError(f"data={config.data}: text field {missing[0]!r} not found; "
                             f"available columns: {columns}")
    fields = tuple(field.split("+"))
    if len(fields) > 1:
        return TextSpec(fields, chat=False)
    sample = first[fields[0]]
    if sample in (None, []) and rows is not None:  # a null or empty first value says nothing: the first other does
        for row in itertools.islice(checked_rows(config, rows), _SPEC_SCAN_ROWS):
            if row.get(fields[0]) not in (None, []):
                sample = row[fields[0]]
                break
    if isinstance(sample, list) and not all(isinstance(m, dict) for m in sample):  # e.g. token ids: not chat
        odd = next(m for m in sample if not isinstance(m, dict))
        raise ValueError(f"data={config.data}: text field {fields[0]!r} holds a list of {type(odd).__name__} "
                         f"({str(sample)[:60]!r}...); expected text, or chat messages (a list of "
                         "{'role': ..., 'content': ...}); set text_field (--text_field)")
    return TextSpec(fields, chat=isinstance(sample, list))


_SPEC_SCAN_ROWS = 10_000  # rows text_spec reads past null ones to tell chat from text


def _field_text(value, field: str) -> str:
    """A text field's value as text: strings, and numbers (a+b fields such as question+answer)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"text field {field!r} holds a {type(value).__name__} ({str(value)[:60]!r}...), not text; "
                     "set text_field to a column of strings (or of chat messages)")


def render(example: dict, spec: TextSpec, tokenizer) -> str | None:
    """The example's text; None when its text fields are all null or empty (nothing to train on)."""
    if not spec.chat:
        parts = [_field_text(example[f], f) for f in spec.fields]
        return "".join(parts) if any(parts) else None
    if not example[spec.fields[0]]:
        return None
    messages = example[spec.fields[0]]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"text field {spec.fields[0]!r} holds chat messages in other rows but a "
                         f"{type(messages).__name__} here ({str(messages)[:60]!r}...)")
    # Arrow gives every message every key seen in the column; drop the absent (None) ones.
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # a template's raise_exception ("roles must alternate"): a traceback naming no row
            raise ValueError(f"the tokenizer's chat template failed on the messages of field {spec.fields[0]!r} "
                             f"({type(e).__name__}: {e}): {str(messages)[:80]!r}...") from e
    lacking = next((m for m in messages if "role" not in m or "content" not in m), None)
    if lacking is not None:  # the `role: content` lines need both (a KeyError traceback named neither field nor row)
        raise ValueError(f"text field {spec.fields[0]!r} holds a chat message that lacks 'role' or 'content' "
                         f"({str(lacking)[:60]!r}...), and the tokenizer has no chat template to render it")
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


# A text tokenized against a limit is read by its head first when it is longer than this many characters per
# token of the limit (text runs ~4 per token): tokenized whole, a 20 MB line took 7.7 GB and 40 s, to be dropped
# as too long. A cut can change the tokens at the seam; the margin covers that.
_HEAD_CHARS_PER_TOKEN = 64
_HEAD_MARGIN = 64


def _head(text: str, chars: int) -> str:
    """The first `chars` characters of text, cut before a whitespace character where one is in the second half."""
    cut = max(text.rfind(c, chars // 2, chars) for c in " \n\t")
    return text[:cut if cut > 0 else chars]


def tokenize(texts: list[str], tokenizer, chat: bool, limit: int | None = None) -> list[np.ndarray]:
    """Token ids of each text, EOS-terminated, int32 [L]. With `limit`, a text whose head (its first
    64 * (limit + 64) characters) already makes more than limit + 64 tokens comes back as the head's ids: longer
    than `limit`, as the whole would be, without the memory and time of tokenizing it all."""
    eos = tokenizer.eos_token_id
    out = []
    if not texts:
        return out
    heads = {}
    if limit is not None:
        chars = _HEAD_CHARS_PER_TOKEN * (limit + _HEAD_MARGIN)
        heads = {i: _head(t, chars) for i, t in enumerate(texts) if len(t) > chars}
    encoded = tokenizer([heads.get(i, t) for i, t in enumerate(texts)], add_special_tokens=not chat,
                        return_attention_mask=False)["input_ids"]
    fits = [i for i in heads if len(encoded[i]) <= limit + _HEAD_MARGIN]  # the head says nothing: read it all
    if fits:
        whole = tokenizer([texts[i] for i in fits], add_special_tokens=not chat, return_attention_mask=False)
        for i, ids in zip(fits, whole["input_ids"]):
            encoded[i] = ids
    for ids in encoded:
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
    try:
        first = next(iter(ds), None)
    except Exception as e:  # a stream reads (and fails) only now
        raise read_error(config, e) from e
    if first is None:
        raise ValueError(f"data={config.data}: the dataset is empty")
    return list(ds.column_names or first.keys()), first


def checked_rows(config: DocumentSpec, ds) -> Iterator[dict]:
    """The rows of `ds`; a reader error on the way (a stream's bad line) names the file and line."""
    try:
        yield from ds
    except Exception as e:
        raise read_error(config, e) from e


def no_text_error(config: DocumentSpec, spec: TextSpec, rows: int) -> ValueError:
    return ValueError(f"data={config.data}: the text field {'+'.join(spec.fields)!r} is null or empty in all "
                      f"{rows} rows; nothing to train on (set text_field?)")


def load_documents(config: DocumentSpec, tokenizer=None) -> Iterator[str]:
    """The source's document texts in stored order (no shuffle, no filter; rows without text skipped)."""
    ds = open_dataset(config)
    spec = text_spec(config, *columns_and_first(config, ds), rows=ds)
    return (t for t in (render(example, spec, tokenizer) for example in checked_rows(config, ds)) if t is not None)
