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

Letters as in model/kda.py: B rows, T tokens of a row, N heads, H head dim, K conv taps,
C = 3 N H conv channels.
"""

from __future__ import annotations

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
