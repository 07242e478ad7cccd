"""Frozen, validated configs: the base Qwen3 architecture and its retrofits (KVpop, DMS).

`Qwen3Config` mirrors the fields of a HuggingFace Qwen3 `config.json` that the model
uses; `KVpopConfig` holds the sparse-attention budget (s, w, k), the scorer and every
loss knob of the paper (Table 3 defaults); `DMSConfig` the Dynamic Memory Sparsification
baseline (window, memory, eviction target, gate; the method is described in `dms.py`). All
validate on construction and name the bad value in the error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import warnings
from typing import Any, Mapping

import numpy as np

SUPPORTED_MODEL_TYPES = ("qwen3",)
DEFAULT_HF_ROPE_THETA = 10_000.0  # transformers' RoPE base when config.json names none
DEFAULT_HF_HEAD_DIM = 128  # transformers' Qwen3Config default when config.json names none
REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


MAX_SIZE = 2**31 - 1  # sizes and counts: JAX indexes, and traces shapes, with int32


def _require_positive(cls_name: str, **values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{cls_name}.{name} must be a positive int, got {value!r}")
        _require_int32(cls_name, name, value)


def _require_int32(cls_name: str, name: str, value: int) -> None:
    if value > MAX_SIZE:  # else an OverflowError traceback from deep inside jax, naming no field
        raise ValueError(f"{cls_name}.{name} must be at most 2**31 - 1 (JAX's int32 indices), got {value!r}")


def _require_bools(obj: Any) -> None:
    """Every field annotated `bool` holds a bool: a string "false" is truthy, 0/1 are not what was meant."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "bool":
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{type(obj).__name__}.{f.name} must be true or false, got {value!r}")
            object.__setattr__(obj, f.name, bool(value))  # numpy's bool is not JSON


def _python_ints(obj: Any) -> None:
    """Every field annotated `int` (or `int | None`) that holds a numpy integer holds it as a Python int:
    a size computed with numpy (np.int64(8)) was refused as "must be a positive int, got np.int64(8)", and
    numpy's ints are not JSON. Other values are left to the field's own check."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type in ("int", "int | None") and isinstance(value, np.integer):
            object.__setattr__(obj, f.name, int(value))


def memory_words(slots: int, memory: int) -> str:
    """"106 slots + 17 of scorer state = memory B 123 per KV head" (no state: "123 slots = memory B 123 per KV
    head"): how `--dry_run`, the recipe and the benches word a KVpop budget, B being memory as in the README."""
    state = f" + {memory - slots} of scorer state" if memory != slots else ""
    return f"{slots} slots{state} = memory B {memory} per KV head"


def _require_finite_floats(obj: Any) -> None:
    """Every field annotated `float` holds a finite real number, not a bool: a NaN weight or logit offset
    passes every `> 0` check and fails silently later (NaN > 0 is false), a string fails far from here."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "float" and not (isinstance(value, numbers.Real) and not isinstance(value, bool)
                                      and math.isfinite(value)):
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a finite number, got {value!r}")


def _from_dict(cls, d: Mapping[str, Any]):
    """A config dataclass from its `to_dict`; unknown fields are an error naming them."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")
    return cls(**dict(d))


def hf_layer_types(hf: Mapping[str, Any]) -> list[str]:
    """Each layer's attention type as transformers' Qwen3Config derives it: `layer_types` when given,
    else sliding for layers at or past `max_window_layers` (28 by default) when `use_sliding_window` and a
    `sliding_window` are set. So `use_sliding_window: true` with every layer below max_window_layers is
    full attention everywhere."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    layers = hf.get("num_hidden_layers")
    if not hf.get("use_sliding_window") or hf.get("sliding_window", 4096) is None or not isinstance(layers, int):
        return []
    first_sliding = hf.get("max_window_layers", 28)
    if isinstance(first_sliding, bool) or not isinstance(first_sliding, int):
        return ["unreadable max_window_layers"]  # refused, naming it, rather than guessed
    return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)]


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture of a Qwen3 causal LM (the subset of HF's config.json we use)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | tuple[int, ...] | None = None
    # The KVpop retrofit (None: a dense model). Carried in config.json under "kvpop".
    kvpop: "KVpopConfig | None" = None
    # The DMS retrofit (the learned-eviction baseline; exclusive with kvpop). config.json "dms".
    dms: "DMSConfig | None" = None

    def __post_init__(self):
        if isinstance(self.eos_token_id, np.ndarray):
            object.__setattr__(self, "eos_token_id", self.eos_token_id.tolist())
        if isinstance(self.eos_token_id, list):  # keep the dataclass hashable
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.kvpop is not None and not isinstance(self.kvpop, KVpopConfig):
            raise TypeError(f"Qwen3Config.kvpop must be a KVpopConfig or None, got {type(self.kvpop).__name__}")
        if self.dms is not None and not isinstance(self.dms, DMSConfig):
            raise TypeError(f"Qwen3Config.dms must be a DMSConfig or None, got {type(self.dms).__name__}")
        if self.kvpop is not None and self.dms is not None:
            raise ValueError("Qwen3Config has both kvpop and dms set; a model is retrofitted with one of them")
        _require_bools(self)
        _python_ints(self)
        _require_positive(
            "Qwen3Config",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "Qwen3Config.num_attention_heads must be divisible by num_key_value_heads, got "
                f"{self.num_attention_heads} heads and {self.num_key_value_heads} kv heads"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ValueError(f"Qwen3Config.{name} must be a finite number > 0, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim must be even (RoPE rotates pairs of dimensions), "
                             f"got {self.head_dim}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) else (value,)
            for token in ids:
                if token is not None and (isinstance(token, bool) or not isinstance(token, (int, np.integer))):
                    raise ValueError(f"Qwen3Config.{name} holds {token!r}; expected token ids (ints)")
            ids = tuple(None if t is None else int(t) for t in ids)  # numpy ints are not JSON
            object.__setattr__(self, name, ids if isinstance(value, tuple) else ids[0])
            outside = [t for t in ids if t is not None and not 0 <= t < self.vocab_size]
            if outside:  # a warning: a checkpoint's odd config still loads; generate refuses such EOS ids
                warnings.warn(f"Qwen3Config.{name} holds {outside[0]} outside the vocabulary [0, {self.vocab_size})",
                              stacklevel=3)

    @classmethod
    def from_hf(cls, source: Mapping[str, Any] | str | os.PathLike) -> "Qwen3Config":
        """Builds the config from a HF `config.json` dict, file, or checkpoint directory.

        A "kvpop" (or "dms") entry (written by `save_pretrained` for a retrofitted model) becomes
        `config.kvpop` (`config.dms`); transformers ignores it, so the file still loads there.
        """
        where = "the config"
        if not isinstance(source, Mapping):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path!r}")
            with open(path) as f:
                try:
                    source = json.load(f)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # binary, nested 100000 deep
                    raise ValueError(f"config.json at {path!r} is not valid JSON: {e}") from e
            where = f"config.json at {path!r}"
            if not isinstance(source, Mapping):
                raise ValueError(f"{where} is not a JSON object (got {type(source).__name__})")
        hf = dict(source)
        for field in REQUIRED_HF_FIELDS:
            if field not in hf:
                raise ValueError(f"{where} lacks the required field {field!r}")
        model_type = hf.get("model_type", "qwen3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; kvpop-jax supports {SUPPORTED_MODEL_TYPES}"
            )
        # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters {rope_type, rope_theta}. As
        # transformers 5 reads them: a non-empty rope_scaling replaces rope_parameters, the dict's rope_theta
        # comes before the top-level one, and with neither RoPE's base is 10000 (not Qwen3's usual 1e6).
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:
            rope_theta = DEFAULT_HF_ROPE_THETA
        for key in ("rope_scaling", "rope_parameters"):
            rope = hf.get(key)
            if not rope:
                continue
            if not isinstance(rope, Mapping):
                raise ValueError(f"{where}: {key} must be an object such as {{\"rope_type\": \"default\"}}, "
                                 f"got {rope!r}")
            nested = sorted(k for k, v in rope.items() if isinstance(v, Mapping))
            if nested:  # transformers 5's RoPE per layer type: {"full_attention": {"rope_type": ...}}
                raise ValueError(f"{where}: {key} per layer type ({nested}) is not supported; only one plain RoPE "
                                 f"such as {{\"rope_type\": \"default\", \"rope_theta\": 1000000.0}}")
            kind = rope.get("rope_type", rope.get("type"))
            if kind not in (None, "default"):
                raise ValueError(
                    f"unsupported {key} type {kind!r}; only plain RoPE ('default') is supported"
                )
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if rope.get("rope_theta") is not None:
            rope_theta = rope["rope_theta"]
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)):
            raise ValueError(f"{where}: rope_theta must be a number, got {rope_theta!r}")
        if hf.get("layer_types") is not None and not isinstance(hf["layer_types"], list):  # list(5): a TypeError
            raise ValueError(f"{where}: layer_types must be a list of each layer's attention, got "
                             f"{hf['layer_types']!r}")
        if any(t != "full_attention" for t in hf_layer_types(hf)):
            raise ValueError(
                f"unsupported sliding-window layers (use_sliding_window={hf.get('use_sliding_window')!r}, "
                f"sliding_window={hf.get('sliding_window')!r}, max_window_layers={hf.get('max_window_layers')!r}, "
                f"layer_types={hf.get('layer_types')!r}); only full attention is supported"
            )
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the MLP is SwiGLU: another activation would load and silently run SiLU
            raise ValueError(f"{where}: hidden_act {act!r} is not supported; Qwen3's MLP uses 'silu'")
        for flag in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(hf.get(flag, False), bool):  # bool("false") is True
                raise ValueError(f"{where}: {flag} must be true or false, got {hf[flag]!r}")
        if not isinstance(hf.get("rms_norm_eps", 1e-6), (int, float)) or isinstance(hf.get("rms_norm_eps"), bool):
            raise ValueError(f"{where}: rms_norm_eps must be a number, got {hf.get('rms_norm_eps')!r}")
        for block in ("kvpop", "dms"):  # a retrofit's block present but empty: its tensors would be dropped
            if block in hf and not hf[block] and hf[block] is not None:
                raise ValueError(f"{where}: {block!r} is empty; a {block} export carries its settings there "
                                 f"(remove the key for a dense model)")
        heads = hf["num_attention_heads"]
        if "head_dim" in hf and hf["head_dim"] is None:  # transformers 5 refuses it; 4 read it as absent
            raise ValueError(f"{where}: head_dim must be an int, got None")
        head_dim = hf.get("head_dim", DEFAULT_HF_HEAD_DIM)  # transformers' Qwen3Config default (4.x and 5.x)
        hidden = hf["hidden_size"]
        if "head_dim" not in hf and all(isinstance(x, int) and x > 0 for x in (hidden, heads)) \
                and hidden // heads != DEFAULT_HF_HEAD_DIM:  # (bad sizes: named by the dataclass below)
            raise ValueError(f"{where}: no head_dim; transformers reads a Qwen3 config without one as head_dim "
                             f"{DEFAULT_HF_HEAD_DIM}, not hidden_size // num_attention_heads = {hidden // heads}: "
                             "give head_dim explicitly")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],  # as HF
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            attention_bias=hf.get("attention_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            kvpop=KVpopConfig.from_dict(hf["kvpop"]) if hf.get("kvpop") else None,
            dms=DMSConfig.from_dict(hf["dms"]) if hf.get("dms") else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `transformers.Qwen3Config` reads back."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            **({"kvpop": self.kvpop.to_dict()} if self.kvpop is not None else {}),
            **({"dms": self.dms.to_dict()} if self.dms is not None else {}),
        }


SCORERS = ("linear", "mlp", "mlstm")
FEATURE_MAPS = ("hedgehog", "softmax")
MLSTM_VALUES = ("projection", "cached")
MLSTM_INITS = ("identity", "random")
AGGREGATIONS = ("max", "mean")
NORMALIZERS = ("sparse", "dense")
TARGET_REDUCTIONS = ("sum", "max")
RETENTION_LABELS = ("hard", "soft")
RANK_PARTNERS = ("random", "similar")
SCORER_KEYS = ("rotated", "unrotated")
SCORER_POSITIONS = ("none", "log")


@dataclasses.dataclass(frozen=True)
class KVpopConfig:
    """The KVpop retrofit: budget B = sinks + window + topk and the training knobs.

    Defaults follow the paper (Table 3 and Appendix B), but for the scorer: `scorer` defaults to the
    stateless "mlp" (KVpop-MLP, at Table 3's k, so not memory-matched: `memory_matched` gives its k); the
    paper's KVpop, and `train.main`'s `--scorer` default, is "mlstm". Knobs the paper leaves unset
    (ε, ω_min, τ_ω, c_min, c_max, sampler sizes) get the values documented inline.

    The mLSTM scorer defaults are the paper's main configuration (Sec. 3.3 Eq. 10-11, App. A,
    E.3-E.5): Hedgehog features of width d = head_dim from a projection 2D -> d/2, a value
    projection 2D -> d/2, soft-capped gates, score `a^T SiLU(h) + b` (no norm, no skip),
    identity-style initialization. The App. E.5 variants are the other settings.
    """

    sinks: int = 4  # s
    window: int = 256  # w, protected recent window
    topk: int = 2016  # k, long-range budget
    scorer: str = "mlp"  # linear | mlp | mlstm
    scorer_hidden: int = 64  # MLP hidden width per KV head
    # the keys a scorer reads: rotated (the cached keys as the attention uses them, RoPE applied; the
    # paper's [k; v]) | unrotated (RoPE undone: no absolute position for the scorer to learn, not in the paper)
    scorer_keys: str = "rotated"
    # none (the paper) | log: the raw score gains a learned a_h * log(1 + t), t the token's index, so a head
    # can rank older (a_h < 0) or newer (a_h > 0) tokens first at any length, beside its decay (not in the paper)
    scorer_position: str = "none"
    mlstm_dim: int | None = None  # d, feature dim of q~/k~ per head; None: head_dim (App. A)
    mlstm_feature_map: str = "hedgehog"  # hedgehog ([softmax(x); softmax(-x)] of a d/2 projection) | softmax
    mlstm_value: str = "projection"  # v~: projection (2D -> d/2, Eq. 37) | cached (v itself, E.5)
    mlstm_skip: bool = False  # E.5: the delayed token's own projection is added before the score projection
    mlstm_norm: bool = False  # Eq. 42: headwise RMS norm of the readout before SiLU
    mlstm_init: str = "identity"  # E.5: identity-style from the key/value pathways | random (LeCun)
    mlstm_chunk: int = 64  # chunk length of the chunkwise-parallel mLSTM
    mlstm_gate_softcap: float = 15.0  # soft-cap of gate pre-activations (E.3); 0 = off
    delayed_readout: bool = True  # mLSTM scores u = q - w from the state after q
    gamma_min: float = 0.999
    gamma_max: float = 0.999999
    decay_step: int = 1  # n in Eq. 5; only 1 supports static priorities
    loss_temperature: float = 1.0  # τ in Eq. 7
    retention_labels: str = "hard"  # hard: Eq. 7's keep/drop y | soft: the target's σ(Δ_tgt/τ) (not in the paper)
    margin_weighting: bool = True  # Eq. 23
    omega_min: float = 0.1  # ω_min in Eq. 23
    tau_omega: float = 1.0  # τ_ω in Eq. 23
    balance_weighting: bool = True  # Eq. 24
    balance_min: float = 0.2  # c_min in Eq. 24
    balance_max: float = 5.0  # c_max in Eq. 24
    eps: float = 1e-6  # ε inside log(ε + m) in Eq. 3
    aggregate: str = "max"  # GQA aggregation of the target (Eq. 14 / 15)
    count_normalize: bool = True  # divide by N_t (Eq. 16-17)
    normalizer: str = "sparse"  # LSE for the target: sparse (Eq. 9) or dense (Eq. 28)
    target_reduce: str = "sum"  # over future queries: sum (the paper, Eq. 2) or max (not in the paper)
    target_lookahead: int | None = None  # L: only queries t + w <= d <= t + w + L count, N_t <= L + 1 (B.2)
    num_query_samples: int = 256  # sampled boundary positions per sequence (B.6)
    late_bias_fraction: float = 0.5  # share of late-biased samples in the sampler
    rank_pairs: int = 0  # + per sampled query, pairs of t_new with random older tokens (not in the paper)
    rank_partners: str = "random"  # "random" | "similar": the older tokens whose keys are closest to t_new's
    keepset_queries: int = 0  # + at this many sampled queries, balanced keep/drop over all of E(q) (not in the paper)
    target_head_samples: int = 0  # + per head, the leave times of the target's top tokens (not in the paper)
    listwise_queries: int = 0  # + at this many of the sampled queries, a listwise KL over E(q) (not in the paper)
    listwise_temperature: float = 0.25  # its τ
    # + this weight times the squared error of the raw score against the log-target over every token that
    # competes (losses.regression_loss; not in the paper): fits the ranking below the top, for recall
    regression_weight: float = 0.0
    kl_topk: int = 256  # teacher top-k logits for distillation
    kl_temperature: float = 1.0
    retention_loss_weight: float = 1.0

    def __post_init__(self):
        _require_bools(self)
        _python_ints(self)  # e.g. a budget computed with numpy, as BaselineConfig takes it
        _require_finite_floats(self)
        for name in ("retention_loss_weight", "regression_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"KVpopConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("sinks", "window", "topk", "rank_pairs", "target_head_samples", "keepset_queries",
                     "listwise_queries"):
            value = getattr(self, name)
            minimum, why = (1, " (the newest token is always kept)") if name == "window" else (0, "")
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"KVpopConfig.{name} must be an int >= {minimum}{why}, got {value!r}")
            _require_int32("KVpopConfig", name, value)
        if self.scorer not in SCORERS:
            raise ValueError(f"KVpopConfig.scorer must be one of {SCORERS}, got {self.scorer!r}")
        if self.aggregate not in AGGREGATIONS:
            raise ValueError(f"KVpopConfig.aggregate must be one of {AGGREGATIONS}, got {self.aggregate!r}")
        if self.normalizer not in NORMALIZERS:
            raise ValueError(f"KVpopConfig.normalizer must be one of {NORMALIZERS}, got {self.normalizer!r}")
        if self.target_reduce not in TARGET_REDUCTIONS:
            raise ValueError(f"KVpopConfig.target_reduce must be one of {TARGET_REDUCTIONS}, got {self.target_reduce!r}")
        if self.decay_step != 1:
            raise ValueError(
                f"KVpopConfig.decay_step must be 1 (static priorities need n = 1), got {self.decay_step!r}"
            )
        if not 0.0 < self.gamma_min < self.gamma_max < 1.0:
            raise ValueError(
                "KVpopConfig needs 0 < gamma_min < gamma_max < 1, got "
                f"gamma_min={self.gamma_min!r}, gamma_max={self.gamma_max!r}"
            )
        _require_positive(
            "KVpopConfig",
            scorer_hidden=self.scorer_hidden,
            mlstm_chunk=self.mlstm_chunk,
            num_query_samples=self.num_query_samples,
            kl_topk=self.kl_topk,
        )
        if self.listwise_queries > self.num_query_samples:
            raise ValueError(f"KVpopConfig.listwise_queries {self.listwise_queries} exceeds num_query_samples "
                             f"{self.num_query_samples}: it is taken at that many of the sampled queries")
        if self.mlstm_dim is not None:
            _require_positive("KVpopConfig", mlstm_dim=self.mlstm_dim)
            if self.mlstm_feature_map == "hedgehog" and self.mlstm_dim % 2:
                raise ValueError(f"KVpopConfig.mlstm_dim must be even (Hedgehog halves it), got {self.mlstm_dim}")
        for name, allowed in (("mlstm_feature_map", FEATURE_MAPS), ("mlstm_value", MLSTM_VALUES),
                              ("mlstm_init", MLSTM_INITS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"KVpopConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.target_lookahead is not None:
            if not isinstance(self.target_lookahead, int) or isinstance(self.target_lookahead, bool) \
                    or self.target_lookahead < 0:
                raise ValueError(f"KVpopConfig.target_lookahead must be None or an int >= 0, "
                                 f"got {self.target_lookahead!r}")
        for name in ("loss_temperature", "tau_omega", "eps", "kl_temperature", "listwise_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"KVpopConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.mlstm_gate_softcap >= 0:
            raise ValueError(f"KVpopConfig.mlstm_gate_softcap must be >= 0 (0: off), got {self.mlstm_gate_softcap!r}")
        if not 0.0 <= self.omega_min <= 1.0:
            raise ValueError(f"KVpopConfig.omega_min must be in [0, 1], got {self.omega_min!r}")
        if not 0.0 < self.balance_min <= self.balance_max:
            raise ValueError(
                f"KVpopConfig needs 0 < balance_min <= balance_max, got {self.balance_min!r}, {self.balance_max!r}"
            )
        if self.scorer_keys not in SCORER_KEYS:
            raise ValueError(f"KVpopConfig.scorer_keys must be one of {SCORER_KEYS}, got {self.scorer_keys!r}")
        if self.scorer_position not in SCORER_POSITIONS:
            raise ValueError(f"KVpopConfig.scorer_position must be one of {SCORER_POSITIONS}, "
                             f"got {self.scorer_position!r}")
        if self.rank_partners not in RANK_PARTNERS:
            raise ValueError(f"KVpopConfig.rank_partners must be one of {RANK_PARTNERS}, got {self.rank_partners!r}")
        if self.retention_labels not in RETENTION_LABELS:
            raise ValueError(f"KVpopConfig.retention_labels must be one of {RETENTION_LABELS}, "
                             f"got {self.retention_labels!r}")
        if not 0.0 <= self.late_bias_fraction <= 1.0:
            raise ValueError(f"KVpopConfig.late_bias_fraction must be in [0, 1], got {self.late_bias_fraction!r}")

    @property
    def budget(self) -> int:
        """B = s + w + k: KV entries kept per head."""
        return self.sinks + self.window + self.topk

    def mlstm_features(self, head_dim: int) -> int:
        """d: the mLSTM feature dim (q~, k~) for a model of this head_dim."""
        d = self.mlstm_dim or head_dim
        if self.mlstm_feature_map == "hedgehog" and d % 2:
            raise ValueError(f"the Hedgehog feature map needs an even mLSTM feature dim, got {d} "
                             "(set KVpopConfig.mlstm_dim)")
        return d

    def mlstm_value_dim(self, head_dim: int) -> int:
        """dv: the width of v~ (and of the readout h): d/2 with a projection, head_dim with cached values."""
        return head_dim if self.mlstm_value == "cached" else self.mlstm_features(head_dim) // 2

    def scorer_state_slots(self, head_dim: int) -> int:
        """The recurrent scorer state per KV head (C [d, dv], n [d], m), in KV-cache entries of
        2 * head_dim numbers, rounded up; 0 for stateless scorers.

        The paper compares scorers at equal memory: a stateless scorer gets these entries as
        extra long-range slots (`memory_matched`)."""
        if self.scorer != "mlstm":
            return 0
        d, dv = self.mlstm_features(head_dim), self.mlstm_value_dim(head_dim)
        return -(-(d * dv + d + 1) // (2 * head_dim))

    def memory_matched(self, scorer: str, head_dim: int) -> "KVpopConfig":
        """This config with `scorer`, its k changed so the memory per KV head stays the same:
        k' = k + state slots of this config's scorer - state slots of `scorer`."""
        other = dataclasses.replace(self, scorer=scorer)
        topk = self.topk + self.scorer_state_slots(head_dim) - other.scorer_state_slots(head_dim)
        if topk < 0:
            raise ValueError(f"no long-range slots left for {scorer} at k = {self.topk}")
        return dataclasses.replace(other, topk=topk)

    def check_sequence_length(self, seq_len: int) -> None:
        """Training needs sequences longer than the budget, or nothing is ever evicted."""
        if seq_len <= self.budget:
            raise ValueError(
                f"sequence length {seq_len} must exceed the KVpop budget B = s + w + k = "
                f"{self.sinks} + {self.window} + {self.topk} = {self.budget}; nothing would be evicted"
            )

    @staticmethod
    def budget_at(compression_ratio: float, context_len: int) -> int:
        """B = round((1 - CR) * context_len). The paper's B 4096 / 2048 of 16384 are CR 75% / 87.5% (§4.1 rounds
        it to 88%; CR 0.88 gives B 1966)."""
        if not 0.0 <= compression_ratio < 1.0:
            raise ValueError(f"compression ratio must be in [0, 1), got {compression_ratio}")
        if isinstance(context_len, bool) or not isinstance(context_len, (int, np.integer)) or context_len < 1:
            raise ValueError(f"context_len must be a positive int (the tokens the CR is taken of), got "
                             f"{context_len!r}")
        return max(1, int(round((1.0 - compression_ratio) * context_len)))

    def memory(self, head_dim: int) -> int:
        """Memory per KV head in KV-cache entries: B = s + w + k plus the scorer's state slots."""
        return self.budget + self.scorer_state_slots(head_dim)

    # What only training reads (the target, the retention losses, the query sampler, the KL and
    # the scorers' initialization): a trained model decodes the same whatever they are.
    TRAINING_ONLY = ("mlstm_init", "loss_temperature", "retention_labels", "margin_weighting", "omega_min",
                     "tau_omega", "balance_weighting", "balance_min", "balance_max", "eps", "aggregate",
                     "count_normalize", "normalizer", "target_reduce", "target_lookahead", "num_query_samples",
                     "late_bias_fraction", "rank_pairs", "rank_partners", "keepset_queries", "target_head_samples",
                     "listwise_queries", "listwise_temperature", "regression_weight", "kl_topk", "kl_temperature",
                     "retention_loss_weight")

    def for_decoding(self) -> "KVpopConfig":
        """This config with every `TRAINING_ONLY` knob at its default: two exports that differ only
        in how they were trained (e.g. the mean and the max target) then share one compiled decode."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in self.TRAINING_ONLY}
        return dataclasses.replace(self, **defaults)

    def retarget(self, budget: int, head_dim: int | None = None) -> "KVpopConfig":
        """This config at a memory budget of `budget` KV entries per head (CR = 1 - budget / context):
        k = budget - s - w - the scorer's state slots, or w = budget - s - the state slots when k = 0
        (StreamingLLM+), so that `memory` is `budget` either way.

        Every method of a comparison gets the same memory: a stateful (mLSTM) scorer pays for its
        state with long-range slots, as in the paper. `head_dim` is needed for the mLSTM's state.
        """
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
            raise ValueError(f"retarget: budget must be an int (KV entries per head), got {budget!r}")
        if self.scorer == "mlstm" and head_dim is None:
            raise ValueError("retarget needs head_dim for an mLSTM scorer (its state counts against the budget)")
        state = self.scorer_state_slots(head_dim) if head_dim is not None else 0
        if self.topk == 0:
            if budget - self.sinks - state < 1:
                raise ValueError(f"budget {budget} leaves no window after {self.sinks} sinks and {state} entries "
                                 "of scorer state")
            return dataclasses.replace(self, window=budget - self.sinks - state)
        topk = budget - self.sinks - self.window - state
        if topk < 0:
            raise ValueError(f"budget {budget} < s + w + scorer state = {self.sinks} + {self.window} + {state} "
                             "of the checkpoint")
        return dataclasses.replace(self, topk=topk)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KVpopConfig":
        return _from_dict(cls, d)


@dataclasses.dataclass(frozen=True)
class DMSConfig:
    """The DMS retrofit (Dynamic Memory Sparsification, Łańcucki et al. 2025): learned per-head
    eviction gates with delayed eviction (the method and its open choices: `kvpop_jax/dms.py`).

    window: w, the newest w tokens (the query itself included) are always attendable, as in
      KVpop; a token marked for eviction is removed when it leaves them (NVIDIA's reference
      counts its window without the query: its 512 is our w = 513).
    budget: memory per KV head in cache entries (the comparison's memory, `KVpopConfig.memory`);
      a decode cache holds `num_kv_heads * budget` entries per layer, shared by its heads.
    target_eviction: the final target of the auxiliary loss, the share of tokens marked for
      eviction (`eviction_for_memory` gives the value whose mean occupancy at the training
      length is `budget`).
    ramp_fraction: share of the training steps over which the target compression ratio rises
      linearly from 1 to 1 / (1 - target_eviction), then stays there.
    temperature: τ of the Gumbel-sigmoid (binary concrete) relaxation (0.1 as the reference).
    logit_scale, logit_offset: the decision logit is `logit_scale * gate(x) - logit_offset`, so a
      zero-initialized gate starts at -5 (almost nothing evicted), as the reference.
    gate_hidden: hidden width of the headwise MLP gate (set to match the KVpop scorers' parameter
      count, `dms.matched_gate_hidden`).
    aux_loss_weight: weight of the one-sided auxiliary loss next to the distillation KL.
    kl_topk, kl_temperature: the distillation (the same as the KVpop runs').
    """

    window: int = 256
    budget: int = 2276
    target_eviction: float = 0.875
    ramp_fraction: float = 0.9
    temperature: float = 0.1
    logit_scale: float = 1.0
    logit_offset: float = 5.0
    gate_hidden: int = 64
    aux_loss_weight: float = 1.0
    kl_topk: int = 256
    kl_temperature: float = 1.0

    def __post_init__(self):
        _python_ints(self)
        _require_positive("DMSConfig", window=self.window, budget=self.budget, gate_hidden=self.gate_hidden,
                          kl_topk=self.kl_topk)
        _require_finite_floats(self)  # a NaN offset would evict nothing (NaN > 0 is false) and pass silently
        if self.budget <= self.window:
            raise ValueError(f"DMSConfig.budget must exceed the window (the cache holds every window token and "
                             f"the new one), got budget {self.budget} <= window {self.window}")
        if not 0.0 <= self.target_eviction < 1.0:
            raise ValueError(f"DMSConfig.target_eviction must be in [0, 1), got {self.target_eviction!r}")
        if not 0.0 < self.ramp_fraction <= 1.0:
            raise ValueError(f"DMSConfig.ramp_fraction must be in (0, 1], got {self.ramp_fraction!r}")
        for name in ("temperature", "logit_scale", "kl_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DMSConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.aux_loss_weight >= 0:
            raise ValueError(f"DMSConfig.aux_loss_weight must be >= 0, got {self.aux_loss_weight!r}")

    @property
    def target_compression(self) -> float:
        """The final target compression ratio of the schedule, 1 / (1 - target_eviction)."""
        return 1.0 / (1.0 - self.target_eviction)

    @staticmethod
    def eviction_for_memory(memory: int, window: int, seq_len: int) -> float:
        """The eviction rate whose mean occupancy per head after `seq_len` tokens is `memory`:
        `w + (1 - a)(S - w) = memory`, so `a = 1 - (memory - w) / (S - w)`."""
        if not window < memory < seq_len:
            raise ValueError(f"need window < memory < seq_len, got {window}, {memory}, {seq_len}")
        return 1.0 - (memory - window) / (seq_len - window)

    def mean_occupancy(self, seq_len: int, eviction: float | None = None) -> float:
        """Expected entries per head after `seq_len` tokens at an eviction rate (default: the target)."""
        a = self.target_eviction if eviction is None else eviction
        return min(seq_len, self.window) + (1.0 - a) * max(0, seq_len - self.window)

    def memory(self, head_dim: int | None = None) -> int:
        """Memory per KV head in cache entries (the interface of `KVpopConfig.memory`)."""
        del head_dim
        return self.budget

    def retarget(self, budget: int, head_dim: int | None = None) -> "DMSConfig":
        """This config with a decode cache of `budget` entries per KV head. The gates (and so the
        eviction rate) are the trained ones: only the capacity changes."""
        del head_dim
        if budget <= self.window:
            raise ValueError(f"budget {budget} leaves no room beyond the DMS window {self.window}")
        return dataclasses.replace(self, budget=budget)

    def check_sequence_length(self, seq_len: int) -> None:
        if seq_len <= self.window:
            raise ValueError(f"sequence length {seq_len} must exceed the DMS window {self.window}; "
                             "nothing would be evicted")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DMSConfig":
        return _from_dict(cls, d)
