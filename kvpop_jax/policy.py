"""The KVpop retention policy: decay, static priorities, ranks, running top-k cutoffs.

Everything here is a pure function of arrays, batched over any leading dims (usually
`[batch, kv_heads]`); per-token arrays are `[..., S]`. Conventions (every module follows them): at
query q the sinks are `t < s`, the window `q - w < t <= q`, the eligible long-range
set `E(q) = {t : s <= t <= q - w}` and the newly eligible token `t_new = q - w`.
Ranks order tokens best-first by static priority (rank 0 is best; ties go to the
smaller position). The cutoff `τ_q` keeps `t ∈ E(q)` iff `rank(t) <= τ_q`.

k = 0 convention: the "0-th smallest rank" is -1, so `running_kth_rank` is -1 at every
q, and `running_topk_cutoff` follows the general rule literally: `τ_q = S` while E(q)
is empty (|E(q)| <= k) and -1 afterwards. Either way no eligible token is kept.

The public functions are jitted with the budget ints (and γ bounds) static, so they
validate at trace time and eager calls compile once per shape.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvpop_jax import sharding as shd
from kvpop_jax.dispatch import Backend, Op
from pallas_kernels.common import check_budget, check_ranks
from pallas_kernels.topk_cutoff import running_topk_cutoff_pallas


@functools.partial(jax.jit, static_argnames=("gamma_min", "gamma_max"))
def decay_log_gamma(alpha, *, gamma_min: float, gamma_max: float) -> jax.Array:
    """Per-head log-decay from the unconstrained parameter α (Eq. 21).

    `log γ = log γ_min + sigmoid(α) (log γ_max − log γ_min)`, so γ ∈ (γ_min, γ_max).

    Args:
      alpha: float array of any shape (one α per KV head, e.g. [H]).
      gamma_min, gamma_max: Python floats with 0 < gamma_min < gamma_max < 1.

    Returns:
      float32 array of alpha's shape: log γ (negative).
    """
    gamma_min, gamma_max = float(gamma_min), float(gamma_max)
    if not 0.0 < gamma_min < gamma_max < 1.0:
        raise ValueError(f"need 0 < gamma_min < gamma_max < 1, got gamma_min={gamma_min!r}, gamma_max={gamma_max!r}")
    lo, hi = math.log(gamma_min), math.log(gamma_max)
    return lo + jax.nn.sigmoid(jnp.asarray(alpha, jnp.float32)) * (hi - lo)


@jax.jit
def static_priority(scores, log_gamma, positions=None) -> jax.Array:
    """Static priority `p_t = r_t − t·log γ_h` (Eq. 20); higher is better.

    At every query q, `r_t + (q − t) log γ = p_t + q log γ` (Eq. 19), so ranking E(q) by
    effective score (Eq. 5/18, decay step n = 1) equals ranking it by p_t.

    Args:
      scores: float [..., S] raw scores r_t (e.g. [B, H, S]); any float dtype.
      log_gamma: float broadcastable to `scores.shape[:-1]` (scalar, [H] or [B, H]);
        a trailing token axis is added here.
      positions: optional int array broadcastable to scores, the token positions t
        (default 0..S-1). The bounded decode cache scores one token at a time with it,
        through this same function, so its priorities are bit-identical to prefill's.

    Returns:
      float32 [..., S].
    """
    scores = jnp.asarray(scores)
    log_gamma = jnp.asarray(log_gamma, jnp.float32)
    if scores.ndim < 1:
        raise ValueError(f"scores must have shape [..., S], got {scores.shape}")
    try:
        ok = np.broadcast_shapes(log_gamma.shape, scores.shape[:-1]) == scores.shape[:-1]
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"log_gamma of shape {log_gamma.shape} does not broadcast to scores.shape[:-1] = "
            f"{scores.shape[:-1]} (scores {scores.shape})"
        )
    if positions is None:
        t = jnp.arange(scores.shape[-1], dtype=jnp.float32)
    else:
        t = jnp.asarray(positions).astype(jnp.float32)
    return scores.astype(jnp.float32) - t * log_gamma[..., None]


@jax.jit
def token_of_rank(ranks) -> jax.Array:
    """Inverse permutation: int32 [..., S] with `token_of_rank(r)[rank[t]] = t`."""
    ranks = check_ranks(ranks)
    s = ranks.shape[-1]
    flat = ranks.reshape(-1, s)
    rows = jnp.arange(flat.shape[0])[:, None]
    inv = jnp.zeros_like(flat).at[rows, flat].set(jnp.arange(s, dtype=jnp.int32)[None, :])
    return inv.reshape(ranks.shape)


@jax.jit
def ranks_from_priority(priority) -> jax.Array:
    """Rank of every token when sorted by priority best-first; rank 0 is best.

    Ties (including 0.0 vs −0.0) go to the smaller position; NaN priorities rank last.

    Args:
      priority: float [..., S].

    Returns:
      int32 [..., S], a permutation of 0..S−1 along the last axis.
    """
    priority = jnp.asarray(priority, jnp.float32)
    if priority.ndim < 1:
        raise ValueError(f"priority must have shape [..., S], got {priority.shape}")
    pos = lax.broadcasted_iota(jnp.int32, priority.shape, priority.ndim - 1)
    _, order = lax.sort((-priority, pos), dimension=priority.ndim - 1, num_keys=2)
    return token_of_rank(order)  # order is token_of_rank; its inverse is rank


def _eligible_count(seq_len: int, sinks: int, window: int) -> jax.Array:
    """|E(q)| = max(0, q − w − s + 1) for q = 0..S−1, int32 [S]."""
    q = jnp.arange(seq_len, dtype=jnp.int32)
    return jnp.maximum(q - window - sinks + 1, 0)


@functools.partial(jax.jit, static_argnames=("sinks", "window", "topk"))
def running_kth_rank(ranks, *, sinks: int, window: int, topk: int) -> jax.Array:
    """k-th smallest rank in E(q) for every query q (Appendix C.2, Algorithm 2).

    A Fenwick tree over ranks counts the eligible tokens; at each q the one newly
    eligible token `t_new = q − w` is inserted and the k-th smallest rank is found by
    binary lifting: O(S log S) time and O(S) memory per head, as a `lax.scan` over q
    vectorized over the leading dims (never an S×S array).

    Args:
      ranks: int [..., S], a permutation of 0..S−1 per row (not checked).
      sinks, window, topk: Python ints s >= 0, w >= 1, k >= 0 (static under jit).

    Returns:
      int32 [..., S]: the k-th smallest rank in E(q) where |E(q)| >= k, else S (the
      teacher boundary needs it when |E(q)| == k, where the cutoff is already S).
      For k = 0 it is −1 everywhere (no rank is <= −1).
    """
    check_budget(sinks, window, topk)
    ranks = check_ranks(ranks)
    if topk == 0:
        return jnp.full(ranks.shape, -1, jnp.int32)
    s = ranks.shape[-1]
    flat = ranks.reshape(-1, s)
    n = flat.shape[0]
    levels = s.bit_length()  # 2**(levels-1) <= S < 2**levels
    rows = jnp.arange(n)
    q_all = jnp.arange(s, dtype=jnp.int32)
    entering = flat[:, jnp.clip(q_all - window, 0, s - 1)].T  # [S, n]: rank of t_new at q
    counts = _eligible_count(s, sinks, window)

    def step(tree, xs):
        q, new_rank = xs
        add = (q - window >= sinks).astype(jnp.int32)  # t_new ∈ E(q)

        def insert(_, carry):  # add 1 at idx and every Fenwick parent; idx > S is dropped
            tree, idx = carry
            return tree.at[rows, idx].add(add, mode="drop"), idx + (idx & -idx)

        tree, _ = lax.fori_loop(0, levels, insert, (tree, new_rank + 1))  # 1-based

        def lift(i, carry):  # binary lifting: largest pos with prefix count < k
            pos, remaining = carry
            nxt = pos + jnp.left_shift(1, levels - 1 - i)
            val = tree[rows, jnp.minimum(nxt, s)]
            take = (nxt <= s) & (val < remaining)
            return jnp.where(take, nxt, pos), jnp.where(take, remaining - val, remaining)

        start = (jnp.zeros((n,), jnp.int32), jnp.full((n,), topk, jnp.int32))
        pos, _ = lax.fori_loop(0, levels, lift, start)
        return tree, pos  # 1-based index pos + 1 holds rank pos

    tree0 = jnp.zeros((n, s + 1), jnp.int32)
    _, kth = lax.scan(step, tree0, (q_all, entering))  # [S, n]
    kth = jnp.where((counts >= topk)[:, None], kth, s)
    return kth.T.reshape(ranks.shape)


@functools.partial(jax.jit, static_argnames=("sinks", "window", "topk"))
def running_topk_cutoff_reference(ranks, *, sinks: int, window: int, topk: int) -> jax.Array:
    """Cutoff rank τ_q for every query q (Eq. 26) in plain XLA: keep `t ∈ E(q)` iff `rank(t) <= τ_q`.

    `τ_q = S` (keep every eligible token) where |E(q)| <= k, else the k-th smallest
    rank in E(q). Non-increasing in q. For k = 0: S while E(q) is empty, then −1.

    Args:
      ranks: int [..., S]; sinks, window, topk: Python ints s >= 0, w >= 1, k >= 0.

    Returns:
      int32 [..., S].
    """
    kth = running_kth_rank(ranks, sinks=sinks, window=window, topk=topk)
    counts = _eligible_count(kth.shape[-1], sinks, window)
    return jnp.where(counts <= topk, kth.shape[-1], kth)


def _pallas(interpret: bool):
    def run(ranks, *, sinks, window, topk):
        kernel = functools.partial(running_topk_cutoff_pallas, sinks=sinks, window=window, topk=topk,
                                   interpret=interpret)
        return shd.shard_kernel(kernel, ("BHS",), "BHS")(ranks) if jnp.ndim(ranks) == 3 else kernel(ranks)

    return run


RUNNING_TOPK_CUTOFF = Op(
    "running_topk_cutoff", "KVPOP_CUTOFF_IMPL",
    {
        "xla": Backend(running_topk_cutoff_reference),
        "pallas": Backend(_pallas(False), platforms=("gpu",)),
        "pallas_interpret": Backend(_pallas(True)),
    },
    auto=("pallas", "xla"),
)


def running_topk_cutoff(ranks, *, sinks: int, window: int, topk: int, implementation: str | None = None):
    """τ_q on the back end `RUNNING_TOPK_CUTOFF` picks (contract of `running_topk_cutoff_reference`).

    implementation: "xla" (the Fenwick scan), "pallas" (`pallas_kernels.topk_cutoff`) or
    "pallas_interpret". None reads `$KVPOP_CUTOFF_IMPL`, else picks the kernel on GPU and the
    XLA scan elsewhere. Under an active mesh the kernel runs in shard_map over batch and heads.
    """
    return RUNNING_TOPK_CUTOFF(ranks, sinks=sinks, window=window, topk=topk, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("sinks", "window"))
def kvpop_mask(ranks, cutoffs, *, sinks: int, window: int) -> jax.Array:
    """Dense KVpop mask (Eq. 26), a reference for small S.

    `M[q,t] = t<=q ∧ (t<s ∨ q−t<w ∨ (t∈E(q) ∧ rank(t)<=τ_q))`.

    Args:
      ranks, cutoffs: int [..., S] of equal shape.

    Returns:
      bool [..., S, S], indexed [..., q, t].
    """
    check_budget(sinks, window)
    ranks = check_ranks(ranks)
    cutoffs = jnp.asarray(cutoffs)
    if cutoffs.shape != ranks.shape:
        raise ValueError(f"cutoffs shape {cutoffs.shape} must equal ranks shape {ranks.shape}")
    s = ranks.shape[-1]
    q = jnp.arange(s)[:, None]
    t = jnp.arange(s)[None, :]
    eligible = (t >= sinks) & (t <= q - window)
    protected = (t < sinks) | (q - t < window)
    kept = ranks[..., None, :] <= cutoffs[..., :, None]
    return (t <= q) & (protected | (eligible & kept))


class Boundary(NamedTuple):
    """Teacher decision at every query position q; each field is [..., S] indexed by q.

    t_new: int32, the newly eligible token q − w (clipped into [0, S−1]).
    t_bnd: int32, the token t_new must beat: the teacher's k-th best in E(q) \\ {t_new},
      i.e. its k-th best at q − 1 (equal to t_new where not valid).
    y: float32, +1 iff the teacher keeps t_new at q (t_new ∈ E(q), rank <= τ_q), else −1.
    valid: bool, q >= s + w + k and k > 0 (t_new exists and the budget is saturated).
    """

    t_new: jax.Array
    t_bnd: jax.Array
    y: jax.Array
    valid: jax.Array


@functools.partial(jax.jit, static_argnames=("sinks", "window", "topk"))
def kth_rank_from_cutoffs(ranks, cutoffs, *, sinks: int, window: int, topk: int) -> jax.Array:
    """`running_kth_rank` from the running top-k cutoffs of the same ranks, in O(S), without a scan.

    The two differ only where |E(q)| <= k: there τ_q = S, while the k-th smallest rank is S
    for |E(q)| < k and, for |E(q)| = k, the largest rank in E(q) (a running max over keys).

    Args:
      ranks: int [..., S]; cutoffs: int [..., S], `running_topk_cutoff(ranks, ...)` (any back end).

    Returns:
      int32 [..., S], equal to `running_kth_rank(ranks, sinks=..., window=..., topk=...)`.
    """
    check_budget(sinks, window, topk)
    ranks = check_ranks(ranks)
    cutoffs = jnp.asarray(cutoffs, jnp.int32)
    if cutoffs.shape != ranks.shape:
        raise ValueError(f"cutoffs shape {cutoffs.shape} must equal ranks shape {ranks.shape}")
    if topk == 0:
        return jnp.full(ranks.shape, -1, jnp.int32)
    s = ranks.shape[-1]
    counts = _eligible_count(s, sinks, window)
    t = jnp.arange(s)
    running_max = lax.cummax(jnp.where(t >= sinks, ranks, -1), axis=ranks.ndim - 1)  # max rank of [s, t]
    max_eligible = jnp.take(running_max, jnp.clip(t - window, 0, s - 1), axis=-1)  # max rank of E(q)
    return jnp.where(counts < topk, s, jnp.where(counts == topk, max_eligible, cutoffs))


@functools.partial(jax.jit, static_argnames=("sinks", "window", "topk"))
def teacher_boundary(ranks, *, sinks: int, window: int, topk: int, cutoffs=None) -> Boundary:
    """Boundary label and token for the retention loss (Eq. 6–7) from teacher ranks.

    Args:
      ranks: int [..., S], ranks from the target priorities (stop-gradient).
      sinks, window, topk: Python ints s >= 0, w >= 1, k >= 0.
      cutoffs: optional int [..., S], the running top-k cutoffs of `ranks` when the caller
        has them already (`running_topk_cutoff`, any back end): the boundary then costs
        O(S) instead of a second Fenwick scan (`kth_rank_from_cutoffs`).

    Returns:
      Boundary of [..., S] arrays. Where valid, y = +1 iff rank(t_new) < rank(t_bnd),
      and the token the bounded cache evicts at q is the worse of t_new and t_bnd.
    """
    ranks = check_ranks(ranks)
    s = ranks.shape[-1]
    counts = _eligible_count(s, sinks, window)
    if cutoffs is None:
        kth = running_kth_rank(ranks, sinks=sinks, window=window, topk=topk)
        cutoffs = jnp.where(counts <= topk, s, kth)
    else:
        kth = kth_rank_from_cutoffs(ranks, cutoffs, sinks=sinks, window=window, topk=topk)
    kth_prev = jnp.concatenate([jnp.full_like(kth[..., :1], s), kth[..., :-1]], axis=-1)
    q = jnp.arange(s, dtype=jnp.int32)
    t_new = jnp.broadcast_to(jnp.clip(q - window, 0, s - 1), ranks.shape)
    valid = jnp.broadcast_to((q >= sinks + window + topk) & (topk > 0), ranks.shape)
    rank_new = jnp.take_along_axis(ranks, t_new, axis=-1)
    bnd = jnp.take_along_axis(token_of_rank(ranks), jnp.clip(kth_prev, 0, s - 1), axis=-1)
    t_bnd = jnp.where(valid, bnd, t_new)
    kept = (counts > 0) & (rank_new <= cutoffs)
    y = jnp.where(kept, 1.0, -1.0).astype(jnp.float32)
    return Boundary(t_new=t_new, t_bnd=t_bnd, y=y, valid=valid)


@functools.partial(jax.jit, static_argnames=("sinks", "window", "topk"))
def policy_from_scores(scores, log_gamma, *, sinks: int, window: int, topk: int):
    """Scores -> (priority float32 [..., S], ranks int32 [..., S], cutoffs int32 [..., S])."""
    check_budget(sinks, window, topk)
    priority = static_priority(scores, log_gamma)
    ranks = ranks_from_priority(priority)
    cutoffs = running_topk_cutoff(ranks, sinks=sinks, window=window, topk=topk)
    return priority, ranks, cutoffs
