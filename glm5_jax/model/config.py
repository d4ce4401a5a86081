"""The model configuration: one frozen, validated dataclass built from an ml_collections file.

Config files under `configs/` are data (`get_config()` returning a ConfigDict with a `model`
section). `ModelConfig.from_dict` converts that section once; every check happens there and an
error names the offending field. Field names are spelled out; the mapping to Hugging Face
`config.json` names lives in `glm5_jax.checkpoint.hf_config`. ModelConfig is the architecture
only; how the model runs (dtypes, kernels, remat, MoE dispatch) is `ExecutionOptions`
(glm5_jax/model/options.py, the config file's `execution` section).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from glm5_jax.errors import ConfigError  # noqa: F401 - raised here, imported from here by callers

INDEXER_TYPES = ("full", "shared")
# "linear": Kimi Delta Attention (kda.py), GLM-5.3-Flash's `linear_attention` layers.
ATTENTION_TYPES = ("dsa", "sliding_window", "linear")
# Execution fields (glm5_jax.model.options.ExecutionOptions) that older config files and saved
# runs kept in the `model` section.
MOVED_TO_EXECUTION = (
    "dtype", "param_dtype", "remat", "moe_impl", "attention_impl", "indexer_impl",
    "decode_attention_impl", "expert_dispatch", "expert_capacity_factor", "pipeline_microbatches",
    "quantized_matmul", "dsa_stage", "scan_unroll", "causal_block_size", "linear_chunk_size",
    "linear_attention_impl",
)


def check_field(config, condition: bool, field: str, message: str) -> None:
    """Raises ConfigError naming `field` (and its value in `config`) unless `condition`."""
    if not condition:
        raise ConfigError(f"{field}: {message} (got {getattr(config, field)!r})")


def indexer_pattern(num_layers: int, frequency: int = 1, offset: int = 2) -> tuple[str, ...]:
    """GLM-5.2 IndexShare pattern: layer i runs the indexer iff max(i - offset + 1, 0) % frequency == 0.

    frequency=1 gives every layer "full" (GLM-5). Other layers are "shared": they reuse the top-k
    selection of the previous "full" layer.
    """
    frequency = max(frequency, 1)
    return tuple(
        "full" if max(i - offset + 1, 0) % frequency == 0 else "shared" for i in range(num_layers)
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every architecture field of GLM-5 (see docs and glm5-reference.md for meanings); execution
    choices live in ExecutionOptions."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    dense_intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_layers: int = 78
    num_dense_layers: int = 3
    num_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    num_expert_groups: int = 1
    num_selected_groups: int = 1
    normalize_topk_weights: bool = True
    routed_scaling_factor: float = 2.5
    index_num_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    # Per layer: "full" runs the DSA indexer, "shared" reuses the previous full layer's top-k.
    indexer_types: tuple[str, ...] = ()
    # Per layer: "dsa" (causal AND indexer-selected keys) or "sliding_window" (causal AND the last
    # `sliding_window` keys). The released models are all "dsa".
    attention_types: tuple[str, ...] = ()
    sliding_window: int = 0
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    # Fixed by the architecture (HF hard-codes them): q/kv latent norms and indexer key norm.
    latent_norm_eps: float = 1e-6
    index_norm_eps: float = 1e-6
    num_mtp_layers: int = 1
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (154820, 154827, 154829)
    pad_token_id: int | None = 154820
    # ---- GLM-5.3-Flash (transformers `glm5_next`); the defaults are GLM-5's (none of it).
    # KDA linear attention of the "linear" attention_types layers (kda.py).
    linear_num_heads: int = 0
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0  # the forget gate's floor; None: -exp(A) softplus
    # Manifold-constrained hyper-connections (hyper_connections.py): residual streams; 0 = one
    # plain residual stream, no hyper-connections (GLM-5). (1 is one stream inside them.)
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Pooled DSA (pooled_dsa.py): the indexer scores groups of index_kpool tokens; 0 = per-token
    # indexer (GLM-5), >= 1 = pooled with its compression weights (GLM-5.3-Flash).
    index_kpool: int = 0
    index_kpool_always_select_tail: bool = True
    # SwiGLU input clamp of every MLP and expert (gate <= limit, |up| <= limit); 0 = none.
    swiglu_limit: float = 0.0

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def has_linear_layers(self) -> bool:
        """KDA ("linear") layers: a per-sequence recurrent state instead of a KV cache there."""
        return "linear" in self.attention_types

    @property
    def is_hybrid(self) -> bool:
        """GLM-5.3-Flash's architecture (glm5_next): KDA layers, hyper-connections or pooled DSA."""
        return self.has_linear_layers or self.hc_mult > 0 or self.index_kpool > 0

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    def replace(self, **changes: Any) -> ModelConfig:
        """A new validated config with some fields changed."""
        return ModelConfig.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """Builds and validates a config from a mapping (a dict or an ml_collections ConfigDict).

        Per-layer lists left empty are filled with the defaults (all "full" / all "dsa").
        """
        if hasattr(values, "to_dict"):
            values = values.to_dict()
        moved = [name for name in MOVED_TO_EXECUTION if name in values]
        if moved:
            raise ConfigError(
                f"{', '.join(moved)}: execution option(s), not architecture: they moved from the "
                "`model` section to the `execution` section (ExecutionOptions, "
                "glm5_jax/model/options.py); pass them as options= / config.execution.*")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        values = dict(values)
        for name in ("indexer_types", "attention_types", "eos_token_ids"):
            if name in values and values[name] is not None:
                if isinstance(values[name], str) or not isinstance(values[name], Sequence):
                    raise ConfigError(f"{name} must be a list, got {values[name]!r}")
                values[name] = tuple(values[name])
        num_layers = values.get("num_layers", cls.num_layers)
        if not values.get("indexer_types"):
            values["indexer_types"] = ("full",) * num_layers
        if not values.get("attention_types"):
            values["attention_types"] = ("dsa",) * num_layers
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Raises ConfigError naming the first invalid field."""
        require = functools.partial(check_field, self)

        for field in (
            "vocab_size", "hidden_size", "dense_intermediate_size", "moe_intermediate_size",
            "num_layers", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "v_head_dim", "num_experts", "num_experts_per_token", "num_expert_groups",
            "num_selected_groups", "index_num_heads", "index_head_dim", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, field)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    field, "must be a positive integer")
        require(self.index_topk >= 1, "index_topk", "must be >= 1")
        require(self.qk_rope_head_dim >= 0 and self.qk_rope_head_dim % 2 == 0,
                "qk_rope_head_dim", "must be an even number (RoPE rotates pairs; 0 = NoPE)")
        require(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
                f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} (the indexer rotates that slice)")
        require(0 <= self.num_dense_layers <= self.num_layers, "num_dense_layers",
                f"must be between 0 and num_layers={self.num_layers}")
        require(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
        require(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                f"top-k cannot exceed num_experts={self.num_experts}")
        require(self.num_experts % self.num_expert_groups == 0, "num_expert_groups",
                f"must divide num_experts={self.num_experts}")
        experts_per_group = self.num_experts // self.num_expert_groups
        require(experts_per_group >= 2 or self.num_expert_groups == 1, "num_expert_groups",
                "each group needs >= 2 experts (group score = sum of its top-2)")
        require(self.num_selected_groups <= self.num_expert_groups, "num_selected_groups",
                f"cannot exceed num_expert_groups={self.num_expert_groups}")
        require(self.num_experts_per_token <= self.num_selected_groups * experts_per_group,
                "num_experts_per_token", "exceeds the experts available in the selected groups")
        require(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
        require(self.rope_theta > 0, "rope_theta", "must be > 0")
        for field in ("rms_norm_eps", "latent_norm_eps", "index_norm_eps"):
            require(getattr(self, field) > 0, field, "must be > 0")
        require(self.num_mtp_layers in (0, 1), "num_mtp_layers", "must be 0 or 1")
        require(self.hc_mult >= 0, "hc_mult", "must be >= 0 (0 = no hyper-connections)")
        require(self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", "must be >= 1")
        require(self.index_kpool >= 0, "index_kpool", "must be >= 0 (0 = per-token indexer)")
        if self.index_kpool:
            require(self.index_topk % self.index_kpool == 0, "index_topk",
                    f"must be divisible by index_kpool={self.index_kpool}")
        require(self.swiglu_limit >= 0, "swiglu_limit", "must be >= 0 (0 = no clamp)")
        if self.has_linear_layers:
            for field in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
                require(getattr(self, field) >= 1, field, "must be >= 1 when a layer is 'linear'")
        if self.is_hybrid:
            require(self.num_mtp_layers == 0, "num_mtp_layers",
                    "GLM-5.3-Flash (linear layers, hyper-connections or pooled DSA) has no MTP head here")

        require(len(self.indexer_types) == self.num_layers, "indexer_types",
                f"needs one entry per layer ({self.num_layers})")
        bad = [t for t in self.indexer_types if t not in INDEXER_TYPES]
        require(not bad, "indexer_types", f"entries must be one of {INDEXER_TYPES}")
        require(len(self.attention_types) == self.num_layers, "attention_types",
                f"needs one entry per layer ({self.num_layers})")
        bad = [t for t in self.attention_types if t not in ATTENTION_TYPES]
        require(not bad, "attention_types", f"entries must be one of {ATTENTION_TYPES}")
        require(self.sliding_window >= 0, "sliding_window", "must be >= 0 (0 = off)")
        if "sliding_window" in self.attention_types:
            require(self.sliding_window >= 1, "sliding_window",
                    "must be >= 1 when a layer's attention type is 'sliding_window'")
        seen_full = False
        layer_types = zip(self.attention_types, self.indexer_types, strict=True)
        for layer, (attention, indexer) in enumerate(layer_types):
            if attention != "dsa":  # sliding-window and KDA layers neither run nor reuse a selection
                continue
            require(seen_full or indexer == "full", "indexer_types",
                    f"layer {layer} is 'shared' but no earlier DSA layer is 'full'")
            seen_full = seen_full or indexer == "full"


def as_model_config(config) -> ModelConfig:
    """`config` as a ModelConfig: a ModelConfig as is, or a whole config (what a `configs/*.py`
    get_config() returns, or a saved run_config dict) through its `model` section.

    Raises TypeError naming what was passed otherwise.
    """
    if isinstance(config, ModelConfig):
        return config
    mapping = isinstance(config, Mapping) or hasattr(config, "to_dict")
    if mapping and "model" in config:
        return ModelConfig.from_dict(config["model"])
    raise TypeError(
        f"expected a ModelConfig, or a config with a `model` section (what configs/*.py "
        f"get_config() returns), got {type(config).__name__}"
        + (" without a `model` section (for a bare model section use ModelConfig.from_dict)"
           if mapping else ""))


def mesh_requirements(config: ModelConfig) -> dict[str, dict[str, int]]:
    """What each mesh axis splits and must divide (glm5_jax.parallel.mesh.check_divisible): the
    routed experts over expert, the MoE layers into equal pipeline stages, heads and hidden units
    over tensor."""
    return {"expert": {"num_experts": config.num_experts},
            "pipeline": {"num_moe_layers": config.num_moe_layers},
            "tensor": {"num_heads": config.num_heads, "moe_intermediate_size": config.moe_intermediate_size,
                       "dense_intermediate_size": config.dense_intermediate_size}}
