"""Qwen3 causal LM in Flax Linen (dense attention; KVpop plugs in through `kvpop.py`, DMS through `dms.py`).

Parameter layout (the table in `checkpoint.py` maps HF names onto it):

  embed_tokens/embedding            [vocab, embed]
  layers_{i}/input_layernorm/scale  [embed]
  layers_{i}/self_attn/{q,k,v}_proj/kernel  [embed, heads, head_dim]   (+ bias [heads, head_dim])
  layers_{i}/self_attn/o_proj/kernel        [heads, head_dim, embed]   (+ bias [embed])
  layers_{i}/self_attn/{q,k}_norm/scale     [head_dim]
  layers_{i}/post_attention_layernorm/scale [embed]
  layers_{i}/mlp/{gate,up}_proj/kernel [embed, mlp];  mlp/down_proj/kernel [mlp, embed]
  norm/scale [embed];  lm_head/kernel [embed, vocab]  (absent when embeddings are tied:
  the head then *is* embed_tokens/embedding, shared, not copied)

Shapes: B batch, S query length, T key length (cache), E embed, Hq query heads, Hkv KV
heads, D head_dim, F mlp, V vocab; a `_BxSxE` suffix names an array's axes.
"""

from __future__ import annotations

from typing import Any

import dataclasses
import inspect

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax import attention as attn_lib
from kvpop_jax import sharding as shd
from kvpop_jax.cache import Cache
from kvpop_jax.config import Qwen3Config
from kvpop_jax.dms import DMS_SUBTREE, DMSGate, dms_layer_attention
from kvpop_jax.kvpop import KVpopHead, kvpop_layer_attention, window_layer_attention
from kvpop_jax.rope import apply_rope, rope_cos_sin

Dtype = Any

# Per-layer rematerialization (`Qwen3ForCausalLM.remat_policy`): what a layer keeps for the
# backward pass. "full" keeps nothing but the layer's inputs.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


KVPOP_SUBTREE = "kvpop"  # layers_{i}/self_attn/kvpop: the scorer and decay of a retrofitted layer
RETROFIT_SUBTREES = (KVPOP_SUBTREE, DMS_SUBTREE)  # the new parameters of a retrofit (KVpop or DMS)
DMS_RNG = "dms"  # the rng stream of DMS's relaxation noise: given, a DMS model trains (soft gates)


def check_token_ids(ids, vocab_size: int, what: str = "input_ids") -> None:
    """Raises ValueError naming the first id outside [0, vocab_size). Host-side, so traced ids (under
    jit) are not checked: there an id >= vocab embeds as NaN (JAX's out-of-bounds gather fill) and a
    negative one wraps around, as numpy indexing does."""
    try:
        ids = np.asarray(ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced
    if ids.size == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise ValueError(f"{what} holds token id {int(ids[bad].flat[0])} outside the vocabulary [0, {vocab_size})")


@flax.struct.dataclass
class CausalLMOutput:
    """logits [B, S, V] float32 (None with `return_hidden`); cache (`cache.Cache` or None);
    aux: per-layer extras (KVpop); hidden [B, S, E]: the final normed hidden states (only
    with `return_hidden`; `Qwen3ForCausalLM.logits_from_hidden` maps them to logits)."""

    logits: jax.Array | None
    cache: Cache | None = None
    aux: Any = None
    hidden: jax.Array | None = None


class RMSNorm(nn.Module):
    eps: float
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # HF casts back to the input dtype before the weight multiply.
        return scale.astype(self.dtype) * x32.astype(self.dtype)


class Attention(nn.Module):
    config: Qwen3Config
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        dense = lambda feats, axis, name: nn.DenseGeneral(  # noqa: E731
            feats, axis=axis, use_bias=c.attention_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        self.q_proj = dense((c.num_attention_heads, c.head_dim), -1, "q_proj")
        self.k_proj = dense((c.num_key_value_heads, c.head_dim), -1, "k_proj")
        self.v_proj = dense((c.num_key_value_heads, c.head_dim), -1, "v_proj")
        self.o_proj = dense(c.hidden_size, (-2, -1), "o_proj")
        self.q_norm = RMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype)
        self.k_norm = RMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype)
        if c.kvpop is not None:
            self.kvpop = KVpopHead(c.kvpop, c.num_key_value_heads, c.head_dim, rope_theta=c.rope_theta,
                                   name=KVPOP_SUBTREE)
        if c.dms is not None:
            self.dms = DMSGate(c.dms, c.num_key_value_heads, c.head_dim, name=DMS_SUBTREE)

    def project_qkv(self, x_BxSxE: jax.Array, positions: jax.Array):
        """x [B, S, E] -> q [B, S, H, D], k, v [B, S, K, D] (normed, rotated)."""
        c = self.config
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        q = apply_rope(self.q_norm(self.q_proj(x_BxSxE)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x_BxSxE)), cos, sin)
        v = self.v_proj(x_BxSxE)
        return q, k, v

    def __call__(self, x_BxSxE, positions, segment_ids=None, layer_cache=None, cache_length=None,
                 decoding=False, query_samples=None, return_policy=False, row_lengths=None):
        """Returns (out [B, S, E], new layer cache or None, KVpop aux or None).

        With `layer_cache` (any `cache.LayerCache`): its `decode` when `decoding`, else its
        `prefill`. Without: the dense causal attention, KVpop's masked parallel forward, or DMS's
        (soft, relaxed gates when the `DMS_RNG` stream is given, hard decisions otherwise).
        """
        q, k, v = self.project_qkv(x_BxSxE, positions)
        c = self.config
        policy = self.kvpop if c.kvpop is not None else (self.dms if c.dms is not None else None)
        if layer_cache is not None:
            kw = dict(positions=positions, length=cache_length, policy=policy)
            if decoding:
                (out, new_cache), aux = layer_cache.decode(q, k, v, **kw), None
            else:
                out, new_cache, aux = layer_cache.prefill(q, k, v, return_policy=return_policy, **kw)
            return self.o_proj(out), new_cache, aux
        if policy is not None and segment_ids is not None:
            raise ValueError(
                "KVpop and DMS attention do not reset at segment boundaries (the paper packs without "
                "resetting); pass segment_ids=None for a retrofitted model"
            )
        if c.dms is not None:
            g = policy(k, v)
            noise = jax.random.logistic(self.make_rng(DMS_RNG), g.shape) if self.has_rng(DMS_RNG) else None
            out, aux = dms_layer_attention(q, k, v, g, c.dms, noise=noise, return_policy=return_policy,
                                           row_lengths=row_lengths)
            return self.o_proj(out), None, aux
        if policy is not None and c.kvpop.topk == 0 and query_samples is None and not return_policy \
                and not self.is_initializing():  # StreamingLLM+: no score can matter (init still makes the scorer)
            return self.o_proj(window_layer_attention(q, k, v, c.kvpop)), None, None
        if policy is not None:
            scores, log_gamma = policy(k, v, positions)
            out, aux = kvpop_layer_attention(
                q, k, v, scores, log_gamma, self.config.kvpop, q_idx=query_samples, row_lengths=row_lengths,
                return_policy=return_policy,
            )
            return self.o_proj(out), None, aux
        out, lse = attn_lib.dense_attention(
            q, k, v, q_positions=positions, kv_positions=positions,
            q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
        )
        # q [B, S, Hq, D], k [B, S, Hkv, D] (rotated) and lse [B, Hq, S], for losses on the attention
        # weights (the demo teacher's parking loss) without a second pass; a no-op unless
        # `apply(..., mutable=["intermediates"])` asks for them.
        self.sow("intermediates", "attention", (q, k, lse))
        return self.o_proj(out), None, None


class MLP(nn.Module):
    config: Qwen3Config
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxSxE):
        c = self.config
        dense = lambda feats, name: nn.Dense(  # noqa: E731
            feats, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        # One row per token: the same products bit for bit, but XLA:CPU then lays out the weight gradients
        # without the strided transposes it fuses with SiLU's backward for [B, S, E] (StreamingLLM+'s 2-core step
        # 0.61 -> 0.54 s; BENCHMARKS.md, stop 60). `length` is never sharded: the merge moves no data.
        x_TxE = x_BxSxE.reshape(-1, x_BxSxE.shape[-1])
        gate = dense(c.intermediate_size, "gate_proj")(x_TxE)
        up = dense(c.intermediate_size, "up_proj")(x_TxE)
        return dense(c.hidden_size, "down_proj")(nn.silu(gate) * up).reshape(x_BxSxE.shape)


class DecoderLayer(nn.Module):
    config: Qwen3Config
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxSxE, positions, segment_ids=None, layer_cache=None, cache_length=None,
                 decoding=False, query_samples=None, return_policy=False, row_lengths=None):
        """x [B, S, E] -> (x [B, S, E], new layer cache or None, KVpop aux or None).

        The residual stream is pinned to (batch, length, act_embed) under an active mesh.
        """
        c = self.config
        x_BxSxE = shd.constrain(x_BxSxE, ("batch", "length", "act_embed"))
        h = RMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype, name="input_layernorm")(x_BxSxE)
        h, new_cache, aux = Attention(c, self.dtype, self.param_dtype, name="self_attn")(
            h, positions, segment_ids, layer_cache, cache_length, decoding, query_samples, return_policy,
            row_lengths,
        )
        x_BxSxE = x_BxSxE + h
        h = RMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype, name="post_attention_layernorm")(x_BxSxE)
        x_BxSxE = x_BxSxE + MLP(c, self.dtype, self.param_dtype, name="mlp")(h)
        return shd.constrain(x_BxSxE, ("batch", "length", "act_embed")), new_cache, aux


class LMHead(nn.Module):
    """The untied output projection: kernel [E, V] (the path and init of `nn.Dense`)."""

    vocab_size: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxSxE):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x_BxSxE.shape[-1], self.vocab_size),
                            self.param_dtype)
        return _project_to_vocab(x_BxSxE, kernel, self.dtype)


def _project_to_vocab(x_BxSxE, w_ExV, dtype):
    """hidden [B, S, E] @ weight [E, V] in `dtype` -> logits float32 [B, S, V].

    The weight is gathered over fsdp (vocab stays split over tensor) before the matmul:
    left to itself, SPMD may instead split the contraction and all-gather the `[B, S, V]`
    logits across the batch (4.6 GB per 1024-token chunk for Qwen3-8B).
    """
    w_ExV = shd.constrain(w_ExV.astype(dtype), (None, "vocab"))
    logits = jnp.dot(x_BxSxE.astype(dtype), w_ExV)
    return shd.constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder-only LM.

    `apply({"params": p}, input_ids)` -> CausalLMOutput with logits [B, S, V] (float32).
    With `config.dms` set, every layer attends through DMS's eviction gates: hard decisions, or
    relaxed ones with `rngs={"dms": key}` (training; `aux["dms_frac"]` [B] then feeds the
    auxiliary loss). With `config.kvpop` set, every layer attends through the KVpop mask of its scorer;
    `query_samples` (int [B, Nq], saturated positions) adds the retention loss and
    metrics to `aux`, and `return_policy=True` adds per-layer scores/ranks/cutoffs
    (and targets/boundaries when `query_samples` is given). `row_lengths` (int [B], optional)
    says that row b's real tokens are its first `row_lengths[b]` and the rest padding: the
    retention targets then leave the padding queries out (`targets.future_attention_target`), and
    DMS's `dms_frac` counts only the real tokens' decisions.
    `positions` (int [B, S], default 0..S-1) and `segment_ids` (int [B, S], optional;
    attention is reset between segments) support packed sequences. With `cache`
    (a DenseCache), the new tokens are written at `cache.length` and attend to the whole
    cache; positions then default to `cache.length + arange(S)`.

    Token ids must lie in [0, vocab): an eager `apply` raises ValueError otherwise; under `jit`
    the check would need a device-to-host sync (or checkify) on every call, so there an id >= vocab
    gives NaN logits and a negative one wraps around (`generate` and the CLIs check ids on the host).

    `return_hidden=True` stops before the head: the output then has `hidden` (the final
    normed hidden states [B, S, E]) and `logits=None`, so a caller can apply
    `logits_from_hidden` a sequence chunk at a time (training never holds `[B, S, V]`).
    `remat_policy` (none | full | dots_saveable | dots_with_no_batch_dims_saveable)
    rematerializes each decoder layer in the backward pass; the parameter tree is the same.
    `scan_layers=True` runs the layers of a parallel forward (no cache) as one `lax.scan` over
    their stacked parameters, so XLA compiles one layer instead of all; the parameter tree, the
    math and the outputs are the loop's (`_scan_layers`).
    """

    config: Qwen3Config
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"
    scan_layers: bool = False

    def setup(self):
        c = self.config
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy must be one of {tuple(REMAT_POLICIES)}, got {self.remat_policy!r}")
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(0.02),
        )
        layer_cls = DecoderLayer
        if self.remat_policy != "none":
            # The Python bools are static; caches, None and the other arguments are pytrees.
            layer_cls = nn.remat(DecoderLayer, policy=REMAT_POLICIES[self.remat_policy],
                                 static_argnums=_argnums(DecoderLayer.__call__, "decoding", "return_policy"))
        self.layers = [
            layer_cls(c, self.dtype, self.param_dtype, name=f"layers_{i}") for i in range(c.num_hidden_layers)
        ]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = LMHead(c.vocab_size, self.dtype, self.param_dtype)

    def logits_from_hidden(self, hidden_BxSxE: jax.Array) -> jax.Array:
        """Final normed hidden states [B, S, E] (any S) -> logits float32 [B, S, V] (tied or untied head)."""
        if self.config.tie_word_embeddings:
            return _project_to_vocab(hidden_BxSxE, self.embed_tokens.embedding.T, self.dtype)
        return self.lm_head(hidden_BxSxE)

    def __call__(self, input_ids, positions=None, segment_ids=None, cache: Cache | None = None,
                 query_samples=None, return_policy: bool = False, return_hidden: bool = False,
                 row_lengths=None):
        shape, dtype = getattr(input_ids, "shape", None), getattr(input_ids, "dtype", None)
        if shape is None or len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"input_ids: expected an integer array [batch, seq]; got {type(input_ids).__name__} "
                             f"of shape {np.shape(input_ids)} and dtype {dtype}")
        b, s = input_ids.shape
        if b == 0 or s == 0:  # each path failed on its own terms ("index can't contain negative values": mLSTM)
            raise ValueError(f"input_ids has shape {(b, s)}: expected at least one row of at least one token")
        for name, value in (("positions", positions), ("segment_ids", segment_ids)):
            if value is not None and tuple(np.shape(value)) != (b, s):
                raise ValueError(f"{name} has shape {tuple(np.shape(value))}; input_ids is {(b, s)} and {name} "
                                 "must match it")
        if row_lengths is not None and tuple(np.shape(row_lengths)) != (b,):
            raise ValueError(f"row_lengths has shape {tuple(np.shape(row_lengths))}; expected one length per "
                             f"row, ({b},)")
        check_token_ids(input_ids, self.config.vocab_size)  # eager calls only; see check_token_ids
        self._check_retrofit_params()
        if positions is None:
            start = 0 if cache is None else cache.length
            positions = jnp.broadcast_to(start + jnp.arange(s, dtype=jnp.int32), (b, s))
        decoding = False
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids are not supported together with a decoding cache")
            if row_lengths is not None:  # the caches never read it: padding would be cached and attended, silently
                raise ValueError("row_lengths is not supported together with a decoding cache: a cache serves rows "
                                 "of equal length (`generate` takes ragged prompt lists, one batch per length)")
            if cache.batch != b:
                raise ValueError(f"the cache holds {cache.batch} rows but the input has {b}; a cache serves the "
                                 f"batch it was made for (init it with batch={b})")
            if len(cache.layers) != self.config.num_hidden_layers:  # else an IndexError or a reshape error
                raise ValueError(f"the cache has {len(cache.layers)} layers but the model has "
                                 f"{self.config.num_hidden_layers}: a cache serves the model config it was made for")
            k0 = getattr(cache.layers[0], "k", None)  # [B, Hkv, N, D] (dense, KVpop, baselines); DMS: [B, N, D]
            if k0 is not None and (k0.shape[-1] != self.config.head_dim
                                   or k0.ndim == 4 and k0.shape[1] != self.config.num_key_value_heads):
                raise ValueError(f"the cache's keys are {tuple(k0.shape)} but the model has "
                                 f"{self.config.num_key_value_heads} KV heads of head_dim {self.config.head_dim}: "
                                 "a cache serves the model config it was made for")
            decoding = cache.started or s == 1  # a one-token prompt is a step on an empty cache
        x = self.embed_tokens(input_ids)
        layer_aux, new_layers = [], []
        scanned = self._scans(cache)
        if scanned:
            x, layer_aux = self._scan_layers(x, positions, segment_ids, query_samples, return_policy, row_lengths)
        for i, layer in enumerate(() if scanned else self.layers):
            x, lc, aux = layer(x, positions, segment_ids, None if cache is None else cache.layers[i],
                               None if cache is None else cache.length, decoding, query_samples, return_policy,
                               row_lengths)
            layer_aux.append(aux)
            new_layers.append(lc)
        x = self.norm(x)
        new_cache = None
        if cache is not None:
            new_cache = cache.replace(layers=tuple(new_layers), length=cache.length + s, started=True)
        aux = _collect_aux(layer_aux)
        if return_hidden:
            return CausalLMOutput(logits=None, cache=new_cache, aux=aux, hidden=x)
        return CausalLMOutput(logits=self.logits_from_hidden(x), cache=new_cache, aux=aux)

    def _check_retrofit_params(self) -> None:
        """A retrofitted config applied to params without its retrofit (dense params) is named, not left
        to Flax's ScopeParamNotFoundError deep inside a layer. Structure only: fine under jit. (A dense
        config on a retrofit's params runs the base model: the extra parameters are unused.)"""
        if self.is_initializing() or not self.has_variable("params", "layers_0"):
            return
        attn = self.variables["params"]["layers_0"].get("self_attn", {})
        want = KVPOP_SUBTREE if self.config.kvpop is not None else DMS_SUBTREE if self.config.dms is not None else None
        if want is not None and want not in attn:
            raise ValueError(f"the config is a {want} model but the params have no {want!r} parameters (dense "
                             f"params?): retrofit_params(config, params, rng) adds fresh ones, or load a {want} export")

    def _scans(self, cache) -> bool:
        """The scanned path serves parallel forwards (training, scoring); decoding, init and
        `mutable=["intermediates"]` take the loop."""
        return (self.scan_layers and cache is None and self.config.num_hidden_layers > 1
                and not self.is_initializing() and not self.is_mutable_collection("intermediates"))

    def _scan_layers(self, x, positions, segment_ids, query_samples, return_policy, row_lengths=None):
        """The decoder layers as one `lax.scan` over their stacked parameters: XLA compiles one
        layer, not L (Qwen3-8B's 36). The parameter tree stays per layer (`layers_{i}`, as HF
        import/export and checkpoints have it); the stack is taken inside the step: one more copy of
        the layers' parameters in memory while it runs (the price of the one compiled layer). Same
        math as the loop; results agree to float rounding. DMS's relaxation noise draws one key per
        layer from the module's "dms" stream, so its noise differs from the loop's (same
        distribution)."""
        c = self.config
        n = c.num_hidden_layers
        params = self.variables["params"]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"] for i in range(n)])
        keys = jax.random.split(self.make_rng(DMS_RNG), n) if self.has_rng(DMS_RNG) else None
        layer = DecoderLayer(c, self.dtype, self.param_dtype, parent=None)  # unbound: applied per layer

        def body(x, xs):
            p, key = xs
            rngs = {DMS_RNG: key} if key is not None else None
            x, _, aux = layer.apply({"params": p}, x, positions, segment_ids, None, None, False, query_samples,
                                    return_policy, row_lengths, rngs=rngs)
            return x, aux

        if self.remat_policy != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat_policy], prevent_cse=False)
        x, aux = jax.lax.scan(body, x, (stacked, keys))
        return x, [None if aux is None else jax.tree.map(lambda a, i=i: a[i], aux) for i in range(n)]

    def decode_step(self, input_ids, cache):
        """New tokens [B, S] against the cache -> CausalLMOutput with the new cache.

        The first call on a cache is the prefill (S >= 1 prompt tokens; KVpop: the masked
        parallel forward, the baselines: dense). Later calls take S = 1 for the bounded caches
        (KVpop, StreamingLLM, TOVA, H2O) and any S for the dense one.
        """
        return self(input_ids, cache=cache)


def _argnums(fn, *names: str) -> tuple[int, ...]:
    """Positions of the named parameters of `fn` (self = 0), for `nn.remat(static_argnums=...)`."""
    params = list(inspect.signature(fn).parameters)
    return tuple(params.index(n) for n in names)


def _collect_aux(layer_aux: list) -> dict | None:
    """Per-layer aux -> {"layers": [...], "metrics": means over layers, and "retention_loss" (KVpop:
    mean over layers) or "dms_frac" (DMS training: [B], mean over layers)}."""
    if all(a is None for a in layer_aux):
        return None
    out: dict[str, Any] = {"layers": layer_aux}
    with_loss = [a for a in layer_aux if a is not None and "retention_loss" in a]
    dms = [a for a in layer_aux if a is not None and "eviction_rate" in a.get("metrics", {})]
    if dms:
        out["metrics"] = {"eviction_rate": jnp.mean(jnp.stack([a["metrics"]["eviction_rate"] for a in dms]))}
        if "dms_frac" in dms[0]:
            out["dms_frac"] = jnp.mean(jnp.stack([a["dms_frac"] for a in dms]), axis=0)
    if with_loss:
        out["retention_loss"] = jnp.mean(jnp.stack([a["retention_loss"] for a in with_loss]))
        keys = with_loss[0]["metrics"].keys()
        out["metrics"] = {k: jnp.mean(jnp.stack([jnp.asarray(a["metrics"][k], jnp.float32) for a in with_loss]))
                          for k in keys}
    return out


def init_params(config: Qwen3Config, rng: jax.Array, dtype: Dtype = jnp.float32) -> dict:
    """Random parameters (for tests and from-scratch training)."""
    model = Qwen3ForCausalLM(config, param_dtype=dtype)
    return model.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def retrofit_params(config: Qwen3Config, base_params: dict, rng: jax.Array) -> dict:
    """Adds freshly initialized retrofit parameters to a dense model's params: KVpop's (scorers,
    decay) under `self_attn/kvpop` or DMS's gates under `self_attn/dms`.

    `config.kvpop` or `config.dms` must be set. The base weights are reused as they are; only the
    small per-layer heads are initialized (layer i uses `fold_in(rng, i)`).
    """
    if config.kvpop is not None:
        head = KVpopHead(config.kvpop, config.num_key_value_heads, config.head_dim, rope_theta=config.rope_theta)
        subtree = KVPOP_SUBTREE
    elif config.dms is not None:
        head, subtree = DMSGate(config.dms, config.num_key_value_heads, config.head_dim), DMS_SUBTREE
    else:
        raise ValueError("retrofit_params needs a config with kvpop or dms set (dataclasses.replace(config, kvpop=...))")
    for i in range(config.num_hidden_layers):
        name = f"layers_{i}"
        if name not in base_params or "self_attn" not in base_params[name]:
            raise ValueError(f"retrofit_params: base_params lack {name}/self_attn; the config has "
                             f"{config.num_hidden_layers} layers")
        present = [t for t in RETROFIT_SUBTREES if t in base_params[name]["self_attn"]]
        if present:
            raise ValueError(f"retrofit_params: {name}/self_attn already holds {present[0]!r} parameters (a "
                             "retrofitted model); retrofitting again would replace them. Pass the dense params "
                             "(strip_kvpop(config, params)[1]) to start afresh")
    dummy = jnp.zeros((1, 1, config.num_key_value_heads, config.head_dim), jnp.float32)
    out = dict(base_params)
    for i in range(config.num_hidden_layers):
        name = f"layers_{i}"
        new = head.init(jax.random.fold_in(rng, i), dummy, dummy)["params"]
        out[name] = {**base_params[name], "self_attn": {**base_params[name]["self_attn"], subtree: new}}
    return out


def strip_kvpop(config: Qwen3Config, params: dict) -> tuple[Qwen3Config, dict]:
    """The dense model inside a retrofitted (KVpop or DMS) checkpoint: config without `kvpop` and
    `dms`, params without the per-layer `self_attn/kvpop` (`self_attn/dms`) subtrees (the inverse
    of `retrofit_params`)."""
    if config.kvpop is None and config.dms is None:
        return config, params
    out = {}
    for name, sub in params.items():
        if name.startswith("layers_") and any(t in sub.get("self_attn", {}) for t in RETROFIT_SUBTREES):
            sub = {**sub, "self_attn": {k: v for k, v in sub["self_attn"].items() if k not in RETROFIT_SUBTREES}}
        out[name] = sub
    return dataclasses.replace(config, kvpop=None, dms=None), out


def abstract_params(config: Qwen3Config, dtype: Dtype = jnp.float32) -> dict:
    """ShapeDtypeStructs of the parameter tree, without allocating anything."""
    return jax.eval_shape(lambda r: init_params(config, r, dtype), jax.random.key(0))


def layer_qkv(config, params, ids_BxS, layer: int, offset: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, S, Hq, D], k and v [B, S, Hkv, D] (RoPE applied) of one layer of a dense model: what its
    attention computes with and what its cache holds. `offset` starts the positions there instead of
    at 0 (the attention is unchanged under RoPE; only the rotation of q and k moves)."""
    pos = jnp.arange(ids_BxS.shape[1])[None] + offset
    x = params["embed_tokens"]["embedding"][ids_BxS]
    for i in range(layer):
        x = DecoderLayer(config).apply({"params": params[f"layers_{i}"]}, x, pos)[0]
    h = RMSNorm(config.rms_norm_eps).apply({"params": params[f"layers_{layer}"]["input_layernorm"]}, x)
    return Attention(config).apply({"params": params[f"layers_{layer}"]["self_attn"]}, h, pos,
                                   method=Attention.project_qkv)


def dense_attention_probs(config, params, ids_BxS, layer: int) -> jax.Array:
    """Causal attention weights of one layer of a dense model: float32 [B, Hq, S, S]."""
    q, k, _ = layer_qkv(config, params, ids_BxS, layer)
    k = jnp.repeat(k, config.num_attention_heads // config.num_key_value_heads, 2)
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(config.head_dim)
    s = ids_BxS.shape[1]
    return jax.nn.softmax(jnp.where(np.tril(np.ones((s, s), bool)), logits, -1e9), -1)


__all__ = [
    "CausalLMOutput",
    "DMS_RNG",
    "DMS_SUBTREE",
    "KVPOP_SUBTREE",
    "RETROFIT_SUBTREES",
    "REMAT_POLICIES",
    "Qwen3ForCausalLM",
    "abstract_params",
    "apply_rope",
    "dense_attention_probs",
    "init_params",
    "layer_qkv",
    "retrofit_params",
    "rope_cos_sin",
    "strip_kvpop",
]
