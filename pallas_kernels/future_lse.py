"""Transposed future-LSE pass (paper Appendix D.2) as a Pallas kernel for the Triton lowering.

`future_attention_log_mass_pallas` has the contract of
`kvpop_jax.targets.future_attention_log_mass_reference`: for every query head and key t,

    log m̄_t = LSE_{d : t+w <= d < S} [<q_d, k_t> · scale − LSE_d]        (Eq. 31)

(`reduce="sum"`; `reduce="max"` keeps the running max instead of the log-sum-exp: the
strongest single future read) and exactly −inf where no query lies that far ahead (t + w >= S).

Shape of the kernel: the dK/dV loop of flash attention's backward with the roles kept.
One program per (batch, query head, key block) holds its keys `[block_k, D]` and loops
over the query blocks that can hold a d >= t + w (earlier blocks are skipped by the loop
bound, later ones by nothing: every one of them contributes), subtracting the per-query
normalizer and keeping an online log-sum-exp `(m, l)` per key in float32 (base 2 inside,
natural log out). No value tensor, no `S × S` array. Query head h*G + g reads KV head h.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (LN2, LOG2E, NEG_INF, check_log_mass_args, fit_block, pad_axis, padded_head_dim,
                                   round_up)


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    window: int
    seq_len: int  # S before padding
    groups: int  # G = Hq / Hkv
    block_k: int
    block_q: int
    num_warps: int
    num_stages: int
    interpret: bool
    reduce: str  # "sum" (Eq. 31) or "max"
    horizon: int  # queries with d - t <= horizon count (w + L with a lookahead L, else S)


def _future_lse_kernel(k_ref, q_ref, lse_ref, out_ref, *, st: _Static):
    """Keys [bk, D] of this program vs all later query blocks; writes log m̄ [bk]."""
    bk, bq = st.block_k, st.block_q
    k_start = pl.program_id(2) * bk
    k = k_ref[...]
    t_pos = k_start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    logit_scale = st.scale * LOG2E  # base-2 logits: exp2 is the native instruction

    def body(i, carry):
        m_prev, l_prev = carry
        d_start = i * bq
        q = q_ref[pl.ds(d_start, bq), :]
        lse2 = lse_ref[pl.ds(d_start, bq)] * LOG2E
        d_pos = d_start + lax.broadcasted_iota(jnp.int32, (bq,), 0)
        ahead = d_pos[None, :] - t_pos[:, None]
        future = (ahead >= st.window) & (ahead <= st.horizon) & (d_pos < st.seq_len)[None, :]
        logits = lax.dot_general(k, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = jnp.where(future, logits * logit_scale - lse2[None, :], NEG_INF)  # Eq. 33
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(future, jnp.exp2(s - m_next[:, None]), 0.0)
        l_next = l_prev * jnp.exp2(m_prev - m_next) + jnp.sum(p, axis=1)
        return m_next, l_next

    first_q_block = lax.div(k_start + st.window, bq)  # the block holding d = k_start + w
    last_needed = jnp.minimum(k_start + bk - 1 + st.horizon, st.seq_len - 1)  # the latest query any key reads
    num_q_blocks = lax.div(last_needed, bq) + 1  # blocks of padding (or beyond the lookahead) are never read
    init = (jnp.full((bk,), NEG_INF, jnp.float32), jnp.zeros((bk,), jnp.float32))
    m, l = lax.fori_loop(first_q_block, num_q_blocks, body, init)
    has_future = ~(l <= 0.0)  # l >= 1 as soon as one query is in the future of t; a NaN stays NaN
    log_mass = (m if st.reduce == "max" else m + jnp.log2(jnp.where(has_future, l, 1.0))) * LN2
    out_ref[...] = jnp.where(has_future, log_mass, -jnp.inf)


def _future_lse_padded(st: _Static, q, k, lse):
    b, s_pad, hq, d = q.shape
    g, bk = st.groups, st.block_k
    return pl.pallas_call(
        functools.partial(_future_lse_kernel, st=st),
        grid=(b, hq, s_pad // bk),
        in_specs=[
            pl.BlockSpec((None, bk, None, d), lambda i, h, kb: (i, kb, h // g, 0)),
            pl.BlockSpec((None, s_pad, None, d), lambda i, h, kb: (i, 0, h, 0)),
            pl.BlockSpec((None, None, s_pad), lambda i, h, kb: (i, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bk), lambda i, h, kb: (i, h, kb)),
        out_shape=jax.ShapeDtypeStruct((b, hq, s_pad), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages),
        interpret=st.interpret,
        name="kvpop_future_lse",
    )(k, q, lse)


def future_attention_log_mass_pallas(q, k, lse, *, window: int, scale: float | None = None, reduce: str = "sum",
                                     lookahead: int | None = None, interpret: bool = False, block_k: int = 64,
                                     block_q: int = 64, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """log m̄_t (Eq. 31) by the Pallas transposed pass; contract of `future_attention_log_mass_reference`.

    Args:
      q: [B, S, Hq, D] queries; k: [B, S, Hkv, D] keys (query head h*G + g reads KV head h).
      lse: [B, Hq, S] per-query log-normalizers (natural log), dense or sparse.
      window: w >= 0; key t collects mass from queries d with t + w <= d < S.
      scale: logit scale, default D ** -0.5.
      reduce: "sum" (Eq. 31) or "max" (log of the largest single future attention weight).
      lookahead: L (App. B.2): only queries t + w <= d <= t + w + L count; None = all later ones.
      interpret: run in Pallas interpret mode (CPU tests).
      block_k, block_q: keys per program and queries per loop step; powers of 2 >= 16,
        shrunk to the padded sequence when S is short.
      num_warps, num_stages: Triton launch parameters.

    Returns:
      float32 [B, Hq, S]: log m̄ per query head and key; exactly −inf where t + w >= S.
      A constant (inputs pass through `stop_gradient`).

    S is padded to a multiple of the blocks and D to a power of 2 >= 16 inside; padded
    queries are masked and padded keys dropped.
    """
    check_log_mass_args(q, k, lse, window, reduce, lookahead, scale)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    blocks = [fit_block(x, s) for x in (block_k, block_q)]
    s_pad = round_up(s, max(blocks))
    d_pad = padded_head_dim(d)
    st = _Static(
        scale=float(d**-0.5 if scale is None else scale),
        window=int(window),
        seq_len=s,
        groups=hq // hkv,
        block_k=blocks[0],
        block_q=blocks[1],
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=bool(interpret),
        reduce=reduce,
        horizon=s if lookahead is None else int(window) + int(lookahead),
    )
    q, k, lse = (lax.stop_gradient(x) for x in (q, k, lse))
    if q.dtype != k.dtype:  # one dot operand type; the reference accumulates in f32 either way
        q, k = (x.astype(jnp.promote_types(q.dtype, k.dtype)) for x in (q, k))
    q_p = pad_axis(pad_axis(q, 1, s_pad), 3, d_pad)
    k_p = pad_axis(pad_axis(k, 1, s_pad), 3, d_pad)
    lse_p = pad_axis(lse.astype(jnp.float32), 2, s_pad)
    return _future_lse_padded(st, q_p, k_p, lse_p)[:, :, :s]
