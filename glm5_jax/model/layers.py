"""Small building blocks: weight declaration, norms, rotary embedding, the SwiGLU MLP.

Einsum letters (one glossary for the whole model): B batch, T query length, S key length,
D hidden_size, N attention heads, H head dim, R low-rank latent, M indexer heads,
E experts, K top-k, F feed-forward hidden units, V vocabulary, L layers.
"""

from __future__ import annotations

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


def vocab_logits(x: jax.Array, lm_head: jax.Array) -> jax.Array:
    """Logits of a vocabulary-wide projection in float32. x: [B, T, D]; lm_head: [D, V] in x's
    dtype. Returns [B, T, V]. Without a mesh, its weight gradient multiplies x^T, copied
    contiguous first, with the [B*T, V] output gradient: XLA:CPU otherwise transposes that big
    gradient (moe16 train step 3.19 -> 3.03 s, docs/benchmarks.md). Under a mesh the plain einsum,
    whose partitioning GSPMD chooses (the copy would make it gather x)."""
    if jax.sharding.get_abstract_mesh().empty:
        return _vocab_logits_contiguous(x, lm_head)
    return _vocab_einsum(x, lm_head)


def _vocab_einsum(x, lm_head):
    return jnp.einsum("BTD,DV->BTV", x, lm_head, preferred_element_type=jnp.float32)


_vocab_logits_contiguous = jax.custom_vjp(_vocab_einsum)


def _vocab_logits_forward(x, lm_head):
    return _vocab_logits_contiguous(x, lm_head), (x, lm_head)


def _vocab_logits_backward(saved, d_logits):
    x, lm_head = saved
    d_x = jnp.einsum("BTV,DV->BTD", d_logits, lm_head.astype(jnp.float32)).astype(x.dtype)
    # The barrier keeps XLA from folding the transpose back into the dot.
    x_t = jax.lax.optimization_barrier(jnp.transpose(x.reshape(-1, x.shape[-1])).astype(jnp.float32))
    d_head = (x_t @ d_logits.reshape(-1, d_logits.shape[-1])).astype(lm_head.dtype)
    return d_x, d_head


_vocab_logits_contiguous.defvjp(_vocab_logits_forward, _vocab_logits_backward)


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
    step passes glm5_jax.quant.matmul.linear); default: cast the weight, then einsum."""
    dtype = x.dtype
    if matmul is not None:
        return matmul(jax.nn.silu(matmul(x, gate_proj)) * matmul(x, up_proj), down_proj)
    gate = jnp.einsum("...D,DF->...F", x, gate_proj.astype(dtype))
    up = jnp.einsum("...D,DF->...F", x, up_proj.astype(dtype))
    return jnp.einsum("...F,FD->...D", jax.nn.silu(gate) * up, down_proj.astype(dtype))


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
