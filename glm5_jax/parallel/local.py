"""Running a per-device computation (a Pallas kernel) on each device's own shard.

A pallas_call has no SPMD partitioning rule: under a sharded jit its operands would be gathered
and the kernel run whole on every device. `run_local` wraps such a call in jax.shard_map over the
mesh axes its operands are split on (from logical axis names and the rules in context), so each
device runs the kernel on its local slice. Without a mesh in context it just calls the function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from glm5_jax.parallel.logical import mesh_axes


class Merged(tuple):
    """An axis that flattens several logical axes and is split like them, in order: tokens
    [B*T] from [B, T] are Merged(("batch", "length"))."""


# One entry per array axis: a logical name, None (whole), or Merged logical names.
LogicalAxes = Sequence[str | Merged | None]


def _names(entry) -> tuple:
    return tuple(entry) if isinstance(entry, Merged) else (entry,)


def _mesh_spec(mesh, axes: LogicalAxes, whole=frozenset()) -> P:
    """Logical axes -> a PartitionSpec over the mesh's non-manual axes of size > 1; the logical
    entries in `whole` stay unsplit."""
    usable = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
              if kind != jax.sharding.AxisType.Manual and mesh.shape[name] > 1}
    mapped = iter(nn.logical_to_mesh_axes(tuple(name for entry in axes for name in _names(entry))))
    entries = []
    for entry in axes:
        names = ()
        for _ in _names(entry):
            target = next(mapped)
            names += mesh_axes(target)
        names = () if entry in whole else tuple(name for name in names if name in usable)
        entries.append(names if len(names) > 1 else (names[0] if names else None))
    return P(*entries)


def _undivided(mesh, args, in_axes) -> frozenset:
    """Logical entries some argument's axis is too short to split as the rules ask (a pipeline
    microbatch of one row over several batch devices): those stay whole everywhere."""
    whole = set()
    for x, axes in zip(args, in_axes, strict=True):
        for size, entry, split in zip(x.shape, axes, _mesh_spec(mesh, axes), strict=True):
            names = mesh_axes(split)
            if size % math.prod(mesh.shape[name] for name in names):
                whole.add(entry)
    return frozenset(whole)


def _used_axes(spec: P) -> set[str]:
    used = set()
    for entry in spec:
        used.update(mesh_axes(entry))
    return used


def run_local(fn: Callable, args: Sequence, in_axes: Sequence[LogicalAxes], out_axes):
    """fn(*args) with each argument split by its logical axes (in_axes, one tuple per argument)
    and the result (out_axes: a logical-axes tuple, or a tuple of them for several outputs)
    assembled the same way. Axes not named, and logical axes some argument cannot split evenly,
    stay whole on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*args)
    whole = _undivided(mesh, args, in_axes)
    in_specs = tuple(_mesh_spec(mesh, axes, whole) for axes in in_axes)
    several = bool(out_axes) and not isinstance(out_axes[0], str | Merged | type(None))
    out_specs = (tuple(_mesh_spec(mesh, axes, whole) for axes in out_axes) if several
                 else _mesh_spec(mesh, out_axes, whole))
    used = set().union(*(_used_axes(spec) for spec in in_specs))
    if not used:
        return fn(*args)
    # Every free axis manual (not only the split ones): the call then also lowers under
    # jax.vmap(spmd_axis_name=...) (train/step.py's per-replica gradients), and a kernel is never
    # auto-partitioned along an axis it does not split (a pallas_call cannot be on a GPU or TPU).
    free = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if kind != jax.sharding.AxisType.Manual}
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=free,
                         check_vma=False)(*args)
