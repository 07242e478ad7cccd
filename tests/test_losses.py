"""Retention loss, query sampler and top-k KL against plain numpy / python loops."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpop_jax import losses

B, H, S, NQ = 2, 3, 24, 10
KNOBS = dict(temperature=0.7, omega_min=0.1, tau_omega=0.5, balance_min=0.2, balance_max=5.0)


def _random_problem(rng, valid_frac=0.7):
    """Random scores and boundaries [B, H, S] (not policy-consistent: the loss must not care)."""
    q = np.arange(S)
    t_new = np.broadcast_to(q - 4, (B, H, S)).astype(np.int32)
    t_bnd = rng.integers(0, S, size=(B, H, S)).astype(np.int32)
    y = np.where(rng.random((B, H, S)) < 0.35, 1, -1).astype(np.int32)
    valid = (rng.random((B, H, S)) < valid_frac) & (t_new >= 0)
    boundary = types.SimpleNamespace(t_new=t_new, t_bnd=t_bnd, y=y, valid=valid)
    scores = rng.normal(size=(B, H, S)).astype(np.float32)
    target = rng.normal(size=(B, H, S)).astype(np.float32) * 2.0
    log_gamma = -rng.uniform(0.01, 0.2, size=(H,)).astype(np.float32)
    q_idx = rng.integers(0, S, size=(B, NQ)).astype(np.int32)
    return scores, log_gamma, target, boundary, q_idx


def _loop_retention_loss(scores, log_gamma, target, bd, q_idx, *, margin_weighting, balance_weighting,
                         labels="hard"):
    """Eq. 7, 22–24 one example at a time in python floats."""
    ex = []
    for b in range(B):
        for h in range(H):
            for q in (q_idx[b, h] if q_idx.ndim == 3 else q_idx[b]):
                if not bd.valid[b, h, q]:
                    continue
                tn, tb, y = int(bd.t_new[b, h, q]), int(bd.t_bnd[b, h, q]), float(bd.y[b, h, q])
                lg = float(log_gamma[h])
                diff = scores[b, h, tn] + (q - tn) * lg - (scores[b, h, tb] + (q - tb) * lg)  # Eq. 5
                tdiff = target[b, h, tn] + (q - tn) * lg - (target[b, h, tb] + (q - tb) * lg)
                ex.append(dict(h=h, y=y, diff=float(diff), tdiff=float(tdiff), margin=y * float(tdiff)))
    if not ex:
        return 0.0, 0.0, 0.0, 0
    w = []
    for e in ex:
        wi = 1.0
        if margin_weighting:
            sig = 1.0 / (1.0 + math.exp(-e["margin"] / KNOBS["tau_omega"]))
            wi *= KNOBS["omega_min"] + (1 - KNOBS["omega_min"]) * sig
        if balance_weighting:
            head = [f for f in ex if f["h"] == e["h"]]
            rho = sum(f["y"] > 0 for f in head) / len(head)
            raw = 1 / (2 * rho) if e["y"] > 0 else 1 / (2 * (1 - rho))
            wi *= min(max(raw, KNOBS["balance_min"]), KNOBS["balance_max"])
        w.append(wi)
    mean_w = sum(w) / len(w)
    def per_example(e):
        tau = KNOBS["temperature"]
        if labels == "hard":
            return math.log1p(math.exp(-e["y"] * e["diff"] / tau))
        sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
        p, s = sig(e["tdiff"] / tau), sig(e["diff"] / tau)
        return p * math.log(p / s) + (1 - p) * math.log((1 - p) / (1 - s))  # KL(p || s)

    loss = sum(wi / mean_w * per_example(e) for wi, e in zip(w, ex)) / len(ex)
    acc = sum(e["y"] * e["diff"] > 0 for e in ex) / len(ex)
    keep = sum(e["y"] > 0 for e in ex) / len(ex)
    return loss, acc, keep, len(ex)


@pytest.mark.parametrize("margin_weighting, balance_weighting", [(True, True), (False, False), (True, False)])
def test_retention_loss_matches_python_loop(rng, margin_weighting, balance_weighting):
    scores, log_gamma, target, bd, q_idx = _random_problem(rng)
    loss, metrics = losses.retention_loss(
        scores, log_gamma, target, bd, q_idx,
        margin_weighting=margin_weighting, balance_weighting=balance_weighting, **KNOBS,
    )
    want, acc, keep, n = _loop_retention_loss(
        scores, log_gamma, target, bd, q_idx, margin_weighting=margin_weighting, balance_weighting=balance_weighting
    )
    assert n > 0 and loss.shape == () and loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["boundary_accuracy"]), acc, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["keep_rate"]), keep, rtol=1e-6)
    assert float(metrics["num_valid"]) == n


@pytest.mark.parametrize("margin_weighting", [True, False])
def test_soft_label_retention_loss_matches_python_loop(rng, margin_weighting):
    scores, log_gamma, target, bd, q_idx = _random_problem(rng)
    loss, _ = losses.retention_loss(scores, log_gamma, target, bd, q_idx, margin_weighting=margin_weighting,
                                    balance_weighting=True, labels="soft", **KNOBS)
    want, *_ = _loop_retention_loss(scores, log_gamma, target, bd, q_idx, margin_weighting=margin_weighting,
                                    balance_weighting=True, labels="soft")
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)


def test_soft_labels_are_zero_where_the_student_matches_the_target_margin(rng):
    _, log_gamma, target, bd, q_idx = _random_problem(rng)
    soft = dict(margin_weighting=True, balance_weighting=True, labels="soft", **KNOBS)
    loss, _ = losses.retention_loss(target, log_gamma, target, bd, q_idx, **soft)  # student scores = target
    assert abs(float(loss)) < 1e-6
    off, _ = losses.retention_loss(target * 0.5, log_gamma, target, bd, q_idx, **soft)
    assert float(off) > 1e-3  # a flatter ranking than the target's costs, even where its order is right
    with pytest.raises(ValueError, match="labels"):
        losses.retention_loss(target, log_gamma, target, bd, q_idx, **{**soft, "labels": "graded"})


def test_retention_loss_with_per_head_queries_matches_python_loop(rng):
    scores, log_gamma, target, bd, _ = _random_problem(rng)
    q_idx = rng.integers(0, S, size=(B, H, NQ)).astype(np.int32)  # a different set per head
    loss, metrics = losses.retention_loss(scores, log_gamma, target, bd, q_idx, margin_weighting=True,
                                          balance_weighting=True, **KNOBS)
    want, acc, _, n = _loop_retention_loss(scores, log_gamma, target, bd, q_idx, margin_weighting=True,
                                           balance_weighting=True)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["boundary_accuracy"]), acc, rtol=1e-6)
    assert float(metrics["num_valid"]) == n
    with pytest.raises(ValueError, match="q_idx"):
        losses.retention_loss(scores, log_gamma, target, bd, q_idx[:, :2], margin_weighting=True,
                              balance_weighting=True, **KNOBS)


def test_target_head_queries_match_numpy(rng):
    target = rng.normal(size=(B, H, S)).astype(np.float32)
    min_q, w, num = 9, 4, 5
    got = np.asarray(losses.target_head_queries(jnp.asarray(target), num=num, min_q=min_q, window=w))
    assert got.shape == (B, H, num) and got.dtype == np.int32
    for b in range(B):
        for h in range(H):
            eligible = [t for t in range(S) if min_q <= t + w < S]
            want = sorted(eligible, key=lambda t: -target[b, h, t])[:num]
            assert sorted(got[b, h] - w) == sorted(want)
    with pytest.raises(ValueError, match="target_head_samples must be in"):
        losses.target_head_queries(jnp.asarray(target), num=S, min_q=min_q, window=w)


def test_weights_have_mean_one_over_valid(rng):
    margin = rng.normal(size=(B, H, NQ)).astype(np.float32)
    y = np.where(rng.random((B, H, NQ)) < 0.2, 1.0, -1.0).astype(np.float32)
    valid = rng.random((B, H, NQ)) < 0.6
    kw = {k: v for k, v in KNOBS.items() if k != "temperature"}
    w = np.asarray(losses.boundary_weights(margin, y, valid, margin_weighting=True, balance_weighting=True, **kw))
    np.testing.assert_allclose(w[valid].mean(), 1.0, rtol=1e-6)
    assert np.all(w[~valid] == 0) and np.all(w[valid] > 0)
    assert w[valid].std() > 0.05  # the weights do something
    # Balance: per head, keep and drop decisions carry equal total weight when unclipped.
    w_bal = np.asarray(losses.boundary_weights(margin, y, valid, margin_weighting=False, balance_weighting=True, **kw))
    checked = 0
    for h in range(H):
        keep = valid[:, h] & (y[:, h] > 0)
        drop = valid[:, h] & (y[:, h] < 0)
        rho = keep.sum() / valid[:, h].sum()
        if 0.1 < rho < 0.9:
            np.testing.assert_allclose(w_bal[:, h][keep].sum(), w_bal[:, h][drop].sum(), rtol=1e-5)
            checked += 1
    assert checked > 0
    none = np.asarray(losses.boundary_weights(margin, y, np.zeros_like(valid), margin_weighting=True,
                                              balance_weighting=True, **kw))
    assert np.all(none == 0)


def test_retention_loss_gradients(rng):
    scores, log_gamma, target, bd, q_idx = _random_problem(rng)

    def loss_fn(scores, log_gamma, target):
        return losses.retention_loss(
            scores, log_gamma, target, bd, q_idx, margin_weighting=True, balance_weighting=True, **KNOBS
        )[0]

    g_scores, g_gamma, g_target = jax.grad(loss_fn, argnums=(0, 1, 2))(scores, log_gamma, target)
    assert np.all(np.isfinite(np.asarray(g_scores))) and np.any(np.asarray(g_scores) != 0)
    assert np.all(np.isfinite(np.asarray(g_gamma))) and np.any(np.asarray(g_gamma) != 0)
    assert np.all(np.asarray(g_target) == 0)


def test_retention_loss_without_valid_examples_is_zero(rng):
    scores, log_gamma, target, bd, q_idx = _random_problem(rng)
    bd = types.SimpleNamespace(t_new=bd.t_new, t_bnd=bd.t_bnd, y=bd.y, valid=np.zeros_like(bd.valid))

    def loss_fn(scores):
        return losses.retention_loss(
            scores, log_gamma, target, bd, q_idx, margin_weighting=True, balance_weighting=True, **KNOBS
        )

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(scores)
    assert float(loss) == 0.0 and float(metrics["num_valid"]) == 0
    assert np.all(np.asarray(grad) == 0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_retention_loss_prefers_correct_order(rng):
    """Scores that agree with every label give accuracy 1 and a smaller loss than flipped ones."""
    scores, log_gamma, target, bd, q_idx = _random_problem(rng)
    log_gamma = np.zeros_like(log_gamma)
    # Label each query by the true order of its two tokens under the scores.
    s_new = np.take_along_axis(scores, np.clip(bd.t_new, 0, S - 1), axis=2)
    s_bnd = np.take_along_axis(scores, bd.t_bnd, axis=2)
    y = np.where(s_new > s_bnd, 1, -1).astype(np.int32)
    valid = bd.valid & (s_new != s_bnd)
    good = types.SimpleNamespace(t_new=bd.t_new, t_bnd=bd.t_bnd, y=y, valid=valid)
    bad = types.SimpleNamespace(t_new=bd.t_new, t_bnd=bd.t_bnd, y=-y, valid=valid)
    kw = dict(margin_weighting=False, balance_weighting=False, **KNOBS)
    loss_good, m_good = losses.retention_loss(scores, log_gamma, target, good, q_idx, **kw)
    loss_bad, m_bad = losses.retention_loss(scores, log_gamma, target, bad, q_idx, **kw)
    assert float(m_good["boundary_accuracy"]) == 1.0 and float(m_bad["boundary_accuracy"]) == 0.0
    assert float(loss_good) < math.log(2) < float(loss_bad)


def test_sampler_bounds_determinism_and_bias():
    key = jax.random.PRNGKey(3)
    kw = dict(batch=4, seq_len=200, num=400, min_q=60)
    a = losses.sample_query_positions(key, late_bias_fraction=0.5, **kw)
    b = losses.sample_query_positions(key, late_bias_fraction=0.5, **kw)
    c = losses.sample_query_positions(jax.random.PRNGKey(4), late_bias_fraction=0.5, **kw)
    assert a.shape == (4, 400) and a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(a) != np.asarray(c))
    a = np.asarray(a)
    assert a.min() >= 60 and a.max() <= 199
    uniform = np.asarray(losses.sample_query_positions(key, late_bias_fraction=0.0, **kw))
    late = np.asarray(losses.sample_query_positions(key, late_bias_fraction=1.0, **kw))
    for x in (uniform, late):
        assert x.min() >= 60 and x.max() <= 199
    mid = 60 + 140 / 2
    assert abs(uniform.mean() - mid) < 6  # uniform mean (60 + 199) / 2
    assert abs(late.mean() - (60 + 140 * 2 / 3)) < 6  # density ∝ (q − min_q): mean 2/3 of the way
    assert late.max() == 199  # the last position is reachable
    edge = np.asarray(losses.sample_query_positions(key, batch=2, seq_len=8, num=16, min_q=7, late_bias_fraction=0.5))
    assert np.all(edge == 7)  # a single saturated position


def test_sampler_keeps_to_each_rows_real_tokens():
    """With `lengths` a row's samples are the draws of a row of its own length; no padding, the draws of
    `lengths=None` exactly; no real saturated position, −1 throughout (no example)."""
    key = jax.random.PRNGKey(5)
    kw = dict(batch=4, num=300, min_q=60, late_bias_fraction=0.5)
    full = np.asarray(losses.sample_query_positions(key, seq_len=200, **kw))
    same = np.asarray(losses.sample_query_positions(key, seq_len=200, lengths=jnp.full((4,), 200, jnp.int32), **kw))
    np.testing.assert_array_equal(same, full)
    cut = np.asarray(losses.sample_query_positions(key, seq_len=150, **kw))
    mixed = np.asarray(losses.sample_query_positions(key, seq_len=200, lengths=jnp.array([150, 200, 60, 61]), **kw))
    np.testing.assert_array_equal(mixed[0], cut[0])  # the row of 150 real tokens: as if S were 150
    np.testing.assert_array_equal(mixed[1], full[1])
    np.testing.assert_array_equal(mixed[2], -1)  # 60 real tokens, min_q 60: no saturated real query
    np.testing.assert_array_equal(mixed[3], 60)  # one: every sample is it
    assert cut[0].max() <= 149 and cut[0].min() >= 60
    with pytest.raises(ValueError, match=r"lengths must be int \[batch\] = \[4\]"):
        losses.sample_query_positions(key, seq_len=200, lengths=jnp.array([150, 200]), **kw)


def test_sampler_rejects_sequences_within_budget():
    with pytest.raises(ValueError, match=r"min_q = s \+ w \+ k = 64 >= seq_len = 64"):
        losses.sample_query_positions(jax.random.PRNGKey(0), batch=1, seq_len=64, num=4, min_q=64,
                                      late_bias_fraction=0.5)
    with pytest.raises(ValueError, match="late_bias_fraction"):
        losses.sample_query_positions(jax.random.PRNGKey(0), batch=1, seq_len=64, num=4, min_q=8,
                                      late_bias_fraction=1.5)


def _np_topk_kl(student, t_logits, t_idx, temperature, mask):
    s = student.astype(np.float64) / temperature
    s_logp = s - (s.max(-1, keepdims=True) + np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    t = t_logits.astype(np.float64) / temperature
    p = np.exp(t - t.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    kl = (p * (np.log(p) - np.take_along_axis(s_logp, t_idx, -1))).sum(-1)
    return (kl * mask).sum() / mask.sum()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_kl_matches_numpy(rng, temperature):
    bsz, seq, vocab, k = 2, 5, 40, 7
    teacher = rng.normal(size=(bsz, seq, vocab)).astype(np.float32) * 3
    student = rng.normal(size=(bsz, seq, vocab)).astype(np.float32) * 3
    values, indices = losses.teacher_topk(teacher, k)
    np.testing.assert_array_equal(np.asarray(indices), np.argsort(-teacher, axis=-1)[..., :k])
    np.testing.assert_allclose(np.asarray(values), -np.sort(-teacher, axis=-1)[..., :k])
    mask = rng.random((bsz, seq)) < 0.7
    mask[0, 0] = True
    got = losses.topk_kl_loss(student, values, indices, temperature=temperature, mask=mask)
    want = _np_topk_kl(student, np.asarray(values), np.asarray(indices), temperature, mask)
    assert got.shape == () and got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    unmasked = losses.topk_kl_loss(student, values, indices, temperature=temperature)
    np.testing.assert_allclose(
        float(unmasked), _np_topk_kl(student, np.asarray(values), np.asarray(indices), temperature,
                                     np.ones((bsz, seq))), rtol=1e-5)


def test_topk_kl_zero_only_when_student_matches_teacher(rng):
    bsz, seq, vocab, k = 2, 4, 30, 5
    teacher = rng.normal(size=(bsz, seq, vocab)).astype(np.float32) * 2
    values, indices = losses.teacher_topk(teacher, k)
    # Student = teacher on the top-k, (almost) no mass elsewhere: KL = 0.
    student = np.full_like(teacher, -1e9)
    np.put_along_axis(student, np.asarray(indices), np.asarray(values), axis=-1)
    assert abs(float(losses.topk_kl_loss(student, values, indices))) < 1e-6
    # A shift of all student logits changes nothing (softmax invariance).
    assert abs(float(losses.topk_kl_loss(student + 5.0, values, indices))) < 1e-6
    # The same top-k proportions but mass left outside the top-k is penalized: −log Σ_topk q.
    student_full = teacher.copy()
    got = float(losses.topk_kl_loss(student_full, values, indices))
    in_topk = np.take_along_axis(jax.nn.softmax(teacher, -1), np.asarray(indices), -1).sum(-1)
    np.testing.assert_allclose(got, float(np.mean(-np.log(in_topk))), rtol=1e-4)
    assert got > 1e-3
    # Wrong proportions on the top-k are penalized too.
    np.put_along_axis(student, np.asarray(indices), np.asarray(values)[..., ::-1], axis=-1)
    assert float(losses.topk_kl_loss(student, values, indices)) > 1e-2
    # An empty mask gives 0, not NaN.
    assert float(losses.topk_kl_loss(student, values, indices, mask=np.zeros((bsz, seq), bool))) == 0.0


def test_topk_kl_gradient(rng):
    bsz, seq, vocab, k = 2, 3, 20, 4
    teacher = rng.normal(size=(bsz, seq, vocab)).astype(np.float32)
    student = rng.normal(size=(bsz, seq, vocab)).astype(np.float32)
    values, indices = losses.teacher_topk(teacher, k)
    g_student, g_teacher = jax.grad(lambda s, t: losses.topk_kl_loss(s, t, indices), argnums=(0, 1))(student, values)
    g_student = np.asarray(g_student)
    assert np.all(np.isfinite(g_student)) and np.any(g_student != 0)
    np.testing.assert_allclose(g_student.sum(-1), 0.0, atol=1e-6)  # log_softmax gradient sums to 0
    assert np.all(np.asarray(g_teacher) == 0)  # the teacher is a constant
    with pytest.raises(ValueError, match="k must be"):
        losses.teacher_topk(teacher, vocab + 1)


def test_boundary_auc_matches_pairwise_count(rng):
    """AUC per (batch, head) row of the student margin against the teacher's keep/drop labels."""
    margin = rng.normal(size=(2, 3, 12)).astype(np.float32)
    margin[0, 0, :4] = 0.25  # ties count one half: two kept and two dropped among them, all valid
    y = np.where(rng.random((2, 3, 12)) < 0.4, 1.0, -1.0).astype(np.float32)
    y[0, 0, :4] = (1.0, 1.0, -1.0, -1.0)
    valid = rng.random((2, 3, 12)) < 0.8
    valid[0, 0, :4] = True
    wins = pairs = ties = 0.0
    for b in range(2):
        for h in range(3):
            for i in range(12):
                for j in range(12):
                    if valid[b, h, i] and valid[b, h, j] and y[b, h, i] > 0 and y[b, h, j] < 0:
                        pairs += 1
                        wins += 1.0 if margin[b, h, i] > margin[b, h, j] else 0.5 if margin[b, h, i] == margin[b, h, j] else 0.0
                        ties += margin[b, h, i] == margin[b, h, j]
    assert ties >= 4  # the tie branch runs (this seed's labels once made it vacuous: mutation audit)
    got = float(losses.boundary_auc(jnp.asarray(margin), jnp.asarray(y), jnp.asarray(valid)))
    np.testing.assert_allclose(got, wins / pairs, rtol=1e-6)
    assert float(losses.boundary_auc(jnp.asarray(margin), jnp.asarray(y), jnp.zeros_like(jnp.asarray(valid)))) == 0.5
    perfect = np.where(y > 0, 1.0, -1.0).astype(np.float32)  # a margin that orders every pair right
    assert float(losses.boundary_auc(jnp.asarray(perfect), jnp.asarray(y), jnp.asarray(valid))) == 1.0


def test_rank_partners_are_older_candidates_and_deterministic():
    q_idx = jnp.asarray([[40, 41, 9, 63], [50, 12, 30, 33]], jnp.int32)
    sinks, w = 4, 8
    a = np.asarray(losses.sample_rank_partners(q_idx, num=6, sinks=sinks, window=w))
    assert a.shape == (2, 4, 6) and a.dtype == np.int32
    np.testing.assert_array_equal(a, np.asarray(losses.sample_rank_partners(q_idx, num=6, sinks=sinks, window=w)))
    t_new = np.asarray(q_idx)[..., None] - w
    has = t_new > sinks
    assert ((a >= sinks) & (a < t_new))[np.broadcast_to(has, a.shape)].all()
    assert (a[~np.broadcast_to(has, a.shape)] == -1).all()  # q = 9, 12: no older candidate
    other = np.asarray(losses.sample_rank_partners(q_idx + 1, num=6, sinks=sinks, window=w))
    assert (other != a).any()  # the draw follows the sampled queries


@pytest.mark.parametrize("margin_weighting", [True, False])
def test_pairwise_rank_loss_matches_python_loop(rng, margin_weighting):
    scores, log_gamma, target, _, _ = _random_problem(rng)
    w = 4
    q_idx = rng.integers(w + 1, S, size=(B, NQ)).astype(np.int32)
    partners = rng.integers(0, S, size=(B, NQ, 3)).astype(np.int32)
    partners[0, 0, 0] = -1
    loss, metrics = losses.pairwise_rank_loss(
        scores, log_gamma, target, q_idx, partners, window=w, temperature=KNOBS["temperature"],
        margin_weighting=margin_weighting, omega_min=KNOBS["omega_min"], tau_omega=KNOBS["tau_omega"])
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    ex = []
    for b in range(B):
        for h in range(H):
            for i, q in enumerate(q_idx[b]):
                tn = q - w
                for tj in partners[b, i]:
                    if tj < 0 or tj >= tn:
                        continue
                    lg = float(log_gamma[h])
                    d = scores[b, h, tn] - scores[b, h, tj] + (tj - tn) * lg
                    td = target[b, h, tn] - target[b, h, tj] + (tj - tn) * lg
                    p, s = sig(td / KNOBS["temperature"]), sig(d / KNOBS["temperature"])
                    kl = p * math.log(p / s) + (1 - p) * math.log((1 - p) / (1 - s))
                    om = KNOBS["omega_min"] + (1 - KNOBS["omega_min"]) * sig(abs(td) / KNOBS["tau_omega"]) \
                        if margin_weighting else 1.0
                    ex.append((om, kl, d * td > 0))
    mean_w = sum(e[0] for e in ex) / len(ex)
    want = sum(e[0] / mean_w * e[1] for e in ex) / len(ex)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["pair_accuracy"]), sum(e[2] for e in ex) / len(ex), rtol=1e-6)


def test_similar_rank_partners_are_the_closest_older_keys():
    """`similar_rank_partners` (branch experiment) against a loop: per head and query, the `num`
    candidates in [sinks, q - w) with the highest key cosine similarity to t_new = q - w."""
    from kvpop_jax.losses import similar_rank_partners

    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(2, 40, 2, 8)), jnp.float32)
    q = jnp.asarray([[20, 39], [12, 30]])
    got = np.asarray(similar_rank_partners(k, q, num=3, sinks=2, window=5))
    kn = np.asarray(k) / np.linalg.norm(np.asarray(k), axis=-1, keepdims=True)
    for b in range(2):
        for h in range(2):
            for n in range(2):
                t = int(q[b, n]) - 5
                cands = list(range(2, t))
                sims = [kn[b, j, h] @ kn[b, t, h] for j in cands]
                assert list(got[b, h, n]) == [cands[i] for i in np.argsort(sims)[::-1][:3]]
    assert got.shape == (2, 2, 2, 3)


def test_keepset_loss_matches_python_loop(rng):
    """Balanced logistic loss of (p_t - theta_q) / tau against the teacher's keep set over E(q) = [s, q - w],
    theta_q the student's k-th largest Eq.-20 priority there, by loops; queries with one class only are left
    out; the loss ignores a common shift of the scores, and its gradient reaches the scores and log gamma."""
    scores, log_gamma, _, _, _ = _random_problem(rng)
    sinks, w, k, tau = 2, 4, 3, 0.7
    q_idx = rng.integers(0, S, size=(B, NQ)).astype(np.int32)
    q_idx[0, 0] = sinks + w + k - 2  # |E(q)| = k - 1: every eligible token kept, no negatives
    q_idx[1, 0] = sinks + w - 1  # E(q) empty
    keep = rng.random((B, H, NQ, S)) < 0.4
    keep[0, :, 0] = True
    loss, metrics = losses.keepset_loss(scores, log_gamma, jnp.asarray(keep), q_idx, sinks=sinks, window=w, topk=k,
                                        temperature=tau)
    terms, accs = [], []
    for b in range(B):
        for h in range(H):
            for n, q in enumerate(q_idx[b]):
                t = np.arange(sinks, q - w + 1)
                y = keep[b, h, n, t]
                if not len(t) or y.all() or not y.any():
                    continue
                p = scores[b, h, t] - t * log_gamma[h]
                theta = np.sort(p)[::-1][min(k, len(t)) - 1]
                m = p - theta
                bce = np.where(y, np.log1p(np.exp(-m / tau)), np.log1p(np.exp(m / tau)))
                terms.append(0.5 * bce[y].mean() + 0.5 * bce[~y].mean())
                accs.append(0.5 * (m[y] >= 0).mean() + 0.5 * (m[~y] < 0).mean())
    assert len(terms) > 10
    np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["keepset_accuracy"]), np.mean(accs), rtol=1e-5)
    shifted, _ = losses.keepset_loss(scores + 5.0, log_gamma, jnp.asarray(keep), q_idx, sinks=sinks, window=w,
                                     topk=k, temperature=tau)
    np.testing.assert_allclose(float(shifted), float(loss), rtol=1e-5)
    grads = jax.grad(lambda s, g: losses.keepset_loss(s, g, jnp.asarray(keep), q_idx, sinks=sinks, window=w, topk=k,
                                                       temperature=tau)[0], argnums=(0, 1))(
        jnp.asarray(scores), jnp.asarray(log_gamma))
    assert all(np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0 for g in grads)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        losses.keepset_loss(scores, log_gamma, jnp.asarray(keep), q_idx, sinks=sinks, window=w, topk=k, temperature=0.0)
def test_listwise_retention_loss_matches_python_loop_and_is_zero_at_the_target(rng):
    """KL(softmax(target priority / tau) || softmax(student priority / tau)) over E(q) = [s, q - w]
    by loops (Eq. 20's priorities: r - t log gamma); an empty E(q) is left out; gradients are finite;
    the loss vanishes when the student equals the target up to a constant, and log gamma's
    gradient comes through the student only."""
    scores, log_gamma, target, _, _ = _random_problem(rng)
    sinks, w, tau = 2, 4, 0.4
    q_idx = rng.integers(0, S, size=(B, NQ)).astype(np.int32)
    q_idx[0, 0] = sinks + w - 1  # E(q) empty
    loss, metrics = losses.listwise_retention_loss(scores, log_gamma, target, q_idx, sinks=sinks, window=w,
                                                   temperature=tau)
    kls, top1 = [], []
    for b in range(B):
        for h in range(H):
            for q in q_idx[b]:
                t = np.arange(sinks, q - w + 1)
                if not len(t):
                    continue
                zs = (scores[b, h, t] - t * log_gamma[h]) / tau
                zt = (target[b, h, t] - t * log_gamma[h]) / tau
                lq = zs - np.log(np.exp(zs - zs.max()).sum()) - zs.max()
                lp = zt - np.log(np.exp(zt - zt.max()).sum()) - zt.max()
                kls.append(float(np.sum(np.exp(lp) * (lp - lq))))
                top1.append(np.argmax(zs) == np.argmax(zt))
    np.testing.assert_allclose(float(loss), np.mean(kls), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["listwise_top1"]), np.mean(top1), rtol=1e-6)
    grads = jax.grad(lambda s, g: losses.listwise_retention_loss(s, g, target, q_idx, sinks=sinks, window=w,
                                                                  temperature=tau)[0], argnums=(0, 1))(
        jnp.asarray(scores), jnp.asarray(log_gamma))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads) and np.abs(np.asarray(grads[1])).max() > 0
    same, _ = losses.listwise_retention_loss(target + 3.0, log_gamma, target, q_idx, sinks=sinks, window=w,
                                             temperature=tau)
    assert abs(float(same)) < 1e-5 and float(loss) > 1e-2
    with pytest.raises(ValueError, match="temperature must be > 0"):
        losses.listwise_retention_loss(scores, log_gamma, target, q_idx, sinks=sinks, window=w, temperature=0.0)


def test_regression_loss_matches_python_loop_and_fits_every_competing_token(rng):
    """Mean over (row, head, s <= t <= S - 1 - w) of the squared difference of score and target, each
    centred over those tokens, by loops; tokens that never compete (sinks, the last w) are left out and
    a constant per (row, head) changes nothing; the gradient reaches no target; zero at the target up
    to a constant; 0 when no token competes."""
    scores, _, target, _, _ = _random_problem(rng)
    sinks, w = 2, 5
    loss, metrics = losses.regression_loss(scores, target, sinks=sinks, window=w)
    errs = []
    for b in range(B):
        for h in range(H):
            d = scores[b, h, sinks:S - w].astype(np.float64) - target[b, h, sinks:S - w]
            errs += list((d - d.mean()) ** 2)
    np.testing.assert_allclose(float(loss), np.mean(errs), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["regression_rmse"]), np.sqrt(np.mean(errs)), rtol=1e-5)
    moved = scores + rng.normal(size=(B, H, 1)).astype(np.float32) * 3
    moved[..., :sinks] += 7.0
    moved[..., S - w:] -= 5.0
    np.testing.assert_allclose(float(losses.regression_loss(moved, target, sinks=sinks, window=w)[0]), float(loss),
                               rtol=1e-5)
    g_s, g_t = jax.grad(lambda a, b: losses.regression_loss(a, b, sinks=sinks, window=w)[0], argnums=(0, 1))(
        jnp.asarray(scores), jnp.asarray(target))
    competes = (np.arange(S) >= sinks) & (np.arange(S) <= S - 1 - w)
    d = np.where(competes, scores - target, 0.0)
    d = np.where(competes, d - d.sum(-1, keepdims=True) / competes.sum(), 0.0)
    np.testing.assert_allclose(np.asarray(g_s), 2 * d / len(errs), rtol=1e-4, atol=1e-7)
    assert not np.any(np.asarray(g_t))
    assert float(losses.regression_loss(target + 4.0, target, sinks=sinks, window=w)[0]) < 1e-10 < float(loss)
    nothing, _ = losses.regression_loss(scores, target, sinks=S, window=w)  # no token competes
    assert float(nothing) == 0.0


def test_a_query_of_minus_one_is_no_example_in_any_loss(rng):
    """−1, the sampler's mark of a row with no real saturated query: every loss and its metrics are those of the
    other row alone (the gathers at −1 would wrap to the row's last position if a loss did not mask them)."""
    scores, log_gamma, target, boundary, _ = _random_problem(rng, valid_frac=1.0)
    q_idx = np.stack([rng.integers(10, S, size=NQ), np.full(NQ, -1)]).astype(np.int32)
    one = lambda x: x[:1]  # noqa: E731
    row0 = types.SimpleNamespace(**{k: one(v) for k, v in vars(boundary).items()})
    kw = dict(margin_weighting=True, balance_weighting=True, **KNOBS)
    both, m_both = losses.retention_loss(scores, log_gamma, target, boundary, q_idx, **kw)
    alone, m_alone = losses.retention_loss(one(scores), log_gamma, one(target), row0, q_idx[:1], **kw)
    np.testing.assert_allclose(float(both), float(alone), rtol=1e-6)
    assert float(m_both["num_valid"]) == float(m_alone["num_valid"]) > 0
    sk = dict(sinks=2, window=4)
    partners = losses.sample_rank_partners(q_idx, num=3, **sk)
    np.testing.assert_array_equal(np.asarray(partners[1]), -1)
    k = rng.normal(size=(B, S, H, 8)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(losses.similar_rank_partners(k, q_idx, num=3, **sk)[1]), -1)
    knobs = dict(temperature=0.7, margin_weighting=True, omega_min=0.1, tau_omega=0.5)
    pair = losses.pairwise_rank_loss(scores, log_gamma, target, q_idx, partners, window=4, **knobs)[0]
    pair1 = losses.pairwise_rank_loss(one(scores), log_gamma, one(target), q_idx[:1], partners[:1], window=4,
                                      **knobs)[0]
    np.testing.assert_allclose(float(pair), float(pair1), rtol=1e-6)
    lw = losses.listwise_retention_loss(scores, log_gamma, target, q_idx, temperature=0.5, **sk)[0]
    lw1 = losses.listwise_retention_loss(one(scores), log_gamma, one(target), q_idx[:1], temperature=0.5, **sk)[0]
    np.testing.assert_allclose(float(lw), float(lw1), rtol=1e-6)
    keep = rng.random((B, H, NQ, S)) < 0.3
    ks = losses.keepset_loss(scores, log_gamma, keep, q_idx, topk=3, temperature=0.5, **sk)[0]
    ks1 = losses.keepset_loss(one(scores), log_gamma, keep[:1], q_idx[:1], topk=3, temperature=0.5, **sk)[0]
    np.testing.assert_allclose(float(ks), float(ks1), rtol=1e-6)
