"""Pipeline parallelism: the MoE layer stack split into stages over the mesh's `pipeline` axis,
run with a GPipe schedule inside jax.shard_map.

Stage s holds layers [s*L/P, (s+1)*L/P) (the stack's layer axis is sharded over `pipeline`).
The batch is cut into M microbatches. At step i (0 <= i < M + P - 1) stage s runs its layers on
microbatch i - s, then every stage passes its activations to the next with one ppermute
(collective-permute). Stage 0 reads fresh microbatches, the last stage keeps finished ones.
Bubble fraction (idle stage-steps): (P - 1) / (M + P - 1). Autodiff of the schedule gives the
backward pass (ppermute transposes to the reverse permutation).

Only the pipeline axis is manual inside; data/fsdp/expert/tensor sharding of each stage's work
stays automatic (and the expert-parallel MoE nests its own shard_map over those axes). The
embedding, the dense prefix, the head and the MTP layer run outside the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

PIPELINE_AXIS = "pipeline"
# How a per-layer sown value combines over microbatches.
COMBINE = {"expert_load": "sum", "dropped_tokens": "sum", "balance_loss": "mean", "selection_gap": "min"}


def pipeline_stages() -> int:
    """Stages of the context mesh's pipeline axis (1 without a mesh or axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or PIPELINE_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[PIPELINE_AXIS]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Fraction of stage-steps a GPipe schedule leaves idle."""
    return (stages - 1) / (microbatches + stages - 1)


def default_microbatches(stages: int, batch: int, requested: int) -> int:
    """requested if > 0, else the largest of 4*stages, 2*stages, stages, 1 dividing the batch."""
    if requested > 0:
        if batch % requested:
            raise ValueError(f"pipeline_microbatches={requested} does not divide the batch ({batch} rows)")
        return requested
    for count in (4 * stages, 2 * stages, stages, 1):
        if batch % count == 0:
            return count
    return 1


def _to_microbatches(x: jax.Array, count: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]; microbatch m holds rows m, m+M, ... (keeps the row sharding)."""
    return jnp.swapaxes(x.reshape((x.shape[0] // count, count) + x.shape[1:]), 0, 1)


def _from_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of _to_microbatches. [M, B/M, ...] -> [B, ...]."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _combine(name: str, total, value, valid):
    rule = COMBINE.get(name, "sum")
    if rule == "min":
        return jnp.where(valid, jnp.minimum(total, value), total)
    return total + jnp.where(valid, value, jnp.zeros_like(value))


def _init_total(name: str, value):
    """The neutral start of a COMBINE reduction (the sown values are float)."""
    return jnp.full_like(value, jnp.inf) if COMBINE.get(name, "sum") == "min" else jnp.zeros_like(value)


def run_pipeline(layer_fn: Callable, stack_params, carry, positions, segment_ids, layer_flags,
                 *, microbatches: int):
    """Runs a stack of layers as a pipeline over the context mesh's `pipeline` axis.

    layer_fn(layer_params, carry, positions, segment_ids, flags) -> (carry, sown) for ONE layer,
    where sown is a flat {name: value} dict of that layer's diagnostics.
    stack_params: leaves [L, ...]; carry: (x [B, T, D], indices [B, T, k]); positions,
    segment_ids: [B, T]; layer_flags: pytree of [L] per-layer flags.
    Returns (carry, sown) with sown values stacked per layer [L, ...] and combined over
    microbatches (COMBINE).
    """
    mesh = jax.sharding.get_abstract_mesh()
    stages = mesh.shape[PIPELINE_AXIS]
    count = microbatches
    inputs = jax.tree.map(lambda a: _to_microbatches(a, count), (carry, positions, segment_ids))
    steps = count + stages - 1
    perm = [(s, (s + 1) % stages) for s in range(stages)]

    def stage_layers(params, flags, carry, positions, segment_ids):
        def one(carry, layer):
            layer_params, layer_flag = layer
            return layer_fn(layer_params, carry, positions, segment_ids, layer_flag)
        return jax.lax.scan(one, carry, (params, flags))

    def body(params, flags, inputs):
        (x_mb, idx_mb), pos_mb, seg_mb = inputs
        stage = jax.lax.axis_index(PIPELINE_AXIS)
        first = (x_mb[0], idx_mb[0])
        _, sown_shape = jax.eval_shape(stage_layers, params, flags, first, pos_mb[0], seg_mb[0])
        totals = {name: _init_total(name, jnp.zeros(s.shape, s.dtype)) for name, s in sown_shape.items()}
        outputs = jax.tree.map(jnp.zeros_like, (x_mb, idx_mb))

        def step(state, i):
            current, outputs, totals = state
            mine = i - stage  # the microbatch this stage works on at step i
            valid = (mine >= 0) & (mine < count)
            index = jnp.clip(mine, 0, count - 1)
            fresh = jax.tree.map(lambda a: a[jnp.clip(i, 0, count - 1)], (x_mb, idx_mb))
            current = jax.tree.map(lambda f, c: jnp.where(stage == 0, f, c), fresh, current)
            result, sown = stage_layers(params, flags, current, pos_mb[index], seg_mb[index])
            finished = valid & (stage == stages - 1)
            outputs = jax.tree.map(
                lambda out, r: out.at[index].set(jnp.where(finished, r, out[index])), outputs, result)
            totals = {name: _combine(name, totals[name], sown[name], valid) for name in totals}
            passed = jax.tree.map(lambda r: jax.lax.ppermute(r, PIPELINE_AXIS, perm), result)
            return (passed, outputs, totals), None

        (_, outputs, totals), _ = jax.lax.scan(step, (first, outputs, totals), jnp.arange(steps))
        # Only the last stage holds the results: sum over stages (the others contribute zeros).
        is_last = (stage == stages - 1)
        outputs = jax.tree.map(
            lambda o: jax.lax.psum(jnp.where(is_last, o, jnp.zeros_like(o)), PIPELINE_AXIS), outputs)
        totals = {name: (value / count if COMBINE.get(name, "sum") == "mean" else value)
                  for name, value in totals.items()}
        return outputs, totals

    layers_spec = P(PIPELINE_AXIS)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(layers_spec, layers_spec, P()),
                            out_specs=(P(), layers_spec), axis_names={PIPELINE_AXIS}, check_vma=False)
    outputs, sown = sharded(stack_params, layer_flags, inputs)
    return jax.tree.map(_from_microbatches, outputs), sown
