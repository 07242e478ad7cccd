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
