"""eval/diagnose.py: the pieces its tables are computed from, against the model's own cache."""

import jax
import jax.numpy as jnp
import numpy as np

from helpers import TINY_HF_CONFIGS
from eval.diagnose import _auc, project_qkv
from kvpop_jax import Qwen3Config
from kvpop_jax.cache import init_dense_cache
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params


def test_project_qkv_is_what_the_dense_cache_holds(rng):
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(4))
    ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 9)))
    cache = Qwen3ForCausalLM(config).apply({"params": params}, ids, cache=init_dense_cache(config, 2, 9)).cache
    for layer in range(config.num_hidden_layers):
        _, k, v = project_qkv(config, params, ids, layer)  # [B, S, Hkv, D]; the cache is [B, Hkv, T, D]
        np.testing.assert_allclose(np.swapaxes(np.asarray(k), 1, 2), np.asarray(cache.layers[layer].k),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.swapaxes(np.asarray(v), 1, 2), np.asarray(cache.layers[layer].v),
                                   rtol=1e-5, atol=1e-5)


def test_auc_counts_pairs_ranked_right(rng):
    ranks = rng.permutation(12)[None].astype(float)  # one head; lower rank = kept first
    needed, others = [0, 3, 5], [1, 2, 4, 6, 7, 8, 9, 10, 11]
    brute = np.mean([ranks[0, n] < ranks[0, o] for n in needed for o in others])
    np.testing.assert_allclose(_auc(ranks, needed, others)[0], brute)
