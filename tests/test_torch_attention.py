"""The KVpop mask reaches the "kvpop" attention on the keys `KVpopCache.update` returns, on every transformers.

transformers 4.56-5.23 never hand the cache the attention's kwargs: 4.56-5.0 call `cache.update(k, v, layer_idx,
cache_kwargs)`, 5.5-5.23 `cache.update(k, v, layer_idx)`, 5.24 on `cache.update(k, v, layer_idx, kwargs=kwargs)`. The
mask took that kwargs dict until it rode on the keys, so every decode before 5.24 failed. All three call forms give
the same attention here, whatever the transformers these tests run on.
"""

import io
import threading
import types
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvpop_torch
from helpers import REPO, kvpop_export
from kvpop_jax import KVpopConfig, Qwen3Config
from kvpop_torch import KVpopCache, kvpop_attention
from kvpop_torch.cache import cache_argument
from kvpop_torch.checkpoint import load_heads

BASE = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
KV = KVpopConfig(scorer="mlstm", sinks=1, window=3, topk=4, mlstm_chunk=4)
STEPS = (6, 1, 1, 5, 1, 1)  # a prompt, decode steps, a later turn of 5 tokens, decode steps: tokens per call


def takes_past_key_values(model) -> bool:
    """Whether this transformers' forward names its cache past_key_values (before 5.24), not cache."""
    return cache_argument(model) == "past_key_values"


CALL_FORMS = ("cache_kwargs", "nothing", "attention_kwargs")  # what update gets: 4.56-5.0, 5.5-5.23, 5.24 on


def attend(cache, layer_idx: int, q, k, v, *, form: str):
    """One attention call of a layer as transformers makes it -> out [B, T, Hq, D]: the cache gets a cache_kwargs
    dict, nothing, or the attention's kwargs (CALL_FORMS), which the attention function receives in every form."""
    first = cache.layers[layer_idx].seen
    kwargs = {"position_ids": torch.arange(first, first + q.shape[2])[None]}
    if form == "attention_kwargs":
        keys, values = cache.update(k, v, layer_idx, kwargs=kwargs)
    elif form == "nothing":
        keys, values = cache.update(k, v, layer_idx)
    else:
        keys, values = cache.update(k, v, layer_idx, {"sin": None, "cos": None,
                                                     "cache_position": kwargs["position_ids"][0]})
    module = types.SimpleNamespace(layer_idx=layer_idx)  # what the attention function is given as `module`
    return kvpop_attention(module, q, keys, values, None, scaling=BASE.head_dim**-0.5, **kwargs)[0]


def random_steps(seed: int, batch: int = 2):
    """Per call: (q [B, Hq, T, D], k [B, Hkv, T, D], v) for each layer."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda heads, t: torch.randn(batch, heads, t, BASE.head_dim, generator=g)  # noqa: E731
    return [[(draw(BASE.num_attention_heads, t), draw(BASE.num_key_value_heads, t), draw(BASE.num_key_value_heads, t))
             for _ in range(BASE.num_hidden_layers)] for t in STEPS]


def run(cache, steps, *, form: str):
    return [[attend(cache, i, *qkv, form=form) for i, qkv in enumerate(layers)] for layers in steps]


def test_the_mask_reaches_the_attention_whether_or_not_update_gets_the_attention_kwargs(tmp_path, rng):
    """A prompt, decode steps and a multi-token turn, through both layers and past the cache's budget: the 4.56-5.0
    and 5.5-5.23 call forms give what the 5.24 one gives (they failed: "KVpopCache needs the attention call's
    kwargs"), and keep the same slots."""
    kvpop_export(tmp_path, BASE, KV, rng)
    settings, heads = load_heads(tmp_path)
    steps = random_steps(0)
    new = KVpopCache(settings, heads)
    want = run(new, steps, form="attention_kwargs")
    for form in CALL_FORMS[:2]:
        old = KVpopCache(settings, heads)
        for got_step, want_step in zip(run(old, steps, form=form), want):
            for a, b in zip(got_step, want_step):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=form)
        for a, b in zip(old.positions(), new.positions()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=form)
        assert old.get_seq_length() == sum(STEPS) > settings.budget


def test_interleaved_caches_and_threads_keep_their_own_masks(tmp_path, rng):
    """Two caches of one export (one scorer set), their calls interleaved layer by layer as two models or two
    threads would: each attention reads its own call's mask, so each equals its cache run alone. And two threads
    generating on one model with a cache each give what one thread gives."""
    kvpop_export(tmp_path, BASE, KV, rng)
    settings, heads = load_heads(tmp_path)
    steps_a, steps_b = random_steps(1), random_steps(2, batch=1)
    alone_a = run(KVpopCache(settings, heads), steps_a, form="nothing")
    alone_b = run(KVpopCache(settings, heads), steps_b, form="nothing")
    a, b = KVpopCache(settings, heads), KVpopCache(settings, heads)
    for step, (layers_a, layers_b) in enumerate(zip(steps_a, steps_b)):
        for i, (qkv_a, qkv_b) in enumerate(zip(layers_a, layers_b)):
            keys_a, values_a = a.update(*qkv_a[1:], i)  # both updates before either attention
            keys_b, values_b = b.update(*qkv_b[1:], i)
            module = types.SimpleNamespace(layer_idx=i)
            out_b = kvpop_attention(module, qkv_b[0], keys_b, values_b, None, scaling=BASE.head_dim**-0.5)[0]
            out_a = kvpop_attention(module, qkv_a[0], keys_a, values_a, None, scaling=BASE.head_dim**-0.5)[0]
            torch.testing.assert_close(out_a, alone_a[step][i], rtol=0, atol=0)
            torch.testing.assert_close(out_b, alone_b[step][i], rtol=0, atol=0)

    model, make_cache = kvpop_torch.load(tmp_path)
    prompts = [torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(1, n))) for n in (9, 14)]
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = [model.generate(p, cache=make_cache(), **greedy) for p in prompts]
        got = [None, None]

        def generate(i):
            with torch.no_grad():
                for _ in range(3):
                    got[i] = model.generate(prompts[i], cache=make_cache(), **greedy)

        threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_keys_without_a_mask_or_a_prompt_off_position_zero_are_named(tmp_path, rng):
    """Keys that did not come from a KVpopCache (copied, or another cache's) carry no mask: named, never attended
    to unmasked. A prompt whose position_ids do not start at 0 is named (the check moved from the cache, which
    4.56-5.23 do not give them, to the attention, which every transformers does)."""
    kvpop_export(tmp_path, BASE, KV, rng)
    settings, heads = load_heads(tmp_path)
    (q, k, v), _ = random_steps(3)[0]
    keys, values = KVpopCache(settings, heads).update(k, v, 0)
    module = types.SimpleNamespace(layer_idx=0)
    with pytest.raises(ValueError, match="needs a KVpopCache"):
        kvpop_attention(module, q, keys.clone(), values, None)
    model, make_cache = kvpop_torch.load(tmp_path)
    ids = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, 6)))
    with torch.no_grad(), pytest.raises(ValueError, match=r"at positions 0\.\.P-1"):
        model(ids, position_ids=torch.arange(3, 9)[None], cache=make_cache())


def test_the_cache_argument_on_every_transformers(tmp_path, rng):
    """`cache=` (the name from 5.24 on) and `past_key_values=` reach the model's cache on every supported
    transformers, for a KVpop and a dense model; a model kvpop_torch has not seen, on a transformers whose forward
    takes past_key_values, passes an unknown `cache` on to the attention, which names the fix."""
    kvpop_export(tmp_path, BASE, KV, rng)
    ids = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, 7)))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="kvpop").eval()
    with torch.no_grad():
        if takes_past_key_values(plain):
            with pytest.raises(ValueError, match="names the model's cache argument past_key_values"):
                plain(ids, cache=KVpopCache.from_pretrained(tmp_path))
        with warnings.catch_warnings(record=True) as caught:  # deprecated from 5.24 on, the model's own name before
            warnings.simplefilter("always")
            want = plain(ids, past_key_values=KVpopCache.from_pretrained(tmp_path)).logits
        assert any(issubclass(w.category, FutureWarning) for w in caught) != takes_past_key_values(plain)
        model, make_cache = kvpop_torch.load(tmp_path)
        cache = make_cache()
        torch.testing.assert_close(model(ids, cache=cache).logits, want, rtol=0, atol=0)
        assert cache.get_seq_length() == 7
        if takes_past_key_values(model):  # (5.24 on, transformers use cache= and warn; so do the guards)
            with pytest.raises(ValueError, match="passed twice"):
                model(ids, cache=make_cache(), past_key_values=make_cache())
            cache = make_cache()  # cache=None names no cache
            torch.testing.assert_close(model(ids, cache=None, past_key_values=cache).logits, want, rtol=0, atol=0)
            assert cache.get_seq_length() == 7

        dense, make_dense = kvpop_torch.load(f"{REPO}/checkpoints/demo-teacher")
        for call in ("forward", "generate"):
            cache = make_dense()
            if call == "forward":
                dense(ids, cache=cache)
            else:
                dense.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
            assert cache.get_seq_length() == (7 if call == "forward" else 9), call  # read, not a fresh one made


def test_a_loaded_model_pickles_and_an_offset_prompt_leaves_the_cache_fresh(tmp_path, rng):
    """torch.save of a whole model from kvpop_torch.load (KVpop or dense) loads back, its checked generate bound to
    the copy (a bound method pickled as getattr(model, '_generate_checked'), which failed on load). A prompt off
    position 0 is refused before the cache reads it, so the same cache serves the corrected call; a model
    kvpop_torch has not seen is refused by the attention instead."""
    kvpop_export(tmp_path, BASE, KV, rng)
    ids = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, 6)))
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    for directory in (tmp_path, f"{REPO}/checkpoints/demo-teacher"):
        model, make_cache = kvpop_torch.load(directory)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.generate.__self__ is loaded
        with torch.no_grad():
            torch.testing.assert_close(loaded.generate(ids, cache=make_cache(), **greedy),
                                       model.generate(ids, cache=make_cache(), **greedy), rtol=0, atol=0)
    model, make_cache = kvpop_torch.load(tmp_path)
    cache = make_cache()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"at positions 0\.\.P-1 .*one at a time$"):
            model(ids, position_ids=torch.arange(3, 9)[None], cache=cache)
        assert cache.get_seq_length() == 0
        torch.testing.assert_close(model(ids, cache=cache).logits, model(ids, cache=make_cache()).logits,
                                   rtol=0, atol=0)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="kvpop").eval()
        with pytest.raises(ValueError, match=r"at positions 0\.\.P-1 .*read the prompt into its first layer"):
            plain(ids, position_ids=torch.arange(3, 9)[None],  # by this transformers' own name
                  **{cache_argument(plain): KVpopCache.from_pretrained(tmp_path)})
