"""`KVpopCache`: the bounded per-KV-head KVpop cache as a `transformers` Cache.

Each layer keeps `N = s + w + k` slots per (batch row, KV head), laid out exactly as
`kvpop_jax.cache.KVpopLayerCache`:

  slots [0, s)          sinks: token t < s in slot t
  slots [s, s + w)      the window ring: token t >= s in slot s + (t - s) % w
  slots [s + w, N)      the long-range top-k, each with its token's static priority

`update` (called by the attention layer with the new, RoPE-rotated keys and values) does
what `KVpopHead.prefill` / `decode` do on the JAX side:

- prefill (first call, P > 1 tokens): scores the prompt, returns its P keys/values for the
  masked parallel forward and keeps the retained set after its last token;
- decode (one token): the token u = q - w leaving the window competes for the k long-range
  slots (an empty slot first, else the worst priority, ties: the later position, is replaced
  iff u's priority is strictly higher), token q takes its ring slot, and the N slots are
  returned;
- continuation (L > 1 tokens on a started cache: a later chat turn, a chunked prompt): what L
  decode steps give, computed at once (the scorer chunkwise from its carried state, the long-range
  slots by `policy.long_range_steps`); the attention reads the N slots from before the call and
  the L new keys, each query those held right after its own step (`KVpopMask.spans`).

The mask for the attention rides on the keys `update` returns (`attention.with_mask`), which
transformers hands straight to the attention function registered as "kvpop"
(`kvpop_torch.attention`), which applies it. Memory after the prefill is constant: N slots per
head and the mLSTM state.

The layer answers every form of `CacheLayerMixin` from transformers 4.56 on: `update(k, v)` then a
cache_kwargs dict (to 5.0), nothing (5.5-5.23) or `kwargs=` the attention's (5.24 on), all unread;
`lazy_initialization(k)` (4.56-4.57) or `(k, v)`; `get_mask_sizes(cache_position)` (to 5.0) or
`(query_length)`; `get_max_cache_shape` (abstract to 5.10 at least) and `get_max_length` (5.15 on).
transformers 4.56-5.23 name the model's cache argument `past_key_values`, 5.24 on `cache`
(`past_key_values` deprecated): a guarded model (`guard_new_tokens`) takes `cache=` on all of them.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from typing import Sequence

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop_torch import policy
from kvpop_torch.attention import ATTENTION_NAME, KVpopMask, check_prefill_positions, with_mask
from kvpop_torch.checkpoint import load_heads
from kvpop_torch.config import KVpopSettings
from kvpop_torch.scorers import KVpopHead, MLSTMState, static_priority

LATEST_EMPTY = 2**62  # sorts an empty slot after every position when picking the worst slot
# Token ids a cache keeps of what it read, its last ones: enough to tell the conversation it holds, passed again with
# a next turn, from a new prompt (`KVpopCache.check_continues`), at a constant 64 ids per row.
READ_TAIL = 64


def ring_slot(t: int, settings: KVpopSettings) -> int:
    """Slot of token t: t for a sink, s + (t - s) % w in the window ring."""
    return t if t < settings.sinks else settings.sinks + (t - settings.sinks) % settings.window


class KVpopLayer(CacheLayerMixin):
    """One layer's bounded cache (see the module docstring).

    keys, values: [B, Hkv, N, D] (the model's dtype); pos: int64 [B, Hkv, N], the token in
    each slot (-1 empty); priority: float32 [B, Hkv, N] (NEG_INF where unknown); state: the
    mLSTM state or None; seen: tokens seen so far (what `get_seq_length` reports).
    """

    is_compileable = False  # generate() must not compile or build 4D masks from slot indices
    is_croppable = False
    is_sliding = False

    def __init__(self, settings: KVpopSettings, head: KVpopHead):
        super().__init__()
        self.is_initialized = False  # (transformers 4.56's CacheLayerMixin does not set it)
        self.settings, self.head = settings, head
        self.seen = 0
        self.pos = self.priority = self.state = None
        self._pending: KVpopMask | None = None

    @property
    def num_slots(self) -> int:
        return self.settings.budget

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        # (transformers 4.56-4.57's early_initialization passes the keys only; a Qwen3 value is a key's size)
        value_states = key_states if value_states is None else value_states
        b, h, _, d = key_states.shape
        n = self.num_slots
        self.dtype, self.device, self.batch_size = key_states.dtype, key_states.device, b
        # The scorer follows its layer: with a device_map that splits the layers over GPUs (or offloads them),
        # the keys arrive on the layer's device, wherever the scorers were loaded.
        if self.head.decay_alpha.device != self.device:
            self.head.to(self.device)
        self.keys = key_states.new_zeros(b, h, n, d)
        self.values = value_states.new_zeros(b, h, n, value_states.shape[-1])
        self.pos = torch.full((b, h, n), -1, dtype=torch.long, device=self.device)
        self.priority = torch.full((b, h, n), policy.NEG_INF, dtype=torch.float32, device=self.device)
        self.state = self.head.scorer.init_state(b, self.device) if self.settings.scorer == "mlstm" else None
        self.is_initialized = True

    # -- the two steps ------------------------------------------------------------------

    def update(self, key_states, value_states, *_, **__):
        """key/value_states [B, Hkv, T, D] -> the keys/values this call attends to, the keys carrying its KVpopMask.

        Whatever else transformers passes (a cache_kwargs dict, the attention's kwargs or nothing) is unread."""
        require_mask_applied(self._pending)
        self._writable()
        if not self.is_initialized or (self.seen == 0 and key_states.shape[0] != self.batch_size):  # fresh or reset
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch_size:  # torch would fail in a cat or a where, naming no cache
            raise ValueError(f"this KVpopCache holds {self.batch_size} rows and the call brings "
                             f"{key_states.shape[0]}: go on with all of its rows (the last output plus the next "
                             "turn), or start a fresh cache (make_cache()) for another batch")
        length = key_states.shape[2]
        if length == 1:
            out = self._decode(key_states, value_states)[:3]
        elif self.seen == 0:
            out = self._prefill(key_states, value_states)  # (its positions are checked by the attention)
        else:
            out = self._continue(key_states, value_states)
        self.seen += length
        self._pending = out[2]
        return with_mask(out[0], out[2]), out[1]

    @torch.no_grad()
    def _prefill(self, k, v):
        """The masked parallel forward's mask over the prompt, and the cache after its last token."""
        s, w, topk = self.settings.sinks, self.settings.window, self.settings.topk
        b, h, p, _ = k.shape
        t = torch.arange(p, device=k.device)
        k_bshd, v_bshd = self.head.scorer_keys(k.transpose(1, 2), t[None]), v.transpose(1, 2)
        scorer = self.head.scorer
        if self.settings.scorer == "mlstm":
            scores, self.state = scorer.scores_and_state(k_bshd, v_bshd)
        else:
            scores = scorer(k_bshd, v_bshd)
        scores = scores.float() + self.head.position_term(t)
        priority = static_priority(scores, self.head.log_gamma(), t)
        last_kept = policy.last_kept_query(policy.ranks_from_priority(priority), sinks=s, window=w, topk=topk)
        mask = KVpopMask(prefill_last_kept=last_kept, sinks=s, window=w)

        if self.settings.delayed:  # window tokens get their score when they leave
            priority = torch.where(t + w <= p - 1, priority, torch.tensor(policy.NEG_INF, device=k.device))
        in_place = ((t < s) | (t > p - 1 - w)).nonzero()[:, 0]
        slots = torch.tensor([ring_slot(int(x), self.settings) for x in in_place.tolist()], device=k.device)
        self.keys[:, :, slots] = k[:, :, in_place].to(self.dtype)
        self.values[:, :, slots] = v[:, :, in_place].to(self.dtype)
        self.pos[:, :, slots] = in_place
        self.priority[:, :, slots] = priority[:, :, in_place]
        long_range = policy.prefill_long_range(priority, sinks=s, window=w, topk=topk)
        if long_range is not None:
            chosen, valid = long_range
            lr = slice(s + w, s + w + chosen.shape[-1])
            gather = lambda x: torch.gather(x, 2, chosen[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
            self.keys[:, :, lr] = torch.where(valid[..., None], gather(k), 0).to(self.dtype)
            self.values[:, :, lr] = torch.where(valid[..., None], gather(v), 0).to(self.dtype)
            self.pos[:, :, lr] = torch.where(valid, chosen, -1)
            self.priority[:, :, lr] = torch.where(valid, torch.gather(priority, 2, chosen), policy.NEG_INF)
        return k, v, mask

    @torch.no_grad()
    def _decode(self, k, v):
        """Token q = seen: score, admit the token leaving the window, write q, attend to the N slots."""
        cfg, scorer = self.settings, self.head.scorer
        q = self.seen
        k_t, v_t = k[:, :, 0], v[:, :, 0]  # [B, H, D]
        log_gamma = self.head.log_gamma()
        at = lambda pos: torch.tensor(pos, device=k.device)  # noqa: E731
        ks_t = self.head.scorer_keys(k_t[:, None], at(q))[:, 0]  # what the scorer reads (k_t is cached)
        if cfg.scorer == "mlstm":
            self.state = scorer.step(self.state, ks_t, v_t)
        if cfg.delayed:
            prio_t = torch.full(k_t.shape[:2], policy.NEG_INF, device=k.device)
        else:
            score_t = scorer.readout(self.state, ks_t, v_t) if cfg.scorer == "mlstm" else \
                scorer(ks_t[:, None], v_t[:, None])[:, :, 0]
            score_t = score_t.float() + self.head.position_term(at(q))
            prio_t = static_priority(score_t[..., None], log_gamma, at(q))[..., 0]
        slot = ring_slot(q, cfg)
        u = q - cfg.window  # leaves the window now: the token in the ring slot q takes
        gone = self.pos[:, :, slot].clone()  # the ring slot's token (u, or -1) leaves the cache, unless admitted
        if cfg.topk > 0 and u >= cfg.sinks:
            k_u, v_u = self.keys[:, :, slot], self.values[:, :, slot]
            if cfg.delayed:
                ks_u = self.head.scorer_keys(k_u[:, None], at(u))[:, 0]
                score_u = scorer.readout(self.state, ks_u, v_u).float() + self.head.position_term(at(u))
                prio_u = static_priority(score_u[..., None], log_gamma, at(u))[..., 0]
            else:
                prio_u = self.priority[:, :, slot]
            admit, replaced = self._admit(k_u, v_u, u, prio_u)  # views of the ring slot; writes long-range slots
            gone = torch.where(admit, replaced, gone)
        self.keys[:, :, slot] = k_t.to(self.dtype)
        self.values[:, :, slot] = v_t.to(self.dtype)
        self.pos[:, :, slot] = q
        self.priority[:, :, slot] = prio_t
        return self.keys, self.values, KVpopMask(slot_valid=(self.pos >= 0)[:, :, None, :]), gone

    @torch.no_grad()
    def _continue(self, k, v):
        """L > 1 new tokens on a started cache (a later chat turn, a chunked prompt), computed at once: what L
        one-token calls (`_decode`) give, to float rounding. The attention reads the slots before the call and
        the L new keys, query i those held right after token i's step (`KVpopMask.spans`). The scorer reads
        the L tokens chunkwise from the carried state, the long-range slots follow `policy.long_range_steps`."""
        cfg, head = self.settings, self.head
        s, w, n_lr = cfg.sinks, cfg.window, cfg.topk
        first, length = self.seen, k.shape[2]
        b, h, n = self.pos.shape
        dev = k.device
        keys = torch.cat([self.keys, k.to(self.dtype)], dim=2)  # [B, H, N + L, D]: every key a query may read
        values = torch.cat([self.values, v.to(self.dtype)], dim=2)
        t = first + torch.arange(length, device=dev)  # the new tokens' positions
        slot = torch.tensor([ring_slot(x, cfg) for x in range(first, first + length)], device=dev)
        u = t - w  # the token leaving the window at each step: in the ring slot token t takes, if u >= s
        leaves = u >= s
        u_key = torch.where(u < first, slot, n + u - first).clamp(max=n + length - 1)  # u's index in keys
        # What the scorer reads: the new tokens as written, a leaving token as cached (`_decode`'s k_t, k_u).
        ks_new, v_new = head.scorer_keys(k.transpose(1, 2), t[None]), v.transpose(1, 2)  # [B, L, H, D]
        log_gamma = head.log_gamma()
        neg_inf = torch.tensor(policy.NEG_INF, device=dev)
        if cfg.delayed:
            ks_u = head.scorer_keys(keys[:, :, u_key].transpose(1, 2), u.clamp(min=0)[None])
            v_u = values[:, :, u_key].transpose(1, 2)
            score_u, self.state = head.scorer.continue_scores(self.state, ks_new, v_new, ks_u, v_u)
            prio_u = static_priority(score_u.float() + head.position_term(u.clamp(min=0)), log_gamma, u)
            prio_t = neg_inf.expand(b, h, length)
        else:
            if cfg.scorer == "mlstm":
                score_t, self.state = head.scorer.continue_scores(self.state, ks_new, v_new, ks_new, v_new)
            else:
                score_t = head.scorer(ks_new, v_new)
            prio_t = static_priority(score_t.float() + head.position_term(t), log_gamma, t)
            prio_u = torch.where(u < first, self.priority[:, :, slot], prio_t[:, :, (u - first).clamp(min=0)])
        # Key j is read by queries [enter_j, leave_j): a slot's token from the start (an empty slot never),
        # new token i from its own step; each until the step that drops it (never: L).
        enter = torch.cat([torch.where(self.pos >= 0, -1, length),
                           torch.arange(length, device=dev).expand(b, h, -1)], dim=-1)
        leave = torch.full((b, h, n + length), length, dtype=torch.long, device=dev)
        steps = torch.arange(length, device=dev).expand(b, h, -1)
        gone = steps  # a leaving token without long-range slots leaves the cache at its step
        if n_lr > 0:
            lr = slice(s + w, n)
            cand_pos = torch.where(leaves, u, -1).expand(b, h, -1)
            lr_leave, gone, source = policy.long_range_steps(self.pos[:, :, lr], self.priority[:, :, lr], cand_pos,
                                                             prio_u, topk=n_lr)
            leave[:, :, lr] = torch.where(self.pos[:, :, lr] >= 0, lr_leave, length)
            # The long-range slots after the last step: each keeps its token or takes a candidate's.
            pick = source.clamp(min=0)
            for store, new in ((self.keys, keys), (self.values, values)):
                both = torch.cat([store[:, :, lr], new[:, :, u_key]], dim=2)
                store[:, :, lr] = torch.gather(both, 2, pick[..., None].expand(-1, -1, -1, both.shape[-1]))
            self.pos[:, :, lr] = torch.where(source >= 0, torch.gather(torch.cat([self.pos[:, :, lr], cand_pos], 2),
                                                                       2, pick), -1)
            self.priority[:, :, lr] = torch.where(source >= 0, torch.gather(
                torch.cat([self.priority[:, :, lr], prio_u], 2), 2, pick), neg_inf)
        keyed = leaves.nonzero()[:, 0]  # the steps at which a token leaves the window
        leave[:, :, u_key[keyed]] = gone[:, :, keyed]
        # The sink and ring slots after the last step: each slot its last writer's token.
        last = {int(x): i for i, x in enumerate(slot.tolist())}
        written, writer = (torch.tensor(list(d), device=dev) for d in (last.keys(), last.values()))
        self.keys[:, :, written] = k[:, :, writer].to(self.dtype)
        self.values[:, :, written] = v[:, :, writer].to(self.dtype)
        self.pos[:, :, written] = t[writer]
        self.priority[:, :, written] = prio_t[:, :, writer]
        return keys, values, KVpopMask(spans=(enter, leave))

    def _admit(self, k_u, v_u, u: int, prio_u):
        """u competes for the long-range slots (`kvpop_jax.cache.admit_to_long_range`): (admitted [B, H],
        the position it replaced there, -1 for an empty slot)."""
        lo = self.settings.sinks + self.settings.window
        lr_pos, lr_prio = self.pos[..., lo:], self.priority[..., lo:]
        empty = lr_pos < 0
        key = torch.where(empty, -float("inf"), lr_prio)
        at_min = key == key.amin(dim=-1, keepdim=True)
        worst = torch.argmax(torch.where(at_min, torch.where(empty, LATEST_EMPTY, lr_pos), -2), dim=-1)  # [B, H]
        pick = lambda x: torch.gather(x, -1, worst[..., None])[..., 0]  # noqa: E731
        admit = pick(empty) | (prio_u > pick(lr_prio))
        slot = (lo + worst)[..., None]  # [B, H, 1]
        for store, new in ((self.keys, k_u), (self.values, v_u)):
            index = slot[..., None].expand(-1, -1, -1, store.shape[-1])
            old = torch.gather(store, 2, index)[:, :, 0]
            store.scatter_(2, index, torch.where(admit[..., None], new.to(store.dtype), old)[:, :, None])
        replaced = torch.where(pick(empty), -1, pick(lr_pos))
        self.pos.scatter_(2, slot, torch.where(admit, u, pick(lr_pos))[..., None])
        self.priority.scatter_(2, slot, torch.where(admit, prio_u, pick(lr_prio))[..., None])
        return admit, replaced

    # -- the transformers Cache protocol -------------------------------------------------

    def get_seq_length(self) -> int:
        return self.seen  # tokens seen: generate() slices prompts and builds positions from it

    def get_max_length(self) -> int:
        return self.num_slots

    def get_max_cache_shape(self) -> int:  # get_max_length's name, abstract in transformers 4.56-5.10 at least
        return self.num_slots

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # Only consulted by transformers' own mask builders; the "kvpop" attention builds its own.
        # transformers 4.56-5.0 pass the call's cache_position [T], later ones its length T.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        if self.seen == 0:
            return query_length, 0
        return self.num_slots, self.seen + query_length - self.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes held: slots, bookkeeping and scorer state."""
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.pos, self.priority, *(self.state or ())]
        return sum(x.numel() * x.element_size() for x in tensors)

    def _writable(self) -> None:
        """Filled under torch.inference_mode() and written in place outside it, which torch forbids for inference
        tensors: the slots go on as normal copies (once), as transformers' DynamicCache goes on by concatenating."""
        if self.is_initialized and self.keys.is_inference() and not torch.is_inference_mode_enabled():
            self._map_batch(torch.clone)

    def reset(self) -> None:
        self._writable()
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.pos.fill_(-1)
            self.priority.fill_(policy.NEG_INF)
            if self.state is not None:
                self.state = self.head.scorer.init_state(self.batch_size, self.device)
        self.seen, self._pending = 0, None

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values, self.pos, self.priority = map(fn, (self.keys, self.values, self.pos, self.priority))
        if self.state is not None:
            self.state = MLSTMState(*map(fn, self.state))
        self.batch_size = self.keys.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda x: x[indices, ...])

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a KVpop cache cannot roll back: evicted tokens are gone")


class KVpopCache(Cache):
    """Bounded KVpop cache for every layer of a KVpop export; pass it to `model.generate(..., cache=...)`.

        model = AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation="kvpop")
        cache = KVpopCache.from_pretrained(export_dir, model)
        out = model.generate(ids, cache=cache, max_new_tokens=64, do_sample=False)

    A cache serves one generation (one prompt batch); make a new one for the next.
    """

    def __init__(self, settings: KVpopSettings, heads: Sequence[KVpopHead]):
        self.read_tail: torch.Tensor | None = None  # int64 [B, <= READ_TAIL]: the last ids read (`note_read`)
        self.read_ids_known = True  # False once a call brought embeddings, not ids
        self.settings = settings
        self.warned_positions = False  # past max_position_embeddings (`check_new_tokens`)
        super().__init__(layers=[KVpopLayer(settings, head) for head in heads])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Each layer's update first checks that the layer below attended under its KVpop mask, so a model
        loaded with another attention fails within its first forward (a one-call generation included), not
        at the next call. A cache built without `from_pretrained(d, model)` skips the up-front check.

        The layer is called directly, not through `Cache.update`, whose signature changed (4.56-5.0: cache_kwargs;
        5.5 on: *args, **kwargs); this cache has every layer from the start and never offloads, the rest of what
        `Cache.update` does."""
        if 0 < layer_idx <= len(self.layers):
            require_mask_applied(self.layers[layer_idx - 1]._pending)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, model=None, *, device=None) -> "KVpopCache":
        """The cache for the KVpop export in `directory` (config.json "kvpop" block and its safetensors).

        With `model`, checks that it attends through "kvpop" and puts the scorers on its device. Each layer's
        scorer then follows its layer's keys at the first update, so a `device_map` over several GPUs works.
        """
        if model is not None:
            check_attention(model)
            guard_new_tokens(model)
            device = device or next(model.parameters()).device
        settings, heads = load_heads(directory, device=device)
        return cls(settings, heads)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def note_read(self, ids: torch.Tensor | None) -> None:
        """Remembers the last READ_TAIL of the ids a forward reads into this cache (None: embeddings, ids unknown)."""
        if ids is None:
            self.read_ids_known = False
            return
        tail = ids if self.read_tail is None else torch.cat([self.read_tail, ids.to(self.read_tail.device)], 1)
        self.read_tail = tail[:, -READ_TAIL:]

    def check_continues(self, ids: torch.Tensor) -> None:
        """`generate(ids, cache=self)` on a started cache: ids [B, L] must be the conversation this cache holds
        (its `held` tokens read so far) with new tokens appended, as `generate` assumes: it feeds ids[:, held:] as
        their continuation. A new prompt, or a shorter input, is a ValueError naming the fix, not a silent answer
        to a conversation nobody wrote (generate read a tail of it after the old one). Checked on the last
        READ_TAIL ids read; another batch size is left to `update` to name."""
        held = self.get_seq_length()
        if held == 0 or ids.dim() != 2 or (self.read_tail is not None and ids.shape[0] != self.read_tail.shape[0]):
            return
        fix = ("for a new prompt pass a fresh cache (cache=make_cache()); to go on, pass the conversation so far "
               "(the last output) with the next turn appended")
        if ids.shape[1] <= held:
            raise ValueError(f"this KVpopCache already holds a generation ({held} tokens) and the input has "
                             f"{ids.shape[1]}, so it cannot continue it: {fix}")
        if self.read_tail is None or not self.read_ids_known:
            return
        n = self.read_tail.shape[1]
        differs = (ids[:, held - n:held].to(self.read_tail.device) != self.read_tail).any(dim=1)
        if bool(differs.any()):
            raise ValueError(f"this input does not continue the conversation this KVpopCache holds: its tokens "
                             f"{held - n}..{held - 1} differ from the ones the cache read (rows "
                             f"{differs.nonzero().flatten().tolist()}): {fix}")

    def reset(self) -> None:
        super().reset()
        self.read_tail, self.read_ids_known = None, True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_read_tail(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_read_tail(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_read_tail(lambda x: x[indices, ...])

    def _map_read_tail(self, fn) -> None:
        if self.read_tail is not None:
            self.read_tail = fn(self.read_tail)

    def positions(self) -> list[torch.Tensor]:
        """The token in every slot, per layer: int64 [B, Hkv, N] (-1 empty)."""
        return [layer.pos for layer in self.layers]


def require_mask_applied(pending: KVpopMask | None) -> None:
    """The mask a layer's update handed to its attention was applied, or a RuntimeError naming the fix."""
    if pending is not None and not pending.consumed:
        raise RuntimeError(f"the attention did not apply the KVpop mask: load the model with "
                           f"attn_implementation={ATTENTION_NAME!r} (kvpop_torch.load does)")


def check_attention(model) -> None:
    """A KVpop cache is only correct under the "kvpop" attention (others ignore its mask)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ATTENTION_NAME:
        raise ValueError(f"the model attends with {impl!r}, which ignores the KVpop mask; load it with "
                         f"attn_implementation={ATTENTION_NAME!r} or call model.set_attn_implementation("
                         f"{ATTENTION_NAME!r})")


def guard_new_tokens(model) -> None:
    """Installs (once) a forward pre-hook that names a call with no new tokens (`check_new_tokens`), and wraps
    the model's `generate` so that a started KVpopCache is given the conversation it holds
    (`KVpopCache.check_continues`). Where this transformers' forward names its cache `past_key_values`
    (before 5.24), both also take it as `cache=`, the name 5.24 on use (`rename_cache_argument`)."""
    if not getattr(model, "_kvpop_guarded", False):
        model._kvpop_cache_argument = cache_argument(model)
        if model._kvpop_cache_argument != "cache":
            model.register_forward_pre_hook(rename_cache_argument, with_kwargs=True)
            # generate() reads its keyword arguments here first; an instance override (these transformers are
            # released and frozen) also serves `model.generate(ids, cache=KVpopCache.from_pretrained(d, model))`,
            # whose `model.generate` was looked up before the cache guarded the model.
            model._prepare_generation_config = BoundToModel(_prepare_generation_config_renamed, model)
        model.register_forward_pre_hook(check_new_tokens, with_kwargs=True)
        model.register_forward_hook(note_read_ids, with_kwargs=True)
        model.generate = BoundToModel(_generate_checked, model)  # a copy of the model rebinds it to itself
        model._kvpop_guarded = True


class BoundToModel:
    """`fn` bound to `model`, set as one of its instance attributes: as types.MethodType, but pickle (torch.save of
    the whole model) can rebuild it too (a bound method pickles as getattr(model, fn.__name__), which the model being
    unpickled does not have). copy.deepcopy and pickle bind it to the copy."""

    def __init__(self, fn, model):
        self.__func__, self.__self__ = fn, model
        self.__name__ = self.__qualname__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)


def cache_argument(model) -> str:
    """The name the model's forward takes its cache by: "cache" (transformers >= 5.24) or "past_key_values"."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _renamed(kwargs: dict, name: str) -> dict:
    """kwargs with `cache=` passed as `name=`; the same dict where there is nothing to rename."""
    if name == "cache" or "cache" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    cache = kwargs.pop("cache")
    if cache is None:  # cache=None names no cache: past_key_values= (or none) stands
        return kwargs
    if kwargs.get(name) is not None:
        raise ValueError(f"the cache is passed twice, as cache= and as {name}=: pass one")
    kwargs[name] = cache
    return kwargs


def _prepare_generation_config_renamed(self, generation_config, *args, **kwargs):
    """`GenerationMixin._prepare_generation_config` (transformers < 5.24), with `cache=` passed as past_key_values."""
    kwargs = _renamed(kwargs, self._kvpop_cache_argument)
    return type(self)._prepare_generation_config(self, generation_config, *args, **kwargs)


def rename_cache_argument(module, args, kwargs):
    """A forward pre-hook: `model(ids, cache=c)` on a transformers whose forward takes `past_key_values` (it would
    run without the cache: its forward passes an unknown `cache` on to the attention, unread)."""
    renamed = _renamed(kwargs, module._kvpop_cache_argument)
    return None if renamed is kwargs else (args, renamed)


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, transformers, sys.modules[__package__]))


def _callers_level() -> int:
    """`warnings.warn`'s stacklevel for the first frame outside torch, transformers and kvpop_torch (the user's
    `generate` or forward line), counted from the caller of this function's caller."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_LIBRARY_DIRS)
                                 or frame.f_code.co_filename.startswith("<")):
        frame, level = frame.f_back, level + 1
    return level


def _passed_cache(kwargs: dict):
    """The cache a forward call was given: `cache=`, else `past_key_values=` (given both, transformers 5.24 on use
    cache=; before, `rename_cache_argument` leaves only past_key_values)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def note_read_ids(module, args, kwargs, output):
    """After a forward: the ids a KVpopCache read (`KVpopCache.note_read`; None: embeddings)."""
    cache = _passed_cache(kwargs)
    if isinstance(cache, KVpopCache):
        cache.note_read(kwargs.get("input_ids", args[0] if args else None))


def _generate_checked(self, *args, **kwargs):
    """The model's `generate`, after `KVpopCache.check_continues` on a started cache."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(cache, KVpopCache) and isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        cache.check_continues(ids)
    return type(self).generate(self, *args, **kwargs)


def check_new_tokens(module, args, kwargs):
    """A forward with no new tokens, named: an empty prompt, or (what `generate` makes of it) a
    KVpopCache passed again after it served a generation. Otherwise torch fails deep inside the
    attention ("cannot reshape tensor of 0 elements"). Also named: a padding `attention_mask` (the
    KVpop attention does not read it, and padding would take sink and long-range slots) and
    `use_cache=False` with a KVpopCache (generate would resend the whole sequence every step)."""
    cache = _passed_cache(kwargs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if isinstance(cache, KVpopCache):
        mask = kwargs.get("attention_mask")
        # At a prompt or a later turn only: a decode step's mask extends it with ones, and reading it every
        # step would sync a GPU with the host once per token.
        held = cache.get_seq_length()
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and (held == 0 or ids is not None and ids.shape[1] > 1) \
                and not bool(mask.bool().all()):
            if held:  # transformers marks every pad_token_id of the history as padding, e.g. after a row's EOS
                raise ValueError("this attention_mask of the conversation so far has zeros (padding: transformers "
                                 "marks every pad_token_id), which the KVpop attention does not read; the cache read "
                                 f"its {held} tokens as tokens: to go on so, pass attention_mask=torch.ones_like("
                                 "history)")
            zeros = (mask == 0).sum(dim=1)
            rows = {int(r): int(zeros[r]) for r in zeros.nonzero().flatten()}
            raise ValueError(f"KVpopCache needs unpadded prompts of equal length: this attention_mask has zeros "
                             f"(padding; row: zeros {rows}), which the KVpop attention does not read; decode ragged "
                             "prompts one at a time. Passed no attention_mask? transformers made this one from "
                             "pad_token_id: if those ids are tokens, pass attention_mask=torch.ones_like(ids)")
        if held == 0 and ids is not None and ids.shape[1] > 1:  # before any layer reads it (the attention checks too)
            check_prefill_positions(kwargs.get("position_ids"), ids.shape[1], cache_read=False)
        if kwargs.get("use_cache") is False:
            raise ValueError("use_cache=False with a KVpopCache: the bounded cache is filled one call at a time "
                             "(a prompt, then the tokens of each later call); pass use_cache=True or leave it out")
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    if ids is not None and isinstance(cache, KVpopCache) and limit and not cache.warned_positions:
        reach = cache.get_seq_length() + ids.shape[1]
        if reach > limit:
            cache.warned_positions = True  # once per generation, as kvpop_jax.generate warns once per call
            warnings.warn(f"decoding past the model's max_position_embeddings ({limit}): positions it was not "
                          f"trained at (this call reaches {reach} tokens)", stacklevel=_callers_level())
    if ids is None or ids.shape[1] > 0:
        return None
    held = cache.get_seq_length() if isinstance(cache, KVpopCache) else 0
    if held:
        raise ValueError(f"this KVpopCache already holds a generation ({held} tokens) and the call brings no new "
                         "token: to go on, pass the conversation so far with the next turn appended; for a new "
                         "generation pass a fresh cache (cache=make_cache())")
    raise ValueError("no input tokens: the prompt is empty (a KVpop cache needs at least one token)")
