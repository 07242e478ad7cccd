"""Training losses: boundary-aware retention loss, query sampling, top-k KL distillation.

Retention loss (Eq. 7, Appendix B.4–B.6). At a sampled query position q whose
long-range budget is saturated, the teacher (policy.py) says whether the newly eligible
token `t_new = q − w` enters the top-k (`y = +1`) or not (`y = −1`), and which token it
must beat (`t_bnd`). The student is trained with a pairwise logistic loss on its own
effective scores `r̂_x(q) = r̂_x + (q − x) log γ_h` (Eq. 5, n = 1), so the comparison is
`r̂_new − r̂_bnd + (t_bnd − t_new) log γ_h`: the decay term stays in (it is the
difference of static priorities) and gives log γ its gradient.

Distillation: forward KL(teacher ‖ student) on the teacher's top-K logits (App. F).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _gather_q(x: jax.Array, q_idx: jax.Array) -> jax.Array:
    """x [B, H, S] at q_idx [B, Nq] (shared by the heads) or [B, H, Nq] (per head) -> [B, H, Nq]."""
    idx = q_idx if q_idx.ndim == 3 else q_idx[:, None, :]
    idx = jnp.broadcast_to(idx, (x.shape[0], x.shape[1], q_idx.shape[-1]))
    return jnp.take_along_axis(x, idx, axis=2)


def _gather_t(x: jax.Array, t: jax.Array) -> jax.Array:
    """x [B, H, S] at token positions t [B, H, Nq] (clipped into range) -> [B, H, Nq]."""
    return jnp.take_along_axis(x, jnp.clip(t, 0, x.shape[2] - 1), axis=2)


def _decayed_diffs(scores, target_scores, log_gamma, t_a, t_b) -> tuple[jax.Array, jax.Array]:
    """Student and target differences of tokens t_a over t_b [B, H, N] on the decayed scores of Eq. 5
    (n = 1): r_a − r_b + (t_b − t_a) log γ_h; log γ gets its gradient through the student's only.
    scores, target_scores float32 [B, H, S]; log_gamma float32 broadcastable to [B, H, 1]."""
    age_gap = (t_b - t_a).astype(jnp.float32)  # (q − t_a) − (q − t_b)
    diff = _gather_t(scores, t_a) - _gather_t(scores, t_b) + age_gap * log_gamma
    target_diff = _gather_t(target_scores, t_a) - _gather_t(target_scores, t_b)
    return diff, target_diff + age_gap * jax.lax.stop_gradient(log_gamma)


def _as_head_column(log_gamma) -> jax.Array:
    """log γ as float32, [H] -> [1, H, 1] (other shapes must already broadcast to [B, H, N])."""
    log_gamma = jnp.asarray(log_gamma, jnp.float32)
    return log_gamma[None, :, None] if log_gamma.ndim == 1 else log_gamma


def boundary_weights(
    target_margin: jax.Array,
    y: jax.Array,
    valid: jax.Array,
    *,
    margin_weighting: bool,
    omega_min: float,
    tau_omega: float,
    balance_weighting: bool,
    balance_min: float,
    balance_max: float,
) -> jax.Array:
    """Example weights ω of Eq. 7: margin weight (Eq. 23) × keep/drop balance (Eq. 24).

    Args:
      target_margin: float [B, H, N], Δ^tgt = y (r_tgt_new(q) − r_tgt_bnd(q)) (Eq. 22).
      y: float [B, H, N] in {+1, −1}; valid: bool [B, H, N].
      margin_weighting, omega_min, tau_omega: Eq. 23 (off: weight 1).
      balance_weighting, balance_min, balance_max: Eq. 24 with ρ_h the fraction of valid
        y = +1 per head over batch and samples (off: weight 1).

    Returns:
      float32 [B, H, N], stop-gradient, 0 on invalid examples and mean 1 over the valid
      ones (all 0 when none is valid).
    """
    validf = valid.astype(jnp.float32)
    w = jnp.ones_like(validf)
    if margin_weighting:
        w = w * (omega_min + (1.0 - omega_min) * jax.nn.sigmoid(target_margin / tau_omega))  # Eq. 23
    if balance_weighting:
        keep = (y > 0).astype(jnp.float32) * validf
        n_head = validf.sum(axis=(0, 2), keepdims=True)
        rho = keep.sum(axis=(0, 2), keepdims=True) / jnp.maximum(n_head, 1.0)  # ρ_h
        w_keep = jnp.clip(0.5 / jnp.maximum(rho, 1e-12), balance_min, balance_max)  # Eq. 24
        w_drop = jnp.clip(0.5 / jnp.maximum(1.0 - rho, 1e-12), balance_min, balance_max)
        w = w * jnp.where(y > 0, w_keep, w_drop)
    w = w * validf
    mean = w.sum() / jnp.maximum(validf.sum(), 1.0)
    return jax.lax.stop_gradient(w / jnp.where(mean > 0, mean, 1.0))


def retention_loss(
    scores: jax.Array,
    log_gamma: jax.Array,
    target_scores: jax.Array,
    boundary: Any,
    q_idx: jax.Array,
    *,
    temperature: float,
    margin_weighting: bool,
    omega_min: float,
    tau_omega: float,
    balance_weighting: bool,
    balance_min: float,
    balance_max: float,
    labels: str = "hard",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Boundary-aware retention loss (Eq. 7) at sampled query positions.

    Args:
      scores: float [B, H, S], the student's raw scores r̂_t (H = KV heads).
      log_gamma: float [H] (or broadcastable to [B, H, 1]), log γ_h < 0; receives gradient.
      target_scores: float [B, H, S], r_tgt (stop-gradient; only enters the weights).
      boundary: any object with fields `t_new`, `t_bnd` (int), `y` (±1) and `valid`
        (bool), each [B, H, S] indexed by query position q (policy.teacher_boundary).
      q_idx: int [B, Nq] sampled query positions (`sample_query_positions`), shared by the heads,
        or [B, H, Nq], one set per head (`target_head_queries` appended to the shared ones).
      temperature: τ of Eq. 7. The other knobs: see `boundary_weights`.
      labels: "hard" (Eq. 7: the teacher's keep/drop y) or "soft": the pairwise logistic loss
        against the target's own preference p = σ(Δ_tgt / τ), Δ_tgt = r_tgt_new(q) − r_tgt_bnd(q)
        with the decay term, as KL(p ‖ σ(Δ̂ / τ)) (0 at Δ̂ = Δ_tgt). Hard labels stop pushing once
        a kept token clears the boundary, so a token the target ranks far above every other kept
        one (a fact read again and again, later) ends up scored like any token that barely
        made it, and the policy evicts it by chance; soft labels ask for the target's margin.
        Not in the paper (RankNet-style graded labels); `KVpopConfig.retention_labels`.

    Returns:
      (loss, metrics): loss is the float32 scalar mean over valid examples of
      ω · softplus(−y (r̂_new(q) − r̂_bnd(q)) / τ) (0 when none is valid, never NaN).
      metrics (float32 scalars): `boundary_accuracy` (fraction of valid examples with
      y · (r̂_new(q) − r̂_bnd(q)) > 0), `boundary_auc` (`boundary_auc`), `keep_rate`
      (fraction with y = +1), `num_valid`.
    """
    if scores.ndim != 3 or target_scores.shape != scores.shape:
        raise ValueError(f"scores and target_scores must both be [B, H, S], got {scores.shape}, {target_scores.shape}")
    for name in ("t_new", "t_bnd", "y", "valid"):
        field = getattr(boundary, name)
        if field.shape != scores.shape:
            raise ValueError(f"boundary.{name} must be [B, H, S] = {scores.shape}, got {field.shape}")
    if q_idx.ndim not in (2, 3) or q_idx.shape[0] != scores.shape[0] or (
            q_idx.ndim == 3 and q_idx.shape[1] != scores.shape[1]):
        raise ValueError(f"q_idx must be [B, Nq] or [B, H, Nq] with B, H = {scores.shape[:2]}, got {q_idx.shape}")
    scores = scores.astype(jnp.float32)
    target_scores = jax.lax.stop_gradient(target_scores.astype(jnp.float32))
    log_gamma = _as_head_column(log_gamma)

    t_new = _gather_q(boundary.t_new, q_idx)
    t_bnd = _gather_q(boundary.t_bnd, q_idx)
    y = _gather_q(boundary.y, q_idx).astype(jnp.float32)
    valid = _gather_q(boundary.valid, q_idx).astype(bool)
    valid &= (t_new >= 0) & (t_bnd >= 0)  # an invalid index never reaches the loss
    q_real = q_idx >= 0  # −1: a row with no real saturated query (`sample_query_positions`)
    valid &= q_real if q_idx.ndim == 3 else q_real[:, None]
    y = jnp.where(valid, y, 1.0)
    diff, target_diff = _decayed_diffs(scores, target_scores, log_gamma, t_new, t_bnd)
    weights = boundary_weights(
        y * target_diff,  # Eq. 22
        y,
        valid,
        margin_weighting=margin_weighting,
        omega_min=omega_min,
        tau_omega=tau_omega,
        balance_weighting=balance_weighting,
        balance_min=balance_min,
        balance_max=balance_max,
    )
    if labels == "hard":
        per_example = jax.nn.softplus(-y * diff / temperature)  # Eq. 7
    elif labels == "soft":
        per_example = _soft_pair_kl(diff, target_diff, temperature)
    else:
        raise ValueError(f"labels must be 'hard' or 'soft', got {labels!r}")
    validf = valid.astype(jnp.float32)
    num_valid = validf.sum()
    denom = jnp.maximum(num_valid, 1.0)
    loss = jnp.sum(jnp.where(valid, weights * per_example, 0.0)) / denom
    metrics = {
        "boundary_accuracy": jnp.sum(jnp.where(valid & (y * diff > 0), 1.0, 0.0)) / denom,
        "boundary_auc": boundary_auc(diff, y, valid),
        "keep_rate": jnp.sum(jnp.where(valid & (y > 0), 1.0, 0.0)) / denom,
        "num_valid": num_valid,
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _soft_pair_kl(diff: jax.Array, target_diff: jax.Array, temperature: float) -> jax.Array:
    """KL(σ(Δ_tgt / τ) ‖ σ(Δ̂ / τ)) elementwise, written stably; 0 iff Δ̂ = Δ_tgt."""
    z, zt = diff / temperature, target_diff / temperature
    p = jax.nn.sigmoid(zt)
    return jax.nn.softplus(z) - p * z - (jax.nn.softplus(zt) - p * zt)


def sample_rank_partners(q_idx: jax.Array, *, num: int, sinks: int, window: int) -> jax.Array:
    """Partners for `pairwise_rank_loss`: per sampled query q, `num` tokens drawn uniformly from
    the long-range candidates older than t_new = q − w, i.e. [sinks, q − w), int32 [B, Nq, num]
    (−1 where that range is empty). Deterministic in q_idx: the key is folded from the sampled
    positions themselves, so a training step stays a pure function of (state, batch)."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    weights = jnp.arange(1, q_idx.size + 1, dtype=jnp.uint32).reshape(q_idx.shape)
    key = jax.random.fold_in(jax.random.PRNGKey(0x6B7670), jnp.sum(q_idx.astype(jnp.uint32) * weights))
    u = jax.random.uniform(key, q_idx.shape + (num,), jnp.float32)
    hi = (q_idx - window)[..., None]  # exclusive: t_new itself is not its own partner
    t = sinks + jnp.floor(u * (hi - sinks)).astype(jnp.int32)
    return jnp.where(hi > sinks, jnp.clip(t, sinks, jnp.maximum(hi - 1, sinks)), -1).astype(jnp.int32)


def similar_rank_partners(k: jax.Array, q_idx: jax.Array, *, num: int, sinks: int, window: int) -> jax.Array:
    """Per KV head and sampled query q, the `num` candidates in [sinks, q - w) whose keys have the highest
    cosine similarity to t_new = q - w's key: int32 [B, H, Nq, num] (-1 where fewer exist). k [B, S, H, D]."""
    k = jax.lax.stop_gradient(k.astype(jnp.float32))
    k = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    t_new = q_idx - window  # [B, Nq]
    k_new = jnp.take_along_axis(k, t_new[:, :, None, None], axis=1)  # [B, Nq, H, D]
    sim = jnp.einsum("bnhd,bshd->bhns", k_new, k)  # [B, H, Nq, S]
    s = jnp.arange(k.shape[1])
    ok = (s[None, None, None] >= sinks) & (s[None, None, None] < t_new[:, None, :, None])
    val, idx = jax.lax.top_k(jnp.where(ok, sim, -jnp.inf), num)
    return jnp.where(jnp.isfinite(val), idx, -1).astype(jnp.int32)


def pairwise_rank_loss(
    scores: jax.Array,
    log_gamma: jax.Array,
    target_scores: jax.Array,
    q_idx: jax.Array,
    partners: jax.Array,
    *,
    window: int,
    temperature: float,
    margin_weighting: bool,
    omega_min: float,
    tau_omega: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Global pairwise ranking of the newly eligible token against older candidates (not in the paper).

    Why: the boundary loss (Eq. 7) compares t_new only with the teacher's weakest kept token, so
    it never orders two kept tokens. With static priorities (Eq. 20) the running top-k keeps, at
    every q, the global top-k of the priorities seen so far; a token the target ranks far above
    the other kept ones but that the student scores like any of them is then evicted by chance
    as later keeps arrive. Here t_new = q − w is compared with `partners` (random older
    candidates, `sample_rank_partners`) on the same decayed scores as Eq. 7,
    Δ̂ = r̂_new(q) − r̂_j(q), against the target's preference σ(Δ_tgt / τ) (soft labels: near-ties
    ask for little, a token read again and again much later asks for its full margin).

    Args:
      scores, target_scores: float [B, H, S]; log_gamma: [H] or broadcastable to [B, H, 1].
      q_idx: int [B, Nq] sampled saturated queries; partners: int [B, Nq, M] (−1: none).
      window: w; temperature: τ; margin_weighting, omega_min, tau_omega: Eq. 23 on |Δ_tgt|.

    Returns:
      (loss, metrics): loss the float32 mean over valid pairs of ω · KL (0 when none);
      metrics: `pair_accuracy`, the share of valid pairs the student orders as the target does.
    """
    scores = scores.astype(jnp.float32)
    target_scores = jax.lax.stop_gradient(target_scores.astype(jnp.float32))
    log_gamma = _as_head_column(log_gamma)
    b, h, _ = scores.shape
    nq, m = partners.shape[-2], partners.shape[-1]
    t_new = jnp.broadcast_to((q_idx - window)[:, None, :, None], (b, h, nq, m)).reshape(b, h, nq * m)
    t_pair = (partners if partners.ndim == 4 else jnp.broadcast_to(partners[:, None], (b, h, nq, m))).reshape(b, h, nq * m)
    valid = (t_pair >= 0) & (t_new > t_pair)
    diff, target_diff = _decayed_diffs(scores, target_scores, log_gamma, t_new, t_pair)
    w = boundary_weights(jnp.abs(target_diff), jnp.ones_like(target_diff), valid, margin_weighting=margin_weighting,
                         omega_min=omega_min, tau_omega=tau_omega, balance_weighting=False, balance_min=1.0,
                         balance_max=1.0)  # Eq. 23 on |Δ_tgt| (a pair has no keep/drop side to balance)
    denom = jnp.maximum(valid.astype(jnp.float32).sum(), 1.0)
    loss = jnp.sum(jnp.where(valid, w * _soft_pair_kl(diff, target_diff, temperature), 0.0)) / denom
    agree = valid & (diff * target_diff > 0)
    return loss, {"pair_accuracy": jax.lax.stop_gradient(jnp.sum(agree.astype(jnp.float32)) / denom)}


def _eligible_at(q_idx: jax.Array, seq_len: int, *, sinks: int, window: int) -> jax.Array:
    """E(q) = {s <= t <= q − w} (Eq. 4) at each sampled query: bool [B, 1, Nq, S] (a head axis to broadcast)."""
    t = jnp.arange(seq_len)
    return ((t >= sinks) & (t <= (q_idx - window)[..., None]))[:, None]


def keepset_loss(
    scores: jax.Array,
    log_gamma: jax.Array,
    teacher_keep: jax.Array,
    q_idx: jax.Array,
    *,
    sinks: int,
    window: int,
    topk: int,
    temperature: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Balanced keep/drop loss over the whole eligible set at sampled queries (not in the paper).

    Why: Eq. 7 labels one token per query, the one leaving the window, when E(q) is whatever has
    left before it; early in a row the top-k of so few tokens holds most of them, and a fact that
    is read again later is one event among a row's hundreds. At a late query the teacher's keep set
    of E(q) is selective, and a classifier of it, balanced between kept and dropped tokens, learns
    the keep cue from the target itself (`python -m eval.main diagnose learn --labels target_topk`:
    validation AUC 0.95 on the parked teacher, where a squared-error fit of the target gets 0.67).
    Here, at each sampled query q with both classes in E(q) = {s <= t <= q − w}, every t ∈ E(q)
    gets the logistic loss of (p̂_t − θ_q) / τ against y = [t in the teacher's keep set], where p̂
    is Eq. 20's static priority and θ_q the student's own k-th largest p̂ over E(q) (its cutoff, or the smallest when |E(q)| < k;
    stop-gradient, so a common shift of the scores changes nothing); kept and dropped tokens weigh
    1/2 each.

    Args:
      scores: float [B, H, S] the student's raw scores; log_gamma: [H] or broadcastable to [B, H, 1].
      teacher_keep: bool [B, H, Nq, S], the teacher's long-range keep sets at q_idx (`kept_long_range`).
      q_idx: int [B, Nq]; sinks, window, topk: s, w, k (k >= 1); temperature: τ > 0.

    Returns:
      (loss, metrics): the float32 mean over (row, head, query) with both classes (0 when none);
      metrics: `keepset_accuracy`, the balanced accuracy of p̂_t >= θ_q against y there.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk!r}")
    if q_idx.ndim != 2 or teacher_keep.shape[:1] + teacher_keep.shape[2:3] != q_idx.shape:
        raise ValueError(f"q_idx must be [B, Nq] matching teacher_keep {teacher_keep.shape}, got {q_idx.shape}")
    log_gamma = _as_head_column(log_gamma)
    t = jnp.arange(scores.shape[-1])
    prio = (scores.astype(jnp.float32) - t * log_gamma)[:, :, None, :]  # Eq. 20, [B, H, 1, S]
    eligible = _eligible_at(q_idx, scores.shape[-1], sinks=sinks, window=window)  # [B, 1, Nq, S]
    very_low = jnp.float32(-1e30)
    masked = jnp.where(eligible, jax.lax.stop_gradient(prio), very_low)
    top = jax.lax.top_k(masked, min(topk, scores.shape[-1]))[0]  # where |E(q)| < k, theta is its smallest
    theta = jnp.min(jnp.where(top > very_low / 2, top, jnp.inf), -1, keepdims=True)  # [B, H, Nq, 1]
    theta = jnp.where(jnp.isfinite(theta), theta, 0.0)  # E(q) empty: no term uses it
    y = (teacher_keep & eligible).astype(jnp.float32)
    n_pos = y.sum(-1, keepdims=True)
    n_neg = eligible.astype(jnp.float32).sum(-1, keepdims=True) - n_pos
    valid = (n_pos > 0) & (n_neg > 0)  # [B, H, Nq, 1]
    weight = jnp.where(eligible & valid, jnp.where(y > 0, 0.5 / jnp.maximum(n_pos, 1), 0.5 / jnp.maximum(n_neg, 1)), 0)
    margin = jnp.where(eligible, prio - theta, 0.0)
    bce = jax.nn.softplus(-margin / temperature) * y + jax.nn.softplus(margin / temperature) * (1 - y)
    denom = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    loss = jnp.sum(weight * bce) / denom
    right = jnp.where(y > 0, margin >= 0, margin < 0)
    accuracy = jnp.sum(weight * right) / denom
    return loss, {"keepset_accuracy": jax.lax.stop_gradient(accuracy)}


def listwise_retention_loss(
    scores: jax.Array,
    log_gamma: jax.Array,
    target_scores: jax.Array,
    q_idx: jax.Array,
    *,
    sinks: int,
    window: int,
    temperature: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Listwise ranking of every eligible token at sampled queries (not in the paper).

    Why: the target singles out a few tokens (a fact read again and again) against hundreds of
    look-alikes whose own targets spread with what comes later and cannot be predicted when they
    leave the window. Pairwise losses and a squared-error fit spend the scorer on that spread
    (`python -m eval.main diagnose learn --labels`, BENCHMARKS.md). Here, at each sampled query q,
    the student's decayed scores over the eligible set E(q) = {s <= t <= q − w} (Eq. 4) are fitted
    to the target's as distributions: KL(softmax(r_tgt(q) / τ) ‖ softmax(r̂(q) / τ)), both on the
    static priorities of Eq. 20 (the decay's q log γ is common to E(q)). A small τ puts the loss
    on the target's top, where the kept tokens are; the minimum is r̂ = r_tgt + const over E(q).

    Args:
      scores, target_scores: float [B, H, S]; log_gamma: [H] or broadcastable to [B, H, 1].
      q_idx: int [B, Nq] sampled saturated queries (each E(q) non-empty: q >= s + w).
      sinks, window: s and w; temperature: τ > 0.

    Returns:
      (loss, metrics): loss the float32 mean KL over (row, head, query) with a non-empty E(q)
      (0 when none); metrics: `listwise_top1`, the share of those where the student's top token is
      the target's.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if q_idx.ndim != 2 or q_idx.shape[0] != scores.shape[0]:
        raise ValueError(f"q_idx must be [B, Nq] with B = {scores.shape[0]}, got {q_idx.shape}")
    scores = scores.astype(jnp.float32)
    target_scores = jax.lax.stop_gradient(target_scores.astype(jnp.float32))
    log_gamma = _as_head_column(log_gamma)
    t = jnp.arange(scores.shape[-1], dtype=jnp.float32)
    student = (scores - t * log_gamma) / temperature  # Eq. 20, [B, H, S]
    teacher = (target_scores - t * jax.lax.stop_gradient(log_gamma)) / temperature
    eligible = _eligible_at(q_idx, scores.shape[-1], sinks=sinks, window=window)  # [B, 1, Nq, S]
    very_low = jnp.float32(-1e30)  # finite: exp underflows to 0, and no inf - inf reaches a gradient
    log_q = jax.nn.log_softmax(jnp.where(eligible, student[:, :, None], very_low), -1)
    log_p = jax.nn.log_softmax(jnp.where(eligible, teacher[:, :, None], very_low), -1)
    p = jnp.exp(log_p)
    kl = jnp.sum(jnp.where(eligible, p * (log_p - log_q), 0.0), -1)  # [B, H, Nq]
    valid = jnp.broadcast_to(jnp.any(eligible, -1), kl.shape)
    denom = jnp.maximum(valid.astype(jnp.float32).sum(), 1.0)
    loss = jnp.sum(jnp.where(valid, kl, 0.0)) / denom
    top1 = jnp.argmax(log_q, -1) == jnp.argmax(log_p, -1)
    return loss, {"listwise_top1": jax.lax.stop_gradient(jnp.sum((valid & top1).astype(jnp.float32)) / denom)}


def regression_loss(
    scores: jax.Array,
    target_scores: jax.Array,
    *,
    sinks: int,
    window: int,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Squared error of the raw scores against the log-target, per token, up to a constant (not in the paper).

    Why: the teacher-retention recall (Fig. 7) asks the student's whole ranking of E(q) to match the
    target's, down to the k-th token, where at CR 75% the kept set is mostly tokens whose target
    depends on what comes later. The best a scorer can do there, knowing only what it sees when the
    token leaves the window, is the conditional mean of the log-target; squared error is the loss
    whose minimum is that mean. The boundary, pair and listwise losses rank the top; this one fits
    the rest. Both sides are centred per (row, head) over the tokens that compete, so only the
    ranking counts (the log-target sits near log ε ≈ -13 for most tokens, a level the score's bias
    would otherwise spend training on), and both are raw scores: Eq. 20's decay `-t log γ` is the
    same on each.

    Args:
      scores, target_scores: float [B, H, S]; the loss covers every token that ever competes for
        the long-range budget, s <= t <= S - 1 - w (Eq. 4).
      sinks, window: s and w.
      lengths: int [B] or None: row b's real tokens are its first `lengths[b]` (the rest padding), and
        S is then lengths[b] in the range above.

    Returns:
      (loss, metrics): the float32 mean over (row, head, token) of ((r̂ - mean r̂) - (r - mean r))²,
      0 when no token competes; metrics: `regression_rmse`, its square root.
    """
    seq_len = scores.shape[-1]
    t = jnp.arange(seq_len)
    end = jnp.full((scores.shape[0], 1, 1), seq_len) if lengths is None else jnp.asarray(lengths)[:, None, None]
    competes = (t >= sinks) & (t <= end - 1 - window)  # [B, 1, S]
    n_row = jnp.sum(competes, -1, keepdims=True).astype(jnp.float32)  # [B, 1, 1]
    err = jnp.where(competes, scores.astype(jnp.float32) - jax.lax.stop_gradient(target_scores.astype(jnp.float32)),
                    0.0)
    err = jnp.where(competes, err - jnp.sum(err, -1, keepdims=True) / jnp.maximum(n_row, 1.0), 0.0)
    loss = jnp.sum(err * err) / jnp.maximum(jnp.sum(n_row) * err.shape[1], 1.0)
    return loss, {"regression_rmse": jax.lax.stop_gradient(jnp.sqrt(loss))}


def boundary_auc(margin: jax.Array, y: jax.Array, valid: jax.Array) -> jax.Array:
    """Ranking quality at the boundary: the probability that a token the teacher keeps gets a larger
    student margin r̂_new(q) − r̂_bnd(q) than one it drops (ties count 1/2), over all (keep, drop)
    pairs of valid examples within each (batch, head) row; 0.5 when no row has both.

    margin, y (±1), valid: [B, H, Nq]. Unlike boundary accuracy it does not depend on where the
    scores sit relative to 0, only on their order: it moves as soon as the scorer ranks better.
    """
    margin = jax.lax.stop_gradient(margin.astype(jnp.float32))
    keep, drop = valid & (y > 0), valid & (y < 0)
    pairs = keep[..., :, None] & drop[..., None, :]  # [B, H, Nq, Nq]
    above = margin[..., :, None] - margin[..., None, :]
    wins = jnp.where(above > 0, 1.0, jnp.where(above == 0, 0.5, 0.0))
    total = jnp.sum(pairs.astype(jnp.float32))
    return jnp.where(total > 0, jnp.sum(jnp.where(pairs, wins, 0.0)) / jnp.maximum(total, 1.0), 0.5)


def sample_query_positions(
    rng: jax.Array,
    *,
    batch: int,
    seq_len: int,
    num: int,
    min_q: int,
    late_bias_fraction: float,
    lengths: jax.Array | None = None,
) -> jax.Array:
    """Query positions for the retention loss (Appendix B.6), int32 [batch, num].

    Every position is saturated: `min_q <= q < seq_len` with `min_q = s + w + k` (Eq. 25).
    Per row, `round(num · late_bias_fraction)` samples are late-biased and the rest
    uniform. Late-biased samples have a linearly increasing density,
    `q = min_q + floor((seq_len − min_q) · sqrt(u))`, u ~ U[0, 1): P(q) ∝ 2(q − min_q) + 1,
    mean two thirds of the way into the saturated range, no scale to tune, never out of
    range. Positions may repeat. Deterministic in `rng`.

    lengths: int [batch] or None. Row b's real tokens are its first `lengths[b]` and the rest is
    padding (a packed row's tail): its samples then fall in `min_q <= q < lengths[b]` (the same
    draws as above with seq_len = lengths[b]; a row without padding is sampled exactly as with
    None), and a row with no real saturated position (`lengths[b] <= min_q`) gets −1 throughout,
    which every retention loss and metric counts as no example.
    """
    if num < 1 or batch < 1:
        raise ValueError(f"batch and num must be >= 1, got batch={batch}, num={num}")
    if min_q < 0:
        raise ValueError(f"min_q must be >= 0, got {min_q}")
    if min_q >= seq_len:
        raise ValueError(
            f"no saturated query position: min_q = s + w + k = {min_q} >= seq_len = {seq_len}; "
            "the sequence must be longer than the KVpop budget"
        )
    if not 0.0 <= late_bias_fraction <= 1.0:
        raise ValueError(f"late_bias_fraction must be in [0, 1], got {late_bias_fraction!r}")
    num_late = int(round(num * late_bias_fraction))
    k_uniform, k_late = jax.random.split(rng)
    end = seq_len
    if lengths is not None:
        lengths = jnp.asarray(lengths)
        if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"lengths must be int [batch] = [{batch}], got {lengths.dtype} {lengths.shape}")
        end = jnp.clip(lengths.astype(jnp.int32), min_q + 1, seq_len)[:, None]  # [batch, 1]
    uniform = jax.random.randint(k_uniform, (batch, num - num_late), min_q, end, dtype=jnp.int32)
    u = jax.random.uniform(k_late, (batch, num_late), jnp.float32)
    late = min_q + jnp.floor((end - min_q) * jnp.sqrt(u)).astype(jnp.int32)
    late = jnp.clip(late, min_q, end - 1)  # float rounding guard
    q = jnp.concatenate([uniform, late], axis=1)
    return q if lengths is None else jnp.where(lengths[:, None] > min_q, q, -1)


def target_head_queries(target: jax.Array, *, num: int, min_q: int, window: int,
                        lengths: jax.Array | None = None) -> jax.Array:
    """Per head, the query positions at which the target's `num` highest tokens become eligible.

    The uniform and late-biased samples (`sample_query_positions`) meet a token only when its own
    leave-time position is drawn; the few tokens a head's target ranks far above the rest (a fact
    read again and again, long after) then appear in a handful of examples among hundreds decided
    by near-ties at the cutoff. These samples put every such token into the loss once per row: for
    each (row, head), the `num` tokens t with the highest target among those whose leave time
    q = t + w is saturated (min_q <= q < S), returned as q. Not in the paper (App. B.6 samples
    uniform and late-biased positions only); off by default (`KVpopConfig.target_head_samples`).

    Args:
      target: float [B, H, S], the future-attention target (stop-gradient).
      num: samples per (row, head), 1 <= num <= S - max(min_q, w).
      min_q: s + w + k, the first saturated query position; window: w.
      lengths: int [B] or None: row b's real tokens are its first `lengths[b]`; its queries are then
        drawn below that, and where fewer than `num` real ones exist the rest are −1 (no example).

    Returns:
      int32 [B, H, num], each in [max(min_q, w), S) or −1.
    """
    s = target.shape[-1]
    first = max(min_q, window)
    if not 1 <= num <= s - first:
        raise ValueError(f"target_head_samples must be in [1, {s - first}] for S = {s}, min_q = {min_q}, "
                         f"w = {window}, got {num}")
    t = jnp.arange(s)
    end = s if lengths is None else jnp.asarray(lengths)[:, None, None]
    eligible = (t + window >= first) & (t + window < end)  # [S] or [B, 1, S]
    masked = jnp.where(eligible, jax.lax.stop_gradient(target.astype(jnp.float32)), -jnp.inf)
    top, top_t = jax.lax.top_k(masked, num)
    return jnp.where(top > -jnp.inf, top_t + window, -1).astype(jnp.int32)


def teacher_topk(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The teacher's top-k logits per token: (values [..., k] in logits' dtype, indices int32)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [1, vocab={logits.shape[-1]}], got {k}")
    values, indices = jax.lax.top_k(logits, k)
    return values, indices.astype(jnp.int32)


def topk_kl_loss(
    student_logits: jax.Array,
    teacher_topk_logits: jax.Array,
    teacher_topk_indices: jax.Array,
    *,
    temperature: float = 1.0,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Forward KL(teacher ‖ student) on the teacher's top-K (App. F).

    The teacher distribution p̃ is the softmax over its K kept logits (zero elsewhere);
    the student log-probs are the full-vocabulary log_softmax gathered at the indices:

        KL = Σ_{i ∈ topK} p̃_i (log p̃_i − log q_i),   q = softmax(student / T)

    This is the exact KL between two full-vocabulary distributions (p̃ has no mass
    off the top-K, so those terms vanish): it is >= 0 and 0 iff the student puts all
    its mass on the top-K in the teacher's proportions. Renormalizing the student over
    the top-K as well would leave the student's mass outside the top-K unpenalized
    (any amount of it costs nothing), so we do not. No T² factor is applied.

    Args:
      student_logits: [B, S, V]; teacher_topk_logits: [B, S, K];
      teacher_topk_indices: int [B, S, K] vocabulary ids of the teacher's top-K.
      temperature: T, dividing both teacher and student logits.
      mask: optional [B, S] (bool or 0/1); tokens that count.

    Returns:
      float32 scalar: mean KL over tokens in the mask (0 when none).
    """
    if teacher_topk_logits.shape != teacher_topk_indices.shape:
        raise ValueError(
            f"teacher logits {teacher_topk_logits.shape} and indices {teacher_topk_indices.shape} differ in shape"
        )
    if student_logits.shape[:-1] != teacher_topk_logits.shape[:-1]:
        raise ValueError(
            f"student logits {student_logits.shape} and teacher top-k {teacher_topk_logits.shape} "
            "differ in leading (batch, sequence) shape"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    student_logp = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    student_logp = jnp.take_along_axis(student_logp, teacher_topk_indices, axis=-1)  # [B, S, K]
    teacher_logp = jax.nn.log_softmax(
        jax.lax.stop_gradient(teacher_topk_logits).astype(jnp.float32) / temperature, axis=-1
    )
    teacher_p = jnp.exp(teacher_logp)
    per_token = jnp.sum(jnp.where(teacher_p > 0, teacher_p * (teacher_logp - student_logp), 0.0), axis=-1)
    if mask is None:
        return per_token.mean()
    maskf = mask.astype(jnp.float32)
    return jnp.sum(per_token * maskf) / jnp.maximum(maskf.sum(), 1.0)
