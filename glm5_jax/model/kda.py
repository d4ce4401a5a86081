"""Kimi Delta Attention (KDA), the linear attention of GLM-5.3-Flash's `linear_attention` layers
(transformers' glm5_next): a gated delta rule with a per-channel forget gate.

Per head, with state S [H, P] (key channels x value channels), for each position t:

    S <- diag(exp(g_t)) S                      (g_t [H] <= 0: per-channel decay)
    S <- S + beta_t k_t (v_t - S^T k_t)^T      (the delta rule: write v_t at key k_t, rate beta_t)
    o_t = S^T q_t                              (q_t scaled by H^-1/2; q, k optionally L2-normalised)

`kda_recurrent` runs that loop (decoding: one position at a time, the state carried between
calls). `kda_chunked` computes the same in chunks of C positions (prefill and training): inside
a chunk the delta rule's triangular system is solved at once, (I - A)^-1 with A strictly lower
triangular, and only the state crosses chunks, in a `lax.scan` over chunks, so cost and memory
grow linearly with the sequence. Both take and return the state, so a prefill in several chunks
equals one over the whole sequence.

Einsum letters as in glm5_jax/model/layers.py; here B batch, T positions, N heads, H the key and
query head dim, P the value head dim, U chunks, C and S a chunk's query and key positions.
All arithmetic in float32, as the reference does (the state accumulates rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model import kernel_calls
from glm5_jax.model.layers import WeightSpec, WeightTable, dense, normal_init


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (the reference's l2norm: + eps, not max)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(query, key, value, g, beta, use_qk_l2norm: bool):
    query, key, value, g, beta = (a.astype(jnp.float32) for a in (query, key, value, g, beta))
    if use_qk_l2norm:
        query, key = l2_normalize(query), l2_normalize(key)
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def _initial_state(key, value, state):
    batch, _, heads, key_dim = key.shape
    if state is None:
        return jnp.zeros((batch, heads, key_dim, value.shape[-1]), jnp.float32)
    return state.astype(jnp.float32)


def kda_recurrent(query, key, value, g, beta, state=None, use_qk_l2norm: bool = False, starts=None):
    """The recurrence, position by position. query, key: [B, T, N, H]; value: [B, T, N, P];
    g: [B, T, N, H] log decay (<= 0); beta: [B, T, N]; state: [B, N, H, P] or None (zeros);
    starts: bool [B, T] or None: a document begins at t (packed rows), the state is zeroed
    before t. Returns (out [B, T, N, P] in query's dtype, final state [B, N, H, P] float32)."""
    dtype = query.dtype
    query, key, value, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)
    if starts is None:
        starts = jnp.zeros(query.shape[:2], bool)

    def step(state, inputs):
        q, k, v, decay, rate, start = inputs  # [B, N, H], [B, N, H], [B, N, P], [B, N, H], [B, N], [B]
        state = jnp.where(start[:, None, None, None], 0.0, state) * jnp.exp(decay)[..., None]
        remembered = jnp.einsum("BNHP,BNH->BNP", state, k)
        state = state + jnp.einsum("BNH,BNP->BNHP", k, (v - remembered) * rate[..., None])
        return state, jnp.einsum("BNHP,BNH->BNP", state, q)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (query, key, value, g, beta, starts)]
    state, out = jax.lax.scan(step, _initial_state(key, value, state), time_major)
    return jnp.moveaxis(out, 0, 1).astype(dtype), state


def kda_chunked(query, key, value, g, beta, state=None, chunk_size: int = 64, use_qk_l2norm: bool = False,
                starts=None):
    """`kda_recurrent`'s result computed chunk by chunk (shapes as there, `starts` included); the
    sequence is padded to whole chunks (padding positions carry no decay and write nothing).

    Documents inside a chunk (starts): positions i, j interact only within one document
    (`same[i, j]`), and the state that enters the chunk reaches only the positions before the
    chunk's first start (`carry[i]`)."""
    dtype, length = query.dtype, query.shape[1]
    query, key, value, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)
    state = _initial_state(key, value, state)
    pad = -length % chunk_size
    if starts is None:
        starts = jnp.zeros(query.shape[:2], bool)

    def chunks(a):  # [B, T, N, ...] -> [U, B, N, C, ...] (padded with zeros)
        a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
        a = a.reshape((a.shape[0], -1, chunk_size) + a.shape[2:])  # [B, U, C, N, ...]
        return jnp.moveaxis(jnp.moveaxis(a, 3, 2), 1, 0)  # [U, B, N, C, ...]

    query, key, value, g, beta = (chunks(a) for a in (query, key, value, g, beta))
    # Documents: a chunk's positions numbered by the starts within it (0: the incoming state's).
    document = jnp.cumsum(jnp.pad(starts, ((0, 0), (0, pad))).reshape(starts.shape[0], -1, chunk_size),
                          axis=-1)
    document = jnp.moveaxis(document, 1, 0)[:, :, None]  # [U, B, 1, C]
    same = document[..., :, None] == document[..., None, :]  # [U, B, 1, C, S]
    carry = (document == 0)[..., None].astype(jnp.float32)  # [U, B, 1, C, 1]
    g = jnp.cumsum(g, axis=-2)  # log decay from the chunk's start, per position and channel
    k_beta, v_beta = key * beta[..., None], value * beta[..., None]
    # decay[i, j, h] = exp(g_i - g_j) for j <= i in one document: channel h's decay from j to i.
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool)) & same
    exponent = g[..., :, None, :] - g[..., None, :, :]  # [U, B, N, C, S, H]
    decay = jnp.where(lower[..., None], jnp.exp(jnp.where(lower[..., None], exponent, 0.0)), 0.0)
    strictly_lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    # The delta rule inside a chunk: A[i, j] = -beta_i (k_i . decay_ij . k_j) for j < i, and
    # (I - A)^-1 folds each position's writes into the later ones' reads.
    a = -jnp.einsum("UBNCH,UBNSH,UBNCSH->UBNCS", k_beta, key, decay)
    eye = jnp.eye(chunk_size, dtype=jnp.float32)
    solve = jnp.linalg.inv(eye - jnp.where(strictly_lower, a, 0.0))  # unit lower triangular
    new_values = solve @ v_beta  # [U, B, N, C, P]
    cumulative_keys = solve @ (k_beta * jnp.exp(g) * carry)  # [U, B, N, C, H]
    # Attention inside the chunk: q_i . decay_ij . k_j for j <= i.
    inside = jnp.einsum("UBNCH,UBNSH,UBNCSH->UBNCS", query, key, decay)

    def step(state, inputs):
        q, k, v, g_chunk, keys_decayed, scores, carry, same = inputs
        written = v - keys_decayed @ state  # [B, N, C, P]: each position's write, the state's part removed
        out = (q * jnp.exp(g_chunk) * carry) @ state + scores @ written
        last = g_chunk[..., -1:, :]  # [B, N, 1, H]: the decay over the whole chunk
        in_last_document = same[..., -1, :, None].astype(jnp.float32)  # [B, 1, C, 1]
        writers = k * jnp.exp(last - g_chunk) * in_last_document  # [B, N, C, H]
        carried = jnp.swapaxes(writers, -1, -2) @ written  # [B, N, H, P]
        state = state * (jnp.exp(last)[..., 0, :, None] * carry[..., -1:, :]) + carried
        return state, out

    state, out = jax.lax.scan(step, state, (query, key, new_values, g, cumulative_keys, inside, carry, same))
    out = jnp.moveaxis(out, 0, 1)  # [B, U, N, C, P]
    out = jnp.moveaxis(out, 2, 3).reshape(out.shape[0], -1, out.shape[2], out.shape[-1])[:, :length]
    return out.astype(dtype), state


def kda_chunked_pallas(query, key, value, g, beta, state=None, chunk_size: int = 64,
                       use_qk_l2norm: bool = False, starts=None):
    """`kda_chunked` by the Pallas kernel (kernels_pallas/kda.py, through kernel_calls: per device
    on its own rows and heads). Same arguments and results."""
    dtype = query.dtype
    query, key, value, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)
    out, state = kernel_calls.kda_chunked(query, key, value, g, beta, state, starts, chunk_size)
    return out.astype(dtype), state


# ----------------------------------------------------------------------------- the layer


class LinearAttentionSpec(NamedTuple):
    """What a `linear_attention` layer needs of a glm5_next config."""

    hidden_size: int
    num_heads: int  # linear_num_heads (N)
    head_dim: int  # linear_head_dim (H; the value head dim P equals it in GLM-5.3-Flash)
    conv_kernel: int  # linear_conv_kernel_dim
    lower_bound: float | None  # linear_lower_bound: g in (lower_bound, 0); None: -exp(A) softplus
    norm_eps: float  # rms_norm_eps of the gated output norm
    initializer_range: float = 0.02
    chunk_size: int = 64
    impl: str = "reference"  # the chunked form: "reference" (kda_chunked) or "pallas" (kernels_pallas/kda.py)


def linear_attention_weights(spec: LinearAttentionSpec, param_dtype) -> WeightTable:
    """One KDA layer's weights, [in, out] as every projection here (checkpoint names under
    self_attn/; A_log and dt_bias stay float32 as in the reference)."""
    init = normal_init(spec.initializer_range)
    width = spec.num_heads * spec.head_dim
    hidden, head = spec.hidden_size, spec.head_dim

    def weight(shape, axes, dtype=param_dtype, initializer=init):
        return WeightSpec(shape, axes, dtype, initializer)

    return {
        "q_proj": weight((hidden, width), ("embed", "heads")),
        "k_proj": weight((hidden, width), ("embed", "heads")),
        "v_proj": weight((hidden, width), ("embed", "heads")),
        # Depthwise short convolutions [channels, taps] of the q, k and v projections.
        **{f"{name}_conv1d": weight((width, spec.conv_kernel), ("heads", None)) for name in "qkv"},
        "forget_gate": {
            "f_a_proj": weight((hidden, head), ("embed", None)),
            "f_b_proj": weight((head, width), (None, "heads")),
            "dt_bias": weight((width,), ("heads",), jnp.float32, nn.initializers.zeros),
            "A_log": weight((spec.num_heads,), ("heads",), jnp.float32, nn.initializers.zeros),
        },
        "b_proj": weight((hidden, spec.num_heads), ("embed", "heads")),
        "g_a_proj": weight((hidden, head), ("embed", None)),
        "g_b_proj": weight((head, width), (None, "heads")),
        "o_norm": {"scale": weight((head,), ("norm",), initializer=nn.initializers.ones)},
        "o_proj": weight((width, hidden), ("heads", "embed")),
    }


def causal_conv1d(x: jax.Array, weight: jax.Array, state: jax.Array | None = None, starts=None, lengths=None):
    """Depthwise causal convolution then SiLU. x: [B, T, C]; weight: [C, K] (tap K-1 on the
    current position); state: [B, K-1, C] the previous positions (None: zeros); starts: bool
    [B, T] or None: a document begins at t, so no earlier input reaches it; lengths: [B] or None:
    each row's valid inputs (the rest padding). Returns (out [B, T, C] in x's dtype, the new state
    [B, K-1, C]: the last K-1 (valid) inputs)."""
    taps = weight.shape[-1]
    if state is None:
        state = jnp.zeros(x.shape[:1] + (taps - 1,) + x.shape[2:], x.dtype)
    history = state.astype(x.dtype)
    padded = jnp.concatenate([history, x], axis=1)  # [B, K-1+T, C]
    length = x.shape[1]
    if starts is None:
        same = lambda j: 1.0  # noqa: E731
    else:  # the history is document 0, the row's positions count the starts up to them
        document = jnp.pad(jnp.cumsum(starts, axis=1), ((0, 0), (taps - 1, 0)))
        same = lambda j: (document[:, j:j + length] == document[:, taps - 1:])[..., None]  # noqa: E731
    out = sum(padded[:, j:j + length].astype(jnp.float32) * weight[:, j].astype(jnp.float32) * same(j)
              for j in range(taps))
    if lengths is None:
        return jax.nn.silu(out).astype(x.dtype), padded[:, length:]
    window = lengths[:, None] + jnp.arange(taps - 1)  # inputs lengths .. lengths + K-2 of `padded`
    return jax.nn.silu(out).astype(x.dtype), jnp.take_along_axis(padded, window[..., None], axis=1)


def forget_gate(spec: LinearAttentionSpec, weights, x: jax.Array) -> jax.Array:
    """The per-channel log decay g [B, T, N, H] float32 (<= 0) from x [B, T, D]."""
    gate = dense(dense(x, weights["f_a_proj"]), weights["f_b_proj"])
    gate = (gate.astype(jnp.float32) + weights["dt_bias"].astype(jnp.float32))
    gate = gate.reshape(x.shape[:2] + (spec.num_heads, spec.head_dim))
    rate = jnp.exp(weights["A_log"].astype(jnp.float32))[:, None]  # [N, 1]
    if spec.lower_bound is not None:
        return spec.lower_bound * jax.nn.sigmoid(rate * gate)
    return -rate * jax.nn.softplus(gate)


def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMS(x) * scale * sigmoid(gate), all in float32 (the reference keeps the weight float32
    too), cast back to x's dtype. x, gate: [..., H]; scale: [H]."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class LinearState(NamedTuple):
    """A sequence's state in one KDA layer: what decoding carries instead of a KV cache."""

    conv: jax.Array  # [B, K-1, 3 N H]: the last inputs of the short convolution
    recurrent: jax.Array  # [B, N, H, H] float32: the delta rule's state


def linear_attention(spec: LinearAttentionSpec, weights, x: jax.Array, state: LinearState | None = None,
                     starts: jax.Array | None = None, valid: jax.Array | None = None):
    """One KDA layer. x: [B, T, D] (normalised); state: the sequence so far (None: a new one);
    starts: bool [B, T] or None: packed documents, each beginning from an empty state; valid:
    bool [B, T] or None: each row's tokens, then padding (a serving step's rows), which leaves the
    state as it was: no decay, no write, the conv window after the last valid input.
    Returns (out [B, T, D] (padding's is garbage), the state after these positions). One position
    with a state decodes by the recurrence; anything else runs chunked (chunked prefill continues
    from `state`)."""
    batch, length, _ = x.shape
    heads, head = spec.num_heads, spec.head_dim
    qkv = jnp.concatenate([dense(x, weights[name]) for name in ("q_proj", "k_proj", "v_proj")], -1)
    conv = jnp.concatenate([weights[f"{name}_conv1d"] for name in "qkv"], axis=0)  # [3 N H, K]
    lengths = None if valid is None else jnp.sum(valid, axis=1)
    qkv, conv_state = causal_conv1d(qkv, conv, None if state is None else state.conv, starts, lengths)
    query, key, value = (part.reshape(batch, length, heads, head) for part in jnp.split(qkv, 3, axis=-1))
    g = forget_gate(spec, weights["forget_gate"], x)
    beta = jax.nn.sigmoid(dense(x, weights["b_proj"]).astype(jnp.float32))
    if valid is not None:
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
    recurrent = None if state is None else state.recurrent
    if state is not None and length == 1:
        out, recurrent = kda_recurrent(query, key, value, g, beta, recurrent, use_qk_l2norm=True,
                                       starts=starts)
    else:
        chunked = kda_chunked if spec.impl == "reference" else kda_chunked_pallas
        out, recurrent = chunked(query, key, value, g, beta, recurrent, min(spec.chunk_size, length),
                                 use_qk_l2norm=True, starts=starts)
    gate = dense(dense(x, weights["g_a_proj"]), weights["g_b_proj"])
    gate = gate.reshape(batch, length, heads, head)
    out = gated_rms_norm(out, gate, weights["o_norm"]["scale"], spec.norm_eps)
    out = dense(out.reshape(batch, length, heads * head), weights["o_proj"])
    return out, LinearState(conv_state, recurrent)
