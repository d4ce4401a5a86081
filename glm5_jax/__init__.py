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


def lazy_exports(module_name: str, exports: dict[str, str], namespace: dict):
    """A module `__getattr__` that imports each of `exports` ({name: module}) on first use and
    keeps it in `namespace` (the module's globals), so later lookups skip it."""

    def module_getattr(name: str):
        if name not in exports:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(exports[name]), name)
        return value

    return module_getattr


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
