"""Small building blocks: weight declaration, norms, rotary embedding, the SwiGLU MLP.

Einsum letters (one glossary for the whole model): B batch, T query length, S key length,
D hidden_size, N attention heads, H head dim, R low-rank latent, M indexer heads,
E experts, K top-k, F feed-forward hidden units, V vocabulary, L layers; a generic matmul: G a
batch of matrices, C rows, I and O its input and output widths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.quant.formats import dequantize, is_quantized


def declare_weight(module: nn.Module, name: str, shape: tuple[int, ...],
                   axes: tuple[str, ...], dtype, init) -> jax.Array:
    """Declares a weight on `module` with logical axis names (see glm5_jax.parallel).

    A weight stored quantized (a glm5_jax.quant QuantizedTensor) comes back dequantized to its
    original dtype, so modules never see the format; inside a scanned stack this happens per
    layer (dequantize-on-the-fly).
    """
    assert len(shape) == len(axes), (name, shape, axes)
    # Read through get_variable, not module.param: param's shape check compares the stored
    # tree's first leaf with `shape`, and a QuantizedTensor's values are the [..., I, O] view
    # (packed for NVFP4), so it would reject them. The shape is checked here instead.
    if module.has_variable("params", name):
        stored = module.get_variable("params", name)
        if is_quantized(stored):
            if stored.shape != tuple(shape):
                raise ValueError(f"quantized param {name} of {module.name or type(module).__name__} "
                                 f"has shape {stored.shape}, the module expects {tuple(shape)}")
            return dequantize(stored)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def normal_init(stddev: float):
    return nn.initializers.normal(stddev=stddev)


def _batched_einsum(x: jax.Array, weight: jax.Array, out_dtype) -> jax.Array:
    """x [G, C, I] . weight [G, I, O] -> [G, C, O] in out_dtype."""
    return jnp.einsum("GCI,GIO->GCO", x, weight, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _contiguous_matmul(x: jax.Array, weight: jax.Array, out_dtype) -> jax.Array:
    return _batched_einsum(x, weight, out_dtype)


def _contiguous_matmul_forward(x, weight, out_dtype):
    return _batched_einsum(x, weight, out_dtype), (x, weight)


def _contiguous_matmul_backward(out_dtype, saved, d_out):
    """Gradients in the output's dtype, returned in the inputs'. The weight gradient multiplies
    x^T, copied contiguous first (the barrier keeps XLA from folding the transpose back into the
    dot): left to itself, XLA:CPU transposes the output gradient instead, inside the fusion that
    produces it (e.g. SwiGLU's backward), whose strided writes ran ~10x slower than its
    row-major ones."""
    x, weight = saved
    d_x = jnp.einsum("GCO,GIO->GCI", d_out, weight.astype(d_out.dtype)).astype(x.dtype)
    x_t = jax.lax.optimization_barrier(jnp.swapaxes(x, 1, 2).astype(d_out.dtype))  # [G, I, C]
    d_weight = jnp.einsum("GIC,GCO->GIO", x_t, d_out).astype(weight.dtype)
    return d_x, d_weight


_contiguous_matmul.defvjp(_contiguous_matmul_forward, _contiguous_matmul_backward)


def batched_matmul(x: jax.Array, weight: jax.Array, out_dtype=None) -> jax.Array:
    """x [G, C, I] . weight [G, I, O] -> [G, C, O] (out_dtype: default x's), the weight gradient
    from a contiguous x^T (`_contiguous_matmul_backward`) when no mesh is active; under a mesh
    the plain einsum, whose partitioning GSPMD chooses (the copy would make it gather x)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if jax.sharding.get_abstract_mesh().empty:
        return _contiguous_matmul(x, weight, out_dtype)
    return _batched_einsum(x, weight, out_dtype)


def project(x: jax.Array, weight: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., I] . weight [I, O] -> [..., O] (out_dtype: default x's), as `batched_matmul`."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if not jax.sharding.get_abstract_mesh().empty:  # x's axes as they are sharded
        return jnp.einsum("...I,IO->...O", x, weight, preferred_element_type=out_dtype)
    flat = _contiguous_matmul(x.reshape(1, -1, x.shape[-1]), weight[None], out_dtype)
    return flat.reshape(x.shape[:-1] + weight.shape[-1:])


def vocab_logits(x: jax.Array, lm_head: jax.Array) -> jax.Array:
    """Logits of a vocabulary-wide projection in float32. x: [B, T, D]; lm_head: [D, V] in x's
    dtype. Returns [B, T, V]. Its weight gradient multiplies a contiguous x^T (`project`):
    moe16 train step 3.19 -> 3.03 s (docs/benchmarks.md)."""
    return project(x, lm_head, jnp.float32)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMS(x; w, eps) = w * x / sqrt(mean(x^2) + eps), normalised in float32.

    x: [..., D]; scale: [D]. The normalised value is cast back to x's dtype before the scale
    multiply, as the reference does.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, computed in float32. x: [..., H]; scale, bias: [H]."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rope_angles(positions: jax.Array, rope_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotation angles. positions: [B, T] -> two [B, T, rope_dim // 2] float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved (GPT-J) RoPE: pair (x_2i, x_2i+1) rotates by angle_i.

    x: [B, T, ..., R] (any number of head axes); cos, sin: [B, T, R/2].
    The rotated pairs come back as [all first elements, all second elements]: one fixed
    permutation of the features, applied alike to queries and keys, so every query-key dot
    product equals that of the interleaved layout (the reference stores it the same way).
    """
    extra_axes = x.ndim - cos.ndim
    shape = cos.shape[:2] + (1,) * extra_axes + cos.shape[2:]
    cos = cos.reshape(shape).astype(x.dtype)
    sin = sin.reshape(shape).astype(x.dtype)
    first, second = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def swiglu_mlp(x: jax.Array, gate_proj: jax.Array, up_proj: jax.Array,
               down_proj: jax.Array, matmul: Callable | None = None) -> jax.Array:
    """down(silu(x gate) * (x up)). x: [..., D]; gate/up: [D, F]; down: [F, D] -> [..., D].

    matmul(x, weight) -> x . weight in x's dtype, for weights that stay quantized (the serving
    step passes glm5_jax.quant.matmul.linear); default: cast the weight, then `project`."""
    dtype = x.dtype
    if matmul is not None:
        return matmul(jax.nn.silu(matmul(x, gate_proj)) * matmul(x, up_proj), down_proj)
    gate = project(x, gate_proj.astype(dtype))
    up = project(x, up_proj.astype(dtype))
    return project(jax.nn.silu(gate) * up, down_proj.astype(dtype))


class MLP(nn.Module):
    """SwiGLU feed-forward block (the dense layers and the shared expert)."""

    hidden_size: int
    intermediate_size: int
    initializer_range: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] -> [B, T, D]."""
        init = normal_init(self.initializer_range)
        shape_in = (self.hidden_size, self.intermediate_size)
        gate = declare_weight(self, "gate_proj", shape_in, ("embed", "mlp"), self.param_dtype, init)
        up = declare_weight(self, "up_proj", shape_in, ("embed", "mlp"), self.param_dtype, init)
        down = declare_weight(self, "down_proj", shape_in[::-1], ("mlp", "embed"),
                              self.param_dtype, init)
        return swiglu_mlp(x, gate, up, down)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (leaf named `scale`)."""

    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = declare_weight(self, "scale", (x.shape[-1],), ("norm",), self.param_dtype,
                               nn.initializers.ones)
        return rms_norm(x, scale, self.eps)
