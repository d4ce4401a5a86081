"""Native FP8 matmul against an FP8 block-scaled weight (DeepSeek-V3 style).

Activations are quantized per 1x128 tile along the contraction axis (scale = tile amax / 448),
then every 128-wide slice of the contraction runs as one float8 x float8 dot with float32
accumulation (`preferred_element_type`), scaled by the activation tile scale times the weight's
128x128 block scale, and the slices are summed:

    y[t, o] = sum_k  xs[t, k] * ws[k, o // 128] * (xq[t, k, :] . wq[k, :, o])

On GPUs with FP8 tensor cores (Hopper and later) XLA runs the float8 dot natively; XLA:CPU
runs it too (upcasting), which is how the tests check it. The model's default path
dequantizes the weight instead (glm5_jax.model.layers.declare_weight); this op is the
building block for modules that want the FP8 dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.quant.formats import (
    E4M3_MAX,
    FP8_BLOCK,
    QuantizationError,
    QuantizedTensor,
    _pad_to,
    to_e4m3,
)


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [T, I] -> (float8_e4m3fn tiles [T, Ib, 128], float32 scales [T, Ib]), Ib = ceil(I/128).

    The contraction axis is zero padded to a multiple of 128 (zeros add nothing to the dot)."""
    padded = _pad_to(x.astype(jnp.float32), -1, FP8_BLOCK)
    tiles = padded.reshape(x.shape[0], -1, FP8_BLOCK)  # [T, Ib, 128]
    amax = jnp.max(jnp.abs(tiles), axis=-1)
    scales = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return to_e4m3(tiles / scales[..., None]), scales


def fp8_matmul(x: jax.Array, weight: QuantizedTensor) -> jax.Array:
    """x: [..., I] times an "fp8" QuantizedTensor with logical shape in_shape + out_shape (no
    leading axes; I = prod(in_shape)) -> float32 [..., *out_shape]."""
    if weight.format != "fp8":
        raise QuantizationError(f"fp8_matmul needs an 'fp8' weight, got {weight.format!r}")
    if weight.values.ndim != 2:
        raise QuantizationError(f"fp8_matmul needs one matrix; this weight has leading axes "
                                f"{weight.values.shape[:-2]} (slice it per layer / expert first)")
    rows, cols = weight.values.shape
    if x.shape[-1] != rows:
        raise QuantizationError(f"fp8_matmul: x has {x.shape[-1]} input features, the weight {rows}")
    lead = x.shape[:-1]
    x_tiles, x_scales = quantize_activations(x.reshape(-1, rows))  # [T, Ib, 128], [T, Ib]
    w = _pad_to(_pad_to(weight.values, 0, FP8_BLOCK), 1, FP8_BLOCK)  # [Ib*128, Ob*128]
    w_tiles = w.reshape(-1, FP8_BLOCK, w.shape[1])  # [Ib, 128, Opad]
    # Batch over the 128-wide contraction slices: [Ib, T, 128] x [Ib, 128, Opad] -> [Ib, T, Opad].
    partial = jax.lax.dot_general(
        jnp.swapaxes(x_tiles, 0, 1), w_tiles, (((2,), (1,)), ((0,), (0,))),
        preferred_element_type=jnp.float32)
    w_scales = jnp.repeat(weight.scales, FP8_BLOCK, axis=1)  # [Ib, Opad]
    out = jnp.einsum("KTO,TK,KO->TO", partial, x_scales, w_scales)[:, :cols]
    return out.reshape(lead + weight.out_shape)
