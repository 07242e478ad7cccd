"""Report files that change together or not at all.

    with staged_outputs(out_dir) as out:
        with open(out.path("samples.jsonl"), "w") as f: ...   # written under a temporary name
        write_text(out.path("accuracy.md"), table)
    # only here, after the block succeeded, are the temporaries renamed to their names

A failed rerun into an old `out_dir` (an exception, a kill) leaves the previous report whole:
no truncated samples.jsonl next to an accuracy.md of another run. Temporaries are named
`.tmp-PID-NAME` (same extension, so matplotlib picks the format) and removed on failure; those
of a process killed before its renames are removed by the next report into the folder.

Each command that writes a report folder holds its lock for the whole call (`holds_out_dir`, the
lock of `kvpop_jax.fileio.lock_folder`: OUT/run.lock, as a training run holds its RUN_DIR): a second
command into the same folder is refused at once (a ValueError naming the folder and the PID) rather
than mixing its files with the first one's. A folder this process already holds (a caller's own
run folder, locked by train.run_dir) nests.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import inspect
import json
import os
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from kvpop_jax.fileio import (atomic_file, check_writable_dir, dead_temporaries, fsync_dir, fsync_file, lock_folder,
                              make_folder)

TMP_PREFIX = ".tmp-"  # `.tmp-PID-NAME`

Writer = TypeVar("Writer", bound=Callable)


class StagedOutputs:
    """Temporary paths for the final files of one report in `out_dir` (created); `names`: the report's files,
    staged (and checked) now rather than when each is written, after the work."""

    def __init__(self, out_dir: str | os.PathLike, names: Sequence[str] = ()):
        self.out_dir = os.fspath(out_dir)
        check_writable_dir(self.out_dir, "out_dir")
        make_folder(self.out_dir)
        remove_dead_staged_files(self.out_dir)
        self.staged: dict[str, str] = {}  # final path -> temporary path
        for name in names:
            self.path(name)

    def path(self, name: str) -> str:
        """Where to write the file `name` of the report now (renamed to out_dir/name at the end)."""
        final = os.path.join(self.out_dir, name)
        if final not in self.staged:
            _check_not_a_folder(final)
            self.staged[final] = os.path.join(self.out_dir, f"{TMP_PREFIX}{os.getpid()}-{name}")
        return self.staged[final]

    def final(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def commit(self) -> None:
        for final in self.staged:  # before any rename: a report mixing new files with old ones is no report
            _check_not_a_folder(final)
        for tmp in self.staged.values():  # a file written with open() (samples.jsonl): on disk before it is renamed
            if os.path.exists(tmp):
                fsync_file(tmp)
        for final, tmp in self.staged.items():
            if os.path.exists(tmp):
                os.replace(tmp, final)
        fsync_dir(self.out_dir)

    def discard(self) -> None:
        for tmp in self.staged.values():
            if os.path.exists(tmp):
                os.unlink(tmp)


def _check_not_a_folder(final: str) -> None:
    """os.replace cannot put a report file where a folder of that name is (a link to one is replaced)."""
    if os.path.isdir(final) and not os.path.islink(final):
        raise ValueError(f"{final} is a folder, not a file: the report writes its file there; move the folder "
                         "aside, or write the report into another folder")


def remove_dead_staged_files(out_dir: str) -> None:
    """Deletes the staged files `.tmp-PID-NAME` in `out_dir` whose process is gone: a SIGKILL skips the
    clean-up, so a killed report's (large) samples would pile up."""
    for path in dead_temporaries(out_dir, TMP_PREFIX):
        if os.path.isfile(path):
            os.unlink(path)


def out_dir_arg(text: str) -> str:
    """argparse type of --out_dir: refused at parse time (usage error, exit 2) if it cannot be a
    report folder, before any model loads. A leading `~` is expanded (the shell leaves `--out_dir=~/x`)."""
    text = os.path.expanduser(text)
    try:
        check_writable_dir(text, "--out_dir")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@contextlib.contextmanager
def staged_outputs(out_dir: str | os.PathLike, names: Sequence[str] = ()) -> Iterator[StagedOutputs]:
    """Yields a StagedOutputs (`names`: its files, checked up front); renames its files into place if the block
    succeeds, else (or if the renames cannot start) deletes them."""
    stage = StagedOutputs(out_dir, names)
    try:
        yield stage
        stage.commit()
    except BaseException:
        stage.discard()
        raise


def journal_file(name: str) -> str:
    """The file name of report NAME's journal (`Journal`) in its folder."""
    return f".{name}-journal.jsonl"


JOURNAL_FORMAT = 1  # in the header: a journal of another layout is not read


def _json_line(line: bytes) -> Any:
    """A whole JSON line's value, or None (no newline: cut short; not JSON)."""
    try:
        return json.loads(line) if line.endswith(b"\n") else None
    except ValueError:
        return None


class Journal:
    """The finished parts of a report, kept across a kill, so that a rerun with the same inputs does only the
    rest: OUT/.NAME-journal.jsonl, a header line holding a hash of `inputs` (everything the report's numbers
    depend on), then one JSON line per finished part, synced as it is written. `parts`: those a rerun with the
    same inputs finds (a line the kill cut short is dropped). A journal of other inputs (`stale`: how many parts
    it held), or one `resume=False` passes over, is left as it is until this run's first part replaces it: a
    rerun stopped at the note loses nothing. The caller removes it once the report is committed. Its folder is
    the report's, locked (`holds_out_dir`)."""

    def __init__(self, out_dir: str | os.PathLike, name: str, inputs: Mapping[str, Any], *, resume: bool = True):
        self.path = os.path.join(os.fspath(out_dir), journal_file(name))
        _check_not_a_folder(self.path)
        key = json.dumps(inputs, sort_keys=True, default=str).encode()
        fields = {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
                  for k, v in inputs.items()}  # to name which inputs another run's journal differs in
        self.header = {"journal": name, "format": JOURNAL_FORMAT, "inputs": hashlib.sha256(key).hexdigest(),
                       "fields": fields}
        self.parts: list[dict] = []
        self.stale: int | None = None
        self.changed: list[str] = []  # the inputs a stale journal of this layout was written for with other values
        self._started = False  # this run's header is in the file
        if not os.path.exists(self.path):
            return
        parts, end, held = self._read()
        if parts is None or not resume:
            self.stale = held
        else:
            self.parts = parts
            if end < os.path.getsize(self.path):  # the torn line, which an append would run into
                os.truncate(self.path, end)
            self._started = True

    def _read(self) -> tuple[list[dict] | None, int, int]:
        """(the parts of a journal of these inputs, else None; the byte where its last whole part ends; how many
        whole lines of parts it holds). Read line by line: a journal of hours of samples is not held twice."""
        parts, end, held = [], 0, 0
        try:
            with open(self.path, "rb") as f:
                header = f.readline()
                theirs = _json_line(header)
                ours, end = theirs == self.header, len(header)
                if not ours and isinstance(theirs, dict) and isinstance(theirs.get("fields"), dict):
                    self.changed = sorted(k for k, v in self.header["fields"].items() if theirs["fields"].get(k) != v)
                for line in f:
                    if not ours:
                        held += line.endswith(b"\n")
                        continue
                    record = _json_line(line)
                    if record is None:  # cut by the kill (or a disk that filled mid-line: nothing after it trusted)
                        break
                    parts.append(record)
                    end += len(line)
        except OSError:
            return None, 0, held
        return (parts if ours else None), end, len(parts) if ours else held

    def add(self, part: Mapping[str, Any]) -> dict:
        """Journals a finished part (synced); returns it as a rerun reads it back."""
        line = json.dumps(part) + "\n"
        if not self._started:  # a stale journal, or none: replaced whole
            with atomic_file(self.path, "w") as f:
                f.write(json.dumps(self.header) + "\n" + line)
            self._started = True
        else:
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        return json.loads(line)

    def remove(self) -> None:
        """Deletes the journal (the report it was for is whole)."""
        if os.path.exists(self.path):
            os.unlink(self.path)


def lock_out_dir(out_dir: str | os.PathLike) -> contextlib.AbstractContextManager[None]:
    """Holds OUT/run.lock (creating OUT), or a ValueError: 'report folder OUT in use by PID N ...'."""
    check_writable_dir(out_dir, "out_dir")
    return lock_folder(os.fspath(out_dir), "report folder", "--out_dir")


def holds_out_dir(*files: str) -> Callable[[Writer], Writer]:
    """Decorates a report writer with an `out_dir` argument: the whole call holds `lock_out_dir(out_dir)`, and
    `files`, the report's, are checked first (a folder of one's name is refused before the work, not at the
    renames after it). The writer's `report_files` names them."""
    def decorate(run: Writer) -> Writer:
        signature = inspect.signature(run)

        @functools.wraps(run)
        def locked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            out_dir = bound.arguments["out_dir"]
            with lock_out_dir(out_dir):
                for name in files:
                    _check_not_a_folder(os.path.join(os.fspath(out_dir), name))
                return run(*args, **kwargs)

        locked.report_files = files
        return locked

    return decorate
