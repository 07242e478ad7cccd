"""kvpop-jax: KVpop (KV cache compression with Predictive Online Pruning) for Qwen3 in JAX."""

from kvpop_jax.checkpoint import load_pretrained, save_pretrained
from kvpop_jax.config import KVpopConfig, Qwen3Config

__all__ = ["KVpopConfig", "Qwen3Config", "load_pretrained", "save_pretrained"]
__version__ = "0.1.0"
