"""Config validation (errors name the field) and HF config.json conversion."""

import pytest
from transformers import GlmMoeDsaConfig

from glm5_jax import ConfigError, ModelConfig
from glm5_jax.checkpoint import config_from_hf, config_to_hf
from glm5_jax.config_files import load_model_config


@pytest.mark.parametrize("changes, field", [
    (dict(num_expert_groups=3), "num_expert_groups"),  # does not divide 8 experts
    (dict(index_topk=0), "index_topk"),
    (dict(num_experts_per_token=9), "num_experts_per_token"),
    (dict(num_selected_groups=3, num_expert_groups=2), "num_selected_groups"),
    (dict(num_expert_groups=4, num_selected_groups=1, num_experts_per_token=3),
     "num_experts_per_token"),
    (dict(indexer_types=["full", "full"]), "indexer_types"),
    (dict(indexer_types=["shared", "full", "full", "full"]), "indexer_types"),
    (dict(indexer_types=["full", "sparse", "full", "full"]), "indexer_types"),
    (dict(attention_types=["sliding_window"] * 4), "sliding_window"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(num_dense_layers=5), "num_dense_layers"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(dtype="float64"), "dtype"),
    (dict(num_mtp_layers=2), "num_mtp_layers"),
])
def test_invalid_fields_are_named(tiny_config, changes, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config.replace(**changes)


def test_unknown_field_is_named(tiny_config):
    with pytest.raises(ConfigError, match="num_expert"):
        ModelConfig.from_dict({**tiny_config.to_dict(), "num_expert": 4})


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config("configs/no_such_model.py")


@pytest.mark.parametrize("name", ["tiny", "glm5", "glm5_2"])
def test_hf_config_round_trip(name):
    config = load_model_config(f"configs/{name}.py")
    assert config_from_hf(config_to_hf(config)) == config


def test_glm5_values_match_the_published_config():
    config = load_model_config("configs/glm5.py")
    hf = GlmMoeDsaConfig()  # transformers' defaults are the GLM-5 values
    ours = config_to_hf(config)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                  "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor",
                  "index_topk", "index_head_dim", "index_n_heads", "first_k_dense_replace",
                  "max_position_embeddings", "rms_norm_eps", "norm_topk_prob"):
        assert ours[field] == getattr(hf, field), field
    assert config.rope_theta == 1e6 and config.eos_token_ids == (154820, 154827, 154829)


def test_glm5_2_indexer_pattern_matches_transformers():
    ours = load_model_config("configs/glm5_2.py").indexer_types
    theirs = GlmMoeDsaConfig(index_topk_freq=4, index_skip_topk_offset=3).indexer_types
    assert ours == tuple(theirs)
    assert ours.count("shared") > 0 and ours[:3] == ("full",) * 3


def test_reads_hf_pattern_fields_and_legacy_rope_theta(tiny_config):
    hf = config_to_hf(tiny_config)
    del hf["indexer_types"], hf["rope_parameters"]
    hf.update(index_topk_freq=2, index_skip_topk_offset=1, rope_theta=5000.0)
    config = config_from_hf(hf)
    assert config.indexer_types == ("full", "shared", "full", "shared")
    assert config.rope_theta == 5000.0


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "gelu"), ("tie_word_embeddings", True), ("num_key_value_heads", 2),
    ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"]),
])
def test_unsupported_hf_fields_are_named(tiny_config, field, value):
    hf = config_to_hf(tiny_config)
    hf[field] = value
    with pytest.raises(ConfigError, match=field):
        config_from_hf(hf)


def test_unsupported_rope_type(tiny_config):
    hf = config_to_hf(tiny_config)
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ConfigError, match="rope_type"):
        config_from_hf(hf)
