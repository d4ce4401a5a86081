"""A tiny model with the full GLM-5 structure, for tests (runs in seconds on a CPU).

index_topk (8) is below typical test sequence lengths so DSA sparsity matters, and it has 16
indexer heads to keep top-k ties unlikely.
"""

import ml_collections


def get_model_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        vocab_size=256,
        hidden_size=64,
        dense_intermediate_size=96,
        moe_intermediate_size=32,
        num_layers=4,
        num_dense_layers=1,
        num_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        num_expert_groups=1,
        num_selected_groups=1,
        normalize_topk_weights=True,
        routed_scaling_factor=2.5,
        index_num_heads=16,
        index_head_dim=32,
        index_topk=8,
        indexer_types=[],  # empty: every layer "full"
        attention_types=[],  # empty: every layer "dsa"
        sliding_window=0,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        num_mtp_layers=1,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_ids=[1],
        pad_token_id=1,
    ))


def get_execution_config() -> ml_collections.ConfigDict:
    """How it runs (glm5_jax/model/options.py): the defaults, spelled out to be overridable."""
    return ml_collections.ConfigDict(dict(
        dtype="float32",
        param_dtype="float32",
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
