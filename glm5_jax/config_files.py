"""Loading ml_collections config files (`configs/*.py` exposing `get_config()`) by path: the
`model` section as a ModelConfig, the `execution` section as ExecutionOptions, and the
command-line flags that override execution options."""

from __future__ import annotations

import argparse
import os
from typing import Any

from glm5_jax.execution_flags import add_execution_flags, flag_changes  # noqa: F401 - callers take it from here
from glm5_jax.model.config import ConfigError, ModelConfig
from glm5_jax.model.options import EXECUTION_FIELDS, ExecutionOptions
from glm5_jax.pyconfig import load_config_file  # noqa: F401 - callers take it from here too


def load_model_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The validated ModelConfig of a config file's `model` section, with field overrides."""
    config = load_config_file(path)
    if "model" not in config:
        raise ConfigError(f"config file {path} has no 'model' section")
    return ModelConfig.from_dict({**config.model.to_dict(), **overrides})


def load_execution_options(path: str | os.PathLike, **overrides) -> ExecutionOptions:
    """The validated ExecutionOptions of a config file's `execution` section (the defaults when it
    has none), with field overrides."""
    config = load_config_file(path)
    section = config.get("execution")
    return ExecutionOptions.from_dict({**(section.to_dict() if section else {}), **overrides})


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Field overrides -> (model fields, execution fields), routed by name."""
    model = {k: v for k, v in overrides.items() if k not in EXECUTION_FIELDS}
    return model, {k: v for k, v in overrides.items() if k in EXECUTION_FIELDS}


def execution_from_flags(args: argparse.Namespace, base: ExecutionOptions | None = None) -> ExecutionOptions:
    """`base` (default: the defaults) with the flags of `add_execution_flags` that were given."""
    return (base or ExecutionOptions()).replace(**flag_changes(args))
