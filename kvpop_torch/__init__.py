"""KVpop exports in PyTorch `transformers`: the bounded per-KV-head cache, the scorers, the "kvpop" attention.

Needs only torch, transformers and safetensors (never kvpop_jax or jax):

    import kvpop_torch
    model, make_cache = kvpop_torch.load("exports/my-kvpop-model")
    out = model.generate(ids, cache=make_cache(), max_new_tokens=64, do_sample=False)

Importing the package registers the "kvpop" attention implementation with transformers. It needs
transformers >= 5.24, whose attention layers hand the cache the attention call's kwargs (the channel the KVpop
mask takes) and whose `generate` takes `cache=`; an older one is refused on import, by version.
"""

import re

import transformers

MIN_TRANSFORMERS = (5, 24)


def check_transformers_version(version: str) -> None:
    """Raises ImportError, naming the version and the fix, for a transformers older than MIN_TRANSFORMERS."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(map(int, found.groups())) < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"kvpop_torch needs transformers >= {need} (its Qwen3 attention hands the cache the "
                          f"attention call's kwargs, where the KVpop mask goes; older ones call the cache without "
                          f"them), found {version}: pip install -U 'transformers>={need}'")


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
