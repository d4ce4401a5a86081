"""Matmuls against weights that may be quantized: how the serving step multiplies activations by
an FP8 weight is an execution option (`ExecutionOptions.quantized_matmul`).

  "dequantize"  weight.astype(dtype), then a plain einsum: every format; a full float copy of the
                weight is made per layer (inside the scan) and read by the matmul.
  "native"      "fp8" weights: float8 x float8 XLA dots (glm5_jax.quant.fp8_dot; activations
                quantized per 1x128 tile, float32 accumulation), native on FP8 tensor cores.
  "pallas"      "fp8" weights: kernels_pallas.fp8_matmul, the weight dequantized tile by tile
                inside the kernel (activations stay in the compute dtype).
Float weights always take the plain einsum, and "int8" / "nvfp4" weights are dequantized
whatever the option says (weight-only formats here).

Three shapes of product occur in the serving step, one function each:
  linear         x [..., *in_shape] . W [*in_shape, *out_shape]  (projections, dense MLPs)
  expert_linear  per (token, k): x [T, K, I] . W[experts[t, k]]    (gathered routed experts)
  head_outputs / head_inputs: kv_b_proj [R, N, H] used per head on a column range of each
                 head, contracting R (the value half) or the columns (the key half folded into
                 the query). For "native" and "pallas" these run as XLA dots over 128-row bands
                 of the fp8 values converted to the compute dtype inside the dot, the block
                 scales applied to the dot's output or input (never to a weight copy).
Einsum letters as in glm5_jax/model/layers.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from glm5_jax.quant.formats import FP8_BLOCK, QuantizedTensor, is_quantized
from glm5_jax.quant.fp8_dot import fp8_matmul, fp8_matmul_batched

IMPLS = ("dequantize", "native", "pallas")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"quantized matmul impl must be one of {IMPLS}, got {impl!r}")


def in_matmul(weight, impl: str) -> bool:
    """Whether `impl` multiplies this weight without dequantizing it first (fp8, not "dequantize")."""
    _check_impl(impl)
    return is_quantized(weight) and weight.format == "fp8" and impl != "dequantize"


def linear(x: jax.Array, weight, impl: str = "dequantize", dtype=None, in_ndim: int = 1) -> jax.Array:
    """x [..., *in_shape] times weight [*in_shape, *out_shape] -> [..., *out_shape] in `dtype`
    (default x.dtype). weight: a float array or a QuantizedTensor without leading axes (one
    layer's slice); in_ndim: how many of its axes are contracted (x's last in_ndim axes)."""
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if is_quantized(weight) and len(weight.in_shape) != in_ndim:
        raise ValueError(f"weight contracts {len(weight.in_shape)} axes {weight.in_shape}, in_ndim={in_ndim}")
    in_shape = tuple(weight.shape[:in_ndim])
    out_shape = tuple(weight.shape[in_ndim:])
    if x.shape[x.ndim - in_ndim:] != in_shape:
        raise ValueError(f"x {x.shape} does not end in the weight's input axes {in_shape}")
    lead = x.shape[:x.ndim - in_ndim]
    flat = x.reshape(lead + (math.prod(in_shape),))  # [..., I]
    if not in_matmul(weight, impl):
        matrix = weight.astype(dtype).reshape(flat.shape[-1], -1)  # [I, O]
        return jnp.einsum("...I,IO->...O", flat.astype(dtype), matrix).reshape(lead + out_shape)
    if weight.values.ndim != 2:
        raise ValueError(f"linear takes one matrix; this weight has leading axes {weight.values.shape[:-2]}")
    if impl == "native":
        out = fp8_matmul(flat, weight)  # float32 [..., *out_shape]
        return out.astype(dtype)
    from kernels_pallas.fp8_matmul import fp8_matmul as kernel  # optional kernel

    rows = flat.reshape(-1, flat.shape[-1]).astype(dtype)  # [T, I]
    out = kernel(rows, weight.values, weight.scales, out_dtype=dtype)  # [T, O]
    return out.reshape(lead + out_shape)


def expert_linear(x: jax.Array, weight, experts: jax.Array, impl: str = "dequantize",
                  dtype=None) -> jax.Array:
    """Each (token, k) through its own expert matrix: x [T, K, I] (or [T, 1, I]: the same row for
    every k); weight [E, I, O] (float or QuantizedTensor); experts [T, K] int -> [T, K, O].

    "pallas" reads the chosen experts' fp8 tiles straight from the stack (no gathered copy);
    "native" gathers their fp8 values and scales ([T, K, I, O] bytes, not the float copy of all
    E experts that "dequantize" makes before gathering)."""
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    tokens, top_k = experts.shape
    x = jnp.broadcast_to(x.astype(dtype), (tokens, top_k, x.shape[-1]))
    if not in_matmul(weight, impl):
        gathered = weight.astype(dtype)[experts]  # [T, K, I, O]
        # (T, K) as batch dimensions of both operands, so the gathered matrices are used in place
        # ("TI,TKIO" made XLA:CPU transpose them first: docs/benchmarks.md, "Quantized experts").
        return jnp.einsum("TKI,TKIO->TKO", x, gathered)
    flat_experts = experts.reshape(-1)  # [T*K]
    rows = x.reshape(tokens * top_k, 1, x.shape[-1])  # one row per (token, k)
    if impl == "native":
        out = fp8_matmul_batched(rows, weight.values[flat_experts], weight.scales[flat_experts]).astype(dtype)
    else:
        from kernels_pallas.fp8_matmul import fp8_matmul as kernel  # optional kernel

        out = kernel(rows, weight.values, weight.scales, group_ids=flat_experts, out_dtype=dtype)
    return out.reshape(tokens, top_k, -1)  # [T*K, 1, O] -> [T, K, O]


def _bands(weight: QuantizedTensor, start: int, stop: int):
    """fp8 weight [R, N, H] -> per 128-row band: (rows slice, values [r, N, stop - start] fp8,
    scale of each (head, column) in the band [N, stop - start] float32)."""
    rows = weight.values.shape[0]
    heads, width = weight.out_shape
    values = weight.values.reshape(rows, heads, width)[..., start:stop]
    for band in range(weight.scales.shape[0]):
        cols = jnp.repeat(weight.scales[band], FP8_BLOCK)[:heads * width].reshape(heads, width)
        part = slice(band * FP8_BLOCK, min((band + 1) * FP8_BLOCK, rows))
        yield part, values[part], cols[:, start:stop]


def head_outputs(x: jax.Array, weight, start: int, stop: int, impl: str = "dequantize",
                 dtype=None) -> jax.Array:
    """out[..., n, h] = sum_r x[..., n, r] W[r, n, start + h]: x [..., N, R], weight [R, N, H]
    (kv_b_proj; columns [start, stop) of each head, e.g. the value half) -> [..., N, stop - start]."""
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if not in_matmul(weight, impl):
        return jnp.einsum("...NR,RNH->...NH", x.astype(dtype), weight.astype(dtype)[..., start:stop])
    out = 0.0
    for part, values, scales in _bands(weight, start, stop):
        partial = jnp.einsum("...NR,RNH->...NH", x[..., part].astype(dtype), values.astype(dtype),
                             preferred_element_type=jnp.float32)
        out = out + partial * scales  # the band's block scale per output column
    return out.astype(dtype)


def head_inputs(x: jax.Array, weight, start: int, stop: int, impl: str = "dequantize",
                dtype=None) -> jax.Array:
    """out[..., n, r] = sum_h x[..., n, h] W[r, n, start + h]: x [..., N, stop - start], weight
    [R, N, H] (kv_b_proj's key half folded into the query) -> [..., N, R]."""
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if not in_matmul(weight, impl):
        return jnp.einsum("...NH,RNH->...NR", x.astype(dtype), weight.astype(dtype)[..., start:stop])
    parts = []
    for _, values, scales in _bands(weight, start, stop):
        scaled = (x.astype(jnp.float32) * scales).astype(dtype)  # the block scale moves onto x
        parts.append(jnp.einsum("...NH,RNH->...NR", scaled, values.astype(dtype),
                                preferred_element_type=jnp.float32))
    return jnp.concatenate(parts, axis=-1).astype(dtype)
