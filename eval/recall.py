"""Teacher top-k recall of a KVpop checkpoint (paper Section 4.3, Fig. 7) and token accuracy.

For every layer and KV head: the fraction of the teacher's long-range keep set that the
learned scorer also keeps, at sampled saturated query positions q (s + w + k <= q < S).
The teacher is the policy of the future-attention target (`policy.teacher_boundary`, Eq. 5–6):
ranks of `r_tgt` under the same decay γ, its running top-k cutoff, computed by the model
itself (`aux["layers"][i]["teacher_ranks"/"teacher_cutoffs"]`). At a saturated q both sets
hold exactly k tokens, so recall = |student ∩ teacher| / k, summed over sequences and
queries before dividing (every query weighs the same).

Token accuracy: argmax next-token accuracy of the KVpop model on the data (all positions,
and the positions q >= B where the cache is full and eviction has happened), and, with a
`teacher` checkpoint, the dense teacher's own accuracy and the rate at which the two argmaxes
agree. Passing the KVpop checkpoint itself as teacher compares it with its own weights under
dense attention.

    result = run_recall("ckpt/", "data.jsonl", num_sequences=8, seq_len=8192, num_queries=64,
                        out_dir="eval_out/recall")
    result.recall        # float [layers, kv_heads]
    result.global_mean   # the paper's "global mean recall"

Writes `recall.md` (per-layer mean/min/max over heads, global mean, accuracies, the full
layer x head table), `recall.png` (distribution over heads per layer) and `recall.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from eval.outputs import holds_out_dir, staged_outputs
from eval.plots import check_counts, load_model, markdown_table, plt, save_figure, timestamp, write_text
from kvpop_jax.checkpoint import checkpoint_tokenizer
from kvpop_jax.config import memory_words
from kvpop_jax.documents import (DocumentSpec, checked_rows, columns_and_first, open_dataset, render, text_spec,
                                 tokenize)
from kvpop_jax.kvpop import kept_long_range
from kvpop_jax.modeling import Qwen3ForCausalLM, strip_kvpop

_ID_FIELDS = ("input_ids", "ids", "token_ids", "tokens")


@dataclasses.dataclass
class RecallResult:
    """Everything `run_recall` measured; arrays are numpy.

    recall: float [L, Hkv] per layer and KV head; hits, totals: int [L, Hkv] (|student ∩
    teacher| and |teacher| summed over sequences and queries); query_positions: int
    [N, Nq]; token_accuracy: {"all", "saturated"} of the KVpop model; teacher: None or
    {"accuracy": {...}, "agreement": {...}}; files: name -> path of what was written.
    """

    recall: np.ndarray
    hits: np.ndarray
    totals: np.ndarray
    query_positions: np.ndarray
    token_accuracy: dict[str, float]
    teacher: dict[str, Any] | None
    settings: dict[str, Any]
    files: dict[str, str]

    @property
    def global_mean(self) -> float:
        return float(self.recall.mean())

    def to_json(self) -> dict[str, Any]:
        return dict(
            recall=self.recall.tolist(), hits=self.hits.tolist(), totals=self.totals.tolist(),
            global_mean=self.global_mean, query_positions=self.query_positions.tolist(),
            token_accuracy=self.token_accuracy, teacher=self.teacher, settings=self.settings,
        )


# ------------------------------------------------------------------------------------ data


def _read_jsonl_ids(path: str) -> list[list[int]] | None:
    """Token-id documents from a JSONL (`[ids...]` or `{"input_ids": [...]}` lines); None
    when the first record holds text instead."""
    docs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not valid JSON ({e.msg}): {line.strip()[:80]!r}") from None
            if isinstance(rec, dict):
                field = next((k for k in _ID_FIELDS if k in rec), None)
                rec = rec[field] if field is not None else None
            if isinstance(rec, list) and rec and all(isinstance(x, (int, float)) for x in rec):
                bad = next((x for x in rec if isinstance(x, bool) or not isinstance(x, int)), None)
                if bad is not None:  # numpy/pandas write 1.0; datasets would read such lines as text
                    raise ValueError(f"{path} line {number}: token ids must be JSON integers, got {bad!r} "
                                     "(write them as ints, e.g. ids.astype(int).tolist())")
            if not (isinstance(rec, list) and rec and all(isinstance(x, int) for x in rec)):
                if docs:
                    raise ValueError(f"{path}: a line holds no token ids after lines that did: {line[:80]!r}")
                return None
            docs.append(rec)
    return docs


def check_rows(ids: np.ndarray, config, *, asked: int | None = None, rows: str = "stream", what: str = "the data"):
    """The rows an analysis reads fit the model: token ids inside its vocabulary (ValueError), and a
    warning for rows longer than `max_position_embeddings` (RoPE runs past it, the model never
    trained there) and for fewer rows than `asked`."""
    if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
        raise ValueError(f"{what}: token ids must lie in [0, {config.vocab_size}), got [{ids.min()}, {ids.max()}]")
    if ids.shape[-1] > config.max_position_embeddings:
        print(f"warning: {what}: rows of {ids.shape[-1]} tokens run past the model's max_position_embeddings "
              f"{config.max_position_embeddings}", file=sys.stderr)
    if asked is not None and len(ids) < asked:  # the report says so too; a terminal reader should see it
        print(f"warning: {what}: {len(ids)} rows read, not the {asked} asked for: the data holds no more "
              f"(rows={rows!r}, seq_len={ids.shape[-1]})", file=sys.stderr)


ROWS = ("stream", "documents")
DOCUMENT_SCAN = 100  # rows="documents" reads at most this many documents per row asked for


def load_rows(data, *, seq_len: int | None, num_sequences: int, tokenizer=None,
              text_field: str = "auto", rows: str = "stream") -> tuple[np.ndarray, np.ndarray]:
    """Rows of token ids to evaluate: (ids int32 [N, S], loss_mask float32 [N, S]).

    `data` is an int array [N, S'] (rows, truncated to `seq_len`), a JSONL of token ids, or a
    text dataset `kvpop_jax.documents` reads (JSONL/parquet/hub name, tokenized with the
    checkpoint's tokenizer, EOS-terminated as in training). How documents become rows:
    - rows="stream": concatenated into one stream and cut into rows of `seq_len` (split across
      rows, no attention reset), as the paper packs long-text training rows;
    - rows="documents": one row per document, its first `seq_len` tokens, so every row starts
      where its document starts, as problems are run (the demo's prompts); documents shorter
      than `seq_len` are skipped.
    loss_mask is 1 where the next token belongs to the same document (0 on the last
    column).
    """
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}, got {rows!r}")
    if not isinstance(data, (str, os.PathLike)):
        ids = np.asarray(data)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token-id data must be an int array [N, S], got {ids.dtype} {ids.shape}")
        if seq_len is not None:
            if ids.shape[1] < seq_len:
                raise ValueError(f"rows have {ids.shape[1]} tokens, fewer than seq_len={seq_len}")
            ids = ids[:, :seq_len]
        return _whole_rows(ids[:num_sequences])
    path = os.fspath(data)
    if seq_len is None:
        raise ValueError("seq_len is required when reading rows from a dataset")
    docs = _read_jsonl_ids(path) if path.endswith(".jsonl") and os.path.isfile(path) else None
    if docs is None:
        if tokenizer is None:
            raise ValueError(f"{path} holds text: the checkpoint needs a tokenizer (or pass token ids)")
        docs = _text_documents(DocumentSpec(path, text_field=text_field), tokenizer, num_sequences * seq_len,
                               rows_of=seq_len if rows == "documents" else None, num_rows=num_sequences)
    if not docs:
        raise ValueError(f"{path} holds no documents (an empty file, or no row with text)")
    if rows == "documents":
        long_enough = [np.asarray(d[:seq_len], np.int32) for d in docs if len(d) >= seq_len][:num_sequences]
        if not long_enough:
            raise ValueError(f"{path}: none of the {len(docs)} documents read holds seq_len={seq_len} tokens "
                             f"(longest {max(map(len, docs))}); use rows='stream' or a shorter seq_len")
        return _whole_rows(np.stack(long_enough))
    stream = np.concatenate([np.asarray(d, np.int32) for d in docs])
    segments = np.concatenate([np.full(len(d), i + 1, np.int32) for i, d in enumerate(docs)])
    n = min(num_sequences, len(stream) // seq_len)
    if n < 1:
        raise ValueError(f"{path} holds {len(stream)} tokens, fewer than one row of seq_len={seq_len}")
    ids = stream[: n * seq_len].reshape(n, seq_len)
    seg = segments[: n * seq_len].reshape(n, seq_len)
    mask = np.zeros(ids.shape, np.float32)
    mask[:, :-1] = seg[:, :-1] == seg[:, 1:]
    return ids, mask


def _whole_rows(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, loss_mask) of rows that each hold one document's tokens: 1 but on the last column."""
    mask = np.ones(ids.shape, np.float32)
    mask[:, -1] = 0
    return ids.astype(np.int32), mask


def _text_documents(spec: DocumentSpec, tokenizer, tokens: int, rows_of: int | None = None,
                    num_rows: int = 0) -> list[np.ndarray]:
    """Tokenized documents of a text source, in stored order, until `tokens` tokens are read (with
    `rows_of`: until `num_rows` documents of at least `rows_of` tokens are read, or DOCUMENT_SCAN x
    num_rows documents, so a stream of short documents is not read to its end)."""
    ds = open_dataset(spec)
    text = text_spec(spec, *columns_and_first(spec, ds), rows=ds)
    docs, total, long_enough = [], 0, 0
    for example in checked_rows(spec, ds):
        rendered = render(example, text, tokenizer)
        if rendered is None:  # no text in this row
            continue
        (ids,) = tokenize([rendered], tokenizer, text.chat)
        docs.append(ids)
        if rows_of is None:
            total += len(ids)
            if total >= tokens:
                break
        else:
            long_enough += len(ids) >= rows_of
            if long_enough >= num_rows or len(docs) >= DOCUMENT_SCAN * max(num_rows, 1):
                break
    return docs


def sample_saturated_queries(rng: np.random.Generator, n: int, *, seq_len: int, budget: int, num: int) -> np.ndarray:
    """int32 [n, num'] sorted query positions per row, distinct, uniform in [budget, seq_len);
    num' = min(num, seq_len - budget)."""
    span = seq_len - budget
    if span < 1:
        raise ValueError(
            f"no saturated query position: seq_len={seq_len} must exceed the budget B = s + w + k = {budget}"
        )
    num = min(num, span)
    return np.stack([np.sort(rng.choice(span, size=num, replace=False)) + budget for _ in range(n)]).astype(np.int32)


# ----------------------------------------------------------------------------- measurement


@functools.partial(jax.jit, static_argnames=("model",))
def policy_arrays(model: Qwen3ForCausalLM, params, ids_BxS, q_idx_BxQ=None) -> dict[str, jax.Array]:
    """One KVpop forward with `return_policy`, per-layer arrays stacked on a layer axis.

    Returns scores float32, ranks and cutoffs int32 [L, B, Hkv, S]; log_gamma [L, Hkv];
    argmax int32 [B, S] (the next-token prediction). With `q_idx_BxQ` (int [B, Nq]) also the
    teacher's target, teacher_ranks, teacher_cutoffs [L, B, Hkv, S] and the model's own
    teacher_recall metric (a scalar, over its first 32 queries).
    """
    out = model.apply({"params": params}, ids_BxS, query_samples=q_idx_BxQ, return_policy=True)
    keys = ("scores", "ranks", "cutoffs", "log_gamma")
    if q_idx_BxQ is not None:
        keys += ("target", "teacher_ranks", "teacher_cutoffs")
    arrays = {k: jnp.stack([a[k] for a in out.aux["layers"]]) for k in keys}
    arrays["argmax"] = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
    if q_idx_BxQ is not None:
        arrays["teacher_recall"] = out.aux["metrics"]["teacher_recall"]
    return arrays


@functools.partial(jax.jit, static_argnames=("sinks", "window"))
def recall_counts(ranks, cutoffs, teacher_ranks, teacher_cutoffs, q_idx_BxQ, *, sinks: int, window: int):
    """|student ∩ teacher| and |teacher| long-range keep sets, summed over the queries.

    ranks, cutoffs, teacher_ranks, teacher_cutoffs: int [L, B, Hkv, S]; q_idx_BxQ: int [B, Nq].
    Returns (hits, totals) int32 [L, B, Hkv].
    """
    def one_layer(r, c, tr, tc):
        student = kept_long_range(r, c, q_idx_BxQ, sinks=sinks, window=window)
        teacher = kept_long_range(tr, tc, q_idx_BxQ, sinks=sinks, window=window)
        return (jnp.sum(student & teacher, axis=(2, 3), dtype=jnp.int32),
                jnp.sum(teacher, axis=(2, 3), dtype=jnp.int32))

    return jax.lax.map(lambda xs: one_layer(*xs), (ranks, cutoffs, teacher_ranks, teacher_cutoffs))


@functools.partial(jax.jit, static_argnames=("model",))
def _argmax_batch(model: Qwen3ForCausalLM, params, ids_BxS):
    return jnp.argmax(model.apply({"params": params}, ids_BxS).logits, axis=-1).astype(jnp.int32)


def _accuracies(correct_NxS: np.ndarray, mask_NxS: np.ndarray, budget: int) -> dict[str, float]:
    saturated = mask_NxS.copy()
    saturated[:, :budget] = 0
    acc = lambda m: float((correct_NxS * m).sum() / m.sum()) if m.sum() else float("nan")  # noqa: E731
    return {"all": acc(mask_NxS), "saturated": acc(saturated)}


@holds_out_dir("recall.png", "recall.md", "recall.json")
def run_recall(
    checkpoint,
    data,
    *,
    num_sequences: int = 8,
    seq_len: int | None = None,
    num_queries: int = 64,
    out_dir: str | os.PathLike,
    teacher=None,
    batch_size: int = 1,
    seed: int = 0,
    text_field: str = "auto",
    progress: bool = True,
    dtype=jnp.float32,
    budget: int | None = None,
    rows: str = "stream",
) -> RecallResult:
    """Teacher top-k recall per layer/head and token accuracy of a KVpop checkpoint.

    Args:
      checkpoint: KVpop checkpoint directory (or a `(config, params)` pair).
      data: int array [N, S'], JSONL of token ids, or text data (see `load_rows`).
      num_sequences: rows evaluated (at most).
      seq_len: tokens per row; default 2 x (s + w + k) for datasets (the row length for arrays).
      num_queries: saturated query positions sampled per row (uniform, distinct).
      out_dir: where recall.md / recall.png / recall.json go.
      teacher: optional dense checkpoint directory (or pair) for argmax agreement.
      batch_size: rows per forward pass.
      dtype: parameter and compute dtype (bfloat16 for large models on GPU; policy
        quantities are float32 regardless).
      budget: memory per KV head B to measure at (`KVpopConfig.retarget`: k = B - s - w - the
        scorer's state); default the checkpoint's own. The paper's Fig. 7 reports CR 75%.
      rows: how dataset documents become rows, "stream" or "documents" (see `load_rows`).
    """
    check_counts(num_sequences=num_sequences, num_queries=num_queries, batch_size=batch_size,
                 seq_len=1 if seq_len is None else seq_len, budget=1 if budget is None else budget)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    config, params = load_model(checkpoint, require_kvpop=True, dtype=dtype)
    trained = config.kvpop
    if budget is not None:
        config = dataclasses.replace(config, kvpop=config.kvpop.retarget(budget, config.head_dim))
    kv = config.kvpop
    if kv.topk == 0:
        raise ValueError("recall needs a long-range budget: " + (
            "this checkpoint has topk = 0" if budget is None else
            f"memory B {budget} per KV head leaves it k = 0 (s {kv.sinks} + w {kv.window}"
            + (f" + {state} of scorer state" if (state := kv.memory(config.head_dim) - kv.budget) else "")
            + f"; trained at k {trained.topk}, memory {trained.memory(config.head_dim)})"))
    budget = kv.budget
    tokenizer = checkpoint_tokenizer(checkpoint) if isinstance(data, (str, os.PathLike)) else None
    if seq_len is None and isinstance(data, (str, os.PathLike)):
        seq_len = 2 * budget
    ids, mask = load_rows(data, seq_len=seq_len, num_sequences=num_sequences, tokenizer=tokenizer,
                          text_field=text_field, rows=rows)
    n, s = ids.shape
    check_rows(ids, config, asked=num_sequences, rows=rows, what="recall")
    q_idx = sample_saturated_queries(np.random.default_rng(seed), n, seq_len=s, budget=budget, num=num_queries)

    model = Qwen3ForCausalLM(config, dtype=dtype)
    t_model = t_params = None
    if teacher is not None:
        t_config, t_params = strip_kvpop(*load_model(teacher, dtype=dtype))
        if t_config.vocab_size != config.vocab_size:
            raise ValueError(f"teacher vocab {t_config.vocab_size} != student vocab {config.vocab_size}")
        t_model = Qwen3ForCausalLM(t_config, dtype=dtype)


    hits = np.zeros((config.num_hidden_layers, config.num_key_value_heads), np.int64)
    totals = np.zeros_like(hits)
    preds, t_preds = [], []
    batch_size = min(batch_size, n)
    for lo in tqdm(range(0, n, batch_size), desc="recall", unit="batch", disable=not progress):
        # The last batch is padded with repeats of row 0 (one compiled shape), then dropped.
        picked = np.arange(lo, lo + batch_size)
        picked = np.where(picked < n, picked, 0)
        real = min(batch_size, n - lo)
        q_rows = jnp.asarray(q_idx[picked])
        arrays = policy_arrays(model, params, jnp.asarray(ids[picked]), q_rows)
        h, t = recall_counts(arrays["ranks"], arrays["cutoffs"], arrays["teacher_ranks"], arrays["teacher_cutoffs"],
                             q_rows, sinks=kv.sinks, window=kv.window)
        hits += np.asarray(h)[:, :real].sum(axis=1)
        totals += np.asarray(t)[:, :real].sum(axis=1)
        preds.append(np.asarray(arrays["argmax"])[:real])
        if t_model is not None:
            t_preds.append(np.asarray(_argmax_batch(t_model, t_params, jnp.asarray(ids[picked])))[:real])
    recall = hits / np.maximum(totals, 1)

    pred = np.concatenate(preds)
    targets = np.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    token_accuracy = _accuracies(pred == targets, mask, budget)
    teacher_stats = None
    if t_model is not None:
        t_pred = np.concatenate(t_preds)
        teacher_stats = {"accuracy": _accuracies(t_pred == targets, mask, budget),
                         "agreement": _accuracies(t_pred == pred, mask, budget)}

    settings = dict(
        checkpoint=str(checkpoint) if not isinstance(checkpoint, tuple) else "<in memory>",
        data=str(data) if isinstance(data, (str, os.PathLike)) else f"<array {ids.shape}>",
        teacher=None if teacher is None else (str(teacher) if not isinstance(teacher, tuple) else "<in memory>"),
        num_sequences=n, seq_len=s, rows=rows, num_queries=int(q_idx.shape[1]), seed=seed,
        sinks=kv.sinks, window=kv.window, topk=kv.topk, budget=budget, memory=kv.memory(config.head_dim),
        scorer=kv.scorer, date=timestamp(),
    )
    result = RecallResult(recall=recall, hits=hits, totals=totals, query_positions=q_idx,
                          token_accuracy=token_accuracy, teacher=teacher_stats, settings=settings, files={})
    with staged_outputs(out_dir) as out:  # the three files are replaced together or not at all
        plot_recall(recall, out.path("recall.png"),
                    title=f"Teacher top-k recall (s={kv.sinks}, w={kv.window}, k={kv.topk})")
        result.files.update(png=out.final("recall.png"), md=out.final("recall.md"), json=out.final("recall.json"))
        write_text(out.path("recall.md"), recall_markdown(result))
        write_text(out.path("recall.json"), json.dumps(result.to_json(), indent=1))
    return result


# -------------------------------------------------------------------------------- reports


def plot_recall(recall_LxH: np.ndarray, path: str, title: str = "Teacher top-k recall") -> str:
    """Box plot of the per-head recall of every layer, heads as points, global mean dashed."""
    num_layers, num_heads = recall_LxH.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * num_layers + 2.0), 3.2))
    layers = np.arange(num_layers)
    ax.boxplot(list(recall_LxH), positions=layers, widths=0.6, showfliers=False,
               medianprops=dict(color="tab:orange"))
    jitter = np.random.default_rng(0).uniform(-0.15, 0.15, size=recall_LxH.shape)
    ax.scatter((layers[:, None] + jitter).ravel(), recall_LxH.ravel(), s=8, color="tab:blue", alpha=0.6, zorder=3)
    mean = float(recall_LxH.mean())
    ax.axhline(mean, ls="--", color="gray", lw=1, label=f"global mean {mean:.2f}")
    ax.set_xticks(layers, [str(i) for i in layers], fontsize=7 if num_layers > 20 else 9)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"recall over {num_heads} KV heads")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)


def memory_note(st: dict) -> str:
    """A report's budget in `config.memory_words`' words: "106 slots + 17 of scorer state = memory B 123 per KV
    head" (`--budget` is that B), as `--dry_run`, the recipe and the benches print it."""
    return memory_words(st["budget"], st.get("memory", st["budget"]))


def recall_markdown(result: RecallResult) -> str:
    st = result.settings
    r = result.recall
    lines = [
        "# Teacher top-k recall\n",
        f"{st['date']} · checkpoint `{st['checkpoint']}` · data `{st['data']}` · "
        f"{st['num_sequences']} sequences x {st['seq_len']} tokens · {st['num_queries']} saturated queries per "
        f"sequence (uniform in [s + w + k, S), seed {st['seed']}) · s={st['sinks']}, w={st['window']}, "
        f"k={st['topk']}: {memory_note(st)}, scorer {st['scorer']}\n",
        "Recall = |student ∩ teacher| / |teacher| over the long-range keep sets (the k slots) at each query; "
        "teacher = ranks of the future-attention target under the same decay γ.\n",
        f"**Global mean recall: {result.global_mean:.3f}**\n",
        markdown_table(["layer", "mean", "min", "max"],
                       [[i, float(row.mean()), float(row.min()), float(row.max())] for i, row in enumerate(r)]),
        "\n## Token accuracy (argmax next token)\n",
    ]
    acc_rows = [["KVpop vs data", result.token_accuracy["all"], result.token_accuracy["saturated"]]]
    if result.teacher is not None:
        acc_rows += [["dense teacher vs data", result.teacher["accuracy"]["all"],
                      result.teacher["accuracy"]["saturated"]],
                     ["KVpop agrees with teacher", result.teacher["agreement"]["all"],
                      result.teacher["agreement"]["saturated"]]]
    lines.append(markdown_table(["", "all positions", f"positions >= s + w + k ({st['budget']})"], acc_rows))
    lines.append("\n## Recall per layer and KV head\n")
    lines.append(markdown_table(["layer"] + [f"h{h}" for h in range(r.shape[1])],
                                [[i] + [float(x) for x in row] for i, row in enumerate(r)]))
    lines.append("\n![recall](recall.png)\n")
    return "\n".join(lines)


__all__ = ["RecallResult", "load_rows", "plot_recall", "policy_arrays", "recall_counts", "recall_markdown",
           "run_recall", "sample_saturated_queries"]
