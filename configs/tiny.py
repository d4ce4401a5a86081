"""A tiny model with the full GLM-5 structure, for tests (runs in seconds on a CPU).

index_topk (8) is below typical test sequence lengths so DSA sparsity matters, and it has 16
indexer heads to keep top-k ties unlikely.
"""

from pathlib import Path

import ml_collections

from glm5_jax.pyconfig import load_config_file


def _base() -> ml_collections.ConfigDict:
    return load_config_file(Path(__file__).with_name("base.py"))


def get_model_config() -> ml_collections.ConfigDict:
    model = _base().model
    model.update(dict(
        vocab_size=256,
        hidden_size=64,
        dense_intermediate_size=96,
        moe_intermediate_size=32,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        index_num_heads=16,
        index_topk=8,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_ids=[1],
        pad_token_id=1,
    ))
    return model


def get_execution_config() -> ml_collections.ConfigDict:
    """How it runs (glm5_jax/model/options.py): the base's defaults."""
    return _base().execution


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = get_model_config()
    config.execution = get_execution_config()
    return config
