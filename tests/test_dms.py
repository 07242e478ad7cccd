"""DMS (kvpop_jax/dms.py, dms_cache.py): the relaxation, the training bias and mask, the schedule
and auxiliary loss against numpy, and the key invariant: teacher-forced decoding with the bounded
pool == the hard-masked parallel forward while the pool is not overflowing."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from helpers import masked_attention_np, random_qkv
from kvpop_jax import KVpopConfig, Qwen3Config, load_pretrained, save_pretrained
from kvpop_jax import dms as dms_lib
from kvpop_jax import dms_cache
from kvpop_jax.config import DMSConfig
from kvpop_jax.generate import generate
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params, retrofit_params, strip_kvpop

BASE = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)


def sigmoid_np(x):
    return 1.0 / (1.0 + np.exp(-x))


# --- numpy references ------------------------------------------------------------------------


def dms_bias_np(log_keep, s, window):
    """float64 [B, Hkv, S, S]: log_keep[t] where q - t >= w, 0 elsewhere (causality aside)."""
    diff = np.arange(s)[:, None] - np.arange(s)[None, :]
    return np.where(diff >= window, np.asarray(log_keep, np.float64)[:, :, None, :], 0.0)


def biased_attention_np(q, k, v, bias, window):
    """float64 causal attention with an additive per-(q, t) bias [B, Hkv, S, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    logits = np.einsum("bqhd,bthd->bhqt", q, np.repeat(k, g, 2)) * d**-0.5 + np.repeat(bias, g, 1)
    logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqt,bthd->bqhd", p, np.repeat(v, g, 2))


# --- relaxation, decisions, bias -------------------------------------------------------------


def test_relaxed_decisions_match_numpy(rng):
    a = rng.normal(scale=2.0, size=(2, 3, 17)).astype(np.float32)
    noise = rng.logistic(size=a.shape).astype(np.float32)
    tau = 0.1
    log_keep, decisions = dms_lib.relaxed_decisions(jnp.asarray(a), jnp.asarray(noise), tau)
    ell = (a.astype(np.float64) + noise) / tau
    alpha = sigmoid_np(ell)
    np.testing.assert_allclose(np.asarray(log_keep), -np.logaddexp(0.0, ell), rtol=1e-4, atol=1e-5)  # log(1 - α)
    np.testing.assert_array_equal(np.asarray(decisions), (alpha > 0.5).astype(np.float32))
    # straight-through: the gradient of the hard decision is dα/da = α (1 - α) / τ
    grad = jax.grad(lambda x: jnp.sum(dms_lib.relaxed_decisions(x, jnp.asarray(noise), tau)[1]))(jnp.asarray(a))
    np.testing.assert_allclose(np.asarray(grad), alpha * (1 - alpha) / tau, rtol=1e-3, atol=1e-6)


def test_decision_logits_are_shifted_by_one():
    g = jnp.arange(10, dtype=jnp.float32).reshape(1, 2, 5)
    a = np.asarray(dms_lib.decision_logits(g))
    np.testing.assert_array_equal(a[..., :4], np.asarray(g)[..., 1:])  # token t is decided by token t + 1
    assert (a[..., 4] == dms_lib.NO_DECISION).all() and not (a[..., 4] > 0).any()


def test_hard_mask_matches_definition(rng):
    s, w = 12, 3
    evict = rng.random((2, 3, s)) < 0.5
    mask = np.asarray(dms_lib.dms_mask(s, jnp.asarray(evict), w))
    for q in range(s):
        for t in range(s):
            want = (t <= q) & ((q - t < w) | ~evict[:, :, t])
            np.testing.assert_array_equal(mask[:, :, q, t], want)


@pytest.mark.parametrize("unrolled_max", [None, 0])  # the unrolled causal blocks, and the rematerialized map
@pytest.mark.parametrize("s,window,block", [(23, 4, 8), (16, 1, 16), (9, 12, 4), (21, 5, None), (12, 3, 64)])
def test_training_attention_matches_numpy_and_its_gradient(rng, s, window, block, unrolled_max):
    q, k, v = random_qkv(rng, 2, s, 4, 2, 8)
    log_keep = jnp.asarray(-rng.exponential(2.0, size=(2, 2, s)).astype(np.float32))
    attention = functools.partial(dms_lib.dms_attention, window=window, block_q=block, unrolled_max=unrolled_max)
    out, lse = attention(q, k, v, log_keep)
    want = biased_attention_np(q, k, v, dms_bias_np(log_keep, s, window), window)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    assert lse.shape == (2, 4, s)

    def whole(lk):  # the same attention on the whole S x S at once
        bias = jnp.where((jnp.arange(s)[:, None] - jnp.arange(s)[None, :]) >= window, lk[:, :, None, :], 0.0)
        logits = jnp.einsum("bqhgd,bthd->bhgqt", q.reshape(2, s, 2, 2, 8), k) * 8**-0.5 + bias[:, :, None]
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
        return jnp.einsum("bhgqt,bthd->bqhgd", jax.nn.softmax(logits, -1), v).reshape(2, s, 4, 8)

    cot = jnp.asarray(rng.normal(size=out.shape).astype(np.float32))
    g_block = jax.grad(lambda lk: jnp.sum(attention(q, k, v, lk)[0] * cot))
    g_whole = jax.grad(lambda lk: jnp.sum(whole(lk) * cot))
    np.testing.assert_allclose(np.asarray(g_block(log_keep)), np.asarray(g_whole(log_keep)), atol=2e-5)
    if s > window:
        assert np.abs(np.asarray(g_block(log_keep))).max() > 1e-4  # differentiable in the gate


def test_hard_attention_is_the_masked_attention(rng):
    s, w = 20, 5
    q, k, v = random_qkv(rng, 1, s, 4, 2, 8)
    a = jnp.asarray(rng.normal(size=(1, 2, s)).astype(np.float32))
    out, _ = dms_lib.dms_attention(q, k, v, dms_lib.hard_log_keep(a), window=w, block_q=8)
    want, _ = masked_attention_np(q, k, v, np.asarray(dms_lib.dms_mask(s, a > 0, w)))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)


# --- schedule and auxiliary loss -------------------------------------------------------------


def test_schedule_and_aux_loss_match_numpy(rng):
    final, ramp = 0.875, 40
    for step in (0, 1, 10, 39, 40, 100):
        cr = 1 + (1 / (1 - final) - 1) * min(step / ramp, 1.0)
        np.testing.assert_allclose(float(dms_lib.target_eviction_at(step, final_eviction=final, ramp_steps=ramp)),
                                   1 - 1 / cr, rtol=1e-6, atol=1e-7)
    assert dms_lib.ramp_steps(DMSConfig(window=4, budget=8, ramp_fraction=0.9), 120) == 108
    frac = rng.random(6).astype(np.float32)
    for target in (0.0, 0.3, 0.9):
        np.testing.assert_allclose(float(dms_lib.aux_loss(jnp.asarray(frac), target)),
                                   np.mean(np.maximum(target - frac, 0)), rtol=1e-6)
    grad = jax.grad(lambda f: dms_lib.aux_loss(f, 0.5))(jnp.asarray([0.2, 0.7]))  # one-sided
    np.testing.assert_allclose(np.asarray(grad), [-0.5, 0.0])


def test_memory_matched_target():
    a = DMSConfig.eviction_for_memory(123, 32, 1024)
    d = DMSConfig(window=32, budget=123, target_eviction=a)
    assert d.mean_occupancy(1024) == pytest.approx(123)
    assert d.target_compression == pytest.approx(1 / (1 - a))
    assert d.retarget(256).budget == 256 and d.retarget(256).target_eviction == a
    with pytest.raises(ValueError, match="window"):
        d.retarget(32)
    with pytest.raises(ValueError, match="budget must exceed"):
        DMSConfig(window=8, budget=8)


@pytest.mark.parametrize("field", ["logit_offset", "logit_scale", "temperature", "aux_loss_weight", "kl_temperature",
                                   "target_eviction", "ramp_fraction"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "0.5"])
def test_config_refuses_non_finite_and_non_numeric_floats(field, value):
    """A NaN logit_offset made every decision logit NaN (NaN > 0 is false: nothing evicted, silently) and an
    inf temperature or weight passed `> 0`; a string failed with a bare TypeError. KVpopConfig refuses them."""
    with pytest.raises(ValueError, match=f"DMSConfig.{field} must be"):
        DMSConfig(window=4, budget=8, **{field: value})


def test_both_configs_check_their_float_fields_alike():
    """One rule for KVpopConfig and DMSConfig (they had two copies that differed): a bool is refused, a numpy
    float accepted."""
    for make, field in ((lambda **kw: KVpopConfig(**kw), "kl_temperature"),
                        (lambda **kw: DMSConfig(window=4, budget=8, **kw), "kl_temperature")):
        with pytest.raises(ValueError, match=f"Config.{field} must be a finite number, got True"):
            make(**{field: True})
        assert make(**{field: np.float32(0.5)}).kl_temperature == 0.5


def test_gate_matches_the_kvpop_scorer_parameter_count():
    for kv, head_dim in ((KVpopConfig(scorer="mlstm"), 128), (KVpopConfig(scorer="mlstm"), 64),
                         (KVpopConfig(scorer="mlp", scorer_hidden=64), 64)):
        target = dms_lib.kvpop_head_param_count(kv, head_dim)
        hidden = dms_lib.matched_gate_hidden(kv, head_dim)
        assert abs(dms_lib.gate_param_count(hidden, head_dim) - target) <= (2 * head_dim + 2) / 2
        gate = dms_lib.DMSGate(DMSConfig(gate_hidden=hidden), 3, head_dim)
        x = jnp.zeros((1, 1, 3, head_dim))
        count = sum(p.size for p in jax.tree.leaves(gate.init(jax.random.key(0), x, x)))
        assert count == 3 * dms_lib.gate_param_count(hidden, head_dim)
    assert dms_lib.kvpop_head_param_count(KVpopConfig(scorer="mlp", scorer_hidden=64), 64) == 130 * 64 + 2
    # the keys a scorer reads do not change its parameters (nor need the model's rope_theta here)
    assert dms_lib.kvpop_head_param_count(KVpopConfig(scorer="mlstm", scorer_keys="unrotated"), 64) == \
        dms_lib.kvpop_head_param_count(KVpopConfig(scorer="mlstm"), 64)


# --- the model and the bounded pool ----------------------------------------------------------


def dms_model(d: DMSConfig, rng, base=BASE, scale=1.0):
    config = dataclasses.replace(base, dms=d)
    params = retrofit_params(config, init_params(base, jax.random.key(0)), jax.random.key(1))
    flat = traverse_util.flatten_dict(params, sep="/")
    # The gates start at -5 (nothing evicted); random ones with offset 0 evict about half.
    flat = {k: jnp.asarray(scale * rng.normal(size=v.shape).astype(np.float32)) if "/dms/" in k else v
            for k, v in flat.items()}
    return Qwen3ForCausalLM(config), traverse_util.unflatten_dict(flat, sep="/")


def teacher_forced(model, params, ids, prompt_len):
    cache = dms_cache.init_cache(model.config, ids.shape[0])
    step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c))  # jit: op by op is slower
    out = step(cache, ids[:, :prompt_len])
    logits, cache = [out.logits], out.cache
    for t in range(prompt_len, ids.shape[1]):
        out = step(cache, ids[:, t : t + 1])
        logits.append(out.logits)
        cache = out.cache
    return jnp.concatenate(logits, axis=1), cache


@pytest.mark.parametrize("window,prompt_len", [(4, 3), (4, 20), (1, 1), (6, 9)])
def test_teacher_forced_decode_equals_masked_forward(rng, window, prompt_len):
    s = 36
    model, params = dms_model(DMSConfig(window=window, budget=s, gate_hidden=8, logit_offset=0.0), rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, s)))
    out = jax.jit(lambda i: model.apply({"params": params}, i, return_policy=True))(ids)
    decoded, cache = teacher_forced(model, params, ids, prompt_len)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(out.logits), atol=1e-4, rtol=0)
    evict = np.stack([np.asarray(a["evict"]) for a in out.aux["layers"]])  # [L, B, Hkv, S]
    assert 0.1 < evict.mean() < 0.9  # the gates evict
    dense = Qwen3ForCausalLM(BASE).apply({"params": strip_kvpop(model.config, params)[1]}, ids).logits
    assert np.abs(np.asarray(dense - out.logits)).max() > 1e-3  # and that changes the logits
    for i, layer in enumerate(cache.layers):
        assert (np.asarray(layer.overflow) == 0).all()
        # the pool holds exactly what the mask lets the last query see: occupancy = S - evicted and gone
        gone = evict[i, :, :, : s - window].sum(-1)
        np.testing.assert_array_equal(np.asarray(dms_cache.occupancy(layer, 2)), s - gone)


@pytest.mark.parametrize("capacity", [24, 10])  # 24: holds the prompt (the unpadded one pads it); 10: overflows
def test_a_padded_prefill_builds_the_unpadded_prompts_pool(rng, capacity):
    """`generate` pads a DMS prompt to a power of two (one compile per power of two, not per length): 11 tokens then
    5 of random padding build exactly the pool of the 11 alone, whose last decision stays pending (its deciding
    token would be padding), overflow count included."""
    b, hkv, d, p, pad_to, window = 2, 2, 8, 11, 16, 4
    k, v = (rng.normal(size=(b, pad_to, hkv, d)).astype(np.float32) for _ in range(2))
    a = rng.normal(size=(b, hkv, pad_to)).astype(np.float32)
    want_a = np.concatenate([a[..., : p - 1], np.full((b, hkv, 1), dms_cache.NO_DECISION, np.float32)], axis=-1)
    want = dms_cache.build_from_prefill(k[:, :p], v[:, :p], want_a, window=window, capacity=capacity)
    got = jax.jit(functools.partial(dms_cache.build_from_prefill, window=window, capacity=capacity))(
        k, v, a, prompt_len=jnp.int32(p))
    assert (np.asarray(want.overflow) > 0).any() == (capacity == 10)
    for name in ("k", "v", "head", "pos", "logit", "evict", "overflow"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)


def test_a_prompt_len_outside_the_tokens_read_is_refused_by_name(rng):
    """A hand-set `prompt_len` of 0 or past the 16 tokens read clamped its index silently; it is a ValueError now."""
    k, v = (rng.normal(size=(2, 16, 2, 8)).astype(np.float32) for _ in range(2))
    a = rng.normal(size=(2, 2, 16)).astype(np.float32)
    for bad in (0, 17):
        with pytest.raises(ValueError, match=rf"prompt_len must be an int in \[1, 16\].*got {bad}"):
            dms_cache.build_from_prefill(k, v, a, window=4, capacity=24, prompt_len=bad)


def test_generate_pads_a_prompt_to_a_power_of_two(rng):
    """generate on a DMS model compiled a program per prompt length; prompts of 11 and 13 ids now share the padded
    program of 16 (`_generate_padded`), the cache after the prompt and the tokens equal the per-length program's, and
    a Conversation's first turn replies as generate does."""
    from helpers import logged_compiles

    from kvpop_jax.generate import Conversation, _generate, _prefill, _prefill_padded
    from kvpop_jax.sampling import SamplingConfig

    model, params = dms_model(DMSConfig(window=3, budget=6, gate_hidden=8, logit_offset=0.0), rng)
    greedy, no_eos = SamplingConfig.greedy(), jnp.asarray([-1], jnp.int32)
    prompts = {n: rng.integers(0, BASE.vocab_size, size=(2, n)) for n in (11, 13)}
    fresh = dms_cache.init_cache(model.config, 2)
    padded = np.zeros((2, 16), np.int32)
    padded[:, :11] = prompts[11]
    _, want = jax.jit(lambda i: _prefill(model, params, i, fresh, None))(jnp.asarray(prompts[11]))
    _, got = jax.jit(lambda i, n: _prefill_padded(model, params, i, n, fresh))(padded, jnp.int32(11))
    assert int(got.length) == 11 and any(int(layer.overflow.sum()) for layer in want.layers)  # the pool overflows
    for got_layer, want_layer in zip(got.layers, want.layers):
        for name in ("head", "pos", "evict", "overflow"):
            np.testing.assert_array_equal(np.asarray(getattr(got_layer, name)), np.asarray(getattr(want_layer, name)))
        for name in ("k", "v", "logit"):
            np.testing.assert_allclose(np.asarray(getattr(got_layer, name)), np.asarray(getattr(want_layer, name)),
                                       atol=1e-5, rtol=0)
    with logged_compiles() as seen:
        for n, prompt in prompts.items():
            tokens, _ = generate(model, params, prompt, max_new_tokens=4, sampling=greedy)
            want_tokens = _generate(model, params, jnp.asarray(prompt), jax.random.key(0), no_eos, max_new_tokens=4,
                                    sampling=greedy, cache="dms")
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens[0]), err_msg=f"{n} ids")
    assert [f for _, f in seen].count("jit(_generate_padded)") == 1, seen
    with pytest.warns(UserWarning, match="the DMS pool overflowed by turn 1"):  # B 6 of 13: as generate's pool
        reply, _ = Conversation(model, params).send(prompts[13][1], max_new_tokens=4, sampling=greedy)
    np.testing.assert_array_equal(np.asarray(reply), np.asarray(tokens[1]))


def test_occupancy_varies_per_head_and_the_pool_has_fixed_size(rng):
    d = DMSConfig(window=4, budget=20, gate_hidden=8, logit_offset=0.0)
    model, params = dms_model(d, rng)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(1, 40)))
    _, short = teacher_forced(model, params, ids[:, :12], 6)
    _, long = teacher_forced(model, params, ids, 6)
    shapes = lambda c: [x.shape for x in jax.tree_util.tree_leaves(c)]  # noqa: E731
    assert shapes(short) == shapes(long)
    assert long.nbytes == dms_cache.init_cache(model.config, 1).nbytes
    assert long.layers[0].k.shape == (1, BASE.num_key_value_heads * d.budget, BASE.head_dim)
    occ = np.stack([np.asarray(dms_cache.occupancy(layer, 2)) for layer in long.layers])
    assert occ.min() != occ.max()  # heads hold different numbers of tokens


def test_pool_capacity_must_hold_every_heads_window():
    """init_layer_cache(capacity=2) made a pool that overwrote window tokens of other heads while decoding
    (silently), and capacity=0 meant the default."""
    config = dataclasses.replace(BASE, dms=DMSConfig(window=3, budget=8, gate_hidden=8))
    assert dms_cache.init_layer_cache(config, 1).capacity == 16
    assert dms_cache.init_layer_cache(config, 1, capacity=7).capacity == 7
    for capacity in (0, 2, 6, 7.0, True):
        with pytest.raises(ValueError, match="capacity must be an int > num_kv_heads \\* window = 6"):
            dms_cache.init_layer_cache(config, 1, capacity=capacity)


@pytest.mark.parametrize("prompt_len", [5, 30])
def test_full_pool_drops_old_tokens_and_keeps_the_window(rng, prompt_len):
    d = DMSConfig(window=3, budget=6, gate_hidden=8, logit_offset=40.0)  # offset 40: nothing is evicted
    model, params = dms_model(d, rng, scale=0.01)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 40)))
    _, cache = teacher_forced(model, params, ids, prompt_len)
    for layer in cache.layers:
        assert (np.asarray(layer.overflow) > 0).all()
        pos, head = np.asarray(layer.pos), np.asarray(layer.head)
        assert (pos >= 0).all()  # full
        for h in range(2):  # every head still holds its whole window
            assert set(range(40 - d.window, 40)) <= set(pos[0][head[0] == h])


def test_training_forward_reports_the_rate_and_trains_the_gate(rng):
    model, params = dms_model(DMSConfig(window=4, budget=16, gate_hidden=8, logit_offset=0.0), rng, scale=0.3)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 24)))
    out = model.apply({"params": params}, ids, rngs={"dms": jax.random.key(0)})
    frac = np.asarray(out.aux["dms_frac"])
    assert frac.shape == (2,) and ((0 < frac) & (frac < 1)).all()
    assert 0 < float(out.aux["metrics"]["eviction_rate"]) < 1
    # the noise makes training stochastic, no noise is the hard forward
    other = model.apply({"params": params}, ids, rngs={"dms": jax.random.key(1)})
    assert np.abs(np.asarray(other.logits - out.logits)).max() > 0

    def loss(p):
        o = model.apply({"params": p}, ids, rngs={"dms": jax.random.key(0)})
        return jnp.mean(o.logits[..., 0] ** 2) + dms_lib.aux_loss(o.aux["dms_frac"], 0.9)

    grads = jax.grad(loss)(params)["layers_1"]["self_attn"]["dms"]
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))


def test_aux_fraction_counts_a_rows_real_tokens_only(rng):
    """With `row_lengths`, dms_frac is the mean relaxed decision over each row's real tokens that have one (all
    but its last real token), the padding tail left out; without, over every token but the row's last."""
    b, h, s, d = 2, 2, 12, 8
    q = jnp.asarray(rng.normal(size=(b, s, 2 * h, d)).astype(np.float32))
    k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)).astype(np.float32)) for _ in range(2))
    g = jnp.asarray(rng.normal(size=(b, h, s)).astype(np.float32))
    noise = jax.random.logistic(jax.random.key(3), (b, h, s))
    cfg = DMSConfig(window=3, budget=8, gate_hidden=8)
    _, dec = dms_lib.relaxed_decisions(dms_lib.decision_logits(g), noise, cfg.temperature)
    dec = np.asarray(dec, np.float64)
    _, full = dms_lib.dms_layer_attention(q, k, v, g, cfg, noise=noise)
    _, cut = dms_lib.dms_layer_attention(q, k, v, g, cfg, noise=noise, row_lengths=jnp.array([7, 12]))
    np.testing.assert_allclose(np.asarray(full["dms_frac"]), dec[:, :, :s - 1].mean(axis=(1, 2)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cut["dms_frac"]), [dec[0, :, :6].mean(), dec[1, :, :11].mean()], rtol=1e-5)


def test_export_round_trip_and_generate(tmp_path, rng):
    d = DMSConfig(window=4, budget=10, gate_hidden=8, target_eviction=0.5)
    model, params = dms_model(d, rng)
    save_pretrained(model.config, params, tmp_path / "dms")
    config, loaded = load_pretrained(tmp_path / "dms")
    assert config.dms == d and config.kvpop is None
    w1 = params["layers_0"]["self_attn"]["dms"]["w1"]
    np.testing.assert_array_equal(np.asarray(loaded["layers_0"]["self_attn"]["dms"]["w1"]), np.asarray(w1))
    prompt = jnp.asarray(rng.integers(0, BASE.vocab_size, size=(2, 15)))
    tokens, _ = generate(Qwen3ForCausalLM(config), loaded, prompt, max_new_tokens=5)
    assert tokens.shape == (2, 5)
    with pytest.raises(ValueError, match="both kvpop and dms"):
        dataclasses.replace(config, kvpop=KVpopConfig(sinks=1, window=2, topk=2))


@pytest.mark.parametrize("capacity", [40, 9])
def test_prefill_pool_equals_the_visible_set_by_brute_force(rng, capacity):
    """`build_from_prefill`'s pool against a plain count of what query P - 1 sees (`P - 1 - t < w` or `a_t <= 0`);
    with a pool too small: the window first, then older tokens by increasing a_t (ties: the newer), the rest counted
    as overflow. Only the decode after a prefill was tested, which drops a token that has left the window before
    it attends, so a pool that kept token P - 1 - w (evicted) right after the prefill passed (mutation audit)."""
    b, p, hkv, d, w = 2, 13, 2, 4, 3
    k, v = (rng.normal(size=(b, p, hkv, d)).astype(np.float32) for _ in range(2))
    a = rng.choice([-2.0, -1.0, 1.0, 2.0], size=(b, hkv, p)).astype(np.float32)  # ties among the logits
    a[..., -1] = dms_cache.NO_DECISION
    lc = dms_cache.build_from_prefill(jnp.asarray(k), jnp.asarray(v), jnp.asarray(a), window=w, capacity=capacity)
    for i in range(b):
        visible = [(h, t) for h in range(hkv) for t in range(p) if p - 1 - t < w or a[i, h, t] <= 0]
        window = [(h, t) for h, t in visible if p - 1 - t < w]
        older = sorted((x for x in visible if x not in window), key=lambda x: (a[i, x[0], x[1]], -x[1]))
        want = (window + older)[:capacity]
        pos, head = np.asarray(lc.pos[i]), np.asarray(lc.head[i])
        got = [(int(h), int(t)) for h, t in zip(head, pos) if t >= 0]
        assert sorted(got) == sorted(want), (capacity, i)
        assert int(lc.overflow[i]) == max(0, len(visible) - capacity)
        for slot, (h, t) in enumerate(zip(head, pos)):
            if t >= 0:
                np.testing.assert_array_equal(np.asarray(lc.k[i, slot]), k[i, t, h])
                np.testing.assert_array_equal(np.asarray(lc.v[i, slot]), v[i, t, h])
                assert bool(lc.evict[i, slot]) == (a[i, h, t] > 0)
