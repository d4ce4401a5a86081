"""glm5_jax.quant: formats (known encodings, round-trip error bounds), recipes, the declare_weight
hook (quantized leaves through nn.scan) and the native FP8 dot.

Round-trip bounds (per element, x the weight, s the scale that applies to it):
  fp8   E4M3 keeps 3 mantissa bits: normal values round within half an ulp, 2^-4 |x|; below the
        smallest normal (2^-6 s) the spacing is 2^-9 s, so within 2^-10 s.
        |x - dq| <= 2^-4 |x| + 2^-10 s.
  nvfp4 E2M1 grid gaps are 0.5 up to 2, 1 up to 4, 2 up to 6, so the rounding error is at most
        0.25 s below 2 and at most |x|/4 above; block scales are rounded up, so nothing clips.
        |x - dq| <= max(0.25 s, |x| / 4), s = e4m3 block scale * per-matrix scale.
  int8  round to nearest integer: |x - dq| <= s / 2, s = channel amax / 127.
A relative slack of 1e-6 covers the float32 divide and multiply.
"""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from reference import random_params

from glm5_jax.config_files import load_model_config
from glm5_jax.model import forward
from glm5_jax.model.layers import declare_weight
from glm5_jax.model.paged_decode import StepBatch, init_paged_cache, paged_step
from glm5_jax.quant import (
    FORMATS,
    MODULE_CLASSES,
    QuantizationError,
    builtin_recipes,
    dequantize,
    dequantize_tree,
    format_counts,
    is_quantized,
    load_recipe,
    quantize,
    quantize_params,
    weight_bytes,
    weight_layout,
)
from glm5_jax.quant.formats import (
    E2M1_GRID,
    _expand,
    e2m1_codes,
    e2m1_values,
    e4m3_round_up,
    to_e4m3,
)
from glm5_jax.quant.fp8_dot import fp8_matmul, quantize_activations
from glm5_jax.quant.recipes import recipe_from_dict

SLACK = 1 + 1e-6


def _weights(shape, seed=0):
    """Normal weights whose magnitude varies by 10^3 across rows, so blocks get distinct scales."""
    rng = np.random.default_rng(seed)
    rows = np.logspace(-3, 0, shape[-2])[:, None]
    return jnp.asarray(rng.standard_normal(shape) * rows, jnp.float32)


# Partial blocks on both axes (200 = 128 + 72, 150 = 128 + 22; 200 = 12*16 + 8) and a lead axis.
SHAPE = (2, 200, 150)


@pytest.fixture(scope="module")
def weight():
    return _weights(SHAPE)


# --- known encodings -------------------------------------------------------------------------

def test_e2m1_grid_and_codes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    expected = np.array(E2M1_GRID + tuple(-v for v in E2M1_GRID), np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_values(codes)), expected)
    assert E2M1_GRID == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    # Rounding (ties included) matches ml_dtypes' float4_e2m1fn on a sweep through every midpoint.
    sweep = np.arange(-7.0, 7.0 + 1e-9, 0.125, dtype=np.float32)
    ours = np.asarray(e2m1_values(e2m1_codes(jnp.asarray(sweep))))
    np.testing.assert_array_equal(ours, sweep.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.asarray(e2m1_codes(jnp.asarray([-0.1, 0.0]))).tolist() == [0, 0]  # -0 -> code 0


def test_e4m3_maximum_saturation_and_round_up():
    got = np.asarray(to_e4m3(jnp.asarray([448.0, 1000.0, -1e6, 449.0, 0.0])).astype(jnp.float32))
    np.testing.assert_array_equal(got, [448.0, 448.0, -448.0, 448.0, 0.0])
    assert float(jnp.finfo(jnp.float8_e4m3fn).max) == 448.0
    x = jnp.asarray(np.concatenate([np.linspace(0, 448, 997), [2.0**-9, 1e-4, 447.9]]), jnp.float32)
    up = np.asarray(e4m3_round_up(x).astype(jnp.float32))
    assert np.all(up >= np.asarray(x)) and not np.isnan(up).any()
    # Minimal: the next value down on the grid is below x.
    bits = up.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    below = np.maximum(bits, 1).__sub__(1).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.all((below < np.asarray(x)) | (up == 0))


def test_all_zero_blocks_have_unit_scale_and_zero_values():
    w = np.array(_weights((200, 150)))
    w[:128, :128] = 0.0  # one all-zero fp8 block (and eight 16-row nvfp4 blocks per column)
    w[:, 7] = 0.0  # one all-zero output channel (int8)
    w = jnp.asarray(w)
    q = quantize(w, "fp8")
    assert float(q.scales[0, 0]) == 1.0
    for fmt in FORMATS:
        q = quantize(w, fmt)
        dq = np.asarray(dequantize(q))
        assert not np.isnan(dq).any(), fmt
        assert np.all(dq[:128, :128] == 0) and np.all(dq[:, 7] == 0), fmt
    zero = quantize(jnp.zeros((3, 5)), "nvfp4")
    assert float(zero.tensor_scale) == 1.0 and np.all(np.asarray(dequantize(zero)) == 0)


def test_nvfp4_two_level_scale(weight):
    q = quantize(weight, "nvfp4")
    amax = np.abs(np.asarray(weight)).max(axis=(1, 2))
    np.testing.assert_allclose(np.asarray(q.tensor_scale), amax / (448 * 6), rtol=1e-6)
    assert q.scales.dtype == jnp.float8_e4m3fn and q.values.dtype == jnp.uint8
    assert q.scales.shape == (2, 13, 150) and q.values.shape == (2, 104, 150)  # 2 codes a byte
    # The block holding the matrix maximum gets the largest E4M3 scale, 448, exactly.
    assert np.asarray(q.scales.astype(jnp.float32)).max(axis=(1, 2)).tolist() == [448.0, 448.0]
    # Grid values times a block's scale come back exactly.
    # Every 16-row block holds +-6, so its scale is the largest (448, exact) and nothing rounds.
    block = np.array(E2M1_GRID + tuple(-v for v in E2M1_GRID[1:]) + (6.0,), np.float32)  # [16]
    grid = jnp.asarray(np.stack([np.roll(block, k) for k in range(3)], axis=1).repeat(2, axis=0))
    np.testing.assert_array_equal(np.asarray(dequantize(quantize(grid, "nvfp4"))), np.asarray(grid))


# --- round-trip error bounds -----------------------------------------------------------------

def test_fp8_round_trip_bound(weight):
    q = quantize(weight, "fp8")
    assert q.values.dtype == jnp.float8_e4m3fn and q.scales.shape == (2, 2, 2)
    s = np.asarray(_expand(q.scales, 128, 128, (200, 150)))
    x = np.asarray(weight)
    err = np.abs(x - np.asarray(dequantize(q)))
    assert np.all(err <= (2.0**-4 * np.abs(x) + 2.0**-10 * s) * SLACK)
    assert err.max() > 0  # the data is not trivially representable


def test_nvfp4_round_trip_bound(weight):
    q = quantize(weight, "nvfp4")
    s = np.asarray(_expand(q.scales.astype(jnp.float32) * q.tensor_scale[:, None, None], 16, 1,
                           (200, 150)))
    x = np.asarray(weight)
    assert np.all(6 * s * SLACK >= np.abs(x))  # rounded-up block scales: no value clips
    err = np.abs(x - np.asarray(dequantize(q)))
    assert np.all(err <= np.maximum(0.25 * s, np.abs(x) / 4) * SLACK)


def test_int8_round_trip_bound(weight):
    q = quantize(weight, "int8")
    s = np.asarray(q.scales)  # [2, 1, 150]
    np.testing.assert_allclose(s[:, 0], np.abs(np.asarray(weight)).max(axis=1) / 127, rtol=1e-6)
    err = np.abs(np.asarray(weight) - np.asarray(dequantize(q)))
    assert np.all(err <= s / 2 * SLACK)


def test_multi_axis_layout_blocks_the_flattened_view():
    """o_proj-like [N, Hv, D] with two input axes: blocks run over the [N*Hv, D] view."""
    w = _weights((3, 4, 48, 40))  # lead 3, in (4, 48) -> 192, out 40
    for fmt in FORMATS:
        q = quantize(w, fmt, in_ndim=2, out_ndim=1)
        assert q.shape == w.shape and q.in_shape == (4, 48) and q.out_shape == (40,)
        flat = dequantize(quantize(w.reshape(3, 192, 40), fmt))
        np.testing.assert_array_equal(np.asarray(dequantize(q)), np.asarray(flat).reshape(w.shape))
    with pytest.raises(QuantizationError, match="input and 1 output axes"):
        quantize(jnp.ones((5,)), "fp8")
    with pytest.raises(QuantizationError, match="unknown quantization format 'fp4'"):
        quantize(w, "fp4")


def test_weight_bytes_count_values_and_scales(weight):
    fp8 = quantize(weight, "fp8")
    assert fp8.nbytes == 2 * 200 * 150 + 2 * 2 * 2 * 4
    nvfp4 = quantize(weight, "nvfp4")
    assert nvfp4.nbytes == 2 * 104 * 150 + 2 * 13 * 150 + 2 * 4  # 4-bit values packed
    tree = {"a": fp8, "b": jnp.zeros((10,), jnp.float32)}
    assert weight_bytes(tree) == fp8.nbytes + 40
    assert weight_bytes(tree, jnp.bfloat16) == 2 * (2 * 200 * 150 + 10)


# --- recipes ---------------------------------------------------------------------------------

def test_builtin_recipes_and_layouts():
    assert {"fp8", "int8", "nvfp4", "mixed"} <= set(builtin_recipes())
    mixed = load_recipe("mixed")
    assert mixed.format_of("attention") == "fp8" and mixed.format_of("routed_experts") == "nvfp4"
    assert mixed.format_of("head") == "none" and mixed.format_of("embedding") == "none"
    assert weight_layout(("moe_layers", "attention", "o_proj")).in_ndim == 2
    assert weight_layout(("moe_layers", "moe", "shared_experts", "up_proj")).module_class == "shared_expert"
    assert weight_layout(("moe_layers", "moe", "router")) is None
    assert weight_layout(("dense_layers", "input_norm", "scale")) is None
    with pytest.raises(QuantizationError, match="no known quantization layout"):
        weight_layout(("moe_layers", "mystery"))


def test_recipe_errors_name_the_problem(tmp_path):
    with pytest.raises(QuantizationError, match="unknown quantization recipe 'fp9'.*mixed"):
        load_recipe("fp9")
    with pytest.raises(QuantizationError, match="unknown module class 'attn'"):
        recipe_from_dict("r", {"formats": {"attn": "fp8"}})
    with pytest.raises(QuantizationError, match="unknown format 'fp16' for attention"):
        recipe_from_dict("r", {"formats": {"attention": "fp16"}})
    with pytest.raises(QuantizationError, match="router is never quantized"):
        recipe_from_dict("r", {"formats": {"router": "fp8"}})
    with pytest.raises(QuantizationError, match=r"unknown field\(s\) \['scheme'\]"):
        recipe_from_dict("r", {"scheme": 1})
    path = tmp_path / "experts_int8.py"
    path.write_text("def get_config():\n    return {'formats': {'routed_experts': 'int8'}}\n")
    recipe = load_recipe(str(path))
    assert recipe.name == "experts_int8" and recipe.format_of("routed_experts") == "int8"
    assert recipe.format_of("attention") == "none"


# --- the model with quantized params ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """Tiny config (one dense, one MoE layer) where the forward is continuous in the weights (DSA
    keeps every key, every expert is chosen), so a small weight error gives a small logit error."""
    config = load_model_config("configs/tiny.py", index_topk=64, num_experts_per_token=8,
                               num_layers=2, num_mtp_layers=0)
    params = random_params(config, 0)
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    return config, params, ids, forward(config, params, ids)


@pytest.fixture(scope="module")
def tiny_mixed(tiny):
    return quantize_params(tiny[1], "mixed")  # fp8 attention + nvfp4 FFN: both block formats


def test_quantized_forward_equals_dequantized_params(tiny, tiny_mixed):
    """declare_weight dequantizes per layer inside nn.scan exactly as dequantizing beforehand."""
    config, params, ids, _ = tiny
    stacked = tiny_mixed["moe_layers"]["moe"]["gate_proj"]
    assert is_quantized(stacked) and stacked.shape == params["moe_layers"]["moe"]["gate_proj"].shape
    assert not is_quantized(tiny_mixed["moe_layers"]["moe"]["router"])
    np.testing.assert_allclose(forward(config, tiny_mixed, ids),
                               forward(config, dequantize_tree(tiny_mixed), ids), atol=1e-5, rtol=1e-5)


def test_paged_step_reads_quantized_params(tiny, tiny_mixed):
    """The serving path (paged_step casts each weight, which dequantizes a QuantizedTensor)
    gives forward's logits on a quantized model, embedding quantized too."""
    config, _, ids, _ = tiny
    quantized = {**tiny_mixed, "embed": quantize(tiny_mixed["embed"], "int8")}
    rows, length = ids.shape
    pages = -(-length // 4)
    tables = np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
    empty = np.zeros(0, np.int32)
    batch = StepBatch(empty, empty, np.asarray(ids, np.int32), positions, tables)
    logits, _ = paged_step(config, quantized, init_paged_cache(config, rows * pages, 4), batch,
                           np.arange(rows * length), block_pages=1)
    expected = forward(config, dequantize_tree(quantized), ids)
    np.testing.assert_allclose(logits.reshape(rows, length, -1), expected, atol=1e-4, rtol=1e-4)


def test_quantized_forward_close_to_unquantized(tiny, tiny_mixed):
    """Relative RMS logit error of the mixed recipe on this tiny random model: an empirical bound
    (measured 0.159; int8 gives 0.019, fp8 0.086) with 2.5x margin."""
    config, params, ids, reference = tiny
    counts = format_counts(tiny_mixed)
    assert counts["fp8"] > 0 and counts["nvfp4"] > 0
    logits = forward(config, tiny_mixed, ids)
    error = float(jnp.sqrt(jnp.mean((logits - reference) ** 2) / jnp.mean(reference**2)))
    assert 0 < error < 0.4
    quantized = tiny_mixed
    assert weight_bytes(quantized) < weight_bytes(params)


def test_flax_param_accepts_quantized_value_at_apply_time():
    """A quantized leaf under nn.scan's per-layer slicing; a wrong shape is a clear error."""

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            w = declare_weight(self, "w", (40, 40), ("embed", "mlp"), jnp.float32,
                               nn.initializers.normal(0.1))
            return x @ w, None

    stack = nn.scan(Dense, variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
                    metadata_params={nn.PARTITION_NAME: "layers"})
    x = jnp.ones((2, 40))
    params = nn.meta.unbox(stack().init(jax.random.key(0), x, None)["params"])
    quantized = {"w": quantize(params["w"], "fp8")}
    assert quantized["w"].shape == (3, 40, 40)
    out, _ = stack().apply({"params": quantized}, x, None)
    ref, _ = stack().apply({"params": {"w": dequantize(quantized["w"])}}, x, None)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    # Plain module.param would reject it: its shape check reads the first leaf (packed values).
    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ self.param("w", nn.initializers.zeros, (40, 40))

    with pytest.raises(flax.errors.ScopeParamShapeError):
        Plain().apply({"params": {"w": quantize(jnp.ones((40, 40)), "nvfp4")}}, x)
    with pytest.raises(ValueError, match=r"quantized param w .* shape \(40, 25\)"):
        stack().apply(
            {"params": {"w": quantize(jnp.ones((3, 40, 25)), "fp8")}}, x, None)


# --- native FP8 dot --------------------------------------------------------------------------

def test_fp8_matmul_matches_dequantized_within_activation_bound():
    """Error vs x @ dequant(w) comes only from the activation tiles: per element of x at most
    2^-4 |x| + 2^-10 s_tile, so |y - ref| <= 2^-4 |x| @ |w| + 2^-10 sum_k s_k |w_k| (+ f32 sums)."""
    x = _weights((2, 5, 200), seed=1)
    w = quantize(_weights((200, 150), seed=2), "fp8")
    dq = dequantize(w)
    y = fp8_matmul(x, w)
    assert y.shape == (2, 5, 150) and y.dtype == jnp.float32
    ref = np.asarray(x, np.float64) @ np.asarray(dq, np.float64)
    _, scales = quantize_activations(x.reshape(10, 200))
    s = np.repeat(np.asarray(scales), 128, axis=1)[:, :200].reshape(2, 5, 200)
    bound = (2.0**-4 * np.abs(np.asarray(x)) + 2.0**-10 * s) @ np.abs(np.asarray(dq, np.float64))
    err = np.abs(np.asarray(y) - ref)
    assert np.all(err <= bound * 1.001 + 1e-6 * np.abs(ref).max())
    with pytest.raises(QuantizationError, match="needs an 'fp8' weight"):
        fp8_matmul(x, quantize(_weights((200, 150)), "int8"))
    with pytest.raises(QuantizationError, match="leading axes"):
        fp8_matmul(x, quantize(_weights((2, 200, 150)), "fp8"))


def test_module_classes_cover_every_tiny_param(tiny):
    """Every param of the model is either quantizable under one class or never quantized."""
    _, params, _, _ = tiny
    classes = {weight_layout(p).module_class for p, _ in _flatten(params) if weight_layout(p)}
    # This config has no MTP layer and no KDA layer (tests/quant/test_quant_checkpoint.py covers one).
    assert classes == set(MODULE_CLASSES) - {"mtp_projection", "linear_attention"}
    assert weight_layout(("mtp", "eh_proj")).module_class == "mtp_projection"


def _flatten(tree, path=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, path + (key,))
    else:
        yield path, tree
