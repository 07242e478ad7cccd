"""KVpop inside an attention layer: scorer + decay, the sparse mask, and the retention objective.

`KVpopHead` is the only module with parameters (stored under `self_attn/kvpop/`):
the layer's scorer and one decay parameter α per KV head. Everything else is a plain
function of arrays from `policy`, `targets` and `losses`.

The kernels (masked attention, transposed future-LSE pass, running cutoff) are chosen
per call by their dispatchers (`attention.kvpop_attention`,
`targets.future_attention_log_mass`, `policy.running_topk_cutoff`): Pallas on GPU, the XLA
references elsewhere (`$KVPOP_ATTENTION_IMPL`, `$KVPOP_FUTURE_LSE_IMPL`, `$KVPOP_CUTOFF_IMPL`).

Gradient flow: the scorer reads stop-gradient [k; v]; the attention sees only
integer ranks/cutoffs, so the distillation loss never reaches scorer or decay; the
retention loss reaches only scorer and decay (its target is a constant).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvpop_jax import attention as attn_lib
from kvpop_jax import cache as cache_lib
from kvpop_jax import losses, policy, targets
from kvpop_jax.config import KVpopConfig
from kvpop_jax.rope import unrotate
from kvpop_jax.scorers import make_scorer, mlstm_step
from pallas_kernels.common import NEG_INF

RECALL_QUERIES = 32  # sampled positions the recall metric looks at (it is O(S) each)


class KVpopHead(nn.Module):
    """Scorer and learned decay of one layer (Eq. 21, Section 3.3).

    The scorer reads the layer's keys as cached (RoPE applied) or, with
    `config.scorer_keys == "unrotated"`, with the rotation undone by `rope_theta` (the model's).
    """

    config: KVpopConfig
    num_kv_heads: int
    head_dim: int
    rope_theta: float | None = None

    def setup(self):
        if self.config.scorer_keys == "unrotated" and self.rope_theta is None:
            raise ValueError("KVpopConfig.scorer_keys='unrotated' needs the model's rope_theta "
                             "(KVpopHead(..., rope_theta=config.rope_theta))")
        self.scorer = make_scorer(self.config, self.num_kv_heads, self.head_dim)
        # α = 0 puts log γ halfway between log γ_min and log γ_max.
        self.decay_alpha = self.param("decay_alpha", nn.initializers.zeros, (self.num_kv_heads,), jnp.float32)
        if self.config.scorer_position == "log":  # a_h = 0: the paper's scorer until trained
            self.position_weight = self.param("position_weight", nn.initializers.zeros, (self.num_kv_heads,),
                                              jnp.float32)

    def position_term(self, t) -> jax.Array | float:
        """What `config.scorer_position` adds to the raw score of the token at index t (the count from 0
        of the static priority and the cache): a_h * log(1 + t), float32 [Hkv] for an int t, [Hkv, S]
        for t int [S]; 0 when off."""
        if self.config.scorer_position == "none":
            return 0.0
        t = jnp.asarray(t, jnp.float32)
        return self.position_weight.reshape((-1,) + (1,) * t.ndim) * jnp.log1p(t)

    def score(self, scorer_k: jax.Array, v: jax.Array) -> jax.Array:
        """Raw scores [B, Hkv, S] float32 of a sequence from index 0: the scorer on (scorer_k, v), plus the
        position term."""
        scores = self.scorer(scorer_k, v).astype(jnp.float32)
        if self.config.scorer_position == "none":
            return scores
        return scores + self.position_term(jnp.arange(scores.shape[-1]))

    def log_gamma(self) -> jax.Array:
        """log γ_h, float32 [Hkv] (Eq. 21)."""
        c = self.config
        return policy.decay_log_gamma(self.decay_alpha, gamma_min=c.gamma_min, gamma_max=c.gamma_max)

    def scorer_keys(self, k: jax.Array, positions=None) -> jax.Array:
        """The keys the scorer reads: k [B, S, Hkv, D] rotated at `positions` (int, broadcastable
        to [B, S]; None: 0..S-1) as they are, or unrotated (`config.scorer_keys`)."""
        if self.config.scorer_keys == "rotated":
            return k
        if positions is None:
            positions = jnp.arange(k.shape[1])[None]
        return unrotate(k, positions, self.rope_theta)

    def __call__(self, k: jax.Array, v: jax.Array, positions=None) -> tuple[jax.Array, jax.Array]:
        """k, v [B, S, Hkv, D] (k rotated at `positions`, None: 0..S-1) -> raw scores [B, Hkv, S]
        float32 and log γ [Hkv]."""
        return self.score(self.scorer_keys(k, positions), v), self.log_gamma()

    # -- decoding with the bounded cache (cache.py) ------------------------------------

    @property
    def is_mlstm(self) -> bool:
        return self.config.scorer == "mlstm"

    @property
    def delayed(self) -> bool:
        """Scores a token when it leaves the window (delayed mLSTM) rather than on entry."""
        return self.is_mlstm and self.config.delayed_readout

    def init_scorer_state(self, batch: int):
        return self.scorer.init_state(batch) if self.is_mlstm else None

    def prefill(self, q, k, v, *, return_policy: bool = False, positions=None):
        """A prompt through the masked parallel forward, then the cache after its last token.

        q [B, P, Hq, D], k/v [B, P, Hkv, D] (rotated at `positions`, int [B, P], None: 0..P-1) ->
        (out [B, P, Hq, D], KVpopLayerCache, aux or None). The cache counts tokens from 0 whatever
        the RoPE positions; those only tell an unrotated-key scorer how to undo the rotation.
        """
        scorer_k = self.scorer_keys(k, positions)
        scores, log_gamma = self.score(scorer_k, v), self.log_gamma()
        out, aux = kvpop_layer_attention(q, k, v, scores, log_gamma, self.config, return_policy=return_policy)
        return out, self.prefill_cache(k, v, scores, log_gamma, scorer_k), aux

    def prefill_cache(self, k, v, scores, log_gamma, scorer_k=None) -> cache_lib.KVpopLayerCache:
        """Cache after a prefill of P tokens. k, v [B, P, Hkv, D] (as cached); scores [B, Hkv, P];
        scorer_k: the keys the scorer read (`scorer_keys`; None: k itself, as for rotated keys)."""
        p = k.shape[1]
        priority = policy.static_priority(scores, log_gamma)
        state, known = None, None
        if self.is_mlstm:
            _, kk, vv, i_pre, log_f = self.scorer.features(k if scorer_k is None else scorer_k, v)  # [B, P, H, ...]
            step = lambda st, xs: (mlstm_step(st, *xs), None)  # noqa: E731
            xs = tuple(jnp.swapaxes(x, 0, 1) for x in (kk, vv, i_pre, log_f))
            state, _ = jax.lax.scan(step, self.init_scorer_state(k.shape[0]), xs)
        if self.delayed:
            known = jnp.arange(p) + self.config.window <= p - 1
        return cache_lib.build_from_prefill(k, v, priority, self.config, state, known)

    def decode(self, lc: cache_lib.KVpopLayerCache, q_tok, k_tok, v_tok, position, rope_positions=None):
        """One decoding step. q_tok [B, 1, Hq, D], k_tok/v_tok [B, 1, Hkv, D]; position int [] (the
        token's index in the cache); rope_positions int [B, 1] (where k_tok was rotated; None:
        position), read only by an unrotated-key scorer, which undoes the rotation of the token
        leaving the window at rope_positions - w (consecutive positions).

        Returns (out [B, 1, Hq, D], new layer cache).
        """
        lc, _ = self.step(lc, k_tok, v_tok, position, rope_positions)
        out, _ = cache_lib.attend_cache(q_tok, lc)
        return out, lc

    def step(self, lc: cache_lib.KVpopLayerCache, k_tok, v_tok, position, rope_positions=None):
        """`decode`'s cache update (arguments as there, no query) -> (new layer cache, gone int32 [B, H]: the
        position the cache holds no more after the step, -1 if none)."""
        if rope_positions is None:
            rope_positions = position
        kv = self.config
        log_gamma = self.log_gamma()
        k_t, v_t = k_tok[:, 0], v_tok[:, 0]  # [B, H, D]
        b, h = k_t.shape[:2]
        state = lc.scorer_state
        ks_t = self.scorer_keys(k_tok, rope_positions)[:, 0]  # what the scorer reads (k_t is what is cached)
        if self.is_mlstm:
            state = self.scorer.step(state, ks_t, v_t)
        if self.delayed:
            prio_t = jnp.full((b, h), NEG_INF, jnp.float32)
        else:
            if self.is_mlstm:
                score_t = self.scorer.readout(state, ks_t, v_t)
            else:
                score_t = self.scorer(ks_t[:, None], v_t[:, None])[:, :, 0]
            score_t = score_t + self.position_term(position)
            prio_t = cache_lib.static_priority_at(score_t, log_gamma, position)
        slot = cache_lib.ring_slot(position, kv)
        gone = lc.pos[:, :, slot]  # the ring slot's token (u, or -1) leaves the cache, unless admitted
        if kv.topk > 0:
            u = position - kv.window  # leaves the window now, shares its ring slot with `position`
            leaving = jnp.broadcast_to(u >= kv.sinks, (b, h))
            k_u, v_u = lc.k[:, :, slot], lc.v[:, :, slot]
            if self.delayed:
                ks_u = self.scorer_keys(k_u[:, None], rope_positions - kv.window)[:, 0]
                score_u = self.scorer.readout(state, ks_u, v_u) + self.position_term(u)
                prio_u = cache_lib.static_priority_at(score_u, log_gamma, u)
            else:
                prio_u = lc.priority[:, :, slot]
            lc, admitted, replaced = cache_lib.admit_to_long_range(lc, k_u, v_u, jnp.broadcast_to(u, (b, h)),
                                                                   prio_u, leaving, kv)
            gone = jnp.where(admitted, replaced, gone)
        lc = cache_lib.write_slot(
            lc, jnp.broadcast_to(slot, (b, h)), k_t, v_t, jnp.broadcast_to(position, (b, h)).astype(jnp.int32),
            prio_t, jnp.ones((b, h), bool),
        )
        return lc.replace(scorer_state=state), gone

    def continue_tokens(self, lc: cache_lib.KVpopLayerCache, q, k, v, position, rope_positions=None):
        """T > 1 tokens on a started cache (a later chat turn, a prompt in chunks), as T `decode` calls give them
        to float rounding: the T cache updates (`step`, a scan of the scorer and eviction alone), then one
        attention in which query i reads the slots from before the call and the new keys, each while step i's
        cache holds it. q [B, T, Hq, D], k/v [B, T, Hkv, D]; position int [] (the first token's index);
        rope_positions int [B, T] (None: position + 0..T-1). Returns (out [B, T, Hq, D], new layer cache)."""
        b, t = q.shape[:2]
        if rope_positions is None:
            rope_positions = jnp.broadcast_to(position + jnp.arange(t), (b, t))
        h, n = lc.pos.shape[1:]
        pos0 = lc.pos
        new_k, new_v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, H, T, D]
        keys = jnp.concatenate([lc.k, new_k.astype(lc.k.dtype)], axis=2)  # every key a query may read
        values = jnp.concatenate([lc.v, new_v.astype(lc.v.dtype)], axis=2)

        def body(c, xs):
            k_i, v_i, i, rp = xs
            return self.step(c, k_i[:, None], v_i[:, None], position + i, rp[:, None])

        xs = (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1), jnp.arange(t), jnp.swapaxes(rope_positions, 0, 1))
        lc, gone = jax.lax.scan(body, lc, xs)  # gone [T, B, H]
        # Key j is read by queries [enter_j, leave_j): a slot's token from the start (an empty slot never), new
        # token i from its own step; each until the step after which the cache no longer holds it (never: T).
        in_slots = jnp.argmax(pos0[None] == gone[..., None], axis=-1)
        key = jnp.where(gone >= position, n + gone - position, in_slots)
        key = jnp.where(gone >= 0, key, n + t)  # out of range: dropped
        steps = jnp.broadcast_to(jnp.arange(t)[:, None, None], gone.shape)
        bi, hi = jnp.arange(b)[None, :, None], jnp.arange(h)[None, None, :]
        leave = jnp.full((b, h, n + t), t, jnp.int32).at[bi, hi, key].min(steps, mode="drop")
        enter = jnp.concatenate([jnp.where(pos0 >= 0, -1, t), jnp.broadcast_to(jnp.arange(t), (b, h, t))], axis=-1)
        return cache_lib.attend_spans(q, keys, values, enter, leave), lc


def sparse_policy(scores: jax.Array, log_gamma: jax.Array, config: KVpopConfig):
    """Scores [B, Hkv, S] -> (ranks, cutoffs) int32 [B, Hkv, S] of the running top-k mask."""
    priority = policy.static_priority(jax.lax.stop_gradient(scores), jax.lax.stop_gradient(log_gamma))
    ranks = policy.ranks_from_priority(priority)
    cutoffs = policy.running_topk_cutoff(ranks, sinks=config.sinks, window=config.window, topk=config.topk)
    return ranks, cutoffs


def kept_long_range(ranks, cutoffs, q_idx, *, sinks: int, window: int) -> jax.Array:
    """Long-range keep sets at the given queries: bool [B, H, Nq, S] (t ∈ E(q) ∧ rank <= τ_q)."""
    s = ranks.shape[-1]
    t = jnp.arange(s)
    q = q_idx[:, None, :, None]  # [B, 1, Nq, 1]
    cut = jnp.take_along_axis(cutoffs, jnp.broadcast_to(q_idx[:, None], cutoffs.shape[:2] + q_idx.shape[1:]), -1)
    eligible = (t >= sinks) & (t <= q - window)
    return eligible & (ranks[:, :, None, :] <= cut[..., None])


def teacher_recall(ranks, cutoffs, teacher_ranks, teacher_cutoffs, q_idx, *, sinks, window) -> jax.Array:
    """Mean over (batch, head, query) of |student ∩ teacher| / |teacher| long-range keep sets."""
    student = kept_long_range(ranks, cutoffs, q_idx, sinks=sinks, window=window)
    teacher = kept_long_range(teacher_ranks, teacher_cutoffs, q_idx, sinks=sinks, window=window)
    hits = jnp.sum(student & teacher, axis=-1)
    total = jnp.sum(teacher, axis=-1)
    return jnp.sum(hits) / jnp.maximum(jnp.sum(total), 1)


def retention_objective(
    q: jax.Array,
    k: jax.Array,
    lse: jax.Array,
    scores: jax.Array,
    log_gamma: jax.Array,
    ranks: jax.Array,
    cutoffs: jax.Array,
    q_idx: jax.Array,
    config: KVpopConfig,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, Any], dict[str, Any]]:
    """Retention loss of one layer (Eq. 7) against the future-attention target.

    Args:
      q [B, S, Hq, D], k [B, S, Hkv, D]: the layer's queries/keys (stop-gradient here).
      lse [B, Hq, S]: the sparse pass's normalizers (used when config.normalizer == "sparse").
      scores [B, Hkv, S], log_gamma [Hkv]: the student's (these receive the gradient).
      ranks, cutoffs [B, Hkv, S]: the student's sparse policy (for the recall metric).
      q_idx [B, Nq]: sampled saturated query positions (−1: none, a row without a real one).
      lengths [B] or None: the real tokens leading each row, the rest padding. Padding queries then
        count for nothing in the target (`targets.future_attention_target`) nor, where the losses
        draw their own, as queries.

    Returns:
      (loss scalar, metrics dict of scalars, extras dict: target [B, Hkv, S], teacher
      ranks/cutoffs and the Boundary).
    """
    c = config
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    if c.normalizer == "dense":
        lse = targets.dense_lse(q, k)
    target = targets.future_attention_target(
        q, k, lse, window=c.window, eps=c.eps, aggregate=c.aggregate, normalize=c.count_normalize,
        reduce=c.target_reduce, lookahead=c.target_lookahead, lengths=lengths,
    )
    t_priority = policy.static_priority(target, jax.lax.stop_gradient(log_gamma))
    t_ranks = policy.ranks_from_priority(t_priority)
    t_cutoffs = policy.running_topk_cutoff(t_ranks, sinks=c.sinks, window=c.window, topk=c.topk)
    boundary = policy.teacher_boundary(t_ranks, sinks=c.sinks, window=c.window, topk=c.topk, cutoffs=t_cutoffs)
    loss_q = q_idx
    if c.target_head_samples:
        head_q = losses.target_head_queries(target, num=c.target_head_samples, min_q=c.budget, window=c.window,
                                            lengths=lengths)
        loss_q = jnp.concatenate([jnp.broadcast_to(q_idx[:, None], head_q.shape[:2] + q_idx.shape[1:]), head_q], -1)
    loss, metrics = losses.retention_loss(
        scores, log_gamma, target, boundary, loss_q,
        temperature=c.loss_temperature, margin_weighting=c.margin_weighting, omega_min=c.omega_min,
        tau_omega=c.tau_omega, balance_weighting=c.balance_weighting, balance_min=c.balance_min,
        balance_max=c.balance_max, labels=c.retention_labels,
    )
    metrics = dict(metrics)
    if c.rank_pairs:
        if c.rank_partners == "similar":
            partners = losses.similar_rank_partners(k, q_idx, num=c.rank_pairs, sinks=c.sinks, window=c.window)
        else:
            partners = losses.sample_rank_partners(q_idx, num=c.rank_pairs, sinks=c.sinks, window=c.window)
        pair_loss, pair_metrics = losses.pairwise_rank_loss(
            scores, log_gamma, target, q_idx, partners, window=c.window, temperature=c.loss_temperature,
            margin_weighting=c.margin_weighting, omega_min=c.omega_min, tau_omega=c.tau_omega)
        loss = loss + pair_loss
        metrics.update(pair_metrics)
    if c.keepset_queries and c.topk:
        keep_q = q_idx[:, :c.keepset_queries]
        keep_loss, keep_metrics = losses.keepset_loss(
            scores, log_gamma, kept_long_range(t_ranks, t_cutoffs, keep_q, sinks=c.sinks, window=c.window), keep_q,
            sinks=c.sinks, window=c.window, topk=c.topk, temperature=c.loss_temperature)
        loss = loss + keep_loss
        metrics.update(keep_metrics)
    if c.listwise_queries:
        list_loss, list_metrics = losses.listwise_retention_loss(
            scores, log_gamma, target, q_idx[:, :c.listwise_queries], sinks=c.sinks, window=c.window,
            temperature=c.listwise_temperature)
        loss = loss + list_loss
        metrics.update(list_metrics)
    if c.regression_weight:
        reg_loss, reg_metrics = losses.regression_loss(scores, target, sinks=c.sinks, window=c.window,
                                                       lengths=lengths)
        loss = loss + c.regression_weight * reg_loss
        metrics.update(reg_metrics)
    metrics["teacher_recall"] = teacher_recall(
        ranks, cutoffs, t_ranks, t_cutoffs, q_idx[:, :RECALL_QUERIES], sinks=c.sinks, window=c.window
    )
    extras = {"target": target, "teacher_ranks": t_ranks, "teacher_cutoffs": t_cutoffs, "boundary": boundary}
    return loss, metrics, extras


def window_layer_attention(q, k, v, config: KVpopConfig):
    """`kvpop_layer_attention` at k = 0 (StreamingLLM+: sinks and window only) without a scorer: no long-range
    slot means no score can change what a query reads, so none is computed (the scorer's forward, priorities
    and ranks cost ~20 ms of a 0.5 s CPU training step). The ranks passed on are positions, a permutation as the
    back ends expect; the outputs and their gradients equal `kvpop_layer_attention`'s with any scores, bit for
    bit. Returns out [B, S, Hq, D]."""
    if config.topk != 0:
        raise ValueError(f"window_layer_attention is the k = 0 case; this config has topk={config.topk}")
    b, s, h = k.shape[:3]
    ranks = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, h, s))
    cutoffs = policy.running_topk_cutoff(ranks, sinks=config.sinks, window=config.window, topk=0)
    out, _ = attn_lib.kvpop_attention(q, k, v, ranks, cutoffs, sinks=config.sinks, window=config.window, topk=0)
    return out


def kvpop_layer_attention(q, k, v, scores, log_gamma, config: KVpopConfig, *, q_idx=None, row_lengths=None,
                          return_policy=False):
    """The KVpop attention of one layer.

    Returns (out [B, S, Hq, D], aux dict or None). aux holds the retention loss and metrics
    when `q_idx` is given (`row_lengths`: `retention_objective`'s lengths), and the policy arrays
    (scores, ranks, cutoffs) when `return_policy`.
    """
    ranks, cutoffs = sparse_policy(scores, log_gamma, config)
    out, lse = attn_lib.kvpop_attention(q, k, v, ranks, cutoffs, sinks=config.sinks, window=config.window,
                                        topk=config.topk)
    aux: dict[str, Any] = {}
    if return_policy:
        aux.update(scores=scores, ranks=ranks, cutoffs=cutoffs, log_gamma=log_gamma, lse=lse)
    if q_idx is not None:
        loss, metrics, extras = retention_objective(q, k, lse, scores, log_gamma, ranks, cutoffs, q_idx, config,
                                                    lengths=row_lengths)
        aux.update(retention_loss=loss, metrics=metrics)
        if return_policy:
            aux.update(extras)
    return out, (aux or None)
