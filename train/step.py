"""The sharded train step: KL distillation from a frozen dense teacher + the retention loss (KVpop)
or DMS's auxiliary eviction loss.

One call of the step is one optimizer update over the global batch, laid out as
micro-batches `[A, b, S]` (A = gradient accumulation): a `lax.scan` runs forward/backward
per micro-batch and sums float32 gradients, then AdamW (two groups, `train/optim.py`)
updates once. Per micro-batch:

  teacher  dense Qwen3 with the *initial* base weights (frozen, bf16 on GPU): its top-K
           logits per token, `[b, S, K]` (or precomputed ones read from disk)
  student  the KVpop model (`query_samples` drawn with `sample_query_positions`, min_q = B, on
           each row's real tokens: a packed row's padding tail is neither a sampled query nor a
           query of the retention target; segment_ids say where it starts),
           or the DMS model with its relaxed gates (logistic noise from the step's rng)
  loss     KL(teacher top-K || student) + retention_loss_weight * retention loss (KVpop), or
           + aux_loss_weight * relu(target(step) - eviction rate) (DMS, `kvpop_jax/dms.py`;
           the target rises with the optimizer step)

Gradient routing is the model's (`kvpop_jax/kvpop.py`'s docstring): the KL reaches only base weights, the
retention loss only scorers and decay; DMS's KL and auxiliary loss reach base weights and
gates (the gates read stop-gradient [k; v]). With `freeze_base` the base weights are
stop-gradient, so XLA drops the whole backward pass through the network.

Memory: `lm_head` and the KL run over sequence chunks of `loss_chunk` tokens under
`jax.checkpoint`, so `[b, S, V]` logits never exist at once (V = 151936 at S = 16384 is
10 GB per row in float32); each decoder layer can be rematerialized (`remat`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from kvpop_jax import dms as dms_lib
from kvpop_jax import losses, modeling
from kvpop_jax import sharding as shd
from kvpop_jax.config import Qwen3Config
from train import optim

Model = modeling.Qwen3ForCausalLM
METRIC_KEYS = ("loss", "kl", "retention_loss", "boundary_accuracy", "boundary_auc", "keep_rate", "num_valid",
               "teacher_recall", "tokens", "dms_loss", "eviction_rate", "target_eviction")


def metric_keys(sc: "StepConfig") -> tuple[str, ...]:
    """The step's scalar metrics: METRIC_KEYS, plus `pair_accuracy` (the share of ranking pairs
    the scorer orders as the target does) when the retention loss has ranking pairs, and
    `regression_rmse` (the squared-error fit's root mean, in nats) when it has that fit."""
    kv = sc.model.kvpop
    if kv is None or kv.topk == 0:
        return METRIC_KEYS
    return METRIC_KEYS + (("pair_accuracy",) if kv.rank_pairs else ()) + \
        (("regression_rmse",) if kv.regression_weight else ())


@flax.struct.dataclass
class TrainState:
    """step int32 []; params / opt_state pytrees; rng uint32 [2] (the run's base key)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step function needs from TrainConfig (hashable, static under jit)."""

    model: Qwen3Config  # with kvpop or dms set
    compute_dtype: Any
    param_dtype: Any
    teacher_dtype: Any
    remat: str
    loss_chunk: int  # 0: the whole sequence
    micro_batch: int
    grad_accum: int
    seq_len: int
    precomputed_teacher: bool
    optim: optim.OptimConfig
    scan_layers: bool = False  # both models' layers as one lax.scan (Qwen3ForCausalLM.scan_layers)


def _chunks(x, chunk: int):
    """[B, S, ...] -> [S / chunk, B, chunk, ...]."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // chunk, chunk, *x.shape[2:]), 1, 0)


def _unchunk(x):
    """[n, B, C, ...] -> [B, n * C, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def teacher_topk_logits(teacher: Model, teacher_params, input_ids, positions, k: int, chunk: int):
    """The frozen teacher's top-k logits: (values float32 [B, S, K], indices int32 [B, S, K]).

    The dense teacher's attention runs tiled (`attention.dense_attention`) from
    `attention.DENSE_TILED_MIN_QUERIES` queries on, so no `[B, H, S, S]` logits are built.
    """
    teacher_params = jax.lax.stop_gradient(teacher_params)
    x = teacher.apply({"params": teacher_params}, input_ids, positions, return_hidden=True).hidden

    def one(_, x_c):
        logits = teacher.apply({"params": teacher_params}, x_c, method=Model.logits_from_hidden)
        return None, shd.shard_over_batch(lambda z: losses.teacher_topk(z, k))(logits)

    _, (values, indices) = jax.lax.scan(one, None, _chunks(x, chunk))
    return jax.lax.stop_gradient(_unchunk(values)), _unchunk(indices)


def chunked_kl(student: Model, params, x, t_values, t_indices, mask, *, temperature: float, chunk: int):
    """Mean over masked tokens of KL(teacher top-K || student), computed `chunk` tokens at a time.

    x [B, S, E] student hidden; t_values, t_indices [B, S, K]; mask [B, S]. Each chunk's
    logits are recomputed in the backward pass instead of stored.
    """

    @jax.checkpoint
    def chunk_sum(x_c, v_c, i_c, m_c):
        logits = student.apply({"params": params}, x_c, method=Model.logits_from_hidden)
        count = jnp.sum(m_c.astype(jnp.float32))
        return losses.topk_kl_loss(logits, v_c, i_c, temperature=temperature, mask=m_c) * count

    def body(total, xs):
        return total + chunk_sum(*xs), None

    xs = (_chunks(x, chunk), _chunks(t_values, chunk), _chunks(t_indices, chunk), _chunks(mask, chunk))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return total / jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)


def build_models(sc: StepConfig) -> tuple[Model, Model]:
    """(student KVpop model with the remat policy, dense teacher: forward only, no remat)."""
    student = Model(sc.model, dtype=sc.compute_dtype, param_dtype=sc.param_dtype, remat_policy=sc.remat,
                    scan_layers=sc.scan_layers)
    teacher = Model(dataclasses.replace(sc.model, kvpop=None, dms=None), dtype=sc.compute_dtype,
                    param_dtype=sc.teacher_dtype, remat_policy="none", scan_layers=sc.scan_layers)
    return student, teacher


def real_lengths(segment_ids: jax.Array) -> jax.Array:
    """Per row, the real tokens before its padding: int32 [b] from segment_ids [b, S] (0 = padding).

    Packing pads only a row's tail (`train.packing`), so this is the index after the last real token."""
    pos = jnp.arange(1, segment_ids.shape[-1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(segment_ids > 0, pos, 0), axis=-1)


def make_loss_fn(sc: StepConfig) -> Callable:
    """loss_fn(params, teacher_params, micro_batch, rng, step) -> (loss, metrics dict of scalars).

    step: the optimizer step (int32 []), which sets DMS's target eviction rate."""
    student, teacher = build_models(sc)
    kv, dms = sc.model.kvpop, sc.model.dms
    distill = kv if kv is not None else dms  # both carry kl_topk and kl_temperature
    chunk = sc.loss_chunk or sc.seq_len
    keys = metric_keys(sc)

    def loss_fn(params, teacher_params, mb, rng, step):
        ids, pos, mask = mb["input_ids"], mb["positions"], mb["loss_mask"]
        lengths = real_lengths(mb["segment_ids"]) if "segment_ids" in mb else None
        if sc.optim.freeze_base:
            flat = traverse_util.flatten_dict(params)
            params = traverse_util.unflatten_dict(
                {k: v if set(modeling.RETROFIT_SUBTREES) & set(k) else jax.lax.stop_gradient(v)
                 for k, v in flat.items()})
        if sc.precomputed_teacher:
            t_values, t_indices = mb["teacher_values"].astype(jnp.float32), mb["teacher_indices"]
        else:
            t_values, t_indices = teacher_topk_logits(teacher, teacher_params, ids, pos, distill.kl_topk, chunk)
        q_samples = None
        if kv is not None and kv.topk > 0:
            q_samples = losses.sample_query_positions(
                rng, batch=ids.shape[0], seq_len=ids.shape[1], num=kv.num_query_samples, min_q=kv.budget,
                late_bias_fraction=kv.late_bias_fraction, lengths=lengths,
            )
        rngs = {modeling.DMS_RNG: jax.random.fold_in(rng, 1)} if dms is not None else {}
        out = student.apply({"params": params}, ids, pos, query_samples=q_samples, return_hidden=True, rngs=rngs,
                            row_lengths=lengths)
        x, aux = out.hidden, out.aux
        kl = chunked_kl(student, params, x, t_values, t_indices, mask, temperature=distill.kl_temperature,
                        chunk=chunk)
        metrics = {"kl": kl, "tokens": jnp.sum(mask.astype(jnp.float32))}
        zero = jnp.zeros((), jnp.float32)
        if dms is not None:
            target = dms_lib.target_eviction_at(step, final_eviction=dms.target_eviction,
                                                ramp_steps=dms_lib.ramp_steps(dms, sc.optim.steps))
            dms_loss = dms_lib.aux_loss(aux["dms_frac"], target)
            metrics.update(dms_loss=dms_loss, eviction_rate=aux["metrics"]["eviction_rate"], target_eviction=target)
        else:
            dms_loss = zero
            metrics.update(dms_loss=zero, eviction_rate=zero, target_eviction=zero)
        if q_samples is not None:
            retention = aux["retention_loss"]
            metrics.update(retention_loss=retention, **aux["metrics"])
        else:
            retention = jnp.zeros((), jnp.float32)
            metrics.update(retention_loss=retention, boundary_accuracy=retention, boundary_auc=retention + 0.5,
                           keep_rate=retention, num_valid=retention, teacher_recall=retention)
        if dms is not None:
            loss = kl + dms.aux_loss_weight * dms_loss
        else:
            loss = kl + kv.retention_loss_weight * retention
        metrics["loss"] = loss
        return loss, {k: jnp.asarray(metrics[k], jnp.float32) for k in keys}

    return loss_fn


def make_train_step(sc: StepConfig, tx: optax.GradientTransformation, mesh=None) -> Callable:
    """train_step(state, teacher_params, batch) -> (state, metrics).

    batch: dict of arrays `[A, b, S]` (input_ids, positions, loss_mask, segment_ids; plus
    teacher_values / teacher_indices `[A, b, S, K]` when precomputed). Metrics are means
    over micro-batches (tokens: the sum), plus grad_norm (before clipping), the LRs
    applied at this step and state_finite (1.0 iff the updated params and optimizer state
    hold no NaN/inf: the loop never keeps or saves a state that does). Deterministic in (state, batch): query samples use
    fold_in(state.rng, step, micro-batch).
    """
    loss_fn = make_loss_fn(sc)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, teacher_params, batch):
        with shd.activate(mesh):
            step_rng = jax.random.fold_in(state.rng, state.step)

            def micro(carry, xs):
                grads_acc, metrics_acc = carry
                mb, i = xs
                (_, metrics), grads = grad_fn(state.params, teacher_params, mb, jax.random.fold_in(step_rng, i),
                                              state.step)
                grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
                metrics_acc = jax.tree.map(jnp.add, metrics_acc, metrics)
                return (grads_acc, metrics_acc), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            zero_metrics = {k: jnp.zeros((), jnp.float32) for k in metric_keys(sc)}
            (grads, metrics), _ = jax.lax.scan(
                micro, (zeros, zero_metrics), (batch, jnp.arange(sc.grad_accum, dtype=jnp.int32)))
            grads = jax.tree.map(lambda g: g / sc.grad_accum, grads)
            metrics = {k: (v if k == "tokens" else v / sc.grad_accum) for k, v in metrics.items()}
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
            metrics["grad_norm"] = optax.global_norm(grads)
            metrics.update(optim.learning_rates(sc.optim, state.step))
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics["state_finite"] = all_finite((params, opt_state))
            new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
            return new_state, metrics

    return train_step


def all_finite(tree) -> jax.Array:
    """1.0 if every float leaf of `tree` is finite, else 0.0 (one fused reduction per leaf)."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)).astype(jnp.float32) if checks else jnp.ones((), jnp.float32)


def init_state(params, tx: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.PRNGKey(seed))


def state_shardings(abstract_state: TrainState, mesh) -> TrainState:
    """NamedShardings of a TrainState: params/opt state FSDP+tensor, step and rng replicated."""
    params_sh = shd.param_shardings(abstract_state.params, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return TrainState(
        step=replicated, params=params_sh,
        opt_state=shd.state_shardings_like(abstract_state.opt_state, abstract_state.params, mesh),
        rng=replicated,
    )


def batch_shardings(batch_like: dict, mesh) -> dict:
    """Arrays [A, b, S, ...]: micro-batch rows b over (data, fsdp)."""
    return {k: shd.batch_sharding(mesh, v.ndim, batch_dim=1) for k, v in batch_like.items()}


def jit_train_step(sc: StepConfig, tx, mesh, abstract_state: TrainState, abstract_teacher, batch_like: dict):
    """The jitted step with explicit in/out shardings (state donated)."""
    state_sh = state_shardings(abstract_state, mesh)
    teacher_sh = shd.param_shardings(abstract_teacher, mesh) if abstract_teacher is not None else None
    batch_sh = batch_shardings(batch_like, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    step = make_train_step(sc, tx, mesh)
    return jax.jit(step, in_shardings=(state_sh, teacher_sh, batch_sh), out_shardings=(state_sh, replicated),
                   donate_argnums=(0,)), state_sh, teacher_sh, batch_sh
