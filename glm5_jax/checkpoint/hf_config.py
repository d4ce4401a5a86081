"""Hugging Face `config.json` (model_type "glm_moe_dsa") <-> ModelConfig.

Our field names are spelled out; this table is the one place that knows the HF names. The
checkpoint's `dtype` (`torch_dtype`) is storage, not architecture: `options_from_hf` maps it to
the default ExecutionOptions (param_dtype and compute dtype) for that checkpoint.
"""

from __future__ import annotations

from typing import Any

from glm5_jax.model.config import ConfigError, ModelConfig, indexer_pattern
from glm5_jax.model.options import ExecutionOptions, platform_moe_impl, platform_scan_unroll

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"

# our field -> HF field, for fields that only change name.
RENAMED_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "dense_intermediate_size": "intermediate_size",
    "moe_intermediate_size": "moe_intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_dense_layers": "first_k_dense_replace",
    "num_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "num_expert_groups": "n_group",
    "num_selected_groups": "topk_group",
    "normalize_topk_weights": "norm_topk_prob",
    "routed_scaling_factor": "routed_scaling_factor",
    "index_num_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "initializer_range": "initializer_range",
    "bos_token_id": "bos_token_id",
    "pad_token_id": "pad_token_id",
}
# HF fields this architecture fixes; any other value is a different model.
FIXED_FIELDS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "mlp_bias": False,
}
# Our own fields with no HF counterpart (written only when not the default).
EXTENSION_FIELDS = ("attention_types", "sliding_window")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Reads an HF config.json dict (the architecture; see `options_from_hf` for its dtype)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConfigError(
            f"model_type: expected {MODEL_TYPE!r} (GLM-5 family), got {hf.get('model_type')!r}")
    for field, value in FIXED_FIELDS.items():
        if field in hf and hf[field] != value:
            raise ConfigError(f"{field}: only {value!r} is supported by GLM-5, got {hf[field]!r}")
    values: dict[str, Any] = {}
    for ours, theirs in RENAMED_FIELDS.items():
        if theirs in hf:
            values[ours] = hf[theirs]
    num_layers = values.get("num_layers", ModelConfig.num_layers)

    heads = values.get("num_heads", ModelConfig.num_heads)
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConfigError(
            f"num_key_value_heads: MLA needs it equal to num_attention_heads={heads}, "
            f"got {hf['num_key_value_heads']}")

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type: only 'default' is supported, got {rope_type!r}")
    if "rope_theta" in rope or "rope_theta" in hf:
        values["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta")))

    if hf.get("indexer_types"):
        values["indexer_types"] = list(hf["indexer_types"])
    elif hf.get("index_topk_pattern"):
        pattern = hf["index_topk_pattern"]
        values["indexer_types"] = ([{"F": "full", "S": "shared"}[c] for c in pattern]
                                   if isinstance(pattern, str) else list(pattern))
    else:
        values["indexer_types"] = list(indexer_pattern(
            num_layers, hf.get("index_topk_freq", 1), hf.get("index_skip_topk_offset", 2)))

    num_dense = values.get("num_dense_layers", ModelConfig.num_dense_layers)
    mlp_types = hf.get("mlp_layer_types")
    expected_mlp = ["dense"] * min(num_dense, num_layers) + ["sparse"] * max(num_layers - num_dense, 0)
    if mlp_types is not None and list(mlp_types) != expected_mlp:
        raise ConfigError("mlp_layer_types: only a dense prefix of first_k_dense_replace layers "
                          f"followed by MoE layers is supported, got {mlp_types}")

    eos = hf.get("eos_token_id")
    if eos is not None:
        values["eos_token_ids"] = [eos] if isinstance(eos, int) else list(eos)
    values["num_mtp_layers"] = int(hf.get("num_nextn_predict_layers", 0))
    for field in EXTENSION_FIELDS:
        if field in hf:
            values[field] = hf[field]

    return ModelConfig.from_dict(values)


def checkpoint_dtype(hf: dict[str, Any]) -> str:
    """The storage dtype an HF config.json declares ("float32" when it declares none)."""
    return str(hf.get("dtype") or hf.get("torch_dtype") or "float32")


def options_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ExecutionOptions:
    """Default ExecutionOptions for an HF checkpoint: weights stored and computed in the
    checkpoint's dtype, or in `dtype` when given; the routed experts and the layer loop run as
    this platform runs them best (`platform_moe_impl`, `platform_scan_unroll`); every other
    option at its default."""
    name = dtype or checkpoint_dtype(hf)
    moe_impl = platform_moe_impl(hf.get("n_routed_experts") or 1, hf.get("num_experts_per_tok") or 1)
    scan_unroll = platform_scan_unroll(hf.get("num_hidden_layers") or 1)
    return ExecutionOptions(dtype=name, param_dtype=name, moe_impl=moe_impl, scan_unroll=scan_unroll)


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The HF config.json dict for `config` (loadable by transformers' GlmMoeDsaConfig); dtype:
    the storage dtype of the weights written with it."""
    hf: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
    for ours, theirs in RENAMED_FIELDS.items():
        hf[theirs] = getattr(config, ours)
    hf.update(FIXED_FIELDS)
    hf["num_key_value_heads"] = config.num_heads
    hf["head_dim"] = config.qk_rope_head_dim  # what HF derives; kept for readers of the file
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    hf["indexer_types"] = list(config.indexer_types)
    hf["mlp_layer_types"] = (["dense"] * config.num_dense_layers
                             + ["sparse"] * config.num_moe_layers)
    hf["eos_token_id"] = (config.eos_token_ids[0] if len(config.eos_token_ids) == 1
                          else list(config.eos_token_ids))
    hf["num_nextn_predict_layers"] = config.num_mtp_layers
    hf["dtype"] = dtype
    if set(config.attention_types) != {"dsa"}:
        hf["attention_types"] = list(config.attention_types)
        hf["sliding_window"] = config.sliding_window
    return hf
