"""GLM-5.3-Flash (transformers `glm5_next`, checkpoint zai-org/GLM-5.3-Flash) as released: the
text model of Glm5NextTextConfig's defaults in transformers 5.24. Three of every four layers are
KDA linear attention, the fourth MLA with NoPE and pooled DSA (index_kpool 16); four
hyper-connection streams; SwiGLU clamped at 10; 288 routed experts, top-8. No MTP head (the
checkpoint's layer 45 is skipped, as transformers skips it)."""

from pathlib import Path

import ml_collections

from glm5_jax.pyconfig import load_config_file

NUM_LAYERS = 45


def get_model_config() -> ml_collections.ConfigDict:
    model = load_config_file(Path(__file__).with_name("glm5.py")).model
    model.update(dict(
        vocab_size=154880,
        hidden_size=4096,
        dense_intermediate_size=12288,
        moe_intermediate_size=2048,
        num_layers=NUM_LAYERS,
        num_dense_layers=3,
        num_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=256,
        qk_rope_head_dim=0,
        v_head_dim=256,
        num_experts=288,
        num_experts_per_token=8,
        index_num_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_types=["full"] * NUM_LAYERS,
        attention_types=["linear" if layer % 4 != 3 else "dsa" for layer in range(NUM_LAYERS)],
        max_position_embeddings=1048576,
        num_mtp_layers=0,
        bos_token_id=None,
        linear_num_heads=64,
        linear_head_dim=128,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        index_kpool=16,
        index_kpool_always_select_tail=True,
        swiglu_limit=10.0,
    ))
    return model


def get_config() -> ml_collections.ConfigDict:
    config = load_config_file(Path(__file__).with_name("glm5.py"))
    config.model = get_model_config()
    return config
