"""Attention back ends behind one signature.

Every back end takes queries `q [B, S, Hq, D]` and keys/values `k, v [B, T, Hkv, D]`
(grouped-query attention: Hq = G * Hkv, query head h*G + g reads KV head h, as in HF)
and returns `(out [B, S, Hq, D], lse [B, Hq, S])` with the natural-log log-sum-exp of
the attention logits of each query (float32). The model calls attention only through
`attend`, so a back end can be swapped without touching the layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite "minus infinity": keeps fully masked rows free of NaNs


def _group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, S, Hq, D] -> [B, S, Hkv, G, D] (query head h*G + g belongs to KV head h)."""
    b, s, hq, d = q.shape
    return q.reshape(b, s, num_kv_heads, hq // num_kv_heads, d)


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
) -> tuple[jax.Array, jax.Array]:
    """Causal softmax attention (the dense reference).

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
