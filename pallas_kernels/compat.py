"""What differs between the JAX versions we support (jax 0.10.x – 0.12.x), in one place.

- Lowering for CUDA without a GPU. Since jax 0.11 the Pallas Triton lowering reads the
  compute capability of the device it lowers for: from the abstract mesh's `AbstractDevice`
  if one is set, else from the default device, and a CPU raises "No supported GPU devices
  found". jax 0.10.x assumes compute capability 9.0 when there is no GPU.
  `abstract_gpu_device()` sets an H100 (sm_90) as the target on every version (a no-op on
  0.10.x) and `export_for_cuda` exports a function for CUDA under it.
- Deviceless compilation for an H100 (`compile_for_gpu`): XLA's own GPU compiler, from the
  `jax-cuda12-plugin` wheel, compiles the kernels' Triton IR to PTX and runs `ptxas`, so
  shared-memory and register overflows show up on a CPU-only machine. Its target is a
  `GpuTargetConfigProto` text; the one in `tests/data/` parses on jaxlib 0.10 and 0.12.
- Mosaic GPU. `jax.experimental.pallas.mosaic_gpu` imports on every supported version, but
  its GPU interpret mode (`InterpretGPUParams`, which runs a Mosaic GPU kernel on CPU)
  exists from jax 0.11 on: `mosaic_gpu_interpret_params` says why it cannot run before.
  `plgpu.kernel` takes `out_type=`/`scratch_types=` on every version from 0.10.2, the floor
  (0.10.0/0.10.1 take only the older `out_shape=`), so the kernels use those. `plgpu.load` needs an index on jax
  0.10, takes an optional one on 0.11 and none on 0.12: `mosaic_load` hides it.
- jax 0.11 deprecates the Pallas Triton backend (warning id `jax-pallas-triton`, a
  `DeprecationWarning` at each lowering, hidden outside `__main__` by Python's defaults);
  it still works on 0.11 and 0.12. `pallas_kernels.mosaic_attention` is the path that survives it.

Nothing outside this module tests the JAX version.
"""

from __future__ import annotations

import contextlib
import inspect

import jax
from jax.experimental import topologies

try:  # Mosaic GPU ships with every jaxlib we support; guarded so a trimmed build still imports
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None
try:  # its GPU interpret mode (jax >= 0.11): where jax 0.11 records the races it finds
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _mgpu_interpret
except ImportError:  # jax 0.10, or a trimmed build
    _mgpu_interpret = None

JAX_VERSION = tuple(jax.__version_info__[:3])

# Custom-call targets a CUDA export of a kernel may contain. Pallas' Triton path emits
# "__gpu$xla.gpu.triton" (Triton IR handed to XLA) on jaxlib 0.10–0.12, the "triton_kernel_call"
# names on builds that compile the kernel at lowering time; Mosaic GPU emits "mosaic_gpu_v2".
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "triton_kernel_call_ffi")
MOSAIC_GPU_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu")
KERNEL_TARGETS = TRITON_TARGETS + MOSAIC_GPU_TARGETS

# The GPU the recipes are sized for: compute capability 9.0 (sm_90), 132 SMs.
DEFAULT_DEVICE_KIND = "NVIDIA H100"
H100_NUM_CORES = 132

# jax >= 0.11 lowers Pallas-Triton kernels for the compute capability of an explicit device.
NEEDS_ABSTRACT_GPU = JAX_VERSION >= (0, 11)


@contextlib.contextmanager
def abstract_gpu_device(device_kind: str = DEFAULT_DEVICE_KIND, num_cores: int = H100_NUM_CORES):
    """Within it, kernels lower for `device_kind` (e.g. "NVIDIA H100", "NVIDIA A100") on any host.

    Known kinds map to a compute capability inside jax ("NVIDIA H100"/"H200" -> 9.0, A100 ->
    8.0, B200 -> 10.0). The abstract mesh has no axes: it only carries the device, so it does
    not change how anything is sharded. A no-op on jax 0.10.x, which lowers for 9.0 by itself.
    """
    if not NEEDS_ABSTRACT_GPU:
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield


def export_for_cuda(fn, *args, device_kind: str = DEFAULT_DEVICE_KIND, **kwargs) -> jax.export.Exported:
    """`jax.export` of `jit(fn)(*args, **kwargs)` for CUDA, on a machine with or without a GPU.

    args: arrays or `jax.ShapeDtypeStruct`s. The kernels' custom calls are allowed (they are
    not in jax's list of stable targets). The result's `mlir_module()` names the kernels.
    """
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_TARGETS]
    exporter = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)
    with abstract_gpu_device(device_kind):  # the lowering runs inside the exporter's call
        return exporter(*args, **kwargs)


def compile_for_gpu(fn, *avals, target_config: str, topology: str = "1x1x1",
                    device_kind: str = DEFAULT_DEVICE_KIND, fail_on_register_spill: bool = False):
    """Compiles `jit(fn)` for one GPU described by `target_config`, with no GPU present.

    XLA's GPU compiler (the jax-cuda12-plugin) runs its pinned Triton on the kernels' IR,
    emits PTX for the target's compute capability and assembles it with `ptxas` (found on
    PATH, in /usr/local/cuda or in the nvidia-cuda-nvcc wheel). A kernel whose tiles need
    more shared memory than the GPU has fails with RESOURCE_EXHAUSTED; with
    `fail_on_register_spill`, one whose registers spill fails with CANCELLED. It compiles at
    XLA's default backend optimization level (3) whatever `XLA_FLAGS` says: at -O0 (which the
    test suite sets for fast CPU compiles) the same kernels spill.

    avals: `jax.ShapeDtypeStruct`s. target_config: a `stream_executor.GpuTargetConfigProto`
    in text form. Set `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` (or JAX_PLATFORMS=cpu) before jax
    starts, or a host without CUDA libraries logs that cuDNN cannot be loaded.
    Returns the compiled executable (`as_text()`, `memory_analysis()`).
    """
    topo = topologies.get_topology_desc("gpu_aot", platform="cuda", target_config=target_config,
                                        topology=topology)
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
    with abstract_gpu_device(device_kind):
        lowered = jax.jit(fn).trace(*args).lower()
    options = {"xla_backend_optimization_level": 3}
    if fail_on_register_spill:
        options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = True
    return lowered.compile(compiler_options=options)


def mosaic_gpu_interpret_params(**kwargs):
    """`plgpu.InterpretGPUParams(**kwargs)`: runs a Mosaic GPU kernel on CPU (jax >= 0.11).

    Raises NotImplementedError naming the reason on a jax without the GPU interpret mode.
    """
    reason = mosaic_gpu_interpret_unavailable()
    if reason:
        raise NotImplementedError(reason)
    if "on_race" in kwargs and "on_race" not in inspect.signature(plgpu.InterpretGPUParams).parameters:
        kwargs.pop("on_race")  # jax 0.11 records races instead (mosaic_gpu_races_found)
    return plgpu.InterpretGPUParams(**kwargs)


def mosaic_gpu_races_found() -> bool:
    """Whether the last Mosaic GPU kernel interpreted with `detect_races=True` found a race.

    jax >= 0.12 raises at the race with `on_race="raise"`; jax 0.11 only prints it and sets a flag
    in its (private) interpreter state, read here.
    """
    if _mgpu_interpret is None:  # no GPU interpret mode: nothing was interpreted
        return False
    try:
        return bool(_mgpu_interpret.get_races().races_found)
    except AssertionError:  # no kernel ran with race detection since start-up
        return False


def mosaic_gpu_interpret_unavailable() -> str | None:
    """None where Mosaic GPU kernels can run in interpret mode on CPU, else why not."""
    if plgpu is None:
        return f"jax {jax.__version__} has no Mosaic GPU module"
    if not hasattr(plgpu, "InterpretGPUParams"):
        return f"Mosaic GPU interpret mode needs jax >= 0.11 (this is jax {jax.__version__})"
    return None


def mosaic_load(ref, layout):
    """`plgpu.load` of all of `ref` (GMEM or SMEM) into registers with `layout`, on every jax."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


_LOAD_TAKES_INDEX = plgpu is not None and "idx" in inspect.signature(plgpu.load).parameters


def is_hopper_or_later(device) -> bool:
    """Whether `device` is an NVIDIA GPU with compute capability >= 9.0 (what Mosaic GPU targets)."""
    capability = getattr(device, "compute_capability", None)
    try:
        return device.platform == "gpu" and float(capability) >= 9.0
    except (TypeError, ValueError):
        return False


__all__ = ["DEFAULT_DEVICE_KIND", "JAX_VERSION", "KERNEL_TARGETS", "MOSAIC_GPU_TARGETS", "TRITON_TARGETS",
           "abstract_gpu_device", "compile_for_gpu", "export_for_cuda", "is_hopper_or_later",
           "mosaic_gpu_interpret_params", "mosaic_gpu_interpret_unavailable", "mosaic_gpu_races_found", "mosaic_load",
           "plgpu"]
