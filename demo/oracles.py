"""Idealized eviction policies on the demo tasks, without a model: what a policy could recover.

`oracle_recovery` asks, for each policy class, whether the cache it would hold at the end
of the prompt (per-head budget B = s + w + k) still contains every token the answer needs:
StreamingLLM (sinks + window), insertion-time scorers (know which tokens are binding values,
not which are marked) and a delayed scorer (also sees the `keep` mark inside its window).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from demo.atoms import ASK, DIGITS, NAMES



def solve_from_tokens(tokens: Sequence[str], visible: Iterable[int] | None = None) -> str | None:
    """Answers from the visible tokens alone, or None if a queried binding is not visible.

    tokens: the tokenized prompt (<bos> at 0). A binding counts as visible when both its name
    and its value token are; the question (last line) must be visible.
    """
    seen = set(range(len(tokens))) if visible is None else set(visible)
    ask = max((i for i, t in enumerate(tokens) if t == ASK), default=-1)
    if ask < 0 or not all(i in seen for i in range(ask, len(tokens))):
        return None
    wanted = [t for t in tokens[ask + 1 :] if t in NAMES]
    found = {}
    for i in range(len(tokens) - 1):
        if tokens[i] in wanted and tokens[i + 1] in DIGITS and i in seen and i + 1 in seen:
            found[tokens[i]] = int(tokens[i + 1])
    if not all(n in found for n in wanted):
        return None
    return str(sum(found[n] for n in wanted) % 10)


def kept_positions(n_tokens: int, s: int, w: int, k: int, priority: Sequence[float]) -> set[int]:
    """Cache contents after prefilling n_tokens with static priorities (higher kept; ties:
    earlier position), the mask of `kvpop_jax/policy.py`: sinks, the last w positions, and the top-k eligible."""
    eligible = range(s, max(s, n_tokens - w))  # E(q) at q = n_tokens - 1
    top = sorted(eligible, key=lambda t: (-priority[t], t))[:k]
    return set(range(min(s, n_tokens))) | set(range(max(0, n_tokens - w), n_tokens)) | set(top)


def oracle_recovery(example: dict, budget: int, s: int = 4, w: int = 32) -> dict[str, bool]:
    """Whether each idealized policy keeps every queried fact's value token at the end of the
    prompt (in the reuse task too: a recall `>q4` reads the fact, it does not bind it again),
    with a per-head budget B = s + w + k:

    streaming: sinks + recent window only (StreamingLLM).
    insertion_fifo / insertion_lifo: knows which tokens are binding values (the best a scorer
      that decides at insertion can know) but not which are marked; ties go to the earliest /
      the latest (no decay / recency decay).
    delayed: also sees the `keep` mark within its window, so ranks marked values first.
    """
    meta = example["meta"]
    n, k = meta["n_prompt_tokens"], budget - s - w
    if k < 0:
        raise ValueError(f"budget {budget} < s + w = {s + w}")
    needed = [f["value_pos"] for f in meta["facts"] if f["queried"]]
    is_value = np.zeros(n)
    is_value[meta["binding_value_positions"]] = 1.0
    recency = np.arange(n) * 1e-6
    is_marked = is_value.copy()
    is_marked[[f["value_pos"] for f in meta["facts"]]] = 2.0
    kept = dict(
        streaming=kept_positions(n, s, budget - s, 0, is_value),
        insertion_fifo=kept_positions(n, s, w, k, is_value),
        insertion_lifo=kept_positions(n, s, w, k, is_value + recency),
        delayed=kept_positions(n, s, w, k, is_marked),
    )
    return {name: all(p in positions for p in needed) for name, positions in kept.items()}
