"""Importance scorers: headwise linear, MLP and mLSTM (paper Sec. 3.3, App. A and E).

Every scorer reads the cached keys and values `k, v [B, S, Hkv, D]` of one layer, forms
`x = [k; v]` per KV head (Eq. 35), detaches it (`stop_gradient`: the retention loss
trains only the scorer, Sec. 3.3) and returns raw scores `[B, Hkv, S]` in float32.
Weights are headwise: one matrix per KV head, stored with a leading `Hkv` axis and
applied with einsum. Parameters are float32 and all compute is float32.

The mLSTM scorer (Eq. 37-42) keeps a stabilized matrix memory per KV head. With
delayed readout the score of token u reads the state after token `min(u + w, S - 1)`
with u's own query features (Eq. 41): at query position q the newly eligible token is
`u = q - w` (`policy.py`'s conventions). The last w tokens of a sequence never become eligible inside
it; they read the final state, which is what a decoder that stops at S - 1 would see.
Three forms compute the same scores: `mlstm_recurrent` (token scan, mirrors decoding),
`mlstm_chunkwise` (chunk scan with a parallel quadratic form inside; the training
default) and `mlstm_quadratic` (materializes S x S; the test reference).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax.config import KVpopConfig

NO_WRITE = -1e30  # log input gate of a padding token: writes nothing, keeps m finite
# The readout floor exp(-m) is taken at m clipped to [-MIN_FLOOR_LOG_SCALE, MAX_FLOOR_LOG_SCALE]
# (`stabilized_normalize`). Below -87 exp(-m) overflows float32; |q^T n| <= 2S there, so the floor
# decides the readout either way and clipping changes it by < 1e-37 |num|. Above 60 (a gate
# pre-activation past 60: only with mlstm_gate_softcap = 0 or > 60) the floor stays at e^-60.
MIN_FLOOR_LOG_SCALE = 87.0
MAX_FLOOR_LOG_SCALE = 60.0
MLSTM_MODES = ("chunkwise", "recurrent", "quadratic")


class MLSTMState(NamedTuple):
    """Stabilized mLSTM state per KV head; the true state is `exp(m) * (C, n)`.

    C: [B, Hkv, d, dv] matrix memory (Eq. 38); n: [B, Hkv, d] normalizer (Eq. 39);
    m: [B, Hkv] log-scale stabilizer (max-state of xLSTM). All float32.
    """

    C: jax.Array
    n: jax.Array
    m: jax.Array


def hedgehog(z: jax.Array) -> jax.Array:
    """Hedgehog feature map `[softmax(z); softmax(-z)]` over the last axis (App. A): [..., e] -> [..., 2e]."""
    return jnp.concatenate([jax.nn.softmax(z, axis=-1), jax.nn.softmax(-z, axis=-1)], axis=-1)


FEATURE_MAPS = {"hedgehog": hedgehog, "softmax": lambda z: jax.nn.softmax(z, axis=-1)}


def feature_projection_width(config: KVpopConfig, head_dim: int) -> int:
    """Width of the q/k projections: d/2 for Hedgehog (its features double it), d for softmax (Eq. 37)."""
    d = config.mlstm_features(head_dim)
    return d // 2 if config.mlstm_feature_map == "hedgehog" else d


def scorer_input(k: jax.Array, v: jax.Array) -> jax.Array:
    """`x = [k; v]` per KV head (Eq. 35), float32 and detached: [..., Hkv, D] x2 -> [..., Hkv, 2D]."""
    x = jnp.concatenate([k.astype(jnp.float32), v.astype(jnp.float32)], axis=-1)
    return jax.lax.stop_gradient(x)


def delay_for(seq_len: int, window: int, delayed: bool) -> int:
    """Effective readout delay: `min(w, S - 1)` (a longer delay also reads the final state)."""
    return min(window, seq_len - 1) if delayed else 0


# ----------------------------------------------------------------------------- mLSTM math
# Arrays are head-major: q, k [B, H, T, d], v [B, H, T, dv], log input gate i and log
# forget gate log_f [B, H, T] (soft-capped pre-activation and log-sigmoid of it, Eq. 40).


def mlstm_init_state(batch: int, heads: int, d: int, dv: int) -> MLSTMState:
    """Empty memory: C = 0, n = 0, m = 0 (m_0 is arbitrary since C_0 = n_0 = 0)."""
    z = jnp.zeros
    return MLSTMState(z((batch, heads, d, dv), jnp.float32), z((batch, heads, d), jnp.float32),
                      z((batch, heads), jnp.float32))


def mlstm_step(state: MLSTMState, k: jax.Array, v: jax.Array, i: jax.Array, log_f: jax.Array) -> MLSTMState:
    """Writes one token: k [B, H, d], v [B, H, dv], i, log_f [B, H] (Eq. 38-39, stabilized)."""
    m = jnp.maximum(log_f + state.m, i)
    decay, write = jnp.exp(log_f + state.m - m), jnp.exp(i - m)
    C = decay[..., None, None] * state.C + write[..., None, None] * k[..., :, None] * v[..., None, :]
    n = decay[..., None] * state.n + write[..., None] * k
    return MLSTMState(C, n, m)


def stabilized_normalize(num: jax.Array, den: jax.Array, m: jax.Array) -> jax.Array:
    """`num / max(|den|, exp(-m))` (Eq. 41 on the stabilized state), finite with finite
    gradients at any gate pre-activation: num [..., dv], den and m [...].

    On the true state this is `num_true / max(|q^T n_true|, 1, exp(m - 60))`: the floor's
    exponent is clipped (`MAX_FLOOR_LOG_SCALE`, `MIN_FLOOR_LOG_SCALE`). Unclipped, once m > ~104
    (i > 104 without the soft-cap) exp(-m) is 0 and a one-hot query that misses every written
    key gave 0/0 = NaN; and a query matching its memory at ~1e-32 of the strongest write gave a
    ratio whose gradient overflows float32. Such a query now reads about 0. With the default
    soft-cap (|i| <= 15, so m <= 15) the upper clip never acts.
    """
    return _divide(num, jnp.maximum(jnp.abs(den), _floor(m))[..., None])


@jax.custom_jvp
def _floor(m: jax.Array) -> jax.Array:
    """exp(-m) at m clipped to [-MIN_FLOOR_LOG_SCALE, MAX_FLOOR_LOG_SCALE]: finite, as is its gradient."""
    return jnp.exp(-jnp.clip(m, -MIN_FLOOR_LOG_SCALE, MAX_FLOOR_LOG_SCALE))


@_floor.defjvp
def _floor_jvp(primals, tangents):
    # exp's own rule (-dm * exp(-m)) inside the range, so gradients keep their bits there; 0 outside.
    (m,), (dm,) = primals, tangents
    out = _floor(m)
    inside = (m >= -MIN_FLOOR_LOG_SCALE) & (m <= MAX_FLOOR_LOG_SCALE)
    return out, jnp.where(inside, jax.lax.mul(jax.lax.neg(dm), out), 0.0)


@jax.custom_jvp
def _divide(num: jax.Array, denom: jax.Array) -> jax.Array:
    """num / denom, both [..., dv] (denom > 0)."""
    return num / denom


@_divide.defjvp
def _divide_jvp(primals, tangents):
    # JAX's own rule for div, term for term (so gradients keep their bits where it is finite), but
    # where denom**-2 overflows (denom < ~1e-19) the denominator's term as -(out * dden) / denom:
    # JAX's -dden * num * denom**-2 is inf there (then NaN). The unused branch's factor is zeroed
    # so its transpose multiplies no inf.
    (num, denom), (dnum, dden) = primals, tangents
    out = num / denom
    inv_sq = jax.lax.integer_pow(denom, -2)
    fine = jnp.isfinite(inv_sq)
    from_den = jnp.where(fine, jax.lax.mul(jax.lax.mul(jax.lax.neg(dden), num), jnp.where(fine, inv_sq, 0.0)),
                         -(out * dden) / denom)
    return out, jax.lax.div(dnum, denom) + from_den


def mlstm_readout(state: MLSTMState, q: jax.Array) -> jax.Array:
    """Reads the memory with query features q [B, H, d] -> h [B, H, dv] (Eq. 41).

    Denominator `max(|q^T n|, exp(-m))`, i.e. `max(|q^T n_true|, 1)` on the true state:
    the standard stabilized mLSTM normalizer, which also keeps an almost empty memory
    from blowing up the first reads. The floor is xLSTM's, not the paper's: its Eq. 41 (and
    Eq. 10) divides by `q^T z` with no floor and no absolute value.
    """
    num = jnp.einsum("bhd,bhde->bhe", q, state.C)
    den = jnp.einsum("bhd,bhd->bh", q, state.n)
    return stabilized_normalize(num, den, state.m)


def _shift_for_delay(q, k, v, i, log_f, delay: int, length: int):
    """Pads the time axis to `length` with no-op tokens (f = 1, i = NO_WRITE) and shifts
    the queries right by `delay`, so that readout position t serves token u = t - delay."""
    s = q.shape[2]

    def pad(x, before, value=0.0):
        widths = [(0, 0)] * x.ndim
        widths[2] = (before, length - before - s)
        return jnp.pad(x, widths, constant_values=value)

    return pad(q, delay), pad(k, 0), pad(v, 0), pad(i, 0, NO_WRITE), pad(log_f, 0)


def mlstm_recurrent(q, k, v, i, log_f, delay: int) -> jax.Array:
    """Token-by-token scan (the decoding order): h [B, H, S, dv], h_u reads state min(u + delay, S - 1)."""
    s = q.shape[2]
    q, k, v, i, log_f = _shift_for_delay(q, k, v, i, log_f, delay, s + delay)
    b, h, _, d = k.shape

    def body(state, xs):
        q_t, k_t, v_t, i_t, f_t = xs
        state = mlstm_step(state, k_t, v_t, i_t, f_t)
        return state, mlstm_readout(state, q_t)

    xs = [jnp.moveaxis(x, 2, 0) for x in (q, k, v, i, log_f)]
    _, out = jax.lax.scan(body, mlstm_init_state(b, h, d, v.shape[-1]), xs)
    return jnp.moveaxis(out, 0, 2)[:, :, delay:]


def _chunk(carry: MLSTMState, xs):
    """One chunk: parallel quadratic form inside, carried state from earlier chunks."""
    C, n, m = carry
    q, k, v, i, log_f = xs  # [B, H, L, .]
    L = q.shape[2]
    b = jnp.cumsum(log_f, axis=-1)  # log decay from the chunk start, inclusive
    g = b + m[..., None]  # log weight of the carried state at each position
    D = b[..., :, None] - b[..., None, :] + i[..., None, :]  # [B, H, L, L] log write weights
    D = jnp.where(np.tril(np.ones((L, L), bool)), D, -jnp.inf)
    m_row = jnp.maximum(g, D.max(axis=-1))  # equals the recurrent max-state
    inter = jnp.exp(g - m_row)
    P = jnp.exp(D - m_row[..., None]) * jnp.einsum("bhjd,bhsd->bhjs", q, k)
    num = inter[..., None] * jnp.einsum("bhjd,bhde->bhje", q, C) + jnp.einsum("bhjs,bhse->bhje", P, v)
    den = inter * jnp.einsum("bhjd,bhd->bhj", q, n) + P.sum(axis=-1)
    out = stabilized_normalize(num, den, m_row)
    m_new = m_row[..., -1]
    decay = jnp.exp(g[..., -1] - m_new)
    w = jnp.exp(b[..., -1:] - b + i - m_new[..., None])  # [B, H, L] weight of each write
    C = decay[..., None, None] * C + jnp.einsum("bhs,bhsd,bhse->bhde", w, k, v)
    n = decay[..., None] * n + jnp.einsum("bhs,bhsd->bhd", w, k)
    return MLSTMState(C, n, m_new), out


def mlstm_chunkwise(q, k, v, i, log_f, delay: int, chunk: int) -> jax.Array:
    """Chunkwise-parallel form (training default): h [B, H, S, dv]; pads to a chunk multiple."""
    s = q.shape[2]
    length = -(-(s + delay) // chunk) * chunk
    q, k, v, i, log_f = _shift_for_delay(q, k, v, i, log_f, delay, length)
    b, h, _, d = k.shape

    def split(x):  # [B, H, N*L, ...] -> [N, B, H, L, ...]
        return jnp.moveaxis(x.reshape(b, h, length // chunk, chunk, *x.shape[3:]), 2, 0)

    _, out = jax.lax.scan(_chunk, mlstm_init_state(b, h, d, v.shape[-1]),
                          [split(x) for x in (q, k, v, i, log_f)])
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, length, -1)
    return out[:, :, delay:delay + s]


def mlstm_quadratic(q, k, v, i, log_f, delay: int) -> jax.Array:
    """Reference: materializes the [S, S] log-decay matrix from the definition. h [B, H, S, dv]."""
    s = q.shape[2]
    t_of_u = np.minimum(np.arange(s) + delay, s - 1)  # state each token reads
    F = jnp.cumsum(log_f, axis=-1)  # log prod f_1..f_t
    Ft = F[..., t_of_u]  # decay of the (empty, m_0 = 0) initial state
    D = Ft[..., :, None] - F[..., None, :] + i[..., None, :]  # [B, H, U, S]
    D = jnp.where(np.arange(s)[None, :] <= t_of_u[:, None], D, -jnp.inf)
    m = jnp.maximum(Ft, D.max(axis=-1))
    P = jnp.exp(D - m[..., None]) * jnp.einsum("bhud,bhsd->bhus", q, k)
    num = jnp.einsum("bhus,bhse->bhue", P, v)
    return stabilized_normalize(num, P.sum(axis=-1), m)


_MLSTM_FORMS = {"recurrent": mlstm_recurrent, "quadratic": mlstm_quadratic}


# ----------------------------------------------------------------------------- modules


def _headwise_init(scale: float = 1.0):
    """Lecun-normal per head for a [H, fan_in, fan_out] weight."""
    return nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                            batch_axis=(0,))


def _pathway_init(pathway: int, identity: bool):
    """[H, 2D, e] weight that reads only the key (0) or value (1) half of x = [k; v] at init
    (App. E.5: q/k features start from the key pathway, values from the value pathway).

    identity: the identity-style mapping of E.5, output i = input coordinate i of the pathway
    (zeros beyond min(D, e)); otherwise LeCun-normal on that half.
    """

    def init(key, shape, dtype=jnp.float32):
        heads, two_d, e = shape
        if identity:
            w = jnp.broadcast_to(jnp.eye(two_d // 2, e, dtype=dtype), (heads, two_d // 2, e))
        else:
            w = _headwise_init()(key, (heads, two_d // 2, e), dtype)
        zeros = jnp.zeros_like(w)
        return jnp.concatenate([w, zeros] if pathway == 0 else [zeros, w], axis=1)

    return init


def _linspace_init(start: float, stop: float):
    return lambda key, shape, dtype=jnp.float32: jnp.linspace(start, stop, shape[0], dtype=dtype)


class LinearScorer(nn.Module):
    """Headwise linear scorer `r = w_h^T x + b_h` (Eq. 36). Zero-init: all scores start equal."""

    num_kv_heads: int
    head_dim: int
    config: KVpopConfig

    @nn.compact
    def __call__(self, k: jax.Array, v: jax.Array) -> jax.Array:
        """k, v [B, S, Hkv, D] -> scores [B, Hkv, S] float32."""
        x = scorer_input(k, v)
        w = self.param("w", nn.initializers.zeros, (self.num_kv_heads, 2 * self.head_dim), jnp.float32)
        b = self.param("b", nn.initializers.zeros, (self.num_kv_heads,), jnp.float32)
        return jnp.einsum("bshi,hi->bhs", x, w) + b[:, None]


class MLPScorer(nn.Module):
    """Headwise two-layer SiLU MLP (Sec. 3.3, Eq. 36); the last layer is zero-initialized."""

    num_kv_heads: int
    head_dim: int
    config: KVpopConfig

    @nn.compact
    def __call__(self, k: jax.Array, v: jax.Array) -> jax.Array:
        """k, v [B, S, Hkv, D] -> scores [B, Hkv, S] float32."""
        h, hidden = self.num_kv_heads, self.config.scorer_hidden
        x = scorer_input(k, v)
        w1 = self.param("w1", _headwise_init(), (h, 2 * self.head_dim, hidden), jnp.float32)
        b1 = self.param("b1", nn.initializers.zeros, (h, hidden), jnp.float32)
        w2 = self.param("w2", nn.initializers.zeros, (h, hidden), jnp.float32)
        b2 = self.param("b2", nn.initializers.zeros, (h,), jnp.float32)
        z = jax.nn.silu(jnp.einsum("bshi,hie->bshe", x, w1) + b1)
        return jnp.einsum("bshe,he->bhs", z, w2) + b2[:, None]


class MLSTMScorer(nn.Module):
    """Headwise mLSTM scorer with delayed readout (Eq. 37-42); the options are `KVpopConfig.mlstm_*`.

    Per KV head, from x = [k; v] (2D): q~, k~ = phi(W x) with phi the Hedgehog map of a d/2
    projection (features d; or softmax of a d projection), d = `mlstm_dim` or head_dim (App. A);
    v~ = W_v x (2D -> d/2), or the cached value v itself (dv = D, E.5); scalar gates
    i = exp(i~), f = sigmoid(f~) (Eq. 40), pre-activations soft-capped to +-mlstm_gate_softcap
    (0: off); no output gate. Score (Eq. 42): `a^T SiLU(z) + b` with z = Norm(h) (headwise RMS
    norm, optional) + W_s x_u (skip from the scored token itself, optional). `a` starts at zero
    (neutral ranking, E.5); the projections start identity-style from the key pathway (q, k) and
    the value pathway (v, skip) unless mlstm_init="random"; forget-gate biases at linspace(3, 6)
    over heads (long memory early), input-gate biases at 0, gate weights small.

    Decoding: `init_state`, `step` (write token q) and `readout` (score token u = q - w from its
    cached k, v) are methods for `apply(..., method=...)`.
    """

    num_kv_heads: int
    head_dim: int
    config: KVpopConfig

    def setup(self):
        c, h, two_d = self.config, self.num_kv_heads, 2 * self.head_dim
        f32, identity = jnp.float32, c.mlstm_init == "identity"
        width = feature_projection_width(c, self.head_dim)
        self.w_q = self.param("w_q", _pathway_init(0, identity), (h, two_d, width), f32)
        self.w_k = self.param("w_k", _pathway_init(0, identity), (h, two_d, width), f32)
        if c.mlstm_value == "projection":
            self.w_v = self.param("w_v", _pathway_init(1, identity), (h, two_d, self.dv), f32)
        if c.mlstm_skip:
            self.w_skip = self.param("w_skip", _pathway_init(1, identity), (h, two_d, self.dv), f32)
        if c.mlstm_norm:
            self.norm_scale = self.param("norm_scale", nn.initializers.ones, (h, self.dv), f32)
        self.w_gates = self.param("w_gates", _headwise_init(0.01), (h, two_d, 2), f32)  # [input, forget]
        self.b_igate = self.param("b_igate", nn.initializers.zeros, (h,), f32)
        self.b_fgate = self.param("b_fgate", _linspace_init(3.0, 6.0), (h,), f32)
        self.a = self.param("a", nn.initializers.zeros, (h, self.dv), f32)  # Eq. 42, neutral start
        self.b = self.param("b", nn.initializers.zeros, (h,), f32)

    @property
    def d(self) -> int:
        return self.config.mlstm_features(self.head_dim)

    @property
    def dv(self) -> int:
        return self.config.mlstm_value_dim(self.head_dim)

    def _softcap(self, x: jax.Array) -> jax.Array:
        cap = self.config.mlstm_gate_softcap
        return cap * jnp.tanh(x / cap) if cap > 0 else x

    def features(self, k: jax.Array, v: jax.Array):
        """k, v [..., Hkv, D] -> q~, k~ [..., Hkv, d], v~ [..., Hkv, dv], log i, log f [..., Hkv].

        Eq. 37 (feature map) and Eq. 40 (gates, pre-activations soft-capped).
        """
        x = scorer_input(k, v)
        phi = FEATURE_MAPS[self.config.mlstm_feature_map]
        q = phi(jnp.einsum("...hi,hie->...he", x, self.w_q))
        kk = phi(jnp.einsum("...hi,hie->...he", x, self.w_k))
        if self.config.mlstm_value == "projection":
            vv = jnp.einsum("...hi,hie->...he", x, self.w_v)
        else:
            vv = x[..., self.head_dim:]  # the cached value itself (stop-gradient, float32)
        gates = jnp.einsum("...hi,hig->...hg", x, self.w_gates)
        i_pre = self._softcap(gates[..., 0] + self.b_igate)
        f_pre = self._softcap(gates[..., 1] + self.b_fgate)
        return q, kk, vv, i_pre, jax.nn.log_sigmoid(f_pre)

    def project(self, h: jax.Array, k_u: jax.Array, v_u: jax.Array) -> jax.Array:
        """Readout h [B, Hkv, ..., dv] of tokens u with their cached k_u, v_u [B, ..., Hkv, D]
        -> scores [B, Hkv, ...] (Eq. 42)."""
        lead = (self.num_kv_heads,) + (1,) * (h.ndim - 3)
        z = h
        if self.config.mlstm_norm:
            z = z * jax.lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + 1e-6)
            z = z * self.norm_scale.reshape(*lead, self.dv)
        if self.config.mlstm_skip:
            skip = jnp.einsum("b...hi,hie->bh...e", scorer_input(k_u, v_u), self.w_skip)
            z = z + skip
        return jnp.sum(jax.nn.silu(z) * self.a.reshape(*lead, self.dv), axis=-1) + self.b.reshape(lead)

    def __call__(self, k: jax.Array, v: jax.Array, mode: str = "chunkwise") -> jax.Array:
        """k, v [B, S, Hkv, D] -> scores [B, Hkv, S] float32; mode in MLSTM_MODES."""
        if mode not in MLSTM_MODES:
            raise ValueError(f"mode must be one of {MLSTM_MODES}, got {mode!r}")
        feats = [jnp.moveaxis(t, 1, 2) for t in self.features(k, v)]  # head-major
        delay = delay_for(k.shape[1], self.config.window, self.config.delayed_readout)
        if mode == "chunkwise":
            h = mlstm_chunkwise(*feats, delay=delay, chunk=self.config.mlstm_chunk)
        else:
            h = _MLSTM_FORMS[mode](*feats, delay=delay)
        return self.project(h, k, v)

    def init_state(self, batch: int) -> MLSTMState:
        """Empty state: C [B, Hkv, d, dv], n [B, Hkv, d], m [B, Hkv]."""
        return mlstm_init_state(batch, self.num_kv_heads, self.d, self.dv)

    def step(self, state: MLSTMState, k_t: jax.Array, v_t: jax.Array) -> MLSTMState:
        """Writes token t given its cached k_t, v_t [B, Hkv, D]."""
        _, kk, vv, i_pre, log_f = self.features(k_t, v_t)
        return mlstm_step(state, kk, vv, i_pre, log_f)

    def readout(self, state: MLSTMState, k_u: jax.Array, v_u: jax.Array) -> jax.Array:
        """Scores token u from its cached k_u, v_u [B, Hkv, D] against `state` -> [B, Hkv].

        Decoding with delayed readout: at step q call `step` with token q, then score
        u = q - w (u = q without delay). This reproduces the parallel scores exactly.
        """
        q, *_ = self.features(k_u, v_u)
        return self.project(mlstm_readout(state, q)[:, :, None], k_u[:, None], v_u[:, None])[:, :, 0]


SCORER_CLASSES = {"linear": LinearScorer, "mlp": MLPScorer, "mlstm": MLSTMScorer}


def make_scorer(config: KVpopConfig, num_kv_heads: int, head_dim: int) -> nn.Module:
    """The scorer named by `config.scorer`, for one layer with `num_kv_heads` heads of `head_dim`."""
    return SCORER_CLASSES[config.scorer](num_kv_heads=num_kv_heads, head_dim=head_dim, config=config)
