"""KVpop-masked attention over gathered key lists, in plain XLA: O(S · (B + 2·block)) work.

The blockwise reference (`attention.kvpop_attention_reference`) scores every query block
against all S keys and masks, so it costs what dense attention costs. But a query block
[q0, q1] keeps keys from three places only (the mask of `policy.py`'s docstring):

  sinks       t < s                                   s keys, the same for every block
  window      q0 − w < t <= q1                        w + block − 1 contiguous keys
  long range  s <= t <= q1 − w, rank(t) <= max τ       at most k + block keys for a running top-k

(the long-range list is `pallas_kernels.compacted_attention.long_range_key_lists`: the k
kept at q0 plus at most one newly eligible key per later query). Each block gathers those
~s + w + k + 2·block keys and attends over them only, with the exact mask evaluated on
the gathered positions (the three parts' masks are disjoint, so a key that sits in two
lists is counted once). This is the path of CPU and TPU users and the GPU fallback.

Forward and backward are a `jax.custom_vjp`: the forward keeps only (out, lse); the
backward recomputes each block's probabilities from the LSE (flash-attention style),
and scatter-adds the gathered keys' dK/dV back (sinks and window by slices, the list by
a scatter). Cheaper on CPU than autodiff through the gathers (measured: BENCHMARKS.md).

The list has the static length `min(S, topk + block)`. Inputs that break the bound
(cutoffs that are not a running top-k) take the reference under `lax.cond`, as the
compacted Pallas kernel does, so the result is exact for every input.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import BIG_RANK, NEG_INF, check_attention_args, pad_axis, round_up
from pallas_kernels.compacted_attention import long_range_key_lists

GATHERED_BLOCK_Q = 64  # queries per block: larger blocks cost 2·block extra keys per query, smaller ones more loop steps


@dataclasses.dataclass(frozen=True)
class _Static:
    """What is static about one call (the custom VJP's non-differentiable argument)."""

    scale: float
    sinks: int  # sink keys gathered: min(s, S_pad)
    sinks_mask: int  # s as the mask reads it
    window: int
    block_q: int
    window_len: int  # keys of the window part: min(w + block − 1, S_pad)
    list_len: int  # keys of the long-range part


def _block_keys(st: _Static, start, kh, keys_blk):
    """The keys of the block at `start`: [B, H, s + window_len + list_len, D] and their positions.

    kh: [B, H, S_pad, D]; keys_blk: int32 [B, H, list_len] long-range positions.
    Returns (gathered [B, H, N, D], window start int32 []).
    """
    s_pad = kh.shape[2]
    w_start = jnp.clip(start - st.window + 1, 0, s_pad - st.window_len)
    parts = [kh[:, :, : st.sinks]] if st.sinks else []
    parts.append(lax.dynamic_slice_in_dim(kh, w_start, st.window_len, axis=2))
    parts.append(jnp.take_along_axis(kh, keys_blk[..., None], axis=2, mode="clip"))
    return jnp.concatenate(parts, axis=2), w_start


def _block_mask(st: _Static, start, w_start, keys_blk, count_blk, ranks, cut_blk):
    """bool [B, H, Q, N]: the KVpop mask of the block's queries over its gathered keys.

    ranks: [B, H, S_pad]; cut_blk: [B, H, Q] cutoffs of the block's queries; count_blk
    [B, H]: valid entries of keys_blk.
    """
    q_pos = start + jnp.arange(st.block_q, dtype=jnp.int32)
    sink_pos = jnp.arange(st.sinks, dtype=jnp.int32)
    win_pos = w_start + jnp.arange(st.window_len, dtype=jnp.int32)
    sink = sink_pos[None, :] <= q_pos[:, None]  # [Q, s]
    diff = q_pos[:, None] - win_pos[None, :]
    window = (win_pos >= st.sinks_mask)[None, :] & (diff >= 0) & (diff < st.window)  # [Q, W]
    lead = keys_blk.shape[:2]
    lr_rank = jnp.take_along_axis(ranks, keys_blk, axis=2, mode="clip")  # [B, H, L]
    slot_ok = jnp.arange(st.list_len, dtype=jnp.int32) < count_blk[..., None]
    long_range = (
        (slot_ok & (keys_blk >= st.sinks_mask))[:, :, None, :]
        & (q_pos[:, None] - keys_blk[:, :, None, :] >= st.window)
        & (lr_rank[:, :, None, :] <= cut_blk[..., None])
    )  # [B, H, Q, L]
    fixed = jnp.concatenate([sink, window], axis=1)
    return jnp.concatenate([jnp.broadcast_to(fixed, lead + fixed.shape), long_range], axis=-1)


def _logits(st, qb, kb, mask):
    """qb [B, H, G, Q, D], kb [B, H, N, D], mask [B, H, Q, N] -> masked logits f32 [B, H, G, Q, N]."""
    logits = jnp.einsum("bhgqd,bhnd->bhgqn", qb, kb, preferred_element_type=jnp.float32) * st.scale
    return jnp.where(mask[:, :, None], logits, NEG_INF)


def _forward(st: _Static, qb_all, kh, vh, ranks, cut_blocks, keys, counts):
    """qb_all [nb, B, H, G, Q, D]; cut_blocks [nb, B, H, Q]; keys [nb, B, H, L]; counts [nb, B, H]."""
    starts = jnp.arange(qb_all.shape[0], dtype=jnp.int32) * st.block_q

    def one(xs):
        start, qb, cut_blk, keys_blk, count_blk = xs
        kb, w_start = _block_keys(st, start, kh, keys_blk)
        vb, _ = _block_keys(st, start, vh, keys_blk)
        mask = _block_mask(st, start, w_start, keys_blk, count_blk, ranks, cut_blk)
        logits = _logits(st, qb, kb, mask)
        m = logits.max(-1)
        p = jnp.exp(logits - m[..., None])
        l = p.sum(-1)
        out = jnp.einsum("bhgqn,bhnd->bhgqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return (out / l[..., None]).astype(qb.dtype), m + jnp.log(l)

    return lax.map(one, (starts, qb_all, cut_blocks, keys, counts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered(st: _Static, qb_all, kh, vh, ranks, cut_blocks, keys, counts):
    return _forward(st, qb_all, kh, vh, ranks, cut_blocks, keys, counts)


def _gathered_fwd(st, qb_all, kh, vh, ranks, cut_blocks, keys, counts):
    out, lse = _forward(st, qb_all, kh, vh, ranks, cut_blocks, keys, counts)
    return (out, lse), (qb_all, kh, vh, ranks, cut_blocks, keys, counts, out, lse)


def _scatter_add(st: _Static, acc, start, w_start, keys_blk, d_blk):
    """Adds the gathered keys' gradient d_blk [B, H, N, D] back onto acc [B, H, S_pad, D] (f32)."""
    n_s, n_w = st.sinks, st.window_len
    if n_s:
        acc = acc.at[:, :, :n_s].add(d_blk[:, :, :n_s])
    win = lax.dynamic_slice_in_dim(acc, w_start, n_w, axis=2) + d_blk[:, :, n_s : n_s + n_w]
    acc = lax.dynamic_update_slice_in_dim(acc, win, w_start, axis=2)
    b, h = keys_blk.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return acc.at[bi, hi, keys_blk].add(d_blk[:, :, n_s + n_w :], mode="drop")


def _gathered_bwd(st, residuals, cotangents):
    qb_all, kh, vh, ranks, cut_blocks, keys, counts, out, lse = residuals
    d_out, d_lse = cotangents
    delta = jnp.einsum("nbhgqd,nbhgqd->nbhgq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    delta = delta - d_lse.astype(jnp.float32)  # d lse / d logit = p: dlse enters as −δ
    starts = jnp.arange(qb_all.shape[0], dtype=jnp.int32) * st.block_q

    def one(carry, xs):
        dk, dv = carry
        start, qb, do, lse_b, delta_b, cut_blk, keys_blk, count_blk = xs
        kb, w_start = _block_keys(st, start, kh, keys_blk)
        vb, _ = _block_keys(st, start, vh, keys_blk)
        mask = _block_mask(st, start, w_start, keys_blk, count_blk, ranks, cut_blk)
        p = jnp.exp(_logits(st, qb, kb, mask) - lse_b[..., None])  # [B, H, G, Q, N]
        do = do.astype(vb.dtype)
        dv_blk = jnp.einsum("bhgqn,bhgqd->bhnd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bhgqd,bhnd->bhgqn", do, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_b[..., None]) * st.scale
        dq = jnp.einsum("bhgqn,bhnd->bhgqd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
        dk_blk = jnp.einsum("bhgqn,bhgqd->bhnd", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
        dk = _scatter_add(st, dk, start, w_start, keys_blk, dk_blk)
        dv = _scatter_add(st, dv, start, w_start, keys_blk, dv_blk)
        return (dk, dv), dq.astype(qb.dtype)

    zeros = jnp.zeros(kh.shape, jnp.float32)
    xs = (starts, qb_all, d_out, lse, delta, cut_blocks, keys, counts)
    (dk, dv), dq = lax.scan(one, (zeros, zeros), xs)
    return dq, dk.astype(kh.dtype), dv.astype(vh.dtype), None, None, None, None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def list_length(seq_len: int, topk: int | None, block_q: int = GATHERED_BLOCK_Q) -> int:
    """Static length of the long-range key lists: min(S_pad, k + block) (S_pad for topk None)."""
    bq = min(block_q, seq_len)
    s_pad = round_up(seq_len, bq)
    return s_pad if topk is None else min(s_pad, round_up(topk + bq, 8))


def keys_per_query(seq_len: int, *, sinks: int, window: int, topk: int | None,
                   block_q: int = GATHERED_BLOCK_Q) -> int:
    """Keys each query block scores: s + (w + block − 1) + list length (each part at most S_pad)."""
    bq = min(block_q, seq_len)
    s_pad = round_up(seq_len, bq)
    return min(sinks, s_pad) + min(window + bq - 1, s_pad) + list_length(seq_len, topk, block_q)


def kvpop_attention_gathered(q, k, v, ranks, cutoffs, *, sinks: int, window: int, scale: float | None = None,
                             topk: int | None = None, block_q: int = GATHERED_BLOCK_Q, fallback=None):
    """KVpop-masked attention over gathered key lists; contract of `kvpop_attention_reference`.

    Args:
      q [B, S, Hq, D]; k, v [B, S, Hkv, D]; ranks, cutoffs int [B, Hkv, S]; sinks, window,
        scale: as the reference.
      topk: the k the cutoffs were computed with; sizes the lists to min(S, k + block).
        None: lists of length S (exact, no savings).
      block_q: queries per block.
      fallback: the reference to run (same arguments) when some block's list is longer than
        the static length; None: `attention.kvpop_attention_reference`'s contract is met by
        a list of length S instead (no fallback needed, no savings).

    Returns:
      out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] float32; differentiable in q, k, v (custom VJP:
      reverse mode, first order; no jvp).
    """
    check_attention_args(q, k, v, ranks, cutoffs, sinks, window, topk, scale)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bq = min(block_q, s)
    s_pad = round_up(s, bq)
    nb = s_pad // bq
    length = list_length(s, topk, block_q) if fallback is not None else s_pad
    st = _Static(scale=float(d**-0.5 if scale is None else scale), sinks=min(sinks, s_pad), sinks_mask=sinks,
                 window=window, block_q=bq, window_len=min(window + bq - 1, s_pad), list_len=length)
    ranks_p = pad_axis(ranks.astype(jnp.int32), 2, s_pad, BIG_RANK)
    cut_p = pad_axis(cutoffs.astype(jnp.int32), 2, s_pad, -1)
    keys, counts = long_range_key_lists(ranks_p, cut_p, sinks=sinks, window=window, block_q=bq, length=length)

    def gathered(q, k, v):
        qb_all = pad_axis(q, 1, s_pad).reshape(b, nb, bq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)
        kh = pad_axis(k, 1, s_pad).transpose(0, 2, 1, 3)  # [B, H, S_pad, D]
        vh = pad_axis(v, 1, s_pad).transpose(0, 2, 1, 3)
        cut_blocks = cut_p.reshape(b, hkv, nb, bq).transpose(2, 0, 1, 3)
        out, lse = _gathered(st, qb_all, kh, vh, ranks_p, cut_blocks, jnp.moveaxis(keys, 2, 0),
                             jnp.moveaxis(counts, 2, 0))
        out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, s_pad, hq, d)[:, :s]  # [nb,B,H,G,Q,D] -> [B,S,Hq,D]
        lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, hq, s_pad)[:, :, :s]
        return out, lse

    if length == s_pad:
        return gathered(q, k, v)
    return lax.cond(
        jnp.any(counts > length),
        lambda: fallback(q, k, v, ranks, cutoffs, sinks=sinks, window=window, scale=scale),
        lambda: gathered(q, k, v),
    )
