import jax, jax.numpy as jnp
from kvpop_jax.baselines import _policy_score, _evictable, _policy_key, NEG_INF
def decode2(cfg, lc, q_tok, k_tok, v_tok, position):
    b, _, hq, d = q_tok.shape
    hkv, n = lc.k.shape[1], lc.k.shape[2]
    g = hq // hkv
    position = jnp.asarray(position, jnp.int32)
    k_new = k_tok[:, 0].astype(lc.k.dtype)  # [B, H, D]
    v_new = v_tok[:, 0].astype(lc.v.dtype)
    pos_all = jnp.concatenate([lc.pos, jnp.broadcast_to(position, (b, hkv, 1))], axis=2)
    qg = q_tok[:, 0].reshape(b, hkv, g, d)
    logits = jnp.concatenate([
        jnp.einsum("bhgd,bhnd->bhgn", qg, lc.k.astype(q_tok.dtype), preferred_element_type=jnp.float32),
        jnp.einsum("bhgd,bhd->bhg", qg, k_new.astype(q_tok.dtype), preferred_element_type=jnp.float32)[..., None]], axis=-1)
    logits = jnp.where((pos_all >= 0)[:, :, None], logits * d**-0.5, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)
    out = (jnp.einsum("bhgn,bhnd->bhgd", probs[..., :n].astype(lc.v.dtype), lc.v, preferred_element_type=jnp.float32)
           + probs[..., n:].astype(jnp.float32) * v_new[:, :, None].astype(jnp.float32))
    out = out.reshape(b, 1, hq, d).astype(q_tok.dtype)
    prev = jnp.concatenate([lc.score, jnp.zeros((b, hkv, 1), jnp.float32)], axis=2)
    score_all = _policy_score(cfg, probs, prev)
    key = jnp.where(_evictable(cfg, pos_all, position), _policy_key(cfg, score_all, pos_all), jnp.inf)
    at_min = key == jnp.min(key, axis=-1, keepdims=True)
    victim = jnp.argmin(jnp.where(at_min, pos_all, jnp.iinfo(jnp.int32).max), axis=-1)
    empty = lc.pos < 0
    drop = jnp.where(jnp.any(empty, axis=-1), jnp.argmax(empty, axis=-1), victim)
    bi, hi = jnp.arange(b)[:, None], jnp.arange(hkv)[None, :]
    put = lambda x, new: x.at[bi, hi, drop].set(new, mode="drop")
    score = jnp.where(jnp.arange(n) == drop[..., None], score_all[..., n:], score_all[..., :n])
    lc = lc.replace(k=put(lc.k, k_new), v=put(lc.v, v_new), pos=put(lc.pos, jnp.broadcast_to(position, (b, hkv))), score=score)
    return out, lc
