"""Expert parallelism: routed experts split over the mesh's `expert` axis with jax.shard_map.

Every device routes its own tokens, sends each token copy to the device that owns the chosen
expert (all_to_all over `expert`), runs its local experts on what it received, sends the results
back (a second all_to_all) and combines them with the routing weights. Expert hidden units may
also be split over `tensor` (the partial down projections are summed with psum).

Buffers have a fixed per-destination capacity C (rows one device may send to one expert shard):
    dropless (capacity_factor = 0): C = T_local * K, the worst case: the result equals the
        unsharded MoE exactly, at n_expert_shards times the buffer memory;
    capacity_factor f >= 1: C = ceil(f * T_local * K / n_expert_shards); copies beyond C are
        dropped (they contribute nothing) and counted.
`expert_dispatch="ragged_all_to_all"` sends exactly the routed rows instead (lax.ragged_all_to_all,
GPU/TPU only; XLA:CPU does not implement it).

When the tokens are not split over `expert` (serving: a step's few decode rows are replicated),
nothing needs sending: each expert shard runs the token copies routed to its own experts and
the partial outputs are summed over `expert` (one psum; dropless, whatever the capacity).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm5_jax.parallel.logical import mesh_axes

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"


def expert_mesh():
    """The context mesh when it splits experts (an `expert` axis of size > 1), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
        return None
    return mesh


def _token_axes(mesh) -> tuple[str, ...]:
    """Mesh axes the token dimension [B*T] is split over, minus manual axes: the `batch` rule's,
    then the `length` rule's (context parallelism: [B, T] flattened keeps its split)."""
    manual = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
              if kind == jax.sharding.AxisType.Manual}
    axes = []
    for entry in nn.logical_to_mesh_axes(("batch", "length")):
        axes += [a for a in mesh_axes(entry) if a in mesh.axis_names and a not in manual]
    return tuple(axes)


def capacity(tokens_local: int, top_k: int, shards: int, capacity_factor: float) -> int:
    """Rows one device may send to one expert shard."""
    worst = tokens_local * top_k
    if capacity_factor == 0:
        return worst
    return min(worst, math.ceil(capacity_factor * worst / shards))


def _local_experts(rows, local_ids, valid, gate_proj, up_proj, down_proj, local_impl):
    """Runs each received row through its local expert (invalid rows give 0). rows: [R, D]."""
    weights = valid.astype(jnp.float32)[:, None]
    experts = jnp.where(valid, local_ids, 0)[:, None]
    return local_impl(rows, weights, experts, gate_proj, up_proj, down_proj)


def _dispatch_all_to_all(x, weights, experts, gate_proj, up_proj, down_proj, *, shards, capacity_factor,
                         local_impl, tensor_split):
    """shard_map body. x: [T, D] local tokens; weights, experts: [T, K]; expert weights local
    [E/n, D, F/t] and [E/n, F/t, D]. Returns (y [T, D], dropped copies (scalar, this device))."""
    num_tokens, top_k = experts.shape
    hidden = x.shape[-1]
    local_count = gate_proj.shape[0]
    cap = capacity(num_tokens, top_k, shards, capacity_factor)

    flat_experts = experts.reshape(-1)
    destination = flat_experts // local_count
    order = jnp.argsort(destination, stable=True)
    sorted_destination = destination[order]
    per_destination = jnp.bincount(destination, length=shards)
    sent_before = jnp.cumsum(per_destination) - per_destination
    rank = jnp.arange(order.shape[0]) - sent_before[sorted_destination]  # place in its destination's buffer
    kept = rank < cap
    token_of_copy = order // top_k
    slot = jnp.where(kept, rank, cap)  # cap = out of bounds: dropped by mode="drop"
    send_rows = jnp.zeros((shards, cap, hidden), x.dtype).at[sorted_destination, slot].set(
        x[token_of_copy], mode="drop")
    send_ids = jnp.full((shards, cap), -1, jnp.int32).at[sorted_destination, slot].set(
        (flat_experts % local_count)[order], mode="drop")

    received_rows = jax.lax.all_to_all(send_rows, EXPERT_AXIS, 0, 0)  # [n, C, D] from each source
    received_ids = jax.lax.all_to_all(send_ids, EXPERT_AXIS, 0, 0)
    ids = received_ids.reshape(-1)
    out = _local_experts(received_rows.reshape(-1, hidden), ids, ids >= 0, gate_proj, up_proj, down_proj,
                         local_impl)
    if tensor_split:
        out = jax.lax.psum(out, TENSOR_AXIS)
    returned = jax.lax.all_to_all(out.reshape(shards, cap, hidden), EXPERT_AXIS, 0, 0)

    copy_weight = weights.reshape(-1)[order] * kept
    result = returned[sorted_destination, jnp.minimum(slot, cap - 1)]
    contribution = result * copy_weight[:, None].astype(x.dtype)
    y = jnp.zeros((num_tokens, hidden), x.dtype).at[token_of_copy].add(contribution)
    return y, jnp.sum(~kept)


def _dispatch_replicated(x, weights, experts, gate_proj, up_proj, down_proj, *, shards, capacity_factor,
                         local_impl, tensor_split):
    """shard_map body for tokens every expert shard holds (replicated over `expert`). x: [T, D];
    weights, experts: [T, K]; local expert weights as in _dispatch_all_to_all. Each shard runs
    the copies routed to its experts; a psum over `expert` (and `tensor`) adds the shards' parts."""
    del shards, capacity_factor  # nothing is sent, so nothing can overflow
    num_tokens, top_k = experts.shape
    local_count = gate_proj.shape[0]
    local_ids = experts - jax.lax.axis_index(EXPERT_AXIS) * local_count
    mine = (local_ids >= 0) & (local_ids < local_count)
    out = _local_experts(jnp.repeat(x, top_k, axis=0), local_ids.reshape(-1), mine.reshape(-1), gate_proj,
                         up_proj, down_proj, local_impl)  # [T*K, D]
    y = jnp.einsum("TKD,TK->TD", out.reshape(num_tokens, top_k, -1), weights.astype(x.dtype))
    y = jax.lax.psum(y, (EXPERT_AXIS, TENSOR_AXIS) if tensor_split else EXPERT_AXIS)
    return y, jnp.zeros((), jnp.int32)


def _dispatch_ragged(x, weights, experts, gate_proj, up_proj, down_proj, *, shards, capacity_factor,
                     local_impl, tensor_split):
    """Like _dispatch_all_to_all but sends exactly the routed rows with ragged_all_to_all.
    The receive buffer holds the worst case (dropless) or the capacity-factor bound."""
    num_tokens, top_k = experts.shape
    hidden = x.shape[-1]
    local_count = gate_proj.shape[0]
    copies = num_tokens * top_k
    receive_rows = copies * shards if capacity_factor == 0 else math.ceil(capacity_factor * copies)

    flat_experts = experts.reshape(-1)
    destination = flat_experts // local_count
    order = jnp.argsort(flat_experts, stable=True)  # by expert, hence by destination
    token_of_copy = order // top_k
    send_sizes = jnp.bincount(destination, length=shards).astype(jnp.int32)
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    # Row counts each source sends me, and where my rows land in each destination's buffer.
    receive_sizes = jax.lax.all_to_all(send_sizes, EXPERT_AXIS, 0, 0, tiled=True)
    all_sizes = jax.lax.all_gather(send_sizes, EXPERT_AXIS)  # [source, destination]
    me = jax.lax.axis_index(EXPERT_AXIS)
    output_offsets = (jnp.cumsum(all_sizes, axis=0) - all_sizes)[me].astype(jnp.int32)
    rows = x[token_of_copy]
    ids = (flat_experts % local_count)[order]
    received = jax.lax.ragged_all_to_all(rows, jnp.zeros((receive_rows, hidden), x.dtype), input_offsets,
                                         send_sizes, output_offsets, receive_sizes, axis_name=EXPERT_AXIS)
    received_ids = jax.lax.ragged_all_to_all(ids, jnp.full((receive_rows,), -1, jnp.int32), input_offsets,
                                             send_sizes, output_offsets, receive_sizes, axis_name=EXPERT_AXIS)
    total = jnp.sum(receive_sizes)
    valid = jnp.arange(receive_rows) < total
    out = _local_experts(received, received_ids, valid & (received_ids >= 0), gate_proj, up_proj, down_proj,
                         local_impl)
    if tensor_split:
        out = jax.lax.psum(out, TENSOR_AXIS)
    # Send results back: the reverse exchange (sizes and offsets swap roles).
    back_offsets = (jnp.cumsum(all_sizes, axis=1) - all_sizes)[:, me].astype(jnp.int32)
    my_offsets = (jnp.cumsum(receive_sizes) - receive_sizes).astype(jnp.int32)
    returned = jax.lax.ragged_all_to_all(out, jnp.zeros((copies, hidden), x.dtype), my_offsets, receive_sizes,
                                         back_offsets, send_sizes, axis_name=EXPERT_AXIS)
    contribution = returned * weights.reshape(-1)[order][:, None].astype(x.dtype)
    y = jnp.zeros((num_tokens, hidden), x.dtype).at[token_of_copy].add(contribution)
    dropped = jnp.maximum(total - receive_rows, 0)
    return y, dropped


def routed_experts_sharded(x, weights, experts, gate_proj, up_proj, down_proj, *, mesh, local_impl,
                           capacity_factor: float = 0.0, dispatch: str = "all_to_all"):
    """Expert-parallel routed experts over `mesh` (see the module docstring).

    x: [T, D] (T split over the batch axes and `context`); weights, experts: [T, K]; gate/up: [E, D, F];
    down: [E, F, D]. Returns (y [T, D], dropped token copies summed over devices).
    """
    shards = mesh.shape[EXPERT_AXIS]
    tensor_split = TENSOR_AXIS in mesh.axis_names and mesh.shape[TENSOR_AXIS] > 1
    token_axes = _token_axes(mesh)
    tokens = P(token_axes)
    tensor = TENSOR_AXIS if tensor_split else None
    in_specs = (tokens, tokens, tokens, P(EXPERT_AXIS, None, tensor), P(EXPERT_AXIS, None, tensor),
                P(EXPERT_AXIS, tensor, None))
    if EXPERT_AXIS not in token_axes:
        body = _dispatch_replicated
    else:
        body = {"all_to_all": _dispatch_all_to_all, "ragged_all_to_all": _dispatch_ragged}[dispatch]
    body = functools.partial(body, shards=shards, capacity_factor=capacity_factor, local_impl=local_impl,
                             tensor_split=tensor_split)
    free_axes = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                 if kind != jax.sharding.AxisType.Manual}  # the axes this shard_map makes manual

    def counted(*args):
        y, dropped = body(*args)
        return y, jax.lax.psum(dropped, token_axes)  # tokens are distinct along these only

    sharded = jax.shard_map(counted, mesh=mesh, in_specs=in_specs, out_specs=(tokens, P()),
                            axis_names=free_axes, check_vma=False)
    return sharded(x, weights, experts, gate_proj, up_proj, down_proj)
