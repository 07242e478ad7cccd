"""The bounded DMS decode cache: per-head variable occupancy inside a fixed per-layer capacity.

DMS (`dms.py`) lets each KV head keep as many tokens as its gates allow, so occupancy differs
from head to head. The reference (NVIDIA's paged cache) grows a page list per head without a
bound; here every layer owns one fixed pool of `N = num_kv_heads * budget` entries per batch
row, the memory KVpop spends on the same layer (`budget` = `DMSConfig.budget`, the
comparison's memory per KV head), and the heads share it: a slot holds one token of one head.

  k, v [B, N, D]       the cached keys (RoPE at their position) and values
  head, pos [B, N]     which KV head and position a slot holds (-1: free)
  logit [B, N]         the token's decision logit a_t (NO_DECISION until token t + 1 came)
  evict [B, N]         a_t > 0: the token goes when it leaves the window
  overflow [B]         entries dropped because the pool was full (0 while DMS is exact)

Decoding token q (one per call), per batch row:

  1. the new token's gate g_q decides token q - 1 of the same head (`a_{q-1} = g_q`);
  2. tokens marked for eviction that leave the window (`pos <= q - w`) free their slots: a
     marked token stays attendable while it is among the w newest (delayed eviction);
  3. each head's new token takes the first free slot. When none is left (the pool is full),
     the layer drops, among the tokens of any head that have left the window, the one its gate
     was least sure to keep (highest decision logit; ties: the oldest) and counts an overflow.
     Window tokens are never dropped: the pool holds Hkv * w of them at most and N > Hkv * w
     (`DMSConfig` needs budget > w);
  4. the query heads of KV head h attend to the slots whose `head == h`.

While no overflow happens this is exactly DMS's hard mask `t <= q ∧ (q - t < w ∨ a_t <= 0)`,
so teacher-forced decoding equals the masked parallel forward (tests/test_dms.py). The pool's
memory is fixed like KVpop's; its heads' shares are not. Attention reads the whole pool once
per query head group (masked by head), which on GPU a paged kernel would avoid.

Prefill of P tokens (`build_from_prefill`): the hard-masked forward over the prompt, then the
tokens still visible to query P - 1, the window first, then older kept tokens by increasing
decision logit (ties: the newer first); what does not fit is dropped and counted.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvpop_jax.cache import Cache, check_cache_args, in_dtype_of, one_token, prompt_count
from kvpop_jax.config import Qwen3Config
from pallas_kernels.common import NEG_INF

NO_DECISION = -1e4  # decision logit of a token whose deciding token has not arrived (kept)


@flax.struct.dataclass
class DMSLayerCache:
    """One layer's DMS pool (see the module docstring for the fields)."""

    k: jax.Array
    v: jax.Array
    head: jax.Array
    pos: jax.Array
    logit: jax.Array
    evict: jax.Array
    overflow: jax.Array
    prompt_len: jax.Array | None = None  # set on a fresh pool only (`with_prompt_len`); None after a prefill

    @property
    def capacity(self) -> int:
        return self.pos.shape[1]

    def prefill(self, q, k, v, *, positions, length, policy, return_policy=False):
        """The hard-masked forward over the prompt, then its kept tokens (`DMSGate.prefill`)."""
        del positions, length
        _require_dms(policy)
        out, cache, aux = policy.prefill(q, k, v, capacity=self.capacity, return_policy=return_policy,
                                         prompt_len=self.prompt_len)
        return out, in_dtype_of(self, cache), aux

    def with_prompt_len(self, prompt_len) -> "DMSLayerCache":
        """This fresh pool, its prefill told that only the first `prompt_len` (an int or a traced int32 []) of the
        tokens it reads are the prompt, the rest padding at its end, never pooled (`build_from_prefill`): `generate`
        pads a prompt to a power of two so that it compiles once per power of two, not per length."""
        return self.replace(prompt_len=prompt_count(prompt_len))

    def decode(self, q, k, v, *, positions, length, policy):
        del positions
        _require_dms(policy)
        one_token(q, "DMS")
        return policy.decode(self, q, k, v, length)


def _require_dms(policy) -> None:
    if not getattr(policy, "IS_DMS", False):
        raise ValueError("a DMS cache needs a model whose config has dms set")


def init_layer_cache(config: Qwen3Config, batch: int, dtype=jnp.float32, capacity: int | None = None) -> DMSLayerCache:
    """An empty pool of `capacity` (default Hkv * dms.budget) entries: more than the Hkv * w window
    tokens, which are never dropped (a smaller pool overwrote them; 0 silently meant the default)."""
    if config.dms is None:
        raise ValueError("the DMS cache needs a config with dms set")
    check_cache_args("the DMS cache", dtype, batch=batch)
    least = config.num_key_value_heads * config.dms.window
    if capacity is None:
        capacity = config.num_key_value_heads * config.dms.budget
    elif isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= least:
        raise ValueError(f"capacity must be an int > num_kv_heads * window = {least} (the window tokens of every "
                         f"head), or None for num_kv_heads * budget; got {capacity!r}")
    n = capacity
    return DMSLayerCache(
        k=jnp.zeros((batch, n, config.head_dim), dtype), v=jnp.zeros((batch, n, config.head_dim), dtype),
        head=jnp.full((batch, n), -1, jnp.int32), pos=jnp.full((batch, n), -1, jnp.int32),
        logit=jnp.full((batch, n), NO_DECISION, jnp.float32), evict=jnp.zeros((batch, n), bool),
        overflow=jnp.zeros((batch,), jnp.int32),
    )


def init_cache(config: Qwen3Config, batch: int, dtype=jnp.float32) -> Cache:
    """An empty DMS cache for every layer (fixed size: Hkv * budget entries per layer)."""
    layer = init_layer_cache(config, batch, dtype)
    return Cache(layers=(layer,) * config.num_hidden_layers, length=jnp.zeros((), jnp.int32))


def occupancy(lc: DMSLayerCache, num_kv_heads: int) -> jax.Array:
    """Entries each KV head holds: int32 [B, Hkv]."""
    return jnp.sum(lc.head[:, None, :] == jnp.arange(num_kv_heads)[None, :, None], axis=-1).astype(jnp.int32)


def _write(lc: DMSLayerCache, slot, k, v, head, pos) -> DMSLayerCache:
    """Writes one token per batch row at `slot` (int [B]): k, v [B, D], head, pos int [B]."""
    onehot = jnp.arange(lc.capacity)[None, :] == slot[:, None]  # [B, N]
    return lc.replace(
        k=jnp.where(onehot[..., None], k[:, None].astype(lc.k.dtype), lc.k),
        v=jnp.where(onehot[..., None], v[:, None].astype(lc.v.dtype), lc.v),
        head=jnp.where(onehot, head[:, None], lc.head), pos=jnp.where(onehot, pos[:, None], lc.pos),
        logit=jnp.where(onehot, NO_DECISION, lc.logit), evict=jnp.where(onehot, False, lc.evict),
    )


def decode_step(lc: DMSLayerCache, q_tok, k_t, v_t, g_t, position, *, window: int):
    """One decoding step (steps 1-4 of the module docstring).

    q_tok [B, 1, Hq, D]; k_t, v_t [B, Hkv, D]; g_t float32 [B, Hkv] the new token's gate logits;
    position int [] the new token's. Returns (out [B, 1, Hq, D], new DMSLayerCache).
    """
    b, _, hq, d = q_tok.shape
    hkv = k_t.shape[1]
    position = jnp.asarray(position, jnp.int32)
    heads = jnp.arange(hkv, dtype=jnp.int32)
    # 1. token q - 1 of each head gets its decision from g_q
    prev = (lc.pos == position - 1)[..., None] & (lc.head[..., None] == heads)  # [B, N, Hkv]
    decided = jnp.any(prev, axis=-1)
    a_prev = jnp.sum(jnp.where(prev, g_t[:, None, :], 0.0), axis=-1)
    logit = jnp.where(decided, a_prev, lc.logit)
    evict = jnp.where(decided, a_prev > 0, lc.evict)
    # 2. marked tokens leaving the window are gone
    gone = (lc.pos >= 0) & evict & (lc.pos <= position - window)
    lc = lc.replace(logit=logit, evict=evict & ~gone, head=jnp.where(gone, -1, lc.head),
                    pos=jnp.where(gone, -1, lc.pos))
    # 3. each head's new token: a free slot, else the least surely kept token out of the window
    big = jnp.iinfo(jnp.int32).max
    for h in range(hkv):
        free = lc.pos < 0
        old = (lc.pos >= 0) & (lc.pos <= position - window)
        worst = jnp.max(jnp.where(old, lc.logit, -jnp.inf), axis=-1, keepdims=True)
        victim = jnp.argmin(jnp.where(old & (lc.logit == worst), lc.pos, big), axis=-1)
        has_free = jnp.any(free, axis=-1)
        slot = jnp.where(has_free, jnp.argmax(free, axis=-1), victim)
        lc = _write(lc, slot, k_t[:, h], v_t[:, h], jnp.full((b,), h, jnp.int32), jnp.broadcast_to(position, (b,)))
        lc = lc.replace(overflow=lc.overflow + (~has_free).astype(jnp.int32))
    # 4. attention of each query group over its head's slots
    qg = q_tok[:, 0].reshape(b, hkv, hq // hkv, d)
    logits = jnp.einsum("bhgd,bnd->bhgn", qg, lc.k.astype(q_tok.dtype), preferred_element_type=jnp.float32)
    mine = (lc.head[:, None, :] == heads[None, :, None])[:, :, None]  # [B, Hkv, 1, N]
    probs = jax.nn.softmax(jnp.where(mine, logits * d**-0.5, NEG_INF), axis=-1)
    out = jnp.einsum("bhgn,bnd->bhgd", probs.astype(lc.v.dtype), lc.v, preferred_element_type=jnp.float32)
    return out.reshape(b, 1, hq, d).astype(q_tok.dtype), lc


def build_from_prefill(k: jax.Array, v: jax.Array, a: jax.Array, *, window: int, capacity: int,
                       prompt_len=None) -> DMSLayerCache:
    """The pool after query P - 1 of a prefill of P tokens.

    k, v [B, P, Hkv, D]; a float32 [B, Hkv, P] decision logits (a_{P-1} = NO_DECISION: pending).
    Keeps the tokens visible to query P - 1 (`q - t < w ∨ a_t <= 0`); if more than `capacity`,
    the window first, then older ones by increasing a_t (ties: the newer), the rest counted in
    `overflow`. prompt_len (int or traced int32 [], optional): only the first prompt_len of the P
    tokens are the prompt, the rest padding at its end: the pool after query prompt_len - 1, whose
    decision is pending (its deciding token would be padding), equal to the unpadded prompt's.
    """
    b, p, hkv, d = k.shape
    t = jnp.arange(p)
    count = prompt_count(prompt_len, p)
    if prompt_len is not None:
        a = jnp.where(t == count - 1, NO_DECISION, a)
    in_window = jnp.broadcast_to((t > count - 1 - window) & (t < count), (b, hkv, p))
    keep = in_window | ((a <= 0) & (t < count))
    flat = lambda x: x.reshape(b, hkv * p)  # noqa: E731  candidate i = h * P + t
    keep_f, win_f, a_f = flat(keep), flat(in_window), flat(a.astype(jnp.float32))
    t_f = flat(jnp.broadcast_to(t, (b, hkv, p)))
    h_f = flat(jnp.broadcast_to(jnp.arange(hkv)[:, None], (b, hkv, p)))
    kf = jnp.swapaxes(k, 1, 2).reshape(b, hkv * p, d)
    vf = jnp.swapaxes(v, 1, 2).reshape(b, hkv * p, d)
    m = hkv * p
    if m < capacity:  # pad the candidates with nothing
        pad = capacity - m
        keep_f, win_f = (jnp.pad(x, ((0, 0), (0, pad))) for x in (keep_f, win_f))
        a_f, t_f, h_f = (jnp.pad(x, ((0, 0), (0, pad))) for x in (a_f, t_f, h_f))
        kf, vf = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (kf, vf))
    # ascending: kept, then window, then low decision logit, then late position
    order = jnp.lexsort((-t_f, jnp.where(win_f, -jnp.inf, a_f), ~win_f, ~keep_f), axis=-1)[:, :capacity]
    take = lambda x: jnp.take_along_axis(x, order, axis=1)  # noqa: E731
    valid = take(keep_f)
    a_kept = take(a_f)
    return DMSLayerCache(
        k=jnp.where(valid[..., None], jnp.take_along_axis(kf, order[..., None], axis=1), 0).astype(k.dtype),
        v=jnp.where(valid[..., None], jnp.take_along_axis(vf, order[..., None], axis=1), 0).astype(v.dtype),
        head=jnp.where(valid, take(h_f), -1).astype(jnp.int32), pos=jnp.where(valid, take(t_f), -1).astype(jnp.int32),
        logit=jnp.where(valid, a_kept, NO_DECISION), evict=valid & (a_kept > 0),
        overflow=jnp.maximum(jnp.sum(keep_f, axis=-1) - capacity, 0).astype(jnp.int32),
    )


__all__ = ["NO_DECISION", "DMSLayerCache", "build_from_prefill", "decode_step", "init_cache", "init_layer_cache", "occupancy"]
