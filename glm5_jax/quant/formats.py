"""Quantized weight formats and the pytree leaf that holds them.

Every weight is viewed as a batch of 2-D matrices [..., I, O]: leading axes (the scan's layer
axis, the expert axis) are kept apart, then the contraction ("in") axes, then the output axes
(see glm5_jax.quant.layout for which axes are which per weight). Scales never span leading axes,
so `nn.scan` can slice a `QuantizedTensor` per layer like any array.

Formats (`QuantizedTensor.format`):
  "fp8"   float8_e4m3fn values [..., I, O] and a float32 scale per 128x128 block
          [..., ceil(I/128), ceil(O/128)] (scale = block amax / 448; the HF checkpoints'
          `weight_scale_inv`, transposed to our [in, out] view). Partial edge blocks are allowed.
  "nvfp4" E2M1 values (grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives) packed two per byte along
          I: uint8 [..., ceil(I/16)*8, O]; a float8_e4m3fn scale per 16 consecutive elements
          along I: [..., ceil(I/16), O]; a float32 scale per matrix [...].
  "int8"  int8 values [..., I, O] and a float32 symmetric scale per output channel [..., 1, O].
Dequantized x = values * scale (times the per-matrix scale for nvfp4).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 128
NVFP4_BLOCK = 16
# E2M1 magnitudes by 3-bit code; bit 3 of a 4-bit code is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring grid values, and whether a tie there rounds up: round to
# nearest, ties to the even code (as IEEE and ml_dtypes' float4_e2m1fn do).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))
FORMATS = ("fp8", "nvfp4", "int8")


class QuantizationError(ValueError):
    """A weight, format or recipe that cannot be quantized as asked."""


@struct.dataclass
class QuantizedTensor:
    """A quantized weight: arrays with the leading (layer, expert) axes first, plus static layout.

    in_shape / out_shape are the weight's contraction and output axes; the logical weight shape
    is values.shape[:-2] + in_shape + out_shape (the leading axes shrink when scan slices them).
    """

    values: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array | None
    format: str = struct.field(pytree_node=False)
    in_shape: tuple[int, ...] = struct.field(pytree_node=False)
    out_shape: tuple[int, ...] = struct.field(pytree_node=False)
    dtype: str = struct.field(pytree_node=False)  # dequantized dtype (the original weight's)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[:-2]) + self.in_shape + self.out_shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def astype(self, dtype) -> jax.Array:
        """The dequantized weight in `dtype`: code that casts weights before use (the decode path)
        dequantizes here, per layer when it runs inside a scan over the stacked weights."""
        return dequantize(self, jnp.dtype(dtype))

    def __getitem__(self, index) -> jax.Array:
        """Rows of the dequantized weight (an embedding lookup)."""
        return dequantize(self)[index]

    @property
    def nbytes(self) -> int:
        """Bytes stored: values (nvfp4 packed, 4 bits each) + all scales."""
        arrays = [self.values, self.scales] + ([self.tensor_scale] if self.tensor_scale is not None else [])
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def is_quantized(leaf) -> bool:
    return isinstance(leaf, QuantizedTensor)


def _as_matrices(weight: jax.Array, in_ndim: int, out_ndim: int):
    """[..., *in_shape, *out_shape] -> ([..., I, O] float32, in_shape, out_shape)."""
    if in_ndim < 1 or out_ndim < 1 or weight.ndim < in_ndim + out_ndim:
        raise QuantizationError(f"weight of shape {weight.shape} has no {in_ndim} input and "
                                f"{out_ndim} output axes to quantize over")
    lead = weight.ndim - in_ndim - out_ndim
    in_shape = tuple(weight.shape[lead:lead + in_ndim])
    out_shape = tuple(weight.shape[lead + in_ndim:])
    matrices = weight.astype(jnp.float32).reshape(weight.shape[:lead] + (math.prod(in_shape),
                                                                         math.prod(out_shape)))
    return matrices, in_shape, out_shape


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _block_amax(matrices: jax.Array, rows: int, cols: int) -> jax.Array:
    """[..., I, O] -> max |x| per rows x cols block [..., ceil(I/rows), ceil(O/cols)] (zero padded)."""
    padded = _pad_to(_pad_to(jnp.abs(matrices), -2, rows), -1, cols)
    *lead, i, o = padded.shape
    return padded.reshape(*lead, i // rows, rows, o // cols, cols).max(axis=(-3, -1))


def _expand(scales: jax.Array, rows: int, cols: int, shape: tuple[int, int]) -> jax.Array:
    """Block scales [..., Ib, Ob] -> per element [..., I, O] (edge blocks cut to size)."""
    full = jnp.repeat(jnp.repeat(scales, rows, axis=-2), cols, axis=-1)
    return full[..., :shape[0], :shape[1]]


def to_e4m3(x: jax.Array) -> jax.Array:
    """Rounds to float8_e4m3fn (nearest even), saturating at +-448 instead of overflowing to NaN."""
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def e4m3_round_up(x: jax.Array) -> jax.Array:
    """The smallest float8_e4m3fn >= x, for 0 <= x <= 448 (so block scales never clip values)."""
    nearest = to_e4m3(x)
    bits = jax.lax.bitcast_convert_type(nearest, jnp.uint8)
    # Positive e4m3fn values are ordered like their bit patterns: +1 is the next value up.
    up = jax.lax.bitcast_convert_type(bits + jnp.uint8(1), jnp.float8_e4m3fn)
    return jnp.where(nearest.astype(jnp.float32) < x, up, nearest)


def e2m1_codes(x: jax.Array) -> jax.Array:
    """Rounds x (already scaled, |x| <= 6 expected; larger saturates) to 4-bit E2M1 codes (uint8)."""
    magnitude = jnp.abs(x)
    index = jnp.zeros(x.shape, jnp.uint8)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        above = magnitude >= midpoint if tie_up else magnitude > midpoint
        index = index + above.astype(jnp.uint8)
    sign = (x < 0).astype(jnp.uint8) << 3
    return jnp.where(index == 0, jnp.uint8(0), sign | index)  # -0 encodes as +0


def e2m1_values(codes: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (uint8) -> float32 values."""
    table = jnp.asarray(E2M1_GRID + tuple(-v for v in E2M1_GRID), jnp.float32)
    return table[codes.astype(jnp.int32)]


def quantize_fp8(weight: jax.Array, in_ndim: int = 1, out_ndim: int = 1) -> QuantizedTensor:
    """FP8 E4M3 with a float32 scale per 128x128 block of each [I, O] matrix."""
    matrices, in_shape, out_shape = _as_matrices(weight, in_ndim, out_ndim)
    amax = _block_amax(matrices, FP8_BLOCK, FP8_BLOCK)
    scales = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)  # all-zero block: scale 1, values 0
    values = to_e4m3(matrices / _expand(scales, FP8_BLOCK, FP8_BLOCK, matrices.shape[-2:]))
    return QuantizedTensor(values, scales, None, "fp8", in_shape, out_shape, jnp.dtype(weight.dtype).name)


def quantize_int8(weight: jax.Array, in_ndim: int = 1, out_ndim: int = 1) -> QuantizedTensor:
    """int8 symmetric with a float32 scale per output channel (amax over the input axis / 127)."""
    matrices, in_shape, out_shape = _as_matrices(weight, in_ndim, out_ndim)
    amax = jnp.max(jnp.abs(matrices), axis=-2, keepdims=True)  # [..., 1, O]
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(matrices / scales), -127, 127).astype(jnp.int8)
    return QuantizedTensor(values, scales, None, "int8", in_shape, out_shape, jnp.dtype(weight.dtype).name)


def quantize_nvfp4(weight: jax.Array, in_ndim: int = 1, out_ndim: int = 1) -> QuantizedTensor:
    """NVFP4: E2M1 values, an E4M3 scale per 16 elements along the input axis, a float32 scale
    per matrix chosen so the largest block scale is 448 (global = amax / (448 * 6)).

    Block scales are rounded up to the E4M3 grid, so no value is clipped beyond 6.
    """
    matrices, in_shape, out_shape = _as_matrices(weight, in_ndim, out_ndim)
    tensor_amax = jnp.max(jnp.abs(matrices), axis=(-2, -1))  # [...]
    tensor_scale = jnp.where(tensor_amax > 0, tensor_amax / (E4M3_MAX * E2M1_MAX), 1.0)
    amax = _block_amax(matrices, NVFP4_BLOCK, 1)  # [..., Ib, O]
    exact = jnp.minimum(amax / (E2M1_MAX * tensor_scale[..., None, None]), E4M3_MAX)
    scales = e4m3_round_up(exact)
    effective = _expand(scales.astype(jnp.float32) * tensor_scale[..., None, None], NVFP4_BLOCK, 1,
                        matrices.shape[-2:])
    scaled = jnp.where(effective > 0, matrices / jnp.where(effective > 0, effective, 1.0), 0.0)
    codes = _pad_to(e2m1_codes(scaled), -2, NVFP4_BLOCK)  # [..., Ib*16, O]
    packed = codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)  # rows 2i (low nibble), 2i+1 (high)
    return QuantizedTensor(packed, scales, tensor_scale, "nvfp4", in_shape, out_shape,
                           jnp.dtype(weight.dtype).name)


QUANTIZERS = {"fp8": quantize_fp8, "nvfp4": quantize_nvfp4, "int8": quantize_int8}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def quantize(weight: jax.Array, fmt: str, in_ndim: int = 1, out_ndim: int = 1) -> QuantizedTensor:
    """weight [..., *in_shape, *out_shape] -> QuantizedTensor in format `fmt` (jitted)."""
    if fmt not in QUANTIZERS:
        raise QuantizationError(f"unknown quantization format {fmt!r}; known: {', '.join(FORMATS)}")
    return QUANTIZERS[fmt](weight, in_ndim, out_ndim)


def _unpack_nvfp4(packed: jax.Array, rows: int) -> jax.Array:
    """uint8 [..., P, O] -> codes [..., rows, O] (low nibble first)."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-2)  # [..., P, 2, O]
    return codes.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])[..., :rows, :]


def dequantize_matrices(q: QuantizedTensor, dtype=None) -> jax.Array:
    """QuantizedTensor -> its [..., I, O] matrices in `dtype` (default: the original dtype)."""
    dtype = q.dtype if dtype is None else dtype
    shape = (math.prod(q.in_shape), math.prod(q.out_shape))
    if q.format == "fp8":
        out = q.values.astype(jnp.float32) * _expand(q.scales, FP8_BLOCK, FP8_BLOCK, shape)
    elif q.format == "int8":
        out = q.values.astype(jnp.float32) * q.scales
    elif q.format == "nvfp4":
        scales = q.scales.astype(jnp.float32) * q.tensor_scale[..., None, None]
        out = e2m1_values(_unpack_nvfp4(q.values, shape[0])) * _expand(scales, NVFP4_BLOCK, 1, shape)
    else:
        raise QuantizationError(f"unknown quantization format {q.format!r}")
    return out.astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def dequantize(q: QuantizedTensor, dtype=None) -> jax.Array:
    """QuantizedTensor -> the weight in its logical shape, in `dtype` (default: the original)."""
    matrices = dequantize_matrices(q, dtype)
    return matrices.reshape(q.shape)


def dequantize_tree(tree, dtype=None):
    """Replaces every QuantizedTensor in a params tree (or one layer's slice) by its dequantized array."""
    return jax.tree.map(lambda leaf: dequantize(leaf, dtype) if is_quantized(leaf) else leaf, tree,
                        is_leaf=is_quantized)
