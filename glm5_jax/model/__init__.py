"""The GLM-5 model: config (config.py) apart from execution options (options.py); layers, MLA,
DSA, MoE; the one decoder (decoder.py: the layer and the MTP head, pure functions over
checkpoint-named weights); attention backends by source of keys (attention/); the training
stack (transformer.py) and the serving forward pass over the page pool (paged_decode.py), both
composed from decoder.py; the seam into the kernels (kernel_calls.py). GLM-5.3-Flash's building
blocks, each equal to transformers' glm5_next, not yet composed into a model: Kimi Delta
Attention and its layer (kda.py), hyper-connections (hyper_connections.py)."""

from glm5_jax.model.config import ConfigError, ModelConfig, indexer_pattern
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import (
    Transformer,
    apply_model,
    forward,
    init_params,
    param_logical_axes,
    param_shapes,
)

__all__ = [
    "ConfigError", "ExecutionOptions", "ModelConfig", "Transformer", "apply_model", "forward",
    "indexer_pattern", "init_params", "param_logical_axes", "param_shapes",
]
