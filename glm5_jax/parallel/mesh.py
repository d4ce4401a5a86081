"""The device mesh from the config: named axes pipeline, data, fsdp, context, expert, tensor.

    config.mesh = dict(pipeline=1, data=-1, fsdp=1, context=1, expert=1, tensor=1)

Sizes multiply to the device count; one size may be -1 to take what is left. The axis order puts
`tensor` innermost (the fastest links: NVLink within a node, neighbouring TPU chips) and
`pipeline` outermost (the least traffic). `context` splits each sequence (context parallelism:
glm5_jax/parallel/sharding.py maps the logical `length` axis to it); it sits inside the batch
axes and outside `expert` and `tensor`. Multi-process runs join JAX's runtime first
(glm5_jax/parallel/distributed.py); the mesh then spans every process's devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

MESH_AXES = ("pipeline", "data", "fsdp", "context", "expert", "tensor")


class MeshError(ValueError):
    """The mesh does not fit the devices or the model; the message says why."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    pipeline: int = 1
    data: int = -1
    fsdp: int = 1
    context: int = 1
    expert: int = 1
    tensor: int = 1

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> MeshSpec:
        values = dict(values.to_dict() if hasattr(values, "to_dict") else (values or {}))
        unknown = sorted(set(values) - set(MESH_AXES))
        if unknown:
            raise MeshError(f"unknown mesh axis {', '.join(unknown)}; the axes are {MESH_AXES}")
        for name, size in values.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise MeshError(f"mesh.{name} must be a positive integer or -1, got {size!r}")
        if list(values.values()).count(-1) > 1:
            raise MeshError("at most one mesh axis may be -1 (fill)")
        if "data" not in values and -1 in values.values():
            values["data"] = 1
        return cls(**values)

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """'data=2,expert=4' -> MeshSpec (axes not named keep their defaults)."""
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, size = item.partition("=")
            try:
                values[name.strip()] = int(size)
            except ValueError:
                raise MeshError(f"bad mesh entry {item!r}; expected axis=size, "
                                "e.g. data=2,expert=4") from None
        return cls.from_dict(values)

    def sizes_given(self) -> tuple[int, ...]:
        """The sizes as written (-1 = fill), in MESH_AXES order."""
        return tuple(getattr(self, name) for name in MESH_AXES)

    def sizes(self, device_count: int) -> dict[str, int]:
        """Axis sizes with -1 resolved; raises MeshError unless they multiply to device_count."""
        sizes = {name: getattr(self, name) for name in MESH_AXES}
        known = math.prod(size for size in sizes.values() if size != -1)
        if -1 in sizes.values():
            if device_count % known:
                raise MeshError(f"cannot fill the -1 mesh axis: {device_count} devices are not "
                                f"divisible by the other axes' product {known}")
            sizes = {name: (device_count // known if size == -1 else size) for name, size in sizes.items()}
        product = math.prod(sizes.values())
        if product != device_count:
            shown = ", ".join(f"{name}={size}" for name, size in sizes.items())
            raise MeshError(f"mesh axes multiply to {product} ({shown}) but there are {device_count} devices")
        return sizes


def check_divisible(sizes: Mapping[str, int], requirements: Mapping[str, Mapping[str, int]]) -> None:
    """Raises MeshError when a quantity is not divisible by the mesh axis it is split over.
    requirements: {axis: {name: value}}, e.g. {"expert": {"num_experts": 8}} (the model's
    `glm5_jax.model.config.mesh_requirements`)."""
    for axis, quantities in requirements.items():
        size = sizes[axis]
        for name, value in quantities.items():
            if size > 1 and value % size:
                raise MeshError(f"{name}={value} is not divisible by the {axis} axis ({size})")


def make_mesh(spec: MeshSpec, requirements: Mapping[str, Mapping[str, int]] | None = None,
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A Mesh over `devices` (default: all) with axes MESH_AXES, checked against `requirements`
    (check_divisible)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = spec.sizes(len(devices))
    if requirements is not None:
        check_divisible(sizes, requirements)
    shape = tuple(sizes[name] for name in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def axes_across_processes(mesh: jax.sharding.Mesh, owner=None) -> tuple[list[str], list[str]]:
    """(the mesh axes whose device groups span processes (hosts): their collectives travel
    between hosts, the axes of more than one device that stay inside one). owner(device) -> its
    process (default: device.process_index; a plan of fake devices passes its own host map)."""
    owner = owner or (lambda device: device.process_index)
    owners = np.vectorize(owner)(mesh.devices)
    across = [name for axis, name in enumerate(mesh.axis_names)
              if mesh.devices.shape[axis] > 1 and (np.diff(owners, axis=axis) != 0).any()]
    within = [name for axis, name in enumerate(mesh.axis_names)
              if mesh.devices.shape[axis] > 1 and name not in across]
    return across, within
