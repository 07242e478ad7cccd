"""Device mesh, the one logical-axis rules table, and sharding helpers (MaxText-style).

Every parameter is described by *logical* axes (`embed`, `heads`, `kv_heads`, `mlp`,
`vocab`, ...) looked up by its path in `PARAM_LOGICAL_AXES`; `LOGICAL_AXIS_RULES` maps
logical axes onto the mesh axes `data`, `fsdp`, `tensor`. Changing the parallelism
layout means editing the rules table, nothing else:

  - batch        -> (data, fsdp)   activations are data-parallel over both
  - embed        -> fsdp           params and optimizer state are FSDP-sharded on embed
  - heads, kv_heads, mlp, vocab -> tensor   (Megatron-style tensor parallelism)

A dimension that its mesh axes do not divide is left unsharded (never an error), so one
table serves every model size. KVpop parameters (scorers, decay: a few KB per layer)
are replicated.

Pallas kernels are not auto-partitioned: `shard_kernel` wraps a kernel in `shard_map`
over batch and heads (its arrays described by layouts such as "BSHD", "BHS"), using the
mesh activated by `activate(mesh)` (a no-op without one). The kernel dispatchers
(`attention.kvpop_attention`, `targets.future_attention_log_mass`,
`policy.running_topk_cutoff`) apply it to their Pallas paths.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# The one table: logical axis -> mesh axis (or tuple of axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("length", None),
    ("act_embed", None),
    ("norm", None),
)

# Param path (regex on "a/b/c") -> logical axes of its dimensions. First match wins.
PARAM_LOGICAL_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)kvpop/", ()),  # replicated: tiny
    (r"(^|/)dms/", ()),  # replicated: tiny (DMS gates)
    (r"^embed_tokens/embedding$", ("vocab", "embed")),
    (r"^lm_head/kernel$", ("embed", "vocab")),
    (r"/self_attn/q_proj/kernel$", ("embed", "heads", "head_dim")),
    (r"/self_attn/[kv]_proj/kernel$", ("embed", "kv_heads", "head_dim")),
    (r"/self_attn/q_proj/bias$", ("heads", "head_dim")),
    (r"/self_attn/[kv]_proj/bias$", ("kv_heads", "head_dim")),
    (r"/self_attn/o_proj/kernel$", ("heads", "head_dim", "embed")),
    (r"/self_attn/o_proj/bias$", ("norm",)),
    (r"/mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"/mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"(norm|layernorm)/scale$", ("norm",)),
)

_ACTIVE_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("kvpop_mesh", default=None)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all). -1 in one axis takes the rest."""
    devices = list(jax.devices() if devices is None else devices)
    shape = [data, fsdp, tensor]
    if shape.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data}, fsdp={fsdp}, tensor={tensor}")
    if -1 in shape:
        rest = int(np.prod([a for a in shape if a != -1]))
        if len(devices) % rest:
            raise ValueError(f"{len(devices)} devices are not divisible by the fixed mesh axes {shape}")
        shape[shape.index(-1)] = len(devices) // rest
    if any(a < 1 for a in shape):
        raise ValueError(f"mesh axes must be >= 1 (or one -1), got data={data}, fsdp={fsdp}, tensor={tensor}")
    n = int(np.prod(shape))
    if n != len(devices):
        raise ValueError(
            f"mesh data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} = {n} devices, but {len(devices)} "
            "are available; the product must equal the device count"
        )
    return jax.make_mesh(
        tuple(shape), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
    )


def _rule(logical: str | None, rules) -> tuple[str, ...]:
    if logical is None:
        return ()
    for name, target in rules:
        if name == logical:
            if target is None:
                return ()
            return (target,) if isinstance(target, str) else tuple(target)
    raise KeyError(f"logical axis {logical!r} has no rule in LOGICAL_AXIS_RULES")


def logical_to_spec(
    logical_axes: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None, rules=LOGICAL_AXIS_RULES
) -> P:
    """Logical axes -> PartitionSpec. With `shape`, mesh axes that do not divide a dim are dropped."""
    spec, used = [], set()
    for i, logical in enumerate(logical_axes):
        axes = [a for a in _rule(logical, rules) if a not in used and mesh.shape[a] > 1]
        if shape is not None:
            while axes and shape[i] % int(np.prod([mesh.shape[a] for a in axes])):
                axes.pop()  # drop the innermost axis until the dim divides
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*spec)


def param_logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at `path` ("layers_0/self_attn/q_proj/kernel")."""
    for pattern, axes in PARAM_LOGICAL_AXES:
        if re.search(pattern, path):
            if axes and len(axes) != ndim:
                raise ValueError(f"parameter {path!r} has {ndim} dims, the rules table says {axes}")
            return axes or (None,) * ndim
    raise KeyError(f"parameter {path!r} matches no entry of PARAM_LOGICAL_AXES; add one")


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """Pytree of NamedShardings for a (possibly abstract) param tree of nested dicts."""
    flat = traverse_util.flatten_dict(params, sep="/")
    out = {
        path: NamedSharding(mesh, logical_to_spec(param_logical_axes(path, x.ndim), mesh, x.shape))
        for path, x in flat.items()
    }
    return traverse_util.unflatten_dict(out, sep="/")


def state_shardings_like(tree: Any, params: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state (or any tree) whose leaves mirror params.

    A leaf whose dict-key path ends with a parameter's path and has the parameter's shape
    (Adam's mu, nu; accumulated grads) gets that parameter's sharding; everything else
    (step counts, scalars, masked placeholders) is replicated.
    """
    by_path = {
        tuple(path): (x.shape, s)
        for (path, x), s in zip(
            traverse_util.flatten_dict(params).items(),
            traverse_util.flatten_dict(param_shardings(params, mesh)).values(),
        )
    }
    replicated = NamedSharding(mesh, P())

    def one(keypath, leaf):
        names = tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))
        for i in range(len(names)):
            hit = by_path.get(names[i:])
            if hit is not None and tuple(hit[0]) == tuple(np.shape(leaf)):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, ndim: int, batch_dim: int = 0) -> NamedSharding:
    """Sharding of a data array: `batch_dim` over (data, fsdp), the rest replicated."""
    axes: list[str | None] = [None] * ndim
    axes[batch_dim] = "batch"
    return NamedSharding(mesh, logical_to_spec(axes, mesh))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None = None) -> jax.Array:
    """`with_sharding_constraint` by logical axes on the active (or given) mesh; no-op without one."""
    mesh = mesh or _ACTIVE_MESH.get()
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, mesh, x.shape)))


@contextlib.contextmanager
def activate(mesh: Mesh | None):
    """Makes `mesh` the one `constrain`, `shard_kernel` and `shard_over_batch` use (while tracing)."""
    token = _ACTIVE_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE_MESH.reset(token)


def shard_kernel(
    kernel: Callable, in_layouts: Sequence[str], out_layouts: str | Sequence[str], mesh: Mesh | None = None
) -> Callable:
    """Wraps `kernel(*arrays)` in shard_map over batch and heads: the one way kernels are partitioned.

    A layout names each array's dims with one letter: "B" is the batch (split over data,
    fsdp), "H" the heads (split over tensor), any other letter is kept whole ("BSHD" for
    q/k/v, "BHS" for per-head rows). `out_layouts` is one layout (one output) or a
    sequence (a tuple of outputs). Heads are split only when tensor divides every H dim;
    contiguous head blocks keep GQA groups together (query head h*G + g reads KV head h).
    The sequence is never split. Without an active multi-device mesh, returns `kernel`.
    """
    mesh = mesh or _ACTIVE_MESH.get()
    if mesh is None or mesh.size == 1:
        return kernel
    in_layouts = tuple(in_layouts)

    def wrapped(*arrays):
        if len(arrays) != len(in_layouts) or any(np.ndim(x) != len(l) for x, l in zip(arrays, in_layouts)):
            raise ValueError(f"arrays of shapes {[np.shape(x) for x in arrays]} do not match layouts {in_layouts}")
        batch = [np.shape(x)[l.index("B")] for x, l in zip(arrays, in_layouts) if "B" in l]
        heads = [np.shape(x)[l.index("H")] for x, l in zip(arrays, in_layouts) if "H" in l]
        bspec = logical_to_spec(["batch"], mesh, batch[:1])[0] if batch else None
        t = mesh.shape["tensor"]
        hspec = "tensor" if t > 1 and heads and all(h % t == 0 for h in heads) else None
        if bspec is None and hspec is None:
            return kernel(*arrays)

        def spec(layout: str) -> P:
            return P(*(bspec if c == "B" else hspec if c == "H" else None for c in layout))

        out_specs = spec(out_layouts) if isinstance(out_layouts, str) else tuple(spec(l) for l in out_layouts)
        fn = jax.shard_map(kernel, mesh=mesh, in_specs=tuple(spec(l) for l in in_layouts), out_specs=out_specs,
                           check_vma=False)
        return fn(*arrays)

    return wrapped


def shard_over_batch(fn: Callable, mesh: Mesh | None = None) -> Callable:
    """Wraps a row-wise `fn(*arrays) -> arrays` (all `[B, ...]`) in shard_map over the batch axes.

    For ops SPMD partitions badly, e.g. `lax.top_k`, which it computes after all-gathering
    the batch. Other dims are gathered per device. No-op without an active multi-device mesh
    or when the batch does not split.
    """
    mesh = mesh or _ACTIVE_MESH.get()
    if mesh is None or mesh.size == 1:
        return fn

    def wrapped(*arrays):
        bspec = logical_to_spec(["batch"], mesh, (arrays[0].shape[0],))[0]
        if bspec is None:
            return fn(*arrays)
        spec = P(bspec)
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec, check_vma=False)(*arrays)

    return wrapped


def per_device_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) under `shardings`."""
    total = 0
    is_sharding = lambda z: isinstance(z, jax.sharding.Sharding)  # noqa: E731
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings, is_leaf=is_sharding)):
        shard = s.shard_shape(tuple(x.shape)) if hasattr(s, "shard_shape") else x.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


MULTI_HOST_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                  "MEGASCALE_NUM_SLICES", "TPU_WORKER_HOSTNAMES")


def multi_host_detected() -> bool:
    """True when the environment looks like one process of a multi-process job."""
    for name in MULTI_HOST_ENV:
        value = os.environ.get(name)
        if value is None:
            continue
        if name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
            if value.isdigit() and int(value) > 1:
                return True
        elif value:
            return True
    return False


def maybe_initialize_distributed(mode: str = "auto") -> bool:
    """`jax.distributed.initialize()` for mode "on", or "auto" when multi-host is detected."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"distributed mode must be auto | on | off, got {mode!r}")
    if mode == "off" or (mode == "auto" and not multi_host_detected()):
        return False
    jax.distributed.initialize()
    return True


__all__ = [
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "PARAM_LOGICAL_AXES",
    "activate",
    "batch_sharding",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "maybe_initialize_distributed",
    "multi_host_detected",
    "param_logical_axes",
    "param_shardings",
    "per_device_bytes",
    "shard_over_batch",
    "shard_kernel",
    "state_shardings_like",
]
