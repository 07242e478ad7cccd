"""The KVpop scorers in torch: linear, MLP and mLSTM, the same math as `kvpop_jax/scorers.py`.

Every scorer reads one layer's cached keys and values `k, v [B, S, Hkv, D]` (after RoPE, as
cached, or with the rotation undone: `KVpopHead.scorer_keys`), forms `x = [k; v]` per KV head in float32 and returns raw scores `[B, Hkv, S]` in
float32. Parameters keep the export's names and shapes (one matrix per KV head, leading
`Hkv` axis), so `KVpopHead.load_state_dict` takes the tensors saved as
`model.layers.{i}.self_attn.kvpop.<name>` with the prefix stripped.

mLSTM (paper Eq. 37-42, App. A, E.5): stabilized state `(C, n, m)` with the true state
`exp(m) (C, n)`, readout denominator `max(|q^T n|, exp(-m))`. With delayed readout the score
of token u reads the state after token `min(u + w, S - 1)` with u's own query features. The
prefill and a multi-token continuation (`continue_scores`) use the chunkwise-parallel form; decoding
uses `step` / `readout` token by token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvpop_torch.config import KVpopSettings

NO_WRITE = -1e30  # log input gate of a padding token: writes nothing, keeps m finite
MIN_FLOOR_LOG_SCALE, MAX_FLOOR_LOG_SCALE = 87.0, 60.0  # the readout floor's clip (kvpop_jax.scorers)


class MLSTMState(NamedTuple):
    """C [B, Hkv, d, dv], n [B, Hkv, d], m [B, Hkv]; float32."""

    C: torch.Tensor
    n: torch.Tensor
    m: torch.Tensor


def scorer_input(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`x = [k; v]` per KV head (Eq. 35) in float32, detached: [..., Hkv, D] x2 -> [..., Hkv, 2D]."""
    return torch.cat([k.float(), v.float()], dim=-1).detach()


def hedgehog(z: torch.Tensor) -> torch.Tensor:
    """`[softmax(z); softmax(-z)]` over the last axis (App. A): [..., e] -> [..., 2e]."""
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


FEATURE_MAPS = {"hedgehog": hedgehog, "softmax": lambda z: torch.softmax(z, dim=-1)}


def delay_for(seq_len: int, window: int, delayed: bool) -> int:
    """Effective readout delay `min(w, S - 1)` (a longer delay also reads the final state)."""
    return min(window, seq_len - 1) if delayed else 0


# ----------------------------------------------------------------------------- mLSTM math
# Head-major: q, k [B, H, T, d], v [B, H, T, dv], log input gate i and log forget gate log_f [B, H, T].


def mlstm_init_state(batch: int, heads: int, d: int, dv: int, device=None) -> MLSTMState:
    z = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)  # noqa: E731
    return MLSTMState(z(batch, heads, d, dv), z(batch, heads, d), z(batch, heads))


def mlstm_step(state: MLSTMState, k, v, i, log_f) -> MLSTMState:
    """Writes one token: k [B, H, d], v [B, H, dv], i, log_f [B, H] (Eq. 38-39, stabilized)."""
    m = torch.maximum(log_f + state.m, i)
    decay, write = torch.exp(log_f + state.m - m), torch.exp(i - m)
    C = decay[..., None, None] * state.C + write[..., None, None] * k[..., :, None] * v[..., None, :]
    n = decay[..., None] * state.n + write[..., None] * k
    return MLSTMState(C, n, m)


def stabilized_normalize(num: torch.Tensor, den: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`num / max(|den|, exp(-m))`: num [..., dv], den, m [...], with the floor's exponent m clipped
    to [-87, 60] as in `kvpop_jax.scorers.stabilized_normalize`: finite at any gate pre-activation
    (unclipped, m > ~104 and a one-hot query missing every written key gave 0/0 = NaN)."""
    floor = torch.exp(-m.clamp(min=-MIN_FLOOR_LOG_SCALE, max=MAX_FLOOR_LOG_SCALE))
    return num / torch.maximum(den.abs(), floor)[..., None]


def mlstm_readout(state: MLSTMState, q: torch.Tensor) -> torch.Tensor:
    """q [B, H, d] -> h [B, H, dv] (Eq. 41), denominator max(|q^T n|, exp(-m))."""
    num = torch.einsum("bhd,bhde->bhe", q, state.C)
    den = torch.einsum("bhd,bhd->bh", q, state.n)
    return stabilized_normalize(num, den, state.m)


def _pad_time(x: torch.Tensor, before: int, length: int, value: float = 0.0) -> torch.Tensor:
    """Pads axis 2 of x to `length` with `before` entries in front."""
    after = length - before - x.shape[2]
    pad = [0, 0] * (x.ndim - 3) + [before, after]
    return F.pad(x, pad, value=value)


def _chunk(state: MLSTMState, q, k, v, i, log_f):
    """One chunk [B, H, L, .]: the parallel quadratic form inside, the carried state from before."""
    C, n, m = state
    L = q.shape[2]
    b = torch.cumsum(log_f, dim=-1)
    g = b + m[..., None]
    D = b[..., :, None] - b[..., None, :] + i[..., None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    D = torch.where(causal, D, torch.tensor(-math.inf, device=q.device))
    m_row = torch.maximum(g, D.amax(dim=-1))
    inter = torch.exp(g - m_row)
    P = torch.exp(D - m_row[..., None]) * torch.einsum("bhjd,bhsd->bhjs", q, k)
    num = inter[..., None] * torch.einsum("bhjd,bhde->bhje", q, C) + torch.einsum("bhjs,bhse->bhje", P, v)
    den = inter * torch.einsum("bhjd,bhd->bhj", q, n) + P.sum(dim=-1)
    out = stabilized_normalize(num, den, m_row)
    m_new = m_row[..., -1]
    decay = torch.exp(g[..., -1] - m_new)
    w = torch.exp(b[..., -1:] - b + i - m_new[..., None])
    C = decay[..., None, None] * C + torch.einsum("bhs,bhsd,bhse->bhde", w, k, v)
    n = decay[..., None] * n + torch.einsum("bhs,bhsd->bhd", w, k)
    return MLSTMState(C, n, m_new), out


def mlstm_chunkwise(q, k, v, i, log_f, delay: int, chunk: int) -> tuple[torch.Tensor, MLSTMState]:
    """Chunkwise-parallel mLSTM: (h [B, H, S, dv] with h_u reading state min(u + delay, S - 1),
    the state after the last token)."""
    bsz, heads, s, d = k.shape
    length = -(-(s + delay) // chunk) * chunk
    q = _pad_time(q, delay, length)
    k, v = _pad_time(k, 0, length), _pad_time(v, 0, length)
    i, log_f = _pad_time(i, 0, length, NO_WRITE), _pad_time(log_f, 0, length)
    h, state = _chunks(mlstm_init_state(bsz, heads, d, v.shape[-1], q.device), q, k, v, i, log_f, chunk)
    return h[:, :, delay:delay + s], state


def _chunks(state: MLSTMState, q, k, v, i, log_f, chunk: int) -> tuple[torch.Tensor, MLSTMState]:
    """`_chunk` over a length that is a multiple of `chunk`, carrying the state."""
    outs = []
    for c in range(0, q.shape[2], chunk):
        sl = slice(c, c + chunk)
        state, out = _chunk(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], i[:, :, sl], log_f[:, :, sl])
        outs.append(out)
    return torch.cat(outs, dim=2), state


def mlstm_continue(state: MLSTMState, q, k, v, i, log_f, chunk: int) -> tuple[torch.Tensor, MLSTMState]:
    """L more tokens on a carried state, chunkwise-parallel: (h [B, H, L, dv] with h_j the readout of query j
    against the state right after token j, as `mlstm_step` then `mlstm_readout` give it; the state after
    the last token). Padding to a multiple of `chunk` writes nothing (log input gate NO_WRITE)."""
    n = q.shape[2]
    length = -(-n // chunk) * chunk
    h, state = _chunks(state, *(_pad_time(x, 0, length) for x in (q, k, v)), _pad_time(i, 0, length, NO_WRITE),
                       _pad_time(log_f, 0, length), chunk)
    return h[:, :, :n], state


# ----------------------------------------------------------------------------- modules


def _param(*shape) -> nn.Parameter:
    """A float32 parameter, filled by `load_state_dict` from the export."""
    return nn.Parameter(torch.zeros(shape, dtype=torch.float32), requires_grad=False)


class LinearScorer(nn.Module):
    """`r = w_h^T x + b_h` (Eq. 36): w [Hkv, 2D], b [Hkv]."""

    def __init__(self, settings: KVpopSettings, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.w = _param(num_kv_heads, 2 * head_dim)
        self.b = _param(num_kv_heads)

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [B, S, Hkv, D] -> scores [B, Hkv, S] float32."""
        return torch.einsum("bshi,hi->bhs", scorer_input(k, v), self.w) + self.b[:, None]


class MLPScorer(nn.Module):
    """Two-layer SiLU MLP per KV head: w1 [Hkv, 2D, hidden], b1, w2 [Hkv, hidden], b2."""

    def __init__(self, settings: KVpopSettings, num_kv_heads: int, head_dim: int):
        super().__init__()
        h, hidden = num_kv_heads, settings.scorer_hidden
        self.w1, self.b1 = _param(h, 2 * head_dim, hidden), _param(h, hidden)
        self.w2, self.b2 = _param(h, hidden), _param(h)

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [B, S, Hkv, D] -> scores [B, Hkv, S] float32."""
        z = F.silu(torch.einsum("bshi,hie->bshe", scorer_input(k, v), self.w1) + self.b1)
        return torch.einsum("bshe,he->bhs", z, self.w2) + self.b2[:, None]


class MLSTMScorer(nn.Module):
    """mLSTM scorer with (optionally) delayed readout; every `KVpopSettings.mlstm_*` option.

    q~, k~ = phi(W x) (Hedgehog of a d/2 projection, or softmax of a d projection); v~ = W_v x
    or the cached value itself; gates i = exp(i~), f = sigmoid(f~) with pre-activations
    soft-capped to +-mlstm_gate_softcap (0: off); score `a^T SiLU(z) + b` with z = Norm(h)
    (optional headwise RMS norm) + W_skip x_u (optional skip).
    """

    def __init__(self, settings: KVpopSettings, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.settings, self.head_dim = settings, head_dim
        h, two_d = num_kv_heads, 2 * head_dim
        self.d, self.dv = settings.mlstm_features(head_dim), settings.mlstm_value_dim(head_dim)
        width = self.d // 2 if settings.mlstm_feature_map == "hedgehog" else self.d
        self.w_q, self.w_k = _param(h, two_d, width), _param(h, two_d, width)
        if settings.mlstm_value == "projection":
            self.w_v = _param(h, two_d, self.dv)
        if settings.mlstm_skip:
            self.w_skip = _param(h, two_d, self.dv)
        if settings.mlstm_norm:
            self.norm_scale = _param(h, self.dv)
        self.w_gates = _param(h, two_d, 2)  # [input, forget]
        self.b_igate, self.b_fgate = _param(h), _param(h)
        self.a, self.b = _param(h, self.dv), _param(h)

    def _softcap(self, x: torch.Tensor) -> torch.Tensor:
        cap = self.settings.mlstm_gate_softcap
        return cap * torch.tanh(x / cap) if cap > 0 else x

    def query_features(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [..., Hkv, D] -> q~ [..., Hkv, d] (all a readout needs of `features`)."""
        x = scorer_input(k, v)
        return FEATURE_MAPS[self.settings.mlstm_feature_map](torch.einsum("...hi,hie->...he", x, self.w_q))

    def features(self, k: torch.Tensor, v: torch.Tensor):
        """k, v [..., Hkv, D] -> q~, k~ [..., Hkv, d], v~ [..., Hkv, dv], log i, log f [..., Hkv]."""
        x = scorer_input(k, v)
        phi = FEATURE_MAPS[self.settings.mlstm_feature_map]
        q = phi(torch.einsum("...hi,hie->...he", x, self.w_q))
        kk = phi(torch.einsum("...hi,hie->...he", x, self.w_k))
        if self.settings.mlstm_value == "projection":
            vv = torch.einsum("...hi,hie->...he", x, self.w_v)
        else:
            vv = x[..., self.head_dim:]
        gates = torch.einsum("...hi,hig->...hg", x, self.w_gates)
        i_pre = self._softcap(gates[..., 0] + self.b_igate)
        f_pre = self._softcap(gates[..., 1] + self.b_fgate)
        return q, kk, vv, i_pre, F.logsigmoid(f_pre)

    def project(self, h: torch.Tensor, k_u: torch.Tensor, v_u: torch.Tensor) -> torch.Tensor:
        """Readouts h [B, Hkv, S, dv] of tokens u with their k_u, v_u [B, S, Hkv, D] -> scores [B, Hkv, S]."""
        z = h
        if self.settings.mlstm_norm:
            z = z * torch.rsqrt(torch.mean(z * z, dim=-1, keepdim=True) + 1e-6)
            z = z * self.norm_scale[:, None, :]
        if self.settings.mlstm_skip:
            z = z + torch.einsum("bshi,hie->bhse", scorer_input(k_u, v_u), self.w_skip)
        return torch.sum(F.silu(z) * self.a[:, None, :], dim=-1) + self.b[:, None]

    def scores_and_state(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, MLSTMState]:
        """k, v [B, S, Hkv, D] -> (scores [B, Hkv, S], the state after the last token)."""
        feats = [t.transpose(1, 2) for t in self.features(k, v)]  # head-major
        delay = delay_for(k.shape[1], self.settings.window, self.settings.delayed_readout)
        h, state = mlstm_chunkwise(*feats, delay=delay, chunk=self.settings.mlstm_chunk)
        return self.project(h, k, v), state

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [B, S, Hkv, D] -> scores [B, Hkv, S] float32."""
        return self.scores_and_state(k, v)[0]

    def continue_scores(self, state: MLSTMState, k, v, k_read, v_read) -> tuple[torch.Tensor, MLSTMState]:
        """L more tokens k, v [B, L, Hkv, D] written on `state`, chunkwise: (scores [B, Hkv, L], the state after
        the last), score j that of the token k_read, v_read [B, L, Hkv, D] read right after token j is written,
        what `step` then `readout` give token by token."""
        _, kk, vv, i_pre, log_f = self.features(k, v)
        q = self.query_features(k_read, v_read)
        h, state = mlstm_continue(state, *(x.transpose(1, 2) for x in (q, kk, vv, i_pre, log_f)),
                                  chunk=self.settings.mlstm_chunk)
        return self.project(h, k_read, v_read), state

    def init_state(self, batch: int, device=None) -> MLSTMState:
        return mlstm_init_state(batch, self.w_q.shape[0], self.d, self.dv, device)

    def step(self, state: MLSTMState, k_t: torch.Tensor, v_t: torch.Tensor) -> MLSTMState:
        """Writes token t given its cached k_t, v_t [B, Hkv, D]."""
        _, kk, vv, i_pre, log_f = self.features(k_t, v_t)
        return mlstm_step(state, kk, vv, i_pre, log_f)

    def readout(self, state: MLSTMState, k_u: torch.Tensor, v_u: torch.Tensor) -> torch.Tensor:
        """Scores token u from its cached k_u, v_u [B, Hkv, D] against `state` -> [B, Hkv]."""
        q = self.query_features(k_u, v_u)
        return self.project(mlstm_readout(state, q)[:, :, None], k_u[:, None], v_u[:, None])[:, :, 0]


SCORER_CLASSES = {"linear": LinearScorer, "mlp": MLPScorer, "mlstm": MLSTMScorer}


def unrotate(k: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Undoes rotate-half RoPE (`kvpop_jax.rope.unrotate`): k [B, S, Hkv, D] rotated at positions
    (int, broadcastable to [B, S]) -> float32, the key before its rotation."""
    d = k.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=k.device) / d))
    freqs = positions.to(device=k.device, dtype=torch.float32)[..., None] * inv_freq  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [B, S, 1, D]
    x = k.float()
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * torch.cos(emb) - rotated * torch.sin(emb)


class KVpopHead(nn.Module):
    """One layer's scorer and decay parameter α per KV head (`self_attn.kvpop` of the export).

    `rope_theta` (the model's) is needed when the scorer reads unrotated keys (`settings.scorer_keys`).
    """

    def __init__(self, settings: KVpopSettings, num_kv_heads: int, head_dim: int, rope_theta: float | None = None):
        super().__init__()
        if settings.scorer_keys == "unrotated" and rope_theta is None:
            raise ValueError("kvpop.scorer_keys='unrotated' needs the model's rope_theta (config.json has none)")
        self.settings, self.rope_theta = settings, rope_theta
        self.scorer = SCORER_CLASSES[settings.scorer](settings, num_kv_heads, head_dim)
        self.decay_alpha = _param(num_kv_heads)
        if settings.scorer_position == "log":
            self.position_weight = _param(num_kv_heads)

    def position_term(self, t: torch.Tensor) -> torch.Tensor | float:
        """a_h * log(1 + t) for `settings.scorer_position == "log"` (t int [] -> [Hkv], [S] -> [Hkv, S]),
        else 0; as `kvpop_jax.kvpop.KVpopHead.position_term`."""
        if self.settings.scorer_position == "none":
            return 0.0
        t = torch.as_tensor(t, device=self.decay_alpha.device).float()
        return self.position_weight.float().reshape((-1,) + (1,) * t.ndim) * torch.log1p(t)

    def scorer_keys(self, k: torch.Tensor, positions) -> torch.Tensor:
        """The keys the scorer reads: k [B, S, Hkv, D] (rotated at `positions`, int broadcastable to
        [B, S]) as cached, or unrotated."""
        if self.settings.scorer_keys == "rotated":
            return k
        positions = torch.as_tensor(positions, device=k.device).expand(k.shape[0], k.shape[1])
        return unrotate(k, positions, self.rope_theta)

    def log_gamma(self) -> torch.Tensor:
        """log γ_h = log γ_min + sigmoid(α_h) (log γ_max − log γ_min), float32 [Hkv] (Eq. 21)."""
        lo, hi = self.settings.log_gamma_bounds
        return lo + torch.sigmoid(self.decay_alpha.float()) * (hi - lo)


def static_priority(scores: torch.Tensor, log_gamma: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`p_t = r_t − t·log γ_h` (Eq. 20) in float32, as `kvpop_jax.policy.static_priority`.

    scores [B, Hkv, S]; log_gamma [Hkv]; positions int, broadcastable to scores.
    """
    return scores.float() - positions.float() * log_gamma[:, None]
