"""Future-attention target for the importance scorers (paper Section 3.2, Appendix D).

The target of key t is the attention mass it receives from the queries that come
after it has left the protected window, `d >= t + w` (Eq. 2, 31):

    log m̄_t^(h,g) = LSE_{d : t+w <= d < S} [ℓ^(h,g)(d, t) − LSE_d^(h,g)]

with `ℓ(d, t) = <q_d, k_t> · scale` and the per-query normalizer `LSE_d` (dense causal,
Eq. 28, or the sparse one returned by the masked attention pass, Eq. 9/34). The
blockwise pass below is the transposed attention of Appendix D.2: the keys own the
computation and a loop over blocks of query positions keeps an online log-sum-exp,
so no `S × S` array is ever built (memory O(S · block)).

Conventions:
  * q [B, S, Hq, D], k [B, S, Hkv, D]; query head h*G + g reads KV head h.
  * lse [B, Hq, S] float32, natural log.
  * A key with no future query (t + w >= S) has log m̄ = −inf exactly (the log of an
    empty sum); its target is then log(ε + 0) = log ε, finite. Inside the loops the
    running max starts at a finite −1e30 so that no inf − inf is ever formed.
  * Padding (`lengths`): a packed row's tail of padding queries gets the normalizer
    `PADDING_QUERY_LSE` = 1e4, so each of its terms is about exp(−1e4) = 0 next to any real
    query's; a key whose only future queries are padding has log m̄ ≈ −1e4 (finite, not −inf)
    and again the target log ε. N_t then counts the row's real queries.
  * `r_tgt = Agg_g log(ε + m^(g))` with `m = m̄ / N_t`, `N_t = max(1, S − (t + w))`
    (the main text's Eq. 2–3). Appendix B.2 instead puts ε before the count normalization,
    `log(ε + m̄) − log N_t`; we follow the main text. Max aggregation is
    `max_g log(ε + m^(g)) = log(ε + max_g m^(g))` (Eq. 3/14), mean is
    `log(ε + mean_g m^(g))` (Eq. 15, probability-space mean).
  * The target is a constant: every input passes through `stop_gradient`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from kvpop_jax import sharding as shd
from kvpop_jax.dispatch import Backend, Op
from pallas_kernels.common import NEG_INF, check_log_mass_args, check_scale, check_self_attention_qk
from pallas_kernels.future_lse import future_attention_log_mass_pallas

LogMassFn = Callable[..., jax.Array]
LOG_MASS_BLOCK = 128  # query (reference) or key (banded) positions per loop step


def _blocks(s: int, block_size: int) -> tuple[int, int, int]:
    """(block, number of blocks, padding) covering S positions."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    blk = min(block_size, s)
    nblk = -(-s // blk)
    return blk, nblk, nblk * blk - s


def _fold_query_block(carry, k_b, q_b, lse_b, t_pos, d_pos, *, s, window, horizon, scale, reduce):
    """One query block into the running (max, sum) of keys `t_pos` (Eq. 33, the future mask, online LSE)."""
    m, l = carry  # [B, Hkv, G, T] over the keys
    logits = jnp.einsum("bhtx,bhgjx->bhgtj", k_b, q_b, preferred_element_type=jnp.float32)
    logits = logits * scale - lse_b[:, :, :, None, :]  # Eq. 33: subtract the query normalizer
    ahead = d_pos[None, :] - t_pos[:, None]
    future = (ahead >= window) & (ahead <= horizon) & (d_pos[None, :] < s)  # [T, blk]
    logits = jnp.where(future, logits, -jnp.inf)
    m_new = jnp.maximum(m, logits.max(axis=-1))  # finite: m starts at NEG_INF
    if reduce == "max":
        return m_new, l
    return m_new, l * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(axis=-1)


def _finish_log_mass(m, l, reduce):
    """log m̄ (or the max logit) from the running (max, sum); −inf for keys with no future query."""
    if reduce == "max":
        return jnp.where(m <= NEG_INF, -jnp.inf, m)  # a NaN input stays NaN, as in the kernels
    return jnp.where(l <= 0, -jnp.inf, m + jnp.log(jnp.where(l <= 0, 1.0, l)))


def future_attention_log_mass_reference(
    q: jax.Array,
    k: jax.Array,
    lse: jax.Array,
    *,
    window: int,
    scale: float | None = None,
    block_size: int = LOG_MASS_BLOCK,
    reduce: str = "sum",
    lookahead: int | None = None,
) -> jax.Array:
    """log m̄_t (Eq. 31) by the transposed blockwise pass in plain XLA (Appendix D.2).

    Args:
      q: [B, S, Hq, D] queries; k: [B, S, Hkv, D] keys (any float dtype).
      lse: [B, Hq, S] per-query log-normalizers (natural log), dense or sparse.
      window: w >= 0; key t collects mass from queries d with t + w <= d < S.
      scale: logit scale, default D ** -0.5.
      block_size: query positions per loop step; memory is O(B · Hq · S · block).
      reduce: "sum" (the paper's Eq. 31) or "max": log max_d exp(ℓ(d, t) − LSE_d), the
        strongest single future read of key t (an option beyond the paper).
      lookahead: L (App. B.2), None = unbounded: only queries t + w <= d <= t + w + L count.

    Returns:
      float32 [B, Hq, S]: log m̄_t^(h,g) per query head and key position; −inf for keys
      with no future query (t + w >= S). Not differentiated (inputs are stop-gradient).
    """
    check_log_mass_args(q, k, lse, window, reduce, lookahead, scale)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    q, k, lse = (jax.lax.stop_gradient(x) for x in (q, k, lse))
    horizon = s if lookahead is None else window + lookahead  # d - t <= horizon
    blk, nblk, pad = _blocks(s, block_size)

    qg = jnp.pad(q.reshape(b, s, hkv, g, d), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    q_blocks = qg.reshape(b, nblk, blk, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)  # [N, B, Hkv, G, blk, D]
    lse_g = jnp.pad(lse.astype(jnp.float32).reshape(b, hkv, g, s), ((0, 0), (0, 0), (0, 0), (0, pad)))
    lse_blocks = lse_g.reshape(b, hkv, g, nblk, blk).transpose(3, 0, 1, 2, 4)  # [N, B, Hkv, G, blk]
    starts = jnp.arange(nblk, dtype=jnp.int32) * blk
    k_h = k.transpose(0, 2, 1, 3)  # [B, Hkv, S, D]: the keys are the transposed pass's queries
    t_pos = jnp.arange(s, dtype=jnp.int32)

    fold = functools.partial(_fold_query_block, s=s, window=window, horizon=horizon, scale=scale, reduce=reduce)

    def step(carry, xs):
        q_b, lse_b, start = xs
        return fold(carry, k_h, q_b, lse_b, t_pos, start + jnp.arange(blk, dtype=jnp.int32)), None

    init = (jnp.full((b, hkv, g, s), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, s), jnp.float32))
    (m, l), _ = jax.lax.scan(step, init, (q_blocks, lse_blocks, starts))
    log_mass = _finish_log_mass(m, l, reduce)
    return log_mass.reshape(b, hq, s)


def future_attention_log_mass_banded(
    q: jax.Array,
    k: jax.Array,
    lse: jax.Array,
    *,
    window: int,
    scale: float | None = None,
    block_size: int = LOG_MASS_BLOCK,
    reduce: str = "sum",
    lookahead: int | None = None,
) -> jax.Array:
    """`future_attention_log_mass_reference` visiting only the query blocks a key block can see.

    Same arguments and result. The keys own the work (Appendix D.2's transposed pass, the
    shape of a flash-attention dK/dV loop): key block [t0, t1] runs over the query blocks
    holding d in [t0 + w, t1 + w + L] only, so the pass does about half the reference's
    work without a lookahead (the future triangle, not the square) and O(S · (L + 2 · block))
    with one. The masks are evaluated exactly as in the reference.
    """
    check_log_mass_args(q, k, lse, window, reduce, lookahead, scale)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    q, k, lse = (jax.lax.stop_gradient(x) for x in (q, k, lse))
    horizon = s if lookahead is None else window + lookahead  # d - t <= horizon
    blk, nblk, pad = _blocks(s, block_size)

    q_h = jnp.pad(q.reshape(b, s, hkv, g, d), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0))).transpose(0, 2, 3, 1, 4)
    lse_h = jnp.pad(lse.astype(jnp.float32).reshape(b, hkv, g, s), ((0, 0), (0, 0), (0, 0), (0, pad)))
    k_blocks = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nblk, blk, hkv, d).transpose(1, 0, 3, 2, 4)
    starts = jnp.arange(nblk, dtype=jnp.int32) * blk
    fold = functools.partial(_fold_query_block, s=s, window=window, horizon=horizon, scale=scale, reduce=reduce)

    def key_block(xs):
        k_b, t0 = xs  # [B, Hkv, blk, D]
        t_pos = t0 + jnp.arange(blk, dtype=jnp.int32)

        def query_block(i, carry):
            d0 = i * blk
            q_b = jax.lax.dynamic_slice_in_dim(q_h, d0, blk, axis=3)
            lse_b = jax.lax.dynamic_slice_in_dim(lse_h, d0, blk, axis=3)
            return fold(carry, k_b, q_b, lse_b, t_pos, d0 + jnp.arange(blk, dtype=jnp.int32))

        first = (t0 + window) // blk
        last = jnp.minimum(nblk - 1, (t0 + blk - 1 + horizon) // blk)
        init = (jnp.full((b, hkv, g, blk), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, blk), jnp.float32))
        return jax.lax.fori_loop(first, last + 1, query_block, init)

    m, l = jax.lax.map(key_block, (k_blocks, starts))  # [N, B, Hkv, G, blk]
    m, l = (x.transpose(1, 2, 3, 0, 4).reshape(b, hkv, g, nblk * blk)[..., :s] for x in (m, l))
    return _finish_log_mass(m, l, reduce).reshape(b, hq, s)


def future_attention_log_mass_dense(
    q: jax.Array,
    k: jax.Array,
    lse: jax.Array,
    *,
    window: int,
    scale: float | None = None,
    block_size: int = 128,
    reduce: str = "sum",
    lookahead: int | None = None,
) -> jax.Array:
    """Brute-force check of `future_attention_log_mass_reference` (materializes [B, Hq, S, S]).

    Same signature and result; `block_size` is accepted and ignored.
    """
    del block_size
    check_log_mass_args(q, k, lse, window, reduce, lookahead, scale)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    q, k, lse = (jax.lax.stop_gradient(x) for x in (q, k, lse))
    qg = q.reshape(b, s, hkv, g, d)
    logits = jnp.einsum("bdhgx,bthx->bhgdt", qg, k, preferred_element_type=jnp.float32) * scale
    logits = logits - lse.astype(jnp.float32).reshape(b, hkv, g, s)[..., None]  # ℓ(d, t) − LSE_d
    pos = jnp.arange(s)
    future = pos[:, None] >= pos[None, :] + window  # [d, t]
    if lookahead is not None:
        future &= pos[:, None] <= pos[None, :] + window + lookahead
    logits = jnp.where(future, logits, -jnp.inf)
    if reduce == "max":
        return logits.max(axis=-2).reshape(b, hq, s)
    return jax.nn.logsumexp(logits, axis=-2).reshape(b, hq, s)  # Eq. 31: reduce over d


def dense_lse(
    q: jax.Array,
    k: jax.Array,
    *,
    scale: float | None = None,
    block_size: int = 128,
) -> jax.Array:
    """Dense causal log-normalizer LSE_d (Eq. 28), blockwise over keys.

    Args:
      q: [B, S, Hq, D]; k: [B, S, Hkv, D].
      scale: logit scale, default D ** -0.5.
      block_size: key positions per loop step; memory is O(B · Hq · S · block).

    Returns:
      float32 [B, Hq, S], finite (every query sees at least key 0). Stop-gradient.
    """
    check_self_attention_qk(q, k)
    check_scale(scale)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    blk, nblk, pad = _blocks(s, block_size)
    qg = q.reshape(b, s, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, S, D]
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    k_blocks = kp.reshape(b, nblk, blk, hkv, d).transpose(1, 0, 3, 2, 4)  # [N, B, Hkv, blk, D]
    starts = jnp.arange(nblk, dtype=jnp.int32) * blk
    d_pos = jnp.arange(s, dtype=jnp.int32)

    def step(carry, xs):
        m, l = carry  # [B, Hkv, G, S]
        k_b, start = xs
        t_pos = start + jnp.arange(blk, dtype=jnp.int32)
        logits = jnp.einsum("bhgdx,bhtx->bhgdt", qg, k_b, preferred_element_type=jnp.float32) * scale
        causal = (t_pos[None, :] <= d_pos[:, None]) & (t_pos[None, :] < s)
        logits = jnp.where(causal, logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        l = l * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(axis=-1)
        return (m_new, l), None

    init = (jnp.full((b, hkv, g, s), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, s), jnp.float32))
    (m, l), _ = jax.lax.scan(step, init, (k_blocks, starts))
    return (m + jnp.log(l)).reshape(b, hq, s)


def _pallas(interpret: bool):
    def run(q, k, lse, *, window, scale=None, reduce="sum", lookahead=None):
        kernel = functools.partial(future_attention_log_mass_pallas, window=window, scale=scale, reduce=reduce,
                                   lookahead=lookahead, interpret=interpret)
        return shd.shard_kernel(kernel, ("BSHD", "BSHD", "BHS"), "BHS")(q, k, lse)

    return run


def _banded_preferred(q, k, lse, *, window, scale=None, reduce="sum", lookahead=None):
    """More than one block of queries: then the banded pass skips work (the masked triangle)."""
    del k, lse, window, scale, reduce, lookahead
    return q.shape[1] > LOG_MASS_BLOCK


FUTURE_ATTENTION_LOG_MASS = Op(
    "future_attention_log_mass", "KVPOP_FUTURE_LSE_IMPL",
    {
        "xla": Backend(future_attention_log_mass_reference),
        "xla_sparse": Backend(future_attention_log_mass_banded, preferred=_banded_preferred),
        "pallas": Backend(_pallas(False), platforms=("gpu",)),
        "pallas_interpret": Backend(_pallas(True)),
    },
    auto=("pallas", "xla_sparse", "xla"),
)


def future_attention_log_mass(q, k, lse, *, window: int, scale: float | None = None, reduce: str = "sum",
                              lookahead: int | None = None, implementation: str | None = None) -> jax.Array:
    """log m̄_t (Eq. 31) on the back end `FUTURE_ATTENTION_LOG_MASS` picks (contract of the reference).

    implementation: "xla" (`future_attention_log_mass_reference`), "xla_sparse"
    (`future_attention_log_mass_banded`: only the query blocks a key block can see), "pallas"
    (`pallas_kernels.future_lse`) or "pallas_interpret". None reads `$KVPOP_FUTURE_LSE_IMPL`,
    else picks the kernel on GPU and the banded XLA pass elsewhere. Under an active mesh the kernel
    runs in shard_map over batch and heads. `reduce` ("sum" | "max") and `lookahead` (L) are
    part of the contract.
    """
    return FUTURE_ATTENTION_LOG_MASS(q, k, lse, window=window, scale=scale, reduce=reduce, lookahead=lookahead,
                                     implementation=implementation)


# The normalizer given to padding queries: ℓ(d, t) − LSE_d is then about −1e4, so exp() of it is 0 next to
# any real query's term, and a key whose only future queries are padding gets log m̄ ≈ −1e4 (target log ε).
# Finite, so that the kernels' running max (which starts at −1e30) never meets an inf − inf or, as it would
# at −1e30 itself, counts a padding query as exp(0).
PADDING_QUERY_LSE = 1e4


def future_query_count(seq_len: int, window: int, lookahead: int | None = None,
                       lengths: jax.Array | None = None) -> jax.Array:
    """N_t = max(1, S − (t + w)) (Eq. 2 / 16), clipped to L + 1 with a lookahead L (B.2); float32 [S].

    lengths: int [B], the real (non-padding) tokens leading each row; S is then each row's own length
    and the result is [B, S]."""
    t = jnp.arange(seq_len, dtype=jnp.float32)
    end = float(seq_len) if lengths is None else jnp.minimum(lengths, seq_len).astype(jnp.float32)[:, None]
    count = jnp.maximum(1.0, end - (t + window))
    return count if lookahead is None else jnp.minimum(count, lookahead + 1.0)


def mask_padding_queries(lse: jax.Array, lengths: jax.Array) -> jax.Array:
    """lse [B, Hq, S] with the queries at or past each row's length (int [B]) set to `PADDING_QUERY_LSE`:
    every log-mass implementation then gives them no mass (module docstring, "Padding")."""
    pos = jnp.arange(lse.shape[-1])
    return jnp.where(pos[None, None, :] >= lengths[:, None, None], PADDING_QUERY_LSE, lse.astype(jnp.float32))


def future_attention_target(
    q: jax.Array,
    k: jax.Array,
    lse: jax.Array,
    *,
    window: int,
    eps: float,
    aggregate: str = "max",
    normalize: bool = True,
    scale: float | None = None,
    log_mass_fn: LogMassFn | None = None,
    reduce: str = "sum",
    lookahead: int | None = None,
    lengths: jax.Array | None = None,
) -> jax.Array:
    """Future-utility target r_tgt per KV head (Eq. 2–3).

    `r_tgt[b, h, t] = log(ε + Agg_g m_t^(h,g))` with `m = m̄ / N_t` when `normalize`
    (else `m = m̄`), Agg = max (Eq. 14) or probability-space mean (Eq. 15). Computed in
    log space (`logaddexp(log ε, ·)`), so tiny masses never underflow to log ε early.

    Args:
      q: [B, S, Hq, D] and k: [B, S, Hkv, D], the student's own queries and keys.
      lse: [B, Hq, S] per-query normalizers: sparse (from the masked pass, Eq. 9) or
        dense (`dense_lse`, Eq. 28). With the sparse normalizer m̄ may exceed 1.
      window: w; eps: ε > 0 inside the log.
      aggregate: "max" or "mean" over the G query heads sharing a KV head.
      normalize: divide by the future-query count N_t (Eq. 2 / 16).
      scale: logit scale, default D ** -0.5.
      log_mass_fn: computes log m̄ with `future_attention_log_mass`'s signature (reduce
        included); default that dispatcher.
      reduce: "sum" (the paper) or "max": m_t is the largest single future attention
        probability of key t (no count normalization: `normalize` is ignored). A key read
        once, decisively, then ranks above keys that collect small leaks from many queries.
      lookahead: L (App. B.2): only the queries t + w <= d <= t + w + L count, and N_t <= L + 1.
      lengths: int [B] or None: row b's first `lengths[b]` tokens are real and the rest padding
        (a packed row's tail, `train.packing`). Padding queries then count for nothing, in the
        mass and in N_t: the target is the one row b would have on its own. None: every query counts.

    Returns:
      float32 [B, Hkv, S], finite; keys without future queries get log ε. A constant:
      no gradient flows to q, k or lse.
    """
    check_log_mass_args(q, k, lse, window, reduce, lookahead, scale)
    if aggregate not in ("max", "mean"):
        raise ValueError(f"aggregate must be 'max' or 'mean', got {aggregate!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    b, s, hq, _ = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    if lengths is not None:
        lengths = jnp.asarray(lengths)
        if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"lengths must be int [B] = [{b}], got {lengths.dtype} {lengths.shape}")
        lse = mask_padding_queries(lse, lengths)
    q, k, lse = (jax.lax.stop_gradient(x) for x in (q, k, lse))
    log_mass_fn = future_attention_log_mass if log_mass_fn is None else log_mass_fn
    log_m = log_mass_fn(q, k, lse, window=window, scale=scale, reduce=reduce, lookahead=lookahead)
    log_m = log_m.astype(jnp.float32).reshape(b, hkv, g, s)
    if normalize and reduce == "sum":
        count = future_query_count(s, window, lookahead, lengths)  # Eq. 2, B.2
        log_m = log_m - jnp.log(count if lengths is None else count[:, None, None])
    if aggregate == "max":
        log_agg = log_m.max(axis=2)  # Eq. 14
    else:
        log_agg = jax.nn.logsumexp(log_m, axis=2) - math.log(g)  # Eq. 15
    return jax.lax.stop_gradient(jnp.logaddexp(math.log(eps), log_agg))  # Eq. 3
