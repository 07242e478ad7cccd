"""The `kvpop` block of an exported `config.json`, read without the JAX library.

`kvpop_jax.checkpoint.save_pretrained` writes `KVpopConfig.to_dict()` under "kvpop". Serving
needs only the budget, the scorer and its options and the decay bounds; the training knobs
(losses, targets, sampling) are ignored. Missing fields take kvpop_jax's defaults (an export
written before an option existed was trained with its default), duplicated here on purpose:
this package must load with only torch + transformers installed, and a test keeps the two
sets of defaults equal.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

SCORERS = ("linear", "mlp", "mlstm")
FEATURE_MAPS = ("hedgehog", "softmax")
MLSTM_VALUES = ("projection", "cached")
SCORER_KEYS = ("rotated", "unrotated")
SCORER_POSITIONS = ("none", "log")


# transformers' Qwen3Config default, which the model transformers loads from a config.json without head_dim uses
# (kvpop_jax.config.DEFAULT_HF_HEAD_DIM; not hidden_size // num_attention_heads).
DEFAULT_HF_HEAD_DIM = 128

# kvpop_jax's KVpopConfig.TRAINING_ONLY: knobs only training reads (copied, see the module docstring;
# a test keeps the two lists equal).
TRAINING_ONLY = ("mlstm_init", "loss_temperature", "retention_labels", "margin_weighting", "omega_min",
                 "tau_omega", "balance_weighting", "balance_min", "balance_max", "eps", "aggregate",
                 "count_normalize", "normalizer", "target_reduce", "target_lookahead", "num_query_samples",
                 "late_bias_fraction", "rank_pairs", "rank_partners", "keepset_queries", "target_head_samples",
                 "listwise_queries", "listwise_temperature", "regression_weight", "kl_topk", "kl_temperature",
                 "retention_loss_weight")


@dataclasses.dataclass(frozen=True)
class KVpopSettings:
    """What the bounded cache and the scorers need of a KVpop export (kvpop_jax's KVpopConfig subset)."""

    sinks: int = 4  # s
    window: int = 256  # w
    topk: int = 2016  # k
    scorer: str = "mlp"  # linear | mlp | mlstm
    scorer_hidden: int = 64
    scorer_keys: str = "rotated"  # rotated (cached keys) | unrotated (RoPE undone before the scorer)
    scorer_position: str = "none"  # none | log: the raw score gains a_h * log(1 + t) (position_weight)
    mlstm_dim: int | None = None  # d; None: head_dim
    mlstm_feature_map: str = "hedgehog"
    mlstm_value: str = "projection"
    mlstm_skip: bool = False
    mlstm_norm: bool = False
    mlstm_chunk: int = 64
    mlstm_gate_softcap: float = 15.0  # 0 = off
    delayed_readout: bool = True
    gamma_min: float = 0.999
    gamma_max: float = 0.999999
    decay_step: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):  # a string "false" is truthy
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"kvpop.{f.name} must be true or false, got {getattr(self, f.name)!r}")
        for name, minimum in (("sinks", 0), ("window", 0), ("topk", 0), ("scorer_hidden", 1), ("mlstm_chunk", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"kvpop.{name} must be an int >= {minimum}, got {value!r}")
        if self.mlstm_dim is not None and (not isinstance(self.mlstm_dim, int) or isinstance(self.mlstm_dim, bool)
                                           or self.mlstm_dim < 1):
            raise ValueError(f"kvpop.mlstm_dim must be null or an int >= 1, got {self.mlstm_dim!r}")
        for name in ("gamma_min", "gamma_max", "mlstm_gate_softcap"):  # a hand-edited "0.999" or null
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"kvpop.{name} must be a finite number, got {value!r}")
        if self.mlstm_gate_softcap < 0:
            raise ValueError(f"kvpop.mlstm_gate_softcap must be >= 0 (0: off), got {self.mlstm_gate_softcap!r}")
        if self.window < 1:
            raise ValueError(f"kvpop.window must be >= 1, got {self.window}")
        for name, allowed in (("scorer", SCORERS), ("mlstm_feature_map", FEATURE_MAPS),
                              ("mlstm_value", MLSTM_VALUES), ("scorer_keys", SCORER_KEYS),
                              ("scorer_position", SCORER_POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"kvpop.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.decay_step != 1:
            raise ValueError(f"kvpop.decay_step must be 1 (static priorities), got {self.decay_step!r}")
        if not 0.0 < self.gamma_min < self.gamma_max < 1.0:
            raise ValueError(f"kvpop needs 0 < gamma_min < gamma_max < 1, got {self.gamma_min!r}, {self.gamma_max!r}")

    @property
    def budget(self) -> int:
        """B = s + w + k slots per KV head."""
        return self.sinks + self.window + self.topk

    @property
    def delayed(self) -> bool:
        """The scorer scores a token when it leaves the window (the delayed-readout mLSTM)."""
        return self.scorer == "mlstm" and self.delayed_readout

    @property
    def log_gamma_bounds(self) -> tuple[float, float]:
        return math.log(self.gamma_min), math.log(self.gamma_max)

    def mlstm_features(self, head_dim: int) -> int:
        """d: width of the mLSTM query/key features."""
        return self.mlstm_dim or head_dim

    def mlstm_value_dim(self, head_dim: int) -> int:
        """dv: width of v~ and of the readout (d/2 projected, or the cached value's head_dim)."""
        return head_dim if self.mlstm_value == "cached" else self.mlstm_features(head_dim) // 2

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> "KVpopSettings":
        """The "kvpop" block of config.json; kvpop_jax's training knobs (TRAINING_ONLY) are ignored,
        any other field is refused: it may change how the export decodes (a newer kvpop_jax, a typo)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - known - set(TRAINING_ONLY))
        if unknown:
            raise ValueError(f"kvpop block has fields this kvpop_torch does not know: {unknown} (an export of a newer "
                             f"kvpop_jax, or a hand edit); known: {sorted(known)} and the training-only "
                             f"{sorted(TRAINING_ONLY)}")
        return cls(**{k: v for k, v in block.items() if k in known})


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The export's config.json as a dict; a DMS export is refused (`refuse_dms`): every reader of an
    export in this package goes through here."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {os.fspath(directory)!r}")
    try:
        with open(path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"config.json at {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config.json at {path!r} is not a JSON object (got {type(config).__name__})")
    refuse_dms(directory, config)
    return config


def refuse_dms(directory: str | os.PathLike, config: Mapping[str, Any]) -> None:
    """A DMS export (config.json's "dms" block, kvpop_jax/dms.py) has eviction gates this package does
    not run: loading it as a dense model would silently decode with the full cache."""
    if config.get("dms"):
        raise ValueError(f"{os.fspath(directory)!r} is a DMS export (its config.json has a 'dms' block): kvpop_torch "
                         "serves KVpop and dense exports only, and would drop its eviction gates. Decode it with "
                         "kvpop_jax (kvpop_jax.generate, python -m eval.main generate/accuracy), or delete the "
                         "'dms' block and the self_attn.dms.* tensors to use it as a dense model on purpose")


def read_settings(directory: str | os.PathLike) -> KVpopSettings | None:
    """The export's KVpop settings, or None for a dense export (no "kvpop" block); a DMS export is refused."""
    block = read_config(directory).get("kvpop")
    return KVpopSettings.from_dict(block) if block else None
