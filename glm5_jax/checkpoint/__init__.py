"""Checkpoint IO: the HF checkpoint layout (config.json + safetensors) and its name mapping."""

from glm5_jax.checkpoint.hf_config import config_from_hf, config_to_hf, options_from_hf
from glm5_jax.checkpoint.hf_io import (
    CheckpointError,
    load_pretrained,
    read_config,
    read_options,
    save_pretrained,
)
from glm5_jax.checkpoint.names import checkpoint_names

__all__ = [
    "CheckpointError", "checkpoint_names", "config_from_hf", "config_to_hf", "load_pretrained",
    "options_from_hf", "read_config", "read_options", "save_pretrained",
]
