"""Helpers shared by the Pallas kernels: block sizing, padding, back-end choice.

Triton lowering needs power-of-2 block shapes and dot dimensions >= 16, so every
kernel wrapper pads the sequence to a multiple of its blocks and the head dim to a
power of 2 (>= 16) before `pallas_call`, and slices the padding off afterwards.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret")
MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16
LOG2E = 1.4426950408889634  # log2(e): kernels use exp2, LSEs leave them in natural log
LN2 = 0.6931471805599453
NEG_INF = -1e30  # finite "minus infinity" for logits and running maxima (no inf - inf NaNs)
BIG_RANK = 2**30  # rank of padded keys: above every cutoff, including the sentinel S


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fit_block(block: int, length: int) -> int:
    """A power-of-2 block >= 16 no longer than needed: `length` rounded up to a power of 2."""
    if block < MIN_DOT_DIM or block & (block - 1):
        raise ValueError(f"block sizes must be powers of 2 >= {MIN_DOT_DIM}, got {block}")
    return max(MIN_DOT_DIM, min(block, next_power_of_2(length)))


def padded_head_dim(head_dim: int) -> int:
    return max(MIN_DOT_DIM, next_power_of_2(head_dim))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pads `x` at the end of `axis` to `size` with `value` (no-op when already that size)."""
    extra = size - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of shape {x.shape} down to {size}")
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def resolve_implementation(implementation: str | None, env_var: str) -> str:
    """Back end to run: the explicit argument, else `$env_var`, else pallas on GPU / xla elsewhere."""
    impl = implementation or os.environ.get(env_var) or None
    if impl is None:
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in IMPLEMENTATIONS:
        source = "implementation" if implementation else f"${env_var}"
        raise ValueError(f"{source} must be one of {IMPLEMENTATIONS}, got {impl!r}")
    return impl
