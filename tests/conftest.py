"""Test set-up: CPU only, float32 matmuls at full precision, fresh RNG per test."""

import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh (never zeros), reproducible."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


# Tiny Qwen3 configs covering GQA group sizes 1/2/4, tied and untied heads, two rope
# thetas, head_dim != hidden/heads and attention biases.
TINY_HF_CONFIGS = {
    "g1_tied": dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, rope_theta=10_000.0,
                    tie_word_embeddings=True),
    "g2_untied": dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0,
                      tie_word_embeddings=False),
    "g4_bias": dict(vocab_size=89, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=500_000.0,
                    tie_word_embeddings=False, attention_bias=True),
}


def make_hf_checkpoint(path, seed: int = 0, **overrides):
    """Saves a random HF Qwen3ForCausalLM to `path` and returns the torch model.

    Weights are re-drawn with a larger scale than HF's init (std 0.02 gives near-constant
    logits, which would let a wrong implementation pass), norms away from 1.
    """
    import torch
    import transformers

    kwargs = dict(TINY_HF_CONFIGS["g2_untied"], max_position_embeddings=512)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(name="g2_untied", **overrides) -> (dir, torch model)."""

    def make(name: str = "g2_untied", seed: int = 0, **overrides):
        path = tmp_path / f"hf_{name}_{seed}"
        model = make_hf_checkpoint(path, seed=seed, **{**TINY_HF_CONFIGS[name], **overrides})
        return str(path), model

    return make
