"""Logical axis names (one glossary) and the activation constraint helper."""

from __future__ import annotations

import math

import flax.linen as nn
import jax

# Logical axis name -> what it indexes. Weights and activations use only these names.
AXIS_NAMES = {
    "layers": "stacked MoE decoder layers (the scan axis; split into pipeline stages)",
    "prefix_layers": "stacked dense-prefix decoder layers (the scan axis; never pipelined)",
    "vocab": "vocabulary entries",
    "embed": "model width (hidden_size)",
    "embed_concat": "the MTP head's input, [embedding, hidden] concatenated (2 x hidden_size)",
    "q_lora": "query low-rank latent",
    "kv_lora": "key/value latent (plus the shared rope key)",
    "heads": "attention heads",
    "head_dim": "per-head feature dimension",
    "index_heads": "DSA indexer heads",
    "mlp": "feed-forward hidden units",
    "experts": "routed experts",
    "norm": "a norm's feature axis",
    "batch": "sequences in a batch",
    "length": "sequence positions",
}


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint on an activation by logical axis names (no-op without rules)."""
    return nn.with_logical_constraint(x, axes)


def mesh_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """One entry of a PartitionSpec or a rules target (a mesh axis name, several, or None) as a
    tuple of mesh axis names."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def shards(axis: str) -> int:
    """How many ways the rules and mesh in context split logical `axis` (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    names = mesh_axes(nn.logical_to_mesh_axes((axis,))[0])
    return math.prod(mesh.shape[name] for name in names if name in mesh.axis_names)
