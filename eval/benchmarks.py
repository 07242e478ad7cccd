"""Benchmarks: problems (id, prompt, answer) from local files, the HF hub, or generated demo tasks.

A source is a JSONL/JSON or CSV file (each cell as written), a local parquet file, a hub dataset name,
or a demo-task spec that generates fresh problems nobody has seen:

    demo:TASK[:SPLIT][:seed=S][:n=N][:len=L][:difficulty=D]

e.g. `demo:reuse:test:seed=123:n=100:len=2048` (TASK in `demo.task.TASKS`: reuse, read_once;
SPLIT train | validation | test, default test; seed 0, n 100, len 1024, difficulty medium).
Different seeds and splits never share a problem. The train split is what the demo's trainings
draw from (`--data=demo:N` with the run's seed), so its problems are not held out: `held_out_note`
says so, and the accuracy report carries it.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import io
import json
import math
import os
import re

import yaml
from tqdm.auto import tqdm

from demo.task import DIFFICULTY, SEED_LIMIT, SPLITS, TASKS, extract_answer, generate_dataset, make_config
from kvpop_jax.documents import reader_cause

PROMPT_FIELDS = ("prompt", "problem", "question")
DEMO_PREFIX = "demo:"
# The generator is Python (~0.5 M tokens a second on one core): a spec past these, e.g. a typed extra digit, ran
# for minutes without a word before any check of the model saw it.
LEN_LIMIT = 2**20  # tokens per prompt: past any model's context
TOKENS_LIMIT = 2**28  # n x len: ~10 minutes of generating, GBs of prompt text
GENERATE_CHUNK_TOKENS = 2**20  # problems generated between two updates of the progress bar


@dataclasses.dataclass(frozen=True)
class DemoSpec:
    """Generated demo-task problems (see the module docstring)."""

    task: str
    split: str = "test"
    seed: int = 0
    n: int = 100
    len: int = 1024
    difficulty: str = "medium"

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"demo task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.split not in SPLITS:
            raise ValueError(f"demo split must be one of {sorted(SPLITS)}, got {self.split!r}")
        if self.difficulty not in DIFFICULTY:
            raise ValueError(f"demo difficulty must be one of {sorted(DIFFICULTY)}, got {self.difficulty!r}")
        # the generator's seed words are 32 bits (larger ones would alias other splits): problem i is word 3
        if not (1 <= self.n <= SEED_LIMIT and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"demo spec needs 1 <= n <= 2**32 and 0 <= seed < 2**32, got n={self.n}, "
                             f"seed={self.seed}")
        if self.len > LEN_LIMIT or self.n * self.len > TOKENS_LIMIT:
            raise ValueError(f"demo spec asks for n={self.n} problems of len={self.len} tokens, "
                             f"{self.n * self.len:,} in all; the generator makes len <= {LEN_LIMIT:,} "
                             f"(2**20) and at most {TOKENS_LIMIT:,} (2**28) tokens per spec")

    @property
    def name(self) -> str:
        # medium, the default, is left out (the names reports already carry stay as they were)
        return f"{self.task}-{self.split}-s{self.seed}-{self.n}x{self.len}" + (
            f"-{self.difficulty}" if self.difficulty != "medium" else "")

    def __str__(self) -> str:
        return f"{DEMO_PREFIX}{self.task}:{self.split}:seed={self.seed}:n={self.n}:len={self.len}" + (
            f":difficulty={self.difficulty}" if self.difficulty != "medium" else "")

    @property
    def held_out(self) -> bool:
        """False for the train split: `train.main --data=demo:N` and the demo teacher train on it."""
        return self.split != "train"

    def config(self):
        """The task's DemoTaskConfig; a length too short for the task is a ValueError naming the
        shortest one that works."""
        try:
            return make_config(self.difficulty, self.task, seq_len=self.len)
        except ValueError as e:
            raise ValueError(f"len={self.len}: {e}") from None  # make_config names the shortest length

    def problems(self, progress: bool = True, limit: int | None = None) -> list[dict]:
        """The spec's problems (the first `limit`); a progress bar where they are more than a few seconds of
        generating."""
        self.config()
        n = self.n if limit is None else min(self.n, limit)
        chunk, out = max(1, GENERATE_CHUNK_TOKENS // self.len), []
        with tqdm(total=n, desc=f"generating {self}", unit="problem", leave=False,
                  disable=not progress or n * self.len < 8 * GENERATE_CHUNK_TOKENS) as bar:
            for start in range(0, n, chunk):  # problem i is the same, however many are drawn at once
                examples = generate_dataset(min(chunk, n - start), self.seed, self.split, start=start,
                                            task=self.task, difficulty=self.difficulty, seq_len=self.len)
                out += [dict(id=ex["id"], prompt=ex["prompt"], answer=ex["answer"]) for ex in examples]
                bar.update(len(examples))
        return out


def parse_demo_spec(source: str) -> DemoSpec:
    """`demo:reuse:test:seed=123:n=100:len=2048` -> DemoSpec; errors name the bad part."""
    if not source.startswith(DEMO_PREFIX):
        raise ValueError(f"a demo benchmark starts with {DEMO_PREFIX!r}, got {source!r}")
    parts = [p for p in source[len(DEMO_PREFIX):].split(":") if p]
    if not parts:
        raise ValueError(f"{source!r}: name a task, e.g. demo:reuse (tasks: {sorted(TASKS)})")
    fields: dict = {"task": parts[0]}
    for part in parts[1:]:
        key, value = part.split("=", 1) if "=" in part else ("split", part)
        if key not in ("split", "seed", "n", "len", "difficulty"):
            raise ValueError(f"{source!r}: unknown key {key!r} (split, seed, n, len, difficulty)")
        if key in fields:
            raise ValueError(f"{source!r}: {key} given twice ({fields[key]!r} and {value!r})")
        if key == "split":
            fields[key] = value
            continue
        if key == "difficulty":
            fields[key] = value
        elif value.isascii() and value.isdigit():  # plain digits: int() would also take "+4", " 4", "1_0"
            fields[key] = int(value)
        else:
            raise ValueError(f"{source!r}: {key}={value!r} is not a non-negative integer (digits only)")
    try:
        spec = DemoSpec(**fields)
        spec.config()  # the task's own checks: is len long enough for it?
    except ValueError as e:
        raise ValueError(f"{source!r}: {e}") from None
    return spec


LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
TEXT_SUFFIXES = (".jsonl", ".json", ".csv")  # read here, not by `datasets`


def load_benchmark(source: str, *, split: str | None = None, limit: int | None = None,
                   progress: bool = True) -> list[dict]:
    """Problems as dicts (id, prompt, answer) from a demo spec, a JSONL/JSON or CSV file, a local
    parquet file (`datasets` reads it), a local folder of split files (`split`; see `_folder_rows`), or a
    HF hub dataset name (`split`, default "test"; a demo spec names its own split). limit: the first
    `limit` problems (>= 1; None: all; a demo spec generates only those). progress: a bar while a large demo
    spec generates."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for every problem), got {limit}")
    places = None
    if source.startswith(DEMO_PREFIX):
        if split is not None:
            raise ValueError(f"{source!r}: a demo spec names its own split (demo:TASK:SPLIT:...); "
                             f"got split={split!r} beside it")
        rows = parse_demo_spec(source).problems(progress=progress, limit=limit)
    elif source.rstrip("/") in ("demo", "demo.task"):
        raise ValueError(f"benchmark {source!r}: a demo benchmark is a spec such as demo:reuse or "
                         "demo:reuse:test:seed=123:n=100:len=2048 (note the colon)")
    elif split is not None and os.path.isfile(source):  # a folder of split files may be given a split
        raise ValueError(f"benchmark {source!r} is a local file, which has no splits; split={split!r} is for "
                         "folders and hub datasets (drop --split, or give the split's own file)")
    elif source.endswith(TEXT_SUFFIXES) and os.path.isfile(source):
        rows = _text_file_rows(source)
    elif os.path.isdir(source):
        rows, places = _folder_rows(source, split)
    elif not os.path.exists(source) and (os.path.splitext(source)[1] in LOCAL_SUFFIXES
                                         or source.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"benchmark {source!r}: no such file (a local path is never looked up on the hub)")
    elif os.path.exists(source) and os.path.splitext(source)[1] == ".parquet":
        import datasets  # heavy: only for non-text sources

        rows = [dict(r) for r in datasets.load_dataset("parquet", data_files=source, split="train")]
    else:  # offline, no such dataset, gated: one line naming the source
        rows = _datasets_rows(source, split or "test",
                              f"benchmark {source!r}: not a local file, and loading it as a hub dataset failed")
    problems, seen = [], {}
    for i, row in enumerate(rows if limit is None else rows[:limit]):
        at = f"{source!r} row {i}" if places is None else places[i]  # a folder's rows are named by file
        if not isinstance(row, dict):
            raise ValueError(f"{at} is not a JSON object: {str(row)[:80]!r}")
        row = _known_fields(at, row)
        field = next((f for f in PROMPT_FIELDS if f in row), None)
        if field is None or "answer" not in row:
            raise ValueError(f"{at} needs one of {PROMPT_FIELDS} and 'answer', has {sorted(row)}")
        if row["answer"] is None or not str(row["answer"]).strip():  # str(None) would score a boxed "None" right
            raise ValueError(f"{at} has no answer ({row['answer']!r})")
        if isinstance(row["answer"], bool) or not isinstance(row["answer"], (str, int, float)) or (
                isinstance(row["answer"], float) and not math.isfinite(row["answer"])):
            # a list or dict would be scored as its string, "['7']", which no completion boxes; JSON's NaN as "nan"
            raise ValueError(f"{at}: 'answer' must be a string or a finite number, got "
                             f"{type(row['answer']).__name__} {str(row['answer'])[:80]!r}")
        if not isinstance(row[field], str) or not row[field].strip():  # whitespace alone asks nothing
            raise ValueError(f"{at}: {field!r} must be a string with text in it (not empty or blank), "
                             f"got {str(row[field])[:80]!r}")
        # ids key every record, sample and per-problem comparison: a missing one is its row number
        problem_id = row.get("id", i)
        if problem_id is None or isinstance(problem_id, (bool, dict, list)) or not str(problem_id).strip():
            raise ValueError(f"{at}: 'id' must be a number or a string with text in it (or absent: "
                             f"the row number), got {str(problem_id)[:80]!r}")
        problem_id = str(problem_id)
        if problem_id in seen:
            first = seen[problem_id]
            both = f"{source!r} rows {first} and {i}" if places is None else f"{places[first]} and {at}"
            number = "row number" if places is None else "row number among the split's rows, file after file"
            raise ValueError(f"{both} share the id {problem_id!r}: records and samples are keyed by it, so give "
                             f"each problem its own (a row without 'id' takes its {number})")
        seen[problem_id] = i
        answer = str(row["answer"])
        if (final := reference_answer(answer)) is not None and not final:
            raise ValueError(f"{at}: 'answer' {answer[-80:]!r} ends in an empty answer")
        problems.append(dict(id=problem_id, prompt=row[field], answer=final or answer))
    if not problems:
        raise ValueError(f"benchmark {source!r} has no problems")
    return problems


def _text_file_rows(source: str) -> list:
    """A JSONL/JSON or CSV file's records, read as text (UTF-8, a byte-order mark skipped)."""
    with open(source, "rb") as f:
        data = f.read()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # a byte-order mark is no record
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:  # was the codec's line alone, naming no file
        at = bom + e.start
        line = len(re.split(rb"\r\n?|\n", data[:at]))  # lines as _json_rows counts them (\n, \r\n or \r)
        raise ValueError(f"benchmark {source!r} is not UTF-8 text ({e.reason} at byte {at}, line {line})") from None
    if not text.strip():
        raise ValueError(f"benchmark {source!r} is empty (no records)")
    return _csv_rows(source, text) if source.endswith(".csv") else _json_rows(source, text)


def _folder_rows(source: str, split: str | None) -> tuple[list, list[str] | None]:
    """A local folder's records for one split, and where each row is (None: `datasets` read them). Its files are
    split as `datasets` splits them (test.csv, data/test-00000-of-00002.jsonl, ...; files whose names carry no
    split are its one split, "train", read when no split is given; a README.md whose YAML names `configs` is
    `datasets`' to read, as it names the splits' files). JSONL/JSON and CSV files are read as a single
    such file is, each cell as written: `datasets` typed a CSV column, and an answer beyond int64 ended the run."""
    import datasets  # heavy: only for folders and non-text sources

    try:
        patterns = datasets.data_files.get_data_patterns(source)
    except datasets.data_files.EmptyDatasetError:
        raise ValueError(f"benchmark folder {source!r} holds no data files") from None
    found = datasets.data_files.DataFilesDict.from_patterns(patterns, base_path=source)
    files = {str(name): list(paths) for name, paths in found.items()}
    unnamed = patterns == datasets.data_files.DEFAULT_PATTERNS_ALL  # no file names a split
    card = os.path.join(source, "README.md")  # a dataset card: its YAML `configs` name each split's files
    configured = _card_names_configs(card)
    name = split or ("train" if unnamed and not configured else "test")
    if not configured and name not in files:
        raise ValueError(f"benchmark folder {source!r} has no {name!r} split (its files make {sorted(files)}): "
                         "name one with --split")
    paths = files.get(name, [])
    if configured or not all(path.endswith(TEXT_SUFFIXES) for path in paths):  # parquet, arrow, ...
        return _datasets_rows(source, name, f"benchmark folder {source!r}: `datasets` could not read its {name!r} "
                                            "split"), None
    rows, places = [], []
    for path in paths:
        file_rows = _text_file_rows(path)
        rows += file_rows
        places += [f"{path!r} row {i}" for i in range(len(file_rows))]
    return rows, places


def _datasets_rows(source: str, split: str, failed: str) -> list[dict]:
    """`datasets.load_dataset(source, split=split)`'s rows. Its ValueError and FileNotFoundError say what is
    wrong; anything else (a DatasetGenerationError, named by its cause; a connection error) is one line, `failed`
    and its first line, not a traceback through eval.main."""
    import datasets  # heavy: only for folders and non-text sources

    try:
        return [dict(r) for r in datasets.load_dataset(source, split=split)]
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:
        cause = reader_cause(e)
        raise ValueError(f"{failed} ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
                         ) from e


def _card_names_configs(path: str) -> bool:
    """Whether `path` is a dataset card whose YAML header (between `---` lines) names `configs`, the files of
    each split, which `datasets` reads; an unreadable header names none."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.startswith("---"):
        return False
    try:
        meta = yaml.safe_load(text[3:].split("\n---", 1)[0])
    except yaml.YAMLError:
        return False
    return isinstance(meta, dict) and bool(meta.get("configs"))


def _json_rows(source: str, text: str) -> list:
    """A JSON array, or JSON lines; a bad line is named by its number."""
    if source.endswith(".json") and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"benchmark {source!r} line {e.lineno} is not valid JSON ({e.msg})") from None
    rows = []
    # Lines end at \n, \r\n or \r (never inside a JSON string) only: str.splitlines also cut at U+2028, U+0085, ...,
    # which json.dumps(ensure_ascii=False) leaves raw in a prompt.
    for number, line in enumerate(re.split(r"\r\n?|\n", text), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"benchmark {source!r} line {number} is not valid JSON ({e.msg}): "
                             f"{line.strip()[:80]!r}") from None
    return rows


def _known_fields(at: str, row: dict) -> dict:
    """The row with the fields it reads (prompt, problem, question, answer, id) found whatever their case, as
    some benchmarks write them (AIME 2024's `Problem` and `Answer` were "needs one of ..."); a name written
    exactly wins, and two other spellings of one name are refused."""
    found = dict(row)
    for name in (*PROMPT_FIELDS, "answer", "id"):
        if name in row:
            continue
        spellings = [key for key in row if isinstance(key, str) and key.lower() == name]
        if len(spellings) > 1:
            raise ValueError(f"{at} spells the field {name!r} {len(spellings)} ways ({spellings}): "
                             "keep one")
        if spellings:
            found[name] = row[spellings[0]]
    return found


_FINAL_LINE_RE = re.compile(r"^####[ \t]*([^\n]*)", re.MULTILINE)


def reference_answer(answer: str) -> str | None:
    """The final answer of a worked solution given as the reference, else None (the answer is used as it is):
    the last line that starts with `####` (GSM8K's "... #### 72"), or the one `\\boxed{...}` in it. The whole
    text matched no completion under the string compare. A `####` inside a line, or several boxed answers (a
    multi-part reference, which a completion's last box cannot match either), leave the answer as it is."""
    finals = _FINAL_LINE_RE.findall(answer)
    if finals:
        return finals[-1].strip()
    if answer.count("\\boxed{") == 1 and "####" not in answer:  # (a #### inside a line: as written)
        return extract_answer(answer)  # None when unclosed
    return None


def _csv_rows(source: str, text: str) -> list[dict]:
    """A CSV file's rows as written, every cell text: `datasets` typed the columns, so an answer beyond
    int64 became a float ("1.2345678901234567e+19") or a traceback."""
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))  # the default 131072 refused long prompts
    try:
        reader = csv.DictReader(io.StringIO(text))
        rows = list(reader)
    except csv.Error as e:
        raise ValueError(f"benchmark {source!r} is not valid CSV ({e})") from None
    for i, row in enumerate(rows):
        if None in row:
            raise ValueError(f"benchmark {source!r} row {i} has more cells than the header names ({row[None]!r} "
                             "beyond it): quote a cell with a comma in it")
        if None in row.values():  # DictReader fills a short row with None: "has no answer (None)" misled
            raise ValueError(f"benchmark {source!r} row {i} has fewer cells than the header names "
                             f"({sum(v is not None for v in row.values())} of {len(reader.fieldnames)})")
    return rows


def held_out_note(source: str) -> str | None:
    """A warning for a demo spec whose problems are not held out (the train split), else None."""
    if not source.startswith(DEMO_PREFIX) or parse_demo_spec(source).held_out:
        return None
    return (f"{source!r} draws its problems from the demo's train split, which the demo trainings learn from "
            "(train.main's --data=demo:N and the demo teacher, by seed): they are not held out; use the "
            "test or validation split for held-out problems")


def benchmark_name(source: str) -> str:
    if source.startswith(DEMO_PREFIX):
        return parse_demo_spec(source).name
    return os.path.splitext(os.path.basename(source.rstrip("/")))[0] or source
