"""Logical-axis sharding rules and the placement of params, optimizer state and batches.

The model names every weight and activation axis logically (glm5_jax.parallel.logical); the
rules below map those names to mesh axes. A mesh axis is used at most once per array: Flax
takes the rules in table order and skips one whose mesh axes are already taken, so activations
[batch, length, embed] shard over the batch axes and `context` only, while weights [embed, ...]
shard embed over fsdp and context.

    batch   -> (data, fsdp, expert)   data parallel outside the experts, token owners inside
    length  -> context                context parallelism: each device holds a slice of every
                                      sequence; attention all-gathers the small per-token keys
                                      (MLA latent + rope key, indexer keys) over it (model/mla.py)
    embed, q_lora, kv_lora -> (fsdp, context)   FSDP: weights and optimizer state split, gathered
                                      per use (a weight's first such axis takes them); the context
                                      devices work on different tokens, so they share the split
    heads, index_heads, mlp, vocab -> tensor   (Megatron-style tensor parallelism)
    experts -> expert                 expert parallelism (shard_map + all_to_all in the MoE)
    layers  -> pipeline               each pipeline stage stores its own layers
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.parallel.logical import AXIS_NAMES
from glm5_jax.parallel.mesh import MESH_AXES
from glm5_jax.quant.formats import QuantizedTensor

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "context"),
    ("layers", "pipeline"),
    ("prefix_layers", None),
    ("vocab", "tensor"),
    ("embed", ("fsdp", "context")),
    ("embed_concat", None),
    ("heads", "tensor"),
    ("index_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("q_lora", ("fsdp", "context")),
    ("kv_lora", ("fsdp", "context")),
    ("head_dim", None),
    ("norm", None),
)


def make_rules(overrides: Mapping[str, str | Sequence[str] | None] | None = None) -> Rules:
    """DEFAULT_RULES with some logical axes remapped (config.sharding_rules), validated."""
    overrides = dict(overrides.to_dict() if hasattr(overrides, "to_dict") else (overrides or {}))
    for name, target in overrides.items():
        if name not in AXIS_NAMES:
            raise ValueError(f"sharding_rules: unknown logical axis {name!r}; known: {sorted(AXIS_NAMES)}")
        targets = (target,) if isinstance(target, str) or target is None else tuple(target)
        bad = [t for t in targets if t is not None and t not in MESH_AXES]
        if bad:
            raise ValueError(f"sharding_rules.{name}: unknown mesh axis {bad[0]!r}; "
                             f"mesh axes are {MESH_AXES}")
    rules = []
    for name, target in DEFAULT_RULES:
        if name in overrides:
            target = overrides[name]
            target = tuple(target) if isinstance(target, list | tuple) else target
        rules.append((name, target))
    return tuple(rules)


# Serving: a step's tokens (a few decode rows, prefill chunks: counts no mesh axis divides) stay
# whole on every device, while the weights split as in training (heads, mlp, vocab over tensor;
# experts over expert).
SERVING_RULES: Rules = make_rules({"batch": None, "length": None})


@contextlib.contextmanager
def activate(mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES):
    """Within: activation constraints and the expert-parallel MoE see `mesh` and `rules`.
    Trace (first call of a jitted function) inside this context."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def logical_sharding(mesh: jax.sharding.Mesh, rules: Rules, axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(axes), rules))


def param_shardings(logical_axes, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES):
    """NamedSharding for every parameter, from its logical axis names (a tree of PartitionSpecs of
    names: the model's `param_logical_axes(config)`)."""
    specs = logical_axes
    return jax.tree.map(lambda spec: NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(spec), rules)),
                        specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def serving_param_shardings(logical_axes, mesh: jax.sharding.Mesh, params=None):
    """Shardings of served weights (SERVING_RULES), shaped like `params` (arrays or
    ShapeDtypeStructs; None = float weights). A quantized weight (QuantizedTensor: values are
    [leading..., in, out] matrices) splits its values over the mesh axes of the weight's leading
    axes (layers, experts) and of its outermost contraction and output axes, so a split of the
    flattened axis keeps whole heads or hidden units together; its scales follow the leading
    axes and are otherwise whole (1/16384 of the values for 128x128 blocks)."""
    weights = param_shardings(logical_axes, mesh, SERVING_RULES)
    if params is None:
        return weights

    def place(sharding: NamedSharding, leaf):
        if not isinstance(leaf, QuantizedTensor):
            return sharding
        spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
        lead = leaf.values.ndim - 2
        values = PartitionSpec(*spec[:lead], spec[lead], spec[lead + len(leaf.in_shape)])
        leading = NamedSharding(mesh, PartitionSpec(*spec[:lead]))
        return leaf.replace(values=NamedSharding(mesh, values), scales=leading,
                            tensor_scale=None if leaf.tensor_scale is None else leading)

    return jax.tree.map(place, weights, params)


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params_abstract,
                              params_sharding, mesh: jax.sharding.Mesh):
    """Shardings of optimizer.init(params): a moment follows the parameter it mirrors (the
    trailing dict keys of its path name a parameter of the same shape), the rest replicates."""
    state_abstract = jax.eval_shape(optimizer.init, params_abstract)
    by_path = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params_abstract):
        by_path[tuple(k.key for k in path)] = leaf.shape
    shardings = {tuple(k.key for k in path): sharding
                 for path, sharding in jax.tree_util.tree_leaves_with_path(params_sharding)}

    def place(path, leaf):
        keys = []
        for entry in reversed(path):
            if not isinstance(entry, jax.tree_util.DictKey):
                break
            keys.insert(0, entry.key)
        keys = tuple(keys)
        if keys in by_path and by_path[keys] == leaf.shape:
            return shardings[keys]
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(place, state_abstract)


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """A [B, T] batch field: rows split over the batch axes, positions over `context`."""
    return logical_sharding(mesh, rules, ("batch", "length"))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def bytes_per_device(abstract_tree, sharding_tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs placed with these shardings."""
    return sum(math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(sharding_tree),
                                         strict=True))
