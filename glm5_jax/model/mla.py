"""Multi-head Latent Attention (MLA) with DSA or sliding-window key selection.

Query path: r = RMS(u Wqa) (q_lora_rank wide); q = r Wqb -> [N, nope + rope].
KV path:    c = u Wkva; latent = RMS(c[:kv_lora_rank]); k_rope = c[kv_lora_rank:] (one head);
            [k_nope, v] = latent Wkvb per head; K = [k_nope, k_rope broadcast over heads].
Scores Q.K / sqrt(qk_head_dim), softmax in float32 over the allowed keys, o = P V, out = o Wo.
With attention_impl="pallas" the same attention runs through kernels_pallas (gathered top-k
attention in the absorbed form on DSA layers, flash attention on sliding-window layers).

Context parallelism (a mesh `context` axis; the `length` rule): each device holds a slice of the
sequence. Queries, masks, scores and outputs keep that slice; the keys' side is all-gathered
where it is smallest: the per-token latent and rope key (kv_lora_rank + rope = 576 values for
GLM-5) and the indexer keys (index_head_dim), expanded into per-head keys and values locally.
Positions are the batch's global ones, so RoPE and the causal mask need nothing else.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model import kernel_calls
from glm5_jax.model.dsa import (
    Indexer,
    IndexerSpec,
    base_mask,
    query_slice,
    sliding_window_mask,
    whole_sequence,
)
from glm5_jax.model.dsa_training import attention_target, indexer_kl
from glm5_jax.model.layers import (
    apply_rope,
    declare_weight,
    mixed_einsum,
    normal_init,
    project,
    rms_norm,
    rope_angles,
)
from glm5_jax.parallel import constrain, shards


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm_eps: float
    sliding_window: int
    rope_theta: float
    initializer_range: float
    indexer: IndexerSpec
    # "reference": dense [B, T, S] masks and `attend`; "pallas": gathered top-k attention on DSA
    # layers and flash attention on sliding-window layers (`pallas_attention`).
    attention_impl: str = "reference"
    dsa_stage: str = "off"  # DSA training (dsa_training.py): "off", "dense_warmup" or "sparse"
    causal_block_size: int = 0  # ExecutionOptions.causal_block_size (`attend_causal_blocks`)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class LayerKinds:
    """Per-layer choices inside a scanned stack: a Python bool when the whole stack agrees
    (no runtime branch), else a traced bool scalar for the current layer."""

    run_indexer: bool | jax.Array
    sliding: bool | jax.Array


def attention_probs(query: jax.Array, key: jax.Array, allowed: jax.Array) -> jax.Array:
    """Masked softmax in float32. query: [B, T, N, H]; key: [B, S, N, H]; allowed: bool [B, T, S].
    Returns [B, N, T, S] float32."""
    scale = query.shape[-1] ** -0.5
    logits = mixed_einsum("BTNH,BSNH->BNTS", query, key, jnp.float32)
    logits = jnp.where(allowed[:, None], logits * scale, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)


def attend(query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array) -> jax.Array:
    """Masked softmax attention with float32 softmax.

    query: [B, T, N, H]; key: [B, S, N, H]; value: [B, S, N, Hv]; allowed: bool [B, T, S].
    Returns [B, T, N, Hv].
    """
    return attend_with(attention_probs(query, key, allowed), value)


def attend_causal_blocks(query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array,
                         block_size: int) -> jax.Array:
    """`attend` for self-attention where no query sees a later key (`allowed` causal by index):
    the queries in blocks of `block_size`, each against the keys up to its own end only, so most
    of the masked upper triangle is never computed ((n + 1) / 2n of the [T, S] work for n blocks).
    Shapes as `attend`, with S = T divisible by block_size; the same result."""
    outputs = []
    for start in range(0, query.shape[1], block_size):
        rows, end = slice(start, start + block_size), start + block_size
        outputs.append(attend(query[:, rows], key[:, :end], value[:, :end], allowed[:, rows, :end]))
    return jnp.concatenate(outputs, axis=1)


def attend_with(probs: jax.Array, value: jax.Array) -> jax.Array:
    """probs: [B, N, T, S]; value: [B, S, N, Hv] -> [B, T, N, Hv]."""
    return mixed_einsum("BNTS,BSNH->BTNH", probs.astype(value.dtype), value)


def query_path(x, q_a_proj, q_a_norm, q_b_proj, eps: float, nope_dim: int):
    """x: [B, T, D] -> (q_latent [B, T, Rq] normalised, q_nope [B, T, N, nope], q_rope [B, T, N, rope]
    not yet rotated). Weights: q_a_proj [D, Rq], q_a_norm [Rq], q_b_proj [Rq, N, nope + rope]."""
    q_latent = rms_norm(project(x, q_a_proj), q_a_norm, eps)
    query = mixed_einsum("BTR,RNH->BTNH", q_latent, q_b_proj)
    return q_latent, query[..., :nope_dim], query[..., nope_dim:]


def kv_latent(x, kv_a_proj, kv_a_norm, kv_lora_rank: int, eps: float):
    """x: [B, S, D] -> (latent [B, S, Rkv] normalised, k_rope [B, S, rope] not yet rotated): the
    per-token quantities a decode cache keeps. kv_a_proj: [D, Rkv + rope]; kv_a_norm: [Rkv]."""
    compressed = project(x, kv_a_proj)
    return rms_norm(compressed[..., :kv_lora_rank], kv_a_norm, eps), compressed[..., kv_lora_rank:]


def expand_latent(latent, k_rope, kv_b_proj, nope_dim: int):
    """Per-head keys and values from the latent. latent: [B, S, Rkv]; k_rope: [B, S, rope] (rotated);
    kv_b_proj: [Rkv, N, nope + Hv]. Returns (key [B, S, N, nope + rope], value [B, S, N, Hv])."""
    kv = mixed_einsum("BSR,RNH->BSNH", latent, kv_b_proj)
    k_nope, value = kv[..., :nope_dim], kv[..., nope_dim:]
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3] + k_rope.shape[-1:])
    return jnp.concatenate([k_nope, k_rope], axis=-1), value


def absorbed_attention(q_nope, q_rope, latent, k_rope, kv_b_proj, allowed):
    """Attention computed on the latent cache with Wkvb folded into the query and the output.

    q_nope: [B, T, N, nope]; q_rope: [B, T, N, rope] (rotated); latent: [B, S, Rkv];
    k_rope: [B, S, rope] (rotated); kv_b_proj: [Rkv, N, nope + Hv]; allowed: bool [B, T, S].
    Returns [B, T, N, Hv], equal to `attend` on `expand_latent`'s keys and values.
    """
    nope_dim = q_nope.shape[-1]
    scale = (nope_dim + q_rope.shape[-1]) ** -0.5
    q_absorbed = jnp.einsum("BTNH,RNH->BTNR", q_nope, kv_b_proj[..., :nope_dim])  # [B, T, N, Rkv]
    logits = (jnp.einsum("BTNR,BSR->BNTS", q_absorbed, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("BTNH,BSH->BNTS", q_rope, k_rope, preferred_element_type=jnp.float32))
    logits = jnp.where(allowed[:, None], logits * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(latent.dtype)
    context = jnp.einsum("BNTS,BSR->BTNR", probs, latent)  # [B, T, N, Rkv]
    return jnp.einsum("BTNR,RNH->BTNH", context, kv_b_proj[..., nope_dim:])


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


def pallas_attention(spec: AttentionSpec, q_nope, q_rope, latent, k_rope, kv_b_proj, indices, positions,
                     segment_ids, sliding):
    """attention_impl="pallas": sparse attention on DSA layers, flash attention on sliding-window
    layers (`sliding`: Python bool, or a traced bool under a scanned stack of mixed layers).
    Shapes as `sparse_latent_attention`. Returns [B, T, N, Hv]."""
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


class MLAttention(nn.Module):
    spec: AttentionSpec
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 previous_indices: jax.Array, kinds: LayerKinds):
        """x: [B, T, D] (already normalised); positions, segment_ids: [B, T];
        previous_indices: [B, T, k] top-k of the last indexer layer (reused by "shared" layers).

        Returns (out [B, T, D], topk indices [B, T, k], selection boundary gap [B, T]).
        """
        spec = self.spec
        dtype = x.dtype
        if x.shape[1] % shards("length") and not self.is_initializing():  # (init traces 2 positions)
            raise ValueError(f"context parallelism: the sequence length {x.shape[1]} does not split "
                             f"evenly over the {shards('length')} devices of the `length` axis "
                             "(mesh axis `context`)")
        init = normal_init(spec.initializer_range)
        weight = lambda name, shape, axes, **kw: declare_weight(  # noqa: E731
            self, name, shape, axes, self.param_dtype, kw.get("init", init)).astype(dtype)
        ones = nn.initializers.ones
        heads = spec.num_heads
        q_a_proj = weight("q_a_proj", (spec.hidden_size, spec.q_lora_rank), ("embed", "q_lora"))
        q_a_norm = weight("q_a_norm", (spec.q_lora_rank,), ("norm",), init=ones)
        q_b_proj = weight("q_b_proj", (spec.q_lora_rank, heads, spec.qk_head_dim),
                          ("q_lora", "heads", "head_dim"))
        kv_a_proj = weight("kv_a_proj", (spec.hidden_size, spec.kv_lora_rank + spec.qk_rope_head_dim),
                           ("embed", "kv_lora"))
        kv_a_norm = weight("kv_a_norm", (spec.kv_lora_rank,), ("norm",), init=ones)
        kv_b_proj = weight("kv_b_proj", (spec.kv_lora_rank, heads, spec.qk_nope_head_dim + spec.v_head_dim),
                           ("kv_lora", "heads", "head_dim"))
        o_proj = weight("o_proj", (heads, spec.v_head_dim, spec.hidden_size),
                        ("heads", "head_dim", "embed"))

        q_latent, q_nope, q_rope = query_path(x, q_a_proj, q_a_norm, q_b_proj, spec.latent_norm_eps,
                                              spec.qk_nope_head_dim)
        latent, k_rope = kv_latent(x, kv_a_proj, kv_a_norm, spec.kv_lora_rank, spec.latent_norm_eps)
        cos, sin = rope_angles(positions, spec.qk_rope_head_dim, spec.rope_theta)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope, cos, sin)
        # Context parallelism: the keys' side whole on every device (see the module docstring).
        latent, k_rope = whole_sequence(latent), whole_sequence(k_rope)
        key_positions, key_segment_ids = whole_sequence(positions), whole_sequence(segment_ids)
        indexer = Indexer(spec.indexer, self.param_dtype, name="indexer")
        if spec.attention_impl == "pallas":  # no dense [B, T, S] mask unless the indexer needs one
            allowed = (None if spec.indexer.impl == "pallas"
                       else query_slice(base_mask(positions, segment_ids, key_positions, key_segment_ids)))
            indices, gap = indexer(x, q_latent, cos, sin, allowed, kinds.run_indexer, previous_indices,
                                   positions, segment_ids)
            out = pallas_attention(spec, constrain(q_nope, ("batch", "length", "heads", "head_dim")),
                                   q_rope, latent, k_rope, kv_b_proj, indices, positions, segment_ids,
                                   kinds.sliding)
            return jnp.einsum("BTNH,NHD->BTD", out, o_proj), indices, gap
        query = constrain(jnp.concatenate([q_nope, q_rope], axis=-1),
                          ("batch", "length", "heads", "head_dim"))
        key, value = expand_latent(latent, k_rope, kv_b_proj, spec.qk_nope_head_dim)

        # Which keys each query may see: [B, T, S], this device's queries against every key. Causal
        # by index as well as by position (as in the reference), which `attend_causal_blocks` needs.
        length = x.shape[1]
        by_index = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
        causal = query_slice(base_mask(positions, segment_ids, key_positions, key_segment_ids) & by_index)
        training_dsa = spec.dsa_stage != "off"
        indices, gap, top_k, *scores = indexer(x, q_latent, cos, sin, causal, kinds.run_indexer,
                                               previous_indices, positions, segment_ids,
                                               with_scores=training_dsa, with_mask=True)
        # The dense warm-up attends to every causal key; otherwise DSA layers attend to the top-k.
        dsa_allowed = causal if spec.dsa_stage == "dense_warmup" else top_k
        if spec.sliding_window > 0 and kinds.sliding is not False:
            window_allowed = causal & sliding_window_mask(positions, spec.sliding_window, key_positions)
            allowed = jnp.where(kinds.sliding, window_allowed, dsa_allowed)
        else:
            allowed = dsa_allowed

        block_size = spec.causal_block_size
        blocked = 0 < block_size < length and length % block_size == 0
        if blocked and not training_dsa and shards("length") == 1:
            out = attend_causal_blocks(query, key, value, allowed, block_size)  # [B, T, N, Hv]
        else:  # one [T, S] block (the DSA KL reads the whole distribution)
            probs = constrain(attention_probs(query, key, allowed),
                              ("batch", "heads", "length", None))  # [B, N, T, S]
            if training_dsa:
                self._sow_indexer_kl(probs, scores[0], dsa_allowed, top_k, kinds)
            out = attend_with(probs, value)  # [B, T, N, Hv]
        out = mixed_einsum("BTNH,NHD->BTD", out, o_proj)
        return out, indices, gap

    def _sow_indexer_kl(self, probs, scores, dsa_allowed, selected, kinds: LayerKinds):
        """Sows the indexer KL and top-k recall sums of this layer (zero on layers that reuse
        another layer's selection or slide a window); see dsa_training.py."""
        kl_sum, recall_sum, queries = indexer_kl(attention_target(probs), scores, dsa_allowed, selected)
        counts = jnp.asarray(kinds.run_indexer, jnp.float32) * (1.0 - jnp.asarray(kinds.sliding, jnp.float32))
        self.sow("intermediates", "indexer_kl_sum", kl_sum * counts)
        self.sow("intermediates", "indexer_recall_sum", recall_sum * counts)
        self.sow("intermediates", "indexer_queries", queries * counts)
