"""Decoding caches: one small protocol, one container, the dense and the bounded KVpop kinds.

Every cache kind (dense here, bounded KVpop here, StreamingLLM / TOVA / H2O in
`baselines.py`, DMS's pool in `dms_cache.py`) is a `Cache` whose `layers[i]` implement the `LayerCache` protocol, so the
model has one `if cache is not None` path:

  prefill(q, k, v, *, positions, length, policy, return_policy) -> (out, layer cache, aux)
      the first call: the prompt's own attention (dense, or KVpop's masked parallel
      forward), then the cache after its last token;
  decode(q, k, v, *, positions, length, policy) -> (out, layer cache)
      a later call: the new token(s) attend to the cache, which then takes them in.

q [B, S, Hq, D] and k, v [B, S, Hkv, D] are the new tokens' (RoPE at their positions);
positions int [B, S]; length int [] tokens the cache has seen; policy: the layer's
`KVpopHead` (bound, its scorer and decay), `DMSGate` or None for a dense model. The dense and KVpop
caches take any number of tokens per decode call; the baselines' and DMS's one.

Bounded KVpop cache. Each layer keeps `B = s + w + k` slots per (batch, KV head):

  slots [0, s)          sinks: token t < s sits in slot t
  slots [s, s + w)      the protected window, a ring buffer: token t >= s in slot s + (t - s) % w
  slots [s + w, B)      the long-range top-k, with each token's static priority

Decoding token q (it must reproduce the masked forward's mask exactly): the token
u = q - w leaves the window (its ring slot is the one q is written to). It is scored
(stateless scorers and the non-delayed mLSTM scored it when it entered; the delayed
mLSTM reads its state after q with u's query features), and competes with the worst
long-range slot: it enters iff its priority is strictly better (on a tie the earlier
position wins, as in `policy_lib.ranks_from_priority`, and u is always the later one). The
loser is gone for good. Because priorities are static, this greedy replacement keeps
exactly the top-k of E(q), so teacher-forced decoding reproduces the masked parallel
forward.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax import attention as attn_lib
from kvpop_jax import policy as policy_lib
from kvpop_jax.config import KVpopConfig, Qwen3Config
from kvpop_jax.scorers import mlstm_init_state
from pallas_kernels.common import NEG_INF


class LayerCache(Protocol):
    """What the model needs of one layer's cache (see the module docstring)."""

    def prefill(self, q, k, v, *, positions, length, policy, return_policy: bool = False): ...

    def decode(self, q, k, v, *, positions, length, policy): ...


@flax.struct.dataclass
class Cache:
    """Every layer's cache (`layers[i]` a LayerCache) and the number of tokens seen so far.

    started (static): False until the first call (the prefill) has run.
    """

    layers: tuple
    length: jax.Array
    started: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    @property
    def batch(self) -> int:
        return jax.tree_util.tree_leaves(self.layers)[0].shape[0]


def one_token(q: jax.Array, kind: str) -> None:
    """The baselines' and DMS caches decode one token per call after the prefill (their eviction is per token)."""
    if q.shape[1] != 1:
        raise ValueError(f"a {kind} cache decodes one token per call after the prefill, got {q.shape[1]} tokens; "
                         "feed them one at a time (or start a new cache for a new prompt)")


def prompt_count(prompt_len, tokens: int | None = None):
    """How many of a prefill's `tokens` are the prompt: all of them when `prompt_len` is None, else `prompt_len`
    (an int, or a traced int32 [] whose value `generate` sets) as int32 []. A concrete value that is not an int in
    [1, tokens] ([1, ...) when `tokens` is None: a fresh cache's `with_prompt_len`) is a ValueError naming it: a
    traced index past either end would clamp and build another prompt's cache."""
    if prompt_len is None:
        return tokens
    try:
        value = np.asarray(prompt_len)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return jnp.asarray(prompt_len, jnp.int32)  # traced
    top = np.iinfo(np.int32).max if tokens is None else tokens
    if value.shape != () or not np.issubdtype(value.dtype, np.integer) or not 1 <= int(value) <= top:
        expected = ">= 1" if tokens is None else f"in [1, {tokens}], the prompt's share of the {tokens} tokens read"
        raise ValueError(f"prompt_len must be an int {expected} (the rest is padding), got {prompt_len!r}")
    return jnp.asarray(value, jnp.int32)


def in_dtype_of(empty, filled):
    """`filled` (a layer cache a prefill built from the prompt's k and v, in the model's dtype) with k and v
    in the dtype `empty` was made with: `init_cache(..., dtype=bf16)` on an f32 model keeps bf16 entries."""
    return filled.replace(k=filled.k.astype(empty.k.dtype), v=filled.v.astype(empty.v.dtype))


# ------------------------------------------------------------------------------- dense


DECODE_CHUNK = 2048  # cache slots per step of the decode attention's loop over the filled prefix
DECODE_MAX_QUERIES = 16  # new tokens up to which the dense cache attends with `prefix_attention`


def prefix_attention(q, k_cache, v_cache, k_new, v_new, *, q_positions, length, scale: float | None = None,
                     chunk: int = DECODE_CHUNK):
    """A few new tokens against the filled prefix of a head-major cache plus themselves (a decode step).

    q [B, S, Hq, D]; k_cache, v_cache [B, Hkv, T, D], slot t holding position t, slots < length
    filled; k_new, v_new [B, S, Hkv, D] the new tokens' (positions length + i, not yet in the
    cache); q_positions int [B, S]; key position p is visible to query s iff p <= q_positions[s].

    The cache is read as it is before this step's write (its own layout, no transpose), so the
    in-place write of the new tokens never forces a copy of it. While at most half the
    capacity is filled, an online softmax visits only the ceil(length / chunk) chunks holding
    filled slots (each sliced out, a copy); past that one pass over all T slots is cheaper.
    Forward only (the chunk loop is a while loop). Returns out [B, S, Hq, D] in q's dtype.
    """
    b, s, hq, d = q.shape
    h, t = k_cache.shape[1:3]
    g = hq // h
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, s, h, g, d).transpose(0, 2, 3, 1, 4).reshape(b, h, g * s, d).astype(k_cache.dtype)
    q_pos = jnp.tile(q_positions.astype(jnp.int32), (1, g))[:, None, :, None]  # [B, 1, G*S, 1]

    def partial(k_c, v_c, visible):
        """Softmax pieces (max, sum, unnormalized out) over keys k_c/v_c [B, H, C, D]."""
        logits = jnp.einsum("bhmd,bhcd->bhmc", qg, k_c.astype(qg.dtype), preferred_element_type=jnp.float32)
        logits = jnp.where(visible, logits * scale, NEG_INF)
        m = logits.max(-1)
        p = jnp.exp(logits - m[..., None])
        out = jnp.einsum("bhmc,bhcd->bhmd", p.astype(v_c.dtype), v_c, preferred_element_type=jnp.float32)
        return m, p.sum(-1), out

    def merge(a, b_):
        m = jnp.maximum(a[0], b_[0])
        wa, wb = jnp.exp(a[0] - m), jnp.exp(b_[0] - m)
        return m, a[1] * wa + b_[1] * wb, a[2] * wa[..., None] + b_[2] * wb[..., None]

    new_pos = length + jnp.arange(s, dtype=jnp.int32)
    new = partial(jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2).astype(v_cache.dtype), new_pos <= q_pos)

    def whole():
        pos = jnp.arange(t, dtype=jnp.int32)
        return partial(k_cache, v_cache, (pos < length) & (pos <= q_pos))

    c = min(chunk, t)

    def chunked():
        def chunk_step(i, carry):
            start = jnp.minimum(i * c, t - c)  # the last chunk may overlap the one before: masked
            pos = start + jnp.arange(c, dtype=jnp.int32)
            visible = (pos >= i * c) & (pos < length) & (pos <= q_pos)
            k_c = jax.lax.dynamic_slice_in_dim(k_cache, start, c, axis=2)
            v_c = jax.lax.dynamic_slice_in_dim(v_cache, start, c, axis=2)
            return merge(carry, partial(k_c, v_c, visible))

        init = (jnp.full((b, h, g * s), NEG_INF, jnp.float32), jnp.zeros((b, h, g * s), jnp.float32),
                jnp.zeros((b, h, g * s, d), jnp.float32))
        return jax.lax.fori_loop(0, (length + c - 1) // c, chunk_step, init)

    cached = whole() if 2 * c > t else jax.lax.cond(2 * length <= t, chunked, whole)
    _, l, acc = merge(cached, new)
    out = (acc / l[..., None]).reshape(b, h, g, s, d).transpose(0, 3, 1, 2, 4).reshape(b, s, hq, d)
    return out.astype(q.dtype)


def after(x: jax.Array, dependency: jax.Array) -> jax.Array:
    """x, plus an exact zero computed from `dependency`: orders a cache's in-place write after
    this step's reads of it (`dependency` = what the reads produced).

    Without a data dependency XLA (CPU) may schedule the write first and then copies a
    loop-carried cache twice per decode step (in `generate`'s while loop) to keep the old
    values readable. `z − z` is not folded for floats; non-finite z contributes 0 too.
    """
    z = dependency.reshape(-1)[0].astype(jnp.float32)
    zero = z - z
    return x + jnp.where(jnp.isfinite(zero), zero, 0.0).astype(x.dtype)


@flax.struct.dataclass
class DenseLayerCache:
    """k, v: [B, Hkv, T, D] (head-major, like the bounded caches and torch's): slot i holds the
    token at position i; T = max cache length."""

    k: jax.Array
    v: jax.Array

    def prefill(self, q, k, v, *, positions, length, policy, return_policy=False):
        out, cache = self.decode(q, k, v, positions=positions, length=length, policy=policy)
        return out, cache, None

    def decode(self, q, k, v, *, positions, length, policy):
        if policy is not None:
            raise ValueError("a KVpop model decodes with its bounded cache (kvpop_jax.cache.init_cache), "
                             "not a dense one")
        b, _, t, _ = self.k.shape
        s = q.shape[1]
        _check_dense_room(t, s, length)
        # Slot i holds the i-th token: the causal mask counts token indices, as the bounded caches do.
        # `positions` only rotated q and k (explicit ones, e.g. offset by 7, once let queries see later tokens).
        del positions
        index = jnp.broadcast_to(length + jnp.arange(s, dtype=jnp.int32), (b, s))
        if s <= DECODE_MAX_QUERIES:  # reads the cache before the write below
            out = prefix_attention(q, self.k, self.v, k, v, q_positions=index, length=length)
            k, v = after(k, out), after(v, out)
        # Written in place (a donated or loop-carried cache is updated, not copied).
        cache_k = jax.lax.dynamic_update_slice_in_dim(self.k, jnp.swapaxes(k, 1, 2).astype(self.k.dtype), length, 2)
        cache_v = jax.lax.dynamic_update_slice_in_dim(self.v, jnp.swapaxes(v, 1, 2).astype(self.v.dtype), length, 2)
        if s > DECODE_MAX_QUERIES:  # a prompt: the tiled dense attention over the cache, transposed once
            slots = jnp.arange(t, dtype=jnp.int32)
            out, _ = attn_lib.dense_attention(
                q, jnp.swapaxes(cache_k, 1, 2).astype(q.dtype), jnp.swapaxes(cache_v, 1, 2).astype(q.dtype),
                q_positions=index, kv_positions=jnp.broadcast_to(slots, (b, t)),
                kv_valid=jnp.broadcast_to(slots < length + s, (b, t)),
            )
        # Under jit an overflow is not caught above (the length is traced) and the write was clamped into
        # the last slots: the output is then NaN, not silently wrong (like an out-of-vocabulary id's logits).
        out = jnp.where(length + s <= t, out, jnp.asarray(jnp.nan, out.dtype))
        return out, DenseLayerCache(cache_k, cache_v)


def _check_dense_room(slots: int, new: int, length) -> None:
    """A dense cache of `slots` slots holding `length` tokens takes `new` more, or a ValueError. The
    length is checked where it is concrete (eager calls); under jit it is traced, an overflowing
    write clamps into the last slots and `decode` returns NaN (`generate` sizes its cache to the
    prompt plus max_new_tokens, so it never does)."""
    if new > slots:
        raise ValueError(f"{new} tokens do not fit a dense cache of {slots} slots (init_dense_cache max_len={slots})")
    try:
        used = int(length)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError, TypeError):
        return  # traced
    if used + new > slots:
        raise ValueError(f"the dense cache holds {used} of its {slots} slots and cannot take {new} more tokens; "
                         f"init it with max_len >= {used + new}")


def check_cache_args(where: str, dtype, **counts) -> jnp.dtype:
    """A cache's dtype (floating: an integer cache rounds every key and value, and decodes other tokens silently)
    and its counts (batch, max_len: positive ints), checked by name for `where`; returns the dtype."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{where}: {name}={value!r}; expected a positive integer")
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"{where}: dtype must be a floating dtype for the cache's keys and values (e.g. "
                         f"jnp.bfloat16), got {dtype!r}")
    return jnp.dtype(dtype)


def init_dense_cache(config: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32) -> Cache:
    """An empty dense cache of `max_len` slots per layer (it holds every token): k, v [B, Hkv, T, D]."""
    check_cache_args("init_dense_cache", dtype, batch=batch, max_len=max_len)
    shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
    layer = DenseLayerCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    return Cache(layers=(layer,) * config.num_hidden_layers, length=jnp.zeros((), jnp.int32))


# ------------------------------------------------------------------------------- KVpop


@flax.struct.dataclass
class KVpopLayerCache:
    """One layer's bounded cache.

    k, v: [B, Hkv, N, D] with N = s + w + k; pos: int32 [B, Hkv, N] token position per
    slot (-1 = empty); priority: float32 [B, Hkv, N] static priority p_t of the slot's
    token (-inf where unknown); scorer_state: the mLSTM state (C, n, m) or None.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    priority: jax.Array
    scorer_state: Any = None

    def prefill(self, q, k, v, *, positions, length, policy, return_policy=False):
        """The masked parallel forward over the prompt, then its retained set (`KVpopHead.prefill`)."""
        del length
        _require_policy(policy)
        out, cache, aux = policy.prefill(q, k, v, return_policy=return_policy, positions=positions)
        return out, in_dtype_of(self, cache), aux

    def decode(self, q, k, v, *, positions, length, policy):
        """One token against the cache (`KVpopHead.decode`), or several (`KVpopHead.continue_tokens`: a later
        chat turn, a prompt in chunks), as that many one-token calls would."""
        _require_policy(policy)
        if q.shape[1] > 1:
            return policy.continue_tokens(self, q, k, v, length, rope_positions=positions)
        return policy.decode(self, q, k, v, length, rope_positions=positions)


def _require_policy(policy) -> None:
    if policy is None or getattr(policy, "IS_DMS", False):
        raise ValueError("a KVpop cache needs a model whose config has kvpop set")


def init_cache(config: Qwen3Config, batch: int, dtype=jnp.float32) -> Cache:
    """An empty bounded KVpop cache for every layer (constant size: it never grows)."""
    if config.kvpop is None:
        raise ValueError("init_cache needs a config with kvpop set")
    kv = config.kvpop
    check_cache_args("init_cache", dtype, batch=batch)
    state = None
    if kv.scorer == "mlstm":  # the shapes of MLSTMScorer.init_state
        state = mlstm_init_state(batch, config.num_key_value_heads, kv.mlstm_features(config.head_dim),
                                 kv.mlstm_value_dim(config.head_dim))
    layers = tuple(init_layer_cache(config, batch, dtype, state) for _ in range(config.num_hidden_layers))
    return Cache(layers=layers, length=jnp.zeros((), jnp.int32))


def init_layer_cache(config: Qwen3Config, batch: int, dtype=jnp.float32, scorer_state=None) -> KVpopLayerCache:
    check_cache_args("init_cache", dtype, batch=batch)
    kv = config.kvpop
    shape = (batch, config.num_key_value_heads, kv.budget)
    return KVpopLayerCache(
        k=jnp.zeros(shape + (config.head_dim,), dtype),
        v=jnp.zeros(shape + (config.head_dim,), dtype),
        pos=jnp.full(shape, -1, jnp.int32),
        priority=jnp.full(shape, NEG_INF, jnp.float32),
        scorer_state=scorer_state,
    )


def ring_slot(t: jax.Array, kv: KVpopConfig) -> jax.Array:
    """Slot of token t: t for sinks, s + (t - s) % w for the window."""
    return jnp.where(t < kv.sinks, t, kv.sinks + (t - kv.sinks) % kv.window)


def write_slot(cache: KVpopLayerCache, slot, k, v, pos, priority, enable) -> KVpopLayerCache:
    """Writes one token per (batch, head) at `slot` ([B, H] ints) where `enable` ([B, H])."""
    b, h = slot.shape
    at = (jnp.arange(b)[:, None], jnp.arange(h)[None, :], slot)  # one slot per (batch, head): a scatter, in place

    def put(x, new):
        keep = enable.reshape(enable.shape + (1,) * (new.ndim - 2))
        return x.at[at].set(jnp.where(keep, new.astype(x.dtype), x[at]))

    return cache.replace(k=put(cache.k, k), v=put(cache.v, v), pos=put(cache.pos, pos),
                         priority=put(cache.priority, priority))


def admit_to_long_range(cache: KVpopLayerCache, k_u, v_u, pos_u, prio_u, enable, kv: KVpopConfig):
    """The token leaving the window competes for the k long-range slots (per batch, head).

    k_u, v_u: [B, H, D]; pos_u int [B, H]; prio_u float32 [B, H]; enable bool [B, H].
    An empty slot is taken first; otherwise the worst slot (lowest priority, ties: the
    later position) is replaced iff prio_u is strictly higher. Returns (the new cache, admitted
    bool [B, H], the position it replaced int32 [B, H], -1 for an empty slot).
    """
    if kv.topk == 0:
        b, h = pos_u.shape
        return cache, jnp.zeros((b, h), bool), jnp.full((b, h), -1, jnp.int32)
    lo = kv.sinks + kv.window
    lr_pos, lr_prio = cache.pos[..., lo:], cache.priority[..., lo:]
    empty = lr_pos < 0
    # Worst-first key: empty slots, then low priority, then late position.
    worst_key_prio = jnp.where(empty, -jnp.inf, lr_prio)
    min_prio = jnp.min(worst_key_prio, axis=-1, keepdims=True)
    at_min = worst_key_prio == min_prio
    latest = jnp.argmax(jnp.where(at_min, jnp.where(empty, jnp.iinfo(jnp.int32).max, lr_pos), -2), axis=-1)
    worst_prio = jnp.take_along_axis(lr_prio, latest[..., None], -1)[..., 0]
    worst_empty = jnp.take_along_axis(empty, latest[..., None], -1)[..., 0]
    admit = enable & (worst_empty | (prio_u > worst_prio))
    replaced = jnp.where(worst_empty, -1, jnp.take_along_axis(lr_pos, latest[..., None], -1)[..., 0])
    return write_slot(cache, lo + latest, k_u, v_u, pos_u, prio_u, admit), admit, replaced


CONTINUE_QUERY_BLOCK = 512  # queries per block of a multi-token step's attention (its mask is block x (N + T))


def attend_spans(q, keys, values, enter, leave, scale: float | None = None):
    """T queries of one call against `keys`/`values` [B, Hkv, K, D], query i reading key j iff
    enter_j <= i < leave_j (enter, leave int [B, Hkv, K]): q [B, T, Hq, D] -> out [B, T, Hq, D].
    `attend_cache`'s arithmetic, one block of queries at a time."""
    b, t, hq, d = q.shape
    hkv = keys.shape[1]
    scale = d**-0.5 if scale is None else scale
    g = hq // hkv
    outs = []
    for q0 in range(0, t, CONTINUE_QUERY_BLOCK):
        q1 = min(t, q0 + CONTINUE_QUERY_BLOCK)
        tb = q1 - q0
        # Batch and head axes leading in every dot (as `prefix_attention`): XLA's CPU runtime has no
        # bf16 x bf16 -> f32 dot with them elsewhere, and a bf16 cache with batch > 1 failed there.
        qg = q[:, q0:q1].reshape(b, tb, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * tb, d)
        i = jnp.arange(q0, q1)[:, None]
        valid = (enter[:, :, None, :] <= i) & (i < leave[:, :, None, :])  # [B, Hkv, Tb, K]
        valid = jnp.broadcast_to(valid[:, :, None], (b, hkv, g, tb, valid.shape[-1])).reshape(b, hkv, g * tb, -1)
        logits = jnp.einsum("bhmd,bhnd->bhmn", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32)
        logits = jnp.where(valid, logits * scale, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhmn,bhnd->bhmd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        outs.append(out.reshape(b, hkv, g, tb, d).transpose(0, 3, 1, 2, 4).reshape(b, tb, hq, d).astype(q.dtype))
    return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]


def attend_cache(q_tok: jax.Array, cache: KVpopLayerCache, scale: float | None = None):
    """One query per row against the cache.

    q_tok: [B, 1, Hq, D] -> (out [B, 1, Hq, D], probs [B, Hkv, G, N] float32 — the
    attention weights, which TOVA/H2O-style policies read).
    """
    b, _, hq, d = q_tok.shape
    hkv = cache.k.shape[1]
    scale = d**-0.5 if scale is None else scale
    qg = q_tok[:, 0].reshape(b, hkv, hq // hkv, d)
    logits = jnp.einsum("bhgd,bhnd->bhgn", qg, cache.k.astype(q_tok.dtype), preferred_element_type=jnp.float32)
    logits = jnp.where((cache.pos >= 0)[:, :, None], logits * scale, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgn,bhnd->bhgd", probs.astype(cache.v.dtype), cache.v, preferred_element_type=jnp.float32)
    return out.reshape(b, 1, hq, d).astype(q_tok.dtype), probs


def build_from_prefill(
    k: jax.Array, v: jax.Array, priority: jax.Array, kv: KVpopConfig, scorer_state=None, known_priority=None
) -> KVpopLayerCache:
    """The cache after query P - 1 of a prefill of P tokens.

    k, v: [B, P, Hkv, D]; priority: float32 [B, Hkv, P] static priorities of the prompt
    tokens; known_priority: bool [P] (or None = all) — which of them are final (the
    delayed mLSTM scores a window token only when it leaves, so those stay -inf).
    Long-range slots get the top-k of E(P - 1) by priority (ties: earlier position), in
    position order; sinks and the window ring as in decoding.
    """
    b, p, h, d = k.shape
    n = kv.budget
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, H, P, D]
    t = jnp.arange(p)
    if known_priority is not None:
        priority = jnp.where(known_priority, priority, NEG_INF)
    cache = KVpopLayerCache(
        k=jnp.zeros((b, h, n, d), k.dtype), v=jnp.zeros((b, h, n, d), v.dtype),
        pos=jnp.full((b, h, n), -1, jnp.int32), priority=jnp.full((b, h, n), NEG_INF, jnp.float32),
        scorer_state=scorer_state,
    )
    # Sinks and window: the tokens still there at q = P - 1, each in its own slot.
    in_place = (t < kv.sinks) | (t > p - 1 - kv.window)
    slots = jnp.where(in_place, ring_slot(t, kv), n)  # n = dropped by the scatter
    mode = "drop"
    cache = cache.replace(
        k=cache.k.at[:, :, slots].set(kh, mode=mode),
        v=cache.v.at[:, :, slots].set(vh, mode=mode),
        pos=cache.pos.at[:, :, slots].set(jnp.broadcast_to(t, (b, h, p)).astype(jnp.int32), mode=mode),
        priority=cache.priority.at[:, :, slots].set(priority, mode=mode),
    )
    if kv.topk == 0:
        return cache
    eligible_np = (np.arange(p) >= kv.sinks) & (np.arange(p) <= p - 1 - kv.window)
    if not eligible_np.any():
        return cache
    eligible = jnp.asarray(eligible_np)
    # top-k by (priority desc, position asc): ranks give exactly that order.
    ranks = policy_lib.ranks_from_priority(jnp.where(eligible, priority, -jnp.inf))
    kth = min(kv.topk, p)
    chosen_rank_order = jnp.argsort(ranks, axis=-1)[..., :kth]  # tokens of the best ranks
    chosen = jnp.sort(chosen_rank_order, axis=-1)  # position order (any order is valid)
    valid = eligible[chosen]
    lo = kv.sinks + kv.window
    gather = lambda x: jnp.take_along_axis(x, chosen[..., None], axis=2)  # noqa: E731
    lr = slice(lo, lo + kth)
    return cache.replace(
        k=cache.k.at[:, :, lr].set(jnp.where(valid[..., None], gather(kh), 0).astype(cache.k.dtype)),
        v=cache.v.at[:, :, lr].set(jnp.where(valid[..., None], gather(vh), 0).astype(cache.v.dtype)),
        pos=cache.pos.at[:, :, lr].set(jnp.where(valid, chosen, -1).astype(jnp.int32)),
        priority=cache.priority.at[:, :, lr].set(
            jnp.where(valid, jnp.take_along_axis(priority, chosen, axis=-1), NEG_INF)
        ),
    )


def static_priority_at(score: jax.Array, log_gamma: jax.Array, position) -> jax.Array:
    """Priority of one token per (batch, head): score [B, H], position int [] or [B, H]."""
    pos = jnp.broadcast_to(jnp.asarray(position), score.shape)[..., None]
    return policy_lib.static_priority(score[..., None], log_gamma, positions=pos)[..., 0]
