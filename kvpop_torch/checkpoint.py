"""Reading a KVpop export's scorers with torch + safetensors alone.

An export (`kvpop_jax.save_pretrained` / `python -m train.export`) is a HF Qwen3 folder whose
config.json has a "kvpop" block and whose safetensors hold, per layer, the scorer and decay
as `model.layers.{i}.self_attn.kvpop.<name>` (e.g. `...kvpop.scorer.w_q`, `...kvpop.decay_alpha`).
transformers loads the base weights and leaves those tensors to us.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from kvpop_torch.config import DEFAULT_HF_HEAD_DIM, KVpopSettings, read_config
from kvpop_torch.scorers import KVpopHead

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
KVPOP_PREFIX = "model.layers.{i}.self_attn.kvpop."
STORED_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")  # a stored tensor's layer (a base Qwen3Model's too)
SCORER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # read as float32


def open_safetensors(filename: str):
    """safe_open, with a truncated or non-safetensors file named in a ValueError."""
    try:
        return safe_open(filename, framework="pt")
    except Exception as e:  # safetensors' SafetensorError, OSError
        raise ValueError(f"corrupt safetensors file {filename!r}: {e}") from e


def check_weights(directory: str | os.PathLike, config: dict) -> None:
    """Every safetensors file of the export opens (its header parses and covers the file), and its layers are
    config.json's `num_hidden_layers`: transformers builds every layer first, so a hostile 1e5 took minutes and
    gigabytes before it named a missing weight."""
    files = weight_files(directory)
    for filename in sorted(set(files.values())):
        with open_safetensors(filename):
            pass
    stored = {int(m.group(1)) for m in map(STORED_LAYER.match, files) if m}
    if config.get("num_hidden_layers") != len(stored):
        raise ValueError(f"{os.fspath(directory)!r} does not match its config: config.json has num_hidden_layers="
                         f"{config.get('num_hidden_layers')!r}, the weights hold {len(stored)} layers")


def weight_files(directory: str | os.PathLike) -> dict[str, str]:
    """tensor name -> safetensors file of the export (single file or sharded index)."""
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index) and os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        # transformers loads the base weights from the single file: the heads must not come from other shards
        raise ValueError(f"{directory!r} holds both {SINGLE_FILE} and {INDEX_FILE} (transformers would load "
                         f"{SINGLE_FILE} and ignore the shards); remove the stale one")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            elsewhere = sorted({repr(fn) for fn in weight_map.values()
                                if not fn or os.path.basename(fn) != fn or fn in (".", "..")})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ValueError(f"corrupt safetensors index {index!r}: {type(e).__name__}: {e}") from None
        if elsewhere:  # "../x.safetensors", "/abs/x.safetensors": the folder must not send us to read other files
            raise ValueError(f"corrupt safetensors index {index!r}: shard {elsewhere[0]} is not a file name in "
                             f"{directory!r} (an index names the shards beside it)")
        return {n: os.path.join(directory, fn) for n, fn in weight_map.items()}
    single = os.path.join(directory, SINGLE_FILE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory!r}")
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def load_heads(directory: str | os.PathLike, *, device=None) -> tuple[KVpopSettings, list[KVpopHead]]:
    """The export's KVpop settings and one `KVpopHead` (scorer + decay, float32) per layer."""
    config = read_config(directory)
    if not config.get("kvpop"):
        raise ValueError(f"{os.fspath(directory)!r} is a dense export (its config.json has no 'kvpop' block): "
                         "decode it with transformers' own cache")
    settings = KVpopSettings.from_dict(config["kvpop"])
    heads_kv = config.get("num_key_value_heads") or config["num_attention_heads"]  # null: one per head, as in HF
    head_dim = config.get("head_dim") or DEFAULT_HF_HEAD_DIM  # the attention's, as transformers builds it
    # as transformers reads it: a non-empty rope_scaling replaces rope_parameters, whose rope_theta comes first
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta") or config.get("rope_theta") or 10_000.0
    if settings.scorer_keys == "unrotated":
        for key in ("rope_scaling", "rope_parameters"):
            rope = config.get(key) or {}
            kind = rope.get("rope_type", rope.get("type", "default"))  # "type": transformers 4's spelling
            if kind != "default":
                raise ValueError(f"{os.fspath(directory)!r}: kvpop.scorer_keys='unrotated' undoes plain RoPE, but "
                                 f"config.json's {key} has rope_type {kind!r}")
    files = weight_files(directory)
    prefixes = tuple(KVPOP_PREFIX.format(i=i) for i in range(config["num_hidden_layers"]))
    stray = sorted(n for n in files if ".self_attn.kvpop." in n and not n.startswith(prefixes))
    if stray:  # tensors of layers the config does not have: a truncated config or another model's files
        more = ", ..." if len(stray) > 3 else ""
        raise ValueError(f"{os.fspath(directory)!r}: KVpop tensors of layers its config.json does not have "
                         f"(num_hidden_layers={config['num_hidden_layers']}): {stray[:3]}{more}")
    heads = []
    for i in range(config["num_hidden_layers"]):
        prefix = KVPOP_PREFIX.format(i=i)
        state = {}
        for name in (n for n in files if n.startswith(prefix)):
            with open_safetensors(files[name]) as f:
                tensor = state[name[len(prefix):]] = f.get_tensor(name)
            if tensor.dtype not in SCORER_DTYPES:  # load_state_dict cast int8 and bool silently
                raise ValueError(f"{os.fspath(directory)!r}: KVpop tensor {name!r} is stored as {tensor.dtype}; "
                                 f"expected a float dtype {SCORER_DTYPES}")
            if not torch.isfinite(tensor).all():  # a NaN scorer keeps the oldest tokens
                raise ValueError(f"{os.fspath(directory)!r}: KVpop tensor {name!r} holds NaN or infinite values")
        head = KVpopHead(settings, heads_kv, head_dim, rope_theta=rope_theta)
        try:
            missing, unexpected = head.load_state_dict(state, strict=False)
        except RuntimeError as e:  # torch's size mismatch
            raise ValueError(f"layer {i} of {os.fspath(directory)!r}: KVpop tensors do not fit its config.json's "
                             f"kvpop settings: {e}") from None
        if missing or unexpected:
            raise ValueError(f"layer {i} of {os.fspath(directory)!r}: missing KVpop tensors "
                             f"{[prefix + n for n in missing]}, unexpected {[prefix + n for n in unexpected]}")
        heads.append(head.to(device) if device is not None else head)
    return settings, heads
