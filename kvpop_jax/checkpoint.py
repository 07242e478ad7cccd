"""HuggingFace safetensors <-> Flax params, table-driven and lazy.

`load_pretrained` reads a HF Qwen3 directory (one `model.safetensors` or shards listed
in `model.safetensors.index.json`) one tensor at a time: each tensor is read from the
memory-mapped file, transformed, cast and put on device before the next one is read,
so an 8B model never needs two host copies. `save_pretrained` writes the inverse (with an
index when sharded) into a temporary sibling directory and swaps it in whole, so a killed
export leaves the previous one loadable; it removes only files an export wrote (its manifest,
`kvpop_export.json`) and keeps everything else in the directory. Pickles (`.bin`, `.pt`)
are refused: nothing here ever runs code from a checkpoint.

KVpop parameters (scorers, decay) live under `layers_{i}/self_attn/kvpop/...` and are
stored verbatim as `model.layers.{i}.self_attn.kvpop.<path>`; the KVpop settings ride in
`config.json` under "kvpop", so a retrofitted model reloads as a KVpop model. DMS gates
likewise: `self_attn/dms/...` and config.json "dms".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as safetensors_save_bytes

from kvpop_jax import fileio
from kvpop_jax.config import Qwen3Config
from kvpop_jax.fileio import atomic_write_bytes  # noqa: F401  (its home before fileio.py)
from kvpop_jax.modeling import RETROFIT_SUBTREES, abstract_params

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# ---------------------------------------------------------------------------------------
# The name table: HF template -> (param path template, transform). `{i}` is the layer.


def _linear_to(w, c):  # HF [out, in] -> [in, out]
    return w.T


def _linear_from(w, c):
    return w.T


def _in_heads_to(w, c):  # HF [H*D, E] -> [E, H, D]
    return w.T.reshape(w.shape[1], -1, c.head_dim)


def _in_heads_from(w, c):
    return w.reshape(w.shape[0], -1).T


def _out_heads_to(w, c):  # HF [E, H*D] -> [H, D, E]
    return w.T.reshape(-1, c.head_dim, w.shape[0])


def _out_heads_from(w, c):
    return w.reshape(-1, w.shape[-1]).T


def _bias_heads_to(w, c):  # HF [H*D] -> [H, D]
    return w.reshape(-1, c.head_dim)


def _bias_heads_from(w, c):
    return w.reshape(-1)


def _copy(w, c):
    return w


TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    "copy": (_copy, _copy),
    "linear": (_linear_to, _linear_from),
    "in_heads": (_in_heads_to, _in_heads_from),
    "out_heads": (_out_heads_to, _out_heads_from),
    "bias_heads": (_bias_heads_to, _bias_heads_from),
}

GLOBAL_TABLE = [
    ("model.embed_tokens.weight", "embed_tokens/embedding", "copy"),
    ("model.norm.weight", "norm/scale", "copy"),
    ("lm_head.weight", "lm_head/kernel", "linear"),
]
LAYER_TABLE = [
    ("model.layers.{i}.input_layernorm.weight", "layers_{i}/input_layernorm/scale", "copy"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers_{i}/post_attention_layernorm/scale", "copy"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/self_attn/q_proj/kernel", "in_heads"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers_{i}/self_attn/k_proj/kernel", "in_heads"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers_{i}/self_attn/v_proj/kernel", "in_heads"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers_{i}/self_attn/o_proj/kernel", "out_heads"),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers_{i}/self_attn/q_proj/bias", "bias_heads"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers_{i}/self_attn/k_proj/bias", "bias_heads"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers_{i}/self_attn/v_proj/bias", "bias_heads"),
    ("model.layers.{i}.self_attn.o_proj.bias", "layers_{i}/self_attn/o_proj/bias", "copy"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers_{i}/self_attn/q_norm/scale", "copy"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers_{i}/self_attn/k_norm/scale", "copy"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers_{i}/mlp/gate_proj/kernel", "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers_{i}/mlp/up_proj/kernel", "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers_{i}/mlp/down_proj/kernel", "linear"),
]
def name_map(config: Qwen3Config, param_paths: Iterable[str]) -> dict[str, tuple[str, str]]:
    """HF tensor name -> (param path "a/b/c", transform) for every param of the model."""
    by_path: dict[str, tuple[str, str]] = {}
    for hf, path, kind in GLOBAL_TABLE:
        by_path[path] = (hf, kind)
    for i in range(config.num_hidden_layers):
        for hf, path, kind in LAYER_TABLE:
            by_path[path.format(i=i)] = (hf.format(i=i), kind)
    out = {}
    for path in param_paths:
        if path in by_path:
            hf, kind = by_path[path]
        else:
            parts = path.split("/")
            if not set(RETROFIT_SUBTREES) & set(parts) or not parts[0].startswith("layers_"):
                raise KeyError(f"parameter {path!r} has no HuggingFace name in the conversion table")
            layer = parts[0].removeprefix("layers_")
            hf, kind = f"model.layers.{layer}." + ".".join(parts[1:]), "copy"
        out[hf] = (path, kind)
    return out


# ---------------------------------------------------------------------------------------
# Loading


def _weight_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the index or the single file."""
    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index) and os.path.isfile(single):
        # transformers loads the single file and ignores the index: which one holds the model is not ours to guess
        raise ValueError(f"{path!r} holds both {SINGLE_FILE} and {INDEX_FILE} (transformers would load "
                         f"{SINGLE_FILE} and ignore the shards); remove the stale one")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"corrupt safetensors index {index!r}: {type(e).__name__}: {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise ValueError(f"corrupt safetensors index {index!r}: weight_map must map tensor names to shard "
                             "file names")
        elsewhere = sorted({fn for fn in weight_map.values() if os.path.basename(fn) != fn or fn in (".", "..")})
        if elsewhere:  # "../x.safetensors", "/abs/x.safetensors": the folder must not send us to read other files
            raise ValueError(f"corrupt safetensors index {index!r}: shard {elsewhere[0]!r} is not a file name in "
                             f"{path!r} (an index names the shards beside it)")
        files = {n: os.path.join(path, fn) for n, fn in weight_map.items()}
        for fn in sorted(set(files.values())):
            if not os.path.isfile(fn):
                raise FileNotFoundError(f"shard {fn!r} listed in {index!r} does not exist")
        return files
    if os.path.isfile(single):
        return {name: single for name in _open(single).keys()}
    pickles = sorted(f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{path!r} holds only pickle weights {pickles}; kvpop-jax loads safetensors only "
            "(pickles can run code). Convert once with transformers: "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True)`"
        )
    raise FileNotFoundError(f"no weights in {path!r}: expected {SINGLE_FILE} or {INDEX_FILE}")


def _open(filename: str):
    try:
        return safe_open(filename, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupt safetensors file {filename!r}: {e}") from e


STORED_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the weights' dtypes we read
STORED_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")  # a stored tensor's layer (a base Qwen3Model's too)
NAMES_SHOWN = 8  # tensor names an error lists before counting the rest (a 36-layer mismatch is 400 names)


def _some(names: list[str]) -> str:
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    return f"{names[:NAMES_SHOWN]}{more}"


def _matched_tensors(path: str, config: Qwen3Config, files: dict[str, str], dtype: Any = jnp.float32):
    """(name map, expected abstract params, open handles) after checking the files' headers
    against the config: the same tensor names (a tied lm_head may be stored), each of the shape
    config.json implies. Reads no tensor data."""
    # The layer count first: the expected params are built per layer, and a hostile num_hidden_layers
    # (1e9) would take hours and gigabytes before any name was compared.
    layers = {int(m.group(1)) for m in map(STORED_LAYER.match, files) if m}
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"checkpoint {path!r} does not match the config: the config has num_hidden_layers="
                         f"{config.num_hidden_layers}, the weights hold {len(layers)} layers")
    expected = traverse_util.flatten_dict(abstract_params(config, dtype), sep="/")
    names = name_map(config, expected)
    file_names = set(files)
    tied_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(names) - file_names)
    unexpected = sorted(file_names - set(names) - tied_extra)
    if missing or unexpected:
        hint = ""
        if missing and unexpected and all(not n.startswith(("model.", "lm_head.")) for n in unexpected):
            hint = " (no 'model.' prefix and no lm_head: a base Qwen3Model's weights, not Qwen3ForCausalLM's)"
        raise ValueError(f"checkpoint {path!r} does not match the config: missing tensors {_some(missing)}, "
                         f"unexpected tensors {_some(unexpected)}{hint}")
    handles = {fn: _open(fn) for fn in sorted(set(files.values()))}
    for hf_name, (param_path, kind) in names.items():
        want = expected[param_path]
        try:  # the transform of a zero-memory view: nothing allocated, whatever sizes config.json names
            hf_shape = tuple(TRANSFORMS[kind][1](np.broadcast_to(np.int8(0), want.shape), config).shape)
        except ValueError:  # over 2**63 elements: a shape no file holds
            hf_shape = want.shape
        try:
            stored = handles[files[hf_name]].get_slice(hf_name)
            shape, stored_dtype = tuple(stored.get_shape()), stored.get_dtype()
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"corrupt safetensors file {files[hf_name]!r} reading {hf_name!r}: {e}") from e
        if shape != hf_shape:
            raise ValueError(f"checkpoint {path!r}: shape mismatch for tensor {hf_name!r}: expected {hf_shape} "
                             f"from config.json, got {shape}")
        if stored_dtype not in STORED_FLOAT_DTYPES:  # int8, bool: cast silently; F8: numpy cannot read it
            raise ValueError(f"checkpoint {path!r}: tensor {hf_name!r} is stored as {stored_dtype}; expected one of "
                             f"{STORED_FLOAT_DTYPES} (a quantized checkpoint's weights need scales kvpop-jax does not "
                             "read: load the unquantized model)")
    return names, expected, handles


TIED_CHECK_ROWS = 4096  # embedding rows compared at a time (bounded host memory at any vocabulary size)


def _check_tied_head(path: str, files: dict[str, str], handles: dict) -> None:
    """A tied model's stored `lm_head.weight` must equal the embedding: transformers unties a
    checkpoint whose two differ (and its logits use the stored head), while the tied params would
    silently use the embedding. Compared in row chunks, never two whole copies on the host."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if head not in files:
        return
    try:
        a, b = handles[files[head]].get_slice(head), handles[files[embed]].get_slice(embed)
        same = tuple(a.get_shape()) == tuple(b.get_shape())
        rows = a.get_shape()[0] if same else 0
        for start in range(0, rows, TIED_CHECK_ROWS):
            stop = min(start + TIED_CHECK_ROWS, rows)  # safetensors slices do not clamp
            # equal_nan: a NaN embedding is the finiteness check's to name (below), not a difference
            if not np.array_equal(a[start:stop], b[start:stop], equal_nan=True):
                same = False
                break
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupt safetensors file reading {head!r} and {embed!r} in {path!r}: {e}") from e
    if not same:
        raise ValueError(f"checkpoint {path!r}: config.json has tie_word_embeddings=true but the stored {head!r} "
                         f"differs from {embed!r} (transformers would untie them); set tie_word_embeddings to "
                         f"false in config.json, or drop {head!r}")


FINGERPRINT_SAMPLES = 32  # chunks read per weight file
FINGERPRINT_CHUNK = 1 << 16


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """A sha256 hex digest of a checkpoint directory's weights: each safetensors file's name, size,
    header and `FINGERPRINT_SAMPLES` chunks of its bytes at evenly spaced offsets. It reads about
    2 MiB a file whatever the model's size. Copies of a checkpoint agree wherever they lie; weights
    changed throughout (another model, fine-tuned, noised) do not. A change confined to a few
    bytes between the samples goes unseen: a guard against resuming from the wrong model, not a
    checksum."""
    path = os.fspath(path)
    digest = hashlib.sha256()
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        filename = os.path.join(path, name)
        size = os.path.getsize(filename)
        digest.update(f"{name}\0{size}\0".encode())
        with open(filename, "rb") as f:
            header = f.read(8)
            digest.update(header + f.read(min(int.from_bytes(header, "little") if len(header) == 8 else 0, 1 << 24)))
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(size * i // FINGERPRINT_SAMPLES)
                digest.update(f.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()


def _require_directory(path: str) -> None:
    """FileNotFoundError for a checkpoint folder that is not there, or naming a file given for it
    (its config.json, say: it was called missing)."""
    if os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} is a file; pass the folder that holds it "
                                f"({os.path.dirname(path) or '.'!r})")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")


def check_checkpoint(path: str | os.PathLike) -> Qwen3Config:
    """The config of the checkpoint directory `path`, after checking all that can be checked
    without reading the weights: config.json parses, every safetensors file's header opens (a
    truncated or non-safetensors file is a ValueError naming it), and the headers hold exactly
    the tensors the config implies, at its shapes. Cheap at any model size."""
    path = os.fspath(path)
    _require_directory(path)
    config = Qwen3Config.from_hf(path)
    _matched_tensors(path, config, _weight_files(path))
    return config


def _float_dtype(dtype: Any) -> Any:
    """`dtype` as a jnp dtype, if it is one of FLOAT_DTYPES (names like "bfloat16" too); ValueError otherwise."""
    try:
        name = np.dtype(jnp.dtype(dtype)).name
    except TypeError:
        name = None
    if name not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype!r}: the params load as one of {FLOAT_DTYPES} (e.g. jnp.bfloat16)")
    return jnp.dtype(name)


def load_pretrained(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    config: Qwen3Config | None = None,
    shardings: Any = None,
) -> tuple[Qwen3Config, dict]:
    """Loads a HF Qwen3 checkpoint directory -> (config, params).

    Args:
      path: directory with config.json and safetensors weights.
      dtype: parameter dtype (float32 default; bf16 for large models).
      config: override the config read from the directory (e.g. to add `kvpop`); its tensors
        must then be in the files, as for the directory's own config.
      shardings: optional pytree of `jax.sharding.Sharding` matching the params; each
        tensor is placed straight onto its shards.
    """
    path = os.fspath(path)
    _require_directory(path)
    dtype = _float_dtype(dtype)
    config = config or Qwen3Config.from_hf(path)
    files = _weight_files(path)
    names, expected, handles = _matched_tensors(path, config, files, dtype)  # every name and shape, before any data
    if config.tie_word_embeddings:
        _check_tied_head(path, files, handles)
    flat_shardings = traverse_util.flatten_dict(shardings, sep="/") if shardings is not None else {}

    flat: dict[str, jax.Array] = {}
    for hf_name, (param_path, kind) in names.items():
        fn = files[hf_name]
        try:
            tensor = handles[fn].get_tensor(hf_name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"corrupt safetensors file {fn!r} reading {hf_name!r}: {e}") from e
        want = expected[param_path]
        with np.errstate(over="ignore"):  # an overflow is refused just below, by name
            value = np.asarray(TRANSFORMS[kind][0](tensor, config)).astype(want.dtype)
        if not np.isfinite(value).all():  # checked once, on the loaded value
            if not np.isfinite(tensor).all():  # a NaN scorer would silently keep the oldest tokens
                raise ValueError(f"checkpoint {path!r}: tensor {hf_name!r} in {fn!r} holds NaN or infinite values")
            raise ValueError(f"checkpoint {path!r}: tensor {hf_name!r} in {fn!r} holds values beyond the range "
                             f"of {np.dtype(want.dtype).name} (max {float(np.abs(tensor).max()):g}); load it as "
                             "float32 or bfloat16")
        sharding = flat_shardings.get(param_path)
        flat[param_path] = jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)
        del tensor, value
    return config, traverse_util.unflatten_dict(flat, sep="/")


# ---------------------------------------------------------------------------------------
# Saving

MANIFEST_FILE = "kvpop_export.json"  # the files an export wrote: the only ones a later export removes
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def check_params(config: Qwen3Config, params: dict) -> dict[str, Any]:
    """The params flattened ("a/b/c" -> array), checked against `config`: the same leaves, the
    config's shapes and a float dtype. Raises ValueError naming the first bad leaf (save_pretrained
    also refuses non-finite values, checked as each tensor is converted)."""
    flat = traverse_util.flatten_dict(dict(params), sep="/")
    expected = traverse_util.flatten_dict(abstract_params(config), sep="/")
    missing, unexpected = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    if missing or unexpected:
        raise ValueError(f"the params do not match the config: missing {missing}, unexpected {unexpected}")
    for name, want in expected.items():
        value = flat[name]
        if tuple(np.shape(value)) != tuple(want.shape):
            raise ValueError(f"param {name!r} has shape {tuple(np.shape(value))}; the config needs {tuple(want.shape)}")
        if np.dtype(value.dtype).name not in FLOAT_DTYPES:
            raise ValueError(f"param {name!r} has dtype {np.dtype(value.dtype).name}; an export needs one of "
                             f"{FLOAT_DTYPES}")
    return flat


def _library_files(path: str) -> set[str]:
    """What an earlier export wrote into `path`: its manifest, or (exports without one) the
    config, weights and index that the index names."""
    manifest = os.path.join(path, MANIFEST_FILE)
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                return set(json.load(f)["files"]) | {MANIFEST_FILE}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: fall back to the names only an export writes
    owned = {"config.json", SINGLE_FILE, INDEX_FILE}
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            owned |= set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return owned


def save_pretrained(
    config: Qwen3Config,
    params: dict,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 4 * 1024**3,
    extra_files: Mapping[str, str] | None = None,
) -> None:
    """Writes params as a HF-compatible checkpoint (safetensors + config.json).

    Tied embeddings are written once (no `lm_head.weight`), as HF does. Tensors keep
    their dtype. With more than `max_shard_bytes` of weights the files are sharded
    `model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json`.
    `extra_files` (name -> source file, e.g. the tokenizer) are copied in with them.

    Safe to point at an existing export: the params are checked against the config
    (`check_params`) before anything is written; the export is written into a temporary
    sibling directory and swapped in whole, so a killed save leaves the old one loadable.
    Files the library wrote before (listed in `kvpop_export.json`) are replaced or removed,
    but for a tokenizer, kept (with a warning) when `extra_files` brings none; every other file
    and folder in `path` is kept. Refuses an empty path and the working directory or a folder
    above it (the swap would replace the folder the process is in).
    """
    path = fileio.check_replaceable_dir(path, "the export path")
    if extra_files is not None and not isinstance(extra_files, Mapping):  # dict() of a list of paths: a riddle
        raise TypeError(f"extra_files maps each file's name in the checkpoint to its source path, e.g. "
                        f"{{'tokenizer.json': 'src/tokenizer.json'}}; got {type(extra_files).__name__}")
    extra_files = dict(extra_files or {})
    for name, src in extra_files.items():
        if os.path.basename(name) != name or not os.path.isfile(src):
            raise ValueError(f"extra file {name!r}: need a plain file name and an existing source, got {src!r}")
        if name in (MANIFEST_FILE, "config.json") or name.endswith(".safetensors") or name == INDEX_FILE:
            raise ValueError(f"extra file {name!r}: the export writes that name itself (weights and config "
                             "come from the params and the config)")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"cannot export to {path!r}: it exists and is not a directory")
    parent = fileio.nearest_existing(os.path.dirname(path))
    if not os.path.isdir(parent):  # not os.makedirs' bare FileExistsError
        raise NotADirectoryError(f"cannot export to {path!r}: {parent!r} on its way is a file, not a directory")
    flat = check_params(config, params)  # the arguments first: then every tensor, copied to the host and checked
    names = name_map(config, flat)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    for hf_name in sorted(names):
        param_path, kind = names[hf_name]
        tensor = np.ascontiguousarray(TRANSFORMS[kind][1](np.asarray(jax.device_get(flat[param_path])), config))
        bad = int(np.size(tensor) - np.count_nonzero(np.isfinite(tensor)))
        if bad:
            raise ValueError(f"param {param_path!r} has {bad} non-finite values; refusing to export it")
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    previous = _library_files(path) if os.path.isdir(path) else set()
    if previous and not os.path.isfile(os.path.join(path, MANIFEST_FILE)):  # a folder no export of ours wrote?
        replaced = sorted(f for f in previous if os.path.isfile(os.path.join(path, f)))
        if replaced:
            warnings.warn(f"{path}: replacing {replaced}, which no {MANIFEST_FILE} lists (taken for an older "
                          "export's files; another model's, or yours, are gone after this export)", stacklevel=2)
    other_layout = SINGLE_FILE if len(shards) > 1 else INDEX_FILE  # kept beside the export, it would shadow or
    if other_layout not in previous and os.path.lexists(os.path.join(path, other_layout)):  # confuse the new one
        why = (f"transformers would load it over the new {INDEX_FILE}" if other_layout == SINGLE_FILE else
               f"beside the new {SINGLE_FILE} it makes the folder one that load_pretrained and kvpop_torch refuse")
        raise ValueError(f"cannot export to {path!r}: it holds a {other_layout} this library did not write, and "
                         f"{why}; move it away or pick another path")
    # A tokenizer the previous export copied in stays, whole, when this one brings none (re-saving a
    # fine-tuned model into its own export must not leave it without one); one file of a new
    # tokenizer replaces all of the old one's.
    carried = [] if set(extra_files) & set(TOKENIZER_FILES) else sorted(  # never a mix of two tokenizers
        name for name in previous & set(TOKENIZER_FILES) if os.path.isfile(os.path.join(path, name)))
    if carried:
        warnings.warn(f"{path}: kept the previous export's tokenizer files {carried} (this export named none; "
                      "pass extra_files to replace them)", stacklevel=2)
        extra_files.update({name: os.path.join(path, name) for name in carried})
    with fileio.staged_directory(path) as stage:
        metadata = {"format": "pt"}

        def put(name: str, data: bytes) -> None:
            fileio.write_synced(os.path.join(stage.path, name), data)
            stage.written.add(name)

        if len(shards) == 1:
            put(SINGLE_FILE, safetensors_save_bytes(shards[0], metadata=metadata))
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                put(fn, safetensors_save_bytes(shard, metadata=metadata))
                weight_map.update({n: fn for n in shard})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            put(INDEX_FILE, json.dumps(index, indent=2).encode())
        dtypes = {str(t.dtype) for shard in shards for t in shard.values()}
        hf_config = config.to_hf()
        # The weights' one float dtype (transformers loads them at it); mixed ones: float32.
        hf_config["torch_dtype"] = dtypes.pop() if len(dtypes) == 1 and dtypes <= set(FLOAT_DTYPES) else "float32"
        put("config.json", json.dumps(hf_config, indent=2).encode())
        for name, src in sorted(extra_files.items()):
            with open(src, "rb") as f:
                put(name, f.read())
        put(MANIFEST_FILE, json.dumps({"format": 1, "files": sorted(stage.written)}, indent=1).encode())
        stage.discard |= previous  # stale files of the previous export; everything else is carried over
    kept = stage.kept
    lookalikes = [f for f in kept if f.endswith((".safetensors", *PICKLE_SUFFIXES))]
    if lookalikes:
        warnings.warn(f"{path}: kept weight files this export did not write: {lookalikes} "
                      f"(the export is {SINGLE_FILE if len(shards) == 1 else INDEX_FILE})", stacklevel=2)


# ---------------------------------------------------------------------------------------
# Tokenizers

# What a HF tokenizer may consist of (copied next to an export); the first two or
# `tokenizer.model` make a directory loadable.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


def load_tokenizer(directory: str | os.PathLike):
    """The checkpoint's own tokenizer (`AutoTokenizer.from_pretrained`, offline: a local path
    is never looked up on the hub)."""
    from transformers import AutoTokenizer

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"no tokenizer at {directory!r}: not a directory")
    if not has_tokenizer(directory):
        # transformers 5 would otherwise build an empty tokenizer of the model type's class from
        # config.json alone, and every prompt would encode to nothing
        raise ValueError(f"no tokenizer in {directory}: none of {list(_LOADABLE)} is there")
    try:  # trust_remote_code=False: an auto_map in tokenizer_config.json is refused, never run (or asked about)
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise ValueError(f"no tokenizer could be loaded from {directory}: {e}") from e


# Any one of these makes a directory's tokenizer loadable.
_LOADABLE = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether the directory holds tokenizer files (checked by file: see `load_tokenizer`)."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in _LOADABLE)


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    """`content` as one user turn of the tokenizer's chat template, with the assistant's opening: its
    token ids. transformers 5 returns a BatchEncoding by default, 4 a list of ids: both asked for the dict.
    A template that fails (its own `raise_exception`, or an attribute the sandbox refuses) is named."""
    try:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
    except Exception as e:  # jinja2's TemplateError and SecurityError: tracebacks through eval.main, naming nothing
        raise ValueError(f"the tokenizer's chat template failed on the prompt ({type(e).__name__}: {e})") from e
    return list(encoded["input_ids"])


GENERATION_CONFIG = "generation_config.json"


def stop_token_ids(directory: str | os.PathLike, config: Qwen3Config) -> tuple[int, ...]:
    """The ids that end a generation from this checkpoint: config.json's `eos_token_id` and those of
    its generation_config.json, as transformers' `generate` stops (Qwen3's file lists <|im_end|> and
    <|endoftext|>, config.json only one). Ids are not checked here (`generate` names a bad one)."""
    ids = []
    for eos in (config.eos_token_id, _generation_config(directory).get("eos_token_id")):
        ids.extend(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return tuple(dict.fromkeys(ids))


def _generation_config(directory: str | os.PathLike) -> dict:
    path = os.path.join(os.fspath(directory), GENERATION_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not a JSON file: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def checkpoint_tokenizer(checkpoint):
    """The checkpoint directory's tokenizer, or None when it ships none."""
    if not isinstance(checkpoint, (str, os.PathLike)) or not has_tokenizer(checkpoint):
        return None
    return load_tokenizer(checkpoint)
