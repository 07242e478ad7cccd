"""Rotary position embedding (RoPE, HF's rotate-half layout), and its inverse for the scorers.

The attention rotates queries and keys by their absolute positions; a cached key therefore
carries its position in its phases. A KVpop scorer that reads cached keys can learn absolute
position from them, which does not carry over to other lengths (BENCHMARKS.md, "Length
generalization"); `unrotate` gives such a scorer the key before the rotation
(`KVpopConfig.scorer_keys = "unrotated"`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions int [B, S] -> cos, sin float32 [B, S, D] (HF layout: two halves repeated)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [B, S, H, D]; cos, sin [B, S, D]."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def unrotate(k: jax.Array, positions, theta: float) -> jax.Array:
    """Undoes `apply_rope`: k [B, S, H, D] rotated at positions (int, broadcastable to [B, S]) ->
    float32 [B, S, H, D], the key before its rotation (the inverse rotation, by -position)."""
    b, s = k.shape[:2]
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, s))
    cos, sin = rope_cos_sin(positions, k.shape[-1], theta)
    return apply_rope(k.astype(jnp.float32), cos, -sin)
