"""Demo-teacher training data: the curriculum's phases and their batches, generated on the fly.

The batch of global step g holds train-split demo-task examples g * MAX_BATCH + r (r < batch),
so every batch is a pure function of (seed, step): a resumed run sees exactly the batches an
uninterrupted one would, and phases never share an example. Each row is one whole trace,
`<bos> prompt completion <eos>`; every trace of a phase has the same length, so nothing is padded.
Ids are the demo tokenizer's (`demo/tokenizer.py`: one token per atom), computed directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from demo import atoms
from demo import task as demo_task
from demo.atoms import VOCAB

MAX_BATCH = 1024  # example index = step * MAX_BATCH + row: phases never share an example
EOS_ID, BOS_ID = VOCAB[atoms.EOS], VOCAB[atoms.BOS]


@dataclasses.dataclass(frozen=True)
class Phase:
    prompt_len: int  # demo-task seq_len: tokens of the prompt, <bos> included
    steps: int
    batch: int
    task: tuple[tuple[str, Any], ...] = ()  # demo-task overrides (e.g. p_scratch, difficulty) for this phase


def _parse_value(text: str):
    if text.lower() in ("true", "false"):  # "False" as a string is truthy
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_curriculum(spec: str, default_batch: int) -> tuple[Phase, ...]:
    """"128:600:32:p_scratch=0.5/difficulty=easy,1024:500:8" -> phases.

    Each phase is LEN:STEPS[:BATCH][:OVERRIDES]; the batch defaults to `default_batch`;
    OVERRIDES are `/`-separated demo-task fields (`eval.demo_task.DemoTaskConfig`, or difficulty).
    """
    phases = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        overrides: tuple = ()
        if len(parts) == 4 or (len(parts) == 3 and "=" in parts[2]):
            overrides = tuple((k.strip(), _parse_value(v.strip()))
                              for k, v in (kv.split("=", 1) for kv in parts.pop().split("/") if kv.strip()))
        if len(parts) not in (2, 3) or not all(x.strip().isdigit() for x in parts):
            raise ValueError(f"curriculum entry {item!r} is not LEN:STEPS[:BATCH][:KEY=VALUE/...]")
        length, steps, *batch = (int(x) for x in parts)
        phases.append(Phase(length, steps, batch[0] if batch else default_batch, overrides))
    return tuple(phases)


def encode(text: str) -> list[int]:
    """<bos> + one id per demo-task atom (the demo tokenizer's encoding, without its overhead)."""
    return [BOS_ID] + [VOCAB.get(a, VOCAB[atoms.UNK]) for a in atoms.atomize(text)]


def drill_row(rng: np.random.Generator, length: int) -> tuple[list[int], np.ndarray]:
    """An arithmetic drill row of `length` ids in the scratch-line format, and its result mask.

    Lines `>a+b=c`, `>a-b=c` (mod 10, as in the task) and `>a/b=c` with c = (a + b) // 2. A
    mod-10 result is independent of either operand alone, so a plain model finds no gradient
    towards it and sits on a plateau; the floor average depends on each operand, teaches the
    model to bring both to `=` and to represent a + b, after which the mod-10 tables follow fast.
    """
    ids, result = [BOS_ID], [False]
    while len(ids) < length:
        a, b = (int(x) for x in rng.integers(10, size=2))
        op = "+-/"[int(rng.integers(3))]
        c = (a + b) % 10 if op == "+" else (a - b) % 10 if op == "-" else (a + b) // 2
        line = encode(f">{a}{op}{b}={c}\n")[1:]
        ids += line
        result += [False] * 5 + [True, False]  # > a op b = c \n
    return ids[:length], np.asarray(result[:length])


def lookup_row(rng: np.random.Generator, length: int) -> tuple[list[int], np.ndarray]:
    """A lookup drill row of `length` ids: binding lines, then scratch lines that read them back.

    2-8 bindings of distinct names (1-3 per line, as in the task), then `>name value op operand
    = result` lines for random earlier names until the row is full; the mask marks each looked-up
    value and result. Every second line is a lookup (the task has a few per hundred tokens), so
    the selection-by-name circuit gets a strong, steady gradient.
    """
    names = [atoms.NAMES[i] for i in rng.permutation(len(atoms.NAMES))[: int(rng.integers(2, 9))]]
    values = {n: int(v) for n, v in zip(names, rng.integers(10, size=len(names)))}
    text, i = "", 0
    while i < len(names):
        k = min(int(rng.integers(1, 4)), len(names) - i)
        text += "".join(f"{n}{values[n]}" for n in names[i : i + k]) + "\n"
        i += k
    ids, weighted = encode(text), [False] * (len(encode(text)))
    while len(ids) < length:
        name = names[int(rng.integers(len(names)))]
        a, b = values[name], int(rng.integers(10))
        op = "+" if rng.random() < 0.5 else "-"
        c = (a + b) % 10 if op == "+" else (a - b) % 10
        ids += encode(f">{name}{a}{op}{b}={c}\n")[1:]
        weighted += [False, False, True, False, False, False, True, False]  # > name a op b = c \n
    return ids[:length], np.asarray(weighted[:length])


def recall_row(rng: np.random.Generator, length: int) -> tuple[list[int], np.ndarray]:
    """A recall drill row: a lookup drill (`lookup_row`) whose every other read is a line
    `name=value`, read at `=` (the reuse task's recall lines until stop 33; they are `>name value`
    lookups now); the mask marks each recalled or looked-up value and each result."""
    names = [atoms.NAMES[i] for i in rng.permutation(len(atoms.NAMES))[: int(rng.integers(2, 9))]]
    values = {n: int(v) for n, v in zip(names, rng.integers(10, size=len(names)))}
    text = "".join(f"{n}{values[n]}\n" for n in names)
    ids = encode(text)
    weighted = [False] * len(ids)
    while len(ids) < length:
        name = names[int(rng.integers(len(names)))]
        if rng.random() < 0.5:
            ids += encode(f"{name}={values[name]}\n")[1:]
            weighted += [False, False, True, False]  # name = value \n
        else:
            a, b = values[name], int(rng.integers(10))
            ids += encode(f">{name}{a}+{b}={(a + b) % 10}\n")[1:]
            weighted += [False, False, True, False, False, False, True, False]
    return ids[:length], np.asarray(weighted[:length])


_NAME_IDS = np.asarray([VOCAB[n] for n in atoms.NAMES])
_DIGIT_IDS = np.asarray([VOCAB[x] for x in atoms.DIGITS])


def park_mask(ids: np.ndarray, n_prompt: int, queries: str = "names") -> np.ndarray:
    """bool [len(ids) - 1]: input positions j (predicting ids[j + 1]) whose attention the parking loss
    keeps off old keys. "names": a prompt binding's name, whose digit is drawn at random, so no lookup
    can predict it. "all": every prompt query but the lookups, the names after `>` (scratch lines,
    the reuse task's recall lines `>q4`) that predict their digit from the name's value."""
    ids = np.asarray(ids)
    cur, nxt = ids[:-1], ids[1:]
    j = np.arange(len(cur))
    lookup = lookup_mask(ids)
    if queries == "all":
        return ~lookup & (j >= 1) & (j < n_prompt)
    if queries != "names":
        raise ValueError(f"park queries must be 'names' or 'all', got {queries!r}")
    return np.isin(cur, _NAME_IDS) & np.isin(nxt, _DIGIT_IDS) & ~lookup & (j < n_prompt)


def lookup_mask(ids: np.ndarray) -> np.ndarray:
    """bool [len(ids) - 1]: input positions j that are a lookup, a name right after `>` (scratch
    lines, recall lines, the completion's lookups), which predicts its digit from the name's value."""
    ids = np.asarray(ids)
    prev = np.concatenate([[BOS_ID], ids[:-2]])
    return np.isin(ids[:-1], _NAME_IDS) & (prev == VOCAB[">"])


def reuse_rows(phase: Phase, task) -> tuple[int, Any]:
    """How many rows of a phase's batch are reuse traces (`reuse=F`: round(F * batch)) and their task
    (the phase's task with the reuse task's fields), or (0, None); ValueError when reuse traces do not
    fit the phase's length."""
    n = round(dict(phase.task).get("reuse", 0.0) * phase.batch)
    return n, (dataclasses.replace(task, **demo_task.TASKS["reuse"]) if n else None)


def make_batch(cfg, step: int) -> dict[str, np.ndarray]:
    """Rows `<bos> prompt completion <eos>` of `cfg.phase_at(step)` (a `train.pretrain.PretrainConfig`);
    input_ids, targets int32, weights float32, completion, park (`park_mask`) and recall (targets that
    are a reuse row's recalled value, `>q4`) and lookup (`lookup_mask`) bool, drill rows none of the
    last four, all [B, T - 1].

    A phase's `drill=F` / `lookup=F` / `recall=F` overrides make the first round(F * batch) rows
    arithmetic (`drill_row`) / lookup (`lookup_row`) / recall (`recall_row`) drills, weighted like
    completions on their answers and never counted as completions; `reuse=F` makes the last
    round(F * batch) task rows the reuse task (`demo.task.TASKS`) instead of the phase's task.
    """
    phase = cfg.phase_at(step)
    task = cfg.task(phase)
    shares = dict(phase.task)
    drills = [(drill_row, round(shares.get("drill", 0.0) * phase.batch)),
              (lookup_row, round(shares.get("lookup", 0.0) * phase.batch)),
              (recall_row, round(shares.get("recall", 0.0) * phase.batch))]
    kinds = [make_row for make_row, n in drills for _ in range(n)]
    n_reuse, reuse_task = reuse_rows(phase, task)
    length = phase.prompt_len + task.completion_tokens + 1
    rows, weights, completion, park, recall, lookup = [], [], [], [], [], []
    for r in range(phase.batch):
        index = step * MAX_BATCH + r
        if r < len(kinds):
            ids, target_weighted = kinds[r](np.random.default_rng((cfg.seed, 3, index)), length)
            is_completion = np.zeros(length - 1, bool)
            target_weighted = target_weighted[1:]
            parked = np.zeros(length - 1, bool)
            is_recall = looked_up = np.zeros(length - 1, bool)
        else:
            row_task = reuse_task if r >= phase.batch - n_reuse else task
            ex = demo_task.generate_example(demo_task.example_seed(cfg.seed, "train", index), config=row_task)
            ids = encode(ex["text"]) + [EOS_ID]
            is_completion = np.arange(1, len(ids)) >= ex["meta"]["n_prompt_tokens"]
            target_weighted = is_completion.copy()
            recalled = [p for f in ex["meta"]["facts"] for p in f["reuse_pos"]]  # reuse rows: its reads
            target_weighted[np.asarray(recalled, int) - 1] = True  # target j predicts token j + 1
            is_recall = np.zeros(len(ids) - 1, bool)
            is_recall[np.asarray(recalled, int) - 1] = True
            parked = park_mask(ids, ex["meta"]["n_prompt_tokens"], cfg.park_queries)
            looked_up = lookup_mask(ids)
        rows.append(ids)
        completion.append(is_completion)
        park.append(parked)
        recall.append(is_recall)
        lookup.append(looked_up)
        weights.append(np.where(target_weighted, cfg.completion_weight, cfg.prompt_weight).astype(np.float32))
    ids = np.asarray(rows, np.int32)
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], weights=np.stack(weights), completion=np.stack(completion),
                park=np.stack(park), recall=np.stack(recall), lookup=np.stack(lookup))


_ID_TO_TOKEN = {i: t for t, i in VOCAB.items()}


def decode(ids) -> str:
    return "".join(_ID_TO_TOKEN.get(int(i), "") for i in ids if int(i) not in (EOS_ID, BOS_ID, VOCAB[atoms.PAD]))
