"""Running top-k cutoff τ_q (paper Eq. 26, Appendix C.2) as a Pallas kernel for the Triton lowering.

`running_topk_cutoff_pallas` has the contract of `kvpop_jax.policy.running_topk_cutoff_reference`: `τ_q = S` while
`|E(q)| <= k`, else the k-th smallest rank in `E(q) = {t : s <= t <= q − w}` (and −1 from
then on when k = 0).

One program per row (batch × KV head) walks q = 0..S−1 sequentially with only scalar
state, so there is no tree to keep (Triton has no scratch memory and cannot index a
register vector). The state is the largest rank `top` in the kept set K (the k best of
E(q), or all of E(q) while |E(q)| <= k) and |K|. When the newly eligible token t_new
enters:
  * |K| < k: it joins K, `top = max(top, rank)`;
  * rank < top: it replaces `top`, and the new `top` is the largest rank below the old one
    still in E(q) (every eligible rank below `top` is in K, so that is max K). It is found
    by scanning the inverse permutation (token of each rank, computed outside: Triton has
    no scatter) downwards from `top` in blocks; the scan stops at `rank` at the latest.
Once |K| = k, `top` only decreases, so all the downward scans of a row cover the ranks
once: O(S) work per row in total, no S limit, memory O(block).

The per-position inputs are read and the outputs written a block of q at a time; inside a
block the entering rank is picked out of the loaded vector with a masked sum.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import BIG_RANK, check_budget, check_ranks, fit_block, pad_axis, round_up


@dataclasses.dataclass(frozen=True)
class _Static:
    sinks: int
    window: int
    topk: int
    seq_len: int  # S before padding: the sentinel τ = S
    block: int
    num_warps: int
    interpret: bool


def _cutoff_kernel(entering_ref, token_ref, out_ref, *, st: _Static):
    """entering [S_pad]: rank of t_new = q − w if t_new ∈ E(q) else −1; token [S_pad]: token_of_rank."""
    blk = st.block
    iota = lax.broadcasted_iota(jnp.int32, (blk,), 0)

    def previous_eligible_rank(top, q):
        """Largest rank below `top` whose token is in E(q) (one exists: the entering one)."""

        def scan_block(carry):
            block_idx, _ = carry
            start = block_idx * blk
            tokens = token_ref[pl.ds(start, blk)]
            rank = start + iota
            eligible = (tokens >= st.sinks) & (tokens <= q - st.window) & (rank < top)
            return block_idx - 1, jnp.max(jnp.where(eligible, rank, -1))

        # The block index bound only matters for invalid ranks (not a permutation): no hang.
        init = (lax.div(top - 1, blk), jnp.int32(-1))
        _, found = lax.while_loop(lambda c: (c[1] < 0) & (c[0] >= 0), scan_block, init)
        return found

    def block_body(c, carry):
        q_start = c * blk
        entering = entering_ref[pl.ds(q_start, blk)]

        def step(j, carry):
            top, size, taus = carry
            q = q_start + j
            rank = jnp.sum(jnp.where(iota == j, entering, 0))
            enters = rank >= 0
            grow = enters & (size < st.topk)
            top = jnp.where(grow, jnp.maximum(top, rank), top)
            size = size + grow.astype(jnp.int32)
            replace = enters & jnp.logical_not(grow) & (rank < top)  # never for k = 0 (top = −1)
            top = lax.cond(replace, previous_eligible_rank, lambda top, q: top, top, q)
            num_eligible = jnp.maximum(q - st.window - st.sinks + 1, 0)
            tau = jnp.where(num_eligible <= st.topk, st.seq_len, top)
            return top, size, jnp.where(iota == j, tau, taus)

        top, size, taus = lax.fori_loop(0, blk, step, (*carry, jnp.zeros((blk,), jnp.int32)))
        out_ref[pl.ds(q_start, blk)] = taus
        return top, size

    num_blocks = out_ref.shape[0] // blk
    lax.fori_loop(0, num_blocks, block_body, (jnp.int32(-1), jnp.int32(0)))


def _topk_cutoff_padded(st: _Static, entering, tokens):
    n, s_pad = entering.shape
    row = pl.BlockSpec((None, s_pad), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_cutoff_kernel, st=st),
        grid=(n,),
        in_specs=[row, row],
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct((n, s_pad), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=st.num_warps, num_stages=1),
        interpret=st.interpret,
        name="kvpop_topk_cutoff",
    )(entering, tokens)


def running_topk_cutoff_pallas(ranks, *, sinks: int, window: int, topk: int, interpret: bool = False,
                               block: int = 64, num_warps: int = 1) -> jax.Array:
    """Cutoff rank τ_q for every query q by the Pallas kernel; contract of `running_topk_cutoff_reference`.

    Args:
      ranks: int [..., S], a permutation of 0..S−1 per row (e.g. [B, Hkv, S]).
      sinks, window, topk: Python ints s >= 0, w >= 1, k >= 0.
      interpret: run in Pallas interpret mode (CPU tests).
      block: positions read/written per step and ranks per scan step; a power of 2 >= 16.
      num_warps: Triton warps per row (the walk is sequential; one warp suffices).

    Returns:
      int32 [..., S]: S where |E(q)| <= k, else the k-th smallest rank in E(q) (−1 for k = 0).
    """
    check_budget(sinks, window, topk)
    ranks = check_ranks(ranks)
    shape, s = ranks.shape, ranks.shape[-1]
    blk = fit_block(block, s)
    s_pad = round_up(s, blk)
    st = _Static(int(sinks), int(window), int(topk), s, blk, int(num_warps), bool(interpret))
    flat = ranks.reshape(-1, s)
    # entering[q] = rank(q − w) where t_new = q − w is eligible (>= s), else −1: a shift, no gather.
    shifted = jnp.pad(flat, ((0, 0), (window, 0)), constant_values=-1)[:, :s]
    q = jnp.arange(s, dtype=jnp.int32)
    entering = jnp.where(q - window >= sinks, shifted, -1)
    entering = pad_axis(entering, 1, s_pad, -1)
    rows = jnp.arange(flat.shape[0])[:, None]
    token_of_rank = jnp.zeros_like(flat).at[rows, flat].set(q[None, :])  # inverse permutation
    tokens = pad_axis(token_of_rank, 1, s_pad, BIG_RANK)
    out = _topk_cutoff_padded(st, entering, tokens)
    return out[:, :s].reshape(shape)
