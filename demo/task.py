"""The bundled long-context task: a synthetic "reasoning trace" where eviction matters.

A prompt is a trace of short lines over a tiny alphabet (one token per symbol):

    <bos>c4R7m0          bindings: name then digit, 1-3 per line (c=4, R=7, m=0)
    >m0+3=3              scratch: restate a recent binding (m0), then arithmetic mod 10
    q1c8                 names are re-bound freely, except the *marked* ones
    keep q               the mark: this binding is needed later (<= 1 line after it)
    ...                  (~300 lines)
    ask q+E              the question: sum mod 10 of 2 of the 3 marked bindings
    >q1>E9               completion (step by step, then the answer): look up each value ...
    1+9=0                  ... add mod 10 ...
    \\boxed{0}            ... and box it

Why this shape:
- Long-range memory is needed: the marked bindings live in the first 5-75% of the prompt, so
  sinks plus a recent window (StreamingLLM) never hold them, and every marked name is bound
  exactly once.
- Most tokens are useless after use: a scratch line looks up a binding at most `scratch_reach`
  tokens back (a short-range copy of the very lookup the question needs, which gives a dense model
  ~50 lookups per 1.5k-token trace to learn from) and is never read again; distractor bindings
  are never asked about.
- The needed facts are few and small: the value token of a binding (its key/value carry the
  name through a previous-token head) is one token per fact, so they fit easily in k.
- Which facts matter is revealed *after* they appear, within `max_mark_gap` tokens: a
  `keep NAME` line follows a marked binding. At insertion a marked binding is identical to the
  hundreds of distractor bindings (~29% of all tokens are binding values), so a scorer
  that decides at insertion can at best keep k of them blindly, while a delayed scorer, which
  sees the w >= max_mark_gap tokens after a token before ranking it (KVpop's mLSTM readout),
  can keep exactly the marked ones. `oracle_recovery` measures both bounds without a model.
- Learnable by a tiny dense model: every step is one attention lookup or local mod-10
  arithmetic, and every lookup (completion `>q1`, scratch `>m0`) has the binding's own form,
  name then digit, so it is a plain induction head (find the earlier `q`, copy the digit
  after it). The chain-of-thought completion splits the answer into such steps.
- A lookup says so before its name: `>` comes right before every name whose value is read by
  the name (scratch lines, the reuse task's recall lines, the completion's lookups), and nowhere
  else. At a name, a 2-layer model sees only the tokens just before it, so without the mark it
  cannot tell a lookup (`q1` answering the question) from a binding (`q1` in the trace, a random
  digit): it then fetches the name's old value at every binding too, and the future-attention
  target counts those useless reads as much as the facts' (BENCHMARKS.md, "A teacher that
  parks"). Recall lines `>q4` use the same syntax, so the circuit that answers the question reads
  the fact at every recall too. (Until stop 33 they were `q=4`, read at `=`: a second circuit,
  which teachers trained on the rest of the task learned in 1 of 4 measured runs; the others
  guessed the recalls, the fact was read once, by the question, and the mean target could not
  single it out. BENCHMARKS.md, stop 33.)

Two tasks (`TASKS`, `make_config(task=...)`):
- "read_once" (the fields' defaults): each fact is read exactly once, by the final question.
  One decisive read among ~900 later queries: the paper's mean future-attention target barely
  singles a fact out (BENCHMARKS.md), a harder benchmark kept beside the main one.
- "reuse" (the main task; the demo teacher's first stage, trained on read_once only, already
  answers it: configs/tiny_teacher_reuse.flags): like a reasoning trace that comes back to earlier results, each
  marked fact is recalled `n_reuse` times on lines `>q4` (its value predictable only by looking
  the fact up), the first recall at least `reuse_gap` of the prompt after the fact and the last
  at least `final_gap` before the question. A recall is a lookup, not a binding (the `>`), and the
  teachers measured read the fact itself there, not an earlier recall's copy, so every read, the
  question's included, goes to the fact: the paper's target collects n_reuse + 1 reads for it. Every read
  comes after the fact has left any heuristic's budget (B <= 25% of the prompt: StreamingLLM,
  TOVA and H2O have seen no attention to it while they could still keep it, provided they evict
  as they read the trace: `generate(stream_prompt=True)`, the demo recipe's default), and at insertion
  a fact looks like the hundreds of distractor bindings. Only the `keep` cue, inside the
  window after the fact, marks it.

Difficulty knob (`DIFFICULTY`): easy = answer is one looked-up value (n_query=1), medium
(default) = sum of two, hard = sum of three out of four marked, with a longer mark delay.
Lengths: `seq_len` is the exact prompt length in tokens of the demo tokenizer
(`demo/tokenizer.py`), <bos> included; the completion adds `completion_tokens`.

Answers are exact-match integers, boxed (`\\boxed{7}`, the native format) or `#### 7`;
`extract_answer` and `score` accept both. Only stdlib and numpy: no kvpop_jax import.
The oracles (`demo/oracles.py`) bound what any eviction policy can recover on it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import unicodedata
from collections import deque
from typing import Iterable

import numpy as np

from demo.atoms import ASK, BOXED, HASHES, KEEP, NAMES
from kvpop_jax.fileio import atomic_file

SPLITS = {"train": 0, "validation": 1, "test": 2}
_SCRATCH_TOKENS = 8  # ">m0+3=3\n"


@dataclasses.dataclass(frozen=True)
class DemoTaskConfig:
    """Shape of one trace. All lengths are in demo-tokenizer tokens.

    seq_len: exact prompt length, <bos> and question included.
    n_query: marked bindings summed (mod 10) in the answer; n_marked >= n_query are marked.
    p_scratch: probability that a distractor line is scratch arithmetic instead of bindings.
    max_bindings_per_line: bindings per binding line are uniform in [1, this].
    max_mark_delay: whole lines allowed between a marked binding's line and its `keep` line.
    marked_zone: marked bindings are placed in this fraction of the body (prompt minus question).
    n_names: size of the variable-name pool (a-z then A-Z).
    recent_names: a distractor name is not re-bound within this many bindings, so scratch
      lines read an unambiguous value.
    scratch_reach: a scratch line restates a binding whose value token is at most this many
      tokens before the restated digit, so distractors are read only inside a window w >= it.
    cot: the completion shows the lookups and additions before the boxed answer.
    answer_format: "boxed" (\\boxed{7}) or "hash" (#### 7).
    n_reuse: recall lines `>q4` of each marked fact (0: the read-once task).
    reuse_gap: the first recall comes at least this fraction of seq_len after the fact.
    final_gap: the last recall comes at least this fraction of seq_len before the question.
    """

    seq_len: int = 1536
    n_query: int = 2
    n_marked: int = 3
    p_scratch: float = 0.2
    max_bindings_per_line: int = 3
    max_mark_delay: int = 1
    marked_zone: tuple[float, float] = (0.05, 0.75)
    n_names: int = 52
    recent_names: int = 12
    scratch_reach: int = 24
    cot: bool = True
    answer_format: str = "boxed"
    n_reuse: int = 0
    reuse_gap: float = 0.27
    final_gap: float = 0.27

    def __post_init__(self):
        if not isinstance(self.cot, bool):  # "False" as a string would be truthy
            raise ValueError(f"cot must be True or False, got {self.cot!r}")
        if not 1 <= self.n_query <= self.n_marked <= 8:
            raise ValueError(f"need 1 <= n_query <= n_marked <= 8, got {self.n_query}, {self.n_marked}")
        if not 0.0 <= self.p_scratch < 1.0:
            raise ValueError(f"p_scratch must be in [0, 1), got {self.p_scratch}")
        if self.max_bindings_per_line < 1 or self.max_mark_delay < 0:
            raise ValueError("max_bindings_per_line must be >= 1 and max_mark_delay >= 0")
        lo, hi = self.marked_zone
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"marked_zone must satisfy 0 <= lo < hi <= 1, got {self.marked_zone}")
        if not self.n_marked + self.recent_names + 4 <= self.n_names <= len(NAMES):
            raise ValueError(f"n_names={self.n_names} leaves too few distractor names")
        if self.scratch_reach < 4:
            raise ValueError(f"scratch_reach must be >= 4, got {self.scratch_reach}")
        if self.answer_format not in ("boxed", "hash"):
            raise ValueError(f"answer_format must be 'boxed' or 'hash', got {self.answer_format!r}")
        body = self.seq_len - 1 - self.question_tokens
        zone_tokens = (hi - lo) * body
        if zone_tokens < self.n_marked * self._marked_spacing:
            raise ValueError(f"seq_len={self.seq_len} is too short for {self.n_marked} marked bindings")
        if body - int(hi * body) < self._after_zone:  # the last marked binding, its delay lines and `keep`
            raise ValueError(f"seq_len={self.seq_len} is too short: the marked zone ends {body - int(hi * body)} "
                             f"tokens before the question, and its last marked binding may need "
                             f"{self._after_zone} (marked_zone={self.marked_zone})")
        if self.n_reuse < 0 or not 0.0 <= self.reuse_gap < 1.0 or not 0.0 <= self.final_gap < 1.0:
            raise ValueError(f"need n_reuse >= 0 and gaps in [0, 1), got {self.n_reuse}, {self.reuse_gap}, "
                             f"{self.final_gap}")
        if self.n_reuse and self._reuse_room < 4 * self.max_line_tokens:
            raise ValueError(f"no room to recall facts: the marked zone ends at {hi:.2f} of the prompt, then "
                             f"reuse_gap {self.reuse_gap} and final_gap {self.final_gap} leave "
                             f"{self._reuse_room} tokens at seq_len={self.seq_len}")

    @property
    def max_line_tokens(self) -> int:
        return max(2 * self.max_bindings_per_line + 1, _SCRATCH_TOKENS)

    @property
    def max_mark_gap(self) -> int:
        """Max positions from a marked value token to the name in its `keep` line.

        A delayed scorer with protected window w >= max_mark_gap has seen the mark before the
        value token becomes eligible for eviction (16 tokens by default).
        """
        rest_of_line = 2 * (self.max_bindings_per_line - 1) + 1
        return rest_of_line + self.max_mark_delay * self.max_line_tokens + 3

    @property
    def question_tokens(self) -> int:
        return 2 + 2 * self.n_query - 1 + 1  # "ask " + names joined by "+" + "\n"

    @property
    def completion_tokens(self) -> int:
        answer = 3  # "\boxed{" d "}" or "####" " " d
        return answer + (3 * self.n_query + 1 + 6 * (self.n_query - 1) if self.cot else 0)

    @property
    def _marked_spacing(self) -> int:
        return self.max_mark_gap + self.max_line_tokens + 1

    @property
    def _after_zone(self) -> int:
        """Tokens a marked binding placed at the end of the zone may still take: the line running over the
        zone's end, its own line, `max_mark_delay` lines and its `keep` line."""
        return (self.max_line_tokens - 1) + self.max_line_tokens * (1 + self.max_mark_delay) + 4

    @property
    def _reuse_room(self) -> int:
        """Tokens between the earliest first restatement of the last fact and the latest restatement."""
        body = self.seq_len - 1 - self.question_tokens
        return int((1.0 - self.final_gap) * self.seq_len) - int(self.marked_zone[1] * body) - int(
            self.reuse_gap * self.seq_len)


DIFFICULTY = {
    "easy": dict(n_query=1, n_marked=2),
    "medium": dict(n_query=2, n_marked=3),
    "hard": dict(n_query=3, n_marked=4, max_mark_delay=2),
}
TASKS = {
    "read_once": dict(),
    # Facts late enough that the first k binding values (an insertion-time FIFO) rarely hold them,
    # reads > B = 25% of the prompt after them, the last read a third of the prompt before the end.
    "reuse": dict(n_reuse=3, marked_zone=(0.26, 0.38), reuse_gap=0.26, final_gap=0.33),
}


def make_config(difficulty: str | None = None, task: str | None = None, **overrides) -> DemoTaskConfig:
    """DemoTaskConfig from a DIFFICULTY preset (default "medium") and a TASKS preset (default
    "read_once") plus field overrides."""
    try:
        return _make_config(difficulty, task, **overrides)
    except ValueError as e:
        # "no room to recall facts" is a too-short length too (reuse, easy: 959-1000 tokens)
        if "seq_len" not in overrides or not any(why in str(e) for why in ("too short", "no room")):
            raise
        shortest = min_seq_len(task, difficulty)
        if overrides["seq_len"] >= shortest:  # other overrides made it too short
            raise
        raise ValueError(f"{e}: the shortest seq_len for task {task or 'read_once'!r}, difficulty "
                         f"{difficulty or 'medium'!r} is {shortest}") from None


def _make_config(difficulty: str | None, task: str | None, **overrides) -> DemoTaskConfig:
    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    if difficulty is not None and difficulty not in DIFFICULTY:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTY)}, got {difficulty!r}")
    return DemoTaskConfig(**{**DIFFICULTY[difficulty or "medium"], **TASKS[task or "read_once"], **overrides})


# ------------------------------------------------------------------------------ generation


@functools.lru_cache(maxsize=None)
def min_seq_len(task: str | None = None, difficulty: str | None = None, *, up_to: int = 8192) -> int:
    """The length from which on every seq_len (up to `up_to`) is valid for this task and
    difficulty (integer rounding makes a few lengths just above the first valid one invalid)."""
    _make_config(difficulty, task)  # a bad task or difficulty is named, not taken for a short length
    last_bad = 0
    for n in range(1, up_to + 1):
        try:
            _make_config(difficulty, task, seq_len=n)
        except ValueError:
            last_bad = n
    if last_bad == up_to:
        raise ValueError(f"no seq_len up to {up_to} works for task {task!r}, difficulty {difficulty!r}")
    return last_bad + 1


SEED_LIMIT = 2**32  # numpy's SeedSequence splits larger ints into 32-bit words: they would alias other splits


def _check_seed_part(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**32), got {value!r}")


def example_seed(seed: int, split: str, index: int) -> tuple[int, int, int]:
    """The entropy of example `index` of `split`: splits never share a seed (seed and index are
    ints in [0, 2**32), so each is one word of the three)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    _check_seed_part("seed", seed)
    _check_seed_part("index", index)
    return (int(seed), SPLITS[split], int(index))


def _check_example_seed(seed) -> None:
    """A Generator, or a tuple of ints in [0, 2**32); a bare int is refused: numpy reads int s as the
    tuple (s, 0, 0), which is `example_seed(s, "train", 0)`, a training problem."""
    if seed is None:
        raise ValueError("seed=None would draw a different trace every call: pass example_seed(seed, split, "
                         "index), a tuple of ints, or an np.random.Generator")
    if isinstance(seed, np.random.Generator):
        return
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        raise ValueError(f"seed={seed!r}: a bare int seed is the train split's example 0 of that seed "
                         f"(example_seed({seed}, 'train', 0)); pass example_seed(seed, split, index) to name the split")
    if not isinstance(seed, (tuple, list)) or not seed:
        raise ValueError(f"seed must be example_seed(seed, split, index), a tuple of ints or an np.random.Generator, "
                         f"got {seed!r}")
    for i, part in enumerate(seed):
        _check_seed_part(f"seed[{i}]", part)


def _answer_atoms(value: int, answer_format: str) -> list[str]:
    return [BOXED, str(value), "}"] if answer_format == "boxed" else [HASHES, " ", str(value)]


def generate_example(seed, *, difficulty: str | None = None, task: str | None = None,
                     config: DemoTaskConfig | None = None, resample: tuple[int, int] | None = None,
                     replan: bool = False, **overrides) -> dict:
    """One trace. `seed`: `example_seed(seed, split, index)` (or another tuple of ints in [0, 2**32)) or
    an np.random.Generator; a bare int is refused (it would be the train split's example 0).

    `resample=(position, future_seed)`: the same trace up to `position`, then a fresh future. Every
    line that starts before token `position` is the trace's own, so its first `position` tokens are
    kept (and up to a line more); every later random choice is drawn from `future_seed`. The plan
    made before `position` stays: which facts the question asks, where the remaining marked
    bindings go, when the facts already made are recalled. A draw of the future given the past (and
    that plan), for `eval.diagnose ceiling`. With `replan`, the parts of the plan the first `position`
    tokens say nothing about are drawn afresh too, from their distribution given those tokens: which
    facts the question asks, the values of the marked bindings still to come, and the recalls still to
    come (each fact's recall spots are independent uniform draws, so those not yet reached are uniform
    between `position` and the end of the fact's range). Still kept: where the remaining marked
    bindings go and which names are marked.

    Returns dict(prompt, answer, text, meta): text = prompt + completion; answer is the
    integer answer as a string. meta holds token positions in the tokenized prompt (<bos> = 0):
      facts: per marked binding, name, value, value_pos, mark_pos (its name in `keep`), queried,
        reuse_pos (the value tokens of its recall lines);
      binding_value_positions: every binding's value token (distractors included);
      determined_positions: the tokens of `text` fixed by their prefix (scratch lookups and
        results, the whole completion). Everything else is random by construction, so weighting
        the LM loss towards these helps a small dense model find the lookups;
      n_prompt_tokens, n_text_tokens, max_mark_gap.
    """
    _check_example_seed(seed)
    if config is not None and (difficulty is not None or task is not None or overrides):
        given = [k for k, v in dict(difficulty=difficulty, task=task).items() if v is not None] + sorted(overrides)
        raise ValueError(f"config= fixes the task already; {given} would be ignored: pass them to make_config "
                         "instead")
    cfg = config or make_config(difficulty, task, **overrides)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    names = [NAMES[i] for i in rng.permutation(cfg.n_names)]
    marked, pool = names[: cfg.n_marked], names[cfg.n_marked :]
    marked_values = [int(v) for v in rng.integers(0, 10, cfg.n_marked)]
    queried = [int(i) for i in rng.choice(cfg.n_marked, cfg.n_query, replace=False)]

    body_len = cfg.seq_len - 1 - cfg.question_tokens

    # Marked value-token targets: sorted, spread over the zone, at least _marked_spacing apart.
    lo, hi = int(cfg.marked_zone[0] * body_len), int(cfg.marked_zone[1] * body_len)
    free = hi - lo - (cfg.n_marked - 1) * cfg._marked_spacing
    targets = lo + np.sort(rng.integers(0, free, cfg.n_marked)) + np.arange(cfg.n_marked) * cfg._marked_spacing

    body: list[str] = []
    recent: deque[tuple[str, int, int]] = deque(maxlen=cfg.recent_names)  # (name, value, value_pos)
    value_positions: list[int] = []
    determined: list[int] = []
    facts = [dict(name=marked[i], value=marked_values[i], value_pos=-1, mark_pos=-1, queried=i in queried,
                  reuse_pos=[]) for i in range(cfg.n_marked)]
    next_marked, pending, delay = 0, None, 0  # pending: index of the marked binding awaiting `keep`
    due: list[tuple[int, int]] = []  # (body position from which a recall may come, fact index)
    last_reuse = int((1.0 - cfg.final_gap) * cfg.seq_len) - 1  # recalls end before this position

    reuse_range: dict[int, tuple[int, int]] = {}  # fact index -> [first, end) of its recall spots

    def schedule_reuse(i: int, value_pos: int) -> None:
        first = value_pos + int(cfg.reuse_gap * cfg.seq_len)
        reuse_range[i] = (first, max(first + 1, last_reuse - 2 * cfg.max_line_tokens))
        spots = np.sort(rng.integers(*reuse_range[i], cfg.n_reuse))
        due.extend((int(p), i) for p in spots)
        due.sort()

    def binding_line(n: int, marked_slot: int | None = None) -> list[str]:
        line = []
        for j in range(n):
            if j == marked_slot:
                facts[next_marked]["value_pos"] = 1 + len(body) + len(line) + 1
                line += [marked[next_marked], str(marked_values[next_marked])]
                schedule_reuse(next_marked, facts[next_marked]["value_pos"]) if cfg.n_reuse else None
                continue
            taken = {name for name, _, _ in recent}
            name = pool[int(rng.integers(len(pool)))]
            while name in taken:
                name = pool[int(rng.integers(len(pool)))]
            value = int(rng.integers(10))
            value_positions.append(1 + len(body) + len(line) + 1)
            recent.append((name, value, value_positions[-1]))
            line += [name, str(value)]
        return line + ["\n"]

    def scratch_line() -> list[str] | None:
        lookup_pos = 1 + len(body) + 2
        reachable = [(n, v) for n, v, p in recent if lookup_pos - p <= cfg.scratch_reach]
        if not reachable:
            return None
        name, value = reachable[int(rng.integers(len(reachable)))]
        operand = int(rng.integers(10))
        op = "+" if rng.random() < 0.5 else "-"
        result = (value + operand) % 10 if op == "+" else (value - operand) % 10
        determined.extend([1 + len(body) + 2, 1 + len(body) + 6])
        return [">", name, str(value), op, str(operand), "=", str(result), "\n"]

    while True:
        if resample is not None and 1 + len(body) >= resample[0]:
            rng = np.random.default_rng(resample[1])  # the closures above read `rng` when called
            if replan:  # redraw what the past does not show: the question, future values, future recalls
                queried = [int(i) for i in rng.choice(cfg.n_marked, cfg.n_query, replace=False)]
                for i in range(next_marked, cfg.n_marked):
                    marked_values[i] = int(rng.integers(0, 10))
                    facts[i]["value"] = marked_values[i]
                for i, f in enumerate(facts):
                    f["queried"] = i in queried
                cut = resample[0]
                due = sorted((p, i) if p < cut else (int(rng.integers(max(cut, reuse_range[i][0]), max(
                    cut + 1, reuse_range[i][1]))), i) for p, i in due)
            resample = None
        remaining = body_len - len(body)
        if pending is not None and delay == 0:
            facts[pending]["mark_pos"] = 1 + len(body) + 2
            line, pending = [KEEP, " ", marked[pending], "\n"], None
        elif pending is None and next_marked < cfg.n_marked and len(body) >= targets[next_marked]:
            n = int(rng.integers(1, cfg.max_bindings_per_line + 1))
            line = binding_line(n, marked_slot=int(rng.integers(n)))
            pending, delay = next_marked, int(rng.integers(0, cfg.max_mark_delay + 1))
            next_marked += 1
        else:
            if pending is not None:
                delay -= 1
            if remaining < cfg.max_line_tokens:
                if pending is not None or next_marked < cfg.n_marked or due:
                    raise AssertionError("marked zone or recall overflow; validation should prevent this")
                break
            if due and due[0][0] <= 1 + len(body) + 2:  # recall a marked fact: `>q4`, a lookup, not a binding
                _, i = due.pop(0)
                facts[i]["reuse_pos"].append(1 + len(body) + 2)
                determined.append(facts[i]["reuse_pos"][-1])  # predictable: the fact's own value
                line = [">", marked[i], str(marked_values[i]), "\n"]
                body += line
                continue
            line = scratch_line() if rng.random() < cfg.p_scratch else None
            if line is None:
                line = binding_line(int(rng.integers(1, cfg.max_bindings_per_line + 1)))
        body += line
    # Close the body at exactly body_len tokens: one short binding line, then blank lines.
    if body_len - len(body) >= 3:
        body += binding_line(min((body_len - len(body) - 1) // 2, cfg.max_bindings_per_line))
    body += ["\n"] * (body_len - len(body))

    question = [ASK, " "]  # built last: `replan` may have drawn another one
    for i, q in enumerate(queried):
        question += ([] if i == 0 else ["+"]) + [marked[q]]
    question.append("\n")
    values = [marked_values[q] for q in queried]
    answer = sum(values) % 10
    completion: list[str] = []
    if cfg.cot:
        for q in queried:  # one line of lookups `>q1>E9`: each name's value, read by the name
            completion += [">", marked[q], str(marked_values[q])]
        completion += ["\n"]
        acc = values[0]
        for v in values[1:]:
            completion += [str(acc), "+", str(v), "=", str((acc + v) % 10), "\n"]
            acc = (acc + v) % 10
    completion += _answer_atoms(answer, cfg.answer_format)

    prompt = "".join(body + question)
    seed_meta = None if isinstance(seed, np.random.Generator) else np.asarray(seed).tolist()
    return dict(
        prompt=prompt,
        answer=str(answer),
        text=prompt + "".join(completion),
        meta=dict(
            seed=seed_meta,
            facts=facts,
            binding_value_positions=sorted(set(value_positions + [f["value_pos"] for f in facts])),
            n_prompt_tokens=1 + len(body) + len(question),
            n_text_tokens=1 + len(body) + len(question) + len(completion),
            determined_positions=determined + list(range(1 + len(body) + len(question),
                                                         1 + len(body) + len(question) + len(completion))),
            max_mark_gap=cfg.max_mark_gap,
        ),
    )


def generate_dataset(n: int, seed: int = 0, split: str = "train", *, start: int = 0, **kw) -> list[dict]:
    """Examples start..start+n-1 of `split`; kw as for generate_example. Each gets an `id`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    for name, value in (("n", n), ("start", start)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    _check_seed_part("seed", seed)
    out = []
    for i in range(start, start + n):
        ex = generate_example(example_seed(seed, split, i), **kw)
        out.append(dict(id=f"{split}-{seed}-{i}", **ex))
    return out


def generate_mixture(n: int, seed: int = 0, split: str = "train", tasks: tuple[str, ...] = ("read_once",),
                     **kw) -> list[dict]:
    """Examples 0..n-1 of `split`, example i of task tasks[i % len(tasks)] (one task: exactly
    `generate_dataset(n, seed, split, task=...)`). Ids name the task when there are several."""
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    if not tasks:
        raise ValueError(f"tasks is empty: name one or more of {sorted(TASKS)}")
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"tasks holds {task!r}; each must be one of {sorted(TASKS)}")
    if len(tasks) == 1:
        return generate_dataset(n, seed, split, task=tasks[0], **kw)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        ex = generate_example(example_seed(seed, split, i), task=task, **kw)
        out.append(dict(id=f"{task}-{split}-{seed}-{i}", **ex))
    return out


def jsonl_record(ex: dict, with_meta: bool = False) -> dict:
    """What write_jsonl keeps of an example: id, prompt, answer, text (and meta if asked)."""
    return {k: ex[k] for k in ("id", "prompt", "answer", "text") + (("meta",) if with_meta else ()) if k in ex}


def write_jsonl(path, examples: Iterable[dict], with_meta: bool = False) -> None:
    """One JSON object per line (`jsonl_record`). Atomic (through a synced PATH.tmp): a run reuses the training
    data or recall rows it finds under PATH, so a crash must not leave a torn file there."""
    with atomic_file(path, "w", tmp=f"{os.fspath(path)}.tmp") as f:
        for ex in examples:
            f.write(json.dumps(jsonl_record(ex, with_meta)) + "\n")


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------- scoring

_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")


def _last_boxed(text: str) -> tuple[int, str | None]:
    start = text.rfind("\\boxed{")
    if start < 0:
        return -1, None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return start, text[i:j]
    return -1, None  # unclosed


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}` (nested braces allowed) or `#### ...` answer in text, stripped."""
    box_at, boxed = _last_boxed(text)
    hashes = list(_HASH_RE.finditer(text))
    hash_at = hashes[-1].start() if hashes else -1
    if box_at < 0 and hash_at < 0:
        return None
    answer = boxed if box_at > hash_at else hashes[-1].group(1)
    return answer.strip()


def canonical_int(text: str) -> str:
    """An integer's text (`[+-]?\\d+`, any Unicode decimal digits: '７' is 7) as str(int(text)) gives it ('+007' ->
    '7', '-0' -> '0'), without int(): a degenerate completion can box more than the 4300 digits int() converts."""
    digits = "".join(str(unicodedata.decimal(c)) for c in text.lstrip("+-")).lstrip("0") or "0"
    return ("-" if text[0] == "-" and digits != "0" else "") + digits


def _normalize(answer: str) -> str:
    answer = answer.strip().strip("$").replace(" ", "")
    return canonical_int(answer) if re.fullmatch(r"[+-]?\d+", answer) else answer


def score(pred_text: str, answer) -> float:
    """1.0 if the extracted answer equals `answer` (integers compared by value), else 0.0 (an empty
    answer matches nothing)."""
    pred = extract_answer(pred_text)
    return float(pred is not None and _normalize(pred) != "" and _normalize(pred) == _normalize(str(answer)))
