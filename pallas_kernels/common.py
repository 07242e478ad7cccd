"""What the Pallas kernels and their XLA references share: constants, argument checks, padding.

The kernel package is a leaf (it imports only jax); `kvpop_jax` imports the checks and
constants from here, so a kernel and its reference reject the same inputs with the same
message.

Triton lowering needs power-of-2 block shapes and dot dimensions >= 16, so every
kernel wrapper pads the sequence to a multiple of its blocks and the head dim to a
power of 2 (>= 16) before `pallas_call`, and slices the padding off afterwards.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16
LOG2E = 1.4426950408889634  # log2(e): kernels use exp2, LSEs leave them in natural log
LN2 = 0.6931471805599453
NEG_INF = -1e30  # finite "minus infinity" for logits and running maxima: no inf - inf NaNs
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


# ------------------------------------------------------------------------------ checks
# Shapes (DESIGN.md): q [B, S, Hq, D], k/v [B, S, Hkv, D], per-KV-head arrays [B, Hkv, S],
# per-query-head normalizers [B, Hq, S]; query head h*G + g reads KV head h.

REDUCTIONS = ("sum", "max")  # over a key's future queries: the paper's mass, or its strongest read


def check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_budget(sinks, window, topk=None) -> None:
    """s >= 0, w >= 1 (query q always sees t = q) and, when given, k >= 0."""
    check_int("sinks", sinks, 0)
    check_int("window", window, 1)
    if topk is not None:
        check_int("topk", topk, 0)


def check_ranks(ranks) -> jax.Array:
    """int [..., S] with S >= 1 -> int32 (a permutation per row is assumed, not checked)."""
    ranks = jnp.asarray(ranks)
    if ranks.ndim < 1 or ranks.shape[-1] < 1:
        raise ValueError(f"ranks must have shape [..., S] with S >= 1, got {ranks.shape}")
    if not jnp.issubdtype(ranks.dtype, jnp.integer):
        raise ValueError(f"ranks must be an integer array, got dtype {ranks.dtype}")
    return ranks.astype(jnp.int32)


def check_attention_args(q, k, v, ranks, cutoffs, sinks, window) -> None:
    """The masked attention's inputs: q [B, S, Hq, D], k/v [B, S, Hkv, D], ranks/cutoffs int [B, Hkv, S]."""
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


def check_log_mass_args(q, k, lse, window, reduce: str = "sum", lookahead=None) -> None:
    """The future log-mass inputs: q [B, S, Hq, D], k [B, S, Hkv, D], lse [B, Hq, S] (or None), w >= 0,
    lookahead None or >= 0."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [B, S, H, D], got q {q.shape} and k {k.shape}")
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"k {k.shape} does not match q {q.shape} in batch, sequence or head_dim")
    if hq % k.shape[2]:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {k.shape[2]}")
    if lse is not None and lse.shape != (b, hq, s):
        raise ValueError(f"lse must be [B, Hq, S] = {(b, hq, s)}, got {lse.shape}")
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if lookahead is not None:
        check_int("lookahead", lookahead, 0)
