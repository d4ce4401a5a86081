"""Running a per-device computation (a Pallas kernel) on each device's own shard.

A pallas_call has no SPMD partitioning rule: under a sharded jit its operands would be gathered
and the kernel run whole on every device. `run_local` wraps such a call in jax.shard_map over the
mesh axes its operands are split on (from logical axis names and the rules in context), so each
device runs the kernel on its local slice. Without a mesh in context it just calls the function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

LogicalAxes = Sequence[str | None]


def _mesh_spec(mesh, axes: LogicalAxes) -> P:
    """Logical axes -> a PartitionSpec over the mesh's non-manual axes of size > 1."""
    usable = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
              if kind != jax.sharding.AxisType.Manual and mesh.shape[name] > 1}
    entries = []
    for entry in nn.logical_to_mesh_axes(tuple(axes)):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(name for name in names if name in usable)
        entries.append(names if len(names) > 1 else (names[0] if names else None))
    return P(*entries)


def _used_axes(spec: P) -> set[str]:
    used = set()
    for entry in spec:
        used.update((entry,) if isinstance(entry, str) else tuple(entry or ()))
    return used


def run_local(fn: Callable, args: Sequence, in_axes: Sequence[LogicalAxes], out_axes):
    """fn(*args) with each argument split by its logical axes (in_axes, one tuple per argument)
    and the result (out_axes: a logical-axes tuple, or a tuple of them for several outputs)
    assembled the same way. Axes not named stay whole on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*args)
    in_specs = tuple(_mesh_spec(mesh, axes) for axes in in_axes)
    several = bool(out_axes) and not isinstance(out_axes[0], str | type(None))
    out_specs = (tuple(_mesh_spec(mesh, axes) for axes in out_axes) if several
                 else _mesh_spec(mesh, out_axes))
    used = set().union(*(_used_axes(spec) for spec in in_specs))
    if not used:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=used,
                         check_vma=False)(*args)
