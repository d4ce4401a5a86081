"""KDA (linear attention) layers in the serving step: a per-sequence state beside the page pool.

A KDA layer (model/kda.py) caches nothing per token. Each running sequence owns a *state slot*
(the engine's slot), and per KDA layer the **state pool** holds the slot's short-convolution
window and delta-rule state, flat over layers like the page pool (entry layer * slots + slot):

    {"conv": [L * slots, K-1, 3 N H]  (the last K-1 q/k/v projections; the pool's storage dtype),
     "recurrent": [L * slots, N, H, H] float32}

so a sequence's state is the same size at any length. In a step (attention/pages.py's
`PagedKeys.attend_linear`) decode rows advance the recurrence one position from their slot's
state and prefill chunk rows run the chunked form continuing from it; the new state is written
back to the slot. Two rules make a slot safe to reuse without clearing it:

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

from glm5_jax.model.kda import (
    LinearAttentionSpec,
    causal_conv1d,
    forget_gate,
    gated_rms_norm,
    kda_chunked,
    kda_chunked_pallas,
    kda_recurrent,
)
from glm5_jax.model.layers import dense


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


def project(spec: LinearAttentionSpec, weights, x: jax.Array):
    """The per-token inputs of the recurrence, as `kda.linear_attention` computes them.
    x: [T, 1, D] normalised flat tokens. Returns (qkv [T, C] before the convolution, log decay
    g [T, N, H] float32, write rate beta [T, N] float32)."""
    flat = x[:, 0]
    qkv = jnp.concatenate([dense(flat, weights[name]) for name in ("q_proj", "k_proj", "v_proj")], axis=-1)
    g = forget_gate(spec, weights["forget_gate"], x)[:, 0]
    beta = jax.nn.sigmoid(dense(flat, weights["b_proj"]).astype(jnp.float32))
    return qkv, g, beta


def conv_weight(weights) -> jax.Array:
    """The q, k and v depthwise convolutions as one [C, K]."""
    return jnp.concatenate([weights[f"{name}_conv1d"] for name in "qkv"], axis=0)


def continue_rows(spec: LinearAttentionSpec, conv: jax.Array, qkv: jax.Array, g: jax.Array, beta: jax.Array,
                  positions: jax.Array, conv_state: jax.Array, recurrent: jax.Array):
    """Rows of one group continuing from their states. conv: [C, K]; qkv: [B, T, C]; g: [B, T, N, H];
    beta: [B, T, N]; positions: [B, T] (-1 = padding, only after a row's valid tokens);
    conv_state: [B, K-1, C]; recurrent: [B, N, H, H] (both already empty for rows starting at
    position 0). Returns (out [B, T, N, H] in qkv's dtype (garbage at padding), the new conv
    window [B, K-1, C], the new recurrent state [B, N, H, H] float32)."""
    rows, length, _ = qkv.shape
    heads, head = spec.num_heads, spec.head_dim
    valid = positions >= 0
    history = conv_state.astype(qkv.dtype)
    mixed, _ = causal_conv1d(qkv, conv, history)
    # The window after the row's valid tokens: inputs count .. count + K-2 of [history, qkv].
    count = jnp.sum(valid, axis=1)  # [B]
    window = jnp.concatenate([history, qkv], axis=1)  # [B, K-1+T, C]
    taken = count[:, None] + jnp.arange(conv.shape[-1] - 1)  # [B, K-1]
    new_conv = jnp.take_along_axis(window, taken[..., None], axis=1)
    query, key, value = (part.reshape(rows, length, heads, head) for part in jnp.split(mixed, 3, axis=-1))
    g = jnp.where(valid[..., None, None], g, 0.0)  # padding: no decay ...
    beta = jnp.where(valid[..., None], beta, 0.0)  # ... and no write
    if length == 1:
        out, recurrent = kda_recurrent(query, key, value, g, beta, recurrent, use_qk_l2norm=True)
    else:
        chunked = kda_chunked if spec.impl == "reference" else kda_chunked_pallas
        out, recurrent = chunked(query, key, value, g, beta, recurrent, min(spec.chunk_size, length),
                                 use_qk_l2norm=True)
    return out, new_conv, recurrent


def output(spec: LinearAttentionSpec, weights, x: jax.Array, out: jax.Array) -> jax.Array:
    """The gated output norm and o_proj. x: [T, 1, D] (the gate's input); out: [T, N, H].
    Returns [T, 1, D]."""
    tokens = x.shape[0]
    gate = dense(dense(x, weights["g_a_proj"]), weights["g_b_proj"])
    gate = gate.reshape(tokens, 1, spec.num_heads, spec.head_dim)
    out = gated_rms_norm(out[:, None], gate, weights["o_norm"]["scale"], spec.norm_eps)
    return dense(out.reshape(tokens, 1, -1), weights["o_proj"])
