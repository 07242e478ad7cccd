"""DMS's learned eviction pattern per layer and KV head (the KVpop paper's App. H, Fig. 8).

For each of `num_sequences` rows of token ids, one forward of the DMS model with its hard
decisions (`dms.dms_layer_attention(return_policy=True)`) gives, per layer and KV head:

- the eviction ratio: the share of the tokens that have left the window at the last query
  (t <= S - 1 - w) that are gone (0 = dense attention, 1 = the sliding window only); the heat
  map shows its median over the rows, as the paper's Fig. 8;
- the occupancy: the entries the head holds after the S tokens (window + kept older tokens),
  which is what the bounded cache stores; its mean over heads is what the DMS variant was
  memory-matched on (`DMSConfig.budget` at the training length), its max what one head takes.

    result = run_dms_patterns("runs/tiny_cpu/dms/export", "data.jsonl", num_sequences=8, seq_len=1024,
                              out_dir="eval_out/dms_patterns")
    result.ratio_median     # float [L, Hkv]
    result.occupancy        # int [N, L, Hkv]

Writes `dms_patterns.md` (settings, occupancy mean / max against the budget, the per-layer x head
median table), `dms_patterns.png` (the heat map) and `dms_patterns.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eval.outputs import holds_out_dir, staged_outputs
from eval.plots import check_counts, load_model, markdown_table, plt, save_figure, timestamp, write_text
from eval.recall import check_rows, load_rows
from kvpop_jax.checkpoint import checkpoint_tokenizer
from kvpop_jax.dms import eviction_stats
from kvpop_jax.modeling import Qwen3ForCausalLM


@dataclasses.dataclass
class DMSPatternsResult:
    """ratio [N, L, Hkv] eviction ratio per row; ratio_median [L, Hkv]; occupancy int [N, L, Hkv]
    entries per head after S tokens; eviction_rate: the share of all decided tokens marked."""

    ratio: np.ndarray
    ratio_median: np.ndarray
    occupancy: np.ndarray
    eviction_rate: float
    settings: dict[str, Any]
    files: dict[str, str]

    @property
    def mean_occupancy(self) -> float:
        return float(self.occupancy.mean())

    @property
    def max_occupancy(self) -> int:
        return int(self.occupancy.max())

    def to_json(self) -> dict[str, Any]:
        return dict(ratio=self.ratio.tolist(), ratio_median=self.ratio_median.tolist(),
                    occupancy=self.occupancy.tolist(), mean_occupancy=self.mean_occupancy,
                    max_occupancy=self.max_occupancy, eviction_rate=self.eviction_rate, settings=self.settings)


@functools.partial(jax.jit, static_argnames=("model",))
def _evictions(model: Qwen3ForCausalLM, params, ids_BxS) -> jax.Array:
    """bool [L, B, Hkv, S]: the hard decision to evict each token (the last one: not yet decided)."""
    out = model.apply({"params": params}, ids_BxS, return_policy=True)
    return jnp.stack([a["evict"] for a in out.aux["layers"]])


@holds_out_dir("dms_patterns.png", "dms_patterns.md", "dms_patterns.json")
def run_dms_patterns(checkpoint, data, *, num_sequences: int = 8, seq_len: int | None = None,
                     out_dir: str | os.PathLike, batch: int = 4, dtype=jnp.float32,
                     rows: str = "stream", text_field: str = "auto") -> DMSPatternsResult:
    """Eviction ratio and occupancy per layer and KV head of a DMS export.

    Args:
      checkpoint: DMS export directory (config.json with "dms") or a `(config, params)` pair.
      data: token ids [N, S] or a dataset `eval.recall.load_rows` reads.
      seq_len: tokens per row (required for a dataset; default: the rows' length).
      batch: rows per forward.
      rows: how a dataset's documents become rows (`eval.recall.load_rows`): "stream" (concatenated,
        cut into rows of seq_len) or "documents" (one row per document, its first seq_len tokens: the
        demo's prompts as they are run).
      text_field: a text dataset's column (`load_rows`; "auto" finds it).
    """
    check_counts(num_sequences=num_sequences, batch=batch, seq_len=1 if seq_len is None else seq_len)
    config, params = load_model(checkpoint, dtype=dtype)
    if config.dms is None:
        raise ValueError("this analysis needs a DMS export (config.json with a 'dms' entry)")
    ids, _ = load_rows(data, seq_len=seq_len, num_sequences=num_sequences,
                       tokenizer=checkpoint_tokenizer(checkpoint), rows=rows, text_field=text_field)
    check_rows(ids, config, asked=num_sequences if isinstance(data, (str, os.PathLike)) else None, rows=rows,
               what="DMS patterns")
    window = config.dms.window
    if ids.shape[1] <= window:
        raise ValueError(f"rows of {ids.shape[1]} tokens never leave the DMS window w = {window}")
    model = Qwen3ForCausalLM(config, dtype=dtype)
    evict = np.concatenate([np.asarray(_evictions(model, params, jnp.asarray(ids[i:i + batch])))
                            for i in range(0, len(ids), batch)], axis=1)  # [L, N, Hkv, S]
    stats = jax.tree.map(np.asarray, eviction_stats(jnp.asarray(evict), window))
    ratio = np.moveaxis(stats["eviction_ratio"], 1, 0)  # [N, L, Hkv]
    occupancy = np.moveaxis(stats["occupancy"], 1, 0)
    s = ids.shape[1]
    settings = dict(date=timestamp(), checkpoint=checkpoint if isinstance(checkpoint, (str, os.PathLike)) else
                    "in-memory", rows=int(len(ids)), row_source=rows, seq_len=int(s), window=window,
                    budget=config.dms.budget, target_eviction=config.dms.target_eviction,
                    num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads)
    result = DMSPatternsResult(ratio=ratio, ratio_median=np.median(ratio, axis=0), occupancy=occupancy,
                               eviction_rate=float(evict[..., :-1].mean()), settings=settings, files={})
    with staged_outputs(out_dir) as out:  # the three files are replaced together or not at all
        plot_eviction_ratio(result.ratio_median, out.path("dms_patterns.png"))
        write_text(out.path("dms_patterns.md"), dms_patterns_markdown(result))
        write_text(out.path("dms_patterns.json"), json.dumps(result.to_json(), indent=1))
        result.files.update(png=out.final("dms_patterns.png"), md=out.final("dms_patterns.md"),
                            json=out.final("dms_patterns.json"))
    return result


def plot_eviction_ratio(ratio_LxH: np.ndarray, path: str) -> str:
    """Layers x KV heads heat map of the median eviction ratio (0 dense, 1 window only)."""
    num_layers, num_heads = ratio_LxH.shape
    fig, ax = plt.subplots(figsize=(max(3.5, 0.45 * num_heads + 2), max(2.2, 0.22 * num_layers + 1.2)))
    im = ax.imshow(ratio_LxH, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(np.arange(num_heads), [str(h) for h in range(num_heads)], fontsize=7)
    ax.set_yticks(np.arange(num_layers), [str(i) for i in range(num_layers)], fontsize=6 if num_layers > 20 else 8)
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title("DMS median eviction ratio (0 dense, 1 window only)", fontsize=9)
    fig.colorbar(im, ax=ax, pad=0.01)
    return save_figure(fig, path, dpi=140)


def dms_patterns_markdown(result: DMSPatternsResult) -> str:
    st = result.settings
    occ = result.occupancy
    lines = [
        "# DMS eviction patterns\n",
        f"{st['date']} · checkpoint `{st['checkpoint']}` · {st['rows']} rows of {st['seq_len']} tokens "
        f"({st.get('row_source', 'stream')}) · window w = {st['window']}, memory {st['budget']} entries per KV "
        f"head, target eviction rate {st['target_eviction']:.3f}\n",
        f"Hard decisions: {result.eviction_rate:.3f} of the decided tokens are marked for eviction. Entries per KV "
        f"head after {st['seq_len']} tokens: mean {result.mean_occupancy:.1f}, max {result.max_occupancy} "
        f"(per row, the mean ranges {occ.mean(axis=(1, 2)).min():.1f}-{occ.mean(axis=(1, 2)).max():.1f}); the "
        f"bounded cache holds {st['num_kv_heads']} x {st['budget']} entries per layer.\n",
        "Median eviction ratio over the rows (0 = dense, 1 = window only; ![heat map](dms_patterns.png)):\n",
        markdown_table(["layer"] + [f"h{h}" for h in range(st["num_kv_heads"])],
                       [[i] + [float(x) for x in row] for i, row in enumerate(result.ratio_median)], digits=2),
        "Mean occupancy per KV head (entries after the last token):\n",
        markdown_table(["layer"] + [f"h{h}" for h in range(st["num_kv_heads"])],
                       [[i] + [float(x) for x in row] for i, row in enumerate(occ.mean(axis=0))], digits=1),
    ]
    return "\n".join(lines)


__all__ = ["DMSPatternsResult", "dms_patterns_markdown", "plot_eviction_ratio", "run_dms_patterns"]
