"""KVpop-masked flash attention forward for Hopper: a Pallas Mosaic GPU kernel.

`kvpop_attention_mosaic` has the signature of `kvpop_jax.attention.kvpop_attention_reference`
(plus `interpret` and block sizes) and returns the same `(out, lse)`; the mask is the one of
`sparse_attention` (paper Eq. 26), evaluated per tile from positions, ranks and cutoffs.
It is the forward only: `kvpop_jax.attention`'s `mosaic_gpu` back end pairs it with the XLA
reference's backward.

Mosaic GPU is the Pallas GPU back end JAX keeps (the Triton one is deprecated from jax 0.11):
Hopper (sm_90) and later only. One program (one warpgroup, 128 threads) per (query block,
query head, batch):

  - TMA copies the query block to shared memory, then the key and value blocks into two
    slots, the next block's copy running while the current one is computed;
  - `wgmma` computes the logits S = Q Kᵀ (both operands in shared memory) into registers
    in the WGMMA layout; the mask comes from `broadcasted_iota` positions, the key block's
    ranks (a row vector) and the query block's cutoffs (a column vector), loaded from global
    memory straight into the matching layouts;
  - online softmax in base 2 (finite NEG_INF, so a row whose first tiles are all masked
    never makes a NaN); P goes to shared memory (bf16/f16) for the second `wgmma`, P V;
  - the output block leaves through shared memory and TMA; the natural-log LSE likewise.

Block skipping: a program visits only the key blocks that can hold a kept entry for its query
block (`key_block_lists`, computed in XLA from per-block rank minima and cutoff maxima, the
Triton kernel's test); the list is copied to shared memory and read as scalars, so the loop
and the prefetch follow it. A visited tile adds exactly 0 for its masked entries.
Inputs must be bfloat16 or float16 (wgmma); D is padded to a multiple of 64 (one 128-byte
swizzled row), S to a multiple of the blocks.

On CPU the kernel runs in Mosaic GPU's interpret mode (`interpret=True`, jax >= 0.11);
`jax.export(..., platforms=["cuda"])` runs the real Mosaic GPU lowering on any host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import BIG_RANK, LN2, LOG2E, NEG_INF, check_attention_args, pad_axis, round_up
from pallas_kernels.compat import mosaic_gpu_interpret_params, mosaic_load, plgpu

SWIZZLE_BYTES = 128  # one swizzled shared-memory row: 64 bf16/f16 elements
MMA_ROWS = 64  # wgmma's M per warpgroup
LIST_WIDTH = 64  # key-block lists are [rows, 64] (TMA copies at most 256 elements per dimension)
DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    scale: float
    sinks: int
    window: int
    groups: int  # G = Hq / Hkv
    block_q: int
    block_k: int
    interpret: object  # False, True or a plgpu.InterpretGPUParams (hashable)


def key_block_lists(ranks, cutoffs, *, sinks: int, window: int, block_q: int, block_k: int) -> jax.Array:
    """The key blocks each query block visits: those that can hold a kept entry (XLA, outside the kernel).

    ranks, cutoffs: int32 [B, H, S] (S a multiple of both blocks; padded keys ranked BIG_RANK,
    padded queries with cutoff −1). A key block is visited by a query block iff it is causal
    for it and holds a sink, overlaps the window of one of its queries, or overlaps their
    eligible range with a key whose rank is <= the block's largest cutoff (the Triton kernel's
    `tile_may_keep`, sound: a skipped tile has no kept entry).

    Returns int32 [B, H, S / block_q, R, LIST_WIDTH]: per query block, flattened, its count n,
    then the n key-block indices ascending, then zeros (R rows: S / block_k + 1 entries).
    """
    b, h, s = ranks.shape
    nq, nk = s // block_q, s // block_k
    k_start = jnp.arange(nk, dtype=jnp.int32) * block_k
    q_start = jnp.arange(nq, dtype=jnp.int32) * block_q
    k_pos = jnp.arange(s, dtype=jnp.int32).reshape(nk, block_k)
    best_rank = jnp.min(jnp.where(k_pos >= sinks, ranks.reshape(b, h, nk, block_k), BIG_RANK), axis=-1)
    max_cut = jnp.max(cutoffs.reshape(b, h, nq, block_q), axis=-1)
    q_last = (q_start + block_q - 1)[:, None]
    causal = k_start[None, :] <= q_last
    near = (k_start[None, :] < sinks) | (k_start[None, :] + block_k - 1 > q_start[:, None] - window)
    eligible = jnp.maximum(k_start, sinks)[None, :] <= q_last - window
    keep = causal & (near | (eligible & (best_rank[:, :, None, :] <= max_cut[:, :, :, None])))  # [B, H, nq, nk]
    order = jnp.argsort(~keep, axis=-1, stable=True).astype(jnp.int32)  # kept blocks first, ascending
    count = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    lists = jnp.concatenate([count[..., None], jnp.where(jnp.arange(nk) < count[..., None], order, 0)], axis=-1)
    lists = pad_axis(lists, 3, round_up(nk + 1, LIST_WIDTH))
    return lists.reshape(b, h, nq, -1, LIST_WIDTH)


def _kernel(q_ref, k_ref, v_ref, ranks_ref, cut_ref, lists_ref, o_ref, lse_ref,
            q_smem, k_smem, v_smem, ranks_smem, p_smem, cut_smem, list_smem, lse_smem, q_bars, k_bars, v_bars,
            r_bars, *, st: StaticArgs):
    bq, bk = st.block_q, st.block_k
    head_dim = q_smem.shape[-1]
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    hkv = lax.div(h, jnp.int32(st.groups))
    q_block = lax.axis_index("q_blocks")
    q_start = q_block * bq

    def listed(i):  # entry i of the list: 0 is the count, 1 + j the j-th key block
        return list_smem[i // LIST_WIDTH, i % LIST_WIDTH]

    def fetch(j, slot):
        keys = pl.ds(listed(1 + j) * bk, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, hkv], k_smem.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(ranks_ref.at[b, hkv, keys], ranks_smem.at[slot], r_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, hkv], v_smem.at[slot], v_bars.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, bq), h], q_smem, q_bars.at[0])
    plgpu.copy_gmem_to_smem(cut_ref.at[b, hkv, pl.ds(q_start, bq)], cut_smem, q_bars.at[1])
    plgpu.copy_gmem_to_smem(lists_ref.at[b, hkv, q_block], list_smem, q_bars.at[2])
    plgpu.barrier_wait(q_bars.at[2])
    num_k_blocks = listed(0)  # >= 1: the block holding q_start is always visited (window >= 1)
    fetch(0, 0)
    q_pos = q_start + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
    plgpu.barrier_wait(q_bars.at[1])
    cut_rows = lax.broadcast_in_dim(mosaic_load(cut_smem, plgpu.Layout.WGMMA.reduce(1)), (bq, bk), [0])
    plgpu.barrier_wait(q_bars.at[0])

    def step(j, carry):
        acc, m, l = carry
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < num_k_blocks)
        def _prefetch():  # the other slot was last read by step j - 1's wgmmas, which have returned
            fetch(j + 1, 1 - slot)

        plgpu.barrier_wait(k_bars.at[slot])

        def logits(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(logits, plgpu.ACC((bq, bk), jnp.float32)) * (st.scale * LOG2E)
        k_start = listed(1 + j) * bk
        plgpu.barrier_wait(r_bars.at[slot])
        ranks = mosaic_load(ranks_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
        k_pos = k_start + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
        diff = q_pos - k_pos
        kept = (k_pos < st.sinks) | (diff < st.window) | (lax.broadcast_in_dim(ranks, (bq, bk), [1]) <= cut_rows)
        s = jnp.where((diff >= 0) & kept, s, NEG_INF)

        m_next = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp2(m - m_next)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
        l = l * correction + p.sum(axis=1)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_bars.at[slot])

        def values(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        pv = pl.run_scoped(values, plgpu.ACC((bq, head_dim), jnp.float32))
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv
        return acc, m_next, l

    carry = (
        plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, m, l = lax.fori_loop(0, num_k_blocks, step, carry)
    # Every real query keeps t = q (window >= 1), so l >= 1 there; padded queries are sliced off.
    q_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(q_smem.dtype)
    lse_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(q_start, bq), h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_start, bq)])
    plgpu.wait_smem_to_gmem(0)


def _forward(st: StaticArgs, q, k, v, ranks, cutoffs):
    b, s_pad, hq, d = q.shape
    lists = key_block_lists(ranks, cutoffs, sinks=st.sinks, window=st.window, block_q=st.block_q,
                            block_k=st.block_k)
    dtype = q.dtype
    swizzled = (plgpu.TilingTransform((8, SWIZZLE_BYTES // dtype.itemsize)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    kernel = plgpu.kernel(
        functools.partial(_kernel, st=st),
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, hq, s_pad), jnp.float32)),
        scratch_types=[
            plgpu.SMEM((st.block_q, d), dtype, transforms=swizzled),  # Q, then the output block
            plgpu.SMEM((2, st.block_k, d), dtype, transforms=swizzled),  # K, two slots
            plgpu.SMEM((2, st.block_k, d), dtype, transforms=swizzled),  # V, two slots
            plgpu.SMEM((2, st.block_k), jnp.int32),  # the key blocks' ranks, two slots
            plgpu.SMEM((st.block_q, st.block_k), dtype, transforms=swizzled),  # P
            plgpu.SMEM((st.block_q,), jnp.int32),  # the query block's cutoffs
            plgpu.SMEM(lists.shape[-2:], jnp.int32),  # its key-block list
            plgpu.SMEM((st.block_q,), jnp.float32),  # LSE
            plgpu.Barrier(num_barriers=3),  # Q, cutoffs, list
            plgpu.Barrier(num_barriers=2),  # K slots
            plgpu.Barrier(num_barriers=2),  # V slots
            plgpu.Barrier(num_barriers=2),  # ranks slots
        ],
        grid=(s_pad // st.block_q, hq, b),
        grid_names=("q_blocks", "heads", "batch"),
        compiler_params=plgpu.CompilerParams(),
        interpret=_interpret_params(st.interpret),
        kernel_name="kvpop_mosaic_attention_fwd",
    )
    return kernel(q, k, v, ranks, cutoffs, lists)


def _interpret_params(interpret):
    if interpret is False:
        return None
    return mosaic_gpu_interpret_params() if interpret is True else interpret


def kvpop_attention_mosaic(q, k, v, ranks, cutoffs, *, sinks: int, window: int, scale: float | None = None,
                           interpret=False, block_q: int = MMA_ROWS,
                           block_k: int = 64) -> tuple[jax.Array, jax.Array]:
    """KVpop-masked flash attention forward (Mosaic GPU); contract of `kvpop_attention_reference`.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] bfloat16 or float16 (query head h*G + g reads
        KV head h).
      ranks: int [B, Hkv, S] key ranks (0 = best); cutoffs: int [B, Hkv, S] τ_q
        (S keeps every eligible key, negative keeps none).
      sinks, window: s and w (window >= 1).
      scale: logit scale, default D ** -0.5.
      interpret: run in Mosaic GPU's interpret mode on CPU (jax >= 0.11): True, or a
        `plgpu.InterpretGPUParams` (e.g. `detect_races=True`).
      block_q: queries per program, 64 (one warpgroup's wgmma rows); block_k: keys per
        step, a multiple of 64.

    Returns:
      out [B, S, Hq, D] in q's dtype and lse [B, Hq, S] float32 (natural log over kept
      keys). Forward only: not differentiable by itself.
    """
    reason = mosaic_rejects(q, block_q=block_q, block_k=block_k)
    if reason:
        raise ValueError(f"kvpop_attention_mosaic: {reason}")
    check_attention_args(q, k, v, ranks, cutoffs, sinks, window, scale=scale)
    b, s, hq, d = q.shape
    st = StaticArgs(scale=float(d**-0.5 if scale is None else scale), sinks=int(sinks), window=int(window),
                    groups=hq // k.shape[2], block_q=block_q, block_k=block_k, interpret=interpret)
    s_pad = round_up(s, max(block_q, block_k))
    d_pad = round_up(d, SWIZZLE_BYTES // q.dtype.itemsize)

    def pad_bshd(x):
        return pad_axis(pad_axis(x, 1, s_pad), 3, d_pad)

    out, lse = _forward(st, pad_bshd(q), pad_bshd(k.astype(q.dtype)), pad_bshd(v.astype(q.dtype)),
                        pad_axis(ranks.astype(jnp.int32), 2, s_pad, BIG_RANK),
                        pad_axis(cutoffs.astype(jnp.int32), 2, s_pad, -1))
    return out[:, :s, :, :d], lse[:, :, :s]


def mosaic_rejects(q, *, block_q: int = MMA_ROWS, block_k: int = 64) -> str | None:
    """None if the kernel can take queries like `q` with these blocks, else why not (static)."""
    if q.dtype not in DTYPES:
        return f"needs bfloat16 or float16 inputs (wgmma), got {q.dtype}"
    if block_q != MMA_ROWS:
        return f"block_q must be {MMA_ROWS} (one warpgroup's wgmma rows), got {block_q}"
    if block_k < 64 or block_k % 64:
        return f"block_k must be a multiple of 64, got {block_k}"
    return None
