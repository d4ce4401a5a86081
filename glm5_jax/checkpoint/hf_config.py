"""Hugging Face `config.json` (model_type "glm_moe_dsa", or "glm5_next" for GLM-5.3-Flash) <-> ModelConfig.

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

# GLM-5.3-Flash: transformers' Glm5NextForConditionalGeneration; the text model's fields under
# `text_config` (flat text-only config.json files keep them at the top level).
NEXT_MODEL_TYPE = "glm5_next"
NEXT_ARCHITECTURE = "Glm5NextForConditionalGeneration"
NEXT_RENAMED_FIELDS = {
    **{ours: theirs for ours, theirs in RENAMED_FIELDS.items() if ours != "num_dense_layers"},
    "linear_num_heads": "linear_num_heads",
    "linear_head_dim": "linear_head_dim",
    "linear_conv_kernel_dim": "linear_conv_kernel_dim",
    "linear_lower_bound": "linear_lower_bound",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "index_kpool": "index_kpool",
    "index_kpool_always_select_tail": "index_kpool_always_select_tail",
    "swiglu_limit": "swiglu_limit",
}
NEXT_LAYER_TYPES = {"linear_attention": "linear", "indexed_attention": "dsa", "full_attention": "dsa"}
# glm5_next's defaults where its config.json may leave a field out (Glm5NextTextConfig's).
NEXT_DEFAULTS = {"qk_rope_head_dim": 0, "index_kpool": 16, "hc_mult": 4, "swiglu_limit": 10.0,
                 "linear_num_heads": 64, "linear_head_dim": 128, "qk_nope_head_dim": 256,
                 "num_experts": 288, "hidden_size": 4096, "num_layers": 45, "q_lora_rank": 1536,
                 "max_position_embeddings": 1048576, "bos_token_id": None}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of an HF config.json dict (glm5_next's `text_config`, else itself)."""
    return hf["text_config"] if hf.get("model_type") == NEXT_MODEL_TYPE and "text_config" in hf else hf


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Reads an HF config.json dict (the architecture; see `options_from_hf` for its dtype)."""
    if hf.get("model_type") == NEXT_MODEL_TYPE:
        return _next_config_from_hf(text_config(hf))
    if hf.get("model_type") != MODEL_TYPE:
        raise ConfigError(
            f"model_type: expected {MODEL_TYPE!r} or {NEXT_MODEL_TYPE!r} (GLM-5 family), "
            f"got {hf.get('model_type')!r}")
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


def _next_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """GLM-5.3-Flash's text config (Glm5NextTextConfig's fields and defaults)."""
    for field, value in FIXED_FIELDS.items():
        if field in hf and hf[field] != value:
            raise ConfigError(f"{field}: only {value!r} is supported by GLM-5.3-Flash, got {hf[field]!r}")
    values: dict[str, Any] = dict(NEXT_DEFAULTS)
    for ours, theirs in NEXT_RENAMED_FIELDS.items():
        if theirs in hf:
            values[ours] = hf[theirs]
    num_layers = values["num_layers"]
    heads = values.get("num_heads", ModelConfig.num_heads)
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"num_key_value_heads: MLA needs it equal to num_attention_heads={heads}, "
                          f"got {hf['num_key_value_heads']}")
    layer_types = hf.get("layer_types") or [
        "linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(num_layers)]
    unknown = sorted(set(layer_types) - set(NEXT_LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types: unknown {unknown}; known: {sorted(NEXT_LAYER_TYPES)}")
    values["attention_types"] = [NEXT_LAYER_TYPES[t] for t in layer_types]
    if hf.get("indexer_types"):
        values["indexer_types"] = list(hf["indexer_types"])
    else:
        values["indexer_types"] = list(indexer_pattern(
            num_layers, hf.get("index_topk_freq", 1), hf.get("index_skip_topk_offset", 2)))
    default_mlp = ["dense"] * min(3, num_layers) + ["sparse"] * (num_layers - 3)
    mlp_types = list(hf.get("mlp_layer_types") or default_mlp)
    num_dense = mlp_types.count("dense")
    if mlp_types != ["dense"] * num_dense + ["sparse"] * (num_layers - num_dense):
        raise ConfigError("mlp_layer_types: only dense layers followed by sparse (MoE) layers are "
                          f"supported, got {mlp_types}")
    values["num_dense_layers"] = num_dense
    eos = hf.get("eos_token_id")
    values["eos_token_ids"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    values["num_mtp_layers"] = 0
    values["rope_theta"] = ModelConfig.rope_theta  # NoPE: unused
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
    text = text_config(hf)
    moe_impl = platform_moe_impl(text.get("n_routed_experts") or 1, text.get("num_experts_per_tok") or 1)
    scan_unroll = platform_scan_unroll(text.get("num_hidden_layers") or 1)
    return ExecutionOptions(dtype=name, param_dtype=name, moe_impl=moe_impl, scan_unroll=scan_unroll)


def _next_config_to_hf(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """glm5_next's config.json: the text model under `text_config`; no `vision_config`, so
    transformers builds its default vision tower (randomly initialised: not in this checkpoint)."""
    text: dict[str, Any] = {"model_type": "glm5_next_text"}
    for ours, theirs in NEXT_RENAMED_FIELDS.items():
        text[theirs] = getattr(config, ours)
    text.update(FIXED_FIELDS)
    text["num_key_value_heads"] = config.num_heads
    text["layer_types"] = ["linear_attention" if t == "linear" else "indexed_attention"
                           for t in config.attention_types]
    text["indexer_types"] = list(config.indexer_types)
    text["mlp_layer_types"] = ["dense"] * config.num_dense_layers + ["sparse"] * config.num_moe_layers
    text["eos_token_id"] = (config.eos_token_ids[0] if len(config.eos_token_ids) == 1
                            else list(config.eos_token_ids) or None)
    text["dtype"] = dtype
    return {"architectures": [NEXT_ARCHITECTURE], "model_type": NEXT_MODEL_TYPE, "text_config": text,
            "tie_word_embeddings": False, "dtype": dtype}


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The HF config.json dict for `config` (loadable by transformers' GlmMoeDsaConfig, or
    Glm5NextConfig for a GLM-5.3-Flash config); dtype: the storage dtype of the weights written
    with it."""
    if config.is_hybrid:
        return _next_config_to_hf(config, dtype)
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
