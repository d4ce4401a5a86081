"""Shared fixtures: the tiny config and float32 CPU determinism."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from glm5_jax.config_files import load_model_config  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def tiny_config():
    return load_model_config("configs/tiny.py")
