"""HF safetensors import/export: round trips and every error with its message."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import traverse_util

from kvpop_jax import Qwen3Config, load_pretrained, save_pretrained
from kvpop_jax.modeling import Qwen3ForCausalLM


def _flat(params):
    return traverse_util.flatten_dict(jax.device_get(params), sep="/")


@pytest.mark.parametrize("name", ["g1_tied", "g4_bias"])
def test_export_loads_in_transformers_with_same_logits(hf_checkpoint, tmp_path, rng, name):
    path, torch_model = hf_checkpoint(name)
    config, params = load_pretrained(path)
    out = tmp_path / "exported"
    save_pretrained(config, params, out)
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()
    ids = rng.integers(0, config.vocab_size, size=(2, 13))
    with torch.no_grad():
        a = torch_model(torch.tensor(ids)).logits.numpy()
        b = reloaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
    ours = Qwen3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids)).logits
    np.testing.assert_allclose(np.asarray(ours), b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_load_save_load_is_bit_identical(hf_checkpoint, tmp_path, dtype):
    path, _ = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path, dtype=dtype)
    save_pretrained(config, params, tmp_path / "a")
    config2, params2 = load_pretrained(tmp_path / "a", dtype=dtype)
    assert config2 == config
    a, b = _flat(params), _flat(params2)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == dtype
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_sharded_save_and_load(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    save_pretrained(config, params, tmp_path / "s", max_shard_bytes=20_000)
    files = sorted(os.listdir(tmp_path / "s"))
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    _, params2 = load_pretrained(tmp_path / "s")
    for k, v in _flat(params).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(_flat(params2)[k]))
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "s")
    assert reloaded.config.num_hidden_layers == config.num_hidden_layers


def test_config_validation_and_from_hf_errors(tmp_path):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=3, num_key_value_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="divisible by num_key_value_heads.*3 heads and 2 kv heads"):
        Qwen3Config(**base)
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        Qwen3Config(**{**base, "num_attention_heads": 2, "hidden_size": 0})
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        Qwen3Config.from_hf({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        Qwen3Config.from_hf({**base, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="unsupported rope_parameters type 'linear'"):
        Qwen3Config.from_hf({**base, "num_attention_heads": 2, "rope_parameters": {"rope_type": "linear"}})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Qwen3Config.from_hf(tmp_path)


def test_missing_directory_config_and_weights(tmp_path, hf_checkpoint):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(empty)
    path, _ = hf_checkpoint("g2_untied")
    os.unlink(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no weights in"):
        load_pretrained(path)


def test_pickles_are_refused(tmp_path, hf_checkpoint):
    path, model = hf_checkpoint("g2_untied")
    os.unlink(os.path.join(path, "model.safetensors"))
    torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"pickle weights \['pytorch_model.bin'\].*safe_serialization=True"):
        load_pretrained(path)


def test_missing_unexpected_and_shape_mismatch(tmp_path, hf_checkpoint):
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("g2_untied")
    weights = load_file(os.path.join(path, "model.safetensors"))
    fn = os.path.join(path, "model.safetensors")

    w = dict(weights)
    del w["model.layers.1.mlp.up_proj.weight"]
    w["model.layers.1.mlp.extra.weight"] = np.ones(3, np.float32)
    save_file(w, fn)
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected tensors \['model.layers.1.mlp.extra.weight'\]"):
        load_pretrained(path)

    w = dict(weights)
    w["model.layers.0.self_attn.k_proj.weight"] = np.ones((32, 48), np.float32)
    save_file(w, fn)
    with pytest.raises(ValueError, match=r"shape mismatch for tensor 'model.layers.0.self_attn.k_proj.weight': "
                                         r"expected \(64, 48\) from config.json, got \(32, 48\)"):
        load_pretrained(path)


def test_corrupt_header_and_index(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("g2_untied")
    fn = os.path.join(path, "model.safetensors")
    with open(fn, "r+b") as f:
        f.seek(8)
        f.write(b"{garbage!!")
    with pytest.raises(ValueError, match="corrupt safetensors file"):
        load_pretrained(path)
    os.unlink(fn)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors.*does not exist"):
        load_pretrained(path)
