"""The demo teacher's training: optimizer, train step, resumable state, the loop."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time

import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from kvpop_jax import load_pretrained
from kvpop_jax.checkpoint import atomic_write_bytes
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params
from train.demo_teacher.config import PretrainConfig
from train.demo_teacher.data import make_batch
from train.demo_teacher.evaluate import evaluate
from train.demo_teacher.init import init_offset_heads, plant_lookup_circuit
from train.run_dir import read_metrics

STATE_FILE = "state.msgpack"
METRICS_FILE = "metrics.jsonl"


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def make_optimizer(cfg: PretrainConfig) -> optax.GradientTransformation:
    total = cfg.total_steps
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, min(cfg.warmup_steps, total - 1), max(total, 2),
                                                  end_value=cfg.final_lr)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731  no decay on norms
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))


def init_state(cfg: PretrainConfig, optimizer) -> TrainState:
    if cfg.init_from:
        params = load_init(cfg)
    else:
        params = init_params(cfg.model, jax.random.key(cfg.seed))
        params = init_offset_heads(params, cfg.model, cfg.offset_heads)
        if cfg.lookup_circuit:
            params = plant_lookup_circuit(params, cfg.model, cfg.seed, recall_head=cfg.recall_head)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def load_init(cfg: PretrainConfig) -> dict:
    """The weights of the exported teacher `cfg.init_from`, checked against `cfg.model`."""
    model_config, params = load_pretrained(cfg.init_from)
    saved, wanted = model_config.to_hf(), cfg.model.to_hf()
    if saved != wanted:
        diff = {k: (v, wanted.get(k)) for k, v in saved.items() if wanted.get(k) != v}
        raise ValueError(f"init_from={cfg.init_from!r} is a different model than the flags ask for "
                         f"(checkpoint vs flags): {diff}")
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


# Whole [S, S] logits up to here, the gathered band above. With the tiled dense attention, a
# 1024-token teacher step (8 rows, CPU) takes 2.27 s with the whole logits and 1.76 s with the band;
# at 512 tokens 0.78 s and 0.82 s (benchmarks/stop30).
FULL_NEAR_MAX_LEN = 512


def park_loss(attention, park_BxS: jax.Array, window: int, lookup_BxS: jax.Array | None = None) -> jax.Array:
    """Mean attention that the parked queries (`data.park_mask`) pay to keys older than `window`
    tokens (1 <= t <= d - window), over every head of every layer: 0 when they attend only to the first
    token and the recent window, where a future-attention target (Eq. 2) does not count them. With
    `lookup_BxS` (`data.lookup_mask`), plus the same mean over the lookups of every head's old
    attention but the layer's largest: a lookup needs one head to read the fact, and the target of a
    KV head (the max over its query heads) also counts what its other query heads read there.

    A lookup at such a name is of no use to the next token, but a teacher trained on the task alone
    keeps making it (its match head fetches the name's previous value, or at a new name the digits
    whose names look closest), and the target then ranks those values like the facts.

    attention: per layer (q [B, S, Hq, D], k [B, S, Hkv, D], lse [B, Hq, S]) as the dense forward sows
    them (`forward_attention`): no second pass through the layers. The old mass is 1 - exp(LSE over
    the first token and the window - lse), the near LSE from the masked [S, S] logits up to
    `FULL_NEAR_MAX_LEN` tokens and from the window's gathered band above (O(S * window) memory);
    no [B, H, S, S] weights are built.
    """
    masses = []
    for q, k, lse in attention:
        b, s, hq, d = q.shape
        hkv = k.shape[2]
        qg = q.reshape(b, s, hkv, hq // hkv, d).astype(jnp.float32)
        if s <= FULL_NEAR_MAX_LEN:  # the whole [S, S] logits: no slower than gathering the band here
            t, q_at = np.arange(s)[None], np.arange(s)[:, None]
            near_keys = (t == 0) | ((t <= q_at) & (t > q_at - window))  # [S, S]
            logits = jnp.einsum("bshgd,bthd->bhgst", qg, k.astype(jnp.float32)) * d**-0.5
            near = jax.nn.logsumexp(jnp.where(near_keys, logits, -jnp.inf), -1).reshape(b, hq, s)
        else:
            back = np.arange(s)[:, None] - np.arange(window)[None]  # [S, w]: key d - j of query d
            band = jnp.einsum("bshgd,bsjhd->bhgsj", qg, k[:, np.maximum(back, 1)].astype(jnp.float32)) * d**-0.5
            band = jnp.where(back >= 1, band, -jnp.inf)  # key 0 comes once, below
            first = jnp.einsum("bshgd,bhd->bhgs", qg, k[:, 0].astype(jnp.float32)) * d**-0.5
            near = jax.nn.logsumexp(jnp.concatenate([first[..., None], band], -1), -1).reshape(b, hq, s)
        masses.append(jnp.maximum(1.0 - jnp.exp(near - lse), 0.0))  # [B, Hq, S]
    park = park_BxS.astype(jnp.float32)[:, None]
    per_query = sum(jnp.sum(m * park) for m in masses) / (len(masses) * masses[0].shape[1])
    loss = per_query / jnp.maximum(jnp.sum(park), 1.0)
    if lookup_BxS is not None:
        look = lookup_BxS.astype(jnp.float32)
        others = sum(jnp.sum((jnp.sum(m, 1) - jnp.max(m, 1)) * look) for m in masses)  # [B, S] per layer
        loss = loss + others / (len(masses) * masses[0].shape[1]) / jnp.maximum(jnp.sum(look), 1.0)
    return loss


def forward_attention(model: Qwen3ForCausalLM, params, ids_BxS: jax.Array):
    """(logits [B, S, V], per layer (q, k, lse) of its dense attention) from one forward."""
    out, sown = model.apply({"params": params}, ids_BxS, mutable=["intermediates"])
    layers = sown["intermediates"]
    return out.logits, [layers[f"layers_{i}"]["self_attn"]["attention"][0] for i in range(model.config.num_hidden_layers)]


def make_train_step(model: Qwen3ForCausalLM, optimizer, park_weight: float = 0.0, park_window: int = 32,
                    park_lookups: bool = False):
    """jitted (state, batch) -> (state, metrics); batch as `data.make_batch` ([B, S] arrays).

    Metrics: the weighted loss, the plain mean CE, over completion tokens their CE, token accuracy and
    the share of rows whose whole completion is argmax-right (teacher forced), and the argmax accuracy
    of the reuse rows' recalled values (`recall_acc`; the loop drops it from batches without); with
    `park_weight` > 0 the loss adds `park_weight * park_loss` and `park` logs the latter.
    """

    def loss_fn(params, batch):
        if park_weight > 0:
            logits, attention = forward_attention(model, params, batch["input_ids"])  # [B, S, V]
        else:
            logits = model.apply({"params": params}, batch["input_ids"]).logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, S]
        w = batch["weights"]
        loss = jnp.sum(ce * w) / jnp.sum(w)
        extra = {}
        if park_weight > 0:
            extra["park"] = park_loss(attention, batch["park"], park_window, batch["lookup"] if park_lookups else None)
            loss = loss + park_weight * extra["park"]
        comp = batch["completion"].astype(jnp.float32)
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
        has_completion = jnp.any(batch["completion"], axis=-1).astype(jnp.float32)  # drill rows have none
        recall = batch["recall"].astype(jnp.float32)  # reuse rows' recalled values: read by a lookup or guessed
        metrics = dict(loss=loss, ce=jnp.mean(ce),
                       completion_ce=jnp.sum(ce * comp) / jnp.sum(comp),
                       completion_token_acc=jnp.sum(correct * comp) / jnp.sum(comp),
                       # a completion is right iff all its tokens are (teacher-forced exact match)
                       completion_exact=jnp.sum(jnp.all((correct > 0) | ~batch["completion"], axis=-1) * has_completion)
                       / jnp.maximum(jnp.sum(has_completion), 1.0),
                       recall_acc=jnp.sum(correct * recall) / jnp.maximum(jnp.sum(recall), 1.0), **extra)
        return loss, metrics

    @functools.partial(jax.jit, donate_argnums=(0,))
    def train_step(state: TrainState, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics["grad_norm"] = optax.global_norm(grads)
        params = optax.apply_updates(state.params, updates)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


# ------------------------------------------------------------------------------- checkpoint


def save_state(cfg: PretrainConfig, state: TrainState, elapsed_s: float = 0.0) -> None:
    """params + optimizer state + step + the settings + training seconds so far, as one
    atomically replaced file."""
    payload = dict(state=flax.serialization.to_state_dict(jax.device_get(state)),
                   config=json.dumps(cfg.resume_key()), elapsed_s=float(elapsed_s))
    os.makedirs(cfg.run_dir, exist_ok=True)
    atomic_write_bytes(os.path.join(cfg.run_dir, STATE_FILE), flax.serialization.msgpack_serialize(payload))


def restore_state(cfg: PretrainConfig, target: TrainState) -> tuple[TrainState, float] | None:
    """(state, training seconds so far) of this run, or None if nothing is saved; refuses a state
    saved with other settings."""
    payload = check_saved_run(cfg)
    if payload is None:
        return None
    return flax.serialization.from_state_dict(target, payload["state"]), float(payload.get("elapsed_s", 0.0))


def check_saved_run(cfg: PretrainConfig) -> dict | None:
    """The state RUN_DIR holds (its msgpack payload), None if none; ValueError naming the settings that
    differ from `cfg`'s (checked before any work, and again on restoring)."""
    path = os.path.join(cfg.run_dir, STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        payload = flax.serialization.msgpack_restore(f.read())
    saved = json.loads(payload["config"])
    saved.setdefault("park_lookups", False)  # states saved before the option ran without it
    if saved != cfg.resume_key():  # each changed value named, old -> new (it named only "model, phases")
        raise ValueError(f"{path} was saved with different settings: {'; '.join(_changes(saved, cfg.resume_key()))}. "
                         "Rerun with the old values to resume it, use another --run_dir, or delete it")
    return payload


def _changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """"KEY OLD -> NEW" for every leaf that differs between two resume keys (nested dicts by dotted key)."""
    out = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {json.dumps(a)} -> {json.dumps(b)}")
    return out


def _log(cfg: PretrainConfig, record: dict) -> None:
    with open(os.path.join(cfg.run_dir, METRICS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")


@functools.lru_cache(maxsize=4)
def _compiled(cfg: PretrainConfig):
    """Model, optimizer and a jitted step per parking weight of the curriculum's phases, as a dict
    weight -> step (cached: a resumed run in the same process reuses the compiled steps). A phase
    without the parking loss runs a step that does not compute it."""
    model, optimizer = Qwen3ForCausalLM(cfg.model), make_optimizer(cfg)
    steps = {w: make_train_step(model, optimizer, w, cfg.park_window, cfg.park_lookups)
             for w in dict.fromkeys(cfg.park_weight_of(p) for p in cfg.phases)}
    return model, optimizer, steps


def train(cfg: PretrainConfig, *, progress: bool = True, stop_at: int | None = None) -> tuple[TrainState, list[dict]]:
    """Runs (or resumes) the curriculum to cfg.total_steps (or only to `stop_at`, as if interrupted
    there); returns the state and the log records of this call (train records carry `elapsed_s`,
    training seconds since step 0 across resumes). Saves RUN_DIR/state.msgpack every
    `checkpoint_every` steps and at the end."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    model, optimizer, train_steps = _compiled(dataclasses.replace(cfg, run_dir="", out_dir=""))
    state, elapsed = init_state(cfg, optimizer), 0.0
    restored = restore_state(cfg, state)
    if restored is not None:
        state, elapsed = restored
    start = int(state.step)
    metrics_path = os.path.join(cfg.run_dir, METRICS_FILE)
    if os.path.isfile(metrics_path):  # cut back to the resumed step: steps logged after the last save come again
        kept = read_metrics(metrics_path, start)  # train.main's reader: a torn last line is dropped too
        atomic_write_bytes(metrics_path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    clock = time.perf_counter() - elapsed  # elapsed = time.perf_counter() - clock, across resumes
    records: list[dict] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(make_batch, cfg, start) if start < cfg.total_steps else None
    bar = tqdm(total=cfg.total_steps, initial=start, desc="pretrain", disable=not progress, mininterval=5,
               dynamic_ncols=True, file=sys.stderr)
    window = dict(tokens=0, time=time.perf_counter())
    end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
    for step in range(start, end):
        batch = future.result()
        future = pool.submit(make_batch, cfg, step + 1) if step + 1 < end else None
        state, metrics = train_steps[cfg.park_weight_of(cfg.phase_at(step))](state, batch)
        window["tokens"] += batch["input_ids"].size
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.total_steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not batch["recall"].any():  # no reuse rows: nothing to score
                metrics.pop("recall_acc")
            now = time.perf_counter()
            tok_s = window["tokens"] / max(now - window["time"], 1e-9)
            window.update(tokens=0, time=now)
            record = dict(step=done, prompt_len=cfg.phase_at(step).prompt_len, tokens_per_s=round(tok_s),
                          elapsed_s=round(now - clock),
                          **{k: round(v, 5) for k, v in metrics.items()})
            records.append(record)
            _log(cfg, record)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", comp=f"{metrics['completion_ce']:.3f}",
                            exact=f"{metrics['completion_exact']:.2f}", tok_s=f"{tok_s:.0f}")
            bar.write(json.dumps(record))
        if done % cfg.checkpoint_every == 0 or done == end:
            save_state(cfg, state, time.perf_counter() - clock)
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.total_steps):
            tasks = dict.fromkeys([cfg.task(cfg.phase_at(step)), cfg.task(cfg.phases[-1])])
            for task in tasks:  # the task of this phase and of the last one
                result = evaluate(model, state.params, cfg, task, cfg.eval_examples, batch=cfg.eval_batch)
                record = dict(step=done, eval_prompt_len=task.seq_len, eval_accuracy=result["accuracy"],
                              eval_n=result["n"], sample=result["samples"][0][2])
                records.append(record)
                _log(cfg, record)
                bar.write(json.dumps(record))
        bar.update(1)
    bar.close()
    pool.shutdown()
    return state, records
