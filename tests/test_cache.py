"""The key invariant: teacher-forced bounded-cache decoding == the masked parallel forward."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from kvpop_jax import KVpopConfig, Qwen3Config
from kvpop_jax.attention import dense_attention_reference
from kvpop_jax.cache import init_cache, prefix_attention
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params, retrofit_params

BASE = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)


def kvpop_model(kv: KVpopConfig, rng):
    config = dataclasses.replace(BASE, kvpop=kv)
    params = retrofit_params(config, init_params(BASE, jax.random.key(0)), jax.random.key(1))
    flat = traverse_util.flatten_dict(params, sep="/")
    # Scorer heads start at zero (all-equal scores = pure recency); random ones exercise eviction.
    flat = {k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32)) if "/kvpop/" in k else v
            for k, v in flat.items()}
    return Qwen3ForCausalLM(config), traverse_util.unflatten_dict(flat, sep="/")


def teacher_forced(model, params, ids, prompt_len, positions=None):
    """Prefill ids[:, :prompt_len], then one token per step; `positions` [B, S] (None: the cache's own
    0, 1, ...) are the RoPE positions passed to every call."""
    at = (lambda a, b: None) if positions is None else (lambda a, b: positions[:, a:b])  # noqa: E731
    cache = init_cache(model.config, ids.shape[0])
    step = jax.jit(lambda c, t, p: model.apply({"params": params}, t, positions=p, cache=c))  # op by op is slower
    out = step(cache, ids[:, :prompt_len], at(0, prompt_len))  # the prefill
    logits, cache = [out.logits], out.cache
    for t in range(prompt_len, ids.shape[1]):
        out = step(cache, ids[:, t : t + 1], at(t, t + 1))
        logits.append(out.logits)
        cache = out.cache
    return jnp.concatenate(logits, axis=1), cache


CASES = [
    # (scorer, sinks, window, topk, prompt_len); budget B = s + w + k, sequence length 44
    ("mlp", 2, 4, 5, 3),  # prompt shorter than B
    ("mlp", 1, 3, 8, 30),  # prompt longer than B
    ("mlp", 0, 1, 6, 1),  # no sinks, w = 1, one-token prompt
    ("linear", 2, 5, 0, 9),  # k = 0: StreamingLLM-like
    ("mlstm", 2, 4, 5, 3),
    ("mlstm", 1, 6, 7, 33),
    ("mlstm", 3, 2, 4, 12),
]


def forward(model, params, ids, positions=None):
    """The masked parallel forward's logits (jitted: op by op is slower on these tiny models)."""
    return jax.jit(lambda i, p: model.apply({"params": params}, i, positions=p).logits)(ids, positions)


def assert_decode_equals_forward(model, params, ids, prompt_lens, positions=None):
    """Teacher-forced decoding from each prompt length == the masked forward; returns the last cache."""
    full = forward(model, params, ids, positions)
    for prompt_len in prompt_lens:
        decoded, cache = teacher_forced(model, params, ids, prompt_len, positions)
        np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=1e-4, rtol=0)
    return full, cache


@pytest.mark.parametrize("scorer,s,w,k,prompt_len", CASES)
def test_teacher_forced_decode_equals_masked_forward(rng, scorer, s, w, k, prompt_len):
    kv = KVpopConfig(sinks=s, window=w, topk=k, scorer=scorer, mlstm_chunk=8)
    model, params = kvpop_model(kv, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 44)))
    full = forward(model, params, ids)
    decoded, cache = teacher_forced(model, params, ids, prompt_len)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=1e-4, rtol=0)
    # The mask did bite: these logits differ from an unbounded model's.
    dense_model = Qwen3ForCausalLM(dataclasses.replace(BASE, kvpop=dataclasses.replace(kv, topk=100)))
    unbounded = forward(dense_model, params, ids)
    assert np.abs(np.asarray(unbounded - full)).max() > 1e-3
    # Every slot is filled and every kept token is one the mask allows.
    layer = cache.layers[0]
    assert (np.asarray(layer.pos) >= 0).all()


def test_non_delayed_mlstm_decodes_too(rng):
    kv = KVpopConfig(sinks=1, window=4, topk=5, scorer="mlstm", mlstm_chunk=8, delayed_readout=False)
    model, params = kvpop_model(kv, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(1, 30)))
    full = forward(model, params, ids)
    decoded, _ = teacher_forced(model, params, ids, 6)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scorer,delayed", [("mlp", True), ("mlstm", False)])  # delayed mLSTM: the next test
def test_unrotated_scorer_keys_decode_equals_masked_forward(rng, scorer, delayed):
    """scorer_keys="unrotated": the scorers read each key with its RoPE undone at its own position,
    in the parallel forward, the prefill and every decode step alike."""
    kv = KVpopConfig(sinks=1, window=4, topk=6, scorer=scorer, mlstm_chunk=8, delayed_readout=delayed,
                     scorer_keys="unrotated")
    model, params = kvpop_model(kv, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 36)))
    full, _ = assert_decode_equals_forward(model, params, ids, (5, 20))
    # The option changes the model: the same parameters reading rotated keys evict differently.
    rotated = Qwen3ForCausalLM(dataclasses.replace(BASE, kvpop=dataclasses.replace(kv, scorer_keys="rotated")))
    assert np.abs(np.asarray(rotated.apply({"params": params}, ids).logits - full)).max() > 1e-3


def test_unrotated_scorer_keys_follow_the_rope_positions_given(rng):
    """A prompt placed at RoPE positions 300.. (positions= passed to prefill and every decode step):
    the bounded cache undoes each key's rotation where it was applied, so decoding still equals the
    masked forward at those positions, and the scores equal those at positions 0.. (position-free)."""
    kv = KVpopConfig(sinks=1, window=4, topk=6, scorer="mlstm", mlstm_chunk=8, scorer_keys="unrotated",
                     mlstm_skip=True)
    model, params = kvpop_model(kv, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 30)))
    pos = jnp.broadcast_to(300 + jnp.arange(30), (2, 30))
    assert_decode_equals_forward(model, params, ids, (12,), positions=pos)
    scores = lambda p: model.apply({"params": params}, ids, positions=p, return_policy=True).aux["layers"][1]["scores"]  # noqa: E731
    # float32 RoPE angles near 330 rad carry ~2e-5 rad of rounding: scores agree to ~1e-4 (rotated keys: O(1))
    np.testing.assert_allclose(np.asarray(scores(pos)), np.asarray(scores(pos - 300)), atol=1e-3, rtol=0)


def test_cache_memory_is_constant(rng):
    kv = KVpopConfig(sinks=2, window=4, topk=5, scorer="mlstm", mlstm_chunk=8)
    model, params = kvpop_model(kv, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(1, 40)))
    _, short = teacher_forced(model, params, ids[:, :15], 10)
    _, long = teacher_forced(model, params, ids, 10)
    shapes = lambda c: [x.shape for x in jax.tree_util.tree_leaves(c)]  # noqa: E731
    assert shapes(short) == shapes(long)
    assert short.nbytes == long.nbytes == init_cache(model.config, 1).nbytes
    assert long.layers[0].k.shape == (1, BASE.num_key_value_heads, kv.budget, BASE.head_dim)


@pytest.mark.parametrize("options", [
    dict(mlstm_feature_map="softmax", mlstm_value="cached", mlstm_norm=True),
    dict(mlstm_skip=True, mlstm_gate_softcap=0.0, mlstm_init="random", mlstm_dim=8),
])
def test_mlstm_variants_decode_equals_masked_forward(rng, options):
    """Every App. E.5 option keeps the key invariant (prompt shorter than B, then longer)."""
    kv = KVpopConfig(sinks=2, window=4, topk=6, scorer="mlstm", mlstm_chunk=8, **options)
    model, params = kvpop_model(kv, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 36)))
    _, cache = assert_decode_equals_forward(model, params, ids, (5, 20))
    state = cache.layers[0].scorer_state
    assert state.C.shape[-2:] == (kv.mlstm_features(BASE.head_dim), kv.mlstm_value_dim(BASE.head_dim))


@pytest.mark.parametrize("scorer, delayed", [("mlp", False), ("mlstm", True), ("mlstm", False)])
def test_position_score_decode_equals_masked_forward(rng, scorer, delayed):
    """scorer_position="log" (a_h * log(1 + t) added to the raw score): the scores are the plain scorer's
    plus that term (numpy), and decoding the bounded cache still equals the masked forward, the term
    computed at each token's index when it is scored (on entry, or when it leaves the window)."""
    kv = KVpopConfig(sinks=1, window=4, topk=6, scorer=scorer, mlstm_chunk=8, delayed_readout=delayed,
                     scorer_keys="unrotated", scorer_position="log")
    model, params = kvpop_model(kv, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 36)))
    full, _ = assert_decode_equals_forward(model, params, ids, (5, 20))
    plain_config = dataclasses.replace(BASE, kvpop=dataclasses.replace(kv, scorer_position="none"))
    flat = traverse_util.flatten_dict(params, sep="/")
    weights = [np.asarray(flat.pop(k)) for k in sorted(k for k in flat if k.endswith("/kvpop/position_weight"))]
    assert len(weights) == BASE.num_hidden_layers
    plain = traverse_util.unflatten_dict(flat, sep="/")
    policy = lambda m, p: m.apply({"params": p}, ids, return_policy=True).aux["layers"]  # noqa: E731
    with_term, without = policy(model, params), policy(Qwen3ForCausalLM(plain_config), plain)
    # Layer 0 reads the same keys either way (later layers read what the changed policy let through).
    np.testing.assert_allclose(np.asarray(with_term[0]["scores"]),
                               np.asarray(without[0]["scores"]) + weights[0][None, :, None] * np.log1p(np.arange(36)),
                               rtol=1e-5, atol=1e-4)
    assert np.abs(np.asarray(Qwen3ForCausalLM(plain_config).apply({"params": plain}, ids).logits) - full).max() > 1e-3


@pytest.mark.parametrize("capacity, chunk, new", [(37, 4, 1), (37, 8, 3), (64, 16, 1), (20, 2048, 2)])
def test_dense_decode_attention_matches_dense_reference(rng, capacity, chunk, new):
    """`prefix_attention` (chunk loop over the filled prefix, or one pass over the capacity, plus
    the new tokens) == the dense reference over cache + new tokens, at every fill level; no slot
    past the length counts (they hold garbage here)."""
    b, hq, hkv, d = 2, 4, 2, 8
    k_cache = jnp.asarray(rng.normal(size=(b, hkv, capacity, d)), jnp.float32)
    v_cache = jnp.asarray(rng.normal(size=(b, hkv, capacity, d)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(b, new, hq, d)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(b, new, hkv, d)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(b, new, hkv, d)), jnp.float32)
    run = jax.jit(lambda pos, n: prefix_attention(q, k_cache, v_cache, k_new, v_new, q_positions=pos, length=n,
                                                  chunk=chunk))
    slots = jnp.broadcast_to(jnp.arange(capacity), (b, capacity))
    for length in sorted({0, 1, chunk - 1, chunk, capacity // 2 - new, capacity // 2, capacity - new}):
        if not 0 <= length <= capacity - new:
            continue
        pos = jnp.broadcast_to(length + jnp.arange(new), (b, new))
        got = run(pos, jnp.int32(length))
        full_k = jax.lax.dynamic_update_slice_in_dim(jnp.swapaxes(k_cache, 1, 2), k_new, length, 1)
        full_v = jax.lax.dynamic_update_slice_in_dim(jnp.swapaxes(v_cache, 1, 2), v_new, length, 1)
        want, _ = dense_attention_reference(q, full_k, full_v, q_positions=pos, kv_positions=slots,
                                            kv_valid=slots < length + new)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"length {length}")


def test_wrong_batch_or_several_tokens_after_the_prefill_are_errors_not_logits(rng):
    """Issue 13: a batch-1 cache fed 2 rows broadcast silently; a 3-token step after the prefill was off
    by 0.22 from the parallel forward. Both are ValueErrors now, for the KVpop and the baseline caches."""
    from kvpop_jax import baselines
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.modeling import abstract_params

    config = dataclasses.replace(BASE, kvpop=KVpopConfig(sinks=1, window=3, topk=4, scorer="mlp"))
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_params(config))  # values do not matter
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 12)))
    for model, cache in ((Qwen3ForCausalLM(config), init_cache(config, 1)),
                         (Qwen3ForCausalLM(BASE), baselines.init_cache(BASE, BaselineConfig("tova", 8), 1))):
        after_prefill = cache.replace(started=True, length=jnp.asarray(9, cache.length.dtype))  # as a prefill leaves it
        for c in (cache, after_prefill):
            with pytest.raises(ValueError, match="the cache holds 1 rows but the input has 2"):
                model.apply({"params": params}, ids[:, 9:10], cache=c)
        if isinstance(cache.layers[0], baselines.BaselineLayerCache):  # KVpop reads several: the next test
            with pytest.raises(ValueError, match="decodes one token per call after the prefill, got 3 tokens"):
                model.apply({"params": params}, ids[:1, 9:12], cache=after_prefill)


CONTINUE_CASES = [
    dict(scorer="mlstm", sinks=2, window=4, topk=5),  # delayed readout
    dict(scorer="mlstm", sinks=1, window=4, topk=5, delayed_readout=False, scorer_keys="unrotated"),
    dict(scorer="mlp", sinks=1, window=3, topk=8, scorer_position="log"),
    dict(scorer="linear", sinks=2, window=5, topk=0),
    dict(scorer="mlstm", sinks=2, window=4, topk=6, mlstm_feature_map="softmax", mlstm_value="cached",
         mlstm_norm=True, mlstm_skip=True, scorer_keys="unrotated", scorer_position="log"),
]


@pytest.mark.parametrize("options", CONTINUE_CASES, ids=[f"{o['scorer']}-{i}" for i, o in enumerate(CONTINUE_CASES)])
def test_several_tokens_on_a_started_cache_equal_one_token_steps(rng, options):
    """A later chat turn (or a prompt in chunks) read in one call (`KVpopHead.continue_tokens`: the evictions
    step by step, the attention at once) gives what one-token steps give: logits to float rounding, the same
    slots, their priorities and the scorer state; through blocks longer than the window, the top-k and an
    mLSTM chunk, and sinks among the new tokens (a one-token prompt with two sinks)."""
    model, params = kvpop_model(KVpopConfig(mlstm_chunk=8, **options), rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 40)))
    step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c))
    for prompt_len in (7, 1):
        cuts = [prompt_len + 2, prompt_len + 14, prompt_len + 33]  # blocks of 2, 12 and 19 tokens
        one = chunked = init_cache(model.config, 2)
        want, got = [], []
        for t0, t1 in [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, cuts[-1])]:
            out = step(one, ids[:, t0:t1])
            want.append(out.logits)
            one = out.cache
        for t0, t1 in zip([0, prompt_len] + cuts[:-1], [prompt_len] + cuts):
            out = step(chunked, ids[:, t0:t1])
            got.append(out.logits)
            chunked = out.cache
        np.testing.assert_allclose(np.concatenate(got, 1), np.concatenate(want, 1), atol=1e-5, rtol=0)
        for x, y in zip(chunked.layers, one.layers):
            np.testing.assert_array_equal(np.asarray(x.pos), np.asarray(y.pos))
            np.testing.assert_allclose(np.asarray(x.priority), np.asarray(y.priority), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.asarray(x.k), np.asarray(y.k), rtol=0, atol=1e-5)
            for a, b in zip(x.scorer_state or (), y.scorer_state or ()):
                # a layer above reads keys rounded differently: 1e-4, as the priorities
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        assert int(chunked.length) == int(one.length) == cuts[-1]


def test_several_tokens_on_a_bf16_cache_with_two_rows_equal_one_token_steps(rng):
    """A bf16 cache (`init_cache(..., dtype=bf16)` on an f32 model, `Conversation(dtype="bfloat16")`) with two
    rows: the continuation's attention once ran a bf16 x bf16 -> f32 dot that XLA's CPU runtime does not have
    (UNIMPLEMENTED under jit). Now it gives the one-token steps' logits and slots."""
    model, params = kvpop_model(KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 16)))
    step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c))
    one = chunked = step(init_cache(model.config, 2, dtype=jnp.bfloat16), ids[:, :4]).cache
    want = []
    for t in range(4, 16):
        out = step(one, ids[:, t : t + 1])
        want.append(out.logits)
        one = out.cache
    out = step(chunked, ids[:, 4:])
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(jnp.concatenate(want, 1)), atol=1e-4, rtol=0)
    for x, y in zip(out.cache.layers, one.layers):
        assert x.k.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x.pos), np.asarray(y.pos))


def test_write_slot_scatter_equals_one_hot_select(rng):
    """`write_slot` (a scatter, in place in a decode loop) == the one-hot select it replaced, on random
    slots and enable masks; disabled rows keep their old values."""
    from kvpop_jax.cache import KVpopLayerCache, write_slot

    b, h, n, d = 3, 2, 7, 4
    cache = KVpopLayerCache(k=jnp.asarray(rng.normal(size=(b, h, n, d)), jnp.float32),
                            v=jnp.asarray(rng.normal(size=(b, h, n, d)), jnp.float32),
                            pos=jnp.asarray(rng.integers(-1, 50, size=(b, h, n)), jnp.int32),
                            priority=jnp.asarray(rng.normal(size=(b, h, n)), jnp.float32))
    slot = jnp.asarray(rng.integers(0, n, size=(b, h)), jnp.int32)
    enable = jnp.asarray(rng.random((b, h)) < 0.6)
    k, v = (jnp.asarray(rng.normal(size=(b, h, d)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(rng.integers(0, 50, size=(b, h)), jnp.int32)
    prio = jnp.asarray(rng.normal(size=(b, h)), jnp.float32)
    got = jax.jit(write_slot)(cache, slot, k, v, pos, prio, enable)
    onehot = (jnp.arange(n) == slot[..., None]) & enable[..., None]
    want = (jnp.where(onehot[..., None], k[:, :, None], cache.k), jnp.where(onehot[..., None], v[:, :, None], cache.v),
            jnp.where(onehot, pos[..., None], cache.pos), jnp.where(onehot, prio[..., None], cache.priority))
    for g, w in zip((got.k, got.v, got.pos, got.priority), want):
        np.testing.assert_array_equal(g, w)
    assert bool(enable.any()) and not bool(enable.all())  # both branches exercised


def test_a_full_dense_cache_and_malformed_inputs_are_refused(rng):
    """A dense cache of 8 slots took a 9th and 10th token by overwriting slot 7 (logits off by 1.07, no
    error); a prompt longer than the cache and malformed ids or positions failed deep inside jax."""
    from kvpop_jax.cache import init_dense_cache

    params = init_params(BASE, jax.random.key(0))
    model = Qwen3ForCausalLM(BASE)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(1, 10)))
    out = model.apply({"params": params}, ids[:, :8], cache=init_dense_cache(BASE, 1, 8))
    with pytest.raises(ValueError, match="holds 8 of its 8 slots and cannot take 1 more tokens; .*max_len >= 9"):
        model.apply({"params": params}, ids[:, 8:9], cache=out.cache)
    with pytest.raises(ValueError, match="10 tokens do not fit a dense cache of 8 slots"):
        model.apply({"params": params}, ids, cache=init_dense_cache(BASE, 1, 8))
    roomy = model.apply({"params": params}, ids[:, :8], cache=init_dense_cache(BASE, 1, 10))  # room: decodes on
    step = model.apply({"params": params}, ids[:, 8:9], cache=roomy.cache)
    np.testing.assert_allclose(step.logits[0, -1], model.apply({"params": params}, ids[:, :9]).logits[0, -1],
                               rtol=1e-4, atol=1e-4)
    # Under jit the length is traced and cannot raise: the overflowing step's logits are NaN, the one with
    # room is the eager step's.
    jitted = jax.jit(lambda c, x: model.apply({"params": params}, x, cache=c).logits)
    assert np.isnan(np.asarray(jitted(out.cache, ids[:, 8:9]))).all()
    np.testing.assert_allclose(jitted(roomy.cache, ids[:, 8:9]), step.logits, rtol=1e-5, atol=1e-5)
    for batch, max_len in ((1, 0), (1, -1), (0, 8), (1, 8.0), (True, 8)):
        with pytest.raises(ValueError, match="init_dense_cache: .* expected a positive integer"):
            init_dense_cache(BASE, batch, max_len)
    bad_inputs = [
        (dict(input_ids=ids[0]), "expected an integer array \\[batch, seq\\]; got ArrayImpl of shape \\(10,\\)"),
        (dict(input_ids=ids[None]), "of shape \\(1, 1, 10\\)"),
        (dict(input_ids=ids.astype(jnp.float32)), "and dtype float32"),
        (dict(input_ids=[[1, 2, 3]]), "got list of shape \\(1, 3\\)"),
        (dict(input_ids=ids, positions=jnp.arange(10)), "positions has shape \\(10,\\); input_ids is \\(1, 10\\)"),
        (dict(input_ids=ids, segment_ids=jnp.zeros((2, 10), jnp.int32)), "segment_ids has shape \\(2, 10\\)"),
    ]
    for kwargs, message in bad_inputs:
        with pytest.raises(ValueError, match=message):
            model.apply({"params": params}, **kwargs)


@pytest.mark.parametrize("prompt_len", [5, 24])  # the few-token path (<= DECODE_MAX_QUERIES) and the tiled one
def test_dense_cache_masks_by_token_index_whatever_the_rope_positions(rng, prompt_len):
    """The dense cache masked with the caller's positions against its slot indices: with positions offset
    by 7 a prompt's queries saw up to 7 later tokens (logits off by up to 3.6). Teacher-forced decoding
    with offset positions now equals the uncached forward with the same positions."""
    from kvpop_jax.cache import init_dense_cache

    params = init_params(BASE, jax.random.key(0))
    model = Qwen3ForCausalLM(BASE)
    total = prompt_len + 3
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, total)))
    positions = jnp.broadcast_to(7 + jnp.arange(total, dtype=jnp.int32), (2, total))
    want = model.apply({"params": params}, ids, positions=positions).logits
    out = model.apply({"params": params}, ids[:, :prompt_len], positions=positions[:, :prompt_len],
                      cache=init_dense_cache(BASE, 2, total))
    got, cache = [out.logits], out.cache
    for t in range(prompt_len, total):
        out = model.apply({"params": params}, ids[:, t:t + 1], positions=positions[:, t:t + 1], cache=cache)
        got.append(out.logits)
        cache = out.cache
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=1e-4, atol=1e-4)


def test_every_cache_keeps_the_dtype_it_was_made_with(rng):
    """`init_cache(..., dtype=bf16)` on an f32 model returned f32 entries after the prefill: every bounded
    cache rebuilt itself from the prompt's k and v in the model's dtype (a cache made to halve its memory
    did not). The entries stay bf16 through the prefill and the decode steps, the memory is the bf16
    cache's, and the logits stay near the f32 cache's. The budgets hold all 14 tokens, so that only the bf16
    rounding of k and v differs (an eviction decided on rounded entries may differ, legitimately)."""
    from kvpop_jax import baselines, dms_cache
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.cache import init_dense_cache
    from kvpop_jax.config import DMSConfig

    kv_model, kv_params = kvpop_model(KVpopConfig(sinks=1, window=3, topk=10, scorer="mlstm"), rng)
    dms_config = dataclasses.replace(BASE, dms=DMSConfig(window=2, budget=14, gate_hidden=8))
    dms_params = retrofit_params(dms_config, init_params(BASE, jax.random.key(0)), jax.random.key(1))
    base_params = init_params(BASE, jax.random.key(0))
    cases = {
        "kvpop": (kv_model, kv_params, lambda dt: init_cache(kv_model.config, 2, dt)),
        "dms": (Qwen3ForCausalLM(dms_config), dms_params, lambda dt: dms_cache.init_cache(dms_config, 2, dt)),
        "h2o": (Qwen3ForCausalLM(BASE), base_params,
                lambda dt: baselines.init_cache(BASE, BaselineConfig("h2o", 14), 2, dt)),
        "dense": (Qwen3ForCausalLM(BASE), base_params, lambda dt: init_dense_cache(BASE, 2, 16, dt)),
    }
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 14)))
    for name, (model, params, make) in cases.items():
        step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c))  # noqa: B023
        runs = {}
        for dt in (jnp.float32, jnp.bfloat16):
            cache = make(dt)
            out = step(cache, ids[:, :10])
            logits = [out.logits]
            for t in range(10, 14):
                for layer in out.cache.layers:
                    assert layer.k.dtype == layer.v.dtype == dt, (name, t, layer.k.dtype)
                out = step(out.cache, ids[:, t:t + 1])
                logits.append(out.logits)
            assert out.cache.nbytes == cache.nbytes, name
            runs[dt] = np.asarray(jnp.concatenate(logits, axis=1))
        assert np.all(np.isfinite(runs[jnp.bfloat16])), name
        np.testing.assert_allclose(runs[jnp.bfloat16], runs[jnp.float32], atol=0.05, err_msg=name)


@pytest.mark.parametrize("seed", range(3))
def test_admission_keeps_the_top_k_by_priority_then_earlier_position_under_ties(seed):
    """Tokens leaving the window one by one through `admit_to_long_range`, with integer priorities that tie often:
    the long-range slots hold exactly the policy's top k (higher priority first, a tie to the earlier token), and
    each call says what it replaced. Scores from a trained scorer never tie, so a `>=` for `>` in the admission,
    or the earliest rather than the latest of the tied worst slots replaced, passed every other test here."""
    from kvpop_jax.cache import KVpopLayerCache, admit_to_long_range

    rng = np.random.default_rng(seed)
    kv = KVpopConfig(sinks=1, window=2, topk=5)
    b, h, d, n_tokens = 2, 3, 4, 40
    n = kv.sinks + kv.window + kv.topk
    cache = KVpopLayerCache(k=jnp.zeros((b, h, n, d)), v=jnp.zeros((b, h, n, d)),
                            pos=jnp.full((b, h, n), -1, jnp.int32), priority=jnp.full((b, h, n), -jnp.inf))
    prio = rng.integers(0, 4, size=(b, h, n_tokens)).astype(np.float32)  # four levels: ties everywhere
    keys = rng.normal(size=(b, h, n_tokens, d)).astype(np.float32)
    admit = jax.jit(functools.partial(admit_to_long_range, kv=kv))
    for u in range(n_tokens):
        before = np.asarray(cache.pos[..., n - kv.topk:])
        cache, admitted, replaced = admit(cache, jnp.asarray(keys[:, :, u]), jnp.asarray(keys[:, :, u]),
                                          jnp.full((b, h), u, jnp.int32), jnp.asarray(prio[:, :, u]),
                                          jnp.ones((b, h), bool))
        lr_pos = np.asarray(cache.pos[..., n - kv.topk:])
        for i in range(b):
            for j in range(h):
                want = sorted(range(u + 1), key=lambda t: (-prio[i, j, t], t))[:kv.topk]
                assert sorted(lr_pos[i, j][lr_pos[i, j] >= 0]) == sorted(want), (seed, u, i, j)
                assert bool(admitted[i, j]) == (u in want)
                if admitted[i, j]:  # the token it displaced, or -1 for an empty slot
                    gone = set(before[i, j][before[i, j] >= 0]) - set(lr_pos[i, j])
                    assert int(replaced[i, j]) == (gone.pop() if gone else -1)
    # the keys moved with their tokens
    got = np.asarray(cache.k[..., n - kv.topk:, :])
    pos = np.asarray(cache.pos[..., n - kv.topk:])
    np.testing.assert_array_equal(got, np.take_along_axis(keys, pos[..., None], axis=2))


@pytest.mark.parametrize("seed", range(2))
def test_prefill_cache_keeps_the_top_k_of_the_last_query_by_priority_then_earlier_position(seed):
    """`build_from_prefill` against a brute-force top k of E(P - 1) with integer priorities that tie often (DESIGN:
    rank ties go to the smaller position, so a tie keeps the earlier token, as the decode's admission does): the
    long-range slots hold exactly those tokens with their keys and priorities, the sinks and the window the rest."""
    from kvpop_jax.cache import build_from_prefill

    rng = np.random.default_rng(seed)
    kv = KVpopConfig(sinks=2, window=3, topk=4)
    b, h, d = 2, 3, 4
    for p in (kv.sinks + kv.window + 2, 25):
        k = rng.normal(size=(b, p, h, d)).astype(np.float32)
        prio = rng.integers(0, 3, size=(b, h, p)).astype(np.float32)  # three levels: ties everywhere
        lc = jax.jit(functools.partial(build_from_prefill, kv=kv))(jnp.asarray(k), jnp.asarray(k), jnp.asarray(prio))
        pos, got_k, got_prio = np.asarray(lc.pos), np.asarray(lc.k), np.asarray(lc.priority)
        lo = kv.sinks + kv.window
        for i, j in np.ndindex(b, h):
            want = sorted(range(kv.sinks, p - kv.window), key=lambda t: (-prio[i, j, t], t))[:kv.topk]
            long_range = pos[i, j, lo:]
            assert sorted(long_range[long_range >= 0]) == sorted(want), (p, i, j)
            held = sorted(pos[i, j, :lo])
            assert held == list(range(kv.sinks)) + list(range(p - kv.window, p)), (p, i, j)
            for slot in np.flatnonzero(pos[i, j] >= 0):
                np.testing.assert_array_equal(got_k[i, j, slot], k[i, pos[i, j, slot], j])
                assert got_prio[i, j, slot] == prio[i, j, pos[i, j, slot]]
