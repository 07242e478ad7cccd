"""Which tokens a KVpop checkpoint keeps (paper Section 4.3, Fig. 6) and how far back heads reach.

One sequence, one forward pass with `return_policy=True`, and the long-range keep set of
every layer and KV head at the final query position q = S - 1 (`kept_long_range`, the
exact mask the bounded cache reproduces while decoding):

- `patterns.png`: the retention heat map. Rows are layers, columns the last `last_n`
  evictable tokens (t ∈ E(q) = [s, q - w], the newest ones) labelled with their token
  strings, colour = number of KV heads whose long-range slots hold the token.
- `head_usage.png`: per layer and KV head, the mean age q - t of the tokens in its k
  long-range slots, and the share of them from the older half of E(q). A pure recency
  policy keeps ages w .. w + k - 1 (mean w + (k - 1) / 2) and nothing from the older half.
- `patterns.md`: settings, per-layer summary, most/least kept tokens, per-head table.

    result = run_patterns("ckpt/", open("trace.txt").read(), out_dir="eval_out/patterns")
    result.counts       # int [layers, N] heads retaining each of the last N evictable tokens
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from eval.outputs import holds_out_dir, staged_outputs
from eval.plots import load_model, markdown_table, plt, save_figure, timestamp, write_text
from kvpop_jax.checkpoint import checkpoint_tokenizer
from eval.recall import check_rows, memory_note, policy_arrays
from kvpop_jax.kvpop import kept_long_range
from kvpop_jax.modeling import Qwen3ForCausalLM


@dataclasses.dataclass
class PatternsResult:
    """kept: bool [L, Hkv, S] long-range keep set at the final query; counts: int [L, N]
    heads keeping each column token; positions: int [N] the columns' token positions;
    labels: their strings; mean_age, old_share: float [L, Hkv] (NaN where nothing is kept)."""

    kept: np.ndarray
    counts: np.ndarray
    positions: np.ndarray
    labels: list[str]
    mean_age: np.ndarray
    old_share: np.ndarray
    settings: dict[str, Any]
    files: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        nan_to_none = lambda a: [[None if np.isnan(x) else float(x) for x in row] for row in a]  # noqa: E731
        return dict(counts=self.counts.tolist(), positions=self.positions.tolist(), labels=self.labels,
                    mean_age=nan_to_none(self.mean_age), old_share=nan_to_none(self.old_share),
                    settings=self.settings)


def token_label(tokenizer, token_id: int) -> str:
    """A short printable string for an axis tick: the decoded token, newlines/tabs escaped."""
    if tokenizer is None:
        return str(token_id)
    text = tokenizer.decode([int(token_id)])
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text if text.strip() else repr(text)[1:-1] or "␣"


def _tokenize(checkpoint, text_or_ids) -> tuple[np.ndarray, Any]:
    tokenizer = checkpoint_tokenizer(checkpoint)
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("text input needs a checkpoint with a tokenizer; pass token ids instead")
        ids = np.asarray(tokenizer(text_or_ids)["input_ids"], np.int32)
    else:
        ids = np.asarray(text_or_ids).astype(np.int32).reshape(-1)
    return ids, tokenizer


@holds_out_dir("patterns.png", "head_usage.png", "patterns.md", "patterns.json")
def run_patterns(
    checkpoint,
    text_or_ids: str | Sequence[int] | np.ndarray,
    *,
    out_dir: str | os.PathLike,
    last_n: int = 112,
    dtype=jnp.float32,
) -> PatternsResult:
    """Retention heat map and per-head long-range usage of one sequence.

    Args:
      checkpoint: KVpop checkpoint directory (or a `(config, params)` pair).
      text_or_ids: text (tokenized with the checkpoint's tokenizer) or token ids [S].
      out_dir: where patterns.md / patterns.png / head_usage.png / patterns.json go.
      last_n: evictable tokens shown in the heat map (the paper shows 112).
      dtype: parameter and compute dtype (policy quantities are float32 regardless).
    """
    if not isinstance(last_n, (int, np.integer)) or last_n < 1:
        raise ValueError(f"last_n must be an integer >= 1 (evictable tokens in the heat map), got {last_n!r}")
    config, params = load_model(checkpoint, require_kvpop=True, dtype=dtype)
    kv = config.kvpop
    ids, tokenizer = _tokenize(checkpoint, text_or_ids)
    s_len = len(ids)
    q = s_len - 1
    lo_e, hi_e = kv.sinks, q - kv.window  # E(q) = [lo_e, hi_e]
    if hi_e < lo_e:
        raise ValueError(f"a sequence of {s_len} tokens has no evictable token (needs > s + w = "
                         f"{kv.sinks + kv.window} tokens)")
    check_rows(ids[None], config, what="patterns")
    arrays = policy_arrays(Qwen3ForCausalLM(config, dtype=dtype), params, jnp.asarray(ids[None]))
    q_1x1 = jnp.full((1, 1), q, jnp.int32)
    kept = np.stack([np.asarray(kept_long_range(r, c, q_1x1, sinks=kv.sinks, window=kv.window))[0, :, 0]
                     for r, c in zip(arrays["ranks"], arrays["cutoffs"])])  # [L, Hkv, S]

    positions = np.arange(max(lo_e, hi_e - last_n + 1), hi_e + 1)
    counts = kept[:, :, positions].sum(axis=1)  # [L, N]
    labels = [token_label(tokenizer, ids[t]) for t in positions]

    age = (q - np.arange(s_len)).astype(np.float64)
    n_kept = kept.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_age = np.where(n_kept > 0, (kept * age).sum(-1) / n_kept, np.nan)
        older_half = np.arange(s_len) < lo_e + (hi_e - lo_e + 1) / 2
        old_share = np.where(n_kept > 0, (kept & older_half).sum(-1) / n_kept, np.nan)

    settings = dict(
        checkpoint=str(checkpoint) if not isinstance(checkpoint, tuple) else "<in memory>",
        seq_len=s_len, query=q, last_n=len(positions), sinks=kv.sinks, window=kv.window, topk=kv.topk,
        budget=kv.budget, memory=kv.memory(config.head_dim), scorer=kv.scorer, num_kv_heads=config.num_key_value_heads,
        evictable=hi_e - lo_e + 1, saturated=bool(hi_e - lo_e + 1 > kv.topk), date=timestamp(),
    )
    result = PatternsResult(kept=kept, counts=counts, positions=positions, labels=labels, mean_age=mean_age,
                            old_share=old_share, settings=settings, files={})
    with staged_outputs(out_dir) as out:  # the four files are replaced together or not at all
        plot_retention(counts, labels, config.num_key_value_heads, out.path("patterns.png"))
        plot_head_usage(mean_age, old_share, out.path("head_usage.png"))
        result.files.update(png=out.final("patterns.png"), usage_png=out.final("head_usage.png"),
                            md=out.final("patterns.md"), json=out.final("patterns.json"))
        write_text(out.path("patterns.md"), patterns_markdown(result))
        write_text(out.path("patterns.json"), json.dumps(result.to_json(), indent=1))
    return result


# -------------------------------------------------------------------------------- reports


def plot_retention(counts_LxN: np.ndarray, labels: Sequence[str], num_heads: int, path: str) -> str:
    """Layers x tokens heat map, colour = number of KV heads retaining the token."""
    num_layers, n = counts_LxN.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.13 * n + 1.5), max(2.0, 0.22 * num_layers + 1.2)))
    cmap = plt.get_cmap("viridis", num_heads + 1)
    im = ax.imshow(counts_LxN, aspect="auto", cmap=cmap, vmin=-0.5, vmax=num_heads + 0.5, interpolation="nearest")
    ax.set_xticks(np.arange(n), labels, rotation=90, fontsize=6)
    ax.set_yticks(np.arange(num_layers), [str(i) for i in range(num_layers)], fontsize=6 if num_layers > 20 else 8)
    ax.set_ylabel("layer")
    ax.set_title(f"Retention of the last {n} evictable tokens at the final query")
    bar = fig.colorbar(im, ax=ax, ticks=range(0, num_heads + 1, max(1, num_heads // 8)), pad=0.01)
    bar.set_label("KV heads retaining")
    return save_figure(fig, path, dpi=150)


def plot_head_usage(mean_age_LxH: np.ndarray, old_share_LxH: np.ndarray, path: str) -> str:
    """Two layer x head heat maps: mean age of the long-range tokens, share from the older half."""
    num_layers, num_heads = mean_age_LxH.shape
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 0.5 * num_heads * 2 + 3), max(2.5, 0.22 * num_layers + 1.2)))
    for ax, data, title, kw in (
        (axes[0], mean_age_LxH, "mean age q - t of long-range tokens", dict(cmap="magma")),
        (axes[1], old_share_LxH, "share from the older half of E(q)", dict(cmap="magma", vmin=0, vmax=1)),
    ):
        im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", interpolation="nearest", **kw)
        ax.set_xticks(np.arange(num_heads), [str(h) for h in range(num_heads)], fontsize=7)
        ax.set_yticks(np.arange(num_layers), [str(i) for i in range(num_layers)], fontsize=6 if num_layers > 20 else 8)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, pad=0.01)
    return save_figure(fig, path)


def patterns_markdown(result: PatternsResult) -> str:
    st = result.settings
    h = st["num_kv_heads"]
    counts = result.counts
    recency_age = st["window"] + (min(st["topk"], st["evictable"]) - 1) / 2
    lines = [
        "# Eviction patterns\n",
        f"{st['date']} · checkpoint `{st['checkpoint']}` · {st['seq_len']} tokens, final query q = {st['query']} · "
        f"s={st['sinks']}, w={st['window']}, k={st['topk']}: {memory_note(st)}, "
        f"scorer {st['scorer']}, "
        f"{h} KV heads per layer · {st['evictable']} evictable tokens at q\n",
    ]
    if not st["saturated"]:
        lines.append(f"Note: only {st['evictable']} <= k = {st['topk']} tokens are evictable: everything is kept; "
                     "use a longer sequence to see eviction.\n")
    lines.append(f"Heat map: last {st['last_n']} evictable tokens, colour = KV heads retaining "
                 "(![retention](patterns.png)).\n")
    with warnings.catch_warnings():  # a layer whose heads keep nothing: NaN, said as such
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_age = np.nanmean(result.mean_age, axis=1)
        old = np.nanmean(result.old_share, axis=1)
    rows = [[i, float(counts[i].mean()), float((counts[i] > 0).mean()), float((counts[i] == h).mean()),
             float(mean_age[i]), float(old[i])] for i in range(counts.shape[0])]
    lines.append(markdown_table(
        ["layer", f"mean heads retaining (of {h})", "kept by >= 1 head", "kept by all heads",
         "mean age of long-range tokens", "share from older half"], rows))
    lines.append(f"\nA pure recency policy would give mean age {recency_age:.1f} and share 0.\n")
    totals = counts.sum(axis=0)
    order = np.argsort(-totals, kind="stable")
    fmt = lambda j: f"`{result.labels[j]}` @{int(result.positions[j])}: {int(totals[j])}"  # noqa: E731
    lines.append(f"\nMost retained (heads x layers, of {h * counts.shape[0]}): "
                 + ", ".join(fmt(j) for j in order[:10]) + "\n")
    lines.append("Least retained: " + ", ".join(fmt(j) for j in order[::-1][:10]) + "\n")
    lines.append("\n## Long-range usage per KV head (mean age / share from older half)\n")
    lines.append(markdown_table(
        ["layer"] + [f"h{j}" for j in range(h)],
        [[i] + [f"{result.mean_age[i, j]:.1f} / {result.old_share[i, j]:.2f}" for j in range(h)]
         for i in range(counts.shape[0])]))
    lines.append("\n![head usage](head_usage.png)\n")
    return "\n".join(lines)


__all__ = ["PatternsResult", "patterns_markdown", "plot_head_usage", "plot_retention", "run_patterns", "token_label"]
