"""Attention back ends behind one signature.

Every back end takes queries `q [B, S, Hq, D]` and keys/values `k, v [B, T, Hkv, D]`
(grouped-query attention: Hq = G * Hkv, query head h*G + g reads KV head h, as in HF)
and returns `(out [B, S, Hq, D], lse [B, Hq, S])` with the natural-log log-sum-exp of
the attention logits of each query (float32). The model calls attention only through
`attend`, so a back end can be swapped without touching the layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvpop_jax import sharding as shd

NEG_INF = -1e30  # finite "minus infinity": keeps fully masked rows free of NaNs


def _group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, S, Hq, D] -> [B, S, Hkv, G, D] (query head h*G + g belongs to KV head h)."""
    b, s, hq, d = q.shape
    return q.reshape(b, s, num_kv_heads, hq // num_kv_heads, d)


def dense_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
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
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = _group_queries(q, hkv)
    logits = jnp.einsum("bshgd,bthd->bhgst", qg, k, preferred_element_type=jnp.float32) * scale
    mask = kv_positions[:, None, :] <= q_positions[:, :, None]  # [B, S, T]
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if kv_valid is not None:
        mask &= kv_valid[:, None, :]
    logits = jnp.where(mask[:, None, None], logits, NEG_INF)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, Hkv, G, S]
    probs = jnp.exp(logits - lse[..., None])
    out = jnp.einsum("bhgst,bthd->bshgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, hq, d).astype(q.dtype), lse.reshape(b, hq, s)



DENSE_BLOCKWISE_MIN_QUERIES = 2048  # above this many queries `dense_attention` goes blockwise


def dense_attention_blockwise(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
    scale: float | None = None,
    block_q: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """`dense_attention_reference` one query block at a time (same contract).

    Memory is O(block_q * T) per head instead of O(S * T), in autodiff too: each block is
    rematerialized (`jax.checkpoint`). S need not be a multiple of `block_q`.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    bq = min(block_q, s)
    nb = -(-s // bq)
    pad = nb * bq - s

    def blocks(x):  # [B, S, ...] -> [nb, B, bq, ...]; padded queries are sliced off at the end
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, nb, bq, *x.shape[2:]), 1, 0)

    xs = [blocks(_group_queries(q, hkv)), blocks(q_positions)]
    if q_segment_ids is not None:
        xs.append(blocks(q_segment_ids))

    def one_block(args):
        q_blk, qpos_blk = args[0], args[1]
        mask = kv_positions[:, None, :] <= qpos_blk[:, :, None]  # [B, bq, T]
        if q_segment_ids is not None:
            mask &= args[2][:, :, None] == kv_segment_ids[:, None, :]
        if kv_valid is not None:
            mask &= kv_valid[:, None, :]
        logits = jnp.einsum("bqhgd,bthd->bhgqt", q_blk, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(mask[:, None, None], logits, NEG_INF)
        lse = jax.nn.logsumexp(logits, axis=-1)  # [B, Hkv, G, bq]
        probs = jnp.exp(logits - lse[..., None])
        out = jnp.einsum("bhgqt,bthd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse

    out, lse = jax.lax.map(jax.checkpoint(one_block, prevent_cse=False), tuple(xs))
    out = jnp.moveaxis(out, 0, 1).reshape(b, nb * bq, hkv, g, d)[:, :s].reshape(b, s, hq, d)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hq, nb * bq)[:, :, :s]
    return out, lse


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
    scale: float | None = None,
    blockwise: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal softmax attention; contract of `dense_attention_reference`.

    blockwise: True runs `dense_attention_blockwise` (no `[S, T]` logits), False the
    reference; None goes blockwise when S > `DENSE_BLOCKWISE_MIN_QUERIES`.
    """
    if blockwise is None:
        blockwise = q.shape[1] > DENSE_BLOCKWISE_MIN_QUERIES
    fn = dense_attention_blockwise if blockwise else dense_attention_reference
    return fn(q, k, v, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids, kv_valid=kv_valid, scale=scale)


# --- KVpop-masked attention -------------------------------------------------------------

KVPOP_IMPL_ENV = "KVPOP_ATTENTION_IMPL"  # xla | pallas | pallas_interpret; overrides the default


def _check_kvpop_args(q, k, v, ranks, cutoffs, sinks, window):
    b, s, hq, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != d:
        raise ValueError(f"k and v must be [B, S, Hkv, D] matching q {q.shape}, got {k.shape}, {v.shape}")
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    for name, x in (("ranks", ranks), ("cutoffs", cutoffs)):
        if x.shape != (b, hkv, s) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be int [B, Hkv, S] = {(b, hkv, s)}, got {x.dtype}{x.shape}")
    if sinks < 0 or window < 1:
        raise ValueError(f"need sinks >= 0 and window >= 1 (query q always sees t = q), got {sinks}, {window}")


def kvpop_block_mask(
    q_pos: jax.Array, k_pos: jax.Array, ranks: jax.Array, cutoffs: jax.Array, *, sinks: int, window: int
) -> jax.Array:
    """The KVpop mask (DESIGN.md) on a tile: query positions `q_pos [Q]`, key positions `k_pos [T]`.

    ranks: int [..., T] for the keys; cutoffs: int [..., Q] τ for the queries (S keeps every
    eligible key, negative keeps none). Returns bool [..., Q, T]:
    `t <= q ∧ (t < s ∨ q − t < w ∨ (s <= t <= q − w ∧ rank(t) <= τ_q))`.
    """
    diff = q_pos[:, None] - k_pos[None, :]
    is_sink = (k_pos < sinks)[None, :]
    eligible = (k_pos >= sinks)[None, :] & (diff >= window)
    kept = ranks[..., None, :] <= cutoffs[..., :, None]
    return (diff >= 0) & (is_sink | (diff < window) | (eligible & kept))


def kvpop_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ranks: jax.Array,
    cutoffs: jax.Array,
    *,
    sinks: int,
    window: int,
    scale: float | None = None,
    block_q: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """KVpop-masked causal attention in plain XLA, one query block at a time (paper Eq. 26).

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] (GQA: query head h*G + g reads KV head h).
      ranks: int [B, Hkv, S], rank of each key under the static priority (0 = best).
      cutoffs: int [B, Hkv, S], τ_q per query position (S: keep all eligible; < 0: none).
      sinks, window: s and w (window >= 1).
      scale: logit scale, default D ** -0.5.
      block_q: queries per block; memory is O(S * block_q) per head in the forward and,
        because each block is rematerialized (`jax.checkpoint`), in autodiff too.

    Returns:
      out [B, S, Hq, D] in q's dtype and lse [B, Hq, S] float32 (natural log over kept keys).
      Differentiable in q, k, v (both outputs) by plain autodiff.
    """
    _check_kvpop_args(q, k, v, ranks, cutoffs, sinks, window)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    bq = min(block_q, s)
    nb = -(-s // bq)
    pad = nb * bq - s
    q_blocks = jnp.pad(_group_queries(q, hkv), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    q_blocks = jnp.moveaxis(q_blocks.reshape(b, nb, bq, hkv, g, d), 1, 0)  # [nb, B, bq, Hkv, G, D]
    cut_blocks = jnp.pad(cutoffs.astype(jnp.int32), ((0, 0), (0, 0), (0, pad)), constant_values=-1)
    cut_blocks = jnp.moveaxis(cut_blocks.reshape(b, hkv, nb, bq), 2, 0)  # [nb, B, Hkv, bq]
    k_pos = jnp.arange(s, dtype=jnp.int32)
    ranks = ranks.astype(jnp.int32)

    def one_block(args):
        q_blk, cut_blk, start = args
        q_pos = start + jnp.arange(bq, dtype=jnp.int32)
        mask = kvpop_block_mask(q_pos, k_pos, ranks, cut_blk, sinks=sinks, window=window)  # [B, Hkv, bq, S]
        logits = jnp.einsum("bqhgd,bthd->bhgqt", q_blk, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(mask[:, :, None], logits, NEG_INF)
        lse = jax.nn.logsumexp(logits, axis=-1)  # [B, Hkv, G, bq]
        probs = jnp.exp(logits - lse[..., None])
        out = jnp.einsum("bhgqt,bthd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse

    starts = jnp.arange(nb, dtype=jnp.int32) * bq
    out, lse = jax.lax.map(jax.checkpoint(one_block, prevent_cse=False), (q_blocks, cut_blocks, starts))
    out = jnp.moveaxis(out, 0, 1).reshape(b, nb * bq, hq, d)[:, :s]
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hq, nb * bq)[:, :, :s]
    return out, lse


def kvpop_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ranks: jax.Array,
    cutoffs: jax.Array,
    *,
    sinks: int,
    window: int,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """KVpop-masked attention, dispatched to a back end (same contract as the reference).

    implementation: "xla" (`kvpop_attention_reference`), "pallas" (the Triton-lowered
    kernel, `pallas_kernels.sparse_attention`) or "pallas_interpret" (the same kernel in
    interpret mode, for CPU tests). None picks `$KVPOP_ATTENTION_IMPL` if set, else
    "pallas" on GPU and "xla" elsewhere. Under an active mesh (`sharding.activate`) the
    Pallas kernel runs in shard_map over batch and heads (`pallas_call` is not
    auto-partitioned); the XLA reference is left to the SPMD partitioner.
    """
    from pallas_kernels._common import resolve_implementation

    impl = resolve_implementation(implementation, KVPOP_IMPL_ENV)
    kwargs = dict(sinks=sinks, window=window, scale=scale)
    if impl == "xla":
        return kvpop_attention_reference(q, k, v, ranks, cutoffs, **kwargs)
    from pallas_kernels.sparse_attention import sparse_attention

    kernel = functools.partial(sparse_attention, interpret=impl == "pallas_interpret", **kwargs)
    return shd.shard_kernel(kernel, ("BSHD", "BSHD", "BSHD", "BHS", "BHS"), ("BSHD", "BHS"))(q, k, v, ranks, cutoffs)
