"""GLM-5 as released (744B total, ~40B active): the published config.json values."""

from pathlib import Path

import ml_collections

from glm5_jax.pyconfig import load_config_file


def _base() -> ml_collections.ConfigDict:
    return load_config_file(Path(__file__).with_name("base.py"))


def get_model_config() -> ml_collections.ConfigDict:
    model = _base().model
    model.update(dict(
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
        index_num_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_types=["full"] * 78,
        attention_types=["dsa"] * 78,
        rope_theta=1_000_000.0,
        max_position_embeddings=202752,
        bos_token_id=0,
        eos_token_ids=[154820, 154827, 154829],
        pad_token_id=154820,
    ))
    return model


def get_execution_config() -> ml_collections.ConfigDict:
    """How it runs (glm5_jax/model/options.py): bfloat16 as released, reference kernels."""
    execution = _base().execution
    execution.update(dict(dtype="bfloat16", param_dtype="bfloat16"))
    return execution


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = get_model_config()
    config.execution = get_execution_config()
    return config
