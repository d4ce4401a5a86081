"""The GLM-5 model: config, layers and the full decoder (see transformer.py)."""

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
