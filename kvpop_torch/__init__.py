"""KVpop exports in PyTorch `transformers`: the bounded per-KV-head cache, the scorers, the "kvpop" attention.

Needs only torch, transformers and safetensors (never kvpop_jax or jax):

    import kvpop_torch
    model, make_cache = kvpop_torch.load("exports/my-kvpop-model")
    out = model.generate(ids, cache=make_cache(), max_new_tokens=64, do_sample=False)

Importing the package registers the "kvpop" attention implementation with transformers. It needs
transformers >= 4.56, the first whose `Cache` is a list of `CacheLayerMixin` layers built by the caller
(`Cache(layers=[...])`; 4.55 builds its own from `layer_classes`); an older one is refused on import, by
version. The KVpop mask rides on the keys the cache returns (`attention.with_mask`), which every one of them
hands to the attention unchanged. A model from `load` or `KVpopCache.from_pretrained(d, model)` takes the
cache as `cache=` (the name from 5.24 on) on all of them, and as `past_key_values=` (deprecated from 5.24).
"""

import re

import transformers

MIN_TRANSFORMERS = (4, 56)


def check_transformers_version(version: str) -> None:
    """Raises ImportError, naming the version and the fix, for a transformers older than MIN_TRANSFORMERS."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(map(int, found.groups())) < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"kvpop_torch needs transformers >= {need} (a Cache built from its own CacheLayerMixin "
                          f"layers, Cache(layers=[...]); older ones build their layers from classes), found "
                          f"{version}: pip install -U 'transformers>={need}'")


check_transformers_version(transformers.__version__)

from kvpop_torch.attention import ATTENTION_NAME, kvpop_attention  # noqa: E402 (after the version check)
from kvpop_torch.cache import KVpopCache, KVpopLayer  # noqa: E402
from kvpop_torch.config import KVpopSettings, read_settings  # noqa: E402
from kvpop_torch.checkpoint import load_heads  # noqa: E402
from kvpop_torch.loading import load  # noqa: E402
from kvpop_torch.scorers import KVpopHead, LinearScorer, MLPScorer, MLSTMScorer  # noqa: E402

__all__ = ["ATTENTION_NAME", "MIN_TRANSFORMERS", "KVpopCache", "KVpopHead", "KVpopLayer", "KVpopSettings",
           "LinearScorer", "MLPScorer", "MLSTMScorer", "check_transformers_version", "kvpop_attention", "load",
           "load_heads", "read_settings"]
