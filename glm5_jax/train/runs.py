"""Reading model weights back from a train.py run directory or an HF checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import tokenizers

from glm5_jax.checkpoint import load_pretrained, read_config, read_options
from glm5_jax.model import ModelConfig, init_params
from glm5_jax.model.options import ExecutionOptions, options_from_run_config, split_saved_model_section
from glm5_jax.quant import load_recipe, quantize_params
from glm5_jax.train.checkpoints import CHECKPOINT_DIR, CheckpointError, RunCheckpoints
from glm5_jax.train.optimizer import make_optimizer
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import init_train_state


class RunNotFoundError(FileNotFoundError):
    """The directory is neither a train.py run with a usable checkpoint nor an HF checkpoint."""


def is_run_directory(path: str | os.PathLike) -> bool:
    return (Path(path) / CHECKPOINT_DIR).is_dir()


def run_configs(run_config) -> tuple[ModelConfig, ExecutionOptions]:
    """A saved run config (run_config.json's dict) -> (ModelConfig, ExecutionOptions). Runs saved
    before the `execution` section existed kept its fields in `model`: they are split out here."""
    model, _ = split_saved_model_section(run_config["model"])
    return ModelConfig.from_dict(model), options_from_run_config(run_config)


def _run_step(workdir, checkpoints: RunCheckpoints, step: int | None) -> int:
    """The newest usable step (damaged newer ones skipped, one line each), or `step` if intact.
    Every reader of a run comes through here; RunNotFoundError (one line) when none can be read."""
    try:
        if step is not None:
            checkpoints.check(step)
            return step
        step = checkpoints.usable_step()
    except CheckpointError as error:
        raise RunNotFoundError(str(error)) from None
    if step is None:
        raise RunNotFoundError(f"{workdir} has no complete checkpoint yet")
    return step


def load_run(workdir: str | os.PathLike, step: int | None = None):
    """The params of a train.py run's newest usable (or given) checkpoint -> (ModelConfig, params)."""
    checkpoints = RunCheckpoints(workdir, read_only=True)
    try:
        step = _run_step(workdir, checkpoints, step)
        run_config = checkpoints.restore_config(step)
        config, options = run_configs(run_config)
        optimizer = make_optimizer(TrainSettings.from_config(run_config))
        abstract = jax.eval_shape(
            lambda: init_train_state(init_params(config, 0, options=options), optimizer))
        state, _, _ = checkpoints.restore(step, abstract)
    except CheckpointError as error:  # intact files orbax still cannot read
        raise RunNotFoundError(str(error)) from None
    finally:
        checkpoints.close()
    return config, state.params


def _saved_configs(path: str | os.PathLike) -> tuple[ModelConfig, ExecutionOptions]:
    """(ModelConfig, ExecutionOptions) of a run directory's latest checkpoint or of an HF checkpoint
    directory (its stored dtype), without reading any weights."""
    path = Path(path)
    if is_run_directory(path):
        checkpoints = RunCheckpoints(path, read_only=True)
        try:
            return run_configs(checkpoints.restore_config(_run_step(path, checkpoints, None)))
        except CheckpointError as error:
            raise RunNotFoundError(str(error)) from None
        finally:
            checkpoints.close()
    if (path / "config.json").exists():
        return read_config(path), read_options(path)
    raise RunNotFoundError(f"{path} is neither a train.py run directory (with {CHECKPOINT_DIR}/) nor "
                           "an HF checkpoint directory (with config.json)")


def checkpoint_options(path: str | os.PathLike) -> ExecutionOptions:
    """The ExecutionOptions a checkpoint was made with: a run directory's `execution` section
    (latest checkpoint), or an HF checkpoint's stored dtype. Serving starts from these and
    overrides what its flags say."""
    return _saved_configs(path)[1]


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """The architecture of a run directory (latest checkpoint) or an HF checkpoint directory."""
    return _saved_configs(path)[0]


def load_any(path: str | os.PathLike, quantize: str | None = None, shardings=None):
    """A run directory or an HF checkpoint directory -> (ModelConfig, params, tokenizer or None).

    quantize: a recipe name (e.g. "fp8", "mixed"; see configs/quant/) or a recipe file path: the
    weights come back as glm5_jax.quant QuantizedTensors where the recipe says (FP8 checkpoints are
    dequantized first, then quantized by the recipe). None: the weights as stored (dequantized).
    shardings: (ModelConfig, params=None) -> a pytree of shardings shaped like `params` (float
    weights when None): an HF checkpoint loads straight into them, a run directory is restored
    then placed, quantized weights are quantized shard by shard then placed.
    """
    path = Path(path)
    recipe = None if quantize is None else load_recipe(quantize)  # bad names fail before loading
    if is_run_directory(path):
        config, params = load_run(path)
        if shardings is not None:
            params = jax.device_put(params, shardings(config))
    elif (path / "config.json").exists():
        config, params = load_pretrained(path, shardings=shardings)
    else:
        raise RunNotFoundError(
            f"{path} is neither a train.py run directory (with {CHECKPOINT_DIR}/) nor an HF "
            "checkpoint directory (with config.json)")
    if recipe is not None:
        params = quantize_params(params, recipe)
        if shardings is not None:
            params = jax.device_put(params, shardings(config, params))
    tokenizer_file = path / "tokenizer.json"
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.exists() else None
    return config, params, tokenizer
