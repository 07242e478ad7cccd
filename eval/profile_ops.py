"""Where a profiled program's time goes: the XLA ops of a JAX profiler trace, summed.

`jax.profiler.trace(DIR, create_perfetto_trace=True)` writes
DIR/plugins/profile/RUN/perfetto_trace.json.gz (`find_trace`). `op_profile` reads it and sums the
self time of every complete event ("ph": "X") that carries an XLA op (`args.hlo_op`), per op, on the
device timelines when the trace has any (a GPU's "/device:GPU:N" process: one event per kernel, on
its stream), else on the host's (XLA:CPU runs its thunks on host threads). It also reports how long
some op was running (the union of those events' intervals) within the span from the first op's
start to the last op's end: a step whose span is much longer than its busy time waits on launches
or the host, one whose busy time is mostly small fusions is memory-bound rather than matmul-bound.

    python -m eval.profile_ops DIR [--top 25]     # prints the markdown table

Categories are read from the op and kernel names (`category`): a rough split, not a cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
from collections.abc import Iterable

# (category, pattern over "hlo_op kernel-name", lower case), first match wins.
CATEGORIES = (
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|\bdot\b|dot_general|dot\.|convolution|ynn_fusion|matmul")),
    ("attention / Pallas / cuDNN", re.compile(r"custom-call|cudnn|flash|triton|pallas|mosaic|attention")),
    ("collective", re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective|nccl|permute")),
    ("copy / transpose", re.compile(r"copy|transpose|memcpy|memset|dynamic-update-slice|bitcast")),
    ("reduction fusion", re.compile(r"reduce|scatter|sort|select-and-scatter")),
    ("elementwise fusion", re.compile(r"fusion|loop|elementwise|add|multiply|exp")),
)


SCOPE_ARGS = ("tf_op", "long_name", "name_stack")  # event args that may hold the op's JAX scope


@dataclasses.dataclass(frozen=True)
class OpRow:
    op: str  # the XLA op (fusion) name
    category: str
    count: int
    total_us: float
    kernel: str  # an example event name (on a GPU the kernel's)
    scope: str = ""  # the JAX name stack of an example event, where the trace records it


@dataclasses.dataclass(frozen=True)
class OpProfile:
    rows: list[OpRow]  # every op, by total time, descending
    timeline: str  # "device" or "host"
    busy_us: float  # union of the op events' intervals over every thread or stream
    span_us: float  # first op start to last op end
    by_category: dict[str, float]  # category -> summed op time (us)

    @property
    def total_us(self) -> float:
        return sum(r.total_us for r in self.rows)


def find_trace(log_dir: str) -> str:
    """The newest perfetto_trace.json.gz under a `jax.profiler.trace` log dir (FileNotFoundError if none);
    a file is returned as it is."""
    if os.path.isfile(log_dir):
        return log_dir
    if not os.path.isdir(log_dir):
        raise FileNotFoundError(f"{log_dir!r}: no such file or folder")
    found = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir!r}: was it profiled with "
                                "jax.profiler.trace(..., create_perfetto_trace=True)?")
    return max(found, key=os.path.getmtime)


def category(op: str, kernel: str) -> str:
    text = f"{op} {kernel}".lower()
    return next((name for name, pattern in CATEGORIES if pattern.search(text)), "other")


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def self_times(intervals: list[tuple[float, float]]) -> list[float]:
    """Per [start, end) interval of one timeline, its length less that of the intervals directly
    inside it (an interval that starts inside another and outlasts it counts as inside up to the
    outer one's end)."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    own = [e - s for s, e in intervals]
    stack: list[int] = []
    for i in order:
        s, e = intervals[i]
        while stack and intervals[stack[-1]][1] <= s:
            stack.pop()
        if stack:
            parent = stack[-1]
            own[parent] -= min(e, intervals[parent][1]) - s
        stack.append(i)
    return own


def op_profile(trace) -> OpProfile:
    """Sums a perfetto trace's XLA op events per op. trace: a path (.json or .json.gz) or the loaded dict."""
    source = "the trace"
    if isinstance(trace, (str, os.PathLike)):
        source = os.fspath(trace)
        with open(source, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"  # by content, whatever the name says
        try:
            with (gzip.open if gzipped else open)(source, "rt", encoding="utf-8") as f:
                trace = json.load(f)
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{source!r} is not a readable trace (JSON, optionally gzipped): "
                             f"{type(e).__name__}: {e}") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{source}: not a Chrome/perfetto trace (a list of events, or a dict with 'traceEvents')")
    process = {e["pid"]: e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {}) and "dur" in e]
    on_device = [e for e in ops if process.get(e.get("pid"), "").startswith("/device:")]
    chosen, timeline = (on_device, "device") if on_device else (ops, "host")
    if not chosen:
        raise ValueError(f"{source}: no XLA op events (complete events with args.hlo_op)")
    # Events nest on one timeline (XLA:CPU's while and call thunks hold their bodies' thunks): each
    # op is charged its self time, its duration less that of the events directly inside it.
    per_line: dict[tuple, list] = {}
    for e in chosen:
        per_line.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    sums: dict[str, list] = {}
    for line in per_line.values():
        intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in line]
        for e, own in zip(line, self_times(intervals)):
            op = e["args"]["hlo_op"]
            args = e["args"]
            entry = sums.setdefault(op, [0, 0.0, e["name"], str(next((args[a] for a in SCOPE_ARGS if a in args), ""))])
            entry[0] += 1
            entry[1] += own
    rows = sorted((OpRow(op, category(op, k), n, t, k, scope) for op, (n, t, k, scope) in sums.items()),
                  key=lambda r: (-r.total_us, r.op))
    starts = [float(e["ts"]) for e in chosen]
    ends = [float(e["ts"]) + float(e["dur"]) for e in chosen]
    busy = busy_time(zip(starts, ends))  # any stream or thread running an op
    by_category: dict[str, float] = {}
    for r in rows:
        by_category[r.category] = by_category.get(r.category, 0.0) + r.total_us
    return OpProfile(rows=rows, timeline=timeline, busy_us=busy, span_us=max(ends) - min(starts),
                     by_category=dict(sorted(by_category.items(), key=lambda kv: -kv[1])))


def markdown(profile: OpProfile, top: int = 25) -> str:
    """The category split and the `top` ops as markdown tables."""
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    total = profile.total_us or 1.0
    lines = [f"Ops on the {profile.timeline} timeline: {len(profile.rows)} distinct, {profile.total_us / 1e3:.1f} ms "
             f"of self time summed over its threads or streams; some op running {profile.busy_us / 1e3:.1f} ms of "
             f"a {profile.span_us / 1e3:.1f} ms span ({100 * profile.busy_us / max(profile.span_us, 1e-9):.0f}%).", "",
             "| category | ms | share |", "|---|---:|---:|"]
    lines += [f"| {c} | {t / 1e3:.1f} | {100 * t / total:.1f}% |" for c, t in profile.by_category.items()]
    scoped = any(r.scope for r in profile.rows[:top])
    lines += ["", "| op | category | calls | ms | share | example event |" + (" scope |" if scoped else ""),
              "|---|---|---:|---:|---:|---|" + ("---|" if scoped else "")]
    for r in profile.rows[:top]:
        scope = f" `{_clip(r.scope, 80, tail=True)}` |" if scoped else ""
        lines.append(f"| `{r.op}` | {r.category} | {r.count} | {r.total_us / 1e3:.2f} | "
                     f"{100 * r.total_us / total:.1f}% | `{_clip(r.kernel, 60)}` |{scope}")
    return "\n".join(lines)


def _clip(text: str, n: int, tail: bool = False) -> str:
    text = text.replace("|", "/").replace("`", "'")
    if len(text) <= n:
        return text
    return "..." + text[-(n - 3):] if tail else text[: n - 3] + "..."


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("trace", help="a jax.profiler.trace log dir, or a perfetto_trace.json(.gz)")
    ap.add_argument("--top", type=_count, default=25, help="ops listed (>= 0; default 25)")
    args = ap.parse_args(argv)
    try:
        path = find_trace(args.trace)
        profile = op_profile(path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"trace: {path}\n\n{markdown(profile, args.top)}")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


if __name__ == "__main__":
    main()
