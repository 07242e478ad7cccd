"""kvpop_torch's prefill policy equals kvpop_jax's: ranks with ties, and the KVpop mask (Eq. 26)."""

import numpy as np
import pytest
import torch

from helpers import random_ranks
from kvpop_jax import policy as jax_policy
from kvpop_torch import policy


def test_ranks_break_ties_by_position_like_kvpop_jax(rng):
    priority = rng.integers(-3, 3, size=(2, 3, 40)).astype(np.float32)  # many ties
    priority[0, 0, :5] = -1e30
    priority[0, 1, 3] = -0.0
    want = np.asarray(jax_policy.ranks_from_priority(priority))
    np.testing.assert_array_equal(policy.ranks_from_priority(torch.from_numpy(priority)).numpy(), want)


@pytest.mark.parametrize("s,w,k,length", [(2, 3, 4, 30), (0, 1, 5, 17), (3, 4, 0, 20), (1, 2, 40, 25),
                                          (4, 30, 3, 20), (2, 3, 4, 300)])
def test_prefill_mask_equals_the_running_topk_mask(rng, s, w, k, length):
    ranks = random_ranks(rng, 2, 3, length)
    cutoffs = jax_policy.running_topk_cutoff(ranks, sinks=s, window=w, topk=k, implementation="xla")
    want = np.asarray(jax_policy.kvpop_mask(ranks, cutoffs, sinks=s, window=w))
    last = policy.last_kept_query(torch.from_numpy(ranks).long(), sinks=s, window=w, topk=k, block=64)
    for q0, q1 in [(0, length), (length // 3, length)]:
        got = policy.prefill_mask_block(last, q0, q1, sinks=s, window=w).numpy()
        np.testing.assert_array_equal(got, want[..., q0:q1, :])
    assert want.sum(-1).max() <= s + w + k


def one_step_at_a_time(lr_pos, lr_prio, cand_pos, cand_prio):
    """`long_range_steps` by the one-step rule (`KVpopLayer._admit`), slot by slot in plain Python: an empty slot
    first (the first), else the worst slot (lowest priority, ties: the later position) iff strictly better."""
    b, h, k = lr_pos.shape
    n = cand_pos.shape[-1]
    lr_leave, cand_leave = np.full((b, h, k), n), np.full((b, h, n), n)
    source = np.full((b, h, k), -1)
    for r in np.ndindex(b, h):
        slots = [(lr_pos[r][j], lr_prio[r][j], j) if lr_pos[r][j] >= 0 else None for j in range(k)]
        for i in range(n):
            if cand_pos[r][i] < 0:
                continue
            new = (cand_pos[r][i], cand_prio[r][i], k + i)
            empty = [j for j in range(k) if slots[j] is None]
            if empty:
                slots[empty[0]] = new
                continue
            worst = min(range(k), key=lambda j: (slots[j][1], -slots[j][0]))
            if new[1] > slots[worst][1]:
                gone = slots[worst][2]
                (lr_leave[r] if gone < k else cand_leave[r])[gone % k if gone < k else gone - k] = i
                slots[worst] = new
            else:
                cand_leave[r][i] = i
        source[r] = [-1 if x is None else x[2] for x in slots]
    return lr_leave, cand_leave, source


@pytest.mark.parametrize("k,n,block", [(1, 12, 4), (3, 30, 5), (8, 40, 256), (6, 3, 2), (5, 0, 4)])
def test_long_range_steps_equal_one_step_at_a_time(rng, k, n, block):
    """Ties everywhere (integer priorities), empty slots, steps without a candidate, blocks smaller than the input."""
    b, h = 2, 3
    lr_pos = np.stack([rng.permutation(50)[:k] for _ in range(b * h)]).reshape(b, h, k)
    lr_pos = np.where(rng.random((b, h, k)) < 0.3, -1, lr_pos)
    lr_prio = rng.integers(-3, 3, size=(b, h, k)).astype(np.float32)
    cand_pos = np.where(rng.random((b, h, n)) < 0.2, -1, 50 + np.arange(n))
    cand_prio = rng.integers(-3, 3, size=(b, h, n)).astype(np.float32)
    want = one_step_at_a_time(lr_pos, lr_prio, cand_pos, cand_prio)
    got = [x.numpy() for x in policy.long_range_steps(*map(torch.from_numpy, (lr_pos, lr_prio, cand_pos, cand_prio)),
                                                       topk=k, block=block)]
    np.testing.assert_array_equal(np.where(lr_pos >= 0, got[0], n), np.where(lr_pos >= 0, want[0], n))
    np.testing.assert_array_equal(np.where(cand_pos >= 0, got[1], n), np.where(cand_pos >= 0, want[1], n))
    np.testing.assert_array_equal(got[2], want[2])
    assert n == 0 or ((want[1] < n).any() and (want[2] >= k).any())  # candidates evicted and kept: the rule ran
