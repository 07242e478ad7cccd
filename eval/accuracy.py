"""Pass@1 of dense, training-free baselines and KVpop checkpoints across compression ratios.

Like the paper's Table 1: each problem gets `n_rollouts` sampled completions; pass@1 is the
mean over problems of the fraction of correct rollouts; each method runs at every compression
ratio CR = 1 - B / context_len (B derived per CR: `budget_for`), and is reported absolute and
relative to dense (the teacher), averaged over benchmarks.

Methods (names on the command line):
  dense                      the dense checkpoint with the plain dense cache (once, no CR);
  streaming | tova | h2o     the dense checkpoint with a training-free policy at budget B
                             (`kvpop_jax.baselines`): StreamingLLM with `sinks` sinks, TOVA
                             without sinks or window, H2O 50/50 heavy/recent without sinks;
  anything else              a KVpop-exported checkpoint (kvpop-mlp, kvpop-mlstm,
                             streamingllm+, ...) decoded with its bounded cache. Its (s, w) are
                             kept and B is met by setting k = B - s - w, or, for a k = 0
                             checkpoint (StreamingLLM+), w = B - s. Pass `{cr: path}` as its
                             checkpoint to use a model trained for each CR instead.

Answers: the last `\\boxed{...}` (nested braces) or `#### ...` in the completion
(`eval.demo_task.extract_answer`). With `math_verify` installed, answers are checked with it
(HF's Math-Verify, as the paper); otherwise by normalized string compare (`normalize_answer`):
whitespace, `$`, `\\left`/`\\right`, `\\dfrac`/`\\tfrac`, `\\text{}` and a trailing period are
dropped, and numbers compare by value.

Outputs in out_dir: accuracy.md (table), accuracy.png (bars), accuracy.json (all numbers),
samples.jsonl (every completion with its extracted answer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

try:  # the demo task's extractor: \boxed{...} (nested) and "#### ..."
    from eval.demo_task import extract_answer
except ImportError:  # pragma: no cover - the demo task ships with the repo
    def extract_answer(text: str) -> str | None:
        start = text.rfind("\\boxed{")
        if start < 0:
            return None
        i, depth = start + len("\\boxed{"), 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
        return None

BASELINES = ("streaming", "tova", "h2o")
PROMPT_FIELDS = ("prompt", "problem", "question")
CHAT_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


# ---------------------------------------------------------------------------------- answers


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
    if re.fullmatch(r"[+-]?\d+", a):
        return str(int(a))
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)", a):
        x = float(a)
        return str(int(x)) if x == int(x) else repr(x)
    return a


def _math_verify():
    try:
        from math_verify import parse, verify

        return parse, verify
    except ImportError:
        return None


def is_correct(completion: str, gold: Any) -> tuple[bool, str | None]:
    """(correct, extracted answer) for one completion against the reference answer."""
    pred = extract_answer(completion)
    if pred is None:
        return False, None
    gold = str(gold)
    mv = _math_verify()
    if mv is not None:
        parse, verify = mv
        try:
            if verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")):
                return True, pred
        except Exception:  # noqa: BLE001 - math_verify raises on unparsable input; fall back
            pass
    return normalize_answer(pred) == normalize_answer(gold), pred


# -------------------------------------------------------------------------------- benchmarks


def load_benchmark(source: str, *, split: str = "test", limit: int | None = None) -> list[dict]:
    """Problems as dicts (id, prompt, answer) from a JSONL/JSON file, a local data file
    `datasets` reads (parquet, csv), or a HF hub dataset name (`split`)."""
    if source.endswith((".jsonl", ".json")) and os.path.isfile(source):
        with open(source) as f:
            text = f.read()
        rows = json.loads(text) if source.endswith(".json") and text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        import datasets

        ext = os.path.splitext(source)[1].lstrip(".")
        if os.path.exists(source) and ext in ("parquet", "csv"):
            rows = datasets.load_dataset(ext, data_files=source, split="train")
        else:
            rows = datasets.load_dataset(source, split=split)
        rows = [dict(r) for r in rows]
    problems = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        field = next((f for f in PROMPT_FIELDS if f in row), None)
        if field is None or "answer" not in row:
            raise ValueError(f"{source!r} row {i} needs one of {PROMPT_FIELDS} and 'answer', has {sorted(row)}")
        problems.append(dict(id=str(row.get("id", i)), prompt=row[field], answer=str(row["answer"])))
    if not problems:
        raise ValueError(f"benchmark {source!r} has no problems")
    return problems


def benchmark_name(source: str) -> str:
    return os.path.splitext(os.path.basename(source.rstrip("/")))[0] or source


# ------------------------------------------------------------------------------------ models


def budget_for(compression_ratio: float, context_len: int) -> int:
    """B = round((1 - CR) * context_len) (paper: 16k context, B 4096 / 2048 = CR 75% / 88%)."""
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression ratio must be in [0, 1), got {compression_ratio}")
    return max(1, int(round((1.0 - compression_ratio) * context_len)))


def _strip_kvpop(params: dict) -> dict:
    return {name: ({**sub, "self_attn": {k: v for k, v in sub["self_attn"].items() if k != "kvpop"}}
                   if isinstance(sub, dict) and "self_attn" in sub else sub)
            for name, sub in params.items()}


def retarget_kvpop(kv, budget: int):
    """The checkpoint's KVpopConfig at budget B: k = B - s - w, or w = B - s when k = 0."""
    if kv.topk == 0:
        if budget - kv.sinks < 1:
            raise ValueError(f"budget {budget} leaves no window after {kv.sinks} sinks")
        return dataclasses.replace(kv, window=budget - kv.sinks)
    topk = budget - kv.sinks - kv.window
    if topk < 0:
        raise ValueError(f"budget {budget} < s + w = {kv.sinks} + {kv.window} of the checkpoint")
    return dataclasses.replace(kv, topk=topk)


def method_setup(method: str, checkpoint_config, params, budget: int | None, *, sinks: int, dtype):
    """(model, params, cache spec) for one method at budget B (None for dense)."""
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.modeling import Qwen3ForCausalLM

    config = checkpoint_config
    if method == "dense" or method in BASELINES:
        if config.kvpop is not None:  # run a retrofitted checkpoint's weights densely
            config, params = dataclasses.replace(config, kvpop=None), _strip_kvpop(params)
        if method == "dense":
            return Qwen3ForCausalLM(config, dtype=dtype), params, "dense"
        cfg = BaselineConfig(method, budget, sinks=min(sinks, budget - 1) if method == "streaming" else 0)
        return Qwen3ForCausalLM(config, dtype=dtype), params, cfg
    if config.kvpop is None:
        raise ValueError(f"method {method!r} needs a KVpop checkpoint (config.json with 'kvpop'), got a dense one")
    config = dataclasses.replace(config, kvpop=retarget_kvpop(config.kvpop, budget))
    return Qwen3ForCausalLM(config, dtype=dtype), params, "kvpop"


# ------------------------------------------------------------------------------------ report


def summarize(records: Sequence[dict], benchmarks: Sequence[str]) -> list[dict]:
    """Rows (method, cr, budget, per-benchmark pass@1, abs, rel) from per-problem records.

    A record: method, cr (None for dense), budget, benchmark, id, correct (list of bools).
    abs = mean over benchmarks; rel = abs / dense abs (None without a dense row or at 0).
    """
    keys = []
    for r in records:
        if (r["method"], r["cr"]) not in keys:
            keys.append((r["method"], r["cr"]))
    rows = []
    for method, cr in keys:
        mine = [r for r in records if r["method"] == method and r["cr"] == cr]
        per = {b: float(np.mean([np.mean(r["correct"]) for r in mine if r["benchmark"] == b]))
               for b in benchmarks if any(r["benchmark"] == b for r in mine)}
        rows.append(dict(method=method, cr=cr, budget=mine[0]["budget"], scores=per,
                         abs=float(np.mean(list(per.values())))))
    dense = next((r["abs"] for r in rows if r["method"] == "dense"), None)
    for r in rows:
        r["rel"] = r["abs"] / dense if dense else None
    return rows


def format_table(rows: Sequence[dict], benchmarks: Sequence[str]) -> str:
    head = ["CR", "B", "Method", *benchmarks, "Abs.", "Rel."]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    order = sorted(rows, key=lambda r: (r["cr"] is not None, r["cr"] or 0.0))
    for r in order:
        cr = "—" if r["cr"] is None else f"{r['cr']:.0%}"
        budget = "full" if r["budget"] is None else str(r["budget"])
        cells = [f"{r['scores'][b]:.2f}" if b in r["scores"] else "—" for b in benchmarks]
        rel = "—" if r["rel"] is None else f"{r['rel']:.2f}"
        lines.append("| " + " | ".join([cr, budget, "dense (teacher)" if r["method"] == "dense" else r["method"],
                                          *cells, f"{r['abs']:.2f}", rel]) + " |")
    return "\n".join(lines) + "\n"


def plot_bars(rows: Sequence[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crs = sorted({r["cr"] for r in rows if r["cr"] is not None})
    methods = list(dict.fromkeys(r["method"] for r in rows if r["cr"] is not None))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(crs) * max(1, len(methods))), 3.6))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [next((r["abs"] for r in rows if r["method"] == m and r["cr"] == cr), np.nan) for cr in crs]
        ax.bar(np.arange(len(crs)) + (j - (len(methods) - 1) / 2) * width, vals, width, label=m)
    dense = next((r["abs"] for r in rows if r["method"] == "dense"), None)
    if dense is not None:
        ax.axhline(dense, color="k", linestyle="--", linewidth=1, label="dense (teacher)")
    ax.set_xticks(np.arange(len(crs)), [f"CR {cr:.0%}" for cr in crs])
    ax.set_ylabel("pass@1 (mean over benchmarks)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------- run


def _load_tokenizer(tokenizer, checkpoint: str):
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    path = os.fspath(tokenizer or checkpoint)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer at {path!r} ({e}); pass tokenizer=") from e


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt + CHAT_INSTRUCTION}],
                                                  add_generation_prompt=True, tokenize=True))
    return list(tokenizer(prompt)["input_ids"])


def _checkpoint_for(checkpoints: Mapping[str, Any], method: str, cr) -> str:
    key = "dense" if method in BASELINES else method
    if key not in checkpoints:
        raise ValueError(f"no checkpoint for method {method!r} (looked up {key!r}); have {sorted(checkpoints)}")
    path = checkpoints[key]
    if isinstance(path, Mapping):
        if cr not in path:
            raise ValueError(f"checkpoint map of {method!r} has no entry for CR {cr}: {sorted(path)}")
        path = path[cr]
    return os.fspath(path)


def _problem_groups(encoded: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """Consecutive problem indices in groups of up to `size` with equal prompt length."""
    if size < 1:
        raise ValueError(f"problem_batch must be >= 1, got {size}")
    groups: list[list[int]] = []
    for i, ids in enumerate(encoded):
        if groups and len(groups[-1]) < size and len(encoded[groups[-1][0]]) == len(ids):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def run_accuracy(
    methods: Sequence[str],
    checkpoints: Mapping[str, Any],
    benchmark: str | Sequence[str],
    *,
    n_rollouts: int = 16,
    compression_ratios: Sequence[float] = (0.75, 0.88),
    context_len: int = 16384,
    max_new_tokens: int = 4096,
    sampling=None,
    out_dir: str,
    tokenizer=None,
    sinks: int = 4,
    batch_size: int | None = None,
    limit: int | None = None,
    split: str = "test",
    chat_template: bool = False,
    seed: int = 0,
    dtype=None,
    progress: bool = True,
    problem_batch: int = 1,
) -> list[dict]:
    """Runs every method × CR on every benchmark, writes the report, returns the table rows.

    methods: names (see the module docstring). checkpoints: method -> HF checkpoint dir (or
    {cr: dir}); "dense" serves dense and the training-free baselines. benchmark: one source
    or several (JSONL path, data file or hub name). n_rollouts samples per problem, in
    batches of `batch_size` (default n_rollouts) copies of the prompt; rollout r of problem
    i uses the same seed for every method. context_len defines CR = 1 - B / context_len.
    tokenizer: object or path (default: the tokenizer saved with the first checkpoint).
    chat_template: wrap prompts in the tokenizer's chat template with the \\boxed{}
    instruction. sampling: a SamplingConfig (default: the paper's 0.6 / 0.95 / 20 / 0).
    problem_batch: with n_rollouts = 1, decode up to this many consecutive problems of equal
    prompt length as one batch (ignored with more rollouts: those batch one problem's rollouts) (the demo task's prompts all have the same length); the
    batch starting at problem i uses the key of problem i.
    """
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from kvpop_jax import load_pretrained
    from kvpop_jax.generate import generate
    from kvpop_jax.sampling import SamplingConfig

    sampling = sampling or SamplingConfig()
    dtype = dtype or jnp.float32
    if problem_batch < 1:
        raise ValueError(f"problem_batch must be >= 1, got {problem_batch}")
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("no methods given")
    sources = [benchmark] if isinstance(benchmark, str) else list(benchmark)
    benchmarks = {benchmark_name(s): load_benchmark(s, split=split, limit=limit) for s in sources}
    settings = [(m, None) if m == "dense" else (m, float(cr)) for m in methods
                for cr in ([None] if m == "dense" else compression_ratios)]
    tok = _load_tokenizer(tokenizer, _checkpoint_for(checkpoints, *settings[0]))
    encoded = {b: [_encode(tok, p["prompt"], chat_template) for p in probs] for b, probs in benchmarks.items()}
    batch = batch_size or n_rollouts
    os.makedirs(out_dir, exist_ok=True)

    loaded: dict[str, tuple] = {}
    records: list[dict] = []
    total = len(settings) * sum(len(p) for p in benchmarks.values())
    bar = tqdm(total=total, desc="accuracy", disable=not progress)
    with open(os.path.join(out_dir, "samples.jsonl"), "w") as samples:
        for method, cr in settings:
            path = _checkpoint_for(checkpoints, method, cr)
            if path not in loaded:
                loaded[path] = load_pretrained(path, dtype=dtype)
            config, params = loaded[path]
            budget = None if cr is None else budget_for(cr, context_len)
            model, mparams, cache = method_setup(method, config, params, budget, sinks=sinks, dtype=dtype)
            eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
            eos |= set(config.eos_token_id if isinstance(config.eos_token_id, tuple) else
                       [config.eos_token_id] if config.eos_token_id is not None else [])
            bar.set_postfix(method=method, cr=cr)
            for bench, problems in benchmarks.items():
                for group in _problem_groups(encoded[bench], problem_batch if n_rollouts == 1 else 1):
                    correct = {i: [] for i in group}
                    for start in range(0, n_rollouts, batch):
                        # rows: (problem, rollout); one problem's rollouts, or one rollout of each problem
                        rows = [(i, start + r) for i in group for r in range(min(batch, n_rollouts - start))]
                        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), group[0]), start)
                        tokens, lengths = generate(model, mparams, jnp.asarray([encoded[bench][i] for i, _ in rows]),
                                                   cache=cache, max_new_tokens=max_new_tokens, sampling=sampling,
                                                   eos_ids=tuple(sorted(eos)), rng=key)
                        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
                        for r, (i, rollout) in enumerate(rows):
                            problem = problems[i]
                            text = tok.decode(tokens[r, : lengths[r]].tolist(), skip_special_tokens=True)
                            ok, pred = is_correct(text, problem["answer"])
                            correct[i].append(ok)
                            samples.write(json.dumps(dict(method=method, cr=cr, benchmark=bench, id=problem["id"],
                                                          rollout=rollout, answer=problem["answer"],
                                                          extracted=pred, correct=ok, completion=text)) + "\n")
                    for i in group:
                        records.append(dict(method=method, cr=cr, budget=budget, benchmark=bench,
                                            id=problems[i]["id"], correct=correct[i]))
                    bar.update(len(group))
    bar.close()

    names = list(benchmarks)
    rows = summarize(records, names)
    table = format_table(rows, names)
    checker = "math_verify" if _math_verify() is not None else "normalized string compare"
    with open(os.path.join(out_dir, "accuracy.md"), "w") as f:
        f.write(f"# Accuracy (pass@1 over {n_rollouts} rollouts)\n\n")
        f.write(f"Context length {context_len} (CR = 1 - B / {context_len}); benchmarks: "
                f"{', '.join(f'{b} ({len(p)} problems)' for b, p in benchmarks.items())}; answers checked by "
                f"{checker}; sampling {dataclasses.asdict(sampling)}; max_new_tokens {max_new_tokens}.\n\n")
        f.write(table)
    with open(os.path.join(out_dir, "accuracy.json"), "w") as f:
        json.dump(dict(rows=rows, records=records, context_len=context_len, n_rollouts=n_rollouts,
                       checker=checker), f, indent=1)
    plot_bars(rows, os.path.join(out_dir, "accuracy.png"))
    return rows


def parse_checkpoints(spec: str) -> dict[str, Any]:
    """'dense=/a,kvpop-mlp=/b,kvpop-mlp@0.88=/c' -> {'dense': '/a', 'kvpop-mlp': ...}.

    `name@CR=path` gives a per-CR checkpoint ({cr: path}); plain `name=path` serves every CR.
    """
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise ValueError(f"checkpoint spec {item!r} is not NAME=PATH or NAME@CR=PATH")
        name, path = item.split("=", 1)
        if "@" in name:
            name, cr = name.split("@", 1)
            if isinstance(out.get(name), str):
                raise ValueError(f"{name!r} has both a plain and a per-CR checkpoint")
            out.setdefault(name, {})[float(cr)] = path
        else:
            if name in out:
                raise ValueError(f"{name!r} is given twice")
            out[name] = path
    return out


__all__ = ["budget_for", "extract_answer", "format_table", "is_correct", "load_benchmark", "normalize_answer",
           "parse_checkpoints", "plot_bars", "retarget_kvpop", "run_accuracy", "summarize"]
