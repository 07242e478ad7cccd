"""Flax Qwen3 == transformers' torch Qwen3, and cached decoding == the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import TINY_HF_CONFIGS
from kvpop_jax import Qwen3Config, load_pretrained
from kvpop_jax.cache import init_dense_cache
from kvpop_jax.modeling import MLP, Qwen3ForCausalLM, init_params


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


@pytest.mark.parametrize("name", sorted(TINY_HF_CONFIGS))
def test_logits_match_transformers(hf_checkpoint, rng, name):
    path, torch_model = hf_checkpoint(name)
    config, params = load_pretrained(path)
    ids = rng.integers(0, config.vocab_size, size=(2, 23))
    ours = Qwen3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids)).logits
    ref = torch_logits(torch_model, ids)
    assert ours.shape == ref.shape == (2, 23, config.vocab_size)
    assert np.abs(ref).max() > 1.0  # the weights are not degenerate
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


def test_positions_and_rope_theta_matter(hf_checkpoint, rng):
    """A wrong theta or shifted positions must change the logits (the parity test can fail)."""
    path, torch_model = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(1, 16)))
    model = Qwen3ForCausalLM(config)
    base = model.apply({"params": params}, ids).logits
    other_theta = Qwen3ForCausalLM(Qwen3Config(**{**config.__dict__, "rope_theta": 10_000.0}))
    assert np.abs(np.asarray(other_theta.apply({"params": params}, ids).logits - base)).max() > 1e-3
    # RoPE is relative: a uniform shift changes nothing, stretched positions must.
    shifted = model.apply({"params": params}, ids, positions=jnp.arange(16)[None] + 5).logits
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(base), atol=1e-4)
    stretched = model.apply({"params": params}, ids, positions=2 * jnp.arange(16)[None]).logits
    assert np.abs(np.asarray(stretched - base)).max() > 1e-3


def test_tied_head_is_shared_not_copied(hf_checkpoint):
    path, _ = hf_checkpoint("g1_tied")
    config, params = load_pretrained(path)
    assert config.tie_word_embeddings and "lm_head" not in params
    ids = jnp.arange(8)[None] % config.vocab_size
    model = Qwen3ForCausalLM(config)
    bumped = jax.tree_util.tree_map(lambda x: x, params)
    bumped["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"].at[3].add(1.0)
    a = model.apply({"params": params}, ids).logits
    b = model.apply({"params": bumped}, ids).logits
    # Token 3 was not in the input at position 0, but its logit column moved: the head reads the embedding.
    assert np.abs(np.asarray(a[0, 0, 3] - b[0, 0, 3])) > 1e-4


@pytest.mark.parametrize("name", ["g2_untied", "g4_bias"])
def test_cached_decode_equals_full_forward(hf_checkpoint, rng, name):
    path, _ = hf_checkpoint(name)
    config, params = load_pretrained(path)
    model = Qwen3ForCausalLM(config)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 19)))
    full = model.apply({"params": params}, ids).logits
    cache = init_dense_cache(config, batch=2, max_len=32)
    prompt = 7
    out = model.apply({"params": params}, ids[:, :prompt], cache=cache)
    steps = [out.logits]
    cache = out.cache
    step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c, method=Qwen3ForCausalLM.decode_step))
    for t in range(prompt, ids.shape[1]):
        out = step(cache, ids[:, t : t + 1])
        cache = out.cache
        steps.append(out.logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=1e-4, rtol=0)
    assert int(cache.length) == ids.shape[1]


def test_segment_ids_reset_attention(rng):
    config = Qwen3Config(**{k: v for k, v in TINY_HF_CONFIGS["g2_untied"].items()})
    params = init_params(config, jax.random.key(0))
    model = Qwen3ForCausalLM(config)
    a = jnp.asarray(rng.integers(0, config.vocab_size, size=(1, 6)))
    b = jnp.asarray(rng.integers(0, config.vocab_size, size=(1, 5)))
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.asarray([[0] * 6 + [1] * 5])
    pos = jnp.asarray([list(range(6)) + list(range(5))])
    out = model.apply({"params": params}, packed, positions=pos, segment_ids=seg).logits
    alone = model.apply({"params": params}, b).logits
    np.testing.assert_allclose(np.asarray(out[:, 6:]), np.asarray(alone), atol=1e-5)
    unreset = model.apply({"params": params}, packed, positions=pos).logits
    assert np.abs(np.asarray(unreset[:, 6:] - alone)).max() > 1e-4


def test_bf16_forward_runs_and_is_close(hf_checkpoint, rng):
    path, torch_model = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path, dtype=jnp.bfloat16)
    assert params["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    ids = rng.integers(0, config.vocab_size, size=(1, 12))
    ours = Qwen3ForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16).apply(
        {"params": params}, jnp.asarray(ids)
    ).logits
    ref = torch_logits(torch_model, ids)
    assert np.abs(np.asarray(ours) - ref).max() < 0.25 * np.abs(ref).max()


def test_mlp_on_token_rows_equals_the_swiglu_of_its_kernels_with_gradients(rng):
    """The MLP runs its products on [B * S, E] rows (a CPU layout fast path): its output and every gradient
    equal a plain SwiGLU over [B, S, E] written with the same kernels, and the parameters keep HF's names."""
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    x = jnp.asarray(rng.normal(size=(3, 7, config.hidden_size)), jnp.float32)
    mlp = MLP(config)
    params = mlp.init(jax.random.key(1), x)["params"]
    assert {k: v["kernel"].shape for k, v in params.items()} == {
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size)}
    cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def reference(p, x):
        gate = jnp.einsum("bse,ef->bsf", x, p["gate_proj"]["kernel"])
        up = jnp.einsum("bse,ef->bsf", x, p["up_proj"]["kernel"])
        return jnp.einsum("bsf,fe->bse", jax.nn.silu(gate) * up, p["down_proj"]["kernel"])

    ours, ours_vjp = jax.vjp(lambda p, x: mlp.apply({"params": p}, x), params, x)
    ref, ref_vjp = jax.vjp(reference, params, x)
    assert ours.shape == x.shape
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(ours_vjp(cotangent)), jax.tree.leaves(ref_vjp(cotangent))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
