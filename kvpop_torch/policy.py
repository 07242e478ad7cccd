"""The KVpop policy over a prompt, in torch: ranks, the running top-k, the retained set.

Same conventions as `kvpop_jax/policy.py` (DESIGN.md): at query q the sinks are `t < s`, the
window `q - w < t <= q`, the eligible set `E(q) = {t : s <= t <= q - w}`; ranks order tokens
best-first by static priority, ties to the smaller position; `t ∈ E(q)` is kept iff fewer
than k tokens of E(q) rank better than t (rank(t) <= τ_q).

Instead of the running cutoff τ_q this side computes, per token, the last query that keeps
it: with `p_k(t)` the position of the k-th token `t' >= s` (in position order) that ranks
better than t, t is kept for `t + w <= q <= p_k(t) + w - 1` (E(q) holds k better tokens from
`q = p_k(t) + w` on, and priorities are static, so t never comes back). One [S] vector per
head gives the whole mask, one query block at a time.
"""

from __future__ import annotations

import torch

NEG_INF = -1e30  # priority of an empty or not-yet-scored slot (kvpop_jax's NEG_INF)


def ranks_from_priority(priority: torch.Tensor) -> torch.Tensor:
    """priority float [..., S] -> rank int64 [..., S], rank 0 best, ties to the smaller position."""
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    arange = torch.arange(priority.shape[-1], device=priority.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, arange)


def last_kept_query(ranks: torch.Tensor, *, sinks: int, window: int, topk: int, block: int = 256) -> torch.Tensor:
    """The last query whose long-range top-k keeps token t: int64 [..., S] (see the module docstring).

    `>= S` where no query of the sequence evicts t; `< t + w` (never kept) when k = 0 or t
    is beaten by k earlier tokens. O(S^2 / block) work in blocks of `block` tokens.
    """
    s = ranks.shape[-1]
    candidate = torch.arange(s, device=ranks.device) >= sinks  # t' that can be in some E(q)
    out = []
    for t0 in range(0, s, block):
        better = (ranks[..., None, :] < ranks[..., t0:t0 + block, None]) & candidate  # [..., Tb, S]
        count = torch.cumsum(better.to(torch.int32), dim=-1, dtype=torch.int32)
        out.append((count < topk).sum(dim=-1))  # = p_k(t): count is non-decreasing along t'
    return torch.cat(out, dim=-1) + window - 1


def prefill_mask_block(last_kept: torch.Tensor, q0: int, q1: int, *, sinks: int, window: int) -> torch.Tensor:
    """Rows q0..q1-1 of the KVpop mask (Eq. 26) of a prompt: bool [..., q1 - q0, S]."""
    s = last_kept.shape[-1]
    q = torch.arange(q0, q1, device=last_kept.device)[:, None]
    t = torch.arange(s, device=last_kept.device)[None, :]
    protected = (t < sinks) | (q - t < window)
    long_range = (t >= sinks) & (t + window <= q) & (q <= last_kept[..., None, :])
    return (t <= q) & (protected | long_range)


def prefill_long_range(priority: torch.Tensor, *, sinks: int, window: int, topk: int):
    """The long-range slots after the last query P - 1 of a prompt, laid out as `build_from_prefill` does.

    priority float32 [B, H, P] (not-yet-known ones NEG_INF). Returns (chosen int64 [B, H, n],
    valid bool [B, H, n]) with n = min(k, P): the tokens of the n best ranks among E(P - 1)
    (the others ranked last, by position), in position order; `valid` marks those in E(P - 1).
    None when nothing is eligible.
    """
    p = priority.shape[-1]
    t = torch.arange(p, device=priority.device)
    eligible = (t >= sinks) & (t <= p - 1 - window)
    if topk == 0 or not bool(eligible.any()):
        return None
    masked = torch.where(eligible, priority, torch.tensor(-float("inf"), device=priority.device))
    n = min(topk, p)
    best = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :n]
    chosen = torch.sort(best, dim=-1).values
    return chosen, eligible[chosen]
