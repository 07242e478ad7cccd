"""Sampling filters against numpy, and the jitted decode loop against the full forward."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_HF_CONFIGS, logged_compiles
from kvpop_jax import KVpopConfig, Qwen3Config
from kvpop_jax.generate import generate
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params, retrofit_params
from kvpop_jax.sampling import SamplingConfig, filter_min_p, filter_top_k, filter_top_p, sample


def test_filters_match_numpy(rng):
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    kept_k = np.asarray(filter_top_k(jnp.asarray(logits), 7)) > -1e29
    assert (kept_k.sum(-1) == 7).all()
    for row, keep in zip(logits, kept_k):
        assert set(np.flatnonzero(keep)) == set(np.argsort(-row)[:7])
    kept_p = np.asarray(filter_top_p(jnp.asarray(logits), 0.8)) > -1e29
    for row, keep in zip(logits, kept_p):
        probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        order = np.argsort(-probs)
        n = int(np.searchsorted(np.cumsum(probs[order]), 0.8) + 1)
        assert set(np.flatnonzero(keep)) == set(order[:n])
    kept_m = np.asarray(filter_min_p(jnp.asarray(logits), 0.1)) > -1e29
    for row, keep in zip(logits, kept_m):
        probs = np.exp(row - row.max())
        assert set(np.flatnonzero(keep)) == set(np.flatnonzero(probs >= 0.1 * probs.max() * (1 - 1e-6)))


def test_top_p_keeps_the_smallest_set_that_reaches_p_at_an_exact_boundary(rng):
    """Rows of 2^j equal logits give exact probabilities 2^-j, so the mass of the first m sorted tokens is exactly
    m 2^-j: with p = m 2^-j, m tokens reach p and the (m+1)-th is not needed. Random logits never land on the
    boundary, where `mass_before <= p` kept one token more."""
    for _ in range(20):
        j = int(rng.integers(1, 6))
        width = 2 ** j
        m = int(rng.integers(1, width))
        logits = np.full((3, width), float(rng.normal()), np.float32)
        kept = np.asarray(filter_top_p(jnp.asarray(logits), m / width)) > -1e29
        np.testing.assert_array_equal(kept.sum(-1), m)


def test_sample_respects_filters_and_greedy(rng):
    logits = jnp.asarray(rng.normal(size=(4, 30)).astype(np.float32))
    assert (sample(jax.random.key(0), logits, SamplingConfig.greedy()) == jnp.argmax(logits, -1)).all()
    allowed = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    for seed in range(20):
        tok = np.asarray(sample(jax.random.key(seed), logits, SamplingConfig(1.0, 1.0, 3, 0.0)))
        assert all(t in a for t, a in zip(tok, allowed))
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingConfig(top_p=0.0)


def greedy_reference(model, params, prompt, n):
    """Greedy continuation by the full (masked, for KVpop) parallel forward, one token at a time.

    Causal attention (and the KVpop mask) make the logits at t independent of later tokens,
    so one jitted forward over a fixed [B, P + n] buffer serves every step.
    """
    b, p = prompt.shape
    forward = jax.jit(lambda ids: model.apply({"params": params}, ids).logits)
    seq = np.zeros((b, p + n), np.int32)
    seq[:, :p] = np.asarray(prompt)
    for t in range(p, p + n):
        seq[:, t] = np.argmax(np.asarray(forward(jnp.asarray(seq)))[:, t - 1], -1)
    return seq[:, p:]


def test_greedy_generate_matches_full_forward(rng):
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(1))
    model = Qwen3ForCausalLM(config)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 5)))
    tokens, lengths = generate(model, params, prompt, max_new_tokens=6, sampling=SamplingConfig.greedy())
    np.testing.assert_array_equal(np.asarray(tokens), greedy_reference(model, params, prompt, 6))
    assert (np.asarray(lengths) == 6).all()
    # EOS stops a row: use the first generated token of row 0 as EOS.
    eos = int(tokens[0, 0])
    _, lengths = generate(model, params, prompt, max_new_tokens=6, sampling=SamplingConfig.greedy(), eos_ids=(eos,))
    assert int(lengths[0]) == 1


def test_a_first_token_eos_stops_its_row_with_zeros_after_it(rng):
    """An EOS drawn as the very first token ends its row there: zeros after it, length 1, and the other rows as
    they decode without it (until they draw it). The old check read only the length, so a row that went on
    sampling after a first-token EOS (tokens the caller keeps) passed."""
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    model = Qwen3ForCausalLM(config)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, size=(3, 5)))
    free, _ = generate(model, params, prompt, max_new_tokens=6, sampling=SamplingConfig.greedy())
    free = np.asarray(free)
    eos = int(free[0, 0])
    tokens, lengths = generate(model, params, prompt, max_new_tokens=6, sampling=SamplingConfig.greedy(), eos_ids=eos)
    want, want_len = free.copy(), np.full(3, 6)
    for row in range(3):  # the reference: the free run cut after each row's first EOS
        stop = np.flatnonzero(free[row] == eos)
        if stop.size:
            want[row, stop[0] + 1:], want_len[row] = 0, stop[0] + 1
    assert want_len[0] == 1 and free[0, 1:].any()  # the cut changes row 0: the comparison can fail
    np.testing.assert_array_equal(np.asarray(tokens), want)
    np.testing.assert_array_equal(np.asarray(lengths), want_len)


def _dms_model_with_random_gates(rng, budget):
    """A tiny DMS model (window 2, `budget` entries per KV head) whose random gates with offset 0 evict about
    half the tokens: (model, params, config)."""
    from kvpop_jax.config import DMSConfig

    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    config = dataclasses.replace(base, dms=DMSConfig(window=2, budget=budget, gate_hidden=8, logit_offset=0.0))
    params = retrofit_params(config, init_params(base, jax.random.key(1)), jax.random.key(2))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), x.dtype) if "dms" in jax.tree_util.keystr(path)
        else x, params)
    return Qwen3ForCausalLM(config), params, config


@pytest.mark.long  # a DMS chat past its pool: ~13 s on 2 cores
def test_a_dms_conversation_warns_once_when_its_pool_first_overflows(rng):
    """Past an overflow a DMS reply may differ from generate on the whole history (its prefill and decode drop
    differently): said once, when it first happens; a pool that never overflows says nothing."""
    import warnings

    from kvpop_jax.generate import Conversation

    turns = [rng.integers(0, 61, size=10).tolist(), rng.integers(0, 61, size=6).tolist(), [3]]
    for budget, overflows in ((32, False), (8, True)):
        model, params, _ = _dms_model_with_random_gates(rng, budget)
        chat = Conversation(model, params)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for turn in turns:
                chat.send(turn, max_new_tokens=6, sampling=SamplingConfig.greedy())
        said = [str(w.message) for w in caught if "DMS pool overflowed" in str(w.message)]
        dropped = sum(int(layer.overflow.sum()) for layer in chat.cache.layers)
        assert (dropped > 0) == overflows and len(said) == int(overflows), (budget, dropped, said)
        if overflows:
            assert "entries dropped over the layers" in said[0] and "a larger DMSConfig.budget" in said[0]


def _kvpop_model_with_random_scorers(rng, **kvpop):
    """A tiny KVpop model whose scorer weights are random (they start at zero = pure recency), so
    eviction is by learned score: (model, params, config)."""
    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    config = dataclasses.replace(base, kvpop=KVpopConfig(**kvpop))
    params = retrofit_params(config, init_params(base, jax.random.key(1)), jax.random.key(2))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), x.dtype)
        if "kvpop" in jax.tree_util.keystr(path) else x, params)
    return Qwen3ForCausalLM(config), params, config


def test_greedy_generate_with_kvpop_cache_matches_masked_forward(rng):
    """Greedy decoding with the bounded cache == argmax of the masked parallel forward, step by step."""
    model, params, config = _kvpop_model_with_random_scorers(rng, sinks=1, window=3, topk=4, scorer="mlp")
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 10)))  # longer than B = 8
    tokens, _ = generate(model, params, prompt, max_new_tokens=8, sampling=SamplingConfig.greedy())
    np.testing.assert_array_equal(np.asarray(tokens), greedy_reference(model, params, prompt, 8))
    # The prompt read token by token past s + w (stream_prompt) evicts exactly as the masked prefill.
    streamed, _ = generate(model, params, prompt, max_new_tokens=8, sampling=SamplingConfig.greedy(),
                           stream_prompt=True)
    np.testing.assert_array_equal(np.asarray(streamed), np.asarray(tokens))
    with pytest.raises(ValueError, match="decodes with its bounded cache"):
        generate(model, params, prompt, max_new_tokens=2, cache="dense")


def test_streaming_with_large_budget_equals_dense(rng):
    from kvpop_jax.baselines import BaselineConfig

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(1))
    model = Qwen3ForCausalLM(config)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 5)))
    dense, _ = generate(model, params, prompt, max_new_tokens=6, sampling=SamplingConfig.greedy(), cache="dense")
    stream, _ = generate(model, params, prompt, max_new_tokens=6, sampling=SamplingConfig.greedy(),
                         cache=BaselineConfig("streaming", 11, sinks=2))
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(dense))
    with pytest.raises(ValueError, match="cache must be one of"):
        generate(model, params, prompt, max_new_tokens=2, cache="paged")


def test_ragged_rows_come_back_in_the_callers_order_each_length_under_its_own_key(rng):
    """The default suite's check of ragged rows (the full one is `long`): interleaved lengths, sampled, come back
    in the caller's order, each length's batch under the key folded with its first row. Rows of lengths in order
    of first appearance (the only ragged case outside `long`) let a missing reorder pass, and greedy rows a key
    shared by every length."""
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    model = Qwen3ForCausalLM(config)
    rows = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (6, 3, 6)]
    sampling, key = SamplingConfig(temperature=1.0), jax.random.key(int(rng.integers(1 << 30)))
    drawn, _ = generate(model, params, rows, max_new_tokens=8, sampling=sampling, rng=key, cache="dense")
    for group in ([0, 2], [1]):
        batch, _ = generate(model, params, [rows[i] for i in group], max_new_tokens=8, sampling=sampling,
                            rng=jax.random.fold_in(key, group[0]), cache="dense")
        np.testing.assert_array_equal(np.asarray(drawn[np.asarray(group)]), np.asarray(batch))
    shared, _ = generate(model, params, [rows[1]], max_new_tokens=8, sampling=sampling, rng=key, cache="dense")
    assert not np.array_equal(np.asarray(drawn[1]), np.asarray(shared[0]))  # the fold changes the draws


@pytest.mark.long  # ~18 s; test_generate_compiles_once_per_power_of_two_of_the_prompt_length[kvpop] decodes ragged rows
def test_ragged_prompts_decode_each_row_as_it_would_alone(rng):
    """A list of rows of unequal lengths (past the KVpop budget, and under it) runs one batch per length: each
    row's tokens are those of the row alone (greedy), and a sampled row those of its length's batch under the key
    folded with that batch's first row, in the caller's order."""
    model, params, config = _kvpop_model_with_random_scorers(rng, sinks=1, window=3, topk=4, scorer="mlp")
    rows = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (12, 5, 12, 9, 5)]
    tokens, lengths = generate(model, params, rows, max_new_tokens=6, sampling=SamplingConfig.greedy())
    assert tokens.shape == (5, 6) and lengths.shape == (5,)
    for i, row in enumerate(rows):
        alone, alone_len = generate(model, params, [row], max_new_tokens=6, sampling=SamplingConfig.greedy())
        np.testing.assert_array_equal(np.asarray(tokens[i]), np.asarray(alone[0]))
        assert int(lengths[i]) == int(alone_len[0])
    # EOS per row: the first generated token of row 3 stops it at length 1, the others as they stop alone
    eos = int(tokens[3, 0])
    _, lengths = generate(model, params, rows, max_new_tokens=6, sampling=SamplingConfig.greedy(), eos_ids=eos)
    assert int(lengths[3]) == 1
    sampling = SamplingConfig(temperature=1.0)
    key = jax.random.key(7)
    drawn, _ = generate(model, params, rows, max_new_tokens=6, sampling=sampling, rng=key)
    for group in ([0, 2], [1, 4], [3]):
        batch, _ = generate(model, params, [rows[i] for i in group], max_new_tokens=6, sampling=sampling,
                            rng=jax.random.fold_in(key, group[0]))
        np.testing.assert_array_equal(np.asarray(drawn[np.asarray(group)]), np.asarray(batch))
    with pytest.raises(ValueError, match=r"prompt_ids row 1 is int, expected a sequence of token ids"):
        generate(model, params, [[1, 2], 3], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_ids holds"):  # an id outside the vocabulary, in any group
        generate(model, params, [[1, 2], [3, config.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_ids row 2 is empty; every row needs at least one token id"):
        generate(model, params, [[1, 2], [3], []], max_new_tokens=2)  # was "got shape (1, 0)"


@pytest.mark.parametrize("kind", ["kvpop", *(pytest.param(k, marks=pytest.mark.long)
                                              for k in ("tova", "dms", "dense"))])  # ~10-25 s each
def test_conversation_replies_equal_generate_on_the_whole_history(rng, kind):
    """Each turn read into the kept cache (the previous reply's last token first) gives the reply `generate`
    gives the whole history as one prompt; a bounded cache keeps its size across turns."""
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import Conversation

    if kind == "kvpop":
        model, params, config = _kvpop_model_with_random_scorers(rng, sinks=1, window=3, topk=4, scorer="mlp")
        spec, options = "auto", {}
    elif kind == "dms":  # a pool that never overflows (DMS exact)
        model, params, config = _dms_model_with_random_gates(rng, budget=32)
        spec, options = "auto", {}
    else:
        config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
        model, params = Qwen3ForCausalLM(config), init_params(config, jax.random.key(1))
        spec = "dense" if kind == "dense" else BaselineConfig("tova", 8, sinks=1)
        options = {"max_len": 40} if kind == "dense" else {"stream_prompt": True}
    greedy = SamplingConfig.greedy()
    chat = Conversation(model, params, cache=spec, **options)
    history = rng.integers(0, config.vocab_size, size=10).tolist()  # past the budget of 8
    turns = [(history, 4, ()), (rng.integers(0, config.vocab_size, size=3).tolist(), 5, ()), ([], 3, ())]
    sizes = []
    for i, (turn, new, eos) in enumerate(turns):
        prompt = history if i == 0 else history + turn
        if i == 1:  # stop this reply at its own second token
            probe, _ = generate(model, params, [prompt], max_new_tokens=new, sampling=greedy, cache=spec,
                                stream_prompt=kind == "tova")
            eos = int(probe[0, 1])
        expected, expected_n = generate(model, params, [prompt], max_new_tokens=new, sampling=greedy, cache=spec,
                                        stream_prompt=kind == "tova", eos_ids=eos)
        reply, n = chat.send(turn, max_new_tokens=new, sampling=greedy, eos_ids=eos)
        np.testing.assert_array_equal(np.asarray(reply), np.asarray(expected[0]), err_msg=f"turn {i}")
        assert n == int(expected_n[0]) and (n <= 2 if i == 1 else n == new)  # turn 1 stops at its EOS
        history = prompt + np.asarray(reply[:n]).tolist()
        assert chat.length == len(history)
        sizes.append(chat.cache.nbytes)
    if kind != "dense":
        assert len(set(sizes)) == 1
        # max_len caps a bounded conversation too (it was ignored silently): 10 ids and 3 new make 12 read
        capped = Conversation(model, params, cache=spec, max_len=12, **options)
        with pytest.raises(ValueError, match=r"to 13 tokens read, past the Conversation's max_len 12"):
            capped.send(history[:10], max_new_tokens=4, sampling=greedy)
        assert capped.length == 0
        capped.send(history[:10], max_new_tokens=3, sampling=greedy)
        with pytest.raises(ValueError, match=r"to 14 tokens read, past the Conversation's max_len 12"):
            capped.send([1], max_new_tokens=1)
    with pytest.raises(ValueError, match="a turn's ids must be one row"):
        chat.send(np.zeros((2, 3), np.int32), max_new_tokens=1)
    with pytest.raises(ValueError, match="must be integer token ids"):
        chat.send([1.5], max_new_tokens=1)
    with pytest.raises(ValueError, match="a turn's ids must be one row .*got rows of unequal lengths"):
        chat.send([[1, 2], [3]], max_new_tokens=1)  # was numpy's "inhomogeneous shape after 1 dimensions"
    if kind == "dense":
        with pytest.raises(ValueError, match=r"to 41 tokens read, past the dense cache's max_len 40"):
            chat.send([1] * (40 - len(history) + 1), max_new_tokens=1)
        _, n = chat.send([1] * (40 - len(history)), max_new_tokens=1)  # 40 read: full; the reply is drawn, not read
        assert n == 1 and chat.length == 41 and np.isfinite(np.asarray(chat.cache.layers[0].k)).all()
        with pytest.raises(ValueError, match="needs max_len"):
            Conversation(model, params, cache="dense")
        with pytest.raises(ValueError, match="the first turn of a Conversation needs at least one token id"):
            Conversation(model, params, cache="dense", max_len=8).send([], max_new_tokens=1)


@pytest.mark.long  # ~12 s of streamed-read compiles
def test_a_streamed_first_turn_compiles_once_per_power_of_two_of_its_streamed_ids(rng, compiles):
    """A Conversation's first turn with stream_prompt=True compiled a program per length: it now prefills the first B
    ids and reads the rest a decode step each, padded to a power of two as generate does (`_generate_fed`): turns of
    13 and 15 ids at B 8 (5 and 7 streamed, 8 padded) share one program and reply as generate."""
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import Conversation

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    model, params = Qwen3ForCausalLM(config), init_params(config, jax.random.key(1))
    cache, greedy = BaselineConfig("tova", 8, sinks=1), SamplingConfig.greedy()
    jax.clear_caches()
    before = len(compiles)
    for n in (13, 15):
        prompt = rng.integers(0, config.vocab_size, size=n).tolist()
        reply, k = Conversation(model, params, cache=cache, stream_prompt=True).send(prompt, max_new_tokens=4,
                                                                                    sampling=greedy)
        expected, expected_k = generate(model, params, [prompt], max_new_tokens=4, sampling=greedy, cache=cache,
                                        stream_prompt=True)
        np.testing.assert_array_equal(np.asarray(reply), np.asarray(expected[0]), err_msg=f"{n} ids")
        assert k == int(expected_k[0])
    assert [f for _, f in compiles[before:]].count("jit(_turn)") == 1, compiles[before:]


@pytest.mark.parametrize("step", ["_reply", "_turn"])
def test_an_interrupted_send_leaves_the_conversation_as_it_was(rng, monkeypatch, step):
    """A send that fails after the turn was read (Ctrl-C while the reply decodes, an OOM) left the cache holding the
    turn but the length and pending token as before: a retry read the turn twice (a dense cache past its max_len,
    silently) and replied to another conversation. Now the turn is committed whole or not at all: the retry
    replies as an uninterrupted conversation does. `_reply` serves KVpop and dense turns, `_turn` a baseline's."""
    import kvpop_jax.generate as gen
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import Conversation

    if step == "_reply":
        model, params, config = _kvpop_model_with_random_scorers(rng, sinks=1, window=3, topk=4, scorer="mlp")
        spec, options = "auto", {}
    else:
        config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
        model, params = Qwen3ForCausalLM(config), init_params(config, jax.random.key(1))
        spec, options = BaselineConfig("tova", 8, sinks=1), {"stream_prompt": True}
    greedy = SamplingConfig.greedy()
    first, second = (rng.integers(0, config.vocab_size, size=n).tolist() for n in (12, 5))
    reference, chat = (Conversation(model, params, cache=spec, **options) for _ in range(2))
    for c in (reference, chat):
        c.send(first, max_new_tokens=3, sampling=greedy)
    expected, expected_n = reference.send(second, max_new_tokens=4, sampling=greedy)
    before = (chat.length, list(chat._pending), chat._turns, jax.tree.leaves(chat.cache))
    real = getattr(gen, step)

    class Interrupted:  # Ctrl-C lands where the host waits for the asynchronous reply: at its length's read
        def __getitem__(self, index):
            raise KeyboardInterrupt

    def interrupted(*args, **kwargs):
        tokens, _, cache = real(*args, **kwargs)
        return tokens, Interrupted(), cache

    monkeypatch.setattr(gen, step, interrupted)
    with pytest.raises(KeyboardInterrupt):
        chat.send(second, max_new_tokens=4, sampling=greedy)
    monkeypatch.setattr(gen, step, real)
    assert (chat.length, chat._pending, chat._turns) == before[:3]
    for a, b in zip(jax.tree.leaves(chat.cache), before[3], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reply, n = chat.send(second, max_new_tokens=4, sampling=greedy)
    np.testing.assert_array_equal(np.asarray(reply), np.asarray(expected))
    assert n == expected_n and chat.length == reference.length


def test_every_cache_refuses_an_integer_dtype_and_a_bad_batch_by_name(rng):
    """init_cache / init_dense_cache (and the baselines' and DMS's) took an integer dtype and decoded other tokens
    silently (Conversation alone refused it); init_cache took batch 0, and -1 or 2.0 failed in jax's broadcast.
    generate with no rows failed as a ZeroDivisionError in the mLSTM scorer."""
    from kvpop_jax import cache as cache_lib
    from kvpop_jax import dms_cache
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.baselines import init_cache as baseline_cache

    model, params, config = _kvpop_model_with_random_scorers(rng, sinks=1, window=3, topk=4, scorer="mlstm")
    dms_model, _, dms_config = _dms_model_with_random_gates(rng, budget=32)
    makers = {"init_cache": lambda **kw: cache_lib.init_cache(config, **kw),
              "init_dense_cache": lambda **kw: cache_lib.init_dense_cache(config, max_len=8, **kw),
              "the tova cache": lambda **kw: baseline_cache(config, BaselineConfig("tova", 8, sinks=1), **kw),
              "the DMS cache": lambda **kw: dms_cache.init_cache(dms_config, **kw)}
    for where, make in makers.items():
        for dtype in (jnp.int8, "int32", bool):
            with pytest.raises(ValueError, match=rf"{where}: dtype must be a floating dtype.*got"):
                make(batch=1, dtype=dtype)
        for batch in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match=rf"{where}: batch={batch!r}; expected a positive integer"):
                make(batch=batch)
        assert jax.tree.leaves(make(batch=2, dtype=jnp.bfloat16))[0].shape[0] == 2
    with pytest.raises(ValueError, match=r"prompt_ids must be \[batch >= 1, prompt_len >= 1\], got shape \(0, 4\)"):
        generate(model, params, np.zeros((0, 4), np.int32), max_new_tokens=2)


def test_a_conversation_cache_dtype_must_be_floating(rng):
    """An integer cache dtype rounded every key and value, and the replies were silently other tokens."""
    from kvpop_jax.generate import Conversation

    model, params, config = _kvpop_model_with_random_scorers(rng, sinks=1, window=3, topk=4, scorer="mlp")
    for dtype in (jnp.int32, "int8", bool, "not a dtype"):
        with pytest.raises(ValueError, match=r"dtype must be a floating dtype for the cache's keys and values.*got"):
            Conversation(model, params, dtype=dtype)
    chat = Conversation(model, params, dtype="bfloat16")
    assert chat.cache.layers[0].k.dtype == jnp.bfloat16


@pytest.mark.parametrize("kind", ["kvpop", pytest.param("dms", marks=pytest.mark.long)])  # dms ~35 s
def test_a_conversation_compiles_once_per_block_size_or_bucket_not_per_turn_length(rng, compiles, kind):
    """Later turns of 4, 5, 6 and 7 ids (5 to 8 read, the last reply's token first): a KVpop cache reads them in
    blocks of 1 token (5, 6, 7 of them) and one of 8 (one compile per block size, each block one call), DMS one
    decode step per token in the bucket of 8 (one compile, the padding never read); turns of those lengths again
    compile nothing. Each reply is still `generate`'s on the whole history."""
    from kvpop_jax.generate import Conversation

    if kind == "kvpop":
        model, params, config = _kvpop_model_with_random_scorers(rng, sinks=1, window=3, topk=4, scorer="mlp")
    else:  # a pool that never overflows here (DMS exact)
        model, params, config = _dms_model_with_random_gates(rng, budget=64)
    greedy = SamplingConfig.greedy()
    jax.clear_caches()  # an earlier test of this process may have compiled a block size of this model already
    before = len(compiles)
    chat = Conversation(model, params)
    chat.send(rng.integers(0, config.vocab_size, size=9).tolist(), max_new_tokens=3, sampling=greedy)
    for n in (4, 5, 6, 7):
        chat.send(rng.integers(0, config.vocab_size, size=n).tolist(), max_new_tokens=3, sampling=greedy)
    names = [f for _, f in compiles[before:]]
    if kind == "kvpop":  # the first turn: a prefill of 8, then a block of 1; later turns blocks of 1 and of 8
        assert names.count("jit(_read)") == 3 and names.count("jit(_reply)") == 1
        assert names.count("jit(_turn)") == 0
    else:
        assert names.count("jit(_turn)") == 2  # the first turn's prefill, then bucket 8 (was 5)
    before = len(compiles)
    for n in (7, 4, 6, 5):
        chat.send(rng.integers(0, config.vocab_size, size=n).tolist(), max_new_tokens=3, sampling=greedy)
    assert [f for _, f in compiles[before:] if f in ("jit(_read)", "jit(_reply)", "jit(_turn)")] == []
    history, chat = rng.integers(0, config.vocab_size, size=9).tolist(), Conversation(model, params)
    reply, k = chat.send(history, max_new_tokens=3, sampling=greedy)
    history += np.asarray(reply[:k]).tolist()
    for n in (2, 5, 12):  # 3, 6 and 13 read: blocks 3 x 1, 6 x 1 and 8 + 5 x 1 (buckets 4, 8 and 16)
        turn = rng.integers(0, config.vocab_size, size=n).tolist()
        history += turn
        reply, k = chat.send(turn, max_new_tokens=3, sampling=greedy)
        expected, _ = generate(model, params, [history], max_new_tokens=3, sampling=greedy)
        np.testing.assert_array_equal(np.asarray(reply), np.asarray(expected[0]))
        history += np.asarray(reply[:k]).tolist()


@pytest.mark.long  # ~17-28 s each; test_conversation_replies_equal_generate_on_the_whole_history[kvpop]'s first turns
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_first_turns_compile_once_per_power_of_two_and_reply_as_generate(rng, compiles, scorer):
    """A first turn on a KVpop or dense cache is a prefill of the largest power of two of its ids, then blocks:
    first turns of 33 to 63 ids (past the budget) compile one prefill of 32 and the blocks of 8 and 1 (was one
    prefill per length), and the replies to 33 and 63 ids equal `generate`'s on the same prompt, for both scorers
    and a dense cache."""
    from kvpop_jax.generate import Conversation

    model, params, config = _kvpop_model_with_random_scorers(rng, sinks=2, window=5, topk=6, scorer=scorer)
    dense_config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    dense, dense_params = Qwen3ForCausalLM(dense_config), init_params(dense_config, jax.random.key(1))
    greedy = SamplingConfig.greedy()
    jax.clear_caches()
    before = len(compiles)
    replies = {}
    for n in (33, 47, 63, 40):
        prompt = rng.integers(0, config.vocab_size, size=n).tolist()
        for m, p, options in ((model, params, {}), (dense, dense_params, {"max_len": 80})):
            replies[n, m is dense] = prompt, Conversation(m, p, **options).send(prompt, max_new_tokens=4,
                                                                                sampling=greedy)
    names = [f for _, f in compiles[before:]]
    # generate compiles once per length: two lengths (blocks of 8 and 1, and of 1 only) stand for the four
    for (n, is_dense), (prompt, (reply, k)) in replies.items():
        if n in (63, 33):
            m, p = (dense, dense_params) if is_dense else (model, params)
            expected, expected_k = generate(m, p, [prompt], max_new_tokens=4, sampling=greedy)
            np.testing.assert_array_equal(np.asarray(reply), np.asarray(expected[0]),
                                          err_msg=f"{n} ids, {m.config.kvpop}")
            assert k == int(expected_k[0]) == 4
    # per model: the prefill of 32, blocks of 8 and of 1 (the 63-id turn: 32 + 8 x 3 + 1 x 7), one reply
    assert names.count("jit(_read)") == 2 * 3 and names.count("jit(_reply)") == 2 and "jit(_turn)" not in names


# ~25-40 s each: both long; test_compile_ahead_compiles_each_next_setting_in_the_background (eval) runs generate's and
# compile_generate's block reads of dense and KVpop by default
@pytest.mark.long
@pytest.mark.parametrize("kind", ["kvpop", "dense"])
def test_generate_compiles_once_per_power_of_two_of_the_prompt_length(rng, compiles, kind):
    """generate on a KVpop or dense cache reads a prompt whose length is not a power of two as Conversation's first
    turn: a prefill of the largest power of two, then blocks. Prompts of 33, 47 and 59 ids (and a ragged list of
    them) run on one prefill of 32, the blocks of 8 and 1 and one reply (was a program per length), which
    compile_generate compiles ahead in a worker thread; the tokens equal the one-program path's (`_generate`, kept
    for powers of two), greedy and sampled."""
    import threading

    from kvpop_jax.generate import _generate, compile_generate

    if kind == "kvpop":
        m, p, config = _kvpop_model_with_random_scorers(rng, sinks=2, window=5, topk=6, scorer="mlstm")
    else:
        config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
        m, p = Qwen3ForCausalLM(config), init_params(config, jax.random.key(1))
    no_eos, greedy_33 = jnp.asarray([-1], jnp.int32), None
    jax.clear_caches()
    before = len(compiles)
    prompts = {n: rng.integers(0, config.vocab_size, size=(2, n)) for n in (47, 33, 59)}
    for sampling in (SamplingConfig.greedy(), SamplingConfig(temperature=1.0, top_p=1.0, top_k=0)):
        worker = threading.Thread(target=compile_generate, args=(m, p, 2, 47), name="ahead",
                                  kwargs=dict(max_new_tokens=4, sampling=sampling))
        worker.start()
        worker.join()
        for n, prompt in prompts.items():
            tokens, lengths = generate(m, p, prompt, max_new_tokens=4, sampling=sampling, rng=jax.random.key(n))
            np.testing.assert_array_equal(np.asarray(lengths), 4)
            if (n == 47) == (sampling.temperature == 0):  # greedy: blocks of 1, of 8 and 1; sampled: 8 and 1
                continue
            want = _generate(m, p, jnp.asarray(prompt), jax.random.key(n), no_eos, max_new_tokens=4,
                             sampling=sampling, cache=kind)  # a compile per length
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want[0]), err_msg=f"{kind}, {n} ids")
            greedy_33 = tokens if n == 33 else greedy_33
    seen = compiles[before:]
    # 47 ids: the prefill of 32, a block of 8, blocks of 1; 33 and 59 (64 dense slots too) add nothing
    ahead = [f for t, f in seen if t == "ahead"]
    assert ahead.count("jit(_read)") == 1 and ahead.count("jit(_read_owned)") == 2, seen  # blocks: in place
    assert ahead.count("jit(_reply)") == 2, seen  # one per sampling
    assert not [f for t, f in seen if t != "ahead" and f in ("jit(_read)", "jit(_read_owned)", "jit(_reply)")]
    ragged, _ = generate(m, p, [prompts[33][0].tolist(), prompts[59][1].tolist()], max_new_tokens=4,
                         sampling=SamplingConfig.greedy())  # rows of one each: batch 1's programs
    np.testing.assert_array_equal(np.asarray(ragged[0]), np.asarray(greedy_33[0]))
    np.testing.assert_array_equal(np.asarray(ragged[1]), np.asarray(_generate(
        m, p, jnp.asarray(prompts[59][1:]), jax.random.key(0), no_eos, max_new_tokens=4,
        sampling=SamplingConfig.greedy(), cache=kind)[0][0]))


@pytest.mark.long  # ~70 s of compiles; test_stream_prompt_evicts_token_by_token's 17 ids at B 6 run the new path
def test_a_streamed_prompt_compiles_once_per_power_of_two_of_its_streamed_tokens(rng, compiles):
    """generate(stream_prompt=True) compiled a program per prompt length: a user's own benchmark, of many lengths,
    compiled TOVA, H2O, StreamingLLM (and a streamed KVpop or DMS cache) once per length and method. A length not a
    power of two now prefills the first B tokens (StreamingLLM: its banded read of the largest power of two) and
    reads the rest a decode step each, padded to the next power of two (the padding skipped): prompts of 17 and 21
    ids at B 6 (11 and 15 streamed, 16 padded; StreamingLLM: 21 and 23, 16 banded and 5 or 7 streamed, 8 padded)
    run on one program, which compile_generate compiles ahead; the tokens equal the per-length program's
    (`_generate`, kept for powers of two); for H2O also sampled, a ragged list of them, and a prompt B holds whole
    (5 ids: a prefill of 4, then a step)."""
    import threading

    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import _generate, compile_generate

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    model, params = Qwen3ForCausalLM(config), init_params(config, jax.random.key(5))
    kv_model, kv_params, _ = _kvpop_model_with_random_scorers(rng, sinks=2, window=4, topk=3, scorer="mlstm")
    no_eos, greedy, sampled = jnp.asarray([-1], jnp.int32), SamplingConfig.greedy(), SamplingConfig(top_k=0)
    banded = dataclasses.replace(BaselineConfig("streaming", 6, sinks=1), banded_prefill=True)
    for m, p, cache, lengths, stream_from, want_cache, full in (  # full: also sampled, ragged and a short prompt
            (model, params, BaselineConfig("h2o", 6), (17, 19, 21), 6, None, True),
            (model, params, BaselineConfig("streaming", 6, sinks=1), (21, 22, 23), None, banded, False),
            (kv_model, kv_params, "kvpop", (17, 19, 21), 6, None, False)):  # KVpop streams from s + w
        first, ahead, last = lengths
        prompts = {n: rng.integers(0, config.vocab_size, size=(2, n)) for n in (first, last)}
        jax.clear_caches()
        before = len(compiles)
        worker = threading.Thread(target=compile_generate, args=(m, p, 2, ahead), name="ahead",
                                  kwargs=dict(max_new_tokens=4, sampling=greedy, cache=cache, stream_prompt=True))
        worker.start()
        worker.join()
        rows = {}
        for n, sampling in ((first, greedy), (last, greedy), (last, sampled))[:3 if full else 2]:
            tokens, _ = generate(m, p, prompts[n], max_new_tokens=4, sampling=sampling, rng=jax.random.key(n),
                                 cache=cache, stream_prompt=True)
            want = _generate(m, p, jnp.asarray(prompts[n]), jax.random.key(n), no_eos, max_new_tokens=4,
                             sampling=sampling, cache=want_cache or cache, stream_from=stream_from)  # per length
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want[0]), err_msg=f"{cache}, {n} ids")
            rows[n] = tokens if sampling is greedy else rows[n]
        fed = [t for t, f in compiles[before:] if f == "jit(_generate_fed)"]
        assert fed == ["ahead", "MainThread"][:2 if full else 1], compiles[before:]  # greedy (ahead), sampled
        if not full:
            continue
        ragged, _ = generate(m, p, [prompts[first][0].tolist(), prompts[last][1].tolist()], max_new_tokens=4,
                             sampling=greedy, cache=cache, stream_prompt=True)  # rows of one each
        np.testing.assert_array_equal(np.asarray(ragged), np.stack([rows[first][0], rows[last][1]]))
        short = rng.integers(0, config.vocab_size, size=(2, 5))  # B holds it whole: a prefill of 4, then a step
        before = len(compiles)
        tokens, _ = generate(m, p, short, max_new_tokens=4, sampling=greedy, cache=cache, stream_prompt=True)
        assert [f for _, f in compiles[before:] if "_generate" in f] == ["jit(_generate_fed)"], compiles[before:]
        want = _generate(m, p, jnp.asarray(short), jax.random.key(0), no_eos, max_new_tokens=4, sampling=greedy,
                         cache=cache, stream_from=stream_from)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want[0]), err_msg=f"{cache}, 5 ids")


@pytest.mark.parametrize("banded", [False, pytest.param(True, marks=pytest.mark.long)])
def test_a_streamed_prompt_without_evictions_or_banded_compiles_once_per_bucket_whatever_its_rest(rng, compiles,
                                                                                                  banded):
    """A streamed prompt that B holds whole (TOVA at B 64), or StreamingLLM's banded read, prefills the largest power
    of two of its length and reads the rest a step each: the rest's tail was padded to the next power of two of the
    rest, so lengths 17 and 24 (rests 1 and 8) compiled two programs in one bucket; the tail now has the prefill's
    size, one program per bucket, and the tokens stay the per-length program's."""
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import _generate

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    model, params = Qwen3ForCausalLM(config), init_params(config, jax.random.key(6))
    streaming = BaselineConfig("streaming", 6, sinks=1)
    cache, want_cache, stream_from = ((streaming, dataclasses.replace(streaming, banded_prefill=True), None) if banded
                                      else (BaselineConfig("tova", 64, sinks=1), BaselineConfig("tova", 64, sinks=1),
                                            64))
    no_eos, greedy = jnp.asarray([-1], jnp.int32), SamplingConfig.greedy()
    jax.clear_caches()
    before = len(compiles)
    for n in (17, 24):
        prompt = rng.integers(0, config.vocab_size, size=(2, n))
        tokens, _ = generate(model, params, prompt, max_new_tokens=3, sampling=greedy, cache=cache,
                             stream_prompt=True)
        if n == 17:
            want = _generate(model, params, jnp.asarray(prompt), jax.random.key(0), no_eos, max_new_tokens=3,
                             sampling=greedy, cache=want_cache, stream_from=stream_from)  # the per-length program
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want[0]))
    fed = [f for _, f in compiles[before:] if f == "jit(_generate_fed)"]
    assert fed == ["jit(_generate_fed)"], compiles[before:]


def test_int64_prompt_ids_compile_nothing_per_length(compiles):
    """numpy's default int64 ids (and Conversation's own turns) were cast to int32 on the device, an eager compile per
    prompt shape beside the bucketed programs; they are cast on the host now."""
    from kvpop_jax.generate import _as_prompt_array

    before = len(compiles)
    for p in (9, 10, 11):
        ids = _as_prompt_array(np.arange(2 * p, dtype=np.int64).reshape(2, p) % 90, 97)
        assert ids.dtype == jnp.int32 and ids.shape == (2, p)
    assert compiles[before:] == [], compiles[before:]


def test_a_dense_cache_read_in_blocks_holds_the_prompts_bucket_plus_the_reply():
    """A dense cache for a prompt read in blocks held the next power of two of P + max_new_tokens slots: 300 + 32768
    took 65536 where 33068 are used. It now holds the prompt's bucket plus the reply (512 + 32768), the same for
    every length of the bucket, so the programs are still shared."""
    from kvpop_jax.generate import _blocks_cache

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    model = Qwen3ForCausalLM(config)
    for prompt_len in (257, 300, 511):
        k = _blocks_cache(model, "dense", (1, prompt_len), 32768).layers[0].k
        assert 512 + 32768 in k.shape and 65536 not in k.shape, k.shape


@pytest.mark.parametrize("method", ["tova", pytest.param("h2o", marks=pytest.mark.long),
                                    pytest.param("streaming", marks=pytest.mark.long)])
def test_a_one_shot_baseline_compiles_once_per_power_of_two(rng, compiles, method):
    """generate on a one-shot baseline (a dense prefill, then compression: `eval.main accuracy`'s default) compiled a
    program per prompt length. A length not a power of two is now padded at its end to the next power of two, the
    padding neither cached nor scored (`BaselineLayerCache.prompt_len`): prompts of 9 and 13 ids at B 6 run on one
    program, which compile_generate compiles ahead, and the tokens equal the per-length program's (`_generate`), a
    prompt B holds whole too (5 ids, padded to 8); H2O also sampled, StreamingLLM a ragged list and a
    Conversation's first turn (padded too) replying as generate (~10 s each)."""
    import threading

    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import Conversation, _generate, compile_generate

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    model, params = Qwen3ForCausalLM(config), init_params(config, jax.random.key(5))
    cache = BaselineConfig(method, 6, sinks=0 if method == "tova" else 1)
    no_eos, greedy, sampled = jnp.asarray([-1], jnp.int32), SamplingConfig.greedy(), SamplingConfig(top_k=0)
    jax.clear_caches()
    before = len(compiles)
    worker = threading.Thread(target=compile_generate, args=(model, params, 2, 11), name="ahead",
                              kwargs=dict(max_new_tokens=4, sampling=greedy, cache=cache))
    worker.start()
    worker.join()
    prompts = {n: rng.integers(0, config.vocab_size, size=(2, n)) for n in (9, 13, 5)}
    calls = [(9, greedy), (13, greedy), (5, greedy)] + [(13, sampled)] * (method == "h2o")
    for n, sampling in calls:
        tokens, _ = generate(model, params, prompts[n], max_new_tokens=4, sampling=sampling, rng=jax.random.key(n),
                             cache=cache)
        want = _generate(model, params, jnp.asarray(prompts[n]), jax.random.key(n), no_eos, max_new_tokens=4,
                         sampling=sampling, cache=cache)  # a program per length
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want[0]), err_msg=f"{cache}, {n} ids")
    padded = [t for t, f in compiles[before:] if f == "jit(_generate_padded)"]
    assert padded == ["ahead", "MainThread"] + ["MainThread"] * (method == "h2o"), compiles[before:]  # 16; 8; sampled
    if method != "streaming":
        return
    ragged, _ = generate(model, params, [prompts[9][0].tolist(), prompts[13][1].tolist()], max_new_tokens=4,
                         sampling=greedy, cache=cache)  # rows of one each: batch 1's programs
    for row, (n, i) in zip(np.asarray(ragged), ((9, 0), (13, 1))):
        want = _generate(model, params, jnp.asarray(prompts[n][i:i + 1]), jax.random.key(0), no_eos,
                         max_new_tokens=4, sampling=greedy, cache=cache)
        np.testing.assert_array_equal(row, np.asarray(want[0][0]))
        reply, k = Conversation(model, params, cache=cache).send(prompts[n][i], max_new_tokens=4, sampling=greedy)
        np.testing.assert_array_equal(np.asarray(reply), row)


@pytest.mark.parametrize("method", [pytest.param("h2o", marks=pytest.mark.long), "tova", "streaming"])  # h2o ~20 s
def test_stream_prompt_evicts_token_by_token(rng, method):
    """stream_prompt: prefill of the first B tokens, then one decode step per prompt token, then
    greedy decoding, checked against those calls made one at a time from Python. (Not equal to the
    one-shot compression, even for StreamingLLM: there the prompt pass itself is dense.)"""
    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import init_generation_cache

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(3))
    model = Qwen3ForCausalLM(config)
    cfg = BaselineConfig(method, 6, sinks=1)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 17)))
    tokens, _ = generate(model, params, prompt, max_new_tokens=5, sampling=SamplingConfig.greedy(), cache=cfg,
                         stream_prompt=True)
    out = model.apply({"params": params}, prompt[:, :6], cache=init_generation_cache(config, cfg, 2, 0))
    cache, logits = out.cache, out.logits[:, -1]
    step = lambda tok, c: model.apply({"params": params}, tok[:, None], cache=c,  # noqa: E731
                                      method=Qwen3ForCausalLM.decode_step)
    for t in range(6, 17):
        out = step(prompt[:, t], cache)
        cache, logits = out.cache, out.logits[:, -1]
    expected = []
    for _ in range(5):
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        expected.append(np.asarray(nxt))
        out = step(nxt, cache)
        cache, logits = out.cache, out.logits[:, -1]
    np.testing.assert_array_equal(np.asarray(tokens), np.stack(expected, 1))


def test_token_ids_outside_the_vocabulary_are_refused(rng):
    """Issue 13: ids >= vocab embedded as NaN (and negative ones wrapped): generate and an eager apply refuse them."""
    from kvpop_jax.modeling import abstract_params

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_params(config))  # checked before use
    model = Qwen3ForCausalLM(config)
    for bad in (config.vocab_size, 500, -1):
        with pytest.raises(ValueError, match=f"prompt_ids holds token id {bad} outside the vocabulary \\[0, 97\\)"):
            generate(model, params, [[1, 5, bad]], max_new_tokens=2)
        with pytest.raises(ValueError, match=f"input_ids holds token id {bad} outside the vocabulary"):
            model.apply({"params": params}, jnp.asarray([[1, 5, bad]]))


@pytest.mark.long
def test_training_only_knobs_do_not_change_decoding(rng):
    """KVpopConfig.for_decoding resets what only training reads: a model decodes bit for bit the same
    with every such knob changed, so eval shares one compile between exports trained differently."""
    from eval.accuracy import method_config

    trained = KVpopConfig(
        sinks=1, window=3, topk=4, scorer="mlstm", mlstm_chunk=4, mlstm_init="random", loss_temperature=0.5,
        retention_labels="soft", margin_weighting=False, omega_min=0.3, tau_omega=2.0, balance_weighting=False,
        balance_min=0.5, balance_max=2.0, eps=1e-3, aggregate="mean", count_normalize=False, normalizer="dense",
        target_reduce="max", target_lookahead=5, num_query_samples=7, late_bias_fraction=0.2, rank_pairs=3,
        rank_partners="similar", keepset_queries=2, target_head_samples=1, listwise_queries=2,
        listwise_temperature=0.5, regression_weight=0.5, kl_topk=5, kl_temperature=2.0, retention_loss_weight=3.0)
    decoding = trained.for_decoding()
    defaults = KVpopConfig()
    for name in KVpopConfig.TRAINING_ONLY:
        assert getattr(trained, name) != getattr(defaults, name), name  # every knob is exercised
        assert getattr(decoding, name) == getattr(defaults, name), name
    kept = [f.name for f in dataclasses.fields(KVpopConfig) if f.name not in KVpopConfig.TRAINING_ONLY]
    assert all(getattr(decoding, n) == getattr(trained, n) for n in kept)

    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = retrofit_params(dataclasses.replace(base, kvpop=trained), init_params(base, jax.random.key(1)),
                             jax.random.key(2))
    params = jax.tree_util.tree_map_with_path(  # random scorers, so eviction follows them
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), x.dtype) if "kvpop" in jax.tree_util.keystr(path) else x,
        params)
    prompt = jnp.asarray(rng.integers(0, base.vocab_size, size=(2, 12)))
    out = {}
    for name, kv in (("trained", trained), ("decoding", decoding)):
        model = Qwen3ForCausalLM(dataclasses.replace(base, kvpop=kv))
        forward = model.apply({"params": params}, prompt).logits  # the masked parallel forward
        tokens, _ = generate(model, params, prompt, max_new_tokens=6, sampling=SamplingConfig.greedy())
        out[name] = (np.asarray(forward), np.asarray(tokens))
    np.testing.assert_array_equal(out["trained"][0], out["decoding"][0])
    np.testing.assert_array_equal(out["trained"][1], out["decoding"][1])
    mean_export = dataclasses.replace(base, kvpop=dataclasses.replace(trained, target_reduce="sum"))
    max_export = dataclasses.replace(base, kvpop=trained)
    assert method_config("a", mean_export, 20, sinks=1) == method_config("b", max_export, 20, sinks=1)


@pytest.fixture
def compiles():
    with logged_compiles() as seen:
        yield seen


def test_compile_generate_compiles_the_program_generate_then_runs(rng, compiles):
    """A background compile of the program, then `generate` in this thread with other prompt ids,
    rng and EOS ids of the same count: no second compile (another model config does compile)."""
    import dataclasses
    import threading

    from kvpop_jax.baselines import BaselineConfig
    from kvpop_jax.generate import compile_generate

    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(4))
    model = Qwen3ForCausalLM(config)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 8)))  # a power of two: one program
    cache = BaselineConfig("tova", 5)
    kwargs = dict(max_new_tokens=4, sampling=SamplingConfig(temperature=1.0, top_p=1.0, top_k=0), cache=cache,
                  stream_prompt=True)
    worker = threading.Thread(target=compile_generate, args=(model, params, 2, 8), kwargs=dict(eos_ids=(1,), **kwargs),
                              name="ahead")
    worker.start()
    worker.join()
    assert compiles.count(("ahead", "jit(_generate)")) == 1
    tokens, _ = generate(model, params, prompt, eos_ids=(5,), rng=jax.random.key(7), **kwargs)
    assert tokens.shape == (2, 4)
    assert ("MainThread", "jit(_generate)") not in compiles
    # the same call with another model config is another program: compiled here, so the check above can fail
    fresh = Qwen3ForCausalLM(dataclasses.replace(config, rms_norm_eps=config.rms_norm_eps * 2))
    generate(fresh, params, prompt, eos_ids=(5,), rng=jax.random.key(7), **kwargs)
    assert ("MainThread", "jit(_generate)") in compiles
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        compile_generate(model, params, 0, 9, max_new_tokens=4)
    with pytest.raises(ValueError, match="eos_ids holds 97"):  # checked as generate checks it
        compile_generate(model, params, 2, 9, max_new_tokens=4, eos_ids=(config.vocab_size,))


def test_generate_arguments_are_checked_and_int_like_values_taken(rng):
    """A notebook's likely arguments: an int EOS (as config.json's eos_token_id comes), numpy / jax integer
    lengths and an int seed are taken as what they mean; wide ids, out-of-vocabulary EOS ids, float lengths
    and the wrong kinds of objects are refused by name before anything compiles."""
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(1))
    model = Qwen3ForCausalLM(config)
    prompt = rng.integers(0, config.vocab_size, size=(2, 5))
    greedy = SamplingConfig.greedy()
    tokens, _ = generate(model, params, prompt, max_new_tokens=4, sampling=greedy)
    eos = int(tokens[0, 1])
    want = generate(model, params, prompt, max_new_tokens=4, sampling=greedy, eos_ids=(eos,))
    for same in (eos, np.int64(eos), [eos], jnp.asarray([eos]), np.asarray(eos)):
        got = generate(model, params, prompt, max_new_tokens=4, sampling=greedy, eos_ids=same)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert int(want[1][0]) == [int(t) for t in tokens[0]].index(eos) + 1  # the EOS stopped row 0
    for length in (np.int32(4), jnp.int32(4)):
        np.testing.assert_array_equal(np.asarray(generate(model, params, prompt, max_new_tokens=length,
                                                          sampling=greedy)[0]), np.asarray(tokens))
    sampled = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0)
    by_seed = generate(model, params, prompt, max_new_tokens=4, sampling=sampled, rng=7)[0]
    by_key = generate(model, params, prompt, max_new_tokens=4, sampling=sampled, rng=jax.random.key(7))[0]
    np.testing.assert_array_equal(np.asarray(by_seed), np.asarray(by_key))
    raw = np.asarray(jax.random.PRNGKey(7))  # an old-style key that went through numpy
    by_raw = generate(model, params, prompt, max_new_tokens=4, sampling=sampled, rng=raw)[0]
    np.testing.assert_array_equal(np.asarray(by_raw),
                                  np.asarray(generate(model, params, prompt, max_new_tokens=4, sampling=sampled,
                                                      rng=jax.random.PRNGKey(7))[0]))

    short = Qwen3ForCausalLM(dataclasses.replace(config, max_position_embeddings=6))
    with pytest.warns(UserWarning, match="reach 9 tokens, beyond the model's max_position_embeddings 6"):
        generate(short, params, prompt, max_new_tokens=4, sampling=greedy)

    wide = np.array([[1, 2**32 + 10, 11]], np.int64)  # int32 would wrap it to id 10
    with pytest.raises(ValueError, match=f"prompt_ids holds token id {2**32 + 10} outside the vocabulary"):
        generate(model, params, wide, max_new_tokens=2)
    bad_calls = [
        (dict(eos_ids=config.vocab_size), "eos_ids holds 97; expected token ids in \\[0, 97\\)"),
        (dict(eos_ids=("2",)), "eos_ids holds '2'"),
        (dict(eos_ids=2.5), "eos_ids must be a token id or a sequence"),
        (dict(max_new_tokens=3.0), "max_new_tokens must be an int >= 1, got 3.0"),
        (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
        (dict(sampling={"temperature": 0}), "sampling must be a SamplingConfig"),
        (dict(rng="seed"), "rng must be a jax.random.key"),
        (dict(rng=2**63), f"rng seed {2**63} is outside jax.random.key's int64 range"),  # was a bare OverflowError
        (dict(rng=-2**63 - 1), "is outside jax.random.key's int64 range"),
    ]
    for kwargs, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            generate(model, params, prompt, **{"max_new_tokens": 2, **kwargs})
    for kwargs, message in [(dict(top_k=True), "top_k must be an int"), (dict(top_k=2.5), "top_k must be an int"),
                            (dict(temperature="0.6"), "temperature must be a number"),
                            (dict(temperature=None), "temperature must be a number")]:
        with pytest.raises(ValueError, match=message):
            SamplingConfig(**kwargs)
    assert SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3)).top_k == 3


def test_a_tiny_temperature_samples_the_argmax(rng):
    """temperature -> 0 tends to greedy. A tiny positive temperature (valid: finite and > 0) overflowed
    logits / T to +-inf, the softmax to NaN, and `categorical` returned token 0 whatever the logits."""
    logits = jnp.asarray(rng.normal(size=(6, 40)).astype(np.float32) * 4 + 20)
    best = np.argmax(np.asarray(logits), -1)
    assert (best != 0).any()
    for temperature in (1e-30, 1e-38, 1e-45):
        for cfg in (SamplingConfig(temperature, 1.0, 0, 0.0), SamplingConfig(temperature, 0.95, 20, 0.05)):
            tok = np.asarray(sample(jax.random.key(int(rng.integers(1 << 30))), logits, cfg))
            np.testing.assert_array_equal(tok, best, err_msg=f"{cfg}")


def test_rng_takes_a_jax_integer_seed_and_names_a_batch_of_keys(rng):
    """A jax integer scalar is an int seed (it was a TypeError about PRNG key data), and one key per row
    (`jax.random.split(key, B)`) is named: jax's own error said to use jax.vmap."""
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(1))
    model = Qwen3ForCausalLM(config)
    prompt = rng.integers(0, config.vocab_size, size=(2, 5))
    sampled = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0)
    seed = int(rng.integers(1 << 30))
    want = np.asarray(generate(model, params, prompt, max_new_tokens=4, sampling=sampled, rng=seed)[0])
    for same in (jnp.int32(seed), jnp.asarray(seed, jnp.uint32), np.asarray(seed)):
        got = generate(model, params, prompt, max_new_tokens=4, sampling=sampled, rng=same)[0]
        np.testing.assert_array_equal(np.asarray(got), want)
    for keys, shape in ((jax.random.split(jax.random.key(seed), 2), (2,)),
                        (jax.random.split(jax.random.PRNGKey(seed), 2), (2,)),
                        (np.zeros((3, 2), np.uint32), (3,))):
        with pytest.raises(ValueError, match=re.escape(f"rng must be one key, got a batch of keys of shape {shape}")):
            generate(model, params, prompt, max_new_tokens=2, sampling=sampled, rng=keys)
    for bad in (jnp.float32(1.0), np.zeros(4, np.uint32), 0.5):
        with pytest.raises(ValueError, match="rng must be a jax.random.key"):
            generate(model, params, prompt, max_new_tokens=2, sampling=sampled, rng=bad)


def _nucleus_reference(logits, cfg):
    """The sampling distribution of `cfg` by numpy, in transformers' order: temperature, top-k, top-p, min-p."""
    x = logits.astype(np.float64) / cfg.temperature
    if 0 < cfg.top_k < x.size:
        x = np.where(x < np.sort(x)[::-1][cfg.top_k - 1], -np.inf, x)
    if cfg.top_p < 1:
        probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # the smallest set whose mass reaches p
        keep = np.zeros(x.size, bool)
        keep[order[before < cfg.top_p]] = True
        x = np.where(keep, x, -np.inf)
    if cfg.min_p > 0:
        x = np.where(np.exp(x - x.max()) < cfg.min_p, -np.inf, x)
    probs = np.exp(x - x.max())
    return probs / probs.sum()


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0, 1.0, 0, 0.0), SamplingConfig(0.6, 0.95, 5, 0.0),
                                 SamplingConfig(1.3, 0.7, 0, 0.0), SamplingConfig(0.8, 1.0, 0, 0.2),
                                 SamplingConfig(2.0, 0.9, 8, 0.05)])
def test_sampled_frequencies_match_the_reference_distribution(rng, cfg):
    """20k draws of one row: no token outside the reference's support, and a chi-square within the
    0.999 quantile of its degrees of freedom (the test fails by chance about once in 1000 seeds)."""
    logits = rng.normal(size=12).astype(np.float32) * 0.6
    n = 20_000
    tokens = np.asarray(sample(jax.random.key(int(rng.integers(1 << 30))), jnp.asarray(np.tile(logits, (n, 1))), cfg))
    counts = np.bincount(tokens, minlength=logits.size)
    expected = _nucleus_reference(logits, cfg) * n
    assert not counts[expected == 0].any()
    support = expected > 0
    dof = int(support.sum()) - 1
    chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    bound = {0: 1e-9, 1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
             10: 29.59, 11: 31.26}[dof]
    assert chi2 < bound, (chi2, dof, counts, expected)


def test_sampled_generate_with_a_bounded_cache_matches_a_reference_loop(rng):
    """Sampling through the KVpop cache (prompt past B, 5 B new tokens, EOS per row) draws what a plain
    loop over the masked parallel forward draws with the same key schedule; tokens after a row's EOS
    are 0, and two rows with the same prompt draw different continuations."""
    model, params, config = _kvpop_model_with_random_scorers(rng, sinks=2, window=3, topk=3, scorer="mlp")
    cfg, n, seed = SamplingConfig(1.0, 0.9, 30, 0.0), 40, int(rng.integers(1 << 30))
    prompt = rng.integers(0, config.vocab_size, size=(3, 9))
    prompt[1] = prompt[0]
    forward = jax.jit(lambda ids: model.apply({"params": params}, ids).logits)
    free = np.zeros((3, 9 + n), np.int32)  # the reference, with no EOS: pick EOS ids it draws
    free[:, :9] = prompt
    key = jax.random.key(seed)
    keys = []
    for t in range(9, 9 + n):
        key, k = jax.random.split(key)
        keys.append(k)
        free[:, t] = np.asarray(sample(k, forward(jnp.asarray(free))[:, t - 1], cfg))
    assert (free[0, 9:] != free[1, 9:]).any()
    eos = (int(free[0, 12]), int(free[2, 30]))
    tokens, lengths = generate(model, params, prompt, max_new_tokens=n, sampling=cfg, rng=seed, eos_ids=eos)
    want = free[:, 9:].copy()
    for row in range(3):
        stop = np.flatnonzero(np.isin(want[row], eos))
        if stop.size:
            want[row, stop[0] + 1:] = 0
    np.testing.assert_array_equal(np.asarray(tokens), want)
    for row in range(3):
        stop = np.flatnonzero(np.isin(want[row], eos))
        assert int(lengths[row]) == (stop[0] + 1 if stop.size else n)
    assert int(lengths[0]) <= 4


@pytest.mark.parametrize("prompt_len", [7, 8, 9])
def test_greedy_kvpop_at_the_budget_and_past_it_over_a_long_generation(rng, prompt_len):
    """Prompts one short of B = s + w + k, exactly B and one past it, then 5 B greedy tokens (the cache
    rolls five times): the masked parallel forward's argmax at every step."""
    model, params, config = _kvpop_model_with_random_scorers(rng, sinks=2, window=3, topk=3, scorer="mlp")
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, prompt_len)))
    tokens, _ = generate(model, params, prompt, max_new_tokens=40, sampling=SamplingConfig.greedy())
    np.testing.assert_array_equal(np.asarray(tokens), greedy_reference(model, params, prompt, 40))


def test_a_tiny_top_p_keeps_the_top_token(rng):
    """top_p keeps the smallest set whose mass reaches p, never fewer than one token. A p below float32's
    normal range (valid: > 0) compares as 0, so no token was kept, and every row drew token 0; the one
    token the filter meant to keep was written at index 0 of the unsorted row, then overwritten."""
    logits = jnp.asarray(rng.normal(size=(6, 40)).astype(np.float32) * 3)
    best = np.argmax(np.asarray(logits), -1)
    assert (best != 0).any()
    for p in (1e-6, 1e-38, 1e-45, 1e-300):
        kept = np.asarray(filter_top_p(logits, p)) > -1e29
        np.testing.assert_array_equal(kept, np.eye(40, dtype=bool)[best], err_msg=f"top_p={p}")
        tok = sample(jax.random.key(int(rng.integers(1 << 30))), logits, SamplingConfig(1.0, p, 0, 0.0))
        np.testing.assert_array_equal(np.asarray(tok), best, err_msg=f"top_p={p}")
