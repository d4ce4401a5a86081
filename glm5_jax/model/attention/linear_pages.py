"""KDA (linear attention) layers in the serving step: a per-sequence state beside the page pool.

A KDA layer (model/kda.py) caches nothing per token. Each running sequence owns a *state slot*
(the engine's slot), and per KDA layer the **state pool** holds the slot's short-convolution
window and delta-rule state, flat over layers like the page pool (entry layer * slots + slot):

    {"conv": [L * slots, K-1, 3 N H]  (the last K-1 q/k/v projections; the pool's storage dtype),
     "recurrent": [L * slots, N, H, H] float32}

so a sequence's state is the same size at any length. In a step (attention/pages.py's
`PagedKeys.attend_linear`) decode rows advance the recurrence one position from their slot's
state and prefill chunk rows run the chunked form continuing from it (`kda.linear_attention`
with the rows' `valid` tokens); the new state is written back to the slot. Two rules make a slot
safe to reuse without clearing it:

- a row whose first token is at position 0 starts from the empty state (a new sequence, or a
  preempted one recomputed from its start), whatever the slot held before;
- padding tokens (position -1: the end of a chunk row, or whole rows) leave the state as it was:
  their decay g and write rate beta are 0, and the new conv window is the last K-1 *valid*
  inputs (gathered at the row's valid count), so a chunk row of 3 tokens padded to 16 carries
  exactly what 3 tokens would.

Prefix caching keeps copies of slot states in a **snapshot pool** of the same layout ([L * S, ...]
for S snapshots): `save_state` copies a slot's state of every KDA layer into a snapshot (the state
after a cached page boundary), `restore_state` copies a snapshot into a slot (a prefix hit resumes
the sequence there; docs/serving.md, "Hybrid models").

Letters as in model/kda.py: B rows, T tokens of a row, N heads, H head dim, K conv taps,
C = 3 N H conv channels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm5_jax.model.kda import LinearAttentionSpec


def init_state_pool(spec: LinearAttentionSpec, layers: int, slots: int, conv_dtype) -> dict[str, jax.Array]:
    """A zeroed state pool of `layers` KDA layers for `slots` sequences (module docs)."""
    width = 3 * spec.num_heads * spec.head_dim
    return {"conv": jnp.zeros((layers * slots, spec.conv_kernel - 1, width), conv_dtype),
            "recurrent": jnp.zeros((layers * slots, spec.num_heads, spec.head_dim, spec.head_dim),
                                   jnp.float32)}


def state_bytes_per_layer(spec: LinearAttentionSpec, conv_itemsize: int) -> int:
    """One sequence's state in one KDA layer: (K-1) * 3NH conv values + N H^2 float32."""
    width = 3 * spec.num_heads * spec.head_dim
    return (spec.conv_kernel - 1) * width * conv_itemsize + spec.num_heads * spec.head_dim ** 2 * 4


def _entries(pool: jax.Array, index, count: int) -> jax.Array:
    """Rows of entry `index` in every layer of a flat [L * count, ...] pool: [L]; all past the
    pool (dropped by a write) when index >= count."""
    rows = jnp.arange(pool.shape[0] // count) * count + index
    return jnp.where(index < count, rows, pool.shape[0])


def _copy(destination, source, to, start, *, to_count: int, from_count: int):
    """destination's entry `to` := source's entry `start`, in every layer of every KDA stack
    ({stack: {"conv", "recurrent"}} both); an out-of-range `to` writes nothing."""
    return jax.tree.map(lambda dst, src: dst.at[_entries(dst, to, to_count)].set(
        src.at[_entries(src, start, from_count)].get(mode="clip"), mode="drop"), destination, source)


@functools.partial(jax.jit, static_argnames=("slots", "snapshots"), donate_argnames=("snapshot_pools",))
def save_state(state_pools, snapshot_pools, slot, snapshot, *, slots: int, snapshots: int):
    """Copies slot `slot`'s state ({stack: state pool [L * slots, ...]}) into snapshot `snapshot`
    of snapshot_pools ({stack: [L * snapshots, ...]}, donated); returns the snapshot pools.
    snapshot >= snapshots: nothing written."""
    return _copy(snapshot_pools, state_pools, snapshot, slot, to_count=snapshots, from_count=slots)


@functools.partial(jax.jit, static_argnames=("slots", "snapshots"), donate_argnames=("state_pools",))
def restore_state(state_pools, snapshot_pools, slot, snapshot, *, slots: int, snapshots: int):
    """Copies snapshot `snapshot` into slot `slot` of state_pools (donated); returns the state
    pools. slot >= slots: nothing written."""
    return _copy(state_pools, snapshot_pools, slot, snapshot, to_count=slots, from_count=snapshots)
