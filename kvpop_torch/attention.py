"""The "kvpop" attention function, registered with transformers' `AttentionInterface` (no remote code).

transformers calls it as `fn(module, query [B, Hq, T, D], key [B, Hkv, K, D], value, attention_mask,
scaling=..., **kwargs)` with the keys/values `KVpopCache.update` returned, and those keys carry the
call's `KVpopMask` (`with_mask`): the one channel from the cache to the attention that every
transformers from 4.56 on keeps (4.56-5.23 call `cache.update` without the attention's kwargs, and
neither side is handed the other's objects), and one bound to its call, so it cannot go stale or
reach another model's, cache's or thread's attention. Query head `h * G + g` reads KV head h (as `repeat_kv`),
so each KV head's G query heads are folded into one query axis and share its mask: keys and
values are never repeated. The prefill mask is built one query block at a time, so memory is
O(block x P) per head rather than O(P^2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvpop_torch import policy

ATTENTION_NAME = "kvpop"
QUERY_BLOCK = 512
MASK_ATTRIBUTE = "kvpop_mask"  # the attribute of the keys `KVpopCache.update` returns that holds their mask


class KVpopMask:
    """Which keys each query of one attention call may read, per KV head.

    Either `slot_valid` bool [B, Hkv, 1, N] (decode: the non-empty slots), the prompt's
    `prefill_last_kept` int [B, Hkv, P] (`policy.last_kept_query`) with the sinks and window, or
    `spans` (enter, leave) int [B, Hkv, K] (a multi-token continuation: the queries that read each key).
    `consumed` is set by the attention function, so the cache can tell when it was ignored.
    """

    def __init__(self, *, slot_valid=None, prefill_last_kept=None, sinks: int = 0, window: int = 1, spans=None):
        self.slot_valid, self.last_kept, self.spans = slot_valid, prefill_last_kept, spans
        self.sinks, self.window = sinks, window
        self.consumed = False

    @property
    def is_prefill(self) -> bool:
        return self.last_kept is not None

    def rows(self, q0: int, q1: int) -> torch.Tensor:
        """bool [B, Hkv, q1 - q0, K] for the queries q0..q1-1 of this call."""
        if self.slot_valid is not None:
            return self.slot_valid
        if self.spans is not None:  # key j is read by the queries i with enter_j <= i < leave_j
            enter, leave = self.spans
            i = torch.arange(q0, q1, device=enter.device)[:, None]
            return (enter[:, :, None, :] <= i) & (i < leave[:, :, None, :])
        return policy.prefill_mask_block(self.last_kept, q0, q1, sinks=self.sinks, window=self.window)


def with_mask(keys: torch.Tensor, mask: KVpopMask) -> torch.Tensor:
    """keys [B, Hkv, K, D] as a new tensor object on the same storage (autograd sees a view), carrying `mask`."""
    keys = keys.view_as(keys)
    setattr(keys, MASK_ATTRIBUTE, mask)
    return keys


def check_prefill_positions(position_ids, length: int, *, cache_read: bool = True) -> None:
    """A prompt on a fresh cache sits at positions 0..P-1: ValueError otherwise (padding or an offset).
    `cache_read`: whether the cache already read the prompt into its first layer (the attention's check)."""
    if position_ids is None:
        return
    want = torch.arange(length, device=position_ids.device)
    if position_ids.shape[-1] != length or not bool((position_ids == want).all()):
        raise ValueError("KVpopCache needs unpadded prompts of equal length at positions 0..P-1 (padding "
                         "tokens would take sink and long-range slots); decode ragged prompts one at a time"
                         + (", each with a fresh cache (this one read the prompt into its first layer)"
                            if cache_read else ""))


def kvpop_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """Masked softmax attention under the KVpop cache's mask -> (out [B, T, Hq, D], None)."""
    mask = getattr(key, MASK_ATTRIBUTE, None)
    if mask is None:
        passed_as_cache = "cache" in kwargs  # a transformers whose forward takes past_key_values passed it on
        raise ValueError(f"attn_implementation={ATTENTION_NAME!r} needs a KVpopCache: "
                         "model.generate(ids, cache=KVpopCache.from_pretrained(export_dir, model)) or "
                         "model(ids, cache=cache); for dense attention load the model with 'sdpa'"
                         + ("; this transformers names the model's cache argument past_key_values (a model from "
                            "kvpop_torch.load or KVpopCache.from_pretrained(export_dir, model) also takes cache=)"
                            if passed_as_cache else ""))
    if mask.is_prefill:
        check_prefill_positions(kwargs.get("position_ids"), query.shape[2])
    mask.consumed = True
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    outs = []
    for q0 in range(0, t, QUERY_BLOCK):
        q1 = min(t, q0 + QUERY_BLOCK)
        q_blk = query[:, :, q0:q1].reshape(b, hkv, g * (q1 - q0), d)  # [B, Hkv, G*Tb, D]
        rows = mask.rows(q0, q1)
        rows = rows[:, :, None].expand(-1, -1, g, -1, -1).reshape(b, hkv, g * (q1 - q0), -1)
        out = F.scaled_dot_product_attention(q_blk, key, value.to(query.dtype), attn_mask=rows, scale=scaling)
        outs.append(out.reshape(b, hq, q1 - q0, d))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, kvpop_attention)
