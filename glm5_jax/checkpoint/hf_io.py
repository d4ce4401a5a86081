"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

Loading reads one tensor at a time into preallocated host arrays of the final shapes, so peak
host memory stays near the size of the params. Saving writes into a temporary directory and
moves the files into place with config.json last, so an interrupted save never leaves a
directory that looks complete but is not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from glm5_jax.checkpoint.hf_config import config_from_hf, config_to_hf
from glm5_jax.checkpoint.names import (
    TensorName,
    checkpoint_names,
    hf_shape,
    optional_duplicates,
    to_hf,
    to_ours,
)
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.transformer import param_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or holds something unexpected."""


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index (sharded) or the single safetensors file."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = {name: directory / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise CheckpointError(f"{index_path} lists {file.name}, which is missing")
        return files
    single = directory / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="np") as handle:
        return {name: single for name in handle.keys()}


def read_config(path: str | os.PathLike, dtype=None) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory."""
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path} is missing")
    dtype_name = None if dtype is None else jnp.dtype(dtype).name
    return config_from_hf(json.loads(config_path.read_text()), dtype_name)


def load_pretrained(path: str | os.PathLike, dtype=None):
    """Loads an HF checkpoint directory -> (ModelConfig, params).

    dtype (e.g. "bfloat16", jnp.float32) overrides the checkpoint's dtype for weights and
    compute; the router, its bias and the indexer's head weights stay float32. The MTP layer
    (stored as layer `num_hidden_layers`) is loaded when present.
    """
    directory = Path(path)
    config = read_config(directory, dtype)
    files = _tensor_files(directory)
    if config.num_mtp_layers and not any(
            n.startswith(f"model.layers.{config.num_layers}.") for n in files):
        config = config.replace(num_mtp_layers=0)  # declared, but this file set has no MTP layer
    names = checkpoint_names(config)
    expected = {n.hf_name for n in names}
    missing = sorted(expected - set(files))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unexpected = sorted(set(files) - expected - optional_duplicates(config))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")

    # Host buffers of the final shapes; shared-indexer layers keep zeros (never used).
    buffers = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), param_shapes(config))
    by_file: dict[Path, list[TensorName]] = {}
    for name in names:
        by_file.setdefault(files[name.hf_name], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="np") as handle:
            for name in file_names:
                target = _get(buffers, name.path)
                slice_shape = target.shape[len(name.index):]
                want = hf_shape(name, slice_shape)
                got = tuple(handle.get_slice(name.hf_name).get_shape())
                if got != want:
                    raise CheckpointError(
                        f"{name.hf_name} in {file.name} has shape {got}, expected {want}")
                target[name.index] = to_ours(name, handle.get_tensor(name.hf_name), slice_shape)

    params = {}
    for leaf_path, host in jax.tree_util.tree_flatten_with_path(buffers)[0]:
        keys = tuple(k.key for k in leaf_path)
        _set(params, keys, jnp.asarray(host))
        _set(buffers, keys, None)  # drop the host copy as soon as the device copy exists
    return config, params


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (use e.g. 5000000 or '5GB')")
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30}
    return int(float(match.group(1)) * units[(match.group(2) or "B").upper()])


def _assign_shards(entries: Iterable[tuple[TensorName, int]], limit: int) -> list[list[TensorName]]:
    shards: list[list[TensorName]] = [[]]
    used = 0
    for name, nbytes in entries:
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def save_pretrained(config: ModelConfig, params, path: str | os.PathLike,
                    max_shard_size: int | str = "5GB") -> None:
    """Writes params in the HF layout (config.json, safetensors shards and their index).

    Each tensor keeps its array's dtype (the router, its bias and the indexer's head weights
    are float32 in our params, as transformers keeps them).
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    names = checkpoint_names(config)
    leaves = {name.hf_name: _get(params, name.path) for name in names}

    def nbytes(name: TensorName) -> int:
        leaf = leaves[name.hf_name]
        return int(np.prod(leaf.shape[len(name.index):])) * np.dtype(leaf.dtype).itemsize

    shards = _assign_shards(((n, nbytes(n)) for n in names), limit)
    staging = Path(tempfile.mkdtemp(prefix=".saving-", dir=directory))
    try:
        weight_map, total = {}, 0
        file_names = ([SINGLE_FILE] if len(shards) == 1 else
                      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                       for i in range(len(shards))])
        for file_name, shard in zip(file_names, shards, strict=True):
            tensors = {}
            for name in shard:
                leaf = leaves[name.hf_name]
                our_slice = np.asarray(leaf[name.index] if name.index else leaf)
                tensor = to_hf(name, our_slice, hf_shape(name, our_slice.shape))
                tensors[name.hf_name] = tensor
                weight_map[name.hf_name] = file_name
                total += tensors[name.hf_name].nbytes
            save_file(tensors, str(staging / file_name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        (staging / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))

        # Retire the previous checkpoint's description first, then move the new files in.
        for stale in ("config.json", INDEX_FILE):
            (directory / stale).unlink(missing_ok=True)
        for old in directory.glob("model*.safetensors"):
            old.unlink()
        for file in sorted(staging.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(file, directory / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
