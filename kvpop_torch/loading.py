"""`kvpop_torch.load(dir)`: a model and a cache factory for any export, KVpop or dense."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

from kvpop_torch.attention import ATTENTION_NAME
from kvpop_torch.cache import KVpopCache, guard_new_tokens
from kvpop_torch.checkpoint import check_weights, load_heads
from kvpop_torch.config import read_config


def check_device(device) -> torch.device:
    """`device` as a torch.device that this torch can use, before any weight is read; ValueError naming it
    otherwise (torch's own errors are a RuntimeError for a bad string and an AssertionError, "Torch not
    compiled with CUDA enabled", only once the weights move)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this torch sees no CUDA device (torch.cuda.is_available() is "
                         "False): load on device='cpu', or install a CUDA build of torch")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}, but this torch sees {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda", "meta"):  # mps, xpu, ...: an empty tensor there fails as the weights would
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(f"device={device!r}, but this torch cannot use it ({type(e).__name__}: {e})") from None
    return dev


NAMES_SHOWN = 8  # tensor names an error lists before counting the rest (a 36-layer mismatch is 400 names)


def _shown(names: list) -> str:
    return str(names[:NAMES_SHOWN]) + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def load(directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device=None, device_map=None):
    """(model, make_cache) for an export: `model.generate(ids, cache=make_cache(), ...)`.

    `device` puts the whole model on one device; `device_map` (e.g. "auto", needs `accelerate`) is
    passed to `from_pretrained` to split it, and each layer's scorer then runs on its layer's device.

    A KVpop export loads with the "kvpop" attention and `make_cache()` returns a fresh
    `KVpopCache` (the scorers are loaded once and shared); a dense export loads with "sdpa"
    and `make_cache()` returns a `DynamicCache`. A DMS export is refused (its gates are not
    implemented here).
    """
    if device is not None and device_map is not None:
        raise ValueError(f"give device ({device!r}) or device_map ({device_map!r}), not both")
    if device is not None:
        check_device(device)
    config = read_config(directory)
    check_weights(directory, config)  # a corrupt file named here, not a bare SafetensorError from transformers
    kvpop = bool(config.get("kvpop"))
    # The kvpop tensors are ours, not the model's: load quietly, then report anything else.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            os.fspath(directory), dtype=dtype, attn_implementation=ATTENTION_NAME if kvpop else "sdpa",
            output_loading_info=True, trust_remote_code=False,  # an auto_map in config.json is refused, never run
            **({} if device_map is None else {"device_map": device_map}))
    finally:
        hf_logging.set_verbosity(verbosity)
    unexpected = sorted(k for k in info["unexpected_keys"] if ".self_attn.kvpop." not in k)
    scorers = sorted(k for k in info["unexpected_keys"] if ".self_attn.kvpop." in k)
    if scorers and not kvpop:  # a KVpop export whose config lost its block would decode densely
        raise ValueError(f"{os.fspath(directory)!r} holds KVpop scorer tensors ({scorers[0]}, ...) but its "
                         "config.json has no 'kvpop' settings: restore them (the export's config.json as written), "
                         "or load a dense checkpoint")
    if info["missing_keys"] or info["mismatched_keys"] or unexpected:
        raise ValueError(f"{os.fspath(directory)!r} does not match its config: missing "
                         f"{_shown(sorted(info['missing_keys']))}, mismatched {_shown(list(info['mismatched_keys']))}, "
                         f"unexpected {_shown(unexpected)}")
    model = model.to(device).eval() if device is not None else model.eval()
    guard_new_tokens(model)  # (a dense model too: it takes cache= on every transformers)
    if not kvpop:
        return model, lambda: DynamicCache(config=model.config)
    device = next(model.parameters()).device
    settings, heads = load_heads(directory, device=device)
    return model, lambda: KVpopCache(settings, heads)
