"""The tiny GLM-5.3-Flash (glm5_next) model the tests share: 4 layers (KDA, KDA, KDA, MLA with
NoPE and pooled DSA: pools of 2, index_topk 8, the tail selected), 2 hyper-connection streams, a
SwiGLU clamp at 0.5 (it bites with the random weights below), a dense first layer, 4 experts
top-2; and random weights where every tensor matters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.config import ModelConfig

TINY_NEXT = dict(
    vocab_size=64, hidden_size=32, dense_intermediate_size=48, moe_intermediate_size=16, num_layers=4,
    num_dense_layers=1, num_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0,
    v_head_dim=8, num_experts=4, num_experts_per_token=2, index_num_heads=8, index_head_dim=16, index_topk=8,
    attention_types=["linear", "linear", "linear", "dsa"], linear_num_heads=2, linear_head_dim=8,
    hc_mult=2, index_kpool=2, swiglu_limit=0.5, num_mtp_layers=0, pad_token_id=0, bos_token_id=None,
    eos_token_ids=[1])


def tiny_next(**changes) -> ModelConfig:
    """TINY_NEXT with some fields changed."""
    return ModelConfig.from_dict({**TINY_NEXT, **changes})


def random_next_params(config: ModelConfig, seed: int):
    """normal(0, 0.1) weights and biases, norm scales 1 + uniform(-0.3, 0.3): every tensor matters
    (the hyper-connections' `scale` is drawn like a weight)."""
    from glm5_jax.model.transformer import param_shapes

    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = str(path[-1].key)
        if name == "scale" and "hc" not in str(path[-2].key):
            values = 1 + rng.uniform(-0.3, 0.3, shape.shape)
        else:
            values = 0.1 * rng.standard_normal(shape.shape)
        return jnp.asarray(values, shape.dtype)

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(config))
