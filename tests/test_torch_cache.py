"""kvpop_torch.KVpopCache decodes a KVpop export in transformers exactly as kvpop_jax does.

Teacher-forced decode logits equal the JAX bounded-cache decode (1e-4, fp32) and every layer's
slots hold the same token positions after every step, through prompts shorter and longer than
B; greedy `generate` on the shipped demo exports gives the tokens of `eval.main generate`.
"""

import copy
import dataclasses
import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import kvpop_torch
from eval import main as eval_main
from helpers import REPO, TINY_HF_CONFIGS, kvpop_export
from kvpop_jax import KVpopConfig, Qwen3Config
from kvpop_jax.cache import init_cache
from kvpop_jax.modeling import Qwen3ForCausalLM
from kvpop_torch import KVpopCache
from kvpop_torch.cache import cache_argument

BASE = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
SEQ_LEN = 36

CASES = [
    # (base, KVpopConfig options, prompt lengths: shorter and longer than B = s + w + k)
    (BASE, dict(scorer="linear", sinks=2, window=5, topk=0), (3, 20)),  # StreamingLLM-like
    (BASE, dict(scorer="mlp", sinks=1, window=3, topk=8), (5, 30)),
    (BASE, dict(scorer="mlp", sinks=0, window=1, topk=6), (1, 17)),  # a one-token prompt is a decode step
    (BASE, dict(scorer="mlstm", sinks=2, window=4, topk=5), (3, 25)),  # delayed readout
    (BASE, dict(scorer="mlstm", sinks=1, window=4, topk=5, delayed_readout=False), (6, 20)),
    (BASE, dict(scorer="mlstm", sinks=2, window=4, topk=6, mlstm_feature_map="softmax", mlstm_value="cached",
                mlstm_norm=True), (5, 20)),
    (Qwen3Config(**TINY_HF_CONFIGS["g4_bias"]),  # GQA 4, attention biases, 3 layers
     dict(scorer="mlstm", sinks=2, window=4, topk=6, mlstm_skip=True, mlstm_gate_softcap=0.0, mlstm_dim=8,
          mlstm_init="random"), (5, 20)),
    (BASE, dict(scorer="mlstm", sinks=2, window=4, topk=5, scorer_keys="unrotated"), (3, 25)),  # RoPE undone
    (BASE, dict(scorer="mlp", sinks=1, window=3, topk=8, scorer_keys="unrotated"), (5, 30)),
    # + a_h * log(1 + t) on the raw score, at entry and at a delayed readout
    (BASE, dict(scorer="mlstm", sinks=2, window=4, topk=5, scorer_keys="unrotated", scorer_position="log"), (3, 25)),
    (BASE, dict(scorer="mlp", sinks=1, window=3, topk=8, scorer_position="log"), (5, 30)),
]


def jax_teacher_forced(model, params, ids, prompt_len, step):
    """(logits [B, S, V], per step: every layer's slot positions [B, Hkv, N]) of the JAX bounded cache."""
    prefill = jax.jit(lambda p, x: model.apply({"params": p}, x, cache=init_cache(model.config, x.shape[0])))
    out = prefill(params, jnp.asarray(ids[:, :prompt_len]))
    logits, cache = [np.asarray(out.logits)], out.cache
    positions = [[np.asarray(layer.pos) for layer in cache.layers]]
    for t in range(prompt_len, ids.shape[1]):
        out = step(params, cache, jnp.asarray(ids[:, t : t + 1]))
        cache = out.cache
        logits.append(np.asarray(out.logits))
        positions.append([np.asarray(layer.pos) for layer in cache.layers])
    return np.concatenate(logits, axis=1), positions


def torch_teacher_forced(model, cache, ids, prompt_len):
    """The same through transformers with a KVpopCache; also checks that its memory never grows."""
    ids = torch.as_tensor(ids)
    with torch.no_grad():
        out = model(ids[:, :prompt_len], cache=cache)
        logits, positions = [out.logits], [[p.numpy().copy() for p in cache.positions()]]
        nbytes = cache.nbytes
        for t in range(prompt_len, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache)
            logits.append(out.logits)
            positions.append([p.numpy().copy() for p in cache.positions()])
            assert cache.nbytes == nbytes
    return torch.cat(logits, dim=1).numpy(), positions


@pytest.mark.parametrize("base,options,prompt_lens", CASES,
                         ids=[f"{o['scorer']}-{i}" for i, (_, o, _) in enumerate(CASES)])
def test_teacher_forced_decode_and_kept_slots_equal_kvpop_jax(tmp_path, rng, base, options, prompt_lens):
    kv = KVpopConfig(mlstm_chunk=8, **options)
    config, params = kvpop_export(tmp_path, base, kv, rng)
    model, make_cache = kvpop_torch.load(tmp_path)
    jax_model = Qwen3ForCausalLM(config)
    step = jax.jit(lambda p, c, t: jax_model.apply({"params": p}, t, cache=c))  # one compile for both prompts
    ids = rng.integers(0, base.vocab_size, size=(2, SEQ_LEN))
    for prompt_len in prompt_lens:
        want, want_pos = jax_teacher_forced(jax_model, params, ids, prompt_len, step)
        cache = make_cache()
        got, got_pos = torch_teacher_forced(model, cache, ids, prompt_len)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        for i, (a, b) in enumerate(zip(got_pos, want_pos)):
            for layer, (x, y) in enumerate(zip(a, b)):
                np.testing.assert_array_equal(x, y, err_msg=f"prompt {prompt_len}, step {i}, layer {layer}")
        # Bounded: B slots per KV head, all taken by now (the sequence is longer than B).
        layer = cache.layers[0]
        assert layer.keys.shape == (2, base.num_key_value_heads, kv.budget, base.head_dim)
        assert (layer.pos >= 0).all()


def test_a_device_this_torch_cannot_use_is_named_before_loading(tmp_path, rng, monkeypatch):
    """load(d, device="cuda") on a torch without CUDA was "Torch not compiled with CUDA enabled" (an
    AssertionError) after the weights were read; a misspelled device was a bare RuntimeError."""
    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda', but this torch sees no CUDA device"):
        kvpop_torch.load(tmp_path, device="cuda")
    with pytest.raises(ValueError, match=r"device='gpu' is not a torch device"):
        kvpop_torch.load(tmp_path, device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device='cuda:3', but this torch sees 1 CUDA device"):
        kvpop_torch.load(tmp_path, device="cuda:3")
    model, _ = kvpop_torch.load(tmp_path, device=torch.device("cpu"))
    assert next(model.parameters()).device.type == "cpu"
    # Other accelerators were checked only by moving the weights there: a raw RuntimeError or AssertionError.
    for dev, usable in (("mps", torch.backends.mps.is_available()),
                        ("xpu", getattr(getattr(torch, "xpu", None), "is_available", lambda: False)())):
        if not usable:
            with pytest.raises(ValueError, match=rf"device='{dev}', but this torch cannot use it"):
                kvpop_torch.load(tmp_path, device=dev)


def test_each_layers_scorer_follows_its_keys_device(tmp_path, rng):
    """With a device_map that splits the layers over GPUs (or offloads them), each layer's keys arrive on
    that layer's device; its scorer moves there at the cache's first update, wherever it was loaded (before,
    every scorer stayed on the first device and the second GPU's layers failed). This box has no second
    device, so the meta device stands in for one: keys there, scorer loaded on the CPU."""
    from kvpop_torch.checkpoint import load_heads

    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlstm", sinks=1, window=3, topk=4), rng)
    settings, heads = load_heads(tmp_path)
    cache = KVpopCache(settings, heads)
    shape = (2, BASE.num_key_value_heads, 5, BASE.head_dim)
    cache.layers[1].lazy_initialization(torch.zeros(shape, device="meta"), torch.zeros(shape, device="meta"))
    assert {p.device.type for p in heads[1].parameters()} == {"meta"}
    assert cache.layers[1].state.C.device.type == "meta" and cache.layers[1].pos.device.type == "meta"
    assert {p.device.type for p in heads[0].parameters()} == {"cpu"}  # the other layer stays where it is
    cache.layers[0].lazy_initialization(torch.zeros(shape), torch.zeros(shape))
    assert {p.device.type for p in heads[0].parameters()} == {"cpu"}


def test_unrotated_keys_refuse_scaled_rope(tmp_path, rng):
    """An unrotated-key export undoes plain RoPE with config.json's rope_theta; a config whose RoPE is
    scaled (edited by hand: kvpop_jax never writes one) is refused by name, not decoded wrongly."""
    import json

    from kvpop_torch.checkpoint import load_heads

    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlstm", sinks=1, window=3, topk=4, scorer_keys="unrotated"), rng)
    settings, heads = load_heads(tmp_path)
    assert settings.scorer_keys == "unrotated" and heads[0].rope_theta == BASE.rope_theta
    path = os.path.join(tmp_path, "config.json")
    config = json.load(open(path))
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    json.dump(config, open(path, "w"))
    with pytest.raises(ValueError, match="undoes plain RoPE, but config.json's rope_scaling has rope_type 'yarn'"):
        load_heads(tmp_path)


def test_a_dms_export_is_refused_not_decoded_dense(tmp_path, rng):
    """kvpop_torch does not run DMS's gates: a DMS export (config.json's "dms" block) is refused by
    name by load and load_heads, where before load failed on its unexpected gate tensors and, with
    those removed, would have decoded it as a dense model."""
    import json

    import kvpop_torch
    from kvpop_torch.checkpoint import load_heads

    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["kvpop"]
    config["dms"] = {"window": 3, "budget": 8}
    with open(path, "w") as f:
        json.dump(config, f)
    for load in (kvpop_torch.load, load_heads, kvpop_torch.read_settings):
        with pytest.raises(ValueError, match="is a DMS export"):
            load(tmp_path)


def test_an_export_that_lost_its_settings_or_holds_nan_scorers_is_refused(tmp_path, rng):
    """Scorer tensors without config.json's 'kvpop' block would load as a dense model (the full
    cache); a NaN scorer would silently keep the oldest tokens; a broken config is named."""
    import json

    import kvpop_torch
    from kvpop_torch.checkpoint import load_heads
    from safetensors.torch import load_file, save_file

    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    path = os.path.join(tmp_path, "config.json")
    original = open(path).read()
    config = json.loads(original)
    del config["kvpop"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"holds KVpop scorer tensors .* but its config.json has no 'kvpop'"):
        kvpop_torch.load(tmp_path)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=r"config.json at .* is not valid JSON"):
        kvpop_torch.load(tmp_path)
    with open(path, "w") as f:
        f.write(original)
    weights = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if ".self_attn.kvpop." in k)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    for load in (kvpop_torch.load, load_heads):
        with pytest.raises(ValueError, match=rf"KVpop tensor '{name}' holds NaN"):
            load(tmp_path)
    # A scorer tensor of a layer the config does not have (2 layers here) was dropped without a word.
    tensors[name] = torch.ones_like(tensors[name])
    tensors[name.replace("layers.0.", "layers.5.").replace("layers.1.", "layers.5.")] = tensors[name].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"KVpop tensors of layers its config.json does not have "
                                         r"\(num_hidden_layers=2\): \['model.layers.5.self_attn.kvpop"):
        load_heads(tmp_path)
    with pytest.raises(ValueError, match=r"config.json has num_hidden_layers=2, the weights hold 3 layers"):
        kvpop_torch.load(tmp_path)  # (before transformers builds the model)


def test_an_export_naming_custom_code_is_refused_without_running_it(tmp_path, rng, monkeypatch):
    """config.json's `auto_map` (with a model_type transformers does not know) names Python files of the
    folder: transformers asked on stdin whether to run them, and a "y" ran them. Refused, unasked."""
    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    ran = tmp_path / "ran"
    (tmp_path / "custom.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n"
                                        "from transformers import Qwen3Config, Qwen3ForCausalLM\n\n\n"
                                        "class CustomConfig(Qwen3Config):\n    model_type = 'custom_qwen3'\n\n\n"
                                        "class CustomModel(Qwen3ForCausalLM):\n    config_class = CustomConfig\n")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="custom_qwen3",
                  auto_map={"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")  # what a user at the prompt might answer
    with pytest.raises(ValueError, match="custom code"):
        kvpop_torch.load(tmp_path)
    assert not ran.exists()


def test_an_index_naming_a_shard_outside_the_export_is_refused(tmp_path, rng):
    """An untrusted index sent load_heads to read a file outside the folder as the scorers' shard."""
    from kvpop_torch.checkpoint import load_heads
    from safetensors.torch import load_file

    export = tmp_path / "export"
    kvpop_export(export, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    os.replace(export / "model.safetensors", tmp_path / "outside.safetensors")
    weight_map = {name: "../outside.safetensors" for name in load_file(tmp_path / "outside.safetensors")}
    (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for load in (load_heads, kvpop_torch.load):  # (transformers 5 refuses it too, in its own words)
        with pytest.raises(ValueError, match="shard '../outside.safetensors' is not a file name in"):
            load(export)
    (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "" for n in weight_map}}))
    with pytest.raises(ValueError, match="shard '' is not a file name in"):  # was the folder itself, opened
        load_heads(export)


def test_an_export_with_other_layers_or_integer_scorers_is_refused_by_name(tmp_path, rng):
    """A hostile num_hidden_layers (1e5) kept transformers building layers for minutes before it named a missing
    weight; scorer tensors stored as int8 or bool were cast to float by load_state_dict without a word."""
    from kvpop_torch.checkpoint import load_heads
    from safetensors.torch import load_file, save_file

    export = tmp_path / "export"
    kvpop_export(export, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    with pytest.raises(ValueError, match=r"does not match its config: config.json has num_hidden_layers=100000, "
                                         r"the weights hold 2 layers"):
        kvpop_torch.load(export)
    (export / "config.json").write_text(json.dumps(config))
    tensors = load_file(export / "model.safetensors")
    gone = sorted(n for n in tensors if n.startswith("model.layers.1.") and ".kvpop." not in n)  # 11 base weights
    save_file({n: t for n, t in tensors.items() if n not in gone}, export / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"does not match its config: missing \[{re.escape(repr(gone[0]))}.*\] and "
                                         rf"{len(gone) - 8} more, mismatched \[\], unexpected \[\]$"):
        kvpop_torch.load(export)  # (the whole list ran to 50 MB for 1e5 layers)
    scorer = next(name for name in tensors if ".self_attn.kvpop." in name and tensors[name].ndim > 1)
    for dtype in (torch.int8, torch.bool):
        save_file({**tensors, scorer: tensors[scorer].to(dtype)}, export / "model.safetensors",
                  metadata={"format": "pt"})
        with pytest.raises(ValueError, match=rf"KVpop tensor '{scorer}' is stored as {dtype}; expected a float"):
            load_heads(export)


def test_a_corrupt_weights_file_is_named(tmp_path, rng):
    import kvpop_torch
    from kvpop_torch.checkpoint import load_heads

    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    weights = os.path.join(tmp_path, "model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2])
    for load in (kvpop_torch.load, load_heads):
        with pytest.raises(ValueError, match=r"corrupt safetensors file '.*model.safetensors'"):
            load(tmp_path)


def test_generate_idioms_and_misuse(tmp_path, rng):
    kv = KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4)
    kvpop_export(tmp_path, BASE, kv, rng)
    ids = torch.as_tensor(rng.integers(0, BASE.vocab_size, size=(2, 12)))
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="kvpop").eval()
    with torch.no_grad():
        a = model.generate(ids, cache=KVpopCache.from_pretrained(tmp_path, model), **greedy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b = model.generate(ids, past_key_values=KVpopCache.from_pretrained(tmp_path, model), **greedy)
        # the name before transformers 5.24, deprecated from then on; before, the model's own (no warning)
        takes_cache = cache_argument(model) == "cache"
        assert any(issubclass(w.category, FutureWarning) for w in caught) == takes_cache
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        with pytest.raises(ValueError, match="needs a KVpopCache"):
            model(ids, use_cache=False)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        with pytest.raises(ValueError, match=r"unpadded prompts.*\(padding; row: zeros \{0: 3\}\)"):
            model.generate(ids, attention_mask=mask, cache=KVpopCache.from_pretrained(tmp_path, model), **greedy)
        # No mask passed: transformers makes one from pad_token_id, which the message says, with the way out.
        tokens = ids.clone()
        tokens[1, 4] = 0
        with pytest.raises(ValueError, match=r"zeros \{1: 1\}.*from pad_token_id.*attention_mask=torch.ones_like"):
            model.generate(tokens, cache=KVpopCache.from_pretrained(tmp_path, model), **greedy)
        model.generate(tokens, attention_mask=torch.ones_like(tokens),
                       cache=KVpopCache.from_pretrained(tmp_path, model), **greedy)
        # The KVpop attention does not read the mask: a direct forward, or generate given position_ids, ran on
        # the padding as tokens (logits identical to the unmasked run's).
        with pytest.raises(ValueError, match="this attention_mask has zeros"):
            model(ids, attention_mask=mask, cache=KVpopCache.from_pretrained(tmp_path, model))
        with pytest.raises(ValueError, match="this attention_mask has zeros"):
            model.generate(ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None].expand(2, -1),
                           cache=KVpopCache.from_pretrained(tmp_path, model), **greedy)
        model(ids, attention_mask=torch.ones_like(ids), cache=KVpopCache.from_pretrained(tmp_path, model))  # fine
        limit, model.config.max_position_embeddings = model.config.max_position_embeddings, 14
        with pytest.warns(UserWarning, match=r"past the model's max_position_embeddings \(14\).*reaches 15 tokens") \
                as caught:
            model.generate(ids, cache=KVpopCache.from_pretrained(tmp_path, model), **greedy)
        assert sum("max_position_embeddings" in str(w.message) for w in caught) == 1  # once, not per token
        # ... and at the caller's generate line, not at torch's module.py where the forward hook runs
        assert [w.filename for w in caught if "max_position_embeddings" in str(w.message)] == [__file__]
        model.config.max_position_embeddings = limit
        with pytest.raises(ValueError, match="use_cache=False with a KVpopCache"):  # was "already holds 12 tokens"
            model.generate(ids, cache=KVpopCache.from_pretrained(tmp_path, model), use_cache=False, **greedy)
        # Passed again with nothing new, generate() would feed no tokens.
        used = KVpopCache.from_pretrained(tmp_path, model)
        model.generate(ids[:, :3], cache=used, **greedy)
        with pytest.raises(ValueError, match=r"already holds a generation \(8 tokens\).*cache=make_cache\(\)"):
            model.generate(ids[:, :3], cache=used, **greedy)  # generate() feeds ids[:, 8:]: nothing
        with pytest.raises(ValueError, match="the prompt is empty"):
            model(ids[:, :0], cache=KVpopCache.from_pretrained(tmp_path, model))
        # Any other attention would silently ignore the mask.
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match="ignores the KVpop mask"):
            KVpopCache.from_pretrained(tmp_path, model)
        cache = KVpopCache.from_pretrained(tmp_path)  # no model to check: the first forward names it
        with pytest.raises(RuntimeError, match="did not apply the KVpop mask"):
            model(ids, cache=cache)


@pytest.mark.parametrize("base,options,_", CASES, ids=[f"{o['scorer']}-{i}" for i, (_, o, _) in enumerate(CASES)])
def test_a_multi_token_continuation_equals_one_token_calls_and_serves_a_multi_turn_generate(tmp_path, rng, base,
                                                                                            options, _):
    """Several new tokens on a started cache (a later chat turn, a chunked prompt), computed at once, give what
    one-token calls give: logits to float rounding, the same kept slots, constant memory; through turns longer
    than the window, the top-k and an mLSTM chunk, and sinks among the new tokens. So a second generate() on
    the conversation so far (transformers feeds only what the cache has not seen) continues it."""
    kvpop_export(tmp_path, base, KVpopConfig(mlstm_chunk=8, **options), rng)
    model, make_cache = kvpop_torch.load(tmp_path)
    ids = torch.as_tensor(rng.integers(1, base.vocab_size, size=(2, 40)))  # no 0: generate() below pads with 0
    for prompt_len, cuts in ((7, (9, 20, 21, 40)), (3, (5, 40)), (12, (13, 40)), (1, (5, 40))):
        one, chunked = make_cache(), make_cache()
        with torch.no_grad():
            want = [model(ids[:, :prompt_len], cache=one).logits]
            want += [model(ids[:, t : t + 1], cache=one).logits for t in range(prompt_len, 40)]
            got = [model(ids[:, :prompt_len], cache=chunked).logits]
            nbytes = chunked.nbytes
            for c0, c1 in zip((prompt_len,) + cuts[:-1], cuts):
                got.append(model(ids[:, c0:c1], cache=chunked).logits)
                assert chunked.nbytes == nbytes
        np.testing.assert_allclose(torch.cat(got, 1).numpy(), torch.cat(want, 1).numpy(), atol=1e-5, rtol=0)
        for layer, (x, y) in enumerate(zip(chunked.positions(), one.positions())):
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"prompt {prompt_len}, layer {layer}")
        for x, y in zip(chunked.layers, one.layers):  # the priorities (scores read at entry or when leaving), state
            torch.testing.assert_close(x.priority, y.priority, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(x.keys, y.keys, rtol=0, atol=1e-5)  # a layer above reads float-rounded inputs
            for a, c in zip(x.state or (), y.state or ()):  # two float32 summation orders (a chunk's matrix
                # product, one outer product per step): 2.9e-5 relative apart at most on an AMD EPYC's kernels
                torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
        assert chunked.get_seq_length() == one.get_seq_length() == 40
    greedy = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    chat = make_cache()
    with torch.no_grad():
        first = model.generate(ids[:, :12], cache=chat, **greedy)
        history = torch.cat([first, ids[:, 12:16]], dim=1)  # the next turn after the reply
        second = model.generate(history, cache=chat, **greedy)
        fresh = model.generate(history, cache=make_cache(), **greedy)
    torch.testing.assert_close(second, fresh, rtol=0, atol=0)


def test_a_started_cache_names_a_call_with_another_batch_size(tmp_path, rng):
    """A chat goes on with every row the cache holds: one row of a batch-2 conversation (or a doubled batch) is
    named, not a bare torch size error from inside the layer; the cache is left as it was, and a reset one takes
    any batch."""
    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    model, make_cache = kvpop_torch.load(tmp_path)
    ids = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, 12)))
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = make_cache()
    with torch.no_grad():
        out = model.generate(ids, cache=cache, **greedy)
        for history, rows in ((torch.cat([out[:1], ids[:1, :3]], 1), 1), (torch.cat([out, out]), 4)):
            with pytest.raises(ValueError, match=rf"this KVpopCache holds 2 rows and the call brings {rows}: go on"):
                model.generate(history, cache=cache, **greedy)
        history = torch.cat([out, ids[:, :3]], 1)
        ones = torch.ones_like(history)  # a 0 id in the history is a token here, not padding
        torch.testing.assert_close(model.generate(history, attention_mask=ones, cache=cache, **greedy),
                                   model.generate(history, attention_mask=ones, cache=make_cache(), **greedy),
                                   rtol=0, atol=0)
        cache.reset()
        torch.testing.assert_close(model(ids[:1], cache=cache).logits, model(ids[:1], cache=make_cache()).logits)


def test_a_later_turn_with_padding_in_its_mask_is_named(tmp_path, rng):
    """A batch-2 chat whose row 0 stopped at its EOS: transformers pads it with pad_token_id and, in the next
    generate, marks every pad id of the history as padding. A fresh cache refused that mask; the started one
    ignored it and read the pads as tokens. Now both name it, and a mask of ones goes on as a fresh cache does."""
    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    model, make_cache = kvpop_torch.load(tmp_path)
    ids = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, 12)))
    greedy = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        probe = model.generate(ids, cache=make_cache(), eos_token_id=None, **greedy)
        eos = int(probe[0, 13])  # row 0 stops at its second token; row 1 (unless it draws it too) goes on
        cache = make_cache()
        out = model.generate(ids, cache=cache, eos_token_id=eos, **greedy)
        assert out.shape[1] > 14 and (out[0, 14:] == 0).all()
        history = torch.cat([out, ids[:, :3]], 1)
        for c in (make_cache(), cache):
            with pytest.raises(ValueError, match="attention_mask .*has zeros"):
                model.generate(history, cache=c, eos_token_id=eos, **greedy)
        go_on = dict(attention_mask=torch.ones_like(history), eos_token_id=eos, **greedy)
        torch.testing.assert_close(model.generate(history, cache=cache, **go_on),
                                   model.generate(history, cache=make_cache(), **go_on), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["demo-kvpop-mlstm", "demo-teacher"])
def test_greedy_generate_on_demo_exports_matches_eval_generate(capsys, name):
    """The shipped exports: transformers + kvpop_torch give the tokens `python -m eval.main generate` prints."""
    from demo import task as demo_task
    from kvpop_jax.checkpoint import checkpoint_tokenizer

    directory = os.path.join(REPO, "checkpoints", name)
    example = demo_task.generate_example(demo_task.example_seed(0, "test", 3), seq_len=384)
    prompt = checkpoint_tokenizer(directory)(example["prompt"])["input_ids"]
    eval_main.main(["generate", "--checkpoint", directory, "--prompt_ids", ",".join(map(str, prompt)),
                    "--max_new_tokens", "24", "--temperature", "0"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("generated ids:"))
    want = [int(t) for t in line.split(":", 1)[1].strip(" []").split(",") if t.strip()]

    model, make_cache = kvpop_torch.load(directory)
    cache = make_cache()
    assert isinstance(cache, KVpopCache) == (name == "demo-kvpop-mlstm")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=24, do_sample=False,
                             eos_token_id=model.config.eos_token_id, pad_token_id=0)
    got = out[0, len(prompt):].tolist()
    assert len(prompt) > 123 and len(want) > 3
    assert got[: len(want)] == want and (len(got) == len(want) or got[len(want)] == 0)


def test_eval_generate_stops_where_transformers_generate_stops(tmp_path, capsys):
    """A generation_config.json naming a second EOS id (as Qwen3's does): transformers' `generate` stops
    there, and so does `python -m eval.main generate` (it read config.json's eos_token_id only)."""
    import shutil

    from demo import task as demo_task
    from kvpop_jax.checkpoint import checkpoint_tokenizer

    directory = str(tmp_path / "teacher")
    shutil.copytree(os.path.join(REPO, "checkpoints", "demo-teacher"), directory)
    example = demo_task.generate_example(demo_task.example_seed(0, "test", 5), seq_len=384)
    prompt = checkpoint_tokenizer(directory)(example["prompt"])["input_ids"]

    def cli():
        eval_main.main(["generate", "--checkpoint", directory, "--prompt_ids", ",".join(map(str, prompt)),
                        "--max_new_tokens", "16", "--temperature", "0"])
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("generated ids:"))
        return [int(t) for t in line.split(":", 1)[1].strip(" []").split(",") if t.strip()]

    free = cli()
    stop = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, free[stop]], "pad_token_id": 0}, f)
    want = cli()
    model, make_cache = kvpop_torch.load(directory)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), cache=make_cache(), max_new_tokens=16, do_sample=False)
    assert out[0, len(prompt):].tolist() == want == free[: stop + 1]


def test_rope_is_read_as_transformers_reads_it_and_weights_come_from_one_place(tmp_path, rng):
    """The unrotated-key scorer undoes RoPE with the base transformers uses (rope_parameters' rope_theta before
    the top-level one), a legacy {"type": ...} scaling is refused like {"rope_type": ...}, and a folder holding
    both weight layouts is refused (transformers takes the model from model.safetensors, the heads would come
    from the shards)."""
    import json
    import shutil

    import kvpop_torch
    from kvpop_torch.checkpoint import load_heads

    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlstm", sinks=1, window=3, topk=4, scorer_keys="unrotated"), rng)
    path = os.path.join(tmp_path, "config.json")
    config = json.load(open(path))
    json.dump({**config, "rope_theta": 123.0, "rope_parameters": {"rope_type": "default", "rope_theta": 4567.0}},
              open(path, "w"))
    assert load_heads(tmp_path)[1][0].rope_theta == 4567.0
    json.dump({**config, "rope_scaling": {"type": "linear", "factor": 2.0}}, open(path, "w"))
    with pytest.raises(ValueError, match="config.json's rope_scaling has rope_type 'linear'"):
        load_heads(tmp_path)
    # num_key_value_heads: null is one KV head per head in transformers and in kvpop_jax: here 4, where the
    # export's heads were made for 2, so the heads' tensors no longer fit (it was read as 2, silently)
    json.dump({**config, "num_key_value_heads": None}, open(path, "w"))
    with pytest.raises(ValueError, match="(?s)do not fit its config.json's kvpop settings.*torch.Size\\(\\[4\\]\\)"):
        load_heads(tmp_path)
    # no head_dim: transformers builds the attention at its default, 128 (not hidden // heads, 8 here), and so do the
    # heads now; an export made at 128 whose config.json lost it did not load (tensors for 128, heads for 8)
    wide = tmp_path / "wide"
    kvpop_export(wide, dataclasses.replace(BASE, head_dim=128), KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4),
                 rng)
    want = [h.state_dict() for h in load_heads(wide)[1]]
    json.dump({k: v for k, v in json.load(open(wide / "config.json")).items() if k != "head_dim"},
              open(wide / "config.json", "w"))
    for a, b in zip(want, [h.state_dict() for h in load_heads(wide)[1]]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    json.dump(config, open(path, "w"))
    weights = os.path.join(tmp_path, "model.safetensors")
    shutil.copy(weights, os.path.join(tmp_path, "model-00001-of-00001.safetensors"))
    from safetensors import safe_open
    with safe_open(weights, framework="numpy") as f:
        index = {"weight_map": {n: "model-00001-of-00001.safetensors" for n in f.keys()}}
    json.dump(index, open(os.path.join(tmp_path, "model.safetensors.index.json"), "w"))
    for load in (kvpop_torch.load, load_heads):
        with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
            load(tmp_path)



@pytest.mark.parametrize("scorer,bias_name", [("mlp", "b2"), ("mlstm", "b")])
def test_a_continuation_with_tied_scores_after_reorder_and_reset_equals_one_token_calls(tmp_path, rng, scorer,
                                                                                       bias_name):
    """Exact ties (a scorer with zero weights and a bias so large that `- t log γ` rounds away: every priority
    equal, so the smaller position wins), rows reordered as beam search does, and a reset cache started by a
    one-token prompt: a multi-token call still keeps what one-token calls keep, in the same slots."""
    kvpop_export(tmp_path, BASE, KVpopConfig(scorer=scorer, sinks=1, window=3, topk=4, mlstm_chunk=8), rng)
    model, make_cache = kvpop_torch.load(tmp_path)
    heads = make_cache().layers  # the heads are shared by every cache of the export
    for layer in heads:
        for param in layer.head.scorer.parameters():
            param.data.zero_()
        getattr(layer.head.scorer, bias_name).data.fill_(1e7)
    ids0 = torch.as_tensor(rng.integers(0, BASE.vocab_size, size=(3, 30)))
    beams = torch.tensor([2, 0, 0])

    def run(chunked):
        cache, logits, kept = make_cache(), [], []
        with torch.no_grad():
            for prompt_len, cuts in ((5, (12, 30)), (1, (2, 30))):
                cache.reset()
                ids = ids0
                logits.append(model(ids[:, :prompt_len], cache=cache).logits)
                for c0, c1 in zip((prompt_len,) + cuts[:-1], cuts):
                    steps = [(c0, c1)] if chunked else [(t, t + 1) for t in range(c0, c1)]
                    logits += [model(ids[:, a:b], cache=cache).logits for a, b in steps]
                    if prompt_len == 5 and c1 == cuts[0]:  # beam search reorders the rows between calls
                        cache.reorder_cache(beams)
                        ids = ids[beams]
                kept.append([x.clone() for x in cache.positions()])
                lr = cache.layers[0].priority[..., 4:][cache.layers[0].pos[..., 4:] >= 0]
                assert (lr == lr[0]).all()  # the ties are real
        return torch.cat(logits, 1).numpy(), kept

    (got, got_kept), (want, want_kept) = run(True), run(False)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for a, b in zip(got_kept, want_kept):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_started_cache_refuses_an_input_that_does_not_continue_its_conversation(tmp_path, rng):
    """generate() on a started cache reads ids[:, held:] as the continuation of what the cache holds. A new prompt
    passed with a used cache was answered silently from a conversation nobody wrote (the old one plus a tail of the
    new prompt) unless it was at most half as long as the cache's; now any input that is not the held
    conversation with new tokens appended is named, and a true continuation still equals a fresh cache's."""
    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlp", sinks=1, window=3, topk=4), rng)
    model, make_cache = kvpop_torch.load(tmp_path)
    greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    a = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, 12)))
    with torch.no_grad():
        for first_new, length in ((1, 12), (3, 12), (6, 10), (6, 30)):  # held 12 / 14 / 17 / 17 tokens
            cache = make_cache()
            model.generate(a, cache=cache, max_new_tokens=first_new, **greedy)
            b = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, length)))
            held = 12 + first_new - 1
            message = (rf"already holds a generation \({held} tokens\) and the input has {length}" if length <= held
                       else rf"does not continue the conversation.*tokens {held - min(held, 64)}\.\.{held - 1} differ")
            with pytest.raises(ValueError, match=message + r".*cache=make_cache\(\)"):
                model.generate(b, cache=cache, max_new_tokens=2, **greedy)
        # One row changed in the history is named by its row; the cache is untouched by the refused call.
        cache = make_cache()
        out = model.generate(a, cache=cache, max_new_tokens=4, **greedy)
        history = torch.cat([out, a[:, :3]], 1)
        wrong = history.clone()
        wrong[1, 5] = (wrong[1, 5] + 1) % BASE.vocab_size
        with pytest.raises(ValueError, match=r"differ from the ones the cache read \(rows \[1\]\)"):
            model.generate(wrong, cache=cache, max_new_tokens=2, **greedy)
        torch.testing.assert_close(model.generate(history, cache=cache, max_new_tokens=2, **greedy),
                                   model.generate(history, cache=make_cache(), max_new_tokens=2, **greedy),
                                   rtol=0, atol=0)
        # Read from embeddings, the ids are unknown: only the length is checked.
        cache = make_cache()
        model(inputs_embeds=model.get_input_embeddings()(a), cache=cache)
        assert not cache.read_ids_known
        model.generate(torch.cat([a, a[:, :2]], 1), cache=cache, max_new_tokens=1, **greedy)
        cache.reset()
        assert cache.read_tail is None and cache.read_ids_known
    # The checked generate is bound to its model: a copy generates with its own weights, not the original's.
    fork = copy.deepcopy(model)
    assert fork.generate.__self__ is fork and model.generate.__self__ is model


def test_a_cache_filled_under_inference_mode_goes_on_outside_it(tmp_path, rng):
    """A first turn under torch.inference_mode() and the next under no_grad (or the other way round, or a reset
    outside it): torch forbids in-place writes to inference tensors outside inference mode, and the cache's slot
    writes failed there; DynamicCache goes on. Each continuation equals a fresh cache's."""
    kvpop_export(tmp_path, BASE, KVpopConfig(scorer="mlstm", sinks=1, window=3, topk=4, mlstm_chunk=4), rng)
    model, make_cache = kvpop_torch.load(tmp_path)
    ids = torch.as_tensor(rng.integers(1, BASE.vocab_size, size=(2, 12)))
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    for first, then in ((torch.inference_mode, torch.no_grad), (torch.no_grad, torch.inference_mode)):
        cache = make_cache()
        with first():
            history = torch.cat([model.generate(ids, cache=cache, **greedy), ids[:, :3]], 1)
        with then():
            got = model.generate(history, cache=cache, **greedy)
        with torch.no_grad():
            torch.testing.assert_close(got, model.generate(history, cache=make_cache(), **greedy), rtol=0, atol=0)
    with torch.inference_mode():
        cache = make_cache()
        model(ids, cache=cache)
    cache.reset()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cache=cache).logits, model(ids, cache=make_cache()).logits)


def test_a_base_qwen3model_checkpoint_with_tied_embeddings_still_loads(tmp_path):
    """transformers loads a base `Qwen3Model`'s weights (`layers.0....`, no `model.` prefix) into the causal LM,
    and a tied one needs no lm_head: the layer count before loading read its layers as 0 and refused it."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3Config(**TINY_HF_CONFIGS["g1_tied"])
    transformers.Qwen3Model(hf).save_pretrained(tmp_path)
    model, make_cache = kvpop_torch.load(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits
        np.testing.assert_allclose(model(ids, cache=make_cache()).logits, want, rtol=1e-5, atol=1e-5)
