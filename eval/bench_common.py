"""What the benchmarks share: the command line, the device and versions, process memory, and
appending a section to BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib

from kvpop_jax.fileio import check_writable_file

MIB = 2**20


def default_command() -> str:
    """The command line of this process, as `python -m eval.<module> ...` when run that way."""
    argv = list(sys.argv)
    head, name = os.path.split(argv[0]) if argv else ("", "")
    if os.path.basename(head) == "eval" and name.endswith(".py"):
        return f"python -m eval.{name[:-3]} " + shlex.join(argv[1:])
    return "python " + shlex.join(argv)


def cli_command(prog: str, argv: Sequence[str] | None) -> str:
    """The command line a benchmark's `main(argv)` parsed: its parser's prog and the flags it was given. argv None
    means argparse read `sys.argv[1:]`, so that is what is recorded; an in-process call's own list is recorded as
    given (the host process's argv is pytest's or a notebook kernel's, not the benchmark's)."""
    return prog + " " + shlex.join(sys.argv[1:] if argv is None else list(argv))


def rss_bytes() -> int | None:
    """Resident set size of this process (VmRSS), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_description() -> dict[str, Any]:
    dev = jax.devices()[0]
    desc = {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count()}
    if dev.platform == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        except OSError:
            model = None
        desc["device_kind"] = model or platform.processor() or "cpu"
        desc["cpu_count"] = os.cpu_count()
    desc.update(jax=jax.__version__, jaxlib=jaxlib.__version__, python=platform.python_version())
    return desc


def check_markdown_out(path: str | os.PathLike, flag: str) -> None:
    """A markdown file results will be appended to, checked before any work: writable (`check_writable_file`)
    and named `*.md`. Appending a section to anything else (a checkpoint's config.json, a JSONL of
    problems) would corrupt a file the user owns, so the name is the guard. Touches nothing."""
    check_writable_file(path, flag)
    if not os.fspath(path).lower().endswith(".md"):
        raise ValueError(f"{flag}={os.fspath(path)} is not a markdown file: results are appended as markdown "
                         "sections, so name a .md file (e.g. BENCHMARKS.md)")


def append_benchmarks(path: str | os.PathLike, section: str) -> str:
    """Appends `section` to the markdown file (created with a title if missing); never truncates."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    unterminated = False  # a last line without its newline would swallow the section's heading
    if not new:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            unterminated = f.read(1) != b"\n"
    with open(path, "a") as f:
        if new:
            f.write("# Benchmarks\n\nResults appended by the eval commands, newest last.\n\n")
        elif unterminated:
            f.write("\n\n")
        f.write(section.rstrip("\n") + "\n\n")
    return path
