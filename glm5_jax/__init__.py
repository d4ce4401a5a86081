"""glm5_jax: the GLM-5 family (MLA + DeepSeek Sparse Attention + MoE) in JAX/Flax.

Public API (stable):
    ModelConfig                 the validated model configuration (architecture)
    ExecutionOptions            how it runs: dtypes, kernels, remat, MoE dispatch
    load_pretrained(path, dtype=None) -> (config, params)
    save_pretrained(config, params, path, max_shard_size="5GB")
    forward(config, params, input_ids, *, options=None) -> float32 logits [batch, seq, vocab]
    count_params(config) -> {"total", "active", "mtp"}
    init_params(config, rng, *, options=None) -> params
"""

from glm5_jax.checkpoint import CheckpointError, load_pretrained, save_pretrained
from glm5_jax.model import ConfigError, ExecutionOptions, ModelConfig, apply_model, forward, init_params
from glm5_jax.model.count import count_params

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "ExecutionOptions", "ModelConfig", "apply_model", "count_params",
    "forward", "init_params", "load_pretrained", "save_pretrained",
]
