"""Token sampling: temperature, top-k, top-p (nucleus) and min-p, composable and jittable.

Paper decoding (Table 3): temperature 0.6, top-p 0.95, top-k 20, min-p 0.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

NEG_INF = -1e30
FLOAT32_TINY = float(jnp.finfo(jnp.float32).tiny)  # the smallest normal float32 (~1.2e-38)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (so does one too small for a float32, below ~1.2e-38: greedy is its limit).
    top_k 0 and top_p 1 and min_p 0 disable those filters."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    min_p: float = 0.0

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise ValueError(f"top_k must be an int (0: off), got {self.top_k!r}")
        if not 0 <= self.temperature < float("inf"):  # NaN too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @classmethod
    def greedy(cls) -> "SamplingConfig":
        return cls(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)


def filter_top_k(logits: jax.Array, k: int) -> jax.Array:
    """Keeps the k largest logits per row ([..., V]); k = 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, NEG_INF, logits)


def filter_top_p(logits: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of tokens whose probability mass reaches p (always >= 1 token)."""
    if p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # The best token always: a p below float32's normal range compares as 0 and would keep none.
    keep_sorted = (mass_before < p).at[..., 0].set(True)
    keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
    return jnp.where(keep, logits, NEG_INF)


def filter_min_p(logits: jax.Array, min_p: float) -> jax.Array:
    """Drops tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    threshold = jnp.max(log_probs, axis=-1, keepdims=True) + jnp.log(min_p)
    return jnp.where(log_probs < threshold, NEG_INF, logits)


def sample(rng: jax.Array, logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """logits [B, V] float -> token ids int32 [B]."""
    logits = logits.astype(jnp.float32)
    if config.temperature < FLOAT32_TINY:  # 0, or below float32's normal range (flushed to 0): greedy, its limit
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Shifted so the best logit is 0 before the division: a tiny temperature then sends the others to
    # -inf (never drawn) rather than every logit to +-inf (a NaN softmax, and token 0 drawn).
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / config.temperature
    logits = filter_top_k(logits, config.top_k)
    logits = filter_top_p(logits, config.top_p)
    logits = filter_min_p(logits, config.min_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
