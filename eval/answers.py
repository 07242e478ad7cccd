"""Answers: the last `\\boxed{...}` (nested braces) or `#### ...` in a completion, checked
against the reference with HF's Math-Verify when installed (as the paper; on POSIX, main thread only), and
where it says no, or without it, by normalized string compare (`normalize_answer`): whitespace, `$`,
`\\left`/`\\right`, `\\dfrac`/`\\tfrac`, `\\text{}` and a trailing period are dropped, and numbers
compare by value. Only Math-Verify equates forms (`\\frac12` and 0.5, `50\\%` and 50, `x=5` and 5,
sets in any order).
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from typing import Any

from demo.task import canonical_int, extract_answer

__all__ = ["check_grading_thread", "extract_answer", "is_correct", "math_verify_available", "normalize_answer"]


def normalize_answer(answer: str) -> str:
    """Canonical string form for the fallback compare (see the module docstring)."""
    a = answer.strip()
    a = re.sub(r"\\text\{([^{}]*)\}", r"\1", a)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\!", ""), ("\\,", ""), ("\\;", ""), ("$", ""), (" ", "")):
        a = a.replace(old, new)
    a = a.rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", a):  # thousands separators
        a = a.replace(",", "")
    if re.fullmatch(r"[+-]?\d+", a):  # not int(a): a degenerate completion can box more than 4300 digits
        return canonical_int(a)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)", a) and math.isfinite(x := float(a)):  # beyond float: as written
        return str(int(x)) if x.is_integer() else repr(x)
    return a


@functools.cache  # a missing package is looked for once, not at every completion
def _math_verify():  # optional: `pip install math-verify`
    try:
        from math_verify import parse, verify

        return parse, verify
    except ImportError:
        return None


def check_grading_thread() -> None:
    """On POSIX, Math-Verify bounds each check with a SIGALRM alarm, which Python allows only in the main thread:
    off it, every check raised inside Math-Verify and silently fell back to the string compare (reported as
    math_verify), and without the alarm a completion such as `\\boxed{2^{2^{2^{2^{2^5}}}}}` never returns.
    (On Windows its timeouts run in a child process, from any thread.)"""
    if os.name == "posix" and _math_verify() is not None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("answers are checked by Math-Verify, whose timeouts (SIGALRM) work only in the main "
                           f"thread, not in thread {threading.current_thread().name!r}: grade on the main thread (or "
                           "call math_verify's parse and verify yourself with parsing_timeout=None and "
                           "timeout_seconds=None, which have no time limit)")


def is_correct(completion: str, gold: Any) -> tuple[bool, str | None]:
    """(correct, extracted answer) for one completion against the reference answer; with Math-Verify
    installed, on the main thread only (`check_grading_thread`)."""
    pred = extract_answer(completion)
    if pred is None:
        return False, None
    gold = str(gold)
    mv = _math_verify()
    if mv is not None:
        check_grading_thread()  # _math_verify is cached: this is no second import
        parse, verify = mv
        try:
            if verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")):
                return True, pred
        except Exception:  # noqa: BLE001 - math_verify raises on unparsable input; fall back
            pass
    return normalize_answer(pred) == normalize_answer(gold), pred


def math_verify_available() -> bool:
    return _math_verify() is not None
