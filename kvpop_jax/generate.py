"""Prefill + decode loop (jitted `lax.while_loop`) with EOS stopping.

This is the dense-cache generator; the bounded KVpop cache and the baselines plug into
the same loop (see `cache.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvpop_jax.modeling import DenseCache, Qwen3ForCausalLM
from kvpop_jax.sampling import SamplingConfig, sample


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "eos_ids"))
def _generate(model, params, prompt_ids, rng, *, max_new_tokens, sampling, eos_ids):
    b, p = prompt_ids.shape
    cache = DenseCache.init(model.config, b, p + max_new_tokens, dtype=model.dtype)
    out = model.apply({"params": params}, prompt_ids, cache=cache)
    rng, key = jax.random.split(rng)
    first = sample(key, out.logits[:, -1], sampling)
    tokens = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    done = jnp.isin(first, eos)

    def cond(state):
        i, _, _, _, done = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, tokens, cache, rng, done = state
        prev = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
        out = model.apply({"params": params}, prev, cache=cache, method=Qwen3ForCausalLM.decode_step)
        rng, key = jax.random.split(rng)
        nxt = sample(key, out.logits[:, -1], sampling)
        nxt = jnp.where(done, 0, nxt)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], i, axis=1)
        return i + 1, tokens, out.cache, rng, done | jnp.isin(nxt, eos)

    _, tokens, _, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tokens, out.cache, rng, done))
    is_eos = jnp.isin(tokens, eos)
    # Length up to and including the first EOS (max_new_tokens if none).
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
    return tokens, first_eos


def generate(
    model: Qwen3ForCausalLM,
    params,
    prompt_ids: jax.Array,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    rng: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Samples continuations of equal-length prompts.

    Args:
      prompt_ids: int [B, P].
    Returns:
      tokens int32 [B, max_new_tokens] (zeros after EOS) and lengths int32 [B] (through
      the first EOS).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be [batch, prompt_len >= 1], got shape {prompt_ids.shape}")
    rng = jax.random.key(0) if rng is None else rng
    return _generate(
        model, params, jnp.asarray(prompt_ids, jnp.int32), rng,
        max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=tuple(eos_ids),
    )
