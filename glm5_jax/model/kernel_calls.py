"""The model's calls into kernels_pallas, in one place: each kernel imported on use (the kernels
stay optional for the reference path) and run per device on its own shard under a mesh
(`run_local` with the operands' logical axes; a pallas_call has no SPMD partitioning rule).

Single-letter axes as in the model: B batch, T queries, S keys, N heads, H head dim, R latent
rank, K selected keys / experts per token, D hidden.

Under context parallelism (`length` split over the mesh's `context` axis) a kernel gets its
device's queries and the whole sequence's keys: query-side operands are split over `length`,
key-side ones (latent, rope key, indexer keys, and the positions and segment ids read as keys')
are whole, so shard_map all-gathers them (and, in the backward, sums their gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm5_jax.parallel.local import Merged, run_local

_ROWS = ("batch", "length")  # [B, T] the queries' positions and segment ids
_KEY_ROWS = ("batch", None)  # [B, S] the keys' positions and segment ids (the same arrays, whole)
_HEADS = ("batch", "length", "heads", None)  # [B, T, N, H] queries
_KEY_HEADS = ("batch", None, "heads", None)  # [B, S, N, H] per-head keys and values
_KEYS = ("batch", None, None)  # [B, S, R]: shared by all heads
QUERY_ROWS = ("batch", "length", None)  # [B, T, S] or [B, T, K]: each device's own queries
_TOKENS = (Merged(("batch", "length")), None)  # [B*T, ...] flattened tokens: rows split like [B, T]


def indexer_topk(queries, keys, head_weights, positions, segment_ids, topk: int):
    """kernels_pallas.dsa_indexer.indexer_topk per device on its own sequences (the kernel sums
    over indexer heads, so they stay whole). queries: [B, T, n, h]; keys: [B, S, h]; head_weights:
    [B, T, n]; positions, segment_ids: [B, T]. Returns (indices [B, T, k] in key order, gap [B, T])."""
    from kernels_pallas.dsa_indexer import indexer_topk as kernel

    return run_local(functools.partial(kernel, topk=topk),
                     (queries, keys, head_weights, positions, positions, segment_ids, segment_ids),
                     (("batch", "length", None, None), _KEYS, QUERY_ROWS, _ROWS, _KEY_ROWS, _ROWS,
                      _KEY_ROWS),
                     (QUERY_ROWS, _ROWS))


def sparse_attention(q_absorbed, q_rope, latent, k_rope, indices, positions, segment_ids, scale: float):
    """kernels_pallas.sparse_attention per device on its own sequences and heads. q_absorbed:
    [B, T, N, R]; q_rope: [B, T, N, rope]; latent: [B, S, R]; k_rope: [B, S, rope]; indices:
    [B, T, K]; positions, segment_ids: [B, T]. Returns the latent context [B, T, N, R]."""
    from kernels_pallas.sparse_attention import sparse_attention as kernel

    return run_local(functools.partial(kernel, scale=scale),
                     (q_absorbed, q_rope, latent, k_rope, indices, positions, positions, segment_ids,
                      segment_ids),
                     (_HEADS, _HEADS, _KEYS, _KEYS, QUERY_ROWS, _ROWS, _KEY_ROWS, _ROWS, _KEY_ROWS),
                     _HEADS)


def flash_attention(query, key, value, positions, segment_ids, sliding_window: int):
    """kernels_pallas.flash_attention per device on its own sequences and heads. query, key:
    [B, T, N, H]; value: [B, T, N, Hv]; positions, segment_ids: [B, T]. Returns [B, T, N, Hv]."""
    from kernels_pallas.flash_attention import flash_attention as kernel

    return run_local(functools.partial(kernel, sliding_window=sliding_window),
                     (query, key, value, positions, positions, segment_ids, segment_ids),
                     (_HEADS, _KEY_HEADS, _KEY_HEADS, _ROWS, _KEY_ROWS, _ROWS, _KEY_ROWS), _HEADS)


def routed_experts(tokens: jax.Array, weights, experts, gate_proj, up_proj, down_proj,
                   swiglu_limit: float = 0.0) -> jax.Array:
    """kernels_pallas.moe_grouped_matmul on the calling device's tokens and whole experts.
    tokens: [T, D]; weights, experts: [T, K]; *_proj: [E, ., .]. Returns [T, D]. swiglu_limit:
    the SwiGLU clamp (0 = none), as in glm5_jax.model.layers.swiglu. (Inside the expert-parallel
    dispatcher, which already runs per device.)"""
    from kernels_pallas.moe_grouped_matmul import routed_experts_pallas as kernel

    return kernel(tokens, weights, experts, gate_proj, up_proj, down_proj, swiglu_limit=swiglu_limit)


def routed_experts_local(tokens: jax.Array, weights, experts, gate_proj, up_proj, down_proj,
                         swiglu_limit: float = 0.0) -> jax.Array:
    """`routed_experts` per device on its own tokens (rows split over the batch axes and `context`),
    experts whole."""
    whole = (None, None, None)
    return run_local(functools.partial(routed_experts, swiglu_limit=swiglu_limit),
                     (tokens, weights, experts, gate_proj, up_proj, down_proj),
                     (_TOKENS, _TOKENS, _TOKENS, whole, whole, whole), _TOKENS)


def kda_chunked(query, key, value, g, beta, state=None, starts=None, chunk_size: int | None = None):
    """kernels_pallas.kda per device on its own sequences and heads, the length whole (the state
    runs along it). Prepared float32 inputs (q scaled, q and k normalised): query, key, g:
    [B, T, N, H]; value: [B, T, N, P]; beta: [B, T, N]; state: [B, N, H, P] or None (zeros);
    starts: bool [B, T] or None. Returns (out [B, T, N, P], final state [B, N, H, P] float32)."""
    from kernels_pallas.kda import kda as kernel

    batch, length, heads, head_dim = query.shape
    if state is None:
        state = jnp.zeros((batch, heads, head_dim, value.shape[-1]), jnp.float32)
    if starts is None:
        starts = jnp.zeros((batch, length), bool)
    states = ("batch", "heads", None, None)  # [B, N, H, P]
    return run_local(functools.partial(kernel, chunk_size=chunk_size),
                     (query, key, value, g, beta, state, starts),
                     (_KEY_HEADS, _KEY_HEADS, _KEY_HEADS, _KEY_HEADS, ("batch", None, "heads"), states,
                      ("batch", None)),
                     (_KEY_HEADS, states))
