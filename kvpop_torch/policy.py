"""The KVpop policy over a prompt, in torch: ranks, the running top-k, the retained set.

Same conventions as `kvpop_jax/policy.py`: at query q the sinks are `t < s`, the
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


def long_range_steps(lr_pos, lr_prio, cand_pos, cand_prio, *, topk: int, block: int = 256):
    """The long-range slots through L decode steps at once, as L calls of the one-step rule
    (`KVpopLayer._admit`) leave them: at step i the token leaving the window (a candidate) takes an empty
    slot (the first), else replaces the worst (lowest priority, ties: the later position) iff its priority
    is strictly higher.

    lr_pos int64 [B, H, K] (-1 empty), lr_prio float32 [B, H, K]: the K = topk slots before step 0;
    cand_pos int64 [B, H, L] (-1: no candidate at step i), cand_prio float32 [B, H, L]. Candidates come
    in position order, after every slot's token.

    Returns (lr_leave [B, H, K], cand_leave [B, H, L], source [B, H, K]), all int64: the step from which
    the cache no longer holds a slot's / candidate's token (L: not within the L steps; a candidate
    not admitted: its own step), and each slot's token after step L - 1 (j < K: the slot's own, K + i:
    candidate i, -1: empty).

    Why it is parallel: priorities are static, so after step i the slots hold the top k of the slots'
    tokens and candidates 0..i (best first by priority, ties to the smaller position), and a token
    leaves at the first step by which k better ones have come (`last_kept_query`'s argument). Which slot
    a candidate takes: the first E admitted fill the E empty slots in order (while one is empty, every
    candidate is admitted), every later one the slot of the token it evicts, a chain resolved by
    pointer doubling. O((K + L) L / block) work in blocks of `block` tokens.
    """
    b, h, k = lr_pos.shape
    n = cand_pos.shape[-1]
    dev = lr_pos.device
    pos, prio = torch.cat([lr_pos, cand_pos], -1), torch.cat([lr_prio, cand_prio], -1).float()  # [B, H, M]
    valid = pos >= 0
    arrival = torch.cat([torch.full((k,), -1, device=dev), torch.arange(n, device=dev)])  # [M]
    reach = []  # per token, the first step by which k better tokens have come (n: none within the steps)
    for a0 in range(0, k + n, block):
        p_a, x_a = prio[..., a0:a0 + block, None], pos[..., a0:a0 + block, None]
        better = valid[..., None, :] & ((prio[..., None, :] > p_a) | ((prio[..., None, :] == p_a) &
                                                                     (pos[..., None, :] < x_a)))  # [B, H, Mb, M]
        before = better[..., :k].sum(-1, dtype=torch.int32)  # better slot tokens: there from the start
        count = before[..., None] + torch.cumsum(better[..., k:].to(torch.int32), dim=-1, dtype=torch.int32)
        reach.append((count < topk).sum(-1))
    leave = torch.maximum(torch.cat(reach, -1), arrival)  # a candidate k better ones precede is not admitted
    leave = torch.where(valid, leave, n)
    admitted = valid & (leave > arrival)
    # Slots: an initial token is its own slot's root; the j-th admitted candidate (j < E) the j-th empty slot;
    # any later admitted candidate points to the token that leaves at its step (exactly one does).
    empty = lr_pos < 0
    empty_slots = torch.sort(torch.where(empty, torch.arange(k, device=dev), k), dim=-1).values  # [B, H, K]
    order = torch.cumsum(admitted[..., k:].long(), -1) - 1  # [B, H, L]: rank among admitted candidates
    fills = admitted[..., k:] & (order < empty.sum(-1, keepdim=True))
    fill_slot = torch.gather(empty_slots, -1, order.clamp(0, max(k - 1, 0)))
    victim = torch.full((b, h, n + 1), -1, dtype=torch.long, device=dev)  # step -> the token that leaves then
    leaving = valid & (leave < n) & (leave > arrival)
    victim.scatter_(-1, torch.where(leaving, leave, n), torch.where(leaving, torch.arange(k + n, device=dev), -1))
    entry = torch.arange(k + n, device=dev).expand(b, h, -1)
    ptr = torch.cat([entry[..., :k], torch.where(fills, entry[..., k:], victim[..., :n].clamp(min=0))], -1)
    root_slot = torch.cat([torch.arange(k, device=dev).expand(b, h, -1), fill_slot], -1)
    for _ in range(max(1, (k + n).bit_length())):
        ptr = torch.gather(ptr, -1, ptr)
    slot = torch.gather(root_slot, -1, ptr)  # [B, H, M]: the slot each admitted token takes
    kept = admitted & (leave == n)
    source = torch.full((b, h, k + 1), -1, dtype=torch.long, device=dev)
    source.scatter_(-1, torch.where(kept, slot, k), torch.where(kept, entry, -1))
    return leave[..., :k], leave[..., k:], source[..., :k]
