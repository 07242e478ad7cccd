"""Flash attention under the KVpop mask: Pallas kernels for the Triton lowering.

`kvpop_attention_pallas` has the signature of `kvpop_jax.attention.kvpop_attention_reference`
(plus `interpret` and block sizes; `kvpop_jax.attention.kvpop_attention` dispatches to it) and returns the same `(out, lse)`. Key t is kept for
query q iff `t <= q ∧ (t < s ∨ q − t < w ∨ (s <= t <= q − w ∧ rank(t) <= τ_q))` (paper
Eq. 26); the mask is evaluated per tile from positions, ranks and cutoffs, never stored.

Forward: one program per (batch, query head, query block) loops over key blocks with the
flash-attention carries (acc, m, l) and writes the output and the natural-log LSE.
Backward (`jax.custom_vjp`, reusing that LSE): a dQ kernel shaped like the forward, and a
dK/dV kernel where each (batch, KV head, key block) program loops over the G query heads
of its group and over query blocks. The LSE output is differentiable too: its cotangent
folds into the softmax-backward term (ds = p · (dp − δ + dlse)) at no extra cost.

Block skipping. A (query block, key block) tile is visited only if it can hold a kept
entry: the key block is causal for the query block and either holds a sink, overlaps the
window, or overlaps the eligible range with a key whose rank is <= the largest cutoff in
the query block. The per-block bounds (min rank of the key block, max cutoff of the query
block) are two small reductions of the tiles of `ranks`/`cutoffs`, which are read anyway.
A skipped tile has no kept entry, and a visited tile adds exactly 0 for its masked
entries, so skipping never changes results (not even in the last bit).

CUDA lowering is tested on CPU with `jax.export(..., platforms=["cuda"])`. With jaxlib <=
0.10.2 that runs Pallas' lowering to Triton IR (custom call `__gpu$xla.gpu.triton`); the
Triton compiler passes (layouts, shared memory, PTX) only run when XLA compiles for a GPU.
Later jaxlibs compile the kernel at lowering time (`triton_kernel_call_ffi`).

The tile helpers and `dkdv_call` are shared with `compacted_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    BIG_RANK,
    LN2,
    LOG2E,
    NEG_INF,
    check_attention_args,
    fit_block,
    pad_axis,
    padded_head_dim,
    round_up,
)


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Everything static about one call (hashable: the custom_vjp's non-diff argument)."""

    scale: float
    sinks: int
    window: int
    seq_len: int  # S before padding
    groups: int  # G = Hq / Hkv
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int
    num_stages: int
    interpret: bool

    def compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def dot_f32(a, b, contract_a: int, contract_b: int):
    """2-D matmul contracting `a`'s dim `contract_a` with `b`'s dim `contract_b`, f32 accumulation."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def tile_mask(q_pos, k_pos, ranks, cutoffs, st: StaticArgs):
    """bool [bq, bk]: the KVpop mask on one tile; padded queries and keys are masked out."""
    diff = q_pos[:, None] - k_pos[None, :]
    is_sink = (k_pos < st.sinks)[None, :]
    long_range = (k_pos >= st.sinks)[None, :] & (diff >= st.window) & (ranks[None, :] <= cutoffs[:, None])
    valid = (q_pos < st.seq_len)[:, None] & (k_pos < st.seq_len)[None, :]
    return valid & (diff >= 0) & (is_sink | (diff < st.window) | long_range)


def tile_may_keep(q_start, k_start, k_pos, ranks, cutoffs, bq: int, bk: int, st: StaticArgs):
    """Scalar bool: can the tile (queries q_start.., keys k_start..) hold any kept entry?"""
    q_last = q_start + bq - 1
    k_last = k_start + bk - 1
    best_rank = jnp.min(jnp.where(k_pos >= st.sinks, ranks, BIG_RANK))
    long_range = (jnp.maximum(k_start, st.sinks) <= q_last - st.window) & (best_rank <= jnp.max(cutoffs))
    return (k_start <= q_last) & ((k_start < st.sinks) | (k_last > q_start - st.window) | long_range)


def _forward_kernel(q_ref, k_ref, v_ref, ranks_ref, cut_ref, o_ref, lse_ref, *, st: StaticArgs):
    bq, bk = st.block_q, st.block_k
    q_start = pl.program_id(2) * bq
    q = q_ref[...]
    cutoffs = cut_ref[...]
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq,), 0)

    def body(j, carry):
        k_start = j * bk
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        ranks = ranks_ref[pl.ds(k_start, bk)]

        def visit(carry):
            k = k_ref[pl.ds(k_start, bk), :]
            v = v_ref[pl.ds(k_start, bk), :]
            mask = tile_mask(q_pos, k_pos, ranks, cutoffs, st)
            return online_softmax_step(carry, q, k, v, mask, st.scale)

        keep = tile_may_keep(q_start, k_start, k_pos, ranks, cutoffs, bq, bk, st)
        return lax.cond(keep, visit, lambda c: c, carry)

    num_k_blocks = lax.div(q_start + bq + bk - 1, bk)  # causal: keys up to the last query
    carry = lax.fori_loop(0, num_k_blocks, body, online_softmax_init(bq, q.shape[-1]))
    online_softmax_finish(carry, o_ref, lse_ref)


def online_softmax_init(rows: int, head_dim: int):
    """Flash-attention carries (acc [rows, D], running max m [rows], sum l [rows]), base 2."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), NEG_INF, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def online_softmax_step(carry, q, k, v, mask, scale: float):
    """Folds one tile of keys into the carries; masked entries add exactly 0."""
    acc, m_prev, l_prev = carry
    s = jnp.where(mask, dot_f32(q, k, 1, 1) * (scale * LOG2E), NEG_INF)  # exp2 is the native instruction
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp2(m_prev - m_next)
    p = jnp.where(mask, jnp.exp2(s - m_next[:, None]), 0.0)
    l_next = l_prev * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + dot_f32(p.astype(v.dtype), v, 1, 0)
    return acc, m_next, l_next


def online_softmax_finish(carry, o_ref, lse_ref):
    """Writes out = acc / l and the natural-log LSE; rows with no key (padding) get 0 and NEG_INF."""
    acc, m, l = carry
    has_keys = ~(l <= 0.0)  # False only for padded queries (window >= 1 keeps t = q); NaN stays NaN
    l_safe = jnp.where(has_keys, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_keys, (m + jnp.log2(l_safe)) * LN2, NEG_INF)


def softmax_grad_tile(q, k, v, do, lse2, delta, mask, scale: float):
    """p and ds = p * (dp - δ) of one tile, from the saved base-2 LSE (no renormalization)."""
    p = jnp.where(mask, jnp.exp2(dot_f32(q, k, 1, 1) * (scale * LOG2E) - lse2[:, None]), 0.0)
    return p, p * (dot_f32(do, v, 1, 1) - delta[:, None])


def _forward(st: StaticArgs, q, k, v, ranks, cutoffs):
    b, s_pad, hq, d = q.shape
    g, bq = st.groups, st.block_q
    grid = (b, hq, s_pad // bq)
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, h, qb: (i, qb, h, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, d), lambda i, h, qb: (i, 0, h // g, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        grid=grid,
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, None, s_pad), lambda i, h, qb: (i, h // g, 0)),
            pl.BlockSpec((None, None, bq), lambda i, h, qb: (i, h // g, qb)),
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, h, qb: (i, h, qb))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, hq, s_pad), jnp.float32),
        ],
        compiler_params=st.compiler_params(),
        interpret=st.interpret,
        name="kvpop_sparse_attention_fwd",
    )(q, k, v, ranks, cutoffs)


def _dq_kernel(q_ref, k_ref, v_ref, ranks_ref, cut_ref, do_ref, lse_ref, delta_ref, dq_ref, *, st):
    bq, bk = st.block_q_bwd, st.block_k_bwd
    q_start = pl.program_id(2) * bq
    q = q_ref[...]
    do = do_ref[...]
    cutoffs = cut_ref[...]
    lse2 = lse_ref[...] * LOG2E
    delta = delta_ref[...]
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq,), 0)

    def body(j, dq):
        k_start = j * bk
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        ranks = ranks_ref[pl.ds(k_start, bk)]

        def visit(dq):
            k = k_ref[pl.ds(k_start, bk), :]
            v = v_ref[pl.ds(k_start, bk), :]
            mask = tile_mask(q_pos, k_pos, ranks, cutoffs, st)
            _, ds = softmax_grad_tile(q, k, v, do, lse2, delta, mask, st.scale)
            return dq + dot_f32(ds.astype(k.dtype), k, 1, 0)

        keep = tile_may_keep(q_start, k_start, k_pos, ranks, cutoffs, bq, bk, st)
        return lax.cond(keep, visit, lambda c: c, dq)

    num_k_blocks = lax.div(q_start + bq + bk - 1, bk)
    dq = lax.fori_loop(0, num_k_blocks, body, jnp.zeros((bq, q.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, ranks_ref, cut_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, st):
    bq, bk = st.block_q_bwd, st.block_k_bwd
    k_start = pl.program_id(2) * bk
    k = k_ref[...]
    v = v_ref[...]
    ranks = ranks_ref[...]
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    num_q_blocks = q_ref.shape[0] // bq

    def group_body(g, carry):
        def query_body(i, carry):
            dk, dv = carry
            q_start = i * bq
            q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq,), 0)
            cutoffs = cut_ref[pl.ds(q_start, bq)]

            def visit(carry):
                dk, dv = carry
                q = q_ref[pl.ds(q_start, bq), g, :]
                do = do_ref[pl.ds(q_start, bq), g, :]
                lse2 = lse_ref[g, pl.ds(q_start, bq)] * LOG2E
                delta = delta_ref[g, pl.ds(q_start, bq)]
                mask = tile_mask(q_pos, k_pos, ranks, cutoffs, st)
                p, ds = softmax_grad_tile(q, k, v, do, lse2, delta, mask, st.scale)
                dv = dv + dot_f32(p.astype(do.dtype), do, 0, 0)
                dk = dk + dot_f32(ds.astype(q.dtype), q, 0, 0)
                return dk, dv

            keep = tile_may_keep(q_start, k_start, k_pos, ranks, cutoffs, bq, bk, st)
            return lax.cond(keep, visit, lambda c: c, carry)

        first_q_block = lax.div(k_start, bq)  # causal: queries from the first key on
        return lax.fori_loop(first_q_block, num_q_blocks, query_body, carry)

    zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(0, st.groups, group_body, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_call(st: StaticArgs, q, k, v, ranks, cutoffs, do, lse, delta):
    b, s_pad, hq, d = q.shape
    g, bq = st.groups, st.block_q_bwd
    q_tile = pl.BlockSpec((None, bq, None, d), lambda i, h, qb: (i, qb, h, 0))
    kv_full = pl.BlockSpec((None, s_pad, None, d), lambda i, h, qb: (i, 0, h // g, 0))
    row_tile = pl.BlockSpec((None, None, bq), lambda i, h, qb: (i, h, qb))
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(b, hq, s_pad // bq),
        in_specs=[
            q_tile,
            kv_full,
            kv_full,
            pl.BlockSpec((None, None, s_pad), lambda i, h, qb: (i, h // g, 0)),
            pl.BlockSpec((None, None, bq), lambda i, h, qb: (i, h // g, qb)),
            q_tile,
            row_tile,
            row_tile,
        ],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="kvpop_sparse_attention_dq",
        compiler_params=st.compiler_params(),
        interpret=st.interpret,
    )(q, k, v, ranks, cutoffs, do, lse, delta)


def dkdv_call(st: StaticArgs, q, k, v, ranks, cutoffs, do, lse, delta):
    """dK, dV: one program per (batch, KV head, key block), looping over its G query heads."""
    b, s_pad, hq, d = q.shape
    hkv = k.shape[2]
    g, bk = st.groups, st.block_k_bwd
    q_group = pl.BlockSpec((None, s_pad, g, d), lambda i, h, kb: (i, 0, h, 0))
    kv_tile = pl.BlockSpec((None, bk, None, d), lambda i, h, kb: (i, kb, h, 0))
    rows_group = pl.BlockSpec((None, g, s_pad), lambda i, h, kb: (i, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st),
        grid=(b, hkv, s_pad // bk),
        in_specs=[
            q_group,
            kv_tile,
            kv_tile,
            pl.BlockSpec((None, None, bk), lambda i, h, kb: (i, h, kb)),
            pl.BlockSpec((None, None, s_pad), lambda i, h, kb: (i, h, 0)),
            q_group,
            rows_group,
            rows_group,
        ],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="kvpop_sparse_attention_dkdv",
        compiler_params=st.compiler_params(),
        interpret=st.interpret,
    )(q, k, v, ranks, cutoffs, do, lse, delta)
    return dk, dv


def softmax_backward_delta(out, d_out, d_lse):
    """δ [B, H, S] = Σ_d out·dout − dlse: the softmax-backward row term, LSE cotangent included
    (d lse / d logit = p, so dlse enters every ds = p · (dp − δ) as −dlse)."""
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32))
    return delta - d_lse.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse_attention_padded(st: StaticArgs, q, k, v, ranks, cutoffs):
    return _forward(st, q, k, v, ranks, cutoffs)


def _padded_fwd(st: StaticArgs, q, k, v, ranks, cutoffs):
    out, lse = _forward(st, q, k, v, ranks, cutoffs)
    return (out, lse), (q, k, v, ranks, cutoffs, out, lse)


def _padded_bwd(st: StaticArgs, residuals, cotangents):
    q, k, v, ranks, cutoffs, out, lse = residuals
    d_out, d_lse = cotangents
    delta = softmax_backward_delta(out, d_out, d_lse)
    args = (st, q, k, v, ranks, cutoffs, d_out.astype(q.dtype), lse, delta)
    dk, dv = dkdv_call(*args)
    return _dq_call(*args), dk, dv, None, None


_sparse_attention_padded.defvjp(_padded_fwd, _padded_bwd)


def kvpop_attention_pallas(q, k, v, ranks, cutoffs, *, sinks: int, window: int, scale: float | None = None,
                           interpret: bool = False, block_q: int = 64, block_k: int = 64, block_q_bwd: int = 32,
                           block_k_bwd: int = 32, num_warps: int | None = None,
                           num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    """KVpop-masked flash attention (Pallas); contract of `kvpop_attention_reference`.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] (query head h*G + g reads KV head h).
      ranks: int [B, Hkv, S] key ranks (0 = best); cutoffs: int [B, Hkv, S] τ_q
        (S keeps every eligible key, negative keeps none).
      sinks, window: s and w (window >= 1).
      scale: logit scale, default D ** -0.5.
      interpret: run the kernels in Pallas interpret mode (CPU tests).
      block_q, block_k: forward tile; block_q_bwd, block_k_bwd: backward tiles. Powers
        of 2 >= 16; shrunk to the padded sequence when S is short.
      num_warps, num_stages: Triton launch parameters (num_warps default 4 for D <= 64,
        else 8).

    Returns:
      out [B, S, Hq, D] in q's dtype and lse [B, Hq, S] float32 (natural log over kept
      keys). Differentiable in q, k, v through both outputs (custom VJP: reverse mode, first
      order; no jvp).

    S is padded to a multiple of the blocks and D to a power of 2 >= 16 inside; padded
    keys are masked, padded queries are dropped.
    """
    st, padded = prepare_inputs(
        q, k, v, ranks, cutoffs, sinks=sinks, window=window, scale=scale, interpret=interpret,
        blocks=(block_q, block_k, block_q_bwd, block_k_bwd), num_warps=num_warps, num_stages=num_stages,
    )
    out, lse = _sparse_attention_padded(st, *padded)
    s, d = q.shape[1], q.shape[3]
    return out[:, :s, :, :d], lse[:, :, :s]


def prepare_inputs(
    q, k, v, ranks, cutoffs, *, sinks, window, scale, interpret, blocks, num_warps, num_stages
) -> tuple[StaticArgs, tuple[jax.Array, ...]]:
    """Validates, fixes the static arguments and pads: S to a multiple of every block (padded
    keys get rank BIG_RANK, padded queries cutoff −1), D to a power of 2 >= 16 (zeros)."""
    check_attention_args(q, k, v, ranks, cutoffs, sinks, window, scale=scale)
    b, s, hq, d = q.shape
    blocks = [fit_block(x, s) for x in blocks]
    s_pad = round_up(s, max(blocks))
    d_pad = padded_head_dim(d)
    st = StaticArgs(
        scale=float(d**-0.5 if scale is None else scale),
        sinks=int(sinks),
        window=int(window),
        seq_len=s,
        groups=hq // k.shape[2],
        block_q=blocks[0],
        block_k=blocks[1],
        block_q_bwd=blocks[2],
        block_k_bwd=blocks[3],
        num_warps=num_warps or (4 if d_pad <= 64 else 8),
        num_stages=num_stages,
        interpret=bool(interpret),
    )

    def pad_bshd(x):
        return pad_axis(pad_axis(x, 1, s_pad), 3, d_pad)

    ranks_p = pad_axis(ranks.astype(jnp.int32), 2, s_pad, BIG_RANK)
    cut_p = pad_axis(cutoffs.astype(jnp.int32), 2, s_pad, -1)
    return st, (pad_bshd(q), pad_bshd(k), pad_bshd(v), ranks_p, cut_p)
