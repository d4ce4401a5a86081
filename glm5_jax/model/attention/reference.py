"""The reference attention backend: plain jnp over either source of keys (runs everywhere).

Over a sequence: dense [B, T, S] masks (causal by position and index, same document, the DSA
top-k or the sliding window) and `mla.attend` on the expanded per-head keys and values, with
the DSA training stages' indexer KL. Over pages: the absorbed form, streamed over each row's
pages with an online softmax (causal) or gathered per query (selected keys, window).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model.attention.pages import (
    PagedKeys,
    attend_over_pages,
    gather_positions,
    num_blocks,
    row_block,
    select_over_pages,
)
from glm5_jax.model.attention.sequence import SequenceKeys, whole_keys
from glm5_jax.model.dsa import base_mask, query_slice, select_keys, selection_mask_local, sliding_window_mask
from glm5_jax.model.dsa_training import attention_target, indexer_kl
from glm5_jax.model.mla import attend_causal_blocks, attend_with, attention_probs, expand_latent
from glm5_jax.model.pooled_dsa import pooled_select_keys
from glm5_jax.parallel import constrain, shards


class ReferenceAttention:
    """ExecutionOptions attention_impl / decode_attention_impl "reference"."""

    def over_sequence(self, spec, weights, x, projected, keys: SequenceKeys, kinds, previous):
        positions, segment_ids = keys.positions, keys.segment_ids
        latent, k_rope = whole_keys(projected)
        key_positions, key_segment_ids = keys.whole()
        query = constrain(jnp.concatenate([projected.q_nope, projected.q_rope], axis=-1),
                          ("batch", "length", "heads", "head_dim"))
        key, value = expand_latent(latent, k_rope, weights["kv_b_proj"].astype(x.dtype),
                                   spec.qk_nope_head_dim)

        # Which keys each query may see: [B, T, S], this device's queries against every key. Causal
        # by index as well as by position (as in the reference), which `attend_causal_blocks` needs.
        length = x.shape[1]
        by_index = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
        causal = query_slice(base_mask(positions, segment_ids, key_positions, key_segment_ids) & by_index)
        training_dsa = spec.dsa_stage != "off"
        if spec.indexer.kpool:
            indices, gap, top_k = pooled_keys(spec, weights["indexer"], x, projected, keys, kinds, previous,
                                              causal)
            scores = []
        else:
            indices, gap, top_k, *scores = select_keys(
                weights["indexer"], spec.indexer, x, projected.q_latent, projected.cos, projected.sin, causal,
                kinds.run_indexer, previous, positions, segment_ids, with_scores=training_dsa, with_mask=True)
        # The dense warm-up attends to every causal key; otherwise DSA layers attend to the top-k.
        dsa_allowed = causal if spec.dsa_stage == "dense_warmup" else top_k
        if spec.sliding_window > 0 and kinds.sliding is not False:
            window_allowed = causal & sliding_window_mask(positions, spec.sliding_window, key_positions)
            allowed = jnp.where(kinds.sliding, window_allowed, dsa_allowed)
        else:
            allowed = dsa_allowed

        stats = {}
        block_size = spec.causal_block_size
        blocked = 0 < block_size < length and length % block_size == 0
        if blocked and not training_dsa and shards("length") == 1:
            heads = attend_causal_blocks(query, key, value, allowed, block_size)  # [B, T, N, Hv]
        else:  # one [T, S] block (the DSA KL reads the whole distribution)
            probs = constrain(attention_probs(query, key, allowed), ("batch", "heads", "length", None))
            if training_dsa:
                stats = indexer_kl_sums(probs, scores[0], dsa_allowed, top_k, kinds)
            heads = attend_with(probs, value)  # [B, T, N, Hv]
        return heads, indices, gap, stats

    def over_pages(self, spec, weights, x, projected, keys: PagedKeys, kinds, previous):
        selected = select_over_pages(spec, weights, x, projected, keys, kinds, previous)
        heads = attend_over_pages(paged_context, spec, weights, projected, keys, kinds, selected)
        return heads, selected, None, {}


def pooled_keys(spec, weights, x, projected, keys: SequenceKeys, kinds, previous, causal):
    """Pooled DSA's selection over a sequence (GLM-5.3-Flash, pooled_dsa.py) on layers that run
    the indexer; others reuse `previous` (a key list, -1 = none). Returns (key list [B, T, K'],
    boundary gap [B, T], the selection as a mask [B, T, S] within `causal`)."""
    if spec.dsa_stage != "off" or spec.indexer.impl != "reference":
        raise NotImplementedError("pooled DSA (index_kpool > 0) runs with dsa_stage 'off' and "
                                  "indexer_impl 'reference' (no indexer KL or fused kernel over pools yet)")
    indexer = spec.indexer

    def run_indexer():
        selected, gap, indices = pooled_select_keys(
            weights, x, projected.q_latent, keys.positions, keys.segment_ids, index_topk=indexer.index_topk,
            kpool=indexer.kpool, always_select_tail=indexer.always_select_tail,
            norm_eps=indexer.index_norm_eps, with_indices=True)
        return indices, gap, selected & causal

    def reuse_previous():
        return (previous, jnp.full(x.shape[:2], jnp.inf, jnp.float32),
                causal & selection_mask_local(previous, causal.shape[-1]))

    if isinstance(kinds.run_indexer, bool):
        return run_indexer() if kinds.run_indexer else reuse_previous()
    return jax.lax.cond(kinds.run_indexer, run_indexer, reuse_previous)


def indexer_kl_sums(probs, scores, dsa_allowed, selected, kinds) -> dict[str, jax.Array]:
    """The indexer KL and top-k recall sums of a layer (zero on layers that reuse another
    layer's selection or slide a window), to sow; see dsa_training.py."""
    kl_sum, recall_sum, queries = indexer_kl(attention_target(probs), scores, dsa_allowed, selected)
    counts = jnp.asarray(kinds.run_indexer, jnp.float32) * (1.0 - jnp.asarray(kinds.sliding, jnp.float32))
    return {"indexer_kl_sum": kl_sum * counts, "indexer_recall_sum": recall_sum * counts,
            "indexer_queries": queries * counts}


def paged_context(q_absorbed, q_rope, pools, tables, query_positions, key_positions, block_pages: int,
                  scale: float):
    """A group's latent context [B, T, N, R] float32: causal over each row's pages when
    key_positions is None, else over each query's key list (pages.GroupContext)."""
    if key_positions is None:
        return streamed_causal_attention(q_absorbed, q_rope, pools["latent"], pools["k_rope"], tables,
                                         query_positions, block_pages, scale)
    return selected_attention(q_absorbed, q_rope, pools["latent"], pools["k_rope"], tables, key_positions,
                              scale)


def streamed_causal_attention(q_absorbed, q_rope, latent_pages, rope_pages, tables, query_positions,
                               block_pages: int, scale: float):
    """Causal absorbed attention over each row's pages with an online softmax.

    q_absorbed [B, T, N, R]; q_rope [B, T, N, r]; tables [B, W]; query_positions [B, T] (-1 =
    padding). Returns the latent context [B, T, N, R] float32 (0 for padding queries).
    """
    rows, q_len, heads, _ = q_absorbed.shape
    block_size = block_pages * latent_pages.shape[1]

    def body(block, carry):
        running_max, denominator, context = carry
        latent = row_block(latent_pages, tables, block, block_pages).astype(q_absorbed.dtype)  # [B, S, R]
        k_rope = row_block(rope_pages, tables, block, block_pages).astype(q_rope.dtype)
        logits = (jnp.einsum("BTNR,BSR->BTNS", q_absorbed, latent, preferred_element_type=jnp.float32)
                  + jnp.einsum("BTNH,BSH->BTNS", q_rope, k_rope, preferred_element_type=jnp.float32)) * scale
        key_positions = block * block_size + jnp.arange(block_size)
        allowed = (key_positions[None, None, :] <= query_positions[:, :, None])[:, :, None, :]
        logits = jnp.where(allowed, logits, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        correction = jnp.exp(running_max - safe_max)
        probs = jnp.exp(logits - safe_max[..., None])
        denominator = denominator * correction + jnp.sum(probs, axis=-1)
        context = context * correction[..., None] + jnp.einsum(
            "BTNS,BSR->BTNR", probs.astype(latent.dtype), latent, preferred_element_type=jnp.float32)
        return new_max, denominator, context

    init = (jnp.full((rows, q_len, heads), -jnp.inf, jnp.float32),
            jnp.zeros((rows, q_len, heads), jnp.float32), jnp.zeros(q_absorbed.shape, jnp.float32))
    _, denominator, context = jax.lax.fori_loop(0, num_blocks(query_positions, block_size), body, init)
    return context / jnp.maximum(denominator, jnp.finfo(jnp.float32).tiny)[..., None]


def selected_attention(q_absorbed, q_rope, latent_pages, rope_pages, tables, key_positions, scale: float):
    """Absorbed attention over each query's own key list. key_positions [B, T, K] (-1 = none).
    Returns the latent context [B, T, N, R] float32 (0 where a query has no key)."""
    latent = gather_positions(latent_pages, tables, key_positions).astype(q_absorbed.dtype)  # [G, Q, K, R]
    k_rope = gather_positions(rope_pages, tables, key_positions).astype(q_rope.dtype)
    logits = (jnp.einsum("BTNR,BTKR->BTNK", q_absorbed, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("BTNH,BTKH->BTNK", q_rope, k_rope, preferred_element_type=jnp.float32)) * scale
    allowed = (key_positions >= 0)[:, :, None, :]
    logits = jnp.where(allowed, logits, -jnp.inf)
    safe_max = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), jnp.finfo(jnp.float32).min)
    probs = jnp.where(allowed, jnp.exp(logits - safe_max), 0.0)
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return jnp.einsum("BTNK,BTKR->BTNR", probs.astype(latent.dtype), latent,
                      preferred_element_type=jnp.float32)
