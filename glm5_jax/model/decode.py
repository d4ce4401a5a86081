"""Incremental decoding on the MLA latent cache, the path a server runs.

Per layer and token the cache holds only what MLA and DSA need later: the normalised latent
(kv_lora_rank), the rotated shared rope key (qk_rope_head_dim) and the indexer key
(index_head_dim); never per-head keys or values. Attention runs on the latent with Wkvb
absorbed into the query and the output (`absorbed_attention`). `decode_step` handles a chunk
of C new tokens for each of S cache slots at their own positions, so one function serves
prefill (C = prompt bucket) and decode (C = 1); in exact arithmetic its logits equal
`forward`'s rows.
"""

from __future__ import annotations

import functools

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
from glm5_jax.model.moe import route, routed_experts_blocked, routed_experts_dense, routed_experts_ragged
from glm5_jax.model.transformer import moe_spec

STACKS = ("dense_layers", "moe_layers")
ROUTED = {"dense": routed_experts_dense, "blocked": routed_experts_blocked,
          "ragged": routed_experts_ragged}


def _stack_sizes(config: ModelConfig) -> dict[str, int]:
    sizes = {"dense_layers": config.num_dense_layers, "moe_layers": config.num_moe_layers}
    return {name: size for name, size in sizes.items() if size}


def init_cache(config: ModelConfig, num_slots: int, max_length: int, dtype=None):
    """Zeroed cache: {stack: {"latent": [L, S, M, kv_lora_rank], "k_rope": [L, S, M, rope],
    "index_keys": [L, S, M, index_head_dim]}} for S slots of M positions."""
    dtype = dtype or config.compute_dtype
    widths = {"latent": config.kv_lora_rank, "k_rope": config.qk_rope_head_dim,
              "index_keys": config.index_head_dim}
    return {stack: {name: jnp.zeros((layers, num_slots, max_length, width), dtype)
                    for name, width in widths.items()}
            for stack, layers in _stack_sizes(config).items()}


def cache_bytes_per_token(config: ModelConfig, dtype=None) -> int:
    """Cache bytes one token occupies across all layers."""
    width = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    return config.num_layers * width * jnp.dtype(dtype or config.compute_dtype).itemsize


def _write(cache: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """cache: [S, M, F]; values: [S, C, F] stored at positions [S, C] (out-of-range ones dropped)."""
    slots = jnp.broadcast_to(jnp.arange(cache.shape[0])[:, None], positions.shape)
    return cache.at[slots, positions].set(values.astype(cache.dtype), mode="drop")


def _attention(config: ModelConfig, weights, cache, x, positions, previous_indices, run_indexer,
               sliding):
    """One layer's attention for new tokens x [S, C, D] (normalised); returns (out [S, C, D],
    top-k indices [S, C, k], updated layer cache)."""
    dtype = x.dtype
    w = {name: value.astype(dtype) for name, value in weights.items() if name != "indexer"}
    q_latent, q_nope, q_rope = query_path(x, w["q_a_proj"], w["q_a_norm"], w["q_b_proj"],
                                          config.latent_norm_eps, config.qk_nope_head_dim)
    latent, k_rope = kv_latent(x, w["kv_a_proj"], w["kv_a_norm"], config.kv_lora_rank,
                               config.latent_norm_eps)
    cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
    q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
    indexer = weights["indexer"]
    keys = indexer_keys(x, cos, sin, indexer["wk"], indexer["k_norm_scale"], indexer["k_norm_bias"],
                        config.qk_rope_head_dim, config.index_norm_eps)
    cache = {"latent": _write(cache["latent"], latent, positions),
             "k_rope": _write(cache["k_rope"], k_rope, positions),
             "index_keys": _write(cache["index_keys"], keys, positions)}

    max_length = cache["latent"].shape[1]
    allowed = jnp.arange(max_length)[None, None, :] <= positions[:, :, None]  # [S, C, M] causal

    def run():
        queries = indexer_queries(q_latent, cos, sin, indexer["wq_b"], config.qk_rope_head_dim)
        scores = combine_index_scores(x, queries, cache["index_keys"], indexer["weights_proj"])
        return select_topk(scores, allowed, config.index_topk)[0]

    indices = (run() if run_indexer else previous_indices) if isinstance(run_indexer, bool) else (
        jax.lax.cond(run_indexer, run, lambda: previous_indices))
    dsa_allowed = allowed & selection_mask(indices, max_length)
    if config.sliding_window > 0 and sliding is not False:
        window = positions[:, :, None] - jnp.arange(max_length)[None, None, :] < config.sliding_window
        allowed = jnp.where(sliding, allowed & window, dsa_allowed)
    else:
        allowed = dsa_allowed
    out = absorbed_attention(q_nope, q_rope, cache["latent"], cache["k_rope"], w["kv_b_proj"], allowed)
    return jnp.einsum("SCNH,NHD->SCD", out, w["o_proj"]), indices, cache


def _feed_forward(config: ModelConfig, layer, x, ffn: str):
    """x: [S, C, D] normalised -> [S, C, D]."""
    if ffn == "dense":
        mlp = layer["mlp"]
        return swiglu_mlp(x, mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
    moe, spec = layer["moe"], moe_spec(config)
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts, _ = route(tokens, moe["router"], moe["router_bias"], spec)
    y = ROUTED[spec.impl](tokens, weights, experts, moe["gate_proj"], moe["up_proj"], moe["down_proj"])
    y = y.reshape(x.shape)
    if config.num_shared_experts:
        shared = moe["shared_experts"]
        y = y + swiglu_mlp(x, shared["gate_proj"], shared["up_proj"], shared["down_proj"])
    return y


def _stack_flags(config: ModelConfig, stack: str):
    first = 0 if stack == "dense_layers" else config.num_dense_layers
    layers = range(first, first + _stack_sizes(config)[stack])
    run = [config.attention_types[i] == "dsa" and config.indexer_types[i] == "full" for i in layers]
    sliding = [config.attention_types[i] == "sliding_window" for i in layers]
    uniform = lambda flags: flags[0] if len(set(flags)) == 1 else None  # noqa: E731
    return jnp.asarray(run), jnp.asarray(sliding), uniform(run), uniform(sliding)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def decode_step(config: ModelConfig, params, cache, tokens: jax.Array, positions: jax.Array):
    """Runs C new tokens per slot through the model, reading and extending the cache.

    tokens, positions: [S, C] int32 (positions of each slot's new tokens; a slot's cache entries
    below its first new position must hold that sequence's earlier tokens). Returns
    (logits [S, C, vocab] float32, updated cache). Positions >= the cache length are dropped.
    """
    dtype = config.compute_dtype
    x = params["embed"][tokens].astype(dtype)
    max_length = next(iter(cache.values()))["latent"].shape[2]
    indices = jnp.zeros(tokens.shape + (min(config.index_topk, max_length),), jnp.int32)
    new_cache = {}
    for stack in _stack_sizes(config):
        run, sliding, uniform_run, uniform_sliding = _stack_flags(config, stack)
        ffn = "dense" if stack == "dense_layers" else "moe"

        def layer_step(carry, layer_inputs, ffn=ffn, uniform_run=uniform_run,
                       uniform_sliding=uniform_sliding):
            x, previous = carry
            layer, layer_cache, run_flag, sliding_flag = layer_inputs
            normed = rms_norm(x, layer["input_norm"]["scale"], config.rms_norm_eps)
            attended, indices, layer_cache = _attention(
                config, layer["attention"], layer_cache, normed, positions, previous,
                run_flag if uniform_run is None else uniform_run,
                sliding_flag if uniform_sliding is None else uniform_sliding)
            x = x + attended
            normed = rms_norm(x, layer["post_attention_norm"]["scale"], config.rms_norm_eps)
            x = x + _feed_forward(config, layer, normed, ffn)
            return (x, indices), layer_cache

        (x, indices), new_cache[stack] = jax.lax.scan(
            layer_step, (x, indices), (params[stack], cache[stack], run, sliding))
    hidden = rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps)
    logits = jnp.einsum("SCD,DV->SCV", hidden, params["lm_head"].astype(dtype),
                        preferred_element_type=jnp.float32)
    return logits, new_cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def insert_slot(cache, single, slot: jax.Array):
    """Copies a one-slot cache (e.g. a prefilled request) into slot `slot` of `cache`.
    Both caches must have the same max length."""
    return jax.tree.map(lambda big, one: jax.lax.dynamic_update_index_in_dim(big, one[:, 0], slot, 1),
                        cache, single)
