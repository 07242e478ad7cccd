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
