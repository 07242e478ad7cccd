"""Mechanistic init of the demo teacher: its lookup circuit is planted, then training takes over.

The demo task's hard step is an associative recall over ~300 bindings: the completion writes a
name `q` and must copy the digit that followed `q` where it was bound, up to ~1000 tokens back.
A small model trained from a random init sits on that plateau (MQAR) for far more steps than a
CPU run can afford, so `plant_lookup_circuit` writes the textbook two-layer induction circuit
into the initial weights; everything stays trainable and the curriculum trains it all.

Residual stream (hidden E): T = dims [0, E - 2C) hold a token's identity (its last dim is a
"digit" flag), N = the next C dims a name's code, P = the last C dims the code of the *previous*
token. Embeddings (tied, so also the unembedding): names are their unit code in N (52 codes of
low mutual coherence, `name_codes`); other tokens a random unit vector in T, digits plus the flag.

- Layer 0, KV head 0: a previous-token head (`init_offset_heads`: q/k biases on fast rotary
  pairs); its query head 0 copies N of the previous token into P.
- Layer 1, KV head 0 / query head 1, the recall head (`recall_head`): the same match with q read
  from P, the *previous* token's code: at `=` in a line `q=4` (the recall drills, `data.recall_row`;
  the reuse task's recall lines until stop 33) it finds the digit bound to q (such a line's own digit
  follows `=`, not a name, so it is never matched) and copies it.
- Layer 1, KV head 0 / query head 0, the match head: q reads the current name's code from N,
  k the previous token's code from P plus the digit flag, both onto the slowest rotary pairs
  (`rope_theta` large, so those barely rotate over the demo length and the match ignores
  distance); q_norm/k_norm scales there set the softmax sharpness. q . k is largest at the digit
  right after an earlier occurrence of the current name; v/o copy that digit's T vector into the
  residual, where the tied unembedding reads it out.
- Everything else keeps its random init, with the other heads' o_proj and the MLPs' down_proj
  scaled by `noise_scale` so they start quiet instead of drowning the circuit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from demo.atoms import DIGITS, NAMES, VOCAB
from kvpop_jax.config import Qwen3Config

NAME_IDS = np.asarray([VOCAB[n] for n in NAMES])
DIGIT_IDS = np.asarray([VOCAB[d] for d in DIGITS])


def init_offset_heads(params: dict, config: Qwen3Config, offsets, *, layer: int = 0, n_freq: int = 5,
                      strength: float = 4.0, sharpen: float = 3.0) -> dict:
    """Makes KV head i of `layer` (and its query heads) attend `offsets[i]` tokens back, whatever the tokens.

    A large q/k bias (their kernels scaled by 0.1) fixes q_f = R(-offset * theta_f) k_f on each of
    the `n_freq` fastest rotary pairs f, so the logit q . R((j - i) theta) k = sum_f |k_f|^2
    cos((j - i + offset) theta_f) peaks at j = i - offset; the layer's q_norm/k_norm scales on those
    dims are raised to `sharpen` to make the peak sharp. Training is free to change these heads.
    """
    d, half = config.head_dim, config.head_dim // 2
    n_freq = min(n_freq, half)
    theta = 1.0 / (config.rope_theta ** (np.arange(0, d, 2) / d))
    group = config.num_attention_heads // config.num_key_value_heads
    attn = jax.tree.map(np.array, params[f"layers_{layer}"]["self_attn"])
    for kv_head, offset in enumerate(offsets):
        k, q = np.zeros(d), np.zeros(d)
        k[:n_freq] = 1.0
        angle = -offset * theta[:n_freq]
        q[:n_freq], q[half : half + n_freq] = np.cos(angle), np.sin(angle)
        attn["k_proj"]["bias"][kv_head] = strength * k
        attn["k_proj"]["kernel"][:, kv_head] *= 0.1
        for h in range(kv_head * group, (kv_head + 1) * group):
            attn["q_proj"]["bias"][h] = strength * q
            attn["q_proj"]["kernel"][:, h] *= 0.1
    if offsets:
        for norm in ("q_norm", "k_norm"):
            attn[norm]["scale"][:n_freq] = sharpen
            attn[norm]["scale"][half : half + n_freq] = sharpen
    layer_params = {**params[f"layers_{layer}"], "self_attn": jax.tree.map(jnp.asarray, attn)}
    return {**params, f"layers_{layer}": layer_params}


def name_codes(n: int, dim: int, seed: int, steps: int = 500) -> np.ndarray:
    """n unit vectors [n, dim] of low mutual coherence: random, then gradient steps on sum (c_i . c_j)^4."""
    rng = np.random.default_rng((seed, 17))
    c = rng.standard_normal((n, dim))
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    for _ in range(steps):
        g = c @ c.T
        np.fill_diagonal(g, 0.0)
        c -= 0.05 * (4 * g**3) @ c
        c /= np.linalg.norm(c, axis=1, keepdims=True)
    return c


def static_dims(config: Qwen3Config, n: int) -> np.ndarray:
    """The n head dims of the slowest rotary pairs (rotate-half layout: pair f is dims f, f + D/2)."""
    half = config.head_dim // 2
    pairs = np.arange(half - (n + 1) // 2, half)
    return np.concatenate([pairs, pairs + half])[:n]


def plant_lookup_circuit(params: dict, config: Qwen3Config, seed: int, *, code_dims: int = 32,
                         sharpen: float = 3.0, copy_gain: float = 3.0, noise_scale: float = 0.1,
                         recall_head: bool = False) -> dict:
    """The random `params` with the lookup circuit of the module docstring written in (returns new params).

    Needs 2 + 2 * code_dims <= hidden_size, code_dims + 1 <= head_dim, attention_bias and >= 2 layers.
    `sharpen`: the match head's q_norm/k_norm scale on its dims (max logit 8 * sharpen^2 * cos at
    head_dim 64); `copy_gain`: the digit vector the match head writes, relative to the embeddings.
    """
    e, d, c = config.hidden_size, config.head_dim, code_dims
    t = e - 2 * c
    if t < 2 or c + 1 > d or config.num_hidden_layers < 2 or not config.attention_bias:
        raise ValueError(f"plant_lookup_circuit needs hidden >= 2 + 2 * {c}, head_dim >= {c + 1}, 2 layers and "
                         f"attention_bias; got {config}")
    N, P, FLAG = slice(t, t + c), slice(t + c, e), t - 1  # token identity dims are [0, t)
    rng = np.random.default_rng((seed, 23))
    p = jax.tree.map(np.array, params)

    emb = np.zeros_like(p["embed_tokens"]["embedding"])
    tok = rng.standard_normal((emb.shape[0], t - 1))
    emb[:, : t - 1] = tok / np.linalg.norm(tok, axis=1, keepdims=True)
    emb[DIGIT_IDS, FLAG] = 1.0
    emb[NAME_IDS] = 0.0
    emb[NAME_IDS, N] = name_codes(len(NAME_IDS), c, seed)
    p["embed_tokens"]["embedding"] = emb

    for i in range(config.num_hidden_layers):
        layer = p[f"layers_{i}"]
        layer["mlp"]["down_proj"]["kernel"] *= noise_scale
        layer["self_attn"]["o_proj"]["kernel"] *= noise_scale
    # An RMSNorm input has norm ~sqrt(E) per unit of residual norm; 1/sqrt(E) undoes that.
    unit = 1.0 / np.sqrt(e)

    # Layer 0, query head 0 (KV head 0, the previous-token head): v = N of the previous token, o -> P.
    a0 = p["layers_0"]["self_attn"]
    a0["v_proj"]["kernel"][:, 0] = 0.0
    a0["v_proj"]["kernel"][N, 0, :c] = unit * np.eye(c)
    a0["v_proj"]["bias"][0] = 0.0
    a0["o_proj"]["kernel"][0] = 0.0
    a0["o_proj"]["kernel"][0, :c, P] = np.eye(c)

    # Layer 1, query head 0 (KV head 0): q = (own code, 1), k = (previous code, digit flag) on static dims.
    a1 = p["layers_1"]["self_attn"]
    dims = static_dims(config, c + 1)
    for proj in ("q_proj", "k_proj"):
        a1[proj]["kernel"][:, 0] = 0.0
        a1[proj]["bias"][0] = 0.0
    a1["q_proj"]["kernel"][N, 0, dims[:c]] = unit * np.eye(c)
    a1["q_proj"]["bias"][0, dims[c]] = 1.0
    a1["k_proj"]["kernel"][P, 0, dims[:c]] = unit * np.eye(c)
    a1["k_proj"]["kernel"][FLAG, 0, dims[c]] = unit
    for norm in ("q_norm", "k_norm"):
        a1[norm]["scale"][dims] = sharpen
    # v/o: copy the key token's T vector (its identity) to the query position.
    a1["v_proj"]["kernel"][:, 0] = 0.0
    m = min(t, d)  # the flag (dim t - 1) and the first m - 1 identity dims
    a1["v_proj"]["kernel"][t - m : t, 0, :m] = unit * np.eye(m)
    a1["v_proj"]["bias"][0] = 0.0
    a1["o_proj"]["kernel"][0] = 0.0
    a1["o_proj"]["kernel"][0, :m, t - m : t] = copy_gain * np.eye(m)
    if recall_head:  # query head 1 shares KV head 0's keys and values; its query is the previous code
        a1["q_proj"]["kernel"][:, 1] = 0.0
        a1["q_proj"]["bias"][1] = 0.0
        a1["q_proj"]["kernel"][P, 1, dims[:c]] = unit * np.eye(c)
        a1["q_proj"]["bias"][1, dims[c]] = 1.0
        a1["o_proj"]["kernel"][1] = 0.0
        a1["o_proj"]["kernel"][1, :m, t - m : t] = copy_gain * np.eye(m)
    return jax.tree.map(jnp.asarray, p)
