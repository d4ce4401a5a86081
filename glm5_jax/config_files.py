"""Loading ml_collections config files (`configs/*.py` exposing `get_config()`) by path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import ml_collections

from glm5_jax.model.config import ConfigError, ModelConfig


def load_config_file(path: str | os.PathLike) -> ml_collections.ConfigDict:
    """Runs `get_config()` of the Python file at `path`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_glm5_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config() function")
    return module.get_config()


def load_model_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The validated ModelConfig of a config file's `model` section, with field overrides."""
    config = load_config_file(path)
    if "model" not in config:
        raise ConfigError(f"config file {path} has no 'model' section")
    return ModelConfig.from_dict({**config.model.to_dict(), **overrides})
