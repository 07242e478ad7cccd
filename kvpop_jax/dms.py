"""DMS (Dynamic Memory Sparsification), the learned-eviction baseline of the KVpop paper.

Łańcucki et al., "Inference-Time Hyper-Scaling with KV Cache Compression" (2025); NVIDIA's
reference is Model-Optimizer `experimental/dms` ("the reference" below). Each KV head of each
layer learns a binary decision per token: evict it or keep it. A token marked for eviction
stays attendable while it is among the `w` newest tokens (delayed eviction) and is removed
when it leaves them. Occupancy therefore varies per head; nothing bounds it but the learned
eviction rate, which an auxiliary loss pushes towards a target that rises during training.

The method, with every choice the sources leave open (or that we make differently), per
layer l, KV head h, token t of a sequence of S tokens:

- Gate (`DMSGate`). A headwise two-layer SiLU MLP on the stop-gradient `[k_t; v_t]` of the
  head, the KVpop MLP scorer's shape: `g_t = logit_scale * MLP_h([k_t; v_t]) - logit_offset`.
  The reference reads the residual stream with a zero-initialized linear adapter (or borrows a
  query channel); the KVpop paper matches DMS's parameters to the KVpop scorers without saying
  how. We give the gate the scorers' input and their parameter count: its hidden width is the
  one whose per-head count (2D + 2) H + 1 is nearest to the compared KVpop head's per-head
  count (scorer + decay; `matched_gate_hidden`). No base weight changes. The last layer starts
  at zero, so every logit starts at -logit_offset = -5 (almost nothing evicted), as in the
  reference. logit_scale is 1: the reference's 100 multiplies its 3e-5 learning rate, our new
  parameters already get the paper's 1e-3 schedule.
- Shift (kept from the reference). The decision about token t comes from the gate of token
  t + 1: `a_t = g_{t+1}` (one token of lookahead, which a [k; v] gate of t + 1 also has). The
  last token of a sequence has no decision yet (`NO_DECISION`, kept); it is always in the
  window, so this changes nothing inside a sequence. While decoding, token q's gate decides
  token q - 1.
- Window. Key t is always visible to query q when `q - t < w` (KVpop's convention, query
  included; the reference's "512" is w = 513). Beyond it, key t is visible iff not evicted.
  The DMS variant uses the KVpop variants' w.
- Relaxation (training). Binary concrete with logistic noise L (= Gumbel - Gumbel) and fixed
  temperature τ = 0.1 as the reference (no annealing): `ℓ_t = (a_t + L_t) / τ`,
  `α_t = σ(ℓ_t)`. The attention adds `log(1 - α_t) = log σ(-ℓ_t)` to the logit of key t for
  queries with `q - t >= w` (`dms_attention`, blockwise in XLA, differentiable in the gate).
  The auxiliary loss counts hard straight-through decisions `1[α_t > 0.5]` (gradient of α_t).
- Inference. Hard decisions without noise: evict t iff `a_t > 0`; the mask is then
  `M[q, t] = t <= q ∧ (q - t < w ∨ a_t <= 0)`, which the bounded cache (`dms_cache.py`)
  reproduces while decoding (the invariant test).
- Target (memory-matched to KVpop). With mean eviction rate a, a head holds
  `w + (1 - a)(S - w)` entries after S tokens. The target a* makes that the KVpop variants'
  memory M per KV head at the training length (`DMSConfig.eviction_for_memory`): the final
  mean occupancy equals KVpop's constant B. No sink tokens (the gate decides about them too).
- Schedule and auxiliary loss (reference). The target compression ratio rises linearly,
  `cr(step) = 1 + (1 / (1 - a*) - 1) min(step / ramp, 1)` with ramp = ramp_fraction x steps
  (the reference: 510 of 544 steps; ours 0.9), and the target rate is `1 - 1 / cr(step)`. The
  loss is one-sided, `L_aux = mean_b relu(target - frac_b)`, frac_b the mean of the hard
  decisions over layers, heads and tokens of sequence b: no per-head term, so the rate may
  concentrate in a few heads (the KVpop paper's App. H). frac counts the S - 1 tokens that have
  a decision (the reference averages its unshifted logits over all S positions, one token
  more). Weight 1, next to the same top-K forward KL as the KVpop runs (the reference uses a
  full-vocabulary KL(student || teacher)); all weights train, as the DMS paper (the reference
  trains only its adapter).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvpop_jax import attention as attn_lib
from kvpop_jax import dms_cache
from kvpop_jax.config import DMSConfig, KVpopConfig
from kvpop_jax.kvpop import KVpopHead
from kvpop_jax.scorers import scorer_input
from pallas_kernels.common import NEG_INF

DMS_SUBTREE = "dms"  # layers_{i}/self_attn/dms: the gate of a DMS layer
NO_DECISION = dms_cache.NO_DECISION


class DMSGate(nn.Module):
    """The eviction gates of one layer: a headwise SiLU MLP on stop-gradient [k; v] per KV head.

    w1 [Hkv, 2D, H] (LeCun-normal per head), b1 [Hkv, H], w2 [Hkv, H] (zero), b2 [Hkv] (zero).
    `prefill` / `decode` drive the bounded cache (`dms_cache.py`), as `KVpopHead` does for KVpop.
    """

    config: DMSConfig
    num_kv_heads: int
    head_dim: int

    IS_DMS = True  # what the DMS cache checks its policy for

    def setup(self):
        h, hidden, two_d = self.num_kv_heads, self.config.gate_hidden, 2 * self.head_dim
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                batch_axis=(0,))
        self.w1 = self.param("w1", init, (h, two_d, hidden), jnp.float32)
        self.b1 = self.param("b1", nn.initializers.zeros, (h, hidden), jnp.float32)
        self.w2 = self.param("w2", nn.initializers.zeros, (h, hidden), jnp.float32)
        self.b2 = self.param("b2", nn.initializers.zeros, (h,), jnp.float32)

    def __call__(self, k: jax.Array, v: jax.Array) -> jax.Array:
        """k, v [B, S, Hkv, D] -> gate logits g [B, Hkv, S] float32 (g_t decides token t - 1)."""
        x = scorer_input(k, v)
        z = jax.nn.silu(jnp.einsum("bshi,hie->bshe", x, self.w1) + self.b1)
        r = jnp.einsum("bshe,he->bhs", z, self.w2) + self.b2[:, None]
        return self.config.logit_scale * r - self.config.logit_offset

    def prefill(self, q, k, v, *, capacity: int, return_policy: bool = False, prompt_len=None):
        """A prompt through the hard-masked forward, then the cache after its last token.

        q [B, P, Hq, D], k/v [B, P, Hkv, D] -> (out [B, P, Hq, D], DMSLayerCache of `capacity`
        entries, aux or None). prompt_len: the prompt is the first prompt_len tokens, the rest
        padding at its end (`dms_cache.build_from_prefill`; the causal mask keeps it out of the
        prompt's outputs: a prompt token's visibility is decided by gates of prompt tokens).
        """
        g = self(k, v)
        out, aux = dms_layer_attention(q, k, v, g, self.config, return_policy=return_policy)
        cache = dms_cache.build_from_prefill(k, v, decision_logits(g), window=self.config.window,
                                             capacity=capacity, prompt_len=prompt_len)
        return out, cache, aux

    def decode(self, lc, q_tok, k_tok, v_tok, position):
        """One step: the new token's gate decides the previous token, then `dms_cache.decode_step`."""
        g_t = self(k_tok, v_tok)[:, :, 0]  # [B, Hkv]
        return dms_cache.decode_step(lc, q_tok, k_tok[:, 0], v_tok[:, 0], g_t, position, window=self.config.window)


# ------------------------------------------------------------------------------ decisions


def decision_logits(g: jax.Array) -> jax.Array:
    """Gate logits g [..., S] -> decision logits a [..., S]: a_t = g_{t+1}, a_{S-1} = NO_DECISION."""
    pad = [(0, 0)] * (g.ndim - 1) + [(0, 1)]
    return jnp.pad(g[..., 1:], pad, constant_values=NO_DECISION)


def relaxed_decisions(a: jax.Array, noise: jax.Array, temperature: float):
    """Binary-concrete relaxation of the decisions a [B, Hkv, S] with logistic noise [B, Hkv, S].

    Returns (log_keep = log(1 - α) = log σ(-ℓ), float32: the attention bias of each key;
    decisions = 1[α > 0.5] with the straight-through gradient of α: what the aux loss counts).
    """
    ell = (a + noise) / temperature
    alpha = jax.nn.sigmoid(ell)
    hard = (alpha > 0.5).astype(alpha.dtype)
    decisions = alpha + jax.lax.stop_gradient(hard - alpha)
    return jax.nn.log_sigmoid(-ell), decisions


def hard_log_keep(a: jax.Array) -> jax.Array:
    """Inference: bias 0 for kept keys, NEG_INF for evicted ones (a > 0)."""
    return jnp.where(a > 0, NEG_INF, 0.0).astype(jnp.float32)


def dms_mask(s: int, evict: jax.Array, window: int) -> jax.Array:
    """The hard DMS mask bool [..., S, S] from evict bool [..., S]: t <= q ∧ (q - t < w ∨ ¬evict_t)."""
    diff = jnp.arange(s)[:, None] - jnp.arange(s)[None, :]
    return (diff >= 0) & ((diff < window) | ~evict[..., None, :])


# ------------------------------------------------------------------------------ attention


DMS_CAUSAL_BLOCK = 128  # query block of the unrolled causal path (short sequences; 128 measured fastest on CPU)
DMS_UNROLLED_MAX_QUERIES = 2048  # up to this many queries the causal blocks are unrolled


def dms_attention(q, k, v, log_keep, *, window: int, scale: float | None = None, block_q: int | None = None,
                  unrolled_max: int | None = None):
    """DMS-masked causal attention in plain XLA, one query block at a time.

    Two paths, the same result:
    - up to `unrolled_max` queries (default `DMS_UNROLLED_MAX_QUERIES`): the query blocks are
      unrolled and block i reads only the keys it can see, [0, end of block i) (static slices:
      the causal upper triangle is never computed), with no rematerialization. At S = 1024 and
      blocks of 128 that is 56% of the S x S work; one DMS training layer's fwd+bwd at B 4,
      S 1024 on CPU takes 0.14 s this way against 0.58 s mapped.
    - longer: `attention.map_query_blocks` over blocks of 512 queries against all S keys, each block
      rematerialized in autodiff, so memory is O(S * block_q) per head and no S x S array exists.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] (query head h*G + g reads KV head h).
      log_keep: float32 [B, Hkv, S], added to the logit of key t for every query with
        q - t >= window (training: log(1 - α_t); inference: 0 or NEG_INF).
      window: w >= 1, the newest keys every query sees unbiased (itself included).
      block_q: queries per block (default `DMS_CAUSAL_BLOCK` unrolled, 512 mapped).

    Returns:
      out [B, S, Hq, D] (q's dtype) and lse [B, Hq, S] float32. Differentiable in q, k, v and
      log_keep.
    """
    b, s, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    log_keep = log_keep.astype(jnp.float32)
    unrolled = s <= (DMS_UNROLLED_MAX_QUERIES if unrolled_max is None else unrolled_max)
    block_q = block_q or (DMS_CAUSAL_BLOCK if unrolled else 512)

    def one_block(start, q_blk, keys: int):
        """Queries [start, start + Q) over keys [0, keys)."""
        q_pos = start + jnp.arange(q_blk.shape[1], dtype=jnp.int32)
        diff = q_pos[:, None] - jnp.arange(keys, dtype=jnp.int32)[None, :]  # [Q, T]
        bias = jnp.where(diff >= window, log_keep[:, :, None, :keys], 0.0)  # [B, Hkv, Q, T]
        return attn_lib.attend(q_blk, k[:, :keys], v[:, :keys], (diff >= 0)[None, None, None], scale,
                               bias=bias[:, :, None])

    q_grouped = attn_lib.group_queries(q, k.shape[2])
    if unrolled:
        parts = [one_block(jnp.int32(lo), q_grouped[:, lo:min(lo + block_q, s)], min(lo + block_q, s))
                 for lo in range(0, s, block_q)]
        out = jnp.concatenate([o for o, _ in parts], axis=1)
        lse = jnp.concatenate([lse_i for _, lse_i in parts], axis=-1)
    else:
        out, lse = attn_lib.map_query_blocks(lambda start, q_blk: one_block(start, q_blk, s), [q_grouped], [1],
                                             block=block_q)
    return out.reshape(b, s, hq, d), lse.reshape(b, hq, s)


def dms_layer_attention(q, k, v, g, config: DMSConfig, *, noise=None, return_policy: bool = False,
                        row_lengths=None):
    """The DMS attention of one layer from its gate logits g [B, Hkv, S].

    noise: logistic noise [B, Hkv, S] (training: the relaxed soft mask, and aux["dms_frac"] [B],
    the mean straight-through decision per sequence for the auxiliary loss) or None (inference:
    the hard mask). Returns (out [B, S, Hq, D], aux): aux["metrics"]["eviction_rate"] (share of
    tokens with a hard decision to evict), and with `return_policy` the decision logits `a` and
    `evict` [B, Hkv, S]. row_lengths: int [B] or None, the real tokens leading each row (the rest a
    packed row's padding): `dms_frac` then averages the real tokens' decisions only.
    """
    a = decision_logits(g)
    decided = jnp.arange(a.shape[-1]) < a.shape[-1] - 1  # the last token has no decision yet
    aux: dict[str, Any] = {}
    if noise is None:
        log_keep = hard_log_keep(a)
        evict = a > 0
    else:
        log_keep, decisions = relaxed_decisions(a, noise, config.temperature)
        evict = decisions > 0.5
        real = decided if row_lengths is None else decided & (jnp.arange(a.shape[-1]) < row_lengths[:, None] - 1)
        real = jnp.broadcast_to(real, (a.shape[0], a.shape[-1]))[:, None, :]  # [B, 1, S]
        count = jnp.maximum(jnp.sum(real, axis=(1, 2)), 1)  # per row
        aux["dms_frac"] = jnp.sum(jnp.where(real, decisions, 0.0), axis=(1, 2)) / (count * a.shape[1])
    out, lse = dms_attention(q, k, v, log_keep, window=config.window)
    rate = jnp.sum(evict & decided) / jnp.maximum(jnp.sum(decided) * a.shape[0] * a.shape[1], 1)
    aux["metrics"] = {"eviction_rate": rate.astype(jnp.float32)}
    if return_policy:
        aux.update(decision_logits=a, evict=evict & decided, lse=lse)
    return out, aux


# ------------------------------------------------------------------------- schedule and loss


def target_eviction_at(step, *, final_eviction: float, ramp_steps: int) -> jax.Array:
    """The target eviction rate at optimizer step `step` (0-based): 1 - 1 / cr(step), with the
    compression ratio cr rising linearly from 1 to 1 / (1 - final_eviction) over `ramp_steps`."""
    final_cr = 1.0 / (1.0 - final_eviction)
    progress = jnp.minimum(jnp.asarray(step, jnp.float32) / max(ramp_steps, 1), 1.0)
    return 1.0 - 1.0 / (1.0 + (final_cr - 1.0) * progress)


def ramp_steps(config: DMSConfig, total_steps: int) -> int:
    """Steps until the target compression ratio is reached: ramp_fraction of the run, at least 1."""
    return max(1, round(config.ramp_fraction * total_steps))


def aux_loss(frac_B: jax.Array, target: jax.Array) -> jax.Array:
    """One-sided L1: mean over sequences of relu(target - frac_b); frac_B [B] (straight-through)."""
    return jnp.mean(jax.nn.relu(target - frac_B))


# --------------------------------------------------------------------- parameters and stats


def gate_param_count(hidden: int, head_dim: int) -> int:
    """Parameters of one KV head's gate: (2D + 2) H + 1."""
    return (2 * head_dim + 2) * hidden + 1


def kvpop_head_param_count(kvpop: KVpopConfig, head_dim: int) -> int:
    """Parameters per KV head of a KVpop layer head (scorer + decay), counted from its pytree."""
    dummy = jax.ShapeDtypeStruct((1, 1, 1, head_dim), jnp.float32)
    kvpop = dataclasses.replace(kvpop, scorer_keys="rotated")  # the same parameters, no rope_theta needed
    shapes = jax.eval_shape(lambda x: KVpopHead(kvpop, 1, head_dim).init(jax.random.key(0), x, x), dummy)
    return sum(int(x.size) for x in jax.tree.leaves(shapes))


def matched_gate_hidden(kvpop: KVpopConfig, head_dim: int) -> int:
    """The gate width whose per-head parameter count is nearest the KVpop head's (>= 1)."""
    target = kvpop_head_param_count(kvpop, head_dim)
    per_unit = gate_param_count(1, head_dim) - 1  # each hidden unit's weights; the 1 is the output bias
    return max(1, round((target - 1) / per_unit))


def eviction_stats(evict, window: int) -> dict[str, jax.Array]:
    """Per-head eviction ratio and occupancy of hard decisions evict bool [B, Hkv, S] at the last query.

    eviction_ratio [B, Hkv]: share of the tokens that have left the window (t <= S - 1 - w) that
    are gone (0: dense, 1: window only, the paper's Fig. 8); occupancy [B, Hkv]: entries a head
    holds after S tokens (the window plus its kept older tokens).
    """
    s = evict.shape[-1]
    left = jnp.arange(s) <= s - 1 - window
    n_left = jnp.sum(left)
    gone = jnp.sum(evict & left, axis=-1)
    ratio = gone / jnp.maximum(n_left, 1)
    return {"eviction_ratio": ratio, "occupancy": s - gone}


__all__ = ["DMS_SUBTREE", "NO_DECISION", "DMSGate", "aux_loss", "decision_logits", "dms_attention",
           "dms_layer_attention", "dms_mask", "eviction_stats", "gate_param_count", "hard_log_keep",
           "kvpop_head_param_count", "matched_gate_hidden", "ramp_steps", "relaxed_decisions",
           "target_eviction_at"]
