"""A toy attention variant as a new backend is written: one module, registered by name
(glm5_jax.model.attention.register_backend), and it runs in `forward` and in the serving step.

"Uniform causal attention": every query averages the values of all the keys it may see (its
document's earlier positions and itself), ignoring the scores and the DSA selection. Over a
sequence it averages the expanded values under the causal mask; over pages it is the reference
backend's streamed causal attention with the logits scaled by 0 (a softmax of equal logits is
the uniform average), the absorbed form giving the same average of values.
"""

import jax.numpy as jnp

from glm5_jax.model.attention.pages import attend_over_pages
from glm5_jax.model.attention.reference import streamed_causal_attention
from glm5_jax.model.attention.sequence import whole_keys
from glm5_jax.model.dsa import base_mask
from glm5_jax.model.mla import expand_latent


class UniformCausalAttention:
    def over_sequence(self, spec, weights, x, projected, keys, kinds, previous):
        latent, k_rope = whole_keys(projected)
        _, value = expand_latent(latent, k_rope, weights["kv_b_proj"].astype(x.dtype), spec.qk_nope_head_dim)
        allowed = base_mask(keys.positions, keys.segment_ids, *keys.whole()).astype(value.dtype)  # [B, T, S]
        mean = allowed / jnp.maximum(jnp.sum(allowed, axis=-1, keepdims=True), 1)
        heads = jnp.einsum("BTS,BSNH->BTNH", mean, value)
        return heads, previous, jnp.full(x.shape[:2], jnp.inf, jnp.float32), {}

    def over_pages(self, spec, weights, x, projected, keys, kinds, previous):
        def uniform(q_absorbed, q_rope, pools, tables, query_positions, key_positions, block_pages, scale):
            return streamed_causal_attention(q_absorbed, q_rope, pools["latent"], pools["k_rope"], tables,
                                             query_positions, block_pages, scale=0.0)

        return attend_over_pages(uniform, spec, weights, projected, keys, kinds, previous), previous, None, {}
