"""Test set-up: CPU only, float32 matmuls at full precision, fresh RNG per test."""

import os
import zlib

if os.environ.get("KVPOP_KERNEL_TESTS") != "native":  # native: the kernel tests on a GPU (bench gpu)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import TINY_ARCH, TINY_HF_CONFIGS, make_hf_checkpoint  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh (never zeros), reproducible."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(name="g2_untied", **overrides) -> (dir, torch model)."""

    def make(name: str = "g2_untied", seed: int = 0, **overrides):
        path = tmp_path / f"hf_{name}_{seed}"
        model = make_hf_checkpoint(path, seed=seed, **{**TINY_HF_CONFIGS[name], **overrides})
        return str(path), model

    return make


@pytest.fixture
def arch(tmp_path):
    path = tmp_path / "tiny_arch.json"
    path.write_text(json.dumps(TINY_ARCH))
    return str(path)
