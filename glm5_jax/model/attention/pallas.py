"""The Pallas attention backend: kernels_pallas over either source of keys (Triton on NVIDIA
GPUs, Mosaic on TPUs; interpret mode elsewhere).

Over a sequence: on DSA layers gathered top-k attention in the absorbed form
(kernels_pallas.sparse_attention), on sliding-window layers flash attention; the indexer fused
with its top-k when indexer_impl is "pallas". Over pages: kernels_pallas.ragged_paged_attention,
reading each row's pages through its block table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model import kernel_calls
from glm5_jax.model.attention.pages import PagedKeys, attend_over_pages, select_over_pages
from glm5_jax.model.attention.sequence import SequenceKeys, whole_keys
from glm5_jax.model.dsa import base_mask, query_slice, select_keys
from glm5_jax.model.mla import expand_latent
from glm5_jax.parallel import constrain


class PallasAttention:
    """ExecutionOptions attention_impl / decode_attention_impl "pallas"."""

    def over_sequence(self, spec, weights, x, projected, keys: SequenceKeys, kinds, previous):
        if spec.indexer.kpool:
            raise NotImplementedError("attention_impl 'pallas' with pooled DSA (index_kpool > 0): the "
                                      "gathered top-k kernel reads per-token selections; use 'reference'")
        positions, segment_ids = keys.positions, keys.segment_ids
        latent, k_rope = whole_keys(projected)
        # No dense [B, T, S] mask unless the indexer needs one.
        allowed = None if spec.indexer.impl == "pallas" else query_slice(base_mask(positions, segment_ids,
                                                                                   *keys.whole()))
        indices, gap = select_keys(weights["indexer"], spec.indexer, x, projected.q_latent, projected.cos,
                                   projected.sin, allowed, kinds.run_indexer, previous, positions,
                                   segment_ids)
        q_nope = constrain(projected.q_nope, ("batch", "length", "heads", "head_dim"))
        heads = pallas_attention(spec, q_nope, projected.q_rope, latent, k_rope,
                                 weights["kv_b_proj"].astype(x.dtype), indices, positions, segment_ids,
                                 kinds.sliding)
        return heads, indices, gap, {}

    def over_pages(self, spec, weights, x, projected, keys: PagedKeys, kinds, previous):
        selected = select_over_pages(spec, weights, x, projected, keys, kinds, previous)
        heads = attend_over_pages(ragged_context, spec, weights, projected, keys, kinds, selected)
        return heads, selected, None, {}


def sparse_latent_attention(q_nope, q_rope, latent, k_rope, kv_b_proj, indices, positions, segment_ids):
    """DSA attention over each query's selected keys only (kernels_pallas.sparse_attention), in the
    absorbed form: Wkvb's key half folded into the query, its value half applied to the context.

    q_nope: [B, T, N, nope]; q_rope: [B, T, N, rope] (rotated); latent: [B, S, Rkv];
    k_rope: [B, S, rope] (rotated); kv_b_proj: [Rkv, N, nope + Hv]; indices: [B, T, K];
    positions, segment_ids: [B, T]. Returns [B, T, N, Hv], equal to `attend` with the
    causal & same-document & selected mask.
    """
    nope_dim = q_nope.shape[-1]
    q_absorbed = jnp.einsum("BTNH,RNH->BTNR", q_nope, kv_b_proj[..., :nope_dim])  # [B, T, N, Rkv]
    context = kernel_calls.sparse_attention(q_absorbed, q_rope, latent, k_rope, indices, positions,
                                            segment_ids, scale=(nope_dim + q_rope.shape[-1]) ** -0.5)
    return jnp.einsum("BTNR,RNH->BTNH", context, kv_b_proj[..., nope_dim:])


def pallas_attention(spec, q_nope, q_rope, latent, k_rope, kv_b_proj, indices, positions, segment_ids,
                     sliding):
    """Sparse attention on DSA layers, flash attention on sliding-window layers (`sliding`:
    Python bool, or a traced bool under a scanned stack of mixed layers). Shapes as
    `sparse_latent_attention`. Returns [B, T, N, Hv]."""
    def dsa():
        return sparse_latent_attention(q_nope, q_rope, latent, k_rope, kv_b_proj, indices, positions,
                                       segment_ids)

    def window():
        key, value = expand_latent(latent, k_rope, kv_b_proj, q_nope.shape[-1])
        query = jnp.concatenate([q_nope, q_rope], axis=-1)
        out = kernel_calls.flash_attention(query, key, value, positions, segment_ids, spec.sliding_window)
        return out.astype(value.dtype)

    if spec.sliding_window == 0 or sliding is False:
        return dsa()
    if sliding is True:
        return window()
    return jax.lax.cond(sliding, window, dsa)


def ragged_context(q_absorbed, q_rope, pools, tables, query_positions, key_positions, block_pages: int,
                   scale: float):
    """A group's latent context [B, T, N, R] float32 through the ragged paged-attention kernel:
    causal over each row's pages when key_positions is None, else over each query's key list."""
    from kernels_pallas.ragged_paged_attention import ragged_paged_mla_attention  # optional kernel

    rows, q_len = query_positions.shape
    flat = lambda a: a.reshape((rows * q_len,) + a.shape[2:])  # noqa: E731
    rope_pages = pools["k_rope"]
    if rope_pages.shape[-1] == 0:  # NoPE (GLM-5.3-Flash): the kernel's blocks need a rope part; zeros add 0
        q_rope = jnp.zeros(q_rope.shape[:-1] + (1,), q_rope.dtype)
        rope_pages = jnp.zeros(rope_pages.shape[:-1] + (1,), rope_pages.dtype)
    context = ragged_paged_mla_attention(
        flat(q_absorbed), flat(q_rope), pools["latent"], rope_pages, tables,
        jnp.arange(rows, dtype=jnp.int32) * q_len, jnp.sum(query_positions >= 0, axis=1).astype(jnp.int32),
        flat(query_positions), scale=scale, max_row_len=q_len,
        topk_positions=None if key_positions is None else flat(key_positions))
    return context.astype(jnp.float32).reshape(q_absorbed.shape)
