"""What the Pallas kernels and their XLA references share: constants, argument checks, padding.

The kernel package is a leaf (it imports only jax); `kvpop_jax` imports the checks and
constants from here, so a kernel and its reference reject the same inputs with the same
message.

Triton lowering needs power-of-2 block shapes and dot dimensions >= 16, so every
kernel wrapper pads the sequence to a multiple of its blocks and the head dim to a
power of 2 (>= 16) before `pallas_call`, and slices the padding off afterwards.
"""

from __future__ import annotations

import math
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
# Shapes (README, "How KVpop works in code"): q [B, S, Hq, D], k/v [B, S, Hkv, D], per-KV-head arrays [B, Hkv, S],
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


def check_array(name: str, x, ndim: int, what: str) -> None:
    """x is an array of `ndim` axes (`what` spells them, e.g. "[B, S, H, D]")."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"{name} must be an array {what}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(x.shape)}")


def check_float_inputs(**arrays) -> None:
    """Each named array holds floats: integer attention inputs would be truncated, not attended."""
    for name, x in arrays.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got dtype {x.dtype}")


def check_scale(scale) -> None:
    """None (D ** -0.5) or a finite number known when tracing: the kernels bake it in."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite Python number (static, not a traced array), got {scale!r}")


def check_qkv(q, k, v) -> None:
    """q [B, S, Hq, D] and k, v [B, T, Hkv, D] floats (v may be None), B, S >= 1, Hq a multiple of Hkv."""
    check_array("q", q, 4, "[B, S, Hq, D]")
    for name, x in (("k", k), ("v", v)):
        if x is not None:
            check_array(name, x, 4, "[B, T, Hkv, D]")
    check_float_inputs(q=q, k=k, **({} if v is None else {"v": v}))
    b, s, hq, d = q.shape
    if b < 1 or s < 1 or k.shape[1] < 1:
        raise ValueError(f"need at least one row, query and key: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[0] != b or k.shape[3] != d or (v is not None and v.shape[:3] != k.shape[:3]):
        more = "" if v is None else f", v {tuple(v.shape)}"
        raise ValueError(f"k{'' if v is None else ' and v'} must be [B, T, Hkv, D] matching q {tuple(q.shape)} in "
                         f"B and D, got k {tuple(k.shape)}{more}")
    if k.shape[2] < 1 or hq % k.shape[2]:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {k.shape[2]}")


def check_self_attention_qk(q, k) -> None:
    """`check_qkv` without v, and keys at the queries' own positions: k [B, S, Hkv, D]."""
    check_qkv(q, k, None)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in sequence length")


def check_attention_args(q, k, v, ranks, cutoffs, sinks, window, topk=None, scale=None) -> None:
    """The masked attention's inputs: q [B, S, Hq, D], k/v [B, S, Hkv, D] floats, ranks/cutoffs int
    [B, Hkv, S], s >= 0, w >= 1, k >= 0 (when given), a static scale."""
    check_qkv(q, k, v)
    b, s, hq, d = q.shape
    if k.shape != v.shape or k.shape[1] != s:  # check_qkv matched B and D
        raise ValueError(f"k and v must be [B, S, Hkv, D] matching q {tuple(q.shape)}, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    hkv = k.shape[2]
    for name, x in (("ranks", ranks), ("cutoffs", cutoffs)):
        check_array(name, x, 3, "int [B, Hkv, S]")
        if x.shape != (b, hkv, s) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be int [B, Hkv, S] = {(b, hkv, s)}, got {x.dtype}{tuple(x.shape)}")
    check_budget(sinks, window, topk)
    check_scale(scale)


def check_log_mass_args(q, k, lse, window, reduce: str = "sum", lookahead=None, scale=None) -> None:
    """The future log-mass inputs: q [B, S, Hq, D], k [B, S, Hkv, D] floats, lse float [B, Hq, S], w >= 0,
    lookahead None or >= 0, a static scale."""
    check_self_attention_qk(q, k)
    b, s, hq, d = q.shape
    check_array("lse", lse, 3, "float [B, Hq, S]")
    if lse.shape != (b, hq, s) or not jnp.issubdtype(lse.dtype, jnp.floating):
        raise ValueError(f"lse must be float [B, Hq, S] = {(b, hq, s)}, got {lse.dtype}{tuple(lse.shape)}")
    check_int("window", window, 0)
    check_scale(scale)
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if lookahead is not None:
        check_int("lookahead", lookahead, 0)


def check_dense_args(q, k, v, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, kv_valid=None,
                     scale=None) -> None:
    """Dense attention's inputs: q [B, S, Hq, D], k/v [B, T, Hkv, D] floats, int positions [B, S] / [B, T],
    int segment ids of the same shapes (both or neither), bool kv_valid [B, T], a static scale. The
    per-token arrays may have a batch axis of 1 (shared by every row)."""
    check_qkv(q, k, v)
    b, s = q.shape[:2]
    t = k.shape[1]
    arrays = dict(q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
                  kv_segment_ids=kv_segment_ids, kv_valid=kv_valid)
    for name, x in arrays.items():
        if x is None and name.endswith("positions"):
            raise ValueError(f"{name} is required (int [B, {'S' if name.startswith('q_') else 'T'}])")
        if x is None:
            continue
        kind, axis = ("bool" if name == "kv_valid" else "int"), ("S" if name.startswith("q_") else "T")
        shape = (b, s if axis == "S" else t)
        check_array(name, x, 2, f"{kind} [B, {axis}] = {shape}")
        if x.shape[0] not in (1, b) or x.shape[1] != shape[1] or \
                not jnp.issubdtype(x.dtype, jnp.bool_ if kind == "bool" else jnp.integer):
            raise ValueError(f"{name} must be {kind} [B, {axis}] = {shape}, got {x.dtype}{tuple(x.shape)}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give q_segment_ids and kv_segment_ids together, or neither")
    check_scale(scale)
