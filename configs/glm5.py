"""GLM-5 as released (744B total, ~40B active): the published config.json values."""

import ml_collections


def get_model_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        vocab_size=154880,
        hidden_size=6144,
        dense_intermediate_size=12288,
        moe_intermediate_size=2048,
        num_layers=78,
        num_dense_layers=3,
        num_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
        num_expert_groups=1,
        num_selected_groups=1,
        normalize_topk_weights=True,
        routed_scaling_factor=2.5,
        index_num_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_types=["full"] * 78,
        attention_types=["dsa"] * 78,
        sliding_window=0,
        rope_theta=1_000_000.0,
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        num_mtp_layers=1,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_ids=[154820, 154827, 154829],
        pad_token_id=154820,
    ))


def get_execution_config() -> ml_collections.ConfigDict:
    """How it runs (glm5_jax/model/options.py): bfloat16 as released, reference kernels."""
    return ml_collections.ConfigDict(dict(
        dtype="bfloat16",
        param_dtype="bfloat16",
        remat="none",
        moe_impl="ragged",
        attention_impl="reference",
        indexer_impl="reference",
        decode_attention_impl="reference",
        expert_dispatch="all_to_all",
        expert_capacity_factor=0.0,
        pipeline_microbatches=0,
    ))


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = get_model_config()
    config.execution = get_execution_config()
    return config
