"""Python config files: `get_config()` of a file, as ml_collections' config_flags reads them (the
model and run configs, quantization recipes, evaluation suites, server configs). Imports nothing of
the model, so that every layer can read its own kind of file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import ml_collections

from glm5_jax.errors import ConfigError


def load_config_file(path: str | os.PathLike, argument: str | None = None) -> ml_collections.ConfigDict:
    """Runs `get_config()` of the Python file at `path` (`get_config(argument)` when given, as
    absl's config flags pass "PATH:ARGUMENT"). Raises ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_glm5_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config() function")
    return module.get_config(argument) if argument else module.get_config()
