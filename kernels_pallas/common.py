"""What every kernel module shares: backend choice, pallas_call arguments, lowering for a
platform, and the benchmark-case record bench/kernels.py iterates over.

Backends: "interpret" (Pallas interpreter: any platform, the CPU default), "triton" (NVIDIA
GPUs, the `__gpu$xla.gpu.triton` custom call) and "mosaic_tpu" (TPUs, `tpu_custom_call`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

BACKENDS = ("interpret", "triton", "mosaic_tpu")
# The custom call each compiled backend leaves in the lowered module.
CUSTOM_CALL_MARKERS = {"triton": "__gpu$xla.gpu.triton", "mosaic_tpu": "tpu_custom_call"}
# Lowering platform of each compiled backend.
LOWERING_PLATFORMS = {"triton": "cuda", "mosaic_tpu": "tpu"}
# The chip lower_as_text targets on a machine without one of that platform, as the
# jax.sharding.AbstractDevice (device kind, cores, platform) the lowering reads (see
# _lowering_target): Mosaic takes the TPU's tiling and memory sizes from it, Triton the GPU's
# compute capability.
LOWERING_DEVICES = {"triton": ("NVIDIA H200", 132, "gpu"), "mosaic_tpu": ("TPU v5 lite", 1, "tpu")}
# Dense bf16 tensor-core peak and HBM bandwidth of the chips we report fractions against.
PEAKS = {"H200": {"bf16_tflops": 989.0, "hbm_gbs": 4800.0}}


def resolve_backend(backend: str | None) -> str:
    """None picks from the default device: cpu -> interpret, gpu -> triton, tpu -> mosaic_tpu."""
    if backend is None:
        platform = jax.default_backend()
        return {"gpu": "triton", "cuda": "triton", "tpu": "mosaic_tpu"}.get(platform, "interpret")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def call_options(backend: str | None, *, num_warps: int = 4, num_stages: int = 2,
                 dimension_semantics: Sequence[str] | None = None) -> dict[str, Any]:
    """Keyword arguments for `pl.pallas_call` on `backend` (interpret flag + compiler params)."""
    backend = resolve_backend(backend)
    if backend == "interpret":
        return {"interpret": True}
    if backend == "triton":
        return {"compiler_params": pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    semantics = tuple(dimension_semantics) if dimension_semantics is not None else None
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=semantics)}


def lower_as_text(fn: Callable, *args, backend: str) -> str:
    """StableHLO text of `jax.jit(fn)(*args)` lowered for `backend`'s platform on this machine.

    args may be ShapeDtypeStructs; nothing runs. Used by the lowering tests to prove a kernel
    compiles to the Triton or Mosaic custom call without the hardware.
    """
    platform = LOWERING_PLATFORMS[backend]
    with _lowering_target(backend):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _lowering_target(backend: str):
    """Context naming the chip `backend` lowers for when this machine has no device of its kind.

    Pallas asks for the target chip while lowering: Mosaic through `tpu_info.get_tpu_info()` (e.g.
    in `run_scoped`, behind `pltpu.sync_copy`), Triton (jax 0.11) through `gpu_info.get_gpu_info()`
    for the compute capability. Both read the device kind of the current abstract mesh's
    `abstract_device`, else of the default device, and jax 0.11 raises for a default device of
    another kind ("Unsupported TPU device kind: NVIDIA H200", "No supported GPU devices found" on
    a CPU). So the chip is named by an empty `AbstractMesh` carrying an `AbstractDevice` (no mesh
    axes: nothing else about the trace changes); jax 0.10.2 reads the same hook. On a machine of
    the backend's own kind, or a jax without `AbstractDevice`, the default device is used.
    """
    sharding = jax.sharding
    own_platform = {"triton": "gpu", "mosaic_tpu": "tpu"}[backend]
    if jax.default_backend() == own_platform or not hasattr(sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    kind, cores, platform = LOWERING_DEVICES[backend]
    device = sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
    try:
        mesh = sharding.AbstractMesh((), (), abstract_device=device)
    except TypeError:  # an AbstractMesh that cannot carry a device: nothing to name it with
        return contextlib.nullcontext()
    return sharding.use_abstract_mesh(mesh)


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One benchmark row: the same inputs through the jnp reference and the Pallas kernel.

    make_inputs(key) -> tuple of arrays; reference(*inputs) and kernel(*inputs) return arrays
    (or pytrees) to compare with atol/rtol. flops and bytes_moved describe one kernel call, for
    TFLOP/s and GB/s. compare_as(inputs, output) -> pytree, when set, maps each output to what is
    compared (e.g. a top-k selection to the scores it selected, where float rounding may
    legitimately swap near-tied indices); it is not timed.
    """

    name: str
    make_inputs: Callable[[jax.Array], tuple]
    reference: Callable
    kernel: Callable
    flops: float
    bytes_moved: float
    atol: float = 2e-2
    rtol: float = 2e-2
    compare_as: Callable[[tuple, Any], Any] | None = None
