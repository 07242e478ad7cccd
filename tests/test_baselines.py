"""Training-free cache policies (StreamingLLM, TOVA, H2O) against a numpy brute-force simulation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpop_jax import Qwen3Config
from kvpop_jax import baselines
from kvpop_jax.baselines import BaselineConfig
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params

B, HQ, HKV, D, T = 2, 4, 2, 8, 20
G = HQ // HKV


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def simulate(cfg: BaselineConfig, q, k, v, prompt_len):
    """Brute force, one (batch row, KV head) at a time, with python lists of positions.

    q [T, Hq, D], k, v [T, Hkv, D] float64. Returns (out [T, Hq, D], kept[h][step] = sorted
    positions after each token from the prompt's last on).
    """
    n, s, r = cfg.budget, cfg.sinks, cfg.recent
    scale = D**-0.5
    out = np.zeros(q.shape)
    # Attention weights of query t over candidate positions, per query head: {hq: {pos: prob}}.
    def weights(t, cands_by_kv):
        res = {}
        for hq in range(HQ):
            h = hq // G
            c = cands_by_kv[h]
            p = _softmax(np.array([q[t, hq] @ k[j, h] for j in c]) * scale)
            out[t, hq] = p @ v[c, h]
            res[hq] = dict(zip(c, p))
        return res

    # Prefill: dense causal over the prompt.
    acc = [dict.fromkeys(range(prompt_len), 0.0) for _ in range(HKV)]
    for t in range(prompt_len):
        w = weights(t, [list(range(t + 1))] * HKV)
        for hq in range(HQ):
            for j, pj in w[hq].items():
                acc[hq // G][j] += pj / G
    last = w
    kept = []
    for h in range(HKV):
        toks = list(range(prompt_len))
        if cfg.method == "tova":
            score = {j: np.mean([last[hq][j] for hq in range(HQ)]) for j in toks}
        elif cfg.method == "h2o":
            score = acc[h]
        else:
            score = {j: float(j) for j in toks}
        protected = [j for j in toks if j < s or j > prompt_len - 1 - r]
        others = sorted((j for j in toks if j not in protected), key=lambda j: (-score[j], -j))
        kept.append(sorted(protected + others[: max(0, n - len(protected))]) if prompt_len > n else toks)
    history = [[list(x)] for x in kept]
    # Decode: attend over kept + t, then evict one if over budget.
    for t in range(prompt_len, T):
        cands = [kept[h] + [t] for h in range(HKV)]
        w = weights(t, cands)
        for h in range(HKV):
            if cfg.method == "h2o":
                acc[h][t] = 0.0
                for j in cands[h]:
                    acc[h][j] += np.mean([w[h * G + g][j] for g in range(G)])
                score = acc[h]
            elif cfg.method == "tova":
                score = {j: np.mean([w[hq][j] for hq in range(HQ)]) for j in cands[h]}
            else:
                score = {j: float(j) for j in cands[h]}
            if len(cands[h]) > n:
                evictable = [j for j in cands[h] if j >= s and j <= t - r]
                victim = min(evictable, key=lambda j: (score[j], j))
                cands[h].remove(victim)
            kept[h] = cands[h]
            history[h].append(sorted(kept[h]))
    return out, history


CONFIGS = [
    BaselineConfig("streaming", 6, sinks=2),
    BaselineConfig("tova", 6),
    BaselineConfig("tova", 6, sinks=1, recent=2),
    BaselineConfig("h2o", 6),
    BaselineConfig("h2o", 7, sinks=1, recent=2),
]


@pytest.mark.parametrize("prompt_len", [9, 3])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.method}-B{c.budget}-s{c.sinks}-r{c.recent}")
def test_policy_matches_brute_force(rng, cfg, prompt_len):
    _check_against_brute_force(rng, cfg, prompt_len)


@pytest.mark.parametrize("prompt_len,pad_to", [(9, 16), (5, 8)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.method}-B{c.budget}-s{c.sinks}-r{c.recent}")
def test_padded_prefill_matches_brute_force(rng, cfg, prompt_len, pad_to):
    """A prompt padded at its end (random q, k, v: what pad tokens give) with `prompt_len` traced, as `generate`
    pads a one-shot baseline's prompt to a power of two: the padding is neither kept nor scored, and the decode
    after it is the unpadded prompt's, by the brute force (9 -> 16: the budget evicts; 5 -> 8: the prompt fits
    B but the padding would not)."""
    _check_against_brute_force(rng, cfg, prompt_len, pad_to=pad_to)


@pytest.mark.parametrize("prompt_len", [0, 9, jnp.int32(-1), 2.0])
def test_a_prompt_len_outside_the_tokens_read_is_refused_by_name(rng, prompt_len):
    """`prompt_len` set by hand (the layer cache's `with_prompt_len`, or `prefill`'s argument) past either end of the
    8 tokens read clamped its index and built another prompt's cache silently; a concrete one outside [1, 8] (or not
    an int) is now a ValueError naming it; traced ones (generate's) are not checked."""
    q, k, v = (jnp.asarray(rng.normal(size=(B, 8, h, D)), jnp.float32) for h in (HQ, HKV, HKV))
    positions = jnp.broadcast_to(jnp.arange(8), (B, 8))
    with pytest.raises(ValueError, match=r"prompt_len must be an int in \[1, 8\]"):
        baselines.prefill(BaselineConfig("tova", 4), q, k, v, positions, prompt_len=prompt_len)
    with pytest.raises(ValueError, match=r"prompt_len must be an int (>= 1|in \[1, 8\])"):  # 9: read by the prefill
        baselines.init_layer_cache(BaselineConfig("h2o", 4), B, HKV, D).with_prompt_len(prompt_len).prefill(
            q, k, v, positions=positions, length=0, policy=None)


@pytest.mark.parametrize("prompt_len", [9, 3])
def test_tova_ties_keep_the_later_token_in_the_prefill_and_every_step(rng, prompt_len):
    """Keys repeated at every position: TOVA's scores (the last query's weights) tie exactly, and the brute force
    keeps the later of tied tokens. Random keys never tie, so the prefill keeping the earlier one passed every test
    (mutation audit)."""
    _check_against_brute_force(rng, BaselineConfig("tova", 6), prompt_len, tie_keys=True)


def _check_against_brute_force(rng, cfg, prompt_len, pad_to=None, tie_keys=False):
    q = rng.normal(size=(B, T, HQ, D)) * 2
    k = rng.normal(size=(B, T, HKV, D)) * 2
    if tie_keys:  # every key the same: every eviction, in the prefill and at each step, is among tied scores
        # Small integers: every q . k is exact in float32 whatever order a backend sums in (jax 0.12's CPU dot gave
        # copies of a random key scores an ulp apart, so rounding, not the tie rule, chose among them).
        q, k = rng.integers(-2, 3, size=q.shape).astype(float), rng.integers(-2, 3, size=k.shape).astype(float)
        k[:, 1:] = k[:, :1]
    v = rng.normal(size=(B, T, HKV, D))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    if pad_to is None:
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (B, prompt_len))
        out, lc = jax.jit(baselines.prefill, static_argnums=0)(
            cfg, f32(q[:, :prompt_len]), f32(k[:, :prompt_len]), f32(v[:, :prompt_len]), positions)
    else:
        def junk(x):  # the prompt, then random padding
            return np.concatenate([x[:, :prompt_len], rng.normal(size=(B, pad_to - prompt_len) + x.shape[2:])], axis=1)

        positions = jnp.broadcast_to(jnp.arange(pad_to), (B, pad_to))
        out, lc = jax.jit(baselines.prefill, static_argnums=0)(
            cfg, f32(junk(q)), f32(junk(k)), f32(junk(v)), positions, jnp.int32(prompt_len))
        out = out[:, :prompt_len]
        assert lc.prompt_len is None and (np.asarray(lc.pos) < prompt_len).all()
        empty = np.asarray(lc.pos) < 0  # spare slots as the unpadded prompt leaves them: zeros
        assert not np.asarray(lc.k)[empty].any() and not np.asarray(lc.v)[empty].any()
    outs, caches = [out], [lc]
    step = jax.jit(baselines.decode, static_argnums=0)
    for t in range(prompt_len, T):
        out, lc = step(cfg, lc, f32(q[:, t:t + 1]), f32(k[:, t:t + 1]), f32(v[:, t:t + 1]), t)
        outs.append(out)
        caches.append(lc)
        assert lc.pos.shape == (B, HKV, cfg.budget)  # constant memory
    got = np.asarray(jnp.concatenate(outs, axis=1))
    for b in range(B):
        want_out, want_kept = simulate(cfg, q[b], k[b], v[b], prompt_len)
        np.testing.assert_allclose(got[b], want_out, atol=1e-4)
        for h in range(HKV):
            for i, c in enumerate(caches):
                pos = np.asarray(c.pos[b, h])
                assert sorted(pos[pos >= 0].tolist()) == want_kept[h][i], (b, h, i)
    final = np.asarray(caches[-1].pos)
    assert (final >= 0).all()  # exactly B tokens kept once T > B
    assert all(len(set(row)) == cfg.budget for row in final.reshape(-1, cfg.budget))
    if cfg.method == "tova":  # one eviction per layer: every KV head holds the same positions
        assert (np.sort(final, -1) == np.sort(final[:, :1], -1)).all()


def test_config_validation():
    assert BaselineConfig("h2o", 10).recent == 5
    assert BaselineConfig("streaming", 10, sinks=4).recent == 6
    assert BaselineConfig("tova", 10).recent == 0
    with pytest.raises(ValueError, match="method must be one of"):
        BaselineConfig("snapkv", 10)
    with pytest.raises(ValueError, match="streaming keeps exactly"):
        BaselineConfig("streaming", 10, sinks=2, recent=3)
    with pytest.raises(ValueError, match="sinks \\+ recent <= budget"):
        BaselineConfig("h2o", 10, sinks=4, recent=7)
    with pytest.raises(ValueError, match="budget must be a positive int"):
        BaselineConfig("tova")
    for kwargs, message in ((dict(budget=True), "budget must be a positive int for 'h2o', got True"),
                            (dict(budget=8, recent=4.5), "recent must be an int, got 4.5"),
                            (dict(budget=8, sinks=2.0), "sinks must be an int, got 2.0")):
        with pytest.raises(ValueError, match=message):
            BaselineConfig("h2o", **kwargs)
    assert BaselineConfig("h2o", np.int64(10), sinks=np.int32(2)) == BaselineConfig("h2o", 10, sinks=2)
    # accepted silently before: dense ignored any budget, a truthy string ran the banded prefill, None sinks
    # raised a bare TypeError
    assert BaselineConfig("dense").budget is None
    for kwargs in (dict(budget=-3), dict(budget=8), dict(sinks=4), dict(recent=2)):
        with pytest.raises(ValueError, match="BaselineConfig\\('dense'\\) keeps every token"):
            BaselineConfig("dense", **kwargs)
    for flag in ("no", 1, None):
        with pytest.raises(ValueError, match="banded_prefill must be true or false"):
            BaselineConfig("streaming", 6, sinks=2, banded_prefill=flag)
    assert BaselineConfig("streaming", 6, banded_prefill=np.bool_(True)).banded_prefill
    with pytest.raises(ValueError, match="sinks must be an int, got None"):
        BaselineConfig("h2o", 8, sinks=None)


def test_model_with_unbounded_budget_equals_dense(rng):
    """Every policy with B >= length evicts nothing: teacher-forced logits == dense forward."""
    config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
    params = init_params(config, jax.random.key(0))
    model = Qwen3ForCausalLM(config)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 12)))
    full = np.asarray(model.apply({"params": params}, ids).logits)
    step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c))
    for method in ("tova", "h2o"):  # streaming: tests/test_generate.py
        cache = baselines.init_cache(config, BaselineConfig(method, 12), 2)
        out = step(cache, ids[:, :5])
        logits, cache = [out.logits], out.cache
        for t in range(5, 12):
            out = step(cache, ids[:, t:t + 1])
            logits.append(out.logits)
            cache = out.cache
        np.testing.assert_allclose(np.asarray(jnp.concatenate(logits, 1)), full, atol=1e-4, err_msg=method)
        assert cache.nbytes == baselines.init_cache(config, BaselineConfig(method, 12), 2).nbytes


@pytest.mark.parametrize("sinks,recent,block,prompt_len", [(2, 5, 4, 37), (0, 7, 8, 30), (3, 1, 4, 9),
                                                        (4, 20, 8, 23), (2, 5, 64, 37)])
def test_banded_attention_equals_numpy_masked_attention(rng, sinks, recent, block, prompt_len):
    """The banded pass reads, per query block, the sinks and the keys its band can reach (sliced);
    against numpy softmax attention under the full band mask, on positions with gaps."""
    from helpers import masked_attention_np

    q = rng.normal(size=(B, prompt_len, HQ, D)).astype(np.float32) * 2
    k = rng.normal(size=(B, prompt_len, HKV, D)).astype(np.float32) * 2
    v = rng.normal(size=(B, prompt_len, HKV, D)).astype(np.float32)
    pos = np.cumsum(rng.integers(1, 3, size=prompt_len)) - 1  # strictly increasing from 0, with gaps
    visible = (pos[None, :] <= pos[:, None]) & ((pos[None, :] < sinks) | (pos[None, :] >= pos[:, None] - recent))
    want, want_lse = masked_attention_np(q, k, v, np.broadcast_to(visible, (B, HKV, prompt_len, prompt_len)))
    fn = jax.jit(baselines._banded_attention, static_argnames=("sinks", "recent", "block"))
    got, lse = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.broadcast_to(jnp.asarray(pos), (B, prompt_len)),
                  sinks=sinks, recent=recent, block=block)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt_len", [17, 6, 4])
def test_banded_prefill_equals_streaming_token_by_token(rng, prompt_len):
    """StreamingLLM's banded prefill == a prefill of the first B tokens and one decode step per
    later prompt token: the same outputs for every prompt query and the same kept positions."""
    cfg = BaselineConfig("streaming", 6, sinks=2)
    q = jnp.asarray(rng.normal(size=(B, prompt_len, HQ, D)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, prompt_len, HKV, D)) * 2, jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, prompt_len, HKV, D)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(prompt_len), (B, prompt_len))
    banded = BaselineConfig("streaming", 6, sinks=2, banded_prefill=True)
    got, got_cache = jax.jit(baselines.prefill, static_argnums=0)(banded, q, k, v, positions)
    n0 = min(cfg.budget, prompt_len)
    out, lc = baselines.prefill(cfg, q[:, :n0], k[:, :n0], v[:, :n0], positions[:, :n0])
    outs = [out]
    for t in range(n0, prompt_len):
        out, lc = baselines.decode(cfg, lc, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], t)
        outs.append(out)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.concatenate(outs, 1)), atol=1e-5)
    assert (np.sort(np.asarray(got_cache.pos), -1) == np.sort(np.asarray(lc.pos), -1)).all()
    order = lambda c: np.argsort(np.asarray(c.pos), -1)  # noqa: E731
    for name in ("k", "v"):  # the same entries, in another slot order
        a, b = np.asarray(getattr(got_cache, name)), np.asarray(getattr(lc, name))
        np.testing.assert_array_equal(np.take_along_axis(a, order(got_cache)[..., None], 2),
                                      np.take_along_axis(b, order(lc)[..., None], 2))
    if prompt_len > cfg.budget:  # the band is narrower than the causal mask: it must differ from dense
        dense, _ = baselines.prefill(cfg, q, k, v, positions)
        assert np.abs(np.asarray(dense) - np.asarray(got)).max() > 1e-3
    with pytest.raises(ValueError, match="banded_prefill is StreamingLLM's"):
        BaselineConfig("h2o", 6, banded_prefill=True)


@pytest.mark.parametrize("method", ["streaming", "tova", "h2o"])
def test_explicit_positions_do_not_change_the_eviction(rng, method):
    """Positions only say where q and k are rotated; the policy counts tokens (as `decode` does with the
    cache's length). With positions offset by 7 the prefill kept positions >= 7: StreamingLLM lost its sink
    and every decoded token, indexed below the prompt's, was evicted at once."""
    config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
    params = init_params(config, jax.random.key(0))
    model = Qwen3ForCausalLM(config)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 14)))
    cfg = BaselineConfig(method, 5, sinks=1 if method != "tova" else 0)
    step = jax.jit(lambda c, t, p: model.apply({"params": params}, t, positions=p, cache=c))
    runs = []
    for offset in (0, 7):
        at = lambda a, b: jnp.broadcast_to(offset + jnp.arange(a, b), (2, b - a))  # noqa: E731
        out = step(baselines.init_cache(config, cfg, 2), ids[:, :8], at(0, 8))
        logits, cache = [out.logits], out.cache
        for t in range(8, 14):
            out = step(cache, ids[:, t:t + 1], at(t, t + 1))
            logits.append(out.logits)
            cache = out.cache
        runs.append((np.asarray(jnp.concatenate(logits, 1)), np.asarray(cache.layers[0].pos)))
    np.testing.assert_array_equal(np.sort(runs[1][1], -1), np.sort(runs[0][1], -1))
    assert (runs[0][1] >= 8).any()  # decoded tokens entered the cache
    np.testing.assert_allclose(runs[1][0], runs[0][0], atol=2e-4)  # RoPE is relative: the same logits


def test_row_lengths_with_a_decoding_cache_is_refused(rng):
    """row_lengths (ragged rows) was ignored by every cache: the padding of a short row was cached and
    attended, silently. Refused, as segment_ids are."""
    from kvpop_jax import dms_cache
    from kvpop_jax.cache import init_dense_cache
    from kvpop_jax.config import DMSConfig
    from kvpop_jax.modeling import retrofit_params

    config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
    params = init_params(config, jax.random.key(0))
    dms_config = dataclasses.replace(config, dms=DMSConfig(window=2, budget=4, gate_hidden=8))
    dms_params = retrofit_params(dms_config, params, jax.random.key(1))
    ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 6)))
    for cfg, p, cache in ((config, params, baselines.init_cache(config, BaselineConfig("h2o", 4), 2)),
                          (config, params, init_dense_cache(config, 2, 8)),
                          (dms_config, dms_params, dms_cache.init_cache(dms_config, 2))):
        with pytest.raises(ValueError, match="row_lengths is not supported together with a decoding cache"):
            Qwen3ForCausalLM(cfg).apply({"params": p}, ids, cache=cache, row_lengths=jnp.array([4, 6]))


def test_a_cache_made_for_another_model_is_named():
    """A cache with another layer count raised a bare IndexError (bounded caches) or a reshape TypeError
    (dense) from inside the layers."""
    from kvpop_jax.cache import init_dense_cache

    config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
    small = dataclasses.replace(config, num_hidden_layers=1)
    params = init_params(config, jax.random.key(0))
    ids = jnp.zeros((2, 5), jnp.int32)
    for cache in (baselines.init_cache(small, BaselineConfig("tova", 4), 2), init_dense_cache(small, 2, 8)):
        with pytest.raises(ValueError, match="the cache has 1 layers but the model has 2"):
            Qwen3ForCausalLM(config).apply({"params": params}, ids, cache=cache)
    # Another KV head count or head size: jax's own shape errors, or (4 KV heads, dense prefill) a silent run.
    for other in (dataclasses.replace(config, num_key_value_heads=4), dataclasses.replace(config, head_dim=8)):
        for cache in (baselines.init_cache(other, BaselineConfig("tova", 4), 2), init_dense_cache(other, 2, 8)):
            with pytest.raises(ValueError, match=rf"the cache's keys are \(2, {other.num_key_value_heads}, \d+, "
                                                 rf"{other.head_dim}\) but the model has 2 KV heads of head_dim 16"):
                Qwen3ForCausalLM(config).apply({"params": params}, ids, cache=cache)


def test_decode_refuses_what_it_would_silently_misread(rng):
    """baselines.decode (the public function) cut a two-token step to its first token and ran another
    config's policy on a cache (the cache then still named its own); both returned a result."""
    cfg = BaselineConfig("h2o", 4)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    _, lc = baselines.prefill(cfg, f(2, 6, 4, 8), f(2, 6, 2, 8), f(2, 6, 2, 8), jnp.broadcast_to(jnp.arange(6), (2, 6)))
    with pytest.raises(ValueError, match="decodes one token per call .* got 2 tokens"):
        baselines.decode(cfg, lc, f(2, 2, 4, 8), f(2, 2, 2, 8), f(2, 2, 2, 8), 6)
    for other in (BaselineConfig("h2o", 8), BaselineConfig("streaming", 4), BaselineConfig("h2o", 4, recent=1)):
        with pytest.raises(ValueError, match="for a cache made with .*pass the cache's own config"):
            baselines.decode(other, lc, f(2, 1, 4, 8), f(2, 1, 2, 8), f(2, 1, 2, 8), 6)
    with pytest.raises(ValueError, match="k_tok and v_tok must be \\[B, 1, Hkv, D\\]"):
        baselines.decode(cfg, lc, f(2, 1, 6, 8), f(2, 1, 3, 8), f(2, 1, 3, 8), 6)
    streaming = BaselineConfig("streaming", 4, sinks=1)  # banded_prefill shapes the prefill only
    _, banded = baselines.prefill(dataclasses.replace(streaming, banded_prefill=True), f(2, 6, 4, 8), f(2, 6, 2, 8),
                                  f(2, 6, 2, 8), jnp.broadcast_to(jnp.arange(6), (2, 6)))
    assert baselines.decode(streaming, banded, f(2, 1, 4, 8), f(2, 1, 2, 8), f(2, 1, 2, 8), 6)[1].pos.shape == (2, 2, 4)


def test_generate_refuses_a_non_bool_stream_prompt():
    """stream_prompt="no" (truthy) streamed the prompt, silently."""
    from kvpop_jax.generate import compile_generate, generate

    config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
    model, params = Qwen3ForCausalLM(config), init_params(config, jax.random.key(0))
    for flag in ("no", 1, None):
        with pytest.raises(ValueError, match="stream_prompt must be True or False"):
            generate(model, params, jnp.zeros((1, 4), jnp.int32), max_new_tokens=2, cache=BaselineConfig("h2o", 4),
                     stream_prompt=flag)
        with pytest.raises(ValueError, match="stream_prompt must be True or False"):
            compile_generate(model, params, 1, 4, max_new_tokens=2, cache=BaselineConfig("h2o", 4), stream_prompt=flag)
