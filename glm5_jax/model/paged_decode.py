"""One model step over a flat batch of tokens on a paged latent cache (what the engine runs).

The cache is a pool of fixed-size pages shared by all sequences, per layer stack
(dense_layers, moe_layers): {"latent": [L, P, page, Rkv], "k_rope": [L, P, page, rope] and,
when any layer is DSA, "index_keys": [L, P, page, H]}; P = num_pages. A sequence owns a list of
pages, its block table: cache position p lives in page block_table[p // page], row p % page.

`paged_step` runs T tokens that may belong to different sequences: decode tokens (one per
running sequence) and prefill chunks side by side. Each token carries its position (-1 =
padding: no cache write, output ignored) and its sequence's block-table row. Per layer, all new
latents are first written into their pages, then every token attends over its own sequence's
cache positions <= its position, so a token sees the tokens written before it in the same step.
Attention is absorbed MLA; DSA layers select top-k keys from the cached indexer keys;
sliding-window layers use the same pages masked to the last `sliding_window` positions (pages
outside the window are not freed: a sliding layer costs as much cache as a DSA layer here).
Logits are computed only for `sample_rows`.

`ModelConfig.decode_attention_impl` picks the attention: "reference" (jnp; gathers each
token's pages into a contiguous [S = max_pages * page] view) or "pallas"
(kernels_pallas.mla_decode, reading the pages through the block table).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.decode import _feed_forward, _project, _stack_kinds, _stack_layers, _stack_sizes
from glm5_jax.model.dsa import (
    combine_index_scores,
    indexer_keys,
    indexer_queries,
    select_topk,
    selection_mask,
)
from glm5_jax.model.layers import rms_norm
from glm5_jax.model.mla import absorbed_attention


def _has_dsa(config: ModelConfig, stack: str) -> bool:
    return any(config.attention_types[i] != "sliding_window" for i in _stack_layers(config, stack))


def init_paged_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=None):
    """Zeroed page pool: {stack: {"latent": [L, P, page, Rkv], "k_rope": [L, P, page, rope],
    "index_keys": [L, P, page, H] (stacks with a DSA layer only)}}."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
    dtype = dtype or config.compute_dtype
    widths = {"latent": config.kv_lora_rank, "k_rope": config.qk_rope_head_dim,
              "index_keys": config.index_head_dim}
    cache = {}
    for stack, size in _stack_sizes(config).items():
        names = ("latent", "k_rope", "index_keys") if _has_dsa(config, stack) else ("latent", "k_rope")
        cache[stack] = {name: jnp.zeros((size, num_pages, page_size, widths[name]), dtype) for name in names}
    return cache


def paged_cache_bytes_per_page(config: ModelConfig, page_size: int, dtype=None) -> int:
    """Bytes one page occupies across all layers."""
    itemsize = jnp.dtype(dtype or config.compute_dtype).itemsize
    total = 0
    for stack, size in _stack_sizes(config).items():
        width = config.kv_lora_rank + config.qk_rope_head_dim
        width += config.index_head_dim if _has_dsa(config, stack) else 0
        total += size * width
    return total * page_size * itemsize


def _write_pages(pages, values, page_index, row):
    """pages: [P, page, F]; values: [T, F] to (page_index [T], row [T]); index P drops the write."""
    return pages.at[page_index, row].set(values.astype(pages.dtype), mode="drop")


def _gather(pages, block_tables):
    """pages: [P, page, F]; block_tables: [T, max_pages] -> each token's contiguous view [T, S, F]."""
    view = pages[block_tables]  # [T, max_pages, page, F]
    return view.reshape(view.shape[0], -1, view.shape[-1])


def _window_positions(positions, window: int):
    """The cache positions a sliding-window query sees, as a top-k list: [T] -> [T, 1, window]
    (-1 = none)."""
    keys = positions[:, None] - jnp.arange(window)[None]
    return jnp.where((keys >= 0) & (positions[:, None] >= 0), keys, -1)[:, None, :].astype(jnp.int32)


def _pallas_context(config: ModelConfig, q_nope, q_rope, kv_b_proj, layer_cache, block_tables, positions,
                    topk_positions):
    """Absorbed attention through kernels_pallas.mla_decode; returns [T, 1, N, Hv]."""
    from kernels_pallas.mla_decode import mla_decode_attention  # lazy: optional kernel

    nope_dim = q_nope.shape[-1]
    q_absorbed = jnp.einsum("BTNH,RNH->BTNR", q_nope, kv_b_proj[..., :nope_dim])  # [T, 1, N, Rkv]
    context = mla_decode_attention(
        q_absorbed, q_rope, layer_cache["latent"], layer_cache["k_rope"], block_tables,
        positions[:, None], scale=(nope_dim + q_rope.shape[-1]) ** -0.5, topk_positions=topk_positions)
    context = context.astype(q_nope.dtype)
    return jnp.einsum("BTNR,RNH->BTNH", context, kv_b_proj[..., nope_dim:])


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def paged_step(config: ModelConfig, params, cache, tokens, positions, block_tables, sample_rows):
    """Runs a flat batch of T tokens through the model on the paged cache.

    tokens, positions: [T] int32 (position -1 = padding); block_tables: [T, max_pages] int32, the
    page list of each token's sequence (entries past the sequence's pages are ignored);
    sample_rows: [G] int32, the token indices whose logits are wanted. A sequence's pages must
    hold its positions before its first token in this step. Returns (logits [G, vocab] float32,
    updated cache).
    """
    dtype = config.compute_dtype
    num_tokens = tokens.shape[0]
    any_stack = next(iter(cache.values()))
    num_pages, page_size = any_stack["latent"].shape[1:3]
    max_keys = block_tables.shape[1] * page_size
    valid = positions >= 0
    page_of_position = jnp.maximum(positions, 0)[:, None] // page_size
    page_index = jnp.take_along_axis(block_tables, page_of_position, axis=1)[:, 0]
    page_index = jnp.where(valid, page_index, num_pages)  # padding: out of range, write dropped
    row = jnp.maximum(positions, 0) % page_size
    causal = jnp.arange(max_keys)[None, :] <= positions[:, None]  # [T, S]; all False for padding
    window = config.sliding_window
    window_allowed = causal & (positions[:, None] - jnp.arange(max_keys)[None, :] < max(window, 1))
    topk = min(config.index_topk, max_keys)
    pallas = config.decode_attention_impl == "pallas"

    x = params["embed"][tokens].astype(dtype)[:, None, :]  # [T, 1, D]: B = tokens, one query each
    indices = jnp.zeros((num_tokens, 1, topk), jnp.int32)
    new_cache = {}
    for stack in _stack_sizes(config):
        kinds = _stack_kinds(config, stack)
        ffn = "dense" if stack == "dense_layers" else "moe"
        has_dsa = kinds.mode != "ring"

        def layer_step(carry, layer_inputs, ffn=ffn, kinds=kinds, has_dsa=has_dsa):
            x, previous = carry
            layer, layer_cache, run_flag, sliding_flag = layer_inputs
            normed = rms_norm(x, layer["input_norm"]["scale"], config.rms_norm_eps)
            weights = layer["attention"]
            w = {name: value.astype(dtype) for name, value in weights.items() if name != "indexer"}
            p = _project(config, w, normed, positions[:, None])
            layer_cache = dict(layer_cache)
            layer_cache["latent"] = _write_pages(layer_cache["latent"], p.latent[:, 0], page_index, row)
            layer_cache["k_rope"] = _write_pages(layer_cache["k_rope"], p.k_rope[:, 0], page_index, row)

            selected = previous
            if has_dsa:
                indexer = weights["indexer"]
                keys = indexer_keys(normed, p.cos, p.sin, indexer["wk"], indexer["k_norm_scale"],
                                    indexer["k_norm_bias"], config.qk_rope_head_dim, config.index_norm_eps)
                layer_cache["index_keys"] = _write_pages(layer_cache["index_keys"], keys[:, 0], page_index,
                                                         row)

                def run():
                    queries = indexer_queries(p.q_latent, p.cos, p.sin, indexer["wq_b"],
                                              config.qk_rope_head_dim)
                    keys = _gather(layer_cache["index_keys"], block_tables)  # [T, S, H]
                    scores = combine_index_scores(normed, queries, keys, indexer["weights_proj"])  # [T, 1, S]
                    return select_topk(scores, causal[:, None], topk)[0]

                run_now = run_flag if kinds.uniform_run is None else kinds.uniform_run
                if isinstance(run_now, bool):
                    selected = run() if run_now else previous
                else:
                    selected = jax.lax.cond(run_now, run, lambda: previous)

            sliding = sliding_flag if kinds.mode == "mixed" else kinds.mode == "ring"
            if pallas:
                dsa_topk = jnp.where(jnp.take_along_axis(causal[:, None], selected, axis=-1), selected, -1)
                if kinds.mode == "full":
                    topk_positions = dsa_topk
                else:
                    window_topk = _window_positions(positions, window)
                    if kinds.mode == "ring":
                        topk_positions = window_topk
                    else:  # mixed: pad both lists to one width, pick per layer
                        width = max(topk, window)
                        pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, width - a.shape[-1])),  # noqa: E731
                                                constant_values=-1)
                        topk_positions = jnp.where(sliding, pad(window_topk), pad(dsa_topk))
                out = _pallas_context(config, p.q_nope, p.q_rope, w["kv_b_proj"], layer_cache, block_tables,
                                      positions, topk_positions)
            else:
                allowed = window_allowed[:, None]  # [T, 1, S]
                if has_dsa:
                    dsa_allowed = causal[:, None] & selection_mask(selected, max_keys)
                    mixed = kinds.mode == "mixed"
                    allowed = jnp.where(sliding, allowed, dsa_allowed) if mixed else dsa_allowed
                out = absorbed_attention(p.q_nope, p.q_rope, _gather(layer_cache["latent"], block_tables),
                                         _gather(layer_cache["k_rope"], block_tables), w["kv_b_proj"],
                                         allowed)
            x = x + jnp.einsum("BTNH,NHD->BTD", out, w["o_proj"])
            normed = rms_norm(x, layer["post_attention_norm"]["scale"], config.rms_norm_eps)
            x = x + _feed_forward(config, layer, normed, ffn)
            return (x, selected), layer_cache

        (x, indices), new_cache[stack] = jax.lax.scan(
            layer_step, (x, indices), (params[stack], cache[stack], kinds.run, kinds.sliding))
    hidden = rms_norm(x[sample_rows, 0], params["final_norm"]["scale"], config.rms_norm_eps)  # [G, D]
    logits = jnp.einsum("GD,DV->GV", hidden, params["lm_head"].astype(dtype),
                        preferred_element_type=jnp.float32)
    return logits, new_cache


@jax.jit
def read_page(cache, page):
    """One page of every layer: {stack: {name: [L, page, F]}} (for offload to host memory)."""
    return jax.tree.map(lambda pages: jax.lax.dynamic_index_in_dim(pages, page, 1, keepdims=False), cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def write_page(cache, page, values):
    """Stores `values` ({stack: {name: [L, page, F]}}, as from `read_page`) into page `page`."""
    return jax.tree.map(lambda pages, one: jax.lax.dynamic_update_index_in_dim(
        pages, one.astype(pages.dtype), page, 1), cache, values)
