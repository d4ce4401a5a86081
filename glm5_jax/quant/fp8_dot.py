"""Native FP8 matmul against an FP8 block-scaled weight (DeepSeek-V3 style).

Activations are quantized per 1x128 tile along the contraction axis (scale = tile amax / 448),
then every 128-wide slice of the contraction runs as one float8 x float8 dot with float32
accumulation (`preferred_element_type`), scaled by the activation tile scale times the weight's
128x128 block scale, and the slices are summed:

    y[t, o] = sum_k  xs[t, k] * ws[k, o // 128] * (xq[t, k, :] . wq[k, :, o])

On GPUs with FP8 tensor cores (Hopper and later) XLA runs the float8 dot natively; XLA:CPU
runs it too (upcasting), which is how the tests check it. The serving step uses it with
`ExecutionOptions.quantized_matmul="native"` (glm5_jax.quant.matmul); training and `forward`
dequantize instead (glm5_jax.model.layers.declare_weight).
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
    rows = weight.values.shape[0]
    if x.shape[-1] != rows:
        raise QuantizationError(f"fp8_matmul: x has {x.shape[-1]} input features, the weight {rows}")
    lead = x.shape[:-1]
    out = fp8_matmul_batched(x.reshape(1, -1, rows), weight.values[None], weight.scales[None])[0]
    return out.reshape(lead + weight.out_shape)


def fp8_matmul_batched(x: jax.Array, values: jax.Array, scales: jax.Array) -> jax.Array:
    """Batch b: x[b] times matrix b of an fp8 weight stack. x [B, T, I]; values float8_e4m3fn
    [B, I, O]; scales float32 [B, ceil(I/128), ceil(O/128)] -> float32 [B, T, O].

    Only the contraction axis of the weight is padded (a copy when I is not a multiple of 128);
    the output axis is used as stored."""
    batch, tokens, rows = x.shape
    cols = values.shape[-1]
    x_tiles, x_scales = quantize_activations(x.reshape(batch * tokens, rows))  # [B*T, Ib, 128], [B*T, Ib]
    x_tiles = x_tiles.reshape(batch, tokens, -1, FP8_BLOCK).transpose(0, 2, 1, 3)  # [B, Ib, T, 128]
    w_tiles = _pad_to(values, 1, FP8_BLOCK).reshape(batch, -1, FP8_BLOCK, cols)  # [B, Ib, 128, O]
    # Batch over (B, the 128-wide contraction slices): [B, Ib, T, 128] x [B, Ib, 128, O] -> [B, Ib, T, O].
    partial = jax.lax.dot_general(x_tiles, w_tiles, (((3,), (2,)), ((0, 1), (0, 1))),
                                  preferred_element_type=jnp.float32)
    w_scales = jnp.repeat(scales, FP8_BLOCK, axis=-1)[..., :cols]  # [B, Ib, O]
    return jnp.einsum("BKTO,BTK,BKO->BTO", partial, x_scales.reshape(batch, tokens, -1), w_scales)
