"""Fine-tuning's starting point (`config.init_from`): the architecture, weights and tokenizer of
an HF checkpoint directory (FP8 ones dequantized) or a train.py run directory.

The architecture comes from the checkpoint; fields a config also gives must agree with it (a
conflict is an error naming each field). Weights load straight into the training shardings
(an HF checkpoint tensor by tensor; a run is restored, then placed) and take the dtypes
`init_params` would give them. The optimizer state starts fresh: only the weights come along.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import tokenizers

from glm5_jax.model import ConfigError, ModelConfig, init_params
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.train.runs import RunNotFoundError, checkpoint_config, load_any


def checkpoint_architecture(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a run directory (its latest checkpoint) or an HF checkpoint directory."""
    try:
        return checkpoint_config(path)
    except RunNotFoundError as error:
        raise RunNotFoundError(f"init_from: {error}") from None


def merge_architecture(given: Mapping[str, Any] | None, found: ModelConfig) -> ModelConfig:
    """The checkpoint's architecture; ConfigError naming every field `given` (a config's `model`
    section, may be None or partial) sets to another value."""
    given = dict(given.to_dict() if hasattr(given, "to_dict") else given or {})
    found_values = found.to_dict()
    unknown = sorted(set(given) - set(found_values))
    if unknown:
        raise ConfigError(f"init_from: config.model has fields no architecture has: {', '.join(unknown)}")

    def normal(value):
        return tuple(value) if isinstance(value, (list, tuple)) else value

    # An empty per-layer list means "the default": it never conflicts.
    conflicts = [f"{name} (config {value!r}, checkpoint {found_values[name]!r})"
                 for name, value in given.items() if not (isinstance(value, (list, tuple)) and not value)
                 and normal(value) != normal(found_values[name])]
    if conflicts:
        raise ConfigError("init_from: the architecture comes from the checkpoint, and config.model "
                          f"disagrees with it in {', '.join(conflicts)}; drop these fields or fix them")
    return found


def _cast(value, like):
    return value if value.dtype == like.dtype else value.astype(like.dtype)


def initial_weights(path: str | os.PathLike, config: ModelConfig, options: ExecutionOptions,
                    shardings: Callable[..., Any] | None = None):
    """The weights of the checkpoint at `path` for training `config`: in `shardings(config)` when
    given, each leaf in the dtype `init_params` gives it (its tokenizer: `load_tokenizer`)."""
    _, params, _ = load_any(path, shardings=shardings)
    abstract = jax.eval_shape(lambda: init_params(config, 0, options=options))
    try:
        params = jax.tree.map(_cast, params, abstract)
    except ValueError as error:  # a tree mismatch: not the architecture its config says
        raise ConfigError(f"init_from: {path}'s weights do not match its architecture: {error}") from None
    return params


def load_tokenizer(path: str | os.PathLike) -> tokenizers.Tokenizer:
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"init_from: {path} has no tokenizer.json; fine-tuning needs the "
                                "checkpoint's tokenizer")
    return tokenizers.Tokenizer.from_file(str(file))


# What a checkpoint's chat template lives in (transformers' names); copied into a fine-tuning run
# so chat data renders, and serve.py answers, as the released model expects.
CHAT_FILES = ("chat_template.jinja", "tokenizer_config.json")


def copy_chat_files(path: str | os.PathLike, workdir: str | os.PathLike) -> list[str]:
    """Copies the checkpoint's chat template files into workdir; returns the names copied."""
    copied = []
    for name in CHAT_FILES:
        if (Path(path) / name).is_file():
            shutil.copyfile(Path(path) / name, Path(workdir) / name)
            copied.append(name)
    return copied
