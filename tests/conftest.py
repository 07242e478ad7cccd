"""Test set-up: CPU only, float32 matmuls at full precision, fresh RNG per test."""

import os
import zlib

if os.environ.get("KVPOP_KERNEL_TESTS") != "native":  # native: the kernel tests on a GPU (bench gpu)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _fast_compile_xla_flags() -> None:
    """Ask XLA:CPU to compile fast rather than run fast. tests/test_cache.py spends 80% of its
    time in XLA compiles (hundreds of small programs per test, each run on a few tokens); LLVM at
    -O0 with the elemental fusion emitter compiles about twice as fast (its
    test_mlstm_variants_decode_equals_masked_forward: 22.1 -> 7.8 s of compile; the suite on a
    clean clone 1352 -> 668 s, BENCHMARKS.md stop 40). No fast-math, but results may differ from
    XLA's defaults in the last bits (no FMA contraction at -O0, another tanh); CI's run 2 runs at
    the defaults. -O0 also reaches XLA's GPU compiler, so `compat.compile_for_gpu` (the H100
    compile checks) pins -O3 for itself. An XLA that does not know a flag aborts at start-up, so
    the flags are tried once in a subprocess; the answer reaches the xdist workers through the
    environment, and the session header prints it. KVPOP_TEST_XLA_FLAGS=0 (or a user's own
    XLA_FLAGS naming either flag) keeps XLA's defaults."""
    if os.environ.get("KVPOP_TEST_XLA_FLAGS") in ("0", "checked"):
        return
    os.environ["KVPOP_TEST_XLA_FLAGS"] = "checked"
    flags = ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
    current = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAX_PLATFORMS") != "cpu" or any(f.split("=")[0] in current for f in flags):
        return
    import subprocess
    import sys

    def known(candidate: list[str]) -> bool | None:  # None: the probe itself did not answer
        env = dict(os.environ, XLA_FLAGS=" ".join([current, *candidate]).strip())
        try:
            return subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
                                  env=env, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return None

    # jaxlib 0.12 dropped the fusion-emitter flag: keep whichever flags this XLA knows
    both = known(flags)
    if both is None:  # no answer in 2 minutes: XLA's defaults, without probing again
        return
    kept = flags if both else [f for f in flags if known([f])]
    if kept:
        os.environ["XLA_FLAGS"] = " ".join([current, *kept]).strip()


_fast_compile_xla_flags()

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import TINY_ARCH, TINY_HF_CONFIGS, make_hf_checkpoint  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_report_header(config):
    return f"XLA_FLAGS: {os.environ.get('XLA_FLAGS') or '(none)'} (tests/conftest.py; KVPOP_TEST_XLA_FLAGS=0: defaults)"


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
