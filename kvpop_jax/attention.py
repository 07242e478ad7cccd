"""Attention: the dense and KVpop-masked references, and the masked-attention dispatcher.

Every back end takes queries `q [B, S, Hq, D]` and keys/values `k, v [B, T, Hkv, D]`
(grouped-query attention: Hq = G * Hkv, query head h*G + g reads KV head h, as in HF)
and returns `(out [B, S, Hq, D], lse [B, Hq, S])` with the natural-log log-sum-exp of
the attention logits of each query (float32).

`kvpop_attention` is the model's masked attention: it dispatches (`dispatch.Op`) to the
blockwise XLA reference or a Pallas kernel (`pallas_kernels.sparse_attention`, its
compacted-key-list variant, or the Hopper-only Mosaic GPU forward
`pallas_kernels.mosaic_attention`) behind the reference's signature.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from kvpop_jax import sharding as shd
from kvpop_jax.dispatch import Backend, Op
from kvpop_jax.gathered_attention import keys_per_query, kvpop_attention_gathered
from kvpop_jax.tiled_attention import dense_attention_tiled
from pallas_kernels.common import NEG_INF, check_attention_args, check_dense_args, check_int
from pallas_kernels.compacted_attention import compacted_is_cheaper, kvpop_attention_pallas_compacted
from pallas_kernels.compat import mosaic_gpu_interpret_unavailable
from pallas_kernels.mosaic_attention import kvpop_attention_mosaic, mosaic_rejects
from pallas_kernels.sparse_attention import kvpop_attention_pallas


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, S, Hq, D] -> [B, S, Hkv, G, D] (query head h*G + g belongs to KV head h)."""
    b, s, hq, d = q.shape
    return q.reshape(b, s, num_kv_heads, hq // num_kv_heads, d)


def attend(q_grouped: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
           bias: jax.Array | None = None):
    """Softmax attention of one block of grouped queries over masked keys.

    q_grouped [B, Q, Hkv, G, D]; k, v [B, T, Hkv, D]; mask bool broadcastable to
    [B, Hkv, G, Q, T]; bias: optional float32 added to the kept logits (same broadcast; DMS's
    soft eviction). Returns out [B, Q, Hkv, G, D] (q's dtype) and lse [B, Hkv, G, Q]
    float32. A row with no kept key gets out 0 and lse NEG_INF.
    """
    logits = jnp.einsum("bqhgd,bthd->bhgqt", q_grouped, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        logits = logits + bias
    logits = jnp.where(mask, logits, NEG_INF)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.where(mask, jnp.exp(logits - lse[..., None]), 0.0)
    out = jnp.einsum("bhgqt,bthd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q_grouped.dtype), lse


def split_query_blocks(xs: Sequence[jax.Array], axes: Sequence[int], block: int,
                       pad_values: Sequence | None = None) -> tuple[jax.Array, list[jax.Array]]:
    """Cuts each xs[i] along its query axis `axes[i]` into blocks of `block` positions.

    The axis is padded to a multiple of the block (with pad_values[i], default 0). Returns the
    blocks' first positions int32 [nb] and the blocks, each with a leading [nb] axis.
    """
    s = xs[0].shape[axes[0]]
    bq = min(block, s)
    nb = -(-s // bq)
    pad_values = pad_values or [0] * len(xs)

    def split(x, axis, value):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, nb * bq - s)
        x = jnp.pad(x, widths, constant_values=value)
        return jnp.moveaxis(x.reshape(*x.shape[:axis], nb, bq, *x.shape[axis + 1:]), axis, 0)

    return jnp.arange(nb, dtype=jnp.int32) * bq, [split(x, a, p) for x, a, p in zip(xs, axes, pad_values)]


def map_query_blocks(block_fn: Callable, xs: Sequence[jax.Array], axes: Sequence[int], *, block: int,
                     out_axes: Sequence[int] = (1, -1), pad_values: Sequence | None = None):
    """Runs `block_fn(start, *blocks)` over blocks of `block` positions of the query axis.

    Inputs as for `split_query_blocks`. `block_fn` gets the block's first position (int32
    scalar) and the blocks, and returns a tuple of outputs whose query axis is `out_axes[j]`
    (default: out [B, Q, ...] and lse [..., Q]). Each block is rematerialized in autodiff
    (`jax.checkpoint`), so memory is O(block) per head. Returns the outputs with the blocks
    joined and the padding cut off.
    """
    s = xs[0].shape[axes[0]]
    starts, blocks = split_query_blocks(xs, axes, block, pad_values)
    outs = jax.lax.map(jax.checkpoint(lambda a: block_fn(a[0], *a[1:]), prevent_cse=False), (starts, *blocks))

    def merge(y, axis):  # [nb, ..., bq at axis, ...] -> [..., nb * bq, ...][:s]
        axis = axis % (y.ndim - 1)
        y = jnp.moveaxis(y, 0, axis)
        y = y.reshape(*y.shape[:axis], y.shape[axis] * y.shape[axis + 1], *y.shape[axis + 2:])
        return jax.lax.slice_in_dim(y, 0, s, axis=axis)

    return tuple(merge(y, axis) for y, axis in zip(outs, out_axes))


# --- dense -------------------------------------------------------------------------------

# From this many queries on `dense_attention` runs the tiled path. On CPU it is faster than the
# reference already at 128 queries, forward and backward (BENCHMARKS.md, stop 30); below, one
# tile would be the whole matrix anyway.
DENSE_TILED_MIN_QUERIES = 64


def _dense_mask(q_pos, kv_positions, q_seg, kv_segment_ids, kv_valid):
    """bool [B, 1, 1, Q, T]: key t visible to query s (causal by position, same segment, valid)."""
    mask = kv_positions[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        mask &= q_seg[:, :, None] == kv_segment_ids[:, None, :]
    if kv_valid is not None:
        mask &= kv_valid[:, None, :]
    return mask[:, None, None]


def dense_attention_blockwise(q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                              kv_valid=None, scale: float | None = None, block_q: int = 512):
    """Causal softmax attention one query block at a time; contract of `dense_attention`.

    Memory is O(block_q * T) per head instead of O(S * T), in autodiff too (each block is
    rematerialized). S need not be a multiple of `block_q`.
    """
    check_dense_args(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_valid, scale)
    check_int("block_q", block_q, 1)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    xs, axes = [group_queries(q, hkv), q_positions], [1, 1]
    if q_segment_ids is not None:
        xs, axes = xs + [q_segment_ids], axes + [1]

    def one_block(_, q_blk, qpos_blk, seg_blk=None):
        mask = _dense_mask(qpos_blk, kv_positions, seg_blk, kv_segment_ids, kv_valid)
        return attend(q_blk, k, v, mask, scale)

    out, lse = map_query_blocks(one_block, xs, axes, block=block_q)
    return out.reshape(b, s, hq, d), lse.reshape(b, hq, s)


def dense_attention_reference(q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                              kv_valid=None, scale: float | None = None):
    """Causal softmax attention over the whole `[S, T]` logits at once (the dense reference).

    Args:
      q: [B, S, Hq, D] queries; k, v: [B, T, Hkv, D].
      q_positions: int [B, S]; kv_positions: int [B, T]. Key t is visible to query s
        iff kv_positions[t] <= q_positions[s] (causality by position, so the same
        function serves a full forward and a step against a cache).
      q_segment_ids, kv_segment_ids: optional int [B, S] / [B, T]; when given, a query
        sees only keys of its own segment (attention reset at packing boundaries).
      kv_valid: optional bool [B, T]; False marks empty cache slots.
      scale: logit scale, default D ** -0.5.

    Returns:
      out [B, S, Hq, D] in q's dtype and lse [B, Hq, S] float32 (natural log).
    """
    check_dense_args(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_valid, scale)
    b, s, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    mask = _dense_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_valid)
    out, lse = attend(group_queries(q, k.shape[2]), k, v, mask, scale)
    return out.reshape(b, s, hq, d), lse.reshape(b, hq, s)


DENSE_IMPLS = ("reference", "blockwise", "tiled")


def dense_attention(q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                    kv_valid=None, scale: float | None = None, impl: str | None = None):
    """Causal softmax attention; contract of `dense_attention_reference`.

    impl: "reference" (the whole [S, T] logits), "blockwise" (query blocks over every key) or
    "tiled" (`tiled_attention.dense_attention_tiled`: online softmax over key blocks, skipping
    those no query of the block can see, with its own backward). None: tiled from
    `DENSE_TILED_MIN_QUERIES` queries on, the reference below (a decode step, short prompts).
    Shapes, dtypes and positions are checked by name first (`common.check_dense_args`); values in
    empty (`kv_valid=False`) slots must be finite (the caches zero them).
    """
    if impl is None:
        impl = "tiled" if q.shape[1] >= DENSE_TILED_MIN_QUERIES else "reference"
    fns = {"reference": dense_attention_reference, "blockwise": dense_attention_blockwise,
           "tiled": dense_attention_tiled}
    if impl not in fns:
        raise ValueError(f"impl must be one of {DENSE_IMPLS} or None, got {impl!r}")
    return fns[impl](q, k, v, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
                     kv_segment_ids=kv_segment_ids, kv_valid=kv_valid, scale=scale)


# --- KVpop-masked ------------------------------------------------------------------------


def kvpop_block_mask(q_pos: jax.Array, k_pos: jax.Array, ranks: jax.Array, cutoffs: jax.Array, *, sinks: int,
                     window: int) -> jax.Array:
    """The KVpop mask (`policy.py`'s conventions) on a tile: query positions `q_pos [Q]`, key positions `k_pos [T]`.

    ranks: int [..., T] for the keys; cutoffs: int [..., Q] τ for the queries (S keeps every
    eligible key, negative keeps none). Returns bool [..., Q, T]:
    `t <= q ∧ (t < s ∨ q − t < w ∨ (s <= t <= q − w ∧ rank(t) <= τ_q))`.
    """
    diff = q_pos[:, None] - k_pos[None, :]
    is_sink = (k_pos < sinks)[None, :]
    eligible = (k_pos >= sinks)[None, :] & (diff >= window)
    kept = ranks[..., None, :] <= cutoffs[..., :, None]
    return (diff >= 0) & (is_sink | (diff < window) | (eligible & kept))


def kvpop_attention_reference(q, k, v, ranks, cutoffs, *, sinks: int, window: int, scale: float | None = None,
                              topk: int | None = None, block_q: int = 512):
    """KVpop-masked causal attention in plain XLA, one query block at a time (paper Eq. 26).

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] (GQA: query head h*G + g reads KV head h).
      ranks: int [B, Hkv, S], rank of each key under the static priority (0 = best).
      cutoffs: int [B, Hkv, S], τ_q per query position (S: keep all eligible; < 0: none).
      sinks, window: s and w (window >= 1).
      scale: logit scale, default D ** -0.5.
      topk: the k the cutoffs were computed with (a hint for back ends that size their work
        by it; ignored here).
      block_q: queries per block; memory is O(S * block_q) per head in the forward and,
        because each block is rematerialized, in autodiff too.

    Returns:
      out [B, S, Hq, D] in q's dtype and lse [B, Hq, S] float32 (natural log over kept keys).
      Differentiable in q, k, v (both outputs) by plain autodiff.
    """
    check_attention_args(q, k, v, ranks, cutoffs, sinks, window, topk, scale)
    check_int("block_q", block_q, 1)
    b, s, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    k_pos = jnp.arange(s, dtype=jnp.int32)
    ranks = ranks.astype(jnp.int32)

    def one_block(start, q_blk, cut_blk):
        q_pos = start + jnp.arange(q_blk.shape[1], dtype=jnp.int32)
        mask = kvpop_block_mask(q_pos, k_pos, ranks, cut_blk, sinks=sinks, window=window)  # [B, Hkv, Q, S]
        return attend(q_blk, k, v, mask[:, :, None], scale)

    xs = [group_queries(q, k.shape[2]), cutoffs.astype(jnp.int32)]
    out, lse = map_query_blocks(one_block, xs, [1, 2], block=block_q, pad_values=[0, -1])
    return out.reshape(b, s, hq, d), lse.reshape(b, hq, s)


def _compacted_rejects(q, k, v, ranks, cutoffs, *, sinks, window, scale=None, topk=None):
    del q, k, v, ranks, cutoffs, sinks, window, scale
    return "needs topk= (the key lists are sized by it)" if topk is None else None


def _compacted_preferred(q, k, v, ranks, cutoffs, *, sinks, window, scale=None, topk=None):
    del k, v, ranks, cutoffs, scale
    return compacted_is_cheaper(q.shape[1], sinks=sinks, window=window, topk=topk)


def _gathered(q, k, v, ranks, cutoffs, *, sinks, window, scale=None, topk=None):
    """`kvpop_attention_gathered`, falling back to the reference where a key list overflows."""
    return kvpop_attention_gathered(q, k, v, ranks, cutoffs, sinks=sinks, window=window, scale=scale, topk=topk,
                                    fallback=kvpop_attention_reference)


GATHERED_MARGIN = 0.6  # the gathered path wins when it scores fewer than this share of the reference's keys


def _gathered_preferred(q, k, v, ranks, cutoffs, *, sinks, window, scale=None, topk=None):
    """Static cost model: keys scored per query, gathered lists vs all S (the reference).

    The margin pays for the gathers, the list building and the scatter-adds of the backward.
    """
    del k, v, ranks, cutoffs, scale
    s = q.shape[1]
    return keys_per_query(s, sinks=sinks, window=window, topk=topk) < GATHERED_MARGIN * s


def _pallas(kernel, interpret: bool, with_topk: bool) -> Callable:
    """A masked-attention kernel under the dispatcher's signature, in shard_map under a mesh.

    q, k and v of different float dtypes run in their common dtype, as the XLA reference computes
    (Triton's dots take one element type); out comes back in q's dtype, each gradient in its input's."""

    def run(q, k, v, ranks, cutoffs, *, sinks, window, scale=None, topk=None):
        kw = dict(sinks=sinks, window=window, scale=scale, interpret=interpret, **({"topk": topk} if with_topk else {}))
        fn = shd.shard_kernel(functools.partial(kernel, **kw), ("BSHD", "BSHD", "BSHD", "BHS", "BHS"), ("BSHD", "BHS"))
        dtype = jnp.result_type(q, k, v)
        out, lse = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), ranks, cutoffs)
        return out.astype(q.dtype), lse

    return run


def _with_reference_backward(forward: Callable) -> Callable:
    """A forward-only kernel with the reference's signature, made differentiable: its
    cotangents are those of `kvpop_attention_reference` (XLA, recomputing the forward)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
    def run(q, k, v, ranks, cutoffs, sinks, window, scale):
        return forward(q, k, v, ranks, cutoffs, sinks=sinks, window=window, scale=scale)

    def run_fwd(q, k, v, ranks, cutoffs, sinks, window, scale):
        return run(q, k, v, ranks, cutoffs, sinks, window, scale), (q, k, v, ranks, cutoffs)

    def run_bwd(sinks, window, scale, residuals, cotangents):
        q, k, v, ranks, cutoffs = residuals
        reference = functools.partial(kvpop_attention_reference, ranks=ranks, cutoffs=cutoffs, sinks=sinks,
                                      window=window, scale=scale)
        _, pullback = jax.vjp(lambda q, k, v: reference(q, k, v), q, k, v)
        return (*pullback(cotangents), None, None)

    run.defvjp(run_fwd, run_bwd)
    return run


def _mosaic(interpret: bool) -> Callable:
    """The Mosaic GPU forward with the reference's backward, in shard_map under a mesh."""
    differentiable = _with_reference_backward(functools.partial(kvpop_attention_mosaic, interpret=interpret))

    def run(q, k, v, ranks, cutoffs, *, sinks, window, scale=None, topk=None):
        del topk
        fn = shd.shard_kernel(lambda *a: differentiable(*a, sinks, window, scale),
                              ("BSHD", "BSHD", "BSHD", "BHS", "BHS"), ("BSHD", "BHS"))
        return fn(q, k, v, ranks, cutoffs)

    return run


def _mosaic_rejects(interpret: bool) -> Callable[..., str | None]:
    def rejects(q, k, v, ranks, cutoffs, *, sinks, window, scale=None, topk=None):
        del k, v, ranks, cutoffs, sinks, window, scale, topk
        return (mosaic_gpu_interpret_unavailable() if interpret else None) or mosaic_rejects(q)

    return rejects


KVPOP_ATTENTION = Op(
    "kvpop_attention", "KVPOP_ATTENTION_IMPL",
    {
        "xla": Backend(kvpop_attention_reference),
        "xla_sparse": Backend(_gathered, rejects=_compacted_rejects, preferred=_gathered_preferred),
        "pallas": Backend(_pallas(kvpop_attention_pallas, False, False), platforms=("gpu",)),
        "pallas_compacted": Backend(_pallas(kvpop_attention_pallas_compacted, False, True), platforms=("gpu",),
                                    rejects=_compacted_rejects, preferred=_compacted_preferred),
        "pallas_interpret": Backend(_pallas(kvpop_attention_pallas, True, False)),
        "pallas_compacted_interpret": Backend(_pallas(kvpop_attention_pallas_compacted, True, True),
                                              rejects=_compacted_rejects),
        # Forward only (gradients by the XLA reference), Hopper only, not yet tuned: never chosen
        # automatically; KVPOP_ATTENTION_IMPL=mosaic_gpu selects it.
        "mosaic_gpu": Backend(_mosaic(False), platforms=("gpu",), rejects=_mosaic_rejects(False)),
        "mosaic_gpu_interpret": Backend(_mosaic(True), rejects=_mosaic_rejects(True)),
    },
    auto=("pallas_compacted", "pallas", "xla_sparse", "xla"),
)


def kvpop_attention(q, k, v, ranks, cutoffs, *, sinks: int, window: int, scale: float | None = None,
                    topk: int | None = None, implementation: str | None = None):
    """KVpop-masked attention on the back end `KVPOP_ATTENTION` picks (contract of the reference).

    implementation: one of `KVPOP_ATTENTION.implementations` — "xla"
    (`kvpop_attention_reference`, O(S²)), "xla_sparse" (`kvpop_attention_gathered`: plain XLA
    over gathered per-block key lists, O(S·(B + block)); needs `topk`), "pallas"
    (`kvpop_attention_pallas`), "pallas_compacted" (compacted key lists; needs `topk`),
    "mosaic_gpu" (`kvpop_attention_mosaic`: Hopper, bf16/f16, forward kernel with the
    reference's backward; never picked automatically), or their "_interpret" twins (CPU tests;
    Mosaic GPU's needs jax >= 0.12). None reads `$KVPOP_ATTENTION_IMPL`, else picks
    automatically: on GPU the compacted kernel where its tile count is lower, else the
    block-skipping kernel; elsewhere "xla_sparse" where it scores fewer than
    `GATHERED_MARGIN` x S keys per query, else the reference. Under an active mesh the kernels
    run in shard_map over batch and heads.

    The arguments are checked by name before any back end runs (`common.check_attention_args`):
    float q, k, v (of any mix of dtypes: the kernels run in their common dtype), int budgets, a
    static scale. v must be finite everywhere, masked keys included: a masked value is multiplied
    by 0, and 0 · inf is NaN (as in any fused attention). The gradients are reverse mode only.
    """
    check_attention_args(q, k, v, ranks, cutoffs, sinks, window, topk, scale)  # before any back end casts
    return KVPOP_ATTENTION(q, k, v, ranks, cutoffs, sinks=sinks, window=window, scale=scale, topk=topk,
                           implementation=implementation)
