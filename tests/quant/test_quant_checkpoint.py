"""Loading FP8 HF checkpoints (`weight` float8_e4m3fn + `weight_scale_inv` per 128x128 block).

The FP8 checkpoint is built the way the published one is laid out: the tiny model's HF save,
with every linear weight of the "fp8" recipe replaced by E4M3 values [out, in] and a float32
scale [ceil(out/128), ceil(in/128)] (quantized per HF tensor, i.e. per layer and expert).
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from glm5_jax.checkpoint import CheckpointError, load_pretrained, save_pretrained
from glm5_jax.checkpoint.hf_io import _read_fp8
from glm5_jax.checkpoint.names import checkpoint_names
from glm5_jax.config_files import load_model_config
from glm5_jax.model.transformer import param_shapes
from glm5_jax.quant import (
    QuantizationError,
    dequantize_tree,
    is_quantized,
    load_recipe,
    quantize,
    quantize_params,
    weight_layout,
)
from glm5_jax.train.runs import load_any

# One xdist worker runs this module, so its fixtures (written checkpoints) are built once.
pytestmark = pytest.mark.xdist_group("quant_checkpoint")

SINGLE = "model.safetensors"


def _read_all(directory):
    """name -> numpy tensor (float8 ones through the loader's raw reader: safetensors' numpy
    reader has no float8 dtype)."""
    file = directory / SINGLE
    with safe_open(str(file), framework="np") as handle:
        return {name: _read_fp8(file, name) if handle.get_slice(name).get_dtype() == "F8_E4M3"
                else handle.get_tensor(name) for name in handle.keys()}


def _write_fp8_checkpoint(source, target, config, recipe="fp8"):
    """Copies an HF checkpoint, storing the recipe's FP8 weights as E4M3 + weight_scale_inv."""
    target.mkdir()
    fp8_classes = {c for c, f in load_recipe(recipe).formats if f == "fp8"}
    tensors = _read_all(source)
    for name in checkpoint_names(config):
        layout = weight_layout(name.path)
        if layout is None or layout.module_class not in fp8_classes:
            continue
        hf = tensors[name.hf_name]  # [out, in] (the embedding: [rows, cols] as is)
        ours = hf.T if name.transposed else hf
        q = quantize(jnp.asarray(ours), "fp8")
        values = np.asarray(q.values.astype(jnp.float32)).astype(ml_dtypes.float8_e4m3fn)
        scales = np.asarray(q.scales)
        tensors[name.hf_name] = values.T.copy() if name.transposed else values
        tensors[name.hf_name + "_scale_inv"] = scales.T.copy() if name.transposed else scales
    save_file(tensors, str(target / SINGLE), metadata={"format": "pt"})
    hf_config = json.loads((source / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                        "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (target / "config.json").write_text(json.dumps(hf_config))


def _random_params(config):
    """Normal(0, 0.1) params of the model's shapes (no init compile: loading needs no forward)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.1, s.shape), s.dtype), param_shapes(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    # Two layers (dense + MoE) and the MTP layer: every module class appears; 144-wide q_b_proj
    # and 256-wide vocab give partial and full 128 blocks.
    config = load_model_config("configs/tiny.py", num_layers=2, q_lora_rank=144)
    params = _random_params(config)
    root = tmp_path_factory.mktemp("fp8")
    save_pretrained(config, params, root / "bf16")
    _write_fp8_checkpoint(root / "bf16", root / "fp8", config)
    return config, params, root


def _assert_trees_equal(got, want):
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                      err_msg=jax.tree_util.keystr(path))


def test_fp8_checkpoint_dequantized_equals_reference(checkpoints):
    config, params, root = checkpoints
    loaded_config, loaded = load_pretrained(root / "fp8")
    assert loaded_config == config
    reference = dequantize_tree(quantize_params(params, "fp8"))
    assert not any(is_quantized(x) for x in jax.tree.leaves(loaded, is_leaf=is_quantized))
    _assert_trees_equal(loaded, reference)
    # The weights did change (E4M3 rounding), and the float ones did not.
    moe, original = loaded["moe_layers"]["moe"], params["moe_layers"]["moe"]
    assert not np.array_equal(moe["gate_proj"], original["gate_proj"])
    np.testing.assert_array_equal(moe["router"], original["router"])


def test_fp8_checkpoint_kept_as_fp8_equals_quantized_params(checkpoints):
    """keep_fp8: stacked QuantizedTensors with the same values and scales as quantizing our params."""
    _, params, root = checkpoints
    _, loaded = load_pretrained(root / "fp8", keep_fp8=True)
    reference = quantize_params(params, "fp8")
    leaf = loaded["moe_layers"]["moe"]["down_proj"]
    assert is_quantized(leaf) and leaf.values.dtype == jnp.float8_e4m3fn
    assert leaf.shape == params["moe_layers"]["moe"]["down_proj"].shape
    # q_b_proj of the MTP layer: [144 in, 4 heads * 40 out] -> 2 x 2 blocks.
    assert loaded["mtp"]["layer"]["attention"]["q_b_proj"].scales.shape == (2, 2)
    _assert_trees_equal(loaded, reference)  # compares values, scales of every QuantizedTensor


def test_fp8_params_save_and_load_back(checkpoints, tmp_path):
    """save_pretrained writes fp8 QuantizedTensors as E4M3 + weight_scale_inv: the same tensors
    as the published layout, and loading keeps them bit for bit; other formats are refused."""
    config, params, root = checkpoints
    _, kept = load_pretrained(root / "fp8", keep_fp8=True)
    save_pretrained(config, kept, tmp_path / "again")
    written, original = _read_all(tmp_path / "again"), _read_all(root / "fp8")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(written[name].astype(np.float32), tensor.astype(np.float32))
    assert "quantization_config" in json.loads((tmp_path / "again" / "config.json").read_text())
    _, reloaded = load_pretrained(tmp_path / "again", keep_fp8=True)
    _assert_trees_equal(reloaded, kept)
    with pytest.raises(CheckpointError, match="quantized as 'nvfp4'"):
        save_pretrained(config, {**params, "lm_head": quantize(params["lm_head"], "nvfp4")},
                        tmp_path / "nvfp4")


def test_wrong_scale_shape_names_the_tensor(checkpoints, tmp_path):
    _, _, root = checkpoints
    tensors = _read_all(root / "fp8")
    bad = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    tensors[bad] = np.ones((1, 1), np.float32)
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / SINGLE))
    shutil.copy(root / "fp8" / "config.json", tmp_path / "bad")
    with pytest.raises(CheckpointError, match=rf"{bad} has shape \(1, 1\), expected \(2, 2\)"):
        load_pretrained(tmp_path / "bad")


def test_scales_on_float_tensors_or_orphans_are_errors(checkpoints, tmp_path):
    _, _, root = checkpoints
    for extra, message in [("model.layers.1.mlp.gate.weight_scale_inv", "never quantized"),
                           ("model.layers.1.mlp.nothing.weight_scale_inv", "has no weight tensor")]:
        tensors = {**_read_all(root / "fp8"), extra: np.ones((1, 1), np.float32)}
        directory = tmp_path / extra.split(".")[-2]
        directory.mkdir()
        save_file(tensors, str(directory / SINGLE))
        shutil.copy(root / "fp8" / "config.json", directory)
        with pytest.raises(CheckpointError, match=message):
            load_pretrained(directory)


def test_load_any_quantizes_with_a_recipe(checkpoints):
    _, _, root = checkpoints
    with pytest.raises(QuantizationError, match="unknown quantization recipe 'fp9'"):
        load_any(root / "bf16", quantize="fp9")
    _, params, _ = load_any(root / "fp8", quantize="mixed")
    assert params["moe_layers"]["moe"]["up_proj"].format == "nvfp4"
    assert params["dense_layers"]["attention"]["o_proj"].format == "fp8"
    assert not is_quantized(params["lm_head"])


def test_glm5_next_fp8_checkpoint_loads_dequantized_and_kept(tmp_path):
    """GLM-5.3-Flash (glm5_next) FP8 checkpoints: the KDA projections, MLA, indexer and FFN
    weights in E4M3 (the fp8 recipe's classes), the convolutions, decays, hyper-connections and
    pool compression in float; loaded dequantized or kept, equal to quantizing our params."""
    config = load_model_config("configs/glm5_next_demo.py", num_layers=2, num_dense_layers=1,
                               attention_types=["linear", "dsa"], indexer_types=["full", "full"])
    params = _random_params(config)
    save_pretrained(config, params, tmp_path / "float")
    _write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", config)
    fp8_names = [name for name in _read_all(tmp_path / "fp8") if name.endswith("_scale_inv")]
    assert any(".self_attn.q_proj." in name for name in fp8_names)  # a KDA projection
    assert not any("conv1d" in name or "hc_" in name or "kpool" in name for name in fp8_names)
    loaded_config, loaded = load_pretrained(tmp_path / "fp8")
    assert loaded_config == config
    _assert_trees_equal(loaded, dequantize_tree(quantize_params(params, "fp8")))
    _, kept = load_pretrained(tmp_path / "fp8", keep_fp8=True)
    assert is_quantized(kept["layers_0_to_0"]["linear_attention"]["o_proj"])
    _assert_trees_equal(kept, quantize_params(params, "fp8"))
