"""Tests for kvpop_jax.policy against brute-force per-query numpy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpop_jax import policy

# (S, s, w, k): saturating, k = 0, w = 1, k >= S, S <= s + w, no sinks, huge window.
COMBOS = [
    (24, 2, 3, 4),
    (16, 0, 1, 0),
    (16, 0, 1, 1),
    (13, 4, 4, 20),
    (8, 4, 5, 2),
    (33, 1, 1, 5),
    (20, 3, 7, 0),
    (17, 0, 4, 12),
    (40, 4, 8, 9),
    (1, 0, 1, 0),
    (2, 1, 1, 1),
    (12, 2, 9, 1),
]


def np_ranks(priority):
    """Brute-force ranks: sort best-first, ties to the smaller position."""
    p = np.asarray(priority, np.float64)
    flat = p.reshape(-1, p.shape[-1])
    out = np.empty(flat.shape, np.int64)
    for row, pr in zip(out, flat):
        order = np.lexsort((np.arange(pr.size), -pr))
        row[order] = np.arange(pr.size)
    return out.reshape(p.shape)


def eligible(q, s, w):
    return list(range(s, q - w + 1))


def topk_set(rank_row, q, s, w, k):
    """The k eligible tokens with the smallest ranks at query q (explicit per-query top-k)."""
    elig = sorted(eligible(q, s, w), key=lambda t: rank_row[t])
    return set(elig[:k])


def brute_cutoff(rank_row, s, w, k):
    out = []
    for q in range(rank_row.size):
        ranks_e = sorted(rank_row[t] for t in eligible(q, s, w))
        out.append(rank_row.size if len(ranks_e) <= k else (-1 if k == 0 else ranks_e[k - 1]))
    return np.array(out)


def brute_mask(rank_row, s, w, k):
    n = rank_row.size
    m = np.zeros((n, n), bool)
    for q in range(n):
        keep = topk_set(rank_row, q, s, w, k)
        for t in range(q + 1):
            m[q, t] = t < s or q - t < w or t in keep
    return m


def random_scores(rng, shape, integer=False):
    if integer:
        return rng.integers(-2, 3, size=shape).astype(np.float32)
    return rng.normal(size=shape).astype(np.float32) + 0.5


@pytest.mark.parametrize("seq,s,w,k", COMBOS)
@pytest.mark.parametrize("integer", [False, True])
def test_policy_matches_brute_force(rng, seq, s, w, k, integer):
    scores = random_scores(rng, (2, 3, seq), integer)
    log_gamma = -rng.uniform(0.01, 0.3, size=(3,)).astype(np.float32) * (not integer)  # 0: many ties
    priority, ranks, cutoffs = policy.policy_from_scores(scores, log_gamma, sinks=s, window=w, topk=k)
    assert priority.dtype == jnp.float32 and ranks.dtype == cutoffs.dtype == jnp.int32
    ranks, cutoffs = np.asarray(ranks), np.asarray(cutoffs)
    np.testing.assert_array_equal(ranks, np_ranks(np.asarray(priority)))
    mask = np.asarray(policy.kvpop_mask(ranks, cutoffs, sinks=s, window=w))
    kth = np.asarray(policy.running_kth_rank(ranks, sinks=s, window=w, topk=k))
    bnd = jax.tree.map(np.asarray, policy.teacher_boundary(ranks, sinks=s, window=w, topk=k))
    q = np.arange(seq)
    for b, h in np.ndindex(2, 3):
        r = ranks[b, h]
        np.testing.assert_array_equal(cutoffs[b, h], brute_cutoff(r, s, w, k))
        np.testing.assert_array_equal(mask[b, h], brute_mask(r, s, w, k))
        assert np.all(np.diff(cutoffs[b, h]) <= 0), "tau must be non-increasing in q"
        n_elig = np.maximum(q - w - s + 1, 0)
        kth_ref = np.where(n_elig > k, cutoffs[b, h], -1 if k == 0 else seq)
        exact_k = n_elig == k
        if k > 0 and exact_k.any():  # |E| == k: the k-th best is the worst eligible rank
            kth_ref[exact_k] = [max(r[t] for t in eligible(qq, s, w)) for qq in q[exact_k]]
        np.testing.assert_array_equal(kth[b, h], kth_ref)
    np.testing.assert_array_equal(mask.sum(-1), np.broadcast_to(np.minimum(q + 1, s + w + k), (2, 3, seq)))
    # The teacher boundary against an explicit per-query top-k simulation.
    for b, h in np.ndindex(2, 3):
        r = ranks[b, h]
        for qq in range(seq):
            t_new = qq - w
            kept_new = t_new >= s and t_new in topk_set(r, qq, s, w, k)
            assert bnd.t_new[b, h, qq] == min(max(t_new, 0), seq - 1)
            assert bnd.y[b, h, qq] == (1.0 if kept_new else -1.0)
            assert bool(bnd.valid[b, h, qq]) == (k > 0 and qq >= s + w + k)
            if bnd.valid[b, h, qq]:
                prev = sorted(eligible(qq - 1, s, w), key=lambda t: r[t])
                assert bnd.t_bnd[b, h, qq] == prev[k - 1]
    assert bnd.y.dtype == np.float32 and bnd.t_bnd.dtype == np.int32 and bnd.valid.dtype == np.bool_


@pytest.mark.parametrize("seq,s,w,k", COMBOS)
def test_boundary_from_precomputed_cutoffs_equals_its_own_scan(rng, seq, s, w, k):
    """One Fenwick scan serves cutoff and boundary: kth from the cutoffs == the scan's kth, and
    teacher_boundary(cutoffs=...) == teacher_boundary() field by field (any back end's cutoffs)."""
    ranks = np.stack([np.stack([rng.permutation(seq) for _ in range(3)]) for _ in range(2)]).astype(np.int32)
    cutoffs = policy.running_topk_cutoff(ranks, sinks=s, window=w, topk=k, implementation="xla")
    np.testing.assert_array_equal(policy.kth_rank_from_cutoffs(ranks, cutoffs, sinks=s, window=w, topk=k),
                                  policy.running_kth_rank(ranks, sinks=s, window=w, topk=k))
    want = policy.teacher_boundary(ranks, sinks=s, window=w, topk=k)
    got = policy.teacher_boundary(ranks, sinks=s, window=w, topk=k, cutoffs=cutoffs)
    for field in want._fields:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    with pytest.raises(ValueError, match="cutoffs shape"):
        policy.kth_rank_from_cutoffs(ranks, cutoffs[..., :-1], sinks=s, window=w, topk=k)


@pytest.mark.parametrize("seq,s,w,k", [(30, 2, 3, 4), (25, 0, 1, 1), (18, 1, 2, 0)])
def test_bounded_cache_simulation_matches_mask_and_boundary(rng, seq, s, w, k):
    """Decoding: t_new competes for k slots, the worst (ties: later) is evicted for good."""
    scores = random_scores(rng, (2, seq), integer=True)
    priority, ranks, cutoffs = policy.policy_from_scores(scores, -0.5, sinks=s, window=w, topk=k)
    mask = np.asarray(policy.kvpop_mask(ranks, cutoffs, sinks=s, window=w))
    bnd = jax.tree.map(np.asarray, policy.teacher_boundary(ranks, sinks=s, window=w, topk=k))
    p = np.asarray(priority)
    for b in range(2):
        worst = lambda ts: min(ts, key=lambda t: (p[b, t], -t))  # noqa: E731
        cache = set()
        for q in range(seq):
            t_new = q - w
            evicted = None
            if t_new >= s:
                cache.add(t_new)
                if len(cache) > k:
                    evicted = worst(cache)
                    cache.remove(evicted)
            row = {t for t in range(q + 1) if mask[b, q, t] and s <= t <= q - w}
            assert row == cache, (b, q)
            if bnd.valid[b, q]:
                assert evicted == worst([t_new, int(bnd.t_bnd[b, q])])
                assert (bnd.y[b, q] > 0) == (evicted != t_new)


def test_static_priority_reproduces_effective_scores(rng):
    """Eq. 19: sorting E(q) by r_t + (q - t) log γ equals sorting by p_t, at every q."""
    seq, s, w, k = 48, 2, 3, 6
    scores = random_scores(rng, (2, 3, seq))
    log_gamma = -rng.uniform(0.02, 0.5, size=(2, 3)).astype(np.float32)
    _, ranks, cutoffs = policy.policy_from_scores(scores, log_gamma, sinks=s, window=w, topk=k)
    mask = np.asarray(policy.kvpop_mask(ranks, cutoffs, sinks=s, window=w))
    ranks = np.asarray(ranks)
    for b, h in np.ndindex(2, 3):
        r64, lg = scores[b, h].astype(np.float64), float(log_gamma[b, h])
        for q in range(seq):
            elig = eligible(q, s, w)
            by_effective = sorted(elig, key=lambda t: (-(r64[t] + (q - t) * lg), t))
            assert by_effective == sorted(elig, key=lambda t: ranks[b, h, t])
            kept = {t for t in elig if mask[b, h, q, t]}
            assert kept == set(by_effective[:k])


def test_static_priority_shapes_and_recency(rng):
    scores = np.full((2, 3, 10), 1.5, np.float32)
    for lg in (np.float32(-0.1), np.full((3,), -0.1, np.float32), np.full((2, 3), -0.1, np.float32)):
        p = policy.static_priority(scores, lg)
        assert p.shape == (2, 3, 10) and p.dtype == jnp.float32
        np.testing.assert_allclose(p, np.broadcast_to(1.5 + 0.1 * np.arange(10), p.shape), rtol=1e-6)
        # equal raw scores + decay: newer tokens are better, so ranks run backwards
        np.testing.assert_array_equal(policy.ranks_from_priority(p)[1, 2], np.arange(10)[::-1])
    # equal priorities: ties go to the smaller position, also 0.0 vs -0.0
    np.testing.assert_array_equal(policy.ranks_from_priority(np.zeros((4,)) * np.array([1, -1, 1, -1])), np.arange(4))
    scores = random_scores(rng, (2, 3, 10)).astype(jnp.bfloat16)
    assert policy.static_priority(scores, np.float32(-0.1)).dtype == jnp.float32
    perm = rng.permutation(10)
    np.testing.assert_array_equal(policy.token_of_rank(perm)[perm], np.arange(10))


def test_decay_log_gamma(rng):
    alpha = rng.normal(size=(5,)).astype(np.float32) * 3
    lg = policy.decay_log_gamma(alpha, gamma_min=0.9, gamma_max=0.999)
    assert lg.dtype == jnp.float32 and lg.shape == (5,)
    expect = np.log(0.9) + (1 / (1 + np.exp(-alpha.astype(np.float64)))) * (np.log(0.999) - np.log(0.9))
    np.testing.assert_allclose(lg, expect, rtol=1e-5)
    ends = policy.decay_log_gamma(np.array([-50.0, 0.0, 50.0]), gamma_min=0.9, gamma_max=0.999)
    np.testing.assert_allclose(ends, [np.log(0.9), 0.5 * (np.log(0.9) + np.log(0.999)), np.log(0.999)], rtol=1e-5)
    grad = jax.grad(lambda a: policy.decay_log_gamma(a, gamma_min=0.999, gamma_max=0.999999).sum())(alpha)
    assert np.all(np.asarray(grad) > 0)


def test_jit_and_vmap(rng):
    seq, s, w, k = 20, 1, 2, 3
    scores = random_scores(rng, (3, 2, 2, seq))
    log_gamma = -rng.uniform(0.01, 0.2, size=(2,)).astype(np.float32)
    fn = functools.partial(policy.policy_from_scores, sinks=s, window=w, topk=k)
    eager = fn(scores, log_gamma)  # the public functions are themselves jitted
    vmapped = jax.jit(jax.vmap(fn, in_axes=(0, None)))(scores, log_gamma)
    np.testing.assert_allclose(eager[0], vmapped[0], rtol=1e-6)
    np.testing.assert_array_equal(eager[1], vmapped[1])
    np.testing.assert_array_equal(eager[2], vmapped[2])
    ranks = eager[1]
    bnd = policy.teacher_boundary(ranks, sinks=s, window=w, topk=k)
    bnd_v = jax.jit(jax.vmap(functools.partial(policy.teacher_boundary, sinks=s, window=w, topk=k)))(ranks)
    for a, b in zip(bnd, bnd_v):
        np.testing.assert_array_equal(a, b)
    # a bare [S] row works too
    np.testing.assert_array_equal(
        policy.running_topk_cutoff(ranks[1, 0, 1], sinks=s, window=w, topk=k), eager[2][1, 0, 1]
    )


def test_bad_arguments():
    ranks = jnp.arange(8)[::-1].reshape(1, 8)
    for kwargs, word in [
        (dict(sinks=-1, window=2, topk=1), "sinks"),
        (dict(sinks=0, window=0, topk=1), "window"),
        (dict(sinks=0, window=1, topk=-2), "topk"),
        (dict(sinks=0, window=1.5, topk=1), "window"),
        (dict(sinks=True, window=1, topk=1), "sinks"),
    ]:
        with pytest.raises(ValueError, match=word):
            policy.running_topk_cutoff(ranks, **kwargs)
    with pytest.raises(ValueError, match="integer"):
        policy.running_topk_cutoff(ranks.astype(jnp.float32), sinks=0, window=1, topk=1)
    with pytest.raises(ValueError, match=r"log_gamma of shape \(4,\)"):
        policy.static_priority(jnp.ones((2, 3, 8)), jnp.ones((4,)))
    with pytest.raises(ValueError, match="cutoffs shape"):
        policy.kvpop_mask(ranks, jnp.zeros((1, 7), jnp.int32), sinks=0, window=1)
    with pytest.raises(ValueError, match="gamma_min"):
        policy.decay_log_gamma(jnp.zeros(2), gamma_min=0.99, gamma_max=0.9)
