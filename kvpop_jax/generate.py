"""Prefill + decode loop (jitted `lax.while_loop`) with EOS stopping, for every cache kind.

Cache kinds (the `cache` argument of `generate`):

  "dense"           a dense cache (`cache.init_dense_cache`) of prompt + max_new_tokens slots (a prompt length
                    not a power of two: its next power of two + max_new_tokens);
  "kvpop"           the bounded KVpop cache (`cache.py`): prefill with the masked parallel
                    forward, then S = 1 steps that reproduce its mask exactly;
  "dms"             DMS's bounded pool (`dms_cache.py`): the same for a DMS model's hard gates;
  BaselineConfig    a training-free policy at budget B (`baselines.py`): StreamingLLM, TOVA,
                    H2O ("dense" maps to the dense cache);
  "auto"            "kvpop" when `model.config.kvpop` is set, "dms" when `config.dms` is, else "dense".

`stream_prompt=True` feeds the prompt past the budget one decode step per token (the bounded
caches evict as if it were generated); the default is one parallel prefill. StreamingLLM's
streamed read is done in one banded pass (`BaselineConfig.banded_prefill`), which equals it.

Prompts are a rectangular [B, P] batch, or a list of rows of any lengths. Ragged rows are not
padded (pad tokens would occupy sinks and compete for the bounded caches' slots): the rows of each
length run as one batch of their own, so each row decodes as it would alone. On a KVpop or dense cache
a prompt length that is not a power of two is read as `Conversation`'s first turn: a prefill of the
largest power of two, then blocks of 512, 64, 8 and 1 tokens (`_chunks`), so `generate` compiles once
per power of two and block size, not per prompt length (a power of two keeps one program, prefill and
decode; the tokens agree to float rounding). A one-shot baseline (TOVA, H2O, StreamingLLM after a dense
prefill) or a DMS cache is given such a prompt padded at its end to the next power of two, the padding
neither cached nor scored (`prompt_len` of their layer caches): the same cache, one program per power of two.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax import baselines, dms_cache
from kvpop_jax import cache as cache_lib
from kvpop_jax.baselines import BaselineConfig
from kvpop_jax.config import Qwen3Config
from kvpop_jax.modeling import Qwen3ForCausalLM, check_token_ids
from kvpop_jax.sampling import SamplingConfig, sample

CacheSpec = Union[str, BaselineConfig]
CACHE_KINDS = ("auto", "dense", "kvpop", "dms")
# Decode steps per iteration of the streamed prompt's scan. 4 took a 100-problem TOVA / H2O pass
# (1024-token prompts, B 256 and 123) from 40.5 to 33.8 s on a 2-core CPU with the same completions;
# 8 compiles longer than it saves (39.0 s), 16 doubles the compile (BENCHMARKS.md, stops 42 and 44).
STREAM_UNROLL = 4


def resolve_cache(config: Qwen3Config, cache: CacheSpec) -> CacheSpec:
    """"auto" / "dense" / "kvpop" / "dms" / BaselineConfig -> "dense", "kvpop", "dms" or a bounded
    BaselineConfig."""
    if isinstance(cache, BaselineConfig):
        return cache if cache.bounded else "dense"
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS} or a BaselineConfig, got {cache!r}")
    if cache == "auto":
        return "kvpop" if config.kvpop is not None else ("dms" if config.dms is not None else "dense")
    if cache == "kvpop" and config.kvpop is None:
        raise ValueError("cache='kvpop' needs a model whose config has kvpop set")
    if cache == "dms" and config.dms is None:
        raise ValueError("cache='dms' needs a model whose config has dms set")
    if cache == "dense" and (config.kvpop is not None or config.dms is not None):
        kind = "kvpop" if config.kvpop is not None else "dms"
        raise ValueError(
            f"a {kind} model decodes with its bounded cache: use cache='{kind}' (or 'auto'), or drop "
            f"config.{kind} to run its weights densely"
        )
    return cache


def init_generation_cache(config: Qwen3Config, cache: CacheSpec, batch: int, max_len: int, dtype=jnp.float32):
    """An empty cache of the resolved kind; `max_len` (prompt + new tokens) sizes only the dense one."""
    kind = resolve_cache(config, cache)
    if kind == "dense":
        return cache_lib.init_dense_cache(config, batch, max_len, dtype=dtype)
    if kind == "kvpop":
        return cache_lib.init_cache(config, batch, dtype)
    if kind == "dms":
        return dms_cache.init_cache(config, batch, dtype)
    return baselines.init_cache(config, kind, batch, dtype)


def _prefill(model, params, prompt_ids, state, stream_from: int | None):
    """Last-position logits and the cache after the prompt: one parallel prefill, or (stream_from)
    a prefill of the first `stream_from` tokens and then one decode step per remaining prompt token,
    so a bounded cache evicts token by token as if the prompt were being generated."""
    p = prompt_ids.shape[1]
    n0 = p if stream_from is None else min(stream_from, p)
    out = model.apply({"params": params}, prompt_ids[:, :n0], cache=state)
    if n0 == p:
        return out.logits[:, -1], out.cache
    return _feed(model, params, prompt_ids[:, n0:], out.cache, out.logits[:, -1])


def _feed(model, params, ids, cache, logits):
    """(last logits, cache) after one decode step per token of `ids` [B, n] on a started cache;
    `logits` (of the last token before them) sets the carried logits' dtype."""

    def feed(carry, tok):
        o = model.apply({"params": params}, tok[:, None], cache=carry[0], method=Qwen3ForCausalLM.decode_step)
        return (o.cache, o.logits[:, -1].astype(carry[1].dtype)), None

    (cache, logits), _ = jax.lax.scan(feed, (cache, logits), ids.T, unroll=STREAM_UNROLL)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "cache", "stream_from"))
def _generate(model, params, prompt_ids, rng, eos, *, max_new_tokens, sampling, cache, stream_from=None):
    """eos: int32 [E] stop tokens (a traced array: a new EOS set of the same size reuses the compile)."""
    b, p = prompt_ids.shape
    state = init_generation_cache(model.config, cache, b, p + max_new_tokens, dtype=model.dtype)
    last_logits, prompt_cache = _prefill(model, params, prompt_ids, state, stream_from)
    tokens, first_eos, _ = _decode(model, params, prompt_cache, last_logits, rng, eos, max_new_tokens, sampling)
    return tokens, first_eos


def _feed_upto(model, params, ids, cache, logits, count):
    """`_feed` of the first `count` (a traced int) tokens of ids [B, T], the rest padding (a power-of-two bucket:
    `_generate_fed`, `Conversation`'s later turns), in loops of exactly that many steps (STREAM_UNROLL per iteration,
    then one by one): the padding costs nothing (steps skipped by a `lax.cond` on the cache cost about a read's)."""

    def step(carry, i):
        cache, logits = carry
        tok = jax.lax.dynamic_slice_in_dim(ids, i, 1, axis=1)
        o = model.apply({"params": params}, tok, cache=cache, method=Qwen3ForCausalLM.decode_step)
        return o.cache, o.logits[:, -1].astype(logits.dtype)

    def unrolled(state):
        i, carry = state
        for j in range(STREAM_UNROLL):
            carry = step(carry, i + j)
        return i + STREAM_UNROLL, carry

    state = jax.lax.while_loop(lambda s: s[0] + STREAM_UNROLL <= count, unrolled, (jnp.int32(0), (cache, logits)))
    _, (cache, logits) = jax.lax.while_loop(lambda s: s[0] < count, lambda s: (s[0] + 1, step(s[1], s[0])), state)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "cache"))
def _generate_fed(model, params, head, tail, count, rng, eos, *, max_new_tokens, sampling, cache):
    """`_generate` of a streamed prompt given as its prefilled head [B, H] and its tail [B, T] padded to a power of
    two, of which the first `count` (a traced int) are read one decode step each (`_feed_upto`), the rest skipped:
    compiled once per (H, T) (`_fed_split`), not once per prompt length."""
    state = init_generation_cache(model.config, cache, head.shape[0], head.shape[1] + tail.shape[1] + max_new_tokens,
                                  dtype=model.dtype)
    last_logits, prompt_cache = _prefill_fed(model, params, head, tail, count, state)
    tokens, first_eos, _ = _decode(model, params, prompt_cache, last_logits, rng, eos, max_new_tokens, sampling)
    return tokens, first_eos


def _prefill_fed(model, params, head, tail, count, state):
    """`_prefill` of a streamed prompt given as its head [B, H], prefilled, and its tail [B, T], padded, of which the
    first `count` (a traced int) are read a decode step each: (last logits, cache)."""
    out = model.apply({"params": params}, head, cache=state)
    return _feed_upto(model, params, tail, out.cache, out.logits[:, -1], count)


def _pads_prompt(kind, stream_from: int | None, prompt_len: int) -> bool:
    """Whether a [B, prompt_len] prompt is given to `kind`'s prefill padded at its end to the next power of two
    (`_prefill_padded`): a length not a power of two on the one-shot baselines (TOVA, H2O, StreamingLLM after a dense
    prefill) or DMS, whose prefills take a padded prompt whole (`prompt_len` of their layer caches)."""
    if stream_from is not None or _power_of_two(prompt_len):
        return False
    return kind == "dms" or isinstance(kind, BaselineConfig) and not kind.banded_prefill


def _prefill_padded(model, params, ids, count, state):
    """`_prefill` of a one-shot baseline's or DMS's prompt ids [B, T] padded at its end, its first `count` (a traced
    int) the prompt (`prompt_len` of their layer caches): (the prompt's last logits, the cache after it, its length
    `count`)."""
    state = state.replace(layers=tuple(layer.with_prompt_len(count) for layer in state.layers))
    out = model.apply({"params": params}, ids, cache=state)
    logits = jax.lax.dynamic_index_in_dim(out.logits, count - 1, axis=1, keepdims=False)
    return logits, out.cache.replace(length=state.length + count)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "cache"))
def _generate_padded(model, params, prompt_ids, count, rng, eos, *, max_new_tokens, sampling, cache):
    """`_generate` of a one-shot baseline's or DMS's prompt padded at its end to a power of two, its first `count` (a
    traced int) the prompt: compiled once per power of two, not once per prompt length."""
    state = init_generation_cache(model.config, cache, prompt_ids.shape[0], prompt_ids.shape[1] + max_new_tokens,
                                  dtype=model.dtype)
    last_logits, prompt_cache = _prefill_padded(model, params, prompt_ids, count, state)
    tokens, first_eos, _ = _decode(model, params, prompt_cache, last_logits, rng, eos, max_new_tokens, sampling)
    return tokens, first_eos


def _padded_args(ids: np.ndarray) -> tuple[np.ndarray, np.int32]:
    """(ids [B, P] padded with 0s at the end to the next power of two, P) for `_generate_padded`, on the host."""
    padded = np.zeros((ids.shape[0], _next_power_of_two(ids.shape[1])), np.int32)
    padded[:, : ids.shape[1]] = ids
    return padded, np.int32(ids.shape[1])


def _fed_split(kind, stream_from: int | None, prompt_len: int) -> tuple[int, int] | None:
    """(head, padded tail) of a streamed prompt `generate` runs through `_generate_fed`, for a length not a power of
    two: past the `stream_from` prefilled tokens, the tail P - stream_from padded to the next power of two; for
    StreamingLLM's banded read (exact at any length) a banded prefill of the largest power of two, then the rest in
    a tail of that same size; a prompt of at most `stream_from` tokens (nothing evicted while it is read): a prefill
    of its largest power of two, the rest likewise (prefill equals decode: a policy's scores sum or take the last
    query as decoding does). The rest is under the largest power of two, so one (head, tail), one program, serves a
    whole power-of-two bucket of lengths; only `count` steps of the tail are read. None otherwise (a power of two
    keeps `_generate`'s one program)."""
    if _power_of_two(prompt_len):
        return None
    largest = _largest_power_of_two(prompt_len)
    if stream_from is not None and prompt_len > stream_from:
        return stream_from, _next_power_of_two(prompt_len - stream_from)
    if stream_from is not None or isinstance(kind, BaselineConfig) and kind.banded_prefill:
        return largest, largest  # a prompt that B holds whole (nothing is evicted), or StreamingLLM's banded read
    return None


def _fed_args(ids: np.ndarray, head: int, tail: int) -> tuple[np.ndarray, np.ndarray, np.int32]:
    """(head, padded tail, count) of prompt ids [B, P] for `_generate_fed`, cut on the host (no eager compile per
    length)."""
    padded = np.zeros((ids.shape[0], tail), np.int32)
    padded[:, : ids.shape[1] - head] = ids[:, head:]
    return np.ascontiguousarray(ids[:, :head], np.int32), padded, np.int32(ids.shape[1] - head)


def _decode(model, params, cache, last_logits, rng, eos, max_new_tokens, sampling):
    """Samples up to `max_new_tokens` from `last_logits` on, feeding each token to `cache` before the
    next, until every row has drawn an EOS: (tokens, lengths, cache). The last token drawn (an EOS, or
    the max_new_tokens-th) is not fed; in a batch, rows that stopped early are fed 0s until the last stops."""
    b = last_logits.shape[0]
    rng, key = jax.random.split(rng)
    first = sample(key, last_logits, sampling)
    tokens = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos)

    def cond(state):
        i, _, _, _, done = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, tokens, cache, rng, done = state
        prev = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
        out = model.apply({"params": params}, prev, cache=cache, method=Qwen3ForCausalLM.decode_step)
        rng, key = jax.random.split(rng)
        nxt = sample(key, out.logits[:, -1], sampling)
        nxt = jnp.where(done, 0, nxt)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], i, axis=1)
        return i + 1, tokens, out.cache, rng, done | jnp.isin(nxt, eos)

    _, tokens, cache, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tokens, cache, rng, done))
    is_eos = jnp.isin(tokens, eos)
    # Length up to and including the first EOS (max_new_tokens if none).
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
    return tokens, first_eos, cache


def _length_groups(prompt_ids) -> list[list[int]] | None:
    """For a list of rows of unequal lengths, the row indices of each length (in order of first
    appearance); None for a rectangular batch (an array, or rows of one length)."""
    if not isinstance(prompt_ids, (list, tuple)):
        return None
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(prompt_ids):
        try:
            groups.setdefault(len(row), []).append(i)
        except TypeError:
            raise ValueError(f"prompt_ids row {i} is {type(row).__name__}, expected a sequence of token ids") from None
        if len(row) == 0:  # else named as a whole batch's shape (1, 0), whichever row it was
            raise ValueError(f"prompt_ids row {i} is empty; every row needs at least one token id")
    return list(groups.values()) if len(groups) > 1 else None


def _as_prompt_array(prompt_ids, vocab_size: int) -> jax.Array:
    """The prompt as int32 [B, P], its ids checked against the vocabulary before the cast (an int64
    id past 2**31 would otherwise wrap into the vocabulary)."""
    if isinstance(prompt_ids, (list, tuple)):
        prompt_ids = np.asarray(prompt_ids)
    if not isinstance(prompt_ids, jax.Array):
        prompt_ids = np.asarray(prompt_ids)  # host ids keep their width until checked
    if prompt_ids.ndim != 2 or prompt_ids.shape[0] < 1 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be [batch >= 1, prompt_len >= 1], got shape {prompt_ids.shape}")
    if not jnp.issubdtype(prompt_ids.dtype, jnp.integer):
        raise ValueError(f"prompt_ids must be integer token ids, got {prompt_ids.dtype}")
    check_token_ids(prompt_ids, vocab_size, "prompt_ids")
    if isinstance(prompt_ids, np.ndarray):  # cast on the host: jnp's cast of int64 ids compiles once per shape
        prompt_ids = prompt_ids.astype(np.int32, copy=False)
    return jnp.asarray(prompt_ids, jnp.int32)


def _eos_tuple(eos_ids, vocab_size: int) -> tuple[int, ...]:
    """`eos_ids` (None, one id, or a sequence of ids, as a config's `eos_token_id` comes) as a tuple of
    ids in the vocabulary; ValueError otherwise (an id outside it would never stop the generation)."""
    if eos_ids is None:
        return ()
    if isinstance(eos_ids, (np.ndarray, jax.Array)):  # host or concrete device ids, any shape
        eos_ids = np.asarray(eos_ids).reshape(-1).tolist()
    ids = (eos_ids,) if isinstance(eos_ids, (int, np.integer)) else eos_ids
    try:
        ids = tuple(ids)
    except TypeError:
        raise ValueError(f"eos_ids must be a token id or a sequence of them, got {eos_ids!r}") from None
    out = []
    for token in ids:
        index = _int_like(token)
        if index is None or not 0 <= index < vocab_size:
            raise ValueError(f"eos_ids holds {token!r}; expected token ids in [0, {vocab_size})")
        out.append(index)
    return tuple(out)


def _int_like(value) -> int | None:
    """`value` as a Python int if it is an integer (Python, numpy, a concrete jax scalar), else None (bools too)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


SEED_RANGE = (-2**63, 2**63)  # what jax.random.key takes (an int64); past it, a bare OverflowError


def check_seed(value, name: str = "rng seed") -> int:
    """`value` as an int seed for `jax.random.key`; ValueError naming it if it is not an int or lies
    outside int64 (where jax raises a bare OverflowError, or, in an evaluation, only at its first rollout)."""
    seed = _int_like(value)
    if seed is None:
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"{name} {seed} is outside jax.random.key's int64 range [-2**63, 2**63)")
    return seed


def _count(value, name: str) -> int:
    """A positive Python int from an int-like value; ValueError otherwise."""
    count = _int_like(value)
    if count is None:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if count < 1:
        raise ValueError(f"{name} must be >= 1, got {count}")
    return count


def _checked_call(model: Qwen3ForCausalLM, max_new_tokens, sampling, eos_ids) -> tuple[int, tuple[int, ...]]:
    """What `generate` and `compile_generate` both take: (max_new_tokens as an int, the EOS ids as a tuple)."""
    max_new_tokens = _count(max_new_tokens, "max_new_tokens")
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig (e.g. SamplingConfig.greedy()), got "
                         f"{type(sampling).__name__}")
    return max_new_tokens, _eos_tuple(eos_ids, model.config.vocab_size)


def generate(
    model: Qwen3ForCausalLM,
    params,
    prompt_ids,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    rng: jax.Array | None = None,
    cache: CacheSpec = "auto",
    stream_prompt: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Samples continuations of prompts.

    Args:
      prompt_ids: int [B, P], or a list of B lists of ids (of any lengths >= 1); ids in [0, vocab)
        (checked: ValueError). Rows of unequal lengths are not padded: the rows of each length run as
        one batch, with the key `jax.random.fold_in(rng, i)` where i is the first such row, so a greedy
        row gives what it gives alone. A KVpop or dense cache compiles once per power of two of the
        length (a prefill of the largest, then blocks; a dense cache then holds the next power of two of
        P, plus max_new_tokens, slots). With `stream_prompt`, a length not a power of two compiles once per power
        of two of the tokens past the prefilled first B (they are read a decode step each, padded, the padding
        skipped); StreamingLLM, or a prompt of at most B tokens, once per power of two of its length (a prefill of
        the largest power of two, then the rest so). DMS and the one-shot baselines compile once per power of two
        (the prompt padded at its end, the padding neither cached nor scored).
      cache: "auto" | "dense" | "kvpop" | "dms" | BaselineConfig (see the module docstring).
      stream_prompt: a bounded cache reads the prompt as if it were being generated: the first
        `budget` tokens are prefilled (nothing is evicted yet) and every later prompt token is one
        decode step, so a training-free policy (TOVA, H2O) decides each eviction with only the
        attention seen so far, as it does over a generated reasoning trace. Without it the baselines
        compress the prompt in one shot after a dense prefill (`baselines.prefill`: they see every
        query of the prompt, the last one included). KVpop and DMS prefill equals their token-by-token
        decode (the decode-cache invariant), so for them it changes only the speed; dense ignores it.
    Returns:
      tokens int32 [B, max_new_tokens] (zeros after EOS) and lengths int32 [B] (through
      the first EOS).
    """
    max_new_tokens, eos = _checked_call(model, max_new_tokens, sampling, eos_ids)
    groups = _length_groups(prompt_ids)
    rows = [prompt_ids] if groups is None else [[prompt_ids[i] for i in group] for group in groups]
    rows = [_as_prompt_array(r, model.config.vocab_size) for r in rows]  # every row checked before any runs
    reach = max(r.shape[1] for r in rows) + max_new_tokens
    if reach > model.config.max_position_embeddings:  # RoPE runs past it, but the model never trained there
        warnings.warn(f"the prompt plus max_new_tokens reach {reach} tokens, beyond the model's "
                      f"max_position_embeddings {model.config.max_position_embeddings}", stacklevel=2)
    kind, stream_from = _plan(model.config, cache, stream_prompt)
    key, eos = _as_key(rng), _eos_array(eos)

    def run(prompt, k):  # positional, as compile_generate lowers it, so that its compile is found
        if _in_blocks(kind, stream_from, prompt.shape[1]):
            logits, state = _read_blocks(model, params, _blocks_cache(model, kind, prompt.shape, max_new_tokens),
                                         prompt, first=True, owned=True)
            return _reply(model, params, state, logits, k, eos, max_new_tokens=max_new_tokens, sampling=sampling)[:2]
        if _pads_prompt(kind, stream_from, prompt.shape[1]):
            return _generate_padded(model, params, *_padded_args(np.asarray(prompt)), k, eos,
                                    max_new_tokens=max_new_tokens, sampling=sampling, cache=kind)
        split = _fed_split(kind, stream_from, prompt.shape[1])
        if split:
            return _generate_fed(model, params, *_fed_args(np.asarray(prompt), *split), k, eos,
                                 max_new_tokens=max_new_tokens, sampling=sampling, cache=kind)
        return _generate(model, params, prompt, k, eos, max_new_tokens=max_new_tokens, sampling=sampling,
                         cache=kind, stream_from=stream_from)

    if groups is None:
        return run(rows[0], key)
    outs = [run(r, jax.random.fold_in(key, group[0])) for r, group in zip(rows, groups)]
    order = np.argsort(np.concatenate([np.asarray(g) for g in groups]), kind="stable")  # back to the caller's rows
    return tuple(jnp.concatenate([o[j] for o in outs])[order] for j in (0, 1))


def compile_generate(
    model: Qwen3ForCausalLM,
    params,
    batch: int,
    prompt_len: int,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    cache: CacheSpec = "auto",
    stream_prompt: bool = False,
) -> None:
    """Compiles, without running it, the program `generate` runs for [batch, prompt_len] prompts
    with these arguments; a later `generate` call with the same model, parameter shapes and
    arguments (any prompt ids, rng and EOS ids of the same count) reuses the compile from JAX's
    cache. Meant for a background thread: XLA compiles on one core, so the next program can
    compile while the current one decodes (`eval.accuracy.run_accuracy`)."""
    max_new_tokens, eos_ids = _checked_call(model, max_new_tokens, sampling, eos_ids)
    batch, prompt_len = _count(batch, "batch"), _count(prompt_len, "prompt_len")
    kind, stream_from = _plan(model.config, cache, stream_prompt)
    # Concrete placeholders rather than ShapeDtypeStructs: the lowering then sees exactly the
    # avals and placements of a real call, so that call finds this compile.
    if _in_blocks(kind, stream_from, prompt_len):  # the prefill, each block size's read, the reply
        state, seen = _blocks_cache(model, kind, (batch, prompt_len), max_new_tokens), set()
        for i, (c0, c1, read) in enumerate(_block_reads(prompt_len, first=True, owned=True)):
            ids = np.zeros((batch, c1 - c0), np.int32)
            if (c1 - c0, read) not in seen:
                seen.add((c1 - c0, read))
                read.lower(model, params, state, ids).compile()
            if i == 0:  # the cache is started from here on, its shapes unchanged by later blocks
                logits, state = jax.eval_shape(functools.partial(_read, model), params, state, ids)
                state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state)  # concrete again, as above
        _reply.lower(model, params, state, jnp.zeros(logits.shape, logits.dtype), jax.random.key(0),
                     _eos_array(eos_ids), max_new_tokens=max_new_tokens, sampling=sampling).compile()
        return
    if _pads_prompt(kind, stream_from, prompt_len):
        _generate_padded.lower(model, params, *_padded_args(np.zeros((batch, prompt_len), np.int32)),
                               jax.random.key(0), _eos_array(eos_ids), max_new_tokens=max_new_tokens,
                               sampling=sampling, cache=kind).compile()
        return
    split = _fed_split(kind, stream_from, prompt_len)
    if split:
        _generate_fed.lower(model, params, *_fed_args(np.zeros((batch, prompt_len), np.int32), *split),
                            jax.random.key(0), _eos_array(eos_ids), max_new_tokens=max_new_tokens, sampling=sampling,
                            cache=kind).compile()
        return
    _generate.lower(model, params, jnp.zeros((batch, prompt_len), jnp.int32), jax.random.key(0),
                    _eos_array(eos_ids), max_new_tokens=max_new_tokens, sampling=sampling, cache=kind,
                    stream_from=stream_from).compile()


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "stream_from", "padded", "head"))
def _turn(model, params, cache, ids, count, rng, eos, *, max_new_tokens, sampling, stream_from, padded=False,
          head=None):
    """One `Conversation.send`: the turn's ids [1, n] into `cache` (a prefill on a fresh cache, else one
    decode step per id: the first `count`, the rest padding to n's bucket), then `_decode`. A first turn given
    padded: `padded` (DMS, a one-shot baseline: `_prefill_padded`), or `head` (a streamed one: its first `head`
    ids prefilled, then the first `count` of the rest a decode step each, `_prefill_fed`)."""
    if cache.started:
        logits, cache = _feed_upto(model, params, ids, cache, jnp.zeros((1, model.config.vocab_size), jnp.float32),
                                   count)
    elif padded:
        logits, cache = _prefill_padded(model, params, ids, count, cache)
    elif head is not None:
        logits, cache = _prefill_fed(model, params, ids[:, :head], ids[:, head:], count, cache)
    else:
        logits, cache = _prefill(model, params, ids, cache, stream_from)
    return _decode(model, params, cache, logits, rng, eos, max_new_tokens, sampling)


TURN_BLOCKS = (512, 64, 8, 1)  # the block sizes a later turn is read in, largest first
ONE_CALL_KINDS = ("kvpop", "dense")  # caches whose decode takes several tokens per call


def _in_blocks(kind, stream_from, prompt_len: int) -> bool:
    """Whether `generate` reads a [B, prompt_len] prompt in blocks (`_chunks(first=True)`: a prefill of the
    largest power of two, then TURN_BLOCKS), compiled once per power of two rather than per length: a KVpop
    or dense cache, a prompt length not a power of two (those keep one program, prefill and decode)."""
    return kind in ONE_CALL_KINDS and stream_from is None and not _power_of_two(prompt_len)


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1): the bucket a padded prompt, tail or turn is compiled for."""
    return 1 << (n - 1).bit_length()


def _largest_power_of_two(n: int) -> int:
    """The largest power of two <= n (n >= 1): the prefill a first turn or a streamed prompt starts with."""
    return 1 << (n.bit_length() - 1)


def _blocks_cache(model, kind, shape: tuple[int, int], max_new_tokens: int):
    """The fresh cache `generate` reads a prompt of `shape` [B, P] into in blocks: a dense one holds the next
    power of two of P, plus max_new_tokens, slots (so that prompts of its power-of-two bucket reuse its programs,
    at most P - 1 slots more than the prompt and reply need)."""
    slots = _next_power_of_two(shape[1]) + max_new_tokens
    return init_generation_cache(model.config, kind, shape[0], slots, dtype=model.dtype)


def _chunks(count: int, first: bool = False) -> list[tuple[int, int]]:
    """[c0, c1) blocks of `count` tokens, each of a TURN_BLOCKS size, largest first (595 -> 512, 64, 8, 8, 1, 1, 1):
    a chat compiles at most one read per block size, and a turn takes fewer than 8 blocks of each smaller size.
    `first` (the prompt on a fresh cache): the first block is the largest power of two <= count (a prefill,
    compiled once per power of two, not per prompt length), then the rest in TURN_BLOCKS
    (1000 -> 512, 64 x 7, 8 x 5)."""
    c0 = _largest_power_of_two(count) if first and count else 0
    out = [(0, c0)] if c0 else []
    for size in TURN_BLOCKS:
        while count - c0 >= size:
            out.append((c0, c0 + size))
            c0 += size
    return out


@functools.partial(jax.jit, static_argnames=("model",))
def _read(model, params, cache, ids):
    """ids [B, n] into a started cache in one call (the KVpop and dense caches' multi-token decode), or a
    fresh cache's prefill -> (the last token's logits float32 [B, V], cache)."""
    out = model.apply({"params": params}, ids, cache=cache)
    return out.logits[:, -1].astype(jnp.float32), out.cache


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _read_owned(model, params, cache, ids):
    """`_read` of a cache the caller gives up (`generate`'s own): updated in place, not copied per block (a dense
    cache of 50 rows x 1024 slots is ~100 MB). A `Conversation`'s cache is not donated: a user may keep a copy."""
    return _read(model, params, cache, ids)


def _block_reads(count: int, first: bool, owned: bool) -> list[tuple[int, int, object]]:
    """(c0, c1, the jitted read) of each `_chunks(count, first)` block, as `_read_blocks` runs them and
    `compile_generate` compiles them. `owned`: the caches the blocks return are the caller's to give up
    (`generate`'s): every block after the first updates its cache in place (`_read_owned`); the first reads the
    cache given (a fresh one's leaves may share one buffer of zeros, which cannot be donated twice)."""
    return [(c0, c1, _read_owned if owned and i else _read) for i, (c0, c1) in enumerate(_chunks(count, first))]


def _read_blocks(model, params, cache, ids, first: bool, owned: bool = False):
    """(last logits, cache) after ids [B, n] are read into `cache` in blocks, one call each (`_block_reads`)."""
    ids = np.asarray(ids)  # sliced on the host: no eager compile per block
    for c0, c1, read in _block_reads(ids.shape[1], first, owned):
        logits, cache = read(model, params, cache, ids[:, c0:c1])
    return logits, cache


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling"))
def _reply(model, params, cache, last_logits, rng, eos, *, max_new_tokens, sampling):
    """`_decode` from the last block of a later turn read by `_read`."""
    return _decode(model, params, cache, last_logits, rng, eos, max_new_tokens, sampling)


class Conversation:
    """Multi-turn decoding of one conversation on one cache: each `send` reads only the new turn.

    With a bounded cache (KVpop, DMS, a training-free baseline) memory stays constant however long the
    conversation runs: that is the method's point. `max_len` caps the tokens the conversation reads in all (every
    turn and reply; a turn that would pass it is refused): a dense cache needs it and is sized by it, on a bounded
    cache it is optional (None: no cap) and its memory does not depend on it.

        chat = Conversation(model, params)                    # cache="auto", as `generate`
        reply, n = chat.send(prompt_ids, max_new_tokens=64, eos_ids=eos)
        reply, n = chat.send(next_turn_ids, max_new_tokens=64, eos_ids=eos)

    Each later `send` first reads the previous reply's last token (drawn, not yet read), then the turn's
    ids. A KVpop or dense cache reads them in a few calls, blocks of 512, 64, 8 or 1 tokens (`TURN_BLOCKS`;
    `KVpopHead.continue_tokens`: the evictions token by token, the attention in one pass), and the first
    turn likewise after a prefill of the largest power of two of its tokens (1000 tokens: a prefill of 512,
    then 7 blocks of 64 and 5 of 8); DMS and the training-free baselines read the first turn as
    `generate` does (padded to a power of two, or with `stream_prompt` its first B ids prefilled and the rest
    a decode step each, padded so; also a KVpop cache with `stream_prompt=True`) and a later one a decode
    step per token, padded to a power of two (the padding skipped). So a reply is the
    one `generate` gives with the whole history as its prompt (for KVpop and dense to float rounding):
    for KVpop, DMS (whose prefill equals their decode; DMS's while its pool does not overflow, and a
    warning says when it first does) and dense caches; for a training-free baseline, with
    `stream_prompt=True` in both. A chat compiles once per block size (or bucket) and `max_new_tokens`,
    not per turn length, and a first turn once per power of two of its length (streamed: of its ids past B).
    `dtype` is the cache's (a floating dtype; the model's by default).
    """

    def __init__(self, model: Qwen3ForCausalLM, params, *, cache: CacheSpec = "auto", max_len: int | None = None,
                 stream_prompt: bool = False, dtype=None):
        self.model, self.params = model, params
        self.kind, self._stream_from = _plan(model.config, cache, stream_prompt)
        if self.kind == "dense":
            if max_len is None:
                raise ValueError("a Conversation on a dense cache needs max_len (the tokens it may hold in all: "
                                 "every turn and reply); a bounded cache needs none")
        if max_len is not None:
            max_len = _count(max_len, "max_len")
        self.max_len = max_len
        self.cache = init_generation_cache(model.config, self.kind, 1, max_len or 1,
                                           dtype=model.dtype if dtype is None else _cache_dtype(dtype))
        self.length = 0  # tokens of the conversation so far: every turn and reply (the last reply's last token
        # is drawn but not read: the next send reads it first)
        self._pending: list[int] = []  # the last reply's last token, not yet read
        self._turns = 0
        self._overflow_warned = False

    def send(self, ids, *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), eos_ids=(),
             rng=None) -> tuple[jax.Array, int]:
        """The reply to the turn `ids` (token ids: a list, or int [n] / [1, n]; at least one on the first
        turn, none allowed later to let the model go on): (tokens int32 [max_new_tokens], zeros after the
        EOS, and its length through the EOS). `rng` as `generate`'s; None draws from key(turn number)."""
        max_new_tokens, eos = _checked_call(self.model, max_new_tokens, sampling, eos_ids)
        try:
            turn = np.asarray(ids) if isinstance(ids, (list, tuple)) else ids
        except ValueError:  # rows of unequal lengths: numpy's "inhomogeneous shape"
            raise ValueError("a turn's ids must be one row (a list, [n] or [1, n]), got rows of unequal lengths: "
                             "a Conversation holds one conversation") from None
        if isinstance(turn, (np.ndarray, jax.Array)) and turn.ndim == 2 and turn.shape[0] == 1:
            turn = turn[0]
        if not isinstance(turn, (np.ndarray, jax.Array)) or turn.ndim != 1:
            got = f"shape {tuple(turn.shape)}" if isinstance(turn, (np.ndarray, jax.Array)) else type(ids).__name__
            raise ValueError(f"a turn's ids must be one row (a list, [n] or [1, n]), got {got}: a Conversation "
                             "holds one conversation")
        if not self._pending and turn.shape[0] == 0:
            raise ValueError("the first turn of a Conversation needs at least one token id")
        if turn.shape[0] and not jnp.issubdtype(turn.dtype, jnp.integer):
            raise ValueError(f"a turn's ids must be integer token ids, got {turn.dtype}")
        row = np.concatenate([np.asarray(self._pending, np.int64), np.asarray(turn, np.int64)])
        prompt = _as_prompt_array(row[None], self.model.config.vocab_size)
        reach = self.length + turn.shape[0] + max_new_tokens  # positions, the last drawn token's included
        if self.max_len is not None and reach - 1 > self.max_len:  # the last drawn token is not read
            raise ValueError(f"this turn would bring the conversation to {reach - 1} tokens read, past "
                             f"{'the dense cache' if self.kind == 'dense' else 'the Conversation'}'s max_len "
                             f"{self.max_len}: start a Conversation with a larger max_len")
        if reach > self.model.config.max_position_embeddings:
            warnings.warn(f"the conversation reaches {reach} tokens, beyond the model's max_position_embeddings "
                          f"{self.model.config.max_position_embeddings}", stacklevel=2)
        key = jax.random.key(self._turns) if rng is None else _as_key(rng)
        count = prompt.shape[1]
        if self.kind in ONE_CALL_KINDS and (self._pending or self._stream_from is None):  # in blocks (`_chunks`)
            logits, cache = _read_blocks(self.model, self.params, self.cache, prompt, first=not self._pending)
            tokens, lengths, cache = _reply(self.model, self.params, cache, logits, key, _eos_array(eos),
                                            max_new_tokens=max_new_tokens, sampling=sampling)
        else:
            # a later turn on DMS or a baseline, or a first turn on DMS or a one-shot baseline: padded to a power of
            # two, one compile per bucket
            padded = not self._pending and _pads_prompt(self.kind, self._stream_from, count)
            # a streamed first turn (a length not a power of two): its first B ids prefilled, the rest padded so
            split = None if self._pending else _fed_split(self.kind, self._stream_from, count)
            if self._pending or padded:
                prompt = jnp.asarray(_padded_args(np.asarray(prompt))[0])
            elif split:
                head, tail, count = _fed_args(np.asarray(prompt), *split)
                prompt = jnp.asarray(np.concatenate([head, tail], axis=1))
            tokens, lengths, cache = _turn(self.model, self.params, self.cache, prompt, jnp.int32(count), key,
                                           _eos_array(eos), max_new_tokens=max_new_tokens, sampling=sampling,
                                           stream_from=self._stream_from, padded=padded,
                                           head=split[0] if split else None)
        # The turn is committed whole once its results are on the host (where an interrupt, or an error of the
        # asynchronous computation, lands): a failed or interrupted send leaves the conversation as it was, so
        # the same send can be retried (a half-updated one read the turn twice, past a dense cache's max_len).
        n = int(lengths[0])
        pending = [int(tokens[0, n - 1])]
        self.cache, self._pending, self.length, self._turns = cache, pending, self.length + turn.shape[0] + n, \
            self._turns + 1
        if self.kind == "dms" and not self._overflow_warned:
            dropped = int(sum(jnp.sum(layer.overflow) for layer in self.cache.layers))  # one read from the device
            if dropped:
                self._overflow_warned = True
                warnings.warn(f"the DMS pool overflowed by turn {self._turns} ({dropped} entries dropped over the "
                              "layers): from here replies may differ from generate on the whole history (a prefill "
                              "and decode drop differently); a larger DMSConfig.budget avoids it", stacklevel=2)
        return tokens[0], n


def _cache_dtype(dtype):
    """`Conversation`'s cache dtype, checked: a floating dtype (an integer cache would round every key and value)."""
    return cache_lib.check_cache_args("Conversation", dtype)


def _as_key(rng) -> jax.Array:
    """`generate`'s rng as one PRNG key: None (seed 0), an int seed (Python, numpy or a jax integer
    scalar), a jax.random.key, or a raw jax.random.PRNGKey (uint32 [2], through numpy too)."""
    if rng is None:
        return jax.random.key(0)
    typed = isinstance(rng, jax.Array) and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if not typed and _int_like(rng) is not None:
        return jax.random.key(check_seed(rng))  # a seed
    raw = isinstance(rng, (np.ndarray, jax.Array)) and rng.dtype == np.uint32 and rng.shape[-1:] == (2,)
    if not (typed or raw):
        raise ValueError(f"rng must be a jax.random.key (or an int seed), got {type(rng).__name__}"
                         + (f" {rng.dtype}{list(rng.shape)}" if isinstance(rng, (np.ndarray, jax.Array)) else ""))
    shape = rng.shape if typed else rng.shape[:-1]
    if shape != ():  # one key per row was jax's "split accepts a single key ... use jax.vmap"
        raise ValueError(f"rng must be one key, got a batch of keys of shape {shape}: every row of the batch "
                         "already draws its own noise from one key")
    return jnp.asarray(rng)


def _eos_array(eos_ids) -> jax.Array:
    return jnp.asarray(tuple(eos_ids) or (-1,), jnp.int32)


def _plan(config: Qwen3Config, cache: CacheSpec, stream_prompt: bool) -> tuple[CacheSpec, int | None]:
    """(resolved cache, stream_from) of a `generate` call."""
    if not isinstance(stream_prompt, (bool, np.bool_)):  # "no" is truthy: it streamed the prompt
        raise ValueError(f"stream_prompt must be True or False, got {stream_prompt!r}")
    kind = resolve_cache(config, cache)
    if stream_prompt and isinstance(kind, BaselineConfig) and kind.method == "streaming":
        return dataclasses.replace(kind, banded_prefill=True), None  # the streamed read in one banded pass (exact)
    if stream_prompt and kind != "dense":
        return kind, max(1, kind.budget if isinstance(kind, BaselineConfig) else _bounded_budget(config))
    return kind, None


def _bounded_budget(config: Qwen3Config) -> int:
    """Entries a KVpop / DMS cache holds before its first eviction (streaming starts there)."""
    if config.kvpop is not None:
        return config.kvpop.sinks + config.kvpop.window
    return config.dms.window


__all__ = ["CACHE_KINDS", "Conversation", "check_seed", "compile_generate", "generate", "init_generation_cache",
           "resolve_cache"]
