"""Training-free KV cache policies at a fixed budget B: StreamingLLM, TOVA, H2O (and dense).

All policies share one cache layout and two pure functions (no parameters):

  prefill(cfg, q, k, v, positions) -> (out, layer cache)       dense causal attention over the
      prompt (the baselines compress the cache, not the prompt pass), then a one-shot
      compression of the prompt to B tokens by the policy's rule (StreamingLLM with
      `banded_prefill`: the banded attention a token-by-token read of the prompt would do).
  decode(cfg, layer_cache, q_tok, k_tok, v_tok, position) -> (out, layer cache)
      the new token attends to the cache plus itself (B + 1 candidates), then one candidate
      is evicted so the cache stays at B.

Rules (the candidates that may be evicted are never the `sinks` first positions nor the
`recent` newest ones; among the others the lowest key goes, ties: the earlier position):

  streaming  StreamingLLM: sinks + the B - s newest tokens (key = position).
  tova       TOVA ("Transformers are Multi-State RNNs"): key = the current query's attention
             weight, averaged over *all* query heads of the layer, so one token is evicted per
             layer and every KV head holds the same positions. Prefill: the last prompt query.
             Defaults: no sinks, no protected window (the new token itself may be evicted).
  h2o        H2O: key = attention accumulated over every query seen so far (prefill: column
             sums of the prompt's causal attention), averaged over the G query heads of each
             KV head, so each KV head evicts on its own (the original is per head, G = 1).
             Default split: `recent = B // 2` newest tokens, the rest heavy hitters.
  dense      no eviction. It has no bounded layout: `generate` runs it with the plain
             dense cache (`cache.init_dense_cache`); `BaselineConfig("dense")` only names it.

Keys keep the RoPE of their original position (no re-indexing inside the cache), as the
KVpop cache does. Prefill keeps the protected tokens plus the best-keyed others (ties: the
later position), which is what sequential eviction would do for StreamingLLM and the paper's
one-shot rule for TOVA and H2O.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax import attention as attn_lib
from kvpop_jax.cache import Cache, check_cache_args, in_dtype_of, one_token, prompt_count
from kvpop_jax.config import _require_bools
from pallas_kernels.common import NEG_INF

METHODS = ("dense", "streaming", "tova", "h2o")  # the training-free methods, dense included
BOUNDED_METHODS = METHODS[1:]  # those with a bounded cache


@dataclasses.dataclass(frozen=True)
class BaselineConfig:
    """A training-free cache policy at budget B (tokens per KV head).

    method: one of METHODS. budget: B (None only for dense). sinks: the first positions,
    never evicted. recent: the newest positions, never evicted; default B - s for
    streaming (the only value it allows), B // 2 for h2o, 0 for tova.
    banded_prefill: StreamingLLM only: the prefill reads the prompt as decoding it token by
    token would (`generate(stream_prompt=True)`), in one pass: query t attends to the sinks, the
    B - s tokens before it and itself, which is exactly the cache a streamed read holds at t
    (the kept positions after the prompt are the same; only their slot order differs). TOVA and
    H2O have no such shortcut: their evictions depend on the attention seen so far.
    """

    method: str
    budget: int | None = None
    sinks: int = 0
    recent: int | None = None
    banded_prefill: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"BaselineConfig.method must be one of {METHODS}, got {self.method!r}")
        _require_bools(self)  # banded_prefill="no" is truthy: it ran the banded pass
        if self.banded_prefill and self.method != "streaming":
            raise ValueError(f"banded_prefill is StreamingLLM's ('streaming'), got method {self.method!r}")
        if self.method == "dense":  # no bounded cache: a budget, sinks or window would be silently unused
            if (self.budget, self.sinks, self.recent) != (None, 0, None):
                raise ValueError(f"BaselineConfig('dense') keeps every token: it takes no budget, sinks or recent, "
                                 f"got budget={self.budget!r}, sinks={self.sinks!r}, recent={self.recent!r}")
            return
        for name in ("budget", "sinks", "recent"):
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))  # hashable and JSON like a Python int
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"BaselineConfig.budget must be a positive int for {self.method!r}, got {self.budget!r}")
        for name in ("sinks", "recent"):
            value = getattr(self, name)
            if (value is not None or name == "sinks") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"BaselineConfig.{name} must be an int, got {value!r}")
        if self.sinks < 0 or self.sinks >= self.budget:
            raise ValueError(f"BaselineConfig.sinks must be in [0, budget={self.budget}), got {self.sinks}")
        default = {"streaming": self.budget - self.sinks, "h2o": self.budget // 2, "tova": 0}[self.method]
        recent = default if self.recent is None else self.recent
        if self.method == "streaming" and recent != default:
            raise ValueError(f"streaming keeps exactly budget - sinks = {default} recent tokens, got recent={recent}")
        if recent < 0 or self.sinks + recent > self.budget:
            raise ValueError(f"need 0 <= recent and sinks + recent <= budget, got {self.sinks} + {recent} > {self.budget}")
        object.__setattr__(self, "recent", recent)

    @property
    def bounded(self) -> bool:
        return self.method != "dense"


@flax.struct.dataclass
class BaselineLayerCache:
    """One layer's bounded cache.

    k, v: [B, Hkv, N, D] with N = budget; pos: int32 [B, Hkv, N] token position per slot
    (-1 = empty); score: float32 [B, Hkv, N] the policy's key (TOVA: last attention; H2O:
    accumulated attention; StreamingLLM: unused, 0); config: the static policy.
    prompt_len: int32 [] or None; set on a fresh cache only (`with_prompt_len`): its prefill's prompt
    is the first `prompt_len` of the tokens given, the rest padding at the end, neither cached nor
    scored (`generate` pads a prompt to a power of two so that it compiles once per power of two, not
    per length). The cache a prefill returns has None.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    score: jax.Array
    config: BaselineConfig = flax.struct.field(pytree_node=False, default=None)
    prompt_len: jax.Array | None = None

    def prefill(self, q, k, v, *, positions, length, policy, return_policy=False):
        """Dense attention over the prompt, then its compression to B tokens (`prefill`).

        A KVpop model's scorers are not used: the policy is the baseline's. The policy counts token
        indices (`length` + 0..P-1), as `decode` does with `length` and the KVpop cache does: `positions`
        are where q and k were rotated, and explicit ones (an offset) once lost the sinks and made every
        later token look older than the prompt, so that decoding evicted each new token at once.
        """
        del positions, policy, return_policy
        b, p = q.shape[:2]
        index = jnp.broadcast_to(length + jnp.arange(p, dtype=jnp.int32), (b, p))
        out, cache = prefill(self.config, q, k, v, index, prompt_len=self.prompt_len)
        return out, in_dtype_of(self, cache), None

    def with_prompt_len(self, prompt_len) -> "BaselineLayerCache":
        """This fresh cache, its prefill told that only the first `prompt_len` (an int or a traced int32 []) of
        the tokens it reads are the prompt; the rest is padding (the class docstring; `prefill` refuses it for
        StreamingLLM's banded read)."""
        return self.replace(prompt_len=prompt_count(prompt_len))

    def decode(self, q, k, v, *, positions, length, policy):
        del positions, policy
        return decode(self.config, self, q, k, v, length)


def init_layer_cache(cfg: BaselineConfig, batch: int, num_kv_heads: int, head_dim: int,
                     dtype=jnp.float32) -> BaselineLayerCache:
    if not cfg.bounded:
        raise ValueError("the dense baseline has no bounded cache: use modeling.DenseCache")
    check_cache_args(f"the {cfg.method} cache", dtype, batch=batch)
    shape = (batch, num_kv_heads, cfg.budget)
    return BaselineLayerCache(
        k=jnp.zeros(shape + (head_dim,), dtype), v=jnp.zeros(shape + (head_dim,), dtype),
        pos=jnp.full(shape, -1, jnp.int32), score=jnp.zeros(shape, jnp.float32), config=cfg,
    )


def init_cache(model_config, cfg: BaselineConfig, batch: int, dtype=jnp.float32) -> Cache:
    """An empty bounded cache for every layer of a `Qwen3Config` (constant size)."""
    layer = init_layer_cache(cfg, batch, model_config.num_key_value_heads, model_config.head_dim, dtype)
    return Cache(layers=(layer,) * model_config.num_hidden_layers, length=jnp.zeros((), jnp.int32))


def _policy_key(cfg: BaselineConfig, score, pos):
    """Eviction key (lower goes first), float32 [..., N]."""
    return pos.astype(jnp.float32) if cfg.method == "streaming" else score


def _evictable(cfg: BaselineConfig, pos, query_pos):
    """Candidates that may be evicted: valid, not a sink, not among the `recent` newest."""
    return (pos >= 0) & (pos >= cfg.sinks) & (pos <= query_pos - cfg.recent)


def _policy_score(cfg: BaselineConfig, probs_BHGT, prev_score_BHT=None):
    """Attention weights [B, Hkv, G, T] -> the policy's per-slot score [B, Hkv, T]."""
    if cfg.method == "tova":
        return jnp.broadcast_to(jnp.mean(probs_BHGT, axis=(1, 2))[:, None], probs_BHGT.shape[:2] + probs_BHGT.shape[3:])
    if cfg.method == "h2o":
        mean = jnp.mean(probs_BHGT, axis=2)
        return mean if prev_score_BHT is None else prev_score_BHT + mean
    return jnp.zeros(probs_BHGT.shape[:2] + probs_BHGT.shape[3:], jnp.float32)


def _column_attention(q, k, lse, positions, q_positions=None, block: int = 256):
    """Sum over queries of the causal attention weights: [B, Hkv, G, P] float32.

    q [B, P, Hq, D], k [B, P, Hkv, D], lse [B, Hq, P] from the dense pass, positions int [B, P] the keys';
    q_positions the queries' (default: the same), -1 for a query that is padding (it adds nothing). One block of
    queries at a time so only [block, P] weights live at once.
    """
    b, p, hq, d = q.shape
    hkv = k.shape[2]
    q_positions = positions if q_positions is None else q_positions

    def one(args):  # padded queries have position -1 and see nothing
        q_blk, lse_blk, pos_blk = args
        logits = jnp.einsum("bqhgd,bthd->bhgqt", q_blk, k, preferred_element_type=jnp.float32) * d**-0.5
        mask = (positions[:, None, :] <= pos_blk[:, :, None]) & (pos_blk >= 0)[:, :, None]  # [B, q, T]
        probs = jnp.where(mask[:, None, None], jnp.exp(logits - lse_blk[..., None]), 0.0)
        return jnp.sum(probs, axis=3)

    xs = [attn_lib.group_queries(q, hkv), lse.reshape(b, hkv, hq // hkv, p), q_positions]
    _, blocks = attn_lib.split_query_blocks(xs, [1, 3, 1], block, pad_values=[0, 0, -1])
    return jnp.sum(jax.lax.map(one, tuple(blocks)), axis=0)


def _banded_attention(q, k, v, positions, *, sinks: int, recent: int, block: int = 128):
    """Causal attention in which query t sees only keys j < sinks or t - recent <= j <= t.

    q [B, P, Hq, D], k, v [B, P, Hkv, D], positions int [B, P] (strictly increasing, >= 0). Returns
    (out [B, P, Hq, D], lse [B, Hq, P]) as `attention.dense_attention` does. One block of queries
    at a time, each against the sinks and the `recent + block` keys its band can reach, not the
    whole prompt: P x (sinks + recent + block) logits instead of P x P.
    """
    b, p, hq, d = q.shape
    width = min(p, recent + block)  # key slots a query block's band can reach past the sinks
    n_sink = min(sinks, p)

    # Increasing positions put position < sinks at an index < sinks and [pos_t - recent, pos_t]
    # at indices within [t - recent, t]; band slots below n_sink are the sinks' own, masked there.
    def one_block(start, q_blk, qpos_blk):
        lo = jnp.clip(start - recent, 0, p - width)
        kk, vv, kv_pos = (jnp.concatenate([x[:, :n_sink], jax.lax.dynamic_slice_in_dim(x, lo, width, axis=1)], axis=1)
                          for x in (k, v, positions))
        fresh = jnp.concatenate([jnp.ones((n_sink,), bool), lo + jnp.arange(width) >= n_sink])
        kv_pos, q_pos = kv_pos[:, None, :], qpos_blk[:, :, None]
        mask = (kv_pos <= q_pos) & ((kv_pos < sinks) | (kv_pos >= q_pos - recent)) & fresh
        return attn_lib.attend(q_blk, kk, vv, mask[:, None, None], d**-0.5)

    out, lse = attn_lib.map_query_blocks(one_block, [attn_lib.group_queries(q, k.shape[2]), positions], [1, 1],
                                         block=block)
    return out.reshape(b, p, hq, d), lse.reshape(b, hq, p)


def prefill(cfg: BaselineConfig, q, k, v, positions, prompt_len=None):
    """Dense causal attention over a prompt, then its compression to B tokens.

    q [B, P, Hq, D], k, v [B, P, Hkv, D], positions int [B, P] (increasing, equal across
    the batch). prompt_len (int or traced int32 [], optional): only the first prompt_len of the P
    tokens are the prompt, the rest padding at its end (the causal pass keeps it out of the prompt's
    outputs; here it is neither scored nor kept), so that prompts of many lengths share one program:
    the cache equals that of the unpadded prompt (to float rounding in the scores). Returns
    (out [B, P, Hq, D], BaselineLayerCache with min(prompt, B) tokens in position order, the rest empty).
    """
    b, p, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    n = cfg.budget
    if prompt_len is not None and cfg.banded_prefill:
        raise ValueError("prompt_len (a padded prompt) is for the one-shot policies, not StreamingLLM's banded read")
    count = prompt_count(prompt_len, p)
    if cfg.banded_prefill:
        out, lse = _banded_attention(q, k, v, positions, sinks=cfg.sinks, recent=cfg.recent)
    else:
        out, lse = attn_lib.dense_attention(q, k, v, q_positions=positions, kv_positions=positions)
    real = jnp.arange(p) < count  # [P]: the prompt's tokens, not its padding
    pos = jnp.broadcast_to(jnp.where(real, positions, -1)[:, None, :], (b, hkv, p)).astype(jnp.int32)
    if cfg.method == "tova":  # the last prompt query's attention
        last = jax.lax.dynamic_index_in_dim(q, count - 1, axis=1, keepdims=False).reshape(b, hkv, g, d)
        logits = jnp.einsum("bhgd,bthd->bhgt", last, k, preferred_element_type=jnp.float32) * d**-0.5
        score = _policy_score(cfg, jax.nn.softmax(jnp.where(real, logits, NEG_INF), axis=-1))
    elif cfg.method == "h2o":
        score = _policy_score(cfg, _column_attention(q, k, lse, positions, jnp.where(real, positions, -1)))
    else:
        score = jnp.zeros((b, hkv, p), jnp.float32)
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, Hkv, P, D]
    if prompt_len is not None:  # padding reads as empty slots: zeros, as the unpadded prompt's spare slots
        kh, vh = (jnp.where(real[:, None], x, 0) for x in (kh, vh))
        score = jnp.where(real, score, 0.0)
    if p <= n:
        padw = ((0, 0), (0, 0), (0, n - p))
        cache = BaselineLayerCache(
            k=jnp.pad(kh, padw + ((0, 0),)), v=jnp.pad(vh, padw + ((0, 0),)),
            pos=jnp.pad(pos, padw, constant_values=-1), score=jnp.pad(score, padw), config=cfg,
        )
        return out, cache
    last_pos = jax.lax.dynamic_index_in_dim(positions, count - 1, axis=1, keepdims=False)  # [B]
    protected = ~_evictable(cfg, pos, last_pos[:, None, None])
    key = _policy_key(cfg, score, pos)
    # Ascending: protected first, then the highest key, then the later position; padding last of all.
    rank = jnp.where(pos < 0, 2, (~protected).astype(jnp.int32))
    order = jnp.lexsort((-pos, -key, rank), axis=-1)
    keep = jnp.sort(order[..., :n], axis=-1)  # slots in position order (a padded prompt's padding after them)
    take = lambda x: jnp.take_along_axis(x, keep, axis=-1)  # noqa: E731
    take_d = lambda x: jnp.take_along_axis(x, keep[..., None], axis=2)  # noqa: E731
    cache = BaselineLayerCache(k=take_d(kh), v=take_d(vh), pos=take(pos), score=take(score), config=cfg)
    return out, cache


def decode(cfg: BaselineConfig, lc: BaselineLayerCache, q_tok, k_tok, v_tok, position):
    """One decoding step: attend over cache + new token, then evict one of the B + 1.

    q_tok [B, 1, Hq, D], k_tok, v_tok [B, 1, Hkv, D], position int [] (the new token's).
    Returns (out [B, 1, Hq, D], new BaselineLayerCache). An empty slot, if any, takes the
    new token; otherwise the lowest-keyed evictable candidate (possibly the new token) goes.
    """
    b, _, hq, d = q_tok.shape
    hkv, n = lc.k.shape[1], lc.k.shape[2]
    # Static checks: two tokens were cut to the first, silently, and another config's policy ran on this
    # cache (banded_prefill aside: it shapes only the prefill).
    one_token(q_tok, cfg.method)
    if lc.config is not None and dataclasses.replace(lc.config, banded_prefill=cfg.banded_prefill) != cfg:
        raise ValueError(f"decode got {cfg} for a cache made with {lc.config}: pass the cache's own config")
    if k_tok.shape != (b, 1, hkv, d) or v_tok.shape != k_tok.shape:
        raise ValueError(f"k_tok and v_tok must be [B, 1, Hkv, D] = {(b, 1, hkv, d)} for this cache, got "
                         f"{tuple(k_tok.shape)} and {tuple(v_tok.shape)}")
    g = hq // hkv
    position = jnp.asarray(position, jnp.int32)
    # The B cached entries and the new token are scored apart and only their small [.., N + 1]
    # logits are joined: the cache is read once per step and written in one slot (a scatter that
    # XLA does in place), never copied whole (a decode step is memory-bound on its cache).
    k_new, v_new = k_tok[:, 0].astype(lc.k.dtype), v_tok[:, 0].astype(lc.v.dtype)  # [B, H, D]
    pos_all = jnp.concatenate([lc.pos, jnp.broadcast_to(position, (b, hkv, 1))], axis=2)
    qg = q_tok[:, 0].reshape(b, hkv, g, d)
    logits = jnp.concatenate([
        jnp.einsum("bhgd,bhnd->bhgn", qg, lc.k.astype(q_tok.dtype), preferred_element_type=jnp.float32),
        jnp.einsum("bhgd,bhd->bhg", qg, k_new.astype(q_tok.dtype), preferred_element_type=jnp.float32)[..., None],
    ], axis=-1)
    logits = jnp.where((pos_all >= 0)[:, :, None], logits * d**-0.5, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, H, G, N+1]
    out = (jnp.einsum("bhgn,bhnd->bhgd", probs[..., :n].astype(lc.v.dtype), lc.v, preferred_element_type=jnp.float32)
           + probs[..., n:] * v_new[:, :, None].astype(jnp.float32))
    out = out.reshape(b, 1, hq, d).astype(q_tok.dtype)

    prev = jnp.concatenate([lc.score, jnp.zeros((b, hkv, 1), jnp.float32)], axis=2)
    score_all = _policy_score(cfg, probs, prev)
    key = jnp.where(_evictable(cfg, pos_all, position), _policy_key(cfg, score_all, pos_all), jnp.inf)
    at_min = key == jnp.min(key, axis=-1, keepdims=True)
    victim = jnp.argmin(jnp.where(at_min, pos_all, jnp.iinfo(jnp.int32).max), axis=-1)  # ties: earlier position
    empty = lc.pos < 0
    drop = jnp.where(jnp.any(empty, axis=-1), jnp.argmax(empty, axis=-1), victim)  # [B, H] in [0, N]
    # The new token goes into slot `drop`; drop == N (the new token itself is evicted) is out of
    # range and dropped, keeping the cache as is.
    rows, heads = jnp.arange(b)[:, None], jnp.arange(hkv)[None, :]
    put = lambda x, new: x.at[rows, heads, drop].set(new, mode="drop")  # noqa: E731
    score = jnp.where(jnp.arange(n) == drop[..., None], score_all[..., n:], score_all[..., :n])
    lc = lc.replace(k=put(lc.k, k_new), v=put(lc.v, v_new), pos=put(lc.pos, pos_all[..., n]), score=score)
    return out, lc


__all__ = ["BOUNDED_METHODS", "METHODS", "BaselineConfig", "BaselineLayerCache", "decode", "init_cache",
           "init_layer_cache", "prefill"]
