"""The optimizer (Table 3): AdamW with two parameter groups and global clipping.

  base  (every pretrained weight): constant LR `base_lr` (8e-5), or frozen (`freeze_base`)
  new   (anything under a `kvpop` or `dms` subtree: scorers, decay, DMS gates): linear warmup over
        `warmup_steps` to `new_lr` (1e-3), then cosine to `new_lr_final` (8e-5) at `steps`

Both: AdamW(b1, b2) with decoupled weight decay on all parameters; the gradient is clipped
to `clip_norm` by its global norm over both groups before the split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from kvpop_jax.modeling import RETROFIT_SUBTREES
from train.config import OptimConfig

BASE, NEW = "base", "new"


def param_labels(params) -> dict:
    """Same tree as params with "new" for retrofit params (KVpop scorers and decay, DMS gates) and
    "base" elsewhere."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: NEW if set(RETROFIT_SUBTREES) & set(k) else BASE for k in flat})


def new_params_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Warmup + cosine of the new params' LR, as a function of the optimizer step (0-based)."""
    decay_steps = max(cfg.steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.new_lr, warmup_steps=cfg.warmup_steps, decay_steps=decay_steps,
        end_value=cfg.new_lr_final,
    )


def base_schedule(cfg: OptimConfig) -> optax.Schedule:
    return optax.constant_schedule(0.0 if cfg.freeze_base else cfg.base_lr)


def learning_rates(cfg: OptimConfig, step) -> dict[str, jax.Array]:
    """The LRs applied at optimizer step `step` (for logging)."""
    return {"lr_base": jnp.asarray(base_schedule(cfg)(step), jnp.float32),
            "lr_new": jnp.asarray(new_params_schedule(cfg)(step), jnp.float32)}


def _adamw(cfg: OptimConfig, schedule) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip(global) -> {base: AdamW(constant) or frozen, new: AdamW(warmup + cosine)}."""
    base = optax.set_to_zero() if cfg.freeze_base else _adamw(cfg, base_schedule(cfg))
    groups = optax.multi_transform({BASE: base, NEW: _adamw(cfg, new_params_schedule(cfg))}, param_labels)
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), groups)
    return groups
