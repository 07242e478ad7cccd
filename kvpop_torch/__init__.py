"""KVpop exports in PyTorch `transformers`: the bounded per-KV-head cache, the scorers, the "kvpop" attention.

Needs only torch, transformers and safetensors (never kvpop_jax or jax):

    import kvpop_torch
    model, make_cache = kvpop_torch.load("exports/my-kvpop-model")
    out = model.generate(ids, cache=make_cache(), max_new_tokens=64, do_sample=False)

Importing the package registers the "kvpop" attention implementation with transformers.
"""

from kvpop_torch.attention import ATTENTION_NAME, kvpop_attention
from kvpop_torch.cache import KVpopCache, KVpopLayer
from kvpop_torch.config import KVpopSettings, read_settings
from kvpop_torch.checkpoint import load_heads
from kvpop_torch.loading import load
from kvpop_torch.scorers import KVpopHead, LinearScorer, MLPScorer, MLSTMScorer

__all__ = ["ATTENTION_NAME", "KVpopCache", "KVpopHead", "KVpopLayer", "KVpopSettings", "LinearScorer",
           "MLPScorer", "MLSTMScorer", "kvpop_attention", "load", "load_heads", "read_settings"]
