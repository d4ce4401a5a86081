"""glm5_jax: the GLM-5 family (MLA + DeepSeek Sparse Attention + MoE) in JAX/Flax.

Public API (stable):
    ModelConfig                 the validated model configuration (architecture)
    ExecutionOptions            how it runs: dtypes, kernels, remat, MoE dispatch
    load_pretrained(path, dtype=None) -> (config, params)
    save_pretrained(config, params, path, max_shard_size="5GB")
    forward(config, params, input_ids, *, options=None) -> float32 logits [batch, seq, vocab]
    count_params(config) -> {"total", "active", "mtp"}
    init_params(config, rng, *, options=None) -> params

Names are imported on first use, so tools that need no model (the data preparation pipeline and
its worker processes) do not pay JAX's import.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointError": "glm5_jax.checkpoint", "load_pretrained": "glm5_jax.checkpoint",
    "save_pretrained": "glm5_jax.checkpoint", "ConfigError": "glm5_jax.model",
    "ExecutionOptions": "glm5_jax.model", "ModelConfig": "glm5_jax.model", "apply_model": "glm5_jax.model",
    "forward": "glm5_jax.model", "init_params": "glm5_jax.model", "count_params": "glm5_jax.model.count",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glm5_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
