"""KVpop flash attention over a compacted key list per query block (second implementation).

Same contract as `kvpop_attention_pallas` (and `kvpop_attention_reference`). The block-skipping
kernel still visits most key blocks, because the k long-range keys are scattered over the
whole prefix. But for a query block [q0, q1] with running top-k cutoffs (τ non-increasing,
ranks a permutation) the long-range keys any of its queries keeps are among

    L(q0, q1) = {t : s <= t <= q1 − w, rank(t) <= max_{q in block} τ_q},

and |L| <= k + (q1 − q0): the k kept at q0 plus at most one newly eligible key per later
query. Gathering that list (positions ascending, computed in XLA outside the kernel) and
visiting only sink blocks, the list, and the window blocks costs O(S · (s + w + k + 2·block))
instead of O(S² / 2).

The list has a static length `min(S, topk + block_q)` (rounded to the key block), so the
caller passes `topk`; inputs that break the bound (cutoffs that are not a running top-k)
fall back, under `lax.cond`, to the block-skipping kernel, so results are exact for every
input. Without `topk` the list holds all of S (exact, no savings).

Backward: dQ uses the same lists; dK/dV reuse the block-skipping dK/dV kernel (keys own the
program there, and key blocks cannot be compacted the same way: a key block's queries are
the union of its keys' lifetimes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import LOG2E, check_int, round_up
from pallas_kernels.sparse_attention import (
    StaticArgs,
    dkdv_call,
    dot_f32,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    prepare_inputs,
    softmax_backward_delta,
    kvpop_attention_pallas,
    softmax_grad_tile,
)


def long_range_key_lists(ranks, cutoffs, *, sinks: int, window: int, block_q: int, length: int):
    """Candidate long-range keys of every query block, compacted.

    Args:
      ranks, cutoffs: int32 [B, H, S] (S a multiple of block_q; padded keys ranked above every
        cutoff, padded queries with cutoff −1).
      length: static list length.

    Returns:
      keys int32 [B, H, S / block_q, length]: positions of L(q0, q1) ascending, then zeros;
      counts int32 [B, H, S / block_q]: |L| (may exceed `length`: the list is then cut).
    """
    b, h, s = ranks.shape
    n_blocks = s // block_q
    max_cut = cutoffs.reshape(b, h, n_blocks, block_q).max(-1)  # [B, H, nQ]
    pos = jnp.arange(s, dtype=jnp.int32)

    def compact(selected):  # bool [S] -> int32 [length]
        slot = jnp.where(selected, jnp.cumsum(selected) - 1, length)
        return jnp.zeros((length,), jnp.int32).at[slot].set(pos, mode="drop")

    def one_block(args):
        last_query, cut = args  # scalar, [B, H]
        selected = (pos >= sinks) & (pos <= last_query - window) & (ranks <= cut[..., None])
        keys = jax.vmap(jax.vmap(compact))(selected)
        return keys, selected.sum(-1, dtype=jnp.int32)

    last_queries = jnp.arange(1, n_blocks + 1, dtype=jnp.int32) * block_q - 1
    keys, counts = lax.map(one_block, (last_queries, jnp.moveaxis(max_cut, 2, 0)))
    return jnp.moveaxis(keys, 0, 2), jnp.moveaxis(counts, 0, 2)


def _masks(q_pos, st: StaticArgs):
    """The three disjoint parts of the KVpop mask, as functions of a key tile."""
    q_ok = (q_pos < st.seq_len)[:, None]

    def sinks(k_pos):
        return q_ok & (k_pos < st.sinks)[None, :] & (k_pos[None, :] <= q_pos[:, None])

    def window(k_pos):
        diff = q_pos[:, None] - k_pos[None, :]
        key_ok = (k_pos >= st.sinks) & (k_pos < st.seq_len)
        return q_ok & key_ok[None, :] & (diff >= 0) & (diff < st.window)

    def long_range(k_pos, ranks, cutoffs, slot_ok):
        diff = q_pos[:, None] - k_pos[None, :]
        keep = (k_pos >= st.sinks)[None, :] & (diff >= st.window) & (ranks[None, :] <= cutoffs[:, None])
        return q_ok & slot_ok[None, :] & keep

    return sinks, window, long_range


def _visit_compacted(q_start, cutoffs, refs, tile_fn, carry, st: StaticArgs):
    """Folds `tile_fn(carry, k, v, mask)` over sink blocks, the compacted list and the window."""
    k_ref, v_ref, ranks_ref, keys_ref, count_ref = refs
    bq, bk = st.block_q, st.block_k
    iota = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq,), 0)
    sink_mask, window_mask, long_range_mask = _masks(q_pos, st)

    def contiguous(mask_fn):
        def body(j, carry):
            k_start = j * bk
            k_pos = k_start + iota
            k = k_ref[pl.ds(k_start, bk), :]
            v = v_ref[pl.ds(k_start, bk), :]
            return tile_fn(carry, k, v, mask_fn(k_pos))

        return body

    if st.sinks:
        num_sink_blocks = min(-(-st.sinks // bk), k_ref.shape[0] // bk)
        carry = lax.fori_loop(0, num_sink_blocks, contiguous(sink_mask), carry)

    count = count_ref[pl.program_id(2)]

    def gathered(c, carry):
        slot = c * bk + iota
        k_pos = keys_ref[pl.ds(c * bk, bk)]
        k = k_ref[k_pos, :]
        v = v_ref[k_pos, :]
        mask = long_range_mask(k_pos, ranks_ref[k_pos], cutoffs, slot < count)
        return tile_fn(carry, k, v, mask)

    carry = lax.fori_loop(0, lax.div(count + bk - 1, bk), gathered, carry)
    first = lax.div(jnp.maximum(q_start - st.window + 1, 0), bk)
    return lax.fori_loop(first, lax.div(q_start + bq - 1, bk) + 1, contiguous(window_mask), carry)


def _forward_kernel(q_ref, k_ref, v_ref, ranks_ref, cut_ref, keys_ref, count_ref, o_ref, lse_ref, *, st):
    q_start = pl.program_id(2) * st.block_q
    q = q_ref[...]

    def tile(carry, k, v, mask):
        return online_softmax_step(carry, q, k, v, mask, st.scale)

    init = online_softmax_init(st.block_q, q.shape[-1])
    refs = (k_ref, v_ref, ranks_ref, keys_ref, count_ref)
    carry = _visit_compacted(q_start, cut_ref[...], refs, tile, init, st)
    online_softmax_finish(carry, o_ref, lse_ref)


def _dq_kernel(q_ref, k_ref, v_ref, ranks_ref, cut_ref, keys_ref, count_ref, do_ref, lse_ref, delta_ref, dq_ref,
               *, st):
    q_start = pl.program_id(2) * st.block_q
    q, do = q_ref[...], do_ref[...]
    lse2 = lse_ref[...] * LOG2E
    delta = delta_ref[...]

    def tile(dq, k, v, mask):
        _, ds = softmax_grad_tile(q, k, v, do, lse2, delta, mask, st.scale)
        return dq + dot_f32(ds.astype(k.dtype), k, 1, 0)

    init = jnp.zeros((st.block_q, q.shape[-1]), jnp.float32)
    refs = (k_ref, v_ref, ranks_ref, keys_ref, count_ref)
    dq = _visit_compacted(q_start, cut_ref[...], refs, tile, init, st)
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _call(kernel, name, st: StaticArgs, q, k, v, ranks, cutoffs, keys, counts, *rows, out_shape):
    """One program per (batch, query head, query block) with the compacted-list inputs."""
    b, s_pad, hq, d = q.shape
    g, bq = st.groups, st.block_q
    q_tile = pl.BlockSpec((None, bq, None, d), lambda i, h, qb: (i, qb, h, 0))
    kv_full = pl.BlockSpec((None, s_pad, None, d), lambda i, h, qb: (i, 0, h // g, 0))
    row_tile = pl.BlockSpec((None, None, bq), lambda i, h, qb: (i, h, qb))
    in_specs = [
        q_tile,
        kv_full,
        kv_full,
        pl.BlockSpec((None, None, s_pad), lambda i, h, qb: (i, h // g, 0)),
        pl.BlockSpec((None, None, bq), lambda i, h, qb: (i, h // g, qb)),
        pl.BlockSpec((None, None, None, keys.shape[-1]), lambda i, h, qb: (i, h // g, qb, 0)),
        pl.BlockSpec((None, None, counts.shape[-1]), lambda i, h, qb: (i, h // g, 0)),
    ]
    in_specs += [q_tile, row_tile, row_tile][: len(rows)]
    out_specs = [q_tile, row_tile] if isinstance(out_shape, list) else q_tile
    return pl.pallas_call(
        functools.partial(kernel, st=st),
        grid=(b, hq, s_pad // bq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=st.compiler_params(),
        interpret=st.interpret,
        name=name,
    )(q, k, v, ranks, cutoffs, keys, counts, *rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _compacted_padded(st: StaticArgs, q, k, v, ranks, cutoffs, keys, counts):
    b, s_pad, hq, _ = q.shape
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, s_pad), jnp.float32)]
    args = (st, q, k, v, ranks, cutoffs, keys, counts)
    return _call(_forward_kernel, "kvpop_compacted_attention_fwd", *args, out_shape=out_shape)


def _compacted_fwd(st, q, k, v, ranks, cutoffs, keys, counts):
    out, lse = _compacted_padded(st, q, k, v, ranks, cutoffs, keys, counts)
    return (out, lse), (q, k, v, ranks, cutoffs, keys, counts, out, lse)


def _compacted_bwd(st, residuals, cotangents):
    q, k, v, ranks, cutoffs, keys, counts, out, lse = residuals
    d_out, d_lse = cotangents
    d_out = d_out.astype(q.dtype)
    delta = softmax_backward_delta(out, d_out, d_lse)
    args = (st, q, k, v, ranks, cutoffs, keys, counts, d_out, lse, delta)
    dq = _call(_dq_kernel, "kvpop_compacted_attention_dq", *args, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype))
    dk, dv = dkdv_call(st, q, k, v, ranks, cutoffs, d_out, lse, delta)
    return dq, dk, dv, None, None, None, None


_compacted_padded.defvjp(_compacted_fwd, _compacted_bwd)


def kvpop_attention_pallas_compacted(q, k, v, ranks, cutoffs, *, sinks: int, window: int, scale: float | None = None,
                                     interpret: bool = False, topk: int | None = None, block_q: int = 64,
                                     block_k: int = 64, block_q_bwd: int = 32, block_k_bwd: int = 32,
                                     num_warps: int | None = None, num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    """`kvpop_attention_pallas` over compacted long-range key lists (same arguments and results).

    topk: the k the cutoffs were computed with; sizes the list to min(S, k + block_q). Inputs
      whose candidate list is longer (cutoffs that are not a running top-k) take the
      block-skipping kernel instead, so the result is exact either way. None: list of length
      S (exact, no savings). block_q/block_k serve the forward and dQ; the *_bwd blocks dK/dV.
    """
    if topk is not None:
        check_int("topk", topk, 0)
    st, padded = prepare_inputs(
        q, k, v, ranks, cutoffs, sinks=sinks, window=window, scale=scale, interpret=interpret,
        blocks=(block_q, block_k, block_q_bwd, block_k_bwd), num_warps=num_warps, num_stages=num_stages,
    )
    qp, kp, vp, ranks_p, cut_p = padded
    s_pad = qp.shape[1]
    length = s_pad if topk is None else min(s_pad, round_up(topk + st.block_q, st.block_k))
    keys, counts = long_range_key_lists(
        ranks_p, cut_p, sinks=st.sinks, window=st.window, block_q=st.block_q, length=length
    )
    s, d = q.shape[1], q.shape[3]

    def compacted(q, k, v):
        out, lse = _compacted_padded(st, q, k, v, ranks_p, cut_p, keys, counts)
        return out[:, :s, :, :d], lse[:, :, :s]

    if length == s_pad:
        return compacted(qp, kp, vp)
    kw = dict(sinks=sinks, window=window, scale=scale, interpret=interpret, block_q=block_q, block_k=block_k,
              block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd, num_warps=num_warps, num_stages=num_stages)
    return lax.cond(
        jnp.any(counts > length),
        lambda: kvpop_attention_pallas(q, k, v, ranks, cutoffs, **kw),
        lambda: compacted(qp, kp, vp),
    )


def compacted_is_cheaper(seq_len: int, *, sinks: int, window: int, topk: int, block_q: int = 64,
                         block_k: int = 64, margin: float = 0.9) -> bool:
    """Static work model for choosing this kernel: does its forward visit fewer key tiles?

    Per query block the compacted kernel visits the sink tiles, the window tiles and the
    `topk + block_q` list (never more than the block's causal tiles); block skipping visits,
    at worst (long-range keys scattered over the prefix, as a decayed top-k keeps them), every
    causal tile. True when the compacted total is below `margin` times the causal total (the
    lists cost an XLA pass of their own). `forward_key_tiles` counts both exactly for given
    ranks and cutoffs.
    """
    n_q, n_k = -(-seq_len // block_q), -(-seq_len // block_k)
    per_block = -(-sinks // block_k) + (window + block_q) // block_k + 1 + -(-(topk + block_q) // block_k)
    causal = [min(((i + 1) * block_q - 1) // block_k + 1, n_k) for i in range(n_q)]
    return sum(min(per_block, c) for c in causal) < margin * sum(causal)


def forward_key_tiles(ranks, cutoffs, *, sinks: int, window: int, block_q: int = 64, block_k: int = 64):
    """Work model of the two forward kernels: (query block, key tile) pairs each one computes.

    ranks, cutoffs: int [B, H, S], S a multiple of both blocks. Returns float32 totals over
    B·H: (causal tiles, tiles the block-skipping kernel visits, tiles the compacted kernel
    visits). Each tile costs 4 · block_q · block_k · D FLOPs per query head.
    """
    b, h, s = ranks.shape
    n_q, n_k = s // block_q, s // block_k
    q_start = jnp.arange(n_q)[:, None] * block_q
    k_start = jnp.arange(n_k)[None, :] * block_k
    q_last, k_last = q_start + block_q - 1, k_start + block_k - 1
    pos = jnp.arange(s).reshape(n_k, block_k)
    best_rank = jnp.where(pos >= sinks, ranks.reshape(b, h, n_k, block_k), 2**30).min(-1)  # [B, H, nK]
    max_cut = cutoffs.reshape(b, h, n_q, block_q).max(-1)  # [B, H, nQ]
    may_keep = best_rank[:, :, None, :] <= max_cut[..., None]
    long_range = (jnp.maximum(k_start, sinks) <= q_last - window) & may_keep
    causal = k_start <= q_last
    skipping = causal & ((k_start < sinks) | (k_last > q_start - window) | long_range)
    _, counts = long_range_key_lists(
        ranks, cutoffs, sinks=sinks, window=window, block_q=block_q, length=block_k
    )
    window_tiles = q_last // block_k - jnp.maximum(q_start - window + 1, 0) // block_k + 1  # [nQ, 1]
    sink_tiles = min(-(-sinks // block_k), n_k)
    compacted = sink_tiles + -(-counts // block_k) + window_tiles[:, 0]
    total = lambda x: jnp.sum(x, dtype=jnp.float32)  # noqa: E731
    return total(jnp.broadcast_to(causal, skipping.shape)), total(skipping), total(compacted)
