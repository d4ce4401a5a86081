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

import jax
import jax.numpy as jnp


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


def kda_recurrent(query, key, value, g, beta, state=None, use_qk_l2norm: bool = False):
    """The recurrence, position by position. query, key: [B, T, N, H]; value: [B, T, N, P];
    g: [B, T, N, H] log decay (<= 0); beta: [B, T, N]; state: [B, N, H, P] or None (zeros).
    Returns (out [B, T, N, P] in query's dtype, final state [B, N, H, P] float32)."""
    dtype = query.dtype
    query, key, value, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)

    def step(state, inputs):
        q, k, v, decay, rate = inputs  # [B, N, H], [B, N, H], [B, N, P], [B, N, H], [B, N]
        state = state * jnp.exp(decay)[..., None]
        remembered = jnp.einsum("BNHP,BNH->BNP", state, k)
        state = state + jnp.einsum("BNH,BNP->BNHP", k, (v - remembered) * rate[..., None])
        return state, jnp.einsum("BNHP,BNH->BNP", state, q)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (query, key, value, g, beta)]
    state, out = jax.lax.scan(step, _initial_state(key, value, state), time_major)
    return jnp.moveaxis(out, 0, 1).astype(dtype), state


def kda_chunked(query, key, value, g, beta, state=None, chunk_size: int = 64, use_qk_l2norm: bool = False):
    """`kda_recurrent`'s result computed chunk by chunk (shapes as there); the sequence is padded
    to whole chunks (padding positions carry no decay and write nothing)."""
    dtype, length = query.dtype, query.shape[1]
    query, key, value, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)
    state = _initial_state(key, value, state)
    pad = -length % chunk_size

    def chunks(a):  # [B, T, N, ...] -> [U, B, N, C, ...] (padded with zeros)
        a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
        a = a.reshape((a.shape[0], -1, chunk_size) + a.shape[2:])  # [B, U, C, N, ...]
        return jnp.moveaxis(jnp.moveaxis(a, 3, 2), 1, 0)  # [U, B, N, C, ...]

    query, key, value, g, beta = (chunks(a) for a in (query, key, value, g, beta))
    g = jnp.cumsum(g, axis=-2)  # log decay from the chunk's start, per position and channel
    k_beta, v_beta = key * beta[..., None], value * beta[..., None]
    # decay[i, j, h] = exp(g_i - g_j) for j <= i: channel h's decay from position j to i.
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    exponent = g[..., :, None, :] - g[..., None, :, :]  # [U, B, N, C, S, H]
    decay = jnp.where(lower[:, :, None], jnp.exp(jnp.where(lower[:, :, None], exponent, 0.0)), 0.0)
    strictly_lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    # The delta rule inside a chunk: A[i, j] = -beta_i (k_i . decay_ij . k_j) for j < i, and
    # (I - A)^-1 folds each position's writes into the later ones' reads.
    a = -jnp.einsum("UBNCH,UBNSH,UBNCSH->UBNCS", k_beta, key, decay)
    eye = jnp.eye(chunk_size, dtype=jnp.float32)
    solve = jnp.linalg.inv(eye - jnp.where(strictly_lower, a, 0.0))  # unit lower triangular
    new_values = solve @ v_beta  # [U, B, N, C, P]
    cumulative_keys = solve @ (k_beta * jnp.exp(g))  # [U, B, N, C, H]
    # Attention inside the chunk: q_i . decay_ij . k_j for j <= i.
    inside = jnp.einsum("UBNCH,UBNSH,UBNCSH->UBNCS", query, key, decay)

    def step(state, inputs):
        q, k, v, g_chunk, keys_decayed, scores = inputs
        written = v - keys_decayed @ state  # [B, N, C, P]: each position's write, the state's part removed
        out = (q * jnp.exp(g_chunk)) @ state + scores @ written
        last = g_chunk[..., -1:, :]  # [B, N, 1, H]: the decay over the whole chunk
        carried = jnp.swapaxes(k * jnp.exp(last - g_chunk), -1, -2) @ written  # [B, N, H, P]
        state = state * jnp.exp(last)[..., 0, :, None] + carried
        return state, out

    state, out = jax.lax.scan(step, state, (query, key, new_values, g, cumulative_keys, inside))
    out = jnp.moveaxis(out, 0, 1)  # [B, U, N, C, P]
    out = jnp.moveaxis(out, 2, 3).reshape(out.shape[0], -1, out.shape[2], out.shape[-1])[:, :length]
    return out.astype(dtype), state
