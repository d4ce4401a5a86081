"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

Loading reads one tensor at a time into preallocated host arrays of the final shapes, so peak
host memory stays near the size of the params. Saving writes into a temporary directory and
moves the files into place with config.json last, so an interrupted save never leaves a
directory that looks complete but is not.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from glm5_jax.checkpoint.hf_config import config_from_hf, config_to_hf, options_from_hf
from glm5_jax.checkpoint.names import (
    FP8_BLOCK,
    SCALE_SUFFIX,
    TensorName,
    checkpoint_names,
    fp8_scale_shape,
    hf_shape,
    optional_duplicates,
    scale_to_ours,
    skipped_prefixes,
    to_hf,
    to_ours,
)
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import param_shapes
from glm5_jax.quant.formats import QuantizedTensor, is_quantized
from glm5_jax.quant.recipes import weight_layout

logger = logging.getLogger(__name__)

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


def _read_hf_config(path: str | os.PathLike) -> dict:
    config_path = Path(path) / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path} is missing")
    return json.loads(config_path.read_text())


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory."""
    return config_from_hf(_read_hf_config(path))


def read_options(path: str | os.PathLike, dtype=None) -> ExecutionOptions:
    """The default ExecutionOptions of an HF checkpoint directory: its stored dtype (or `dtype`,
    e.g. "bfloat16" or jnp.float32) for weights and compute."""
    return options_from_hf(_read_hf_config(path), None if dtype is None else jnp.dtype(dtype).name)


def _read_fp8(file: Path, hf_name: str) -> np.ndarray:
    """An F8_E4M3 tensor read straight from the safetensors layout (safetensors' numpy reader
    has no float8 dtype): 8-byte header size, JSON header, then the raw bytes."""
    with open(file, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        info = json.loads(handle.read(header_size))[hf_name]
        start, end = info["data_offsets"]
        handle.seek(8 + header_size + start)
        data = np.frombuffer(handle.read(end - start), np.uint8)
    return data.view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])


def _fp8_weights(directory: Path, files: dict[str, Path], names: list[TensorName]) -> set[str]:
    """Names of the weights stored as FP8 with a block scale (`<name>_scale_inv`); checks that
    each scale has its weight, that the weight may be quantized and the block size is 128x128."""
    known = {n.hf_name: n for n in names}
    scaled = {n[: -len(SCALE_SUFFIX)] for n in files if n.endswith(SCALE_SUFFIX)}
    for base in sorted(scaled):
        if base not in known:
            raise CheckpointError(f"{base}{SCALE_SUFFIX} has no weight tensor {base} in the model")
        if weight_layout(known[base].path) is None:
            raise CheckpointError(f"{base} has a block scale, but {'/'.join(known[base].path)} is "
                                  "never quantized (norms, biases and the router stay float)")
    if scaled:
        hf = json.loads((directory / "config.json").read_text()).get("quantization_config", {})
        block = list(hf.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK]))
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise CheckpointError(f"quantization_config.weight_block_size {block}: only "
                                  f"[{FP8_BLOCK}, {FP8_BLOCK}] is supported")
    return scaled


def _read_weight(handle, file: Path, name: TensorName, scaled: set[str], want: tuple[int, ...],
                 files: dict[str, Path]):
    """One HF tensor (checked against its expected shape) -> (tensor, FP8 scale or None).

    FP8 tensors come back as float8_e4m3fn with their [ceil(out/128), ceil(in/128)] scale."""
    got = tuple(handle.get_slice(name.hf_name).get_shape())
    if got != want:
        raise CheckpointError(f"{name.hf_name} in {file.name} has shape {got}, expected {want}")
    if name.hf_name not in scaled:
        return handle.get_tensor(name.hf_name), None
    dtype = handle.get_slice(name.hf_name).get_dtype()
    if dtype != "F8_E4M3":
        raise CheckpointError(f"{name.hf_name} has a block scale but dtype {dtype}; expected F8_E4M3")
    scale_name = name.hf_name + SCALE_SUFFIX
    with safe_open(str(files[scale_name]), framework="np") as scales:
        scale = scales.get_tensor(scale_name).astype(np.float32)
    if scale.shape != fp8_scale_shape(want):
        raise CheckpointError(f"{scale_name} has shape {scale.shape}, expected "
                              f"{fp8_scale_shape(want)} (one scale per {FP8_BLOCK}x{FP8_BLOCK} block "
                              f"of the {want} weight)")
    return _read_fp8(file, name.hf_name), scale


def _dequantize_fp8(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float8 [R, C] and block scales [ceil(R/128), ceil(C/128)] -> float32 [R, C]."""
    full = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return values.astype(np.float32) * full[: values.shape[0], : values.shape[1]]


def load_pretrained(path: str | os.PathLike, dtype=None, keep_fp8: bool = False, shardings=None):
    """Loads an HF checkpoint directory -> (ModelConfig, params).

    dtype (e.g. "bfloat16", jnp.float32) overrides the checkpoint's dtype for the weights (the
    matching ExecutionOptions come from `read_options(path, dtype)`); the router, its bias and
    the indexer's head weights stay float32. The MTP layer (stored as layer `num_hidden_layers`)
    is loaded when present.

    FP8 checkpoints (`weight` float8_e4m3fn + `weight_scale_inv` per 128x128 block) are
    dequantized to that dtype, or with keep_fp8 kept as glm5_jax.quant QuantizedTensors
    ("fp8" format; the model dequantizes them per layer).

    shardings: a function ModelConfig -> a pytree of `jax.sharding.Sharding` shaped like the
    params (e.g. glm5_jax.parallel.sharding.serving_param_shardings on a mesh): each weight goes
    from its host buffer straight into its shards, never whole onto one device.
    """
    directory = Path(path)
    config = read_config(directory)
    options = read_options(directory, dtype)
    files = _tensor_files(directory)
    if config.num_mtp_layers and not any(
            n.startswith(f"model.layers.{config.num_layers}.") for n in files):
        config = config.replace(num_mtp_layers=0)  # declared, but this file set has no MTP layer
    names = checkpoint_names(config)
    scaled = _fp8_weights(directory, files, names)
    expected = {n.hf_name for n in names} | {n + SCALE_SUFFIX for n in scaled}
    missing = sorted(expected - set(files))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unexpected = sorted(set(files) - expected - optional_duplicates(config))
    for prefix, what in skipped_prefixes(config).items():
        skipped = [name for name in unexpected if name.startswith(prefix)]
        if skipped:
            logger.warning("%s: skipped %s (%d tensors under %s)", directory, what, len(skipped), prefix)
            unexpected = [name for name in unexpected if not name.startswith(prefix)]
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")

    # Host buffers of the final shapes; shared-indexer layers keep zeros (never used).
    buffers = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), param_shapes(config, options=options))
    if shardings is not None and keep_fp8:
        raise ValueError("load_pretrained: keep_fp8 and shardings together are not supported")
    placements = {} if shardings is None else {
        tuple(k.key for k in path): sharding
        for path, sharding in jax.tree_util.tree_flatten_with_path(shardings(config))[0]}
    kept = _fp8_buffers(buffers, names, scaled) if keep_fp8 else {}
    by_file: dict[Path, list[TensorName]] = {}
    for name in names:
        by_file.setdefault(files[name.hf_name], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="np") as handle:
            for name in file_names:
                target = _get(buffers, name.path)
                slice_shape = target.shape[len(name.index):]
                tensor, scale = _read_weight(handle, file, name, scaled, hf_shape(name, slice_shape),
                                             files)
                if name.path in kept:
                    values, scales = kept[name.path]
                    values[name.index] = tensor.T if name.transposed else tensor
                    scales[name.index] = scale_to_ours(name, scale)
                    continue
                if scale is not None:
                    tensor = _dequantize_fp8(tensor, scale)
                target[name.index] = to_ours(name, tensor, slice_shape)

    params = {}
    for leaf_path, host in jax.tree_util.tree_flatten_with_path(buffers)[0]:
        keys = tuple(k.key for k in leaf_path)
        if keys in kept:
            values, scales = kept.pop(keys)
            layout = weight_layout(keys)
            lead = host.ndim - layout.in_ndim - layout.out_ndim
            host_shape = host.shape
            _set(params, keys, QuantizedTensor(
                jnp.asarray(values), jnp.asarray(scales), None, "fp8", host_shape[lead:lead + layout.in_ndim],
                host_shape[lead + layout.in_ndim:], host.dtype.name))
        elif keys in placements:
            _set(params, keys, jax.device_put(host, placements[keys]))
        else:
            _set(params, keys, jnp.asarray(host))
        _set(buffers, keys, None)  # drop the host copy as soon as the device copy exists
    return config, params


def _fp8_buffers(buffers, names: list[TensorName], scaled: set[str]):
    """{param path: (float8 values [..., I, O], float32 scales [..., ceil(I/128), ceil(O/128)])}
    for every param whose tensors are all FP8 (a stacked param mixing FP8 and float layers is an
    error: one QuantizedTensor holds the whole stack)."""
    by_path: dict[tuple[str, ...], list[bool]] = {}
    for name in names:
        by_path.setdefault(name.path, []).append(name.hf_name in scaled)
    kept = {}
    for path, flags in by_path.items():
        if not any(flags):
            continue
        if not all(flags):
            raise CheckpointError(f"{'/'.join(path)}: some of its tensors are FP8 and some are not; "
                                  "keep_fp8 needs all of them FP8 (or load with keep_fp8=False)")
        host = _get(buffers, path)
        layout = weight_layout(path)
        lead = host.ndim - layout.in_ndim - layout.out_ndim
        rows = int(np.prod(host.shape[lead:lead + layout.in_ndim]))
        cols = int(np.prod(host.shape[lead + layout.in_ndim:]))
        kept[path] = (np.zeros(host.shape[:lead] + (rows, cols), ml_dtypes.float8_e4m3fn),
                      np.zeros(host.shape[:lead] + (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)),
                               np.float32))
    return kept


def _fp8_to_hf(name: TensorName, leaf: QuantizedTensor) -> dict[str, np.ndarray]:
    """One tensor of an "fp8" QuantizedTensor -> {weight: E4M3 [out, in], weight_scale_inv}."""
    values = np.asarray(leaf.values[name.index] if name.index else leaf.values)  # [I, O]
    scales = np.asarray(leaf.scales[name.index] if name.index else leaf.scales)
    if name.transposed:
        values, scales = values.T, scales.T
    return {name.hf_name: np.ascontiguousarray(values),
            name.hf_name + SCALE_SUFFIX: np.ascontiguousarray(scales, np.float32)}


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


def _storage_dtype(params) -> str:
    """The dtype name the weights are stored in (the embedding table's), for config.json."""
    embed = params.get("embed") if isinstance(params, dict) else None
    return jnp.dtype(embed.dtype).name if embed is not None else "float32"


def save_pretrained(config: ModelConfig, params, path: str | os.PathLike,
                    max_shard_size: int | str = "5GB") -> None:
    """Writes params in the HF layout (config.json, safetensors shards and their index).

    Each tensor keeps its array's dtype (the router, its bias and the indexer's head weights
    are float32 in our params, as transformers keeps them). "fp8" QuantizedTensors are written
    as FP8 checkpoints store them (E4M3 `weight` + `weight_scale_inv`, and a
    quantization_config in config.json); other quantized formats have no HF layout here:
    dequantize them first (glm5_jax.quant.dequantize_tree).
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    names = checkpoint_names(config)
    leaves = {name.hf_name: _get(params, name.path) for name in names}
    for name, leaf in leaves.items():
        if is_quantized(leaf) and leaf.format != "fp8":
            raise CheckpointError(f"{name} is quantized as {leaf.format!r}, which has no HF checkpoint "
                                  "layout here (only 'fp8'); dequantize it first")

    def nbytes(name: TensorName) -> int:
        leaf = leaves[name.hf_name]
        if is_quantized(leaf):
            return sum(int(np.prod(a.shape[len(name.index):])) * a.dtype.itemsize
                       for a in (leaf.values, leaf.scales))
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
                if is_quantized(leaf):
                    written = _fp8_to_hf(name, leaf)
                else:
                    our_slice = np.asarray(leaf[name.index] if name.index else leaf)
                    written = {name.hf_name: to_hf(name, our_slice, hf_shape(name, our_slice.shape))}
                for hf_name, tensor in written.items():
                    tensors[hf_name] = tensor
                    weight_map[hf_name] = file_name
                    total += tensor.nbytes
            save_file(tensors, str(staging / file_name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        hf_config = config_to_hf(config, _storage_dtype(params))
        if any(is_quantized(leaf) for leaf in leaves.values()):
            hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                                "activation_scheme": "dynamic",
                                                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        # safetensors writes its files 0600 whatever the umask: give every file the mode config.json
        # got from the umask (0644 under the usual 022, like files downloaded from the Hub).
        mode = (staging / "config.json").stat().st_mode & 0o777
        for file in staging.iterdir():
            file.chmod(mode)

        # Retire the previous checkpoint's description first, then move the new files in.
        for stale in ("config.json", INDEX_FILE):
            (directory / stale).unlink(missing_ok=True)
        for old in directory.glob("model*.safetensors"):
            old.unlink()
        for file in sorted(staging.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(file, directory / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
