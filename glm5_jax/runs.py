"""Reading model weights back from a train.py run directory or an HF checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import tokenizers

from glm5_jax.checkpoint import load_pretrained
from glm5_jax.model import ModelConfig, init_params
from glm5_jax.quant import load_recipe, quantize_params
from glm5_jax.train.checkpoints import CHECKPOINT_DIR, RunCheckpoints
from glm5_jax.train.optimizer import make_optimizer
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import init_train_state


class RunNotFoundError(FileNotFoundError):
    """The directory is neither a train.py run with a checkpoint nor an HF checkpoint."""


def is_run_directory(path: str | os.PathLike) -> bool:
    return (Path(path) / CHECKPOINT_DIR).is_dir()


def load_run(workdir: str | os.PathLike, step: int | None = None):
    """The params of a train.py run's latest (or given) checkpoint -> (ModelConfig, params)."""
    checkpoints = RunCheckpoints(workdir, read_only=True)
    step = checkpoints.latest_step() if step is None else step
    if step is None:
        raise RunNotFoundError(f"{workdir} has no complete checkpoint yet")
    run_config = checkpoints.restore_config(step)
    config = ModelConfig.from_dict(run_config["model"])
    optimizer = make_optimizer(TrainSettings.from_config(run_config))
    abstract = jax.eval_shape(lambda: init_train_state(init_params(config, 0), optimizer))
    state, _, _ = checkpoints.restore(step, abstract)
    checkpoints.close()
    return config, state.params


def load_any(path: str | os.PathLike, quantize: str | None = None):
    """A run directory or an HF checkpoint directory -> (ModelConfig, params, tokenizer or None).

    quantize: a recipe name (e.g. "fp8", "mixed"; see configs/quant/) or a recipe file path: the
    weights come back as glm5_jax.quant QuantizedTensors where the recipe says (FP8 checkpoints are
    dequantized first, then quantized by the recipe). None: the weights as stored (dequantized).
    """
    path = Path(path)
    recipe = None if quantize is None else load_recipe(quantize)  # bad names fail before loading
    if is_run_directory(path):
        config, params = load_run(path)
    elif (path / "config.json").exists():
        config, params = load_pretrained(path)
    else:
        raise RunNotFoundError(
            f"{path} is neither a train.py run directory (with {CHECKPOINT_DIR}/) nor an HF "
            "checkpoint directory (with config.json)")
    if recipe is not None:
        params = quantize_params(params, recipe)
    tokenizer_file = path / "tokenizer.json"
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.exists() else None
    return config, params, tokenizer
