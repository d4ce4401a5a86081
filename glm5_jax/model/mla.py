"""Multi-head Latent Attention (MLA) with DSA or sliding-window key selection.

Query path: r = RMS(u Wqa) (q_lora_rank wide); q = r Wqb -> [N, nope + rope].
KV path:    c = u Wkva; latent = RMS(c[:kv_lora_rank]); k_rope = c[kv_lora_rank:] (one head);
            [k_nope, v] = latent Wkvb per head; K = [k_nope, k_rope broadcast over heads].
Scores Q.K / sqrt(qk_head_dim), softmax in float32 over the allowed keys, o = P V, out = o Wo.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model.dsa import (
    Indexer,
    IndexerSpec,
    base_mask,
    selection_mask,
    sliding_window_mask,
)
from glm5_jax.model.layers import apply_rope, declare_weight, normal_init, rms_norm, rope_angles
from glm5_jax.parallel import constrain


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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class LayerKinds:
    """Per-layer choices inside a scanned stack: a Python bool when the whole stack agrees
    (no runtime branch), else a traced bool scalar for the current layer."""

    run_indexer: bool | jax.Array
    sliding: bool | jax.Array


def attend(query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array) -> jax.Array:
    """Masked softmax attention with float32 softmax.

    query: [B, T, N, H]; key: [B, S, N, H]; value: [B, S, N, Hv]; allowed: bool [B, T, S].
    Returns [B, T, N, Hv].
    """
    scale = query.shape[-1] ** -0.5
    logits = jnp.einsum("BTNH,BSNH->BNTS", query, key, preferred_element_type=jnp.float32)
    logits = jnp.where(allowed[:, None], logits * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", probs, value)


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

        # Query path.
        q_latent = rms_norm(x @ q_a_proj, q_a_norm, spec.latent_norm_eps)  # [B, T, Rq]
        query = jnp.einsum("BTR,RNH->BTNH", q_latent, q_b_proj)
        query = constrain(query, ("batch", "length", "heads", "head_dim"))
        q_nope, q_rope = jnp.split(query, [spec.qk_nope_head_dim], axis=-1)

        # KV path: one normalised latent and one rope key per token, shared by all heads.
        compressed = x @ kv_a_proj  # [B, S, Rkv + rope]
        latent = rms_norm(compressed[..., : spec.kv_lora_rank], kv_a_norm, spec.latent_norm_eps)
        k_rope = compressed[..., spec.kv_lora_rank :]  # [B, S, rope]

        cos, sin = rope_angles(positions, spec.qk_rope_head_dim, spec.rope_theta)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope, cos, sin)

        kv = jnp.einsum("BSR,RNH->BSNH", latent, kv_b_proj)
        k_nope, value = jnp.split(kv, [spec.qk_nope_head_dim], axis=-1)
        key = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3] + k_rope.shape[-1:])],
            axis=-1)
        query = jnp.concatenate([q_nope, q_rope], axis=-1)

        # Which keys each query may see.
        allowed = base_mask(positions, segment_ids)  # [B, T, S]
        indices, gap = Indexer(spec.indexer, self.param_dtype, name="indexer")(
            x, q_latent, cos, sin, allowed, kinds.run_indexer, previous_indices)
        dsa_allowed = allowed & selection_mask(indices, allowed.shape[-1])
        if spec.sliding_window > 0 and kinds.sliding is not False:
            window_allowed = allowed & sliding_window_mask(positions, spec.sliding_window)
            allowed = jnp.where(kinds.sliding, window_allowed, dsa_allowed)
        else:
            allowed = dsa_allowed

        out = attend(query, key, value, allowed)  # [B, T, N, Hv]
        out = jnp.einsum("BTNH,NHD->BTD", out, o_proj)
        return out, indices, gap
