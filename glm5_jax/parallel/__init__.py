"""Sharding vocabulary: the logical axis names carried by weights and activations.

The model annotates weights with these names and calls `constrain` on activations; which mesh
axis each name maps to is decided outside the model (a rules table), so the math never mentions
devices. With no rules in context `constrain` is a no-op.
"""

from glm5_jax.parallel.logical import AXIS_NAMES, constrain

__all__ = ["AXIS_NAMES", "constrain"]
