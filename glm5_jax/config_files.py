"""Loading ml_collections config files (`configs/*.py` exposing `get_config()`) by path: the
`model` section as a ModelConfig, the `execution` section as ExecutionOptions, and the
command-line flags that override execution options."""

from __future__ import annotations

import argparse
import os
from typing import Any

from glm5_jax.model.config import ConfigError, ModelConfig
from glm5_jax.model.options import DTYPES, EXECUTION_FIELDS, KERNEL_IMPLS, MOE_IMPLS, ExecutionOptions
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


def add_execution_flags(parser: argparse.ArgumentParser) -> None:
    """Command-line flags for the serving-relevant ExecutionOptions (see `execution_from_flags`)."""
    group = parser.add_argument_group("execution options (default: as the checkpoint was made)")
    group.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="compute dtype of activations and the cache (weights stay as loaded)")
    group.add_argument("--moe-impl", choices=MOE_IMPLS, default=None,
                       help="routed-expert computation: ragged (GPU/TPU), blocked, dense (CPU), pallas; "
                            "an HF checkpoint's default: this platform's (options.platform_moe_impl)")
    group.add_argument("--scan-unroll", type=int, default=None, metavar="N",
                       help="layers per iteration of each layer stack's loop; the serving step runs a stack "
                            "of at most N layers on per-layer weights (an HF checkpoint's default: "
                            "options.platform_scan_unroll)")
    group.add_argument("--attention-impl", choices=KERNEL_IMPLS, default=None,
                       help="prefill/training attention: reference (jnp) or pallas kernels")
    group.add_argument("--indexer-impl", choices=KERNEL_IMPLS, default=None,
                       help="DSA indexer scores + top-k: reference (jnp) or the pallas kernel")
    group.add_argument("--decode-attention-impl", choices=KERNEL_IMPLS, default=None,
                       help="MLA attention over the paged cache: reference (jnp) or the pallas "
                            "ragged paged kernel (GPU/TPU)")


def execution_from_flags(args: argparse.Namespace, base: ExecutionOptions | None = None) -> ExecutionOptions:
    """`base` (default: the defaults) with the flags of `add_execution_flags` that were given."""
    changes = {name: getattr(args, name) for name in
               ("dtype", "moe_impl", "scan_unroll", "attention_impl", "indexer_impl", "decode_attention_impl")
               if getattr(args, name, None) is not None}
    return (base or ExecutionOptions()).replace(**changes)
