"""Incremental decoding on a contiguous MLA latent cache (one row of M positions per slot).

The serving engine runs the paged variant (glm5_jax.model.paged_decode), which reuses this
module's per-layer pieces (projection, feed-forward, stack kinds); this contiguous cache stays
as the simplest statement of cached decoding, tested equal to `forward`.

Per layer and token the cache holds only what MLA and DSA need later: the normalised latent
(kv_lora_rank), the rotated shared rope key (qk_rope_head_dim) and, on DSA layers, the indexer
key (index_head_dim); never per-head keys or values. Attention runs on the latent with Wkvb
absorbed into the query and the output (`absorbed_attention`). `decode_step` handles a chunk
of C new tokens for each of S cache slots at their own positions, so one function serves
prefill (C = prompt bucket) and decode (C = 1); in exact arithmetic its logits equal
`forward`'s rows.

Cache layout (`init_cache`), per layer stack (dense_layers, moe_layers):
  "full": DSA layers, a full-length cache {"latent", "k_rope", "index_keys"}: [L_dsa, S, M, F];
  "ring": sliding-window layers, a ring buffer of R = min(sliding_window, M) entries
          {"latent", "k_rope"}: [L_sliding, S, R, F] (they never run the indexer); position p
          lives in ring entry p % R.
plus "ring_positions" [S, R] int32 (the position held by each ring entry, -1 = empty; shared by
all sliding layers, updated once per step) when any layer slides, and "max_length" (M, an int32
scalar). A stack whose layers are all of one type scans its group branch-free; a mixed stack
carries both groups through the scan and picks the layer's branch with `lax.cond`.

A sliding-window query attends over the ring entries written before this chunk plus the chunk's
own new tokens (so prefill chunks longer than the window are exact), masked to
key <= query < key + sliding_window; afterwards only the last R valid tokens of the chunk are
written into the ring.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.dsa import (
    combine_index_scores,
    indexer_keys,
    indexer_queries,
    select_topk,
    selection_mask,
)
from glm5_jax.model.layers import apply_rope, rms_norm, rope_angles, swiglu_mlp
from glm5_jax.model.mla import absorbed_attention, kv_latent, query_path
from glm5_jax.model.moe import ROUTED_EXPERTS, route
from glm5_jax.model.transformer import moe_spec
from glm5_jax.parallel.expert import expert_mesh, routed_experts_sharded

STACKS = ("dense_layers", "moe_layers")
FULL_WIDTHS = ("latent", "k_rope", "index_keys")
RING_WIDTHS = ("latent", "k_rope")


def _stack_sizes(config: ModelConfig) -> dict[str, int]:
    sizes = {"dense_layers": config.num_dense_layers, "moe_layers": config.num_moe_layers}
    return {name: size for name, size in sizes.items() if size}


def _stack_layers(config: ModelConfig, stack: str) -> range:
    first = 0 if stack == "dense_layers" else config.num_dense_layers
    return range(first, first + _stack_sizes(config)[stack])


def _is_sliding(config: ModelConfig, layer: int) -> bool:
    return config.attention_types[layer] == "sliding_window"


def _widths(config: ModelConfig) -> dict[str, int]:
    return {"latent": config.kv_lora_rank, "k_rope": config.qk_rope_head_dim,
            "index_keys": config.index_head_dim}


def ring_size(config: ModelConfig, max_length: int) -> int:
    """Entries a sliding-window layer's ring holds for caches of `max_length` positions."""
    return min(config.sliding_window, max_length)


def init_cache(config: ModelConfig, num_slots: int, max_length: int, dtype=None):
    """Zeroed cache for S = num_slots sequences of M = max_length positions (see the module
    docstring): {stack: {"full": {"latent", "k_rope", "index_keys"}: [L_dsa, S, M, F],
    "ring": {"latent", "k_rope"}: [L_sliding, S, R, F]}, "ring_positions": [S, R],
    "max_length": M}, a group present only when its stack has such layers."""
    dtype = dtype or config.compute_dtype
    widths = _widths(config)
    size = ring_size(config, max_length)
    cache = {}
    for stack in _stack_sizes(config):
        sliding = [_is_sliding(config, i) for i in _stack_layers(config, stack)]
        groups = {}
        if not all(sliding):
            groups["full"] = {name: jnp.zeros((sliding.count(False), num_slots, max_length,
                                               widths[name]), dtype) for name in FULL_WIDTHS}
        if any(sliding):
            groups["ring"] = {name: jnp.zeros((sliding.count(True), num_slots, size, widths[name]),
                                              dtype) for name in RING_WIDTHS}
        cache[stack] = groups
    if "sliding_window" in config.attention_types:
        cache["ring_positions"] = jnp.full((num_slots, size), -1, jnp.int32)
    cache["max_length"] = jnp.asarray(max_length, jnp.int32)
    return cache


def cache_bytes_per_token(config: ModelConfig, dtype=None) -> int:
    """Cache bytes each further position of max_length costs one slot, across all layers
    (DSA layers only: a sliding-window layer's ring does not grow with the length)."""
    width = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    dsa_layers = config.num_layers - config.attention_types.count("sliding_window")
    return dsa_layers * width * jnp.dtype(dtype or config.compute_dtype).itemsize


def cache_bytes(config: ModelConfig, max_length: int, dtype=None) -> int:
    """Bytes one slot of `init_cache(config, S, max_length, dtype)` occupies: M positions on DSA
    layers, a ring of min(sliding_window, M) on sliding-window layers, plus its ring positions."""
    sliding = config.attention_types.count("sliding_window")
    if not sliding:
        return max_length * cache_bytes_per_token(config, dtype)
    itemsize = jnp.dtype(dtype or config.compute_dtype).itemsize
    size = ring_size(config, max_length)
    ring = sliding * size * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize
    return max_length * cache_bytes_per_token(config, dtype) + ring + size * 4


def _write(cache: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """cache: [S, M, F]; values: [S, C, F] stored at positions [S, C] (out-of-range ones dropped)."""
    slots = jnp.broadcast_to(jnp.arange(cache.shape[0])[:, None], positions.shape)
    return cache.at[slots, positions].set(values.astype(cache.dtype), mode="drop")


class _Projected(NamedTuple):
    """One layer's per-token attention inputs for the new tokens."""

    q_latent: jax.Array  # [S, C, Rq]
    q_nope: jax.Array  # [S, C, N, nope]
    q_rope: jax.Array  # [S, C, N, rope], rotated
    latent: jax.Array  # [S, C, Rkv]
    k_rope: jax.Array  # [S, C, rope], rotated
    cos: jax.Array
    sin: jax.Array


class _RingPlan(NamedTuple):
    """What every sliding-window layer of one step shares (computed once per step)."""

    allowed: jax.Array  # bool [S, C, R + C]: over (ring entries before the chunk, new tokens)
    entries: jax.Array  # int32 [S, C]: the ring entry each new token goes to; R = not stored
    positions: jax.Array  # int32 [S, R]: ring positions after this step


def _ring_plan(config: ModelConfig, ring_positions, positions, max_length) -> _RingPlan:
    """ring_positions: [S, R] (-1 = empty); positions: [S, C] contiguous per slot, padding at
    positions >= max_length (traced scalar)."""
    size = ring_positions.shape[1]
    window = config.sliding_window
    valid = positions < max_length
    first = jnp.min(positions, axis=1)[:, None, None]  # the chunk's first (valid) position
    last = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)
    query = positions[:, :, None]
    stored = ring_positions[:, None, :]
    from_ring = (stored >= 0) & (stored < first) & (stored <= query) & (query - stored < window)
    keys = positions[:, None, :]
    from_chunk = (keys <= query) & (query - keys < window)
    # Only the chunk's last R valid tokens are stored: distinct entries, no duplicate writes.
    keep = valid & (positions > last - size)
    entries = jnp.where(keep, positions % size, size)
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    updated = ring_positions.at[rows, entries].set(positions, mode="drop")
    return _RingPlan(jnp.concatenate([from_ring, from_chunk], axis=-1), entries, updated)


def _project(config: ModelConfig, w, x, positions) -> _Projected:
    q_latent, q_nope, q_rope = query_path(x, w["q_a_proj"], w["q_a_norm"], w["q_b_proj"],
                                          config.latent_norm_eps, config.qk_nope_head_dim)
    latent, k_rope = kv_latent(x, w["kv_a_proj"], w["kv_a_norm"], config.kv_lora_rank,
                               config.latent_norm_eps)
    cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
    return _Projected(q_latent, q_nope, apply_rope(q_rope, cos, sin), latent,
                      apply_rope(k_rope, cos, sin), cos, sin)


def _dsa_attention(config: ModelConfig, indexer, kv_b_proj, p: _Projected, x, positions, cache,
                   previous_indices, run_indexer):
    """DSA on a full-length layer cache {name: [S, M, F]}; returns (out [S, C, N, Hv],
    top-k indices [S, C, k], updated layer cache)."""
    keys = indexer_keys(x, p.cos, p.sin, indexer["wk"], indexer["k_norm_scale"], indexer["k_norm_bias"],
                        config.qk_rope_head_dim, config.index_norm_eps)
    cache = {"latent": _write(cache["latent"], p.latent, positions),
             "k_rope": _write(cache["k_rope"], p.k_rope, positions),
             "index_keys": _write(cache["index_keys"], keys, positions)}

    max_length = cache["latent"].shape[1]
    allowed = jnp.arange(max_length)[None, None, :] <= positions[:, :, None]  # [S, C, M] causal

    def run():
        queries = indexer_queries(p.q_latent, p.cos, p.sin, indexer["wq_b"], config.qk_rope_head_dim)
        scores = combine_index_scores(x, queries, cache["index_keys"], indexer["weights_proj"])
        return select_topk(scores, allowed, config.index_topk)[0]

    indices = (run() if run_indexer else previous_indices) if isinstance(run_indexer, bool) else (
        jax.lax.cond(run_indexer, run, lambda: previous_indices))
    allowed = allowed & selection_mask(indices, max_length)
    out = absorbed_attention(p.q_nope, p.q_rope, cache["latent"], cache["k_rope"], kv_b_proj, allowed)
    return out, indices, cache


def _ring_attention(kv_b_proj, p: _Projected, ring, plan: _RingPlan):
    """Sliding-window attention over a layer's ring {name: [S, R, F]} and the chunk's own new
    tokens; returns (out [S, C, N, Hv], updated ring)."""
    latent = jnp.concatenate([ring["latent"], p.latent.astype(ring["latent"].dtype)], axis=1)
    k_rope = jnp.concatenate([ring["k_rope"], p.k_rope.astype(ring["k_rope"].dtype)], axis=1)
    out = absorbed_attention(p.q_nope, p.q_rope, latent, k_rope, kv_b_proj, plan.allowed)
    ring = {"latent": _write(ring["latent"], p.latent, plan.entries),
            "k_rope": _write(ring["k_rope"], p.k_rope, plan.entries)}
    return out, ring


def _feed_forward(config: ModelConfig, layer, x, ffn: str):
    """x: [S, C, D] normalised -> [S, C, D]."""
    if ffn == "dense":
        mlp = layer["mlp"]
        return swiglu_mlp(x, mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
    moe, spec = layer["moe"], moe_spec(config)
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts, _ = route(tokens, moe["router"], moe["router_bias"], spec)
    mesh = expert_mesh()  # expert-parallel serving: tokens travel to the experts, not weights
    if mesh is None:
        y = ROUTED_EXPERTS[spec.impl](tokens, weights, experts, moe["gate_proj"], moe["up_proj"],
                                      moe["down_proj"])
    else:
        y, _ = routed_experts_sharded(tokens, weights, experts, moe["gate_proj"], moe["up_proj"],
                                      moe["down_proj"], mesh=mesh, local_impl=ROUTED_EXPERTS[spec.impl],
                                      capacity_factor=spec.capacity_factor, dispatch=spec.dispatch)
    y = y.reshape(x.shape)
    if config.num_shared_experts:
        shared = moe["shared_experts"]
        y = y + swiglu_mlp(x, shared["gate_proj"], shared["up_proj"], shared["down_proj"])
    return y


class _StackKinds(NamedTuple):
    """Static description of one scanned stack's layers."""

    mode: str  # "full" (all DSA), "ring" (all sliding-window) or "mixed"
    run: jax.Array  # bool [L]: the layer runs the indexer
    sliding: jax.Array  # bool [L]: the layer is a sliding-window layer
    group_index: jax.Array  # int32 [L]: the layer's index in its cache group
    uniform_run: bool | None  # `run` when all the stack's DSA layers agree, else None


def _stack_kinds(config: ModelConfig, stack: str) -> _StackKinds:
    layers = _stack_layers(config, stack)
    sliding = [_is_sliding(config, i) for i in layers]
    run = [not s and config.indexer_types[i] == "full" for i, s in zip(layers, sliding, strict=True)]
    dsa_runs = {r for r, s in zip(run, sliding, strict=True) if not s}
    mode = "ring" if all(sliding) else "mixed" if any(sliding) else "full"
    index = [sliding[:j].count(sliding[j]) for j in range(len(sliding))]
    return _StackKinds(mode, jnp.asarray(run), jnp.asarray(sliding), jnp.asarray(index, jnp.int32),
                       dsa_runs.pop() if len(dsa_runs) == 1 else None)


def _take(group, index):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False), group)


def _put(group, layer, index):
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, index, 0), group, layer)


def _full_length(cache) -> int | None:
    """M (static) from any full-length group, None when every layer slides."""
    for groups in cache.values():
        if isinstance(groups, dict) and "full" in groups:
            return groups["full"]["latent"].shape[2]
    return None


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def decode_step(config: ModelConfig, params, cache, tokens: jax.Array, positions: jax.Array):
    """Runs C new tokens per slot through the model, reading and extending the cache.

    tokens, positions: [S, C] int32 (positions of each slot's new tokens, contiguous per slot; a
    slot's cache must hold that sequence's tokens before its first new position). Returns
    (logits [S, C, vocab] float32, updated cache). Positions >= the cache length (padding, idle
    slots) write nothing.
    """
    dtype = config.compute_dtype
    x = params["embed"][tokens].astype(dtype)
    full_length = _full_length(cache)
    indices = jnp.zeros(tokens.shape + (min(config.index_topk, full_length or 1),), jnp.int32)
    plan = None
    if "ring_positions" in cache:
        plan = _ring_plan(config, cache["ring_positions"], positions, cache["max_length"])
    new_cache = {}
    for stack in _stack_sizes(config):
        kinds = _stack_kinds(config, stack)
        ffn = "dense" if stack == "dense_layers" else "moe"

        def layer_step(carry, layer_inputs, ffn=ffn, kinds=kinds):
            x, previous, groups = carry  # groups: (full, ring) of a mixed stack, else None
            layer, layer_cache, run_flag, sliding_flag, index = layer_inputs
            normed = rms_norm(x, layer["input_norm"]["scale"], config.rms_norm_eps)
            weights = layer["attention"]
            w = {name: value.astype(dtype) for name, value in weights.items() if name != "indexer"}
            p = _project(config, w, normed, positions)
            run = run_flag if kinds.uniform_run is None else kinds.uniform_run

            def dsa(full):
                return _dsa_attention(config, weights["indexer"], w["kv_b_proj"], p, normed, positions,
                                      full, previous, run)

            if kinds.mode == "full":
                out, indices, layer_cache = dsa(layer_cache)
                layer_cache = {"full": layer_cache}
            elif kinds.mode == "ring":
                out, layer_cache = _ring_attention(w["kv_b_proj"], p, layer_cache, plan)
                indices, layer_cache = previous, {"ring": layer_cache}
            else:
                def dsa_branch(full, ring):
                    out, indices, layer = dsa(_take(full, index))
                    return out, indices, _put(full, layer, index), ring

                def ring_branch(full, ring):
                    out, layer = _ring_attention(w["kv_b_proj"], p, _take(ring, index), plan)
                    return out, previous, full, _put(ring, layer, index)

                out, indices, full, ring = jax.lax.cond(sliding_flag, ring_branch, dsa_branch, *groups)
                groups = (full, ring)
            x = x + jnp.einsum("SCNH,NHD->SCD", out, w["o_proj"])
            normed = rms_norm(x, layer["post_attention_norm"]["scale"], config.rms_norm_eps)
            x = x + _feed_forward(config, layer, normed, ffn)
            return (x, indices, groups), layer_cache

        if kinds.mode == "mixed":
            groups, layer_caches = (cache[stack]["full"], cache[stack]["ring"]), None
        else:
            groups, layer_caches = None, cache[stack][kinds.mode]
        (x, indices, groups), scanned = jax.lax.scan(
            layer_step, (x, indices, groups),
            (params[stack], layer_caches, kinds.run, kinds.sliding, kinds.group_index))
        new_cache[stack] = scanned if groups is None else {"full": groups[0], "ring": groups[1]}
    if plan is not None:
        new_cache["ring_positions"] = plan.positions
    new_cache["max_length"] = cache["max_length"]
    hidden = rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps)
    logits = jnp.einsum("SCD,DV->SCV", hidden, params["lm_head"].astype(dtype),
                        preferred_element_type=jnp.float32)
    return logits, new_cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def insert_slot(cache, single, slot: jax.Array):
    """Copies a one-slot cache (e.g. a prefilled request), ring state included, into slot `slot`
    of `cache`. Both caches must have the same max length."""
    new = {}
    for key, value in cache.items():
        if key == "max_length":
            new[key] = value
        elif key == "ring_positions":
            new[key] = jax.lax.dynamic_update_index_in_dim(value, single[key][0], slot, 0)
        else:
            new[key] = jax.tree.map(
                lambda big, one: jax.lax.dynamic_update_index_in_dim(big, one[:, 0], slot, 1),
                value, single[key])
    return new
