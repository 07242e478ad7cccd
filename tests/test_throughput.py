"""train/throughput.py's FLOP count and peak table (its run is exercised by tests/test_bench_gpu.py)."""

import dataclasses

import pytest

from kvpop_jax.config import Qwen3Config
from train.config import resolve_model_config
from train.throughput import matmul_params, model_flops_per_token, peak_flops


def test_matmul_params_match_qwen3_8b():
    """Qwen3-8B: 6.95B non-embedding parameters (its model card) + the untied lm_head 151936 x 4096."""
    config = Qwen3Config.from_hf(resolve_model_config("qwen3_8b"))
    assert matmul_params(config) == pytest.approx(6.95e9 + 151936 * 4096, rel=0.01)
    four = dataclasses.replace(config, num_hidden_layers=4)
    assert matmul_params(four) == pytest.approx(4 / 36 * 6.95e9 + 151936 * 4096, rel=0.01)


def test_model_flops_per_token():
    config = Qwen3Config.from_hf(resolve_model_config("qwen3_8b"))
    n = matmul_params(config)
    attention = 8 * 36 * 32 * 128 * 16384  # 8·L·Hq·D·S
    assert model_flops_per_token(config, 16384) == pytest.approx(8 * n + attention)


def test_peak_flops_by_device_kind():
    assert peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_flops("cpu") is None
