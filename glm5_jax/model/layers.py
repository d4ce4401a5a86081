"""Small building blocks: weight declaration, norms, rotary embedding, the SwiGLU MLP.

Einsum letters (one glossary for the whole model): B batch, T query length, S key length,
D hidden_size, N attention heads, H head dim, R low-rank latent, M indexer heads,
E experts, K top-k, F feed-forward hidden units, V vocabulary, L layers; a generic matmul: G a
batch of matrices, C rows, I and O its input and output widths; linear attention (kda.py): P the
value head dim, U chunks (C and S a chunk's query and key positions); W hyper-connection streams
(hyper_connections.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.quant.formats import dequantize, is_quantized
from glm5_jax.quant.matmul import linear


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


class WeightSpec(NamedTuple):
    """One weight of a table: its shape, logical axes, storage dtype and initializer."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    dtype: Any
    init: Callable


# A weight table: {checkpoint name: WeightSpec or a nested table}, in declaration order (Flax
# draws each scope's initial values in that order). Each component states its own (mla.py,
# dsa.py, moe.py, decoder.py); the training modules declare them, the math reads the same names.
WeightTable = dict[str, Any]


def declare_table(module: nn.Module, table: WeightTable) -> tuple[dict[str, Any], dict[str, Any]]:
    """Declares every weight of `table` on `module` (nested tables as child `Weights` modules of
    those names). Returns (the weights as a plain nested dict with the same names, the child
    scopes {name: (module, its scopes)} for `sow_tree`)."""
    weights, scopes = {}, {}
    for name, entry in table.items():
        if isinstance(entry, WeightSpec):
            weights[name] = declare_weight(module, name, *entry)
        else:
            child = Weights(entry, name=name)
            weights[name], inner = child()
            scopes[name] = (child, inner)
    return weights, scopes


def sow_tree(module: nn.Module, scopes: dict[str, Any], values: dict[str, Any]) -> None:
    """Sows {name: value, child: {...}} as intermediates of `module` and of its child scopes
    (`declare_table`'s), so diagnostics land beside the weights of the part that made them."""
    for name, value in values.items():
        if isinstance(value, dict):
            child, inner = scopes[name]
            sow_tree(child, inner, value)
        else:
            module.sow("intermediates", name, value)


class Weights(nn.Module):
    """A scope that declares a weight table (`declare_table`)."""

    table: WeightTable

    @nn.compact
    def __call__(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return declare_table(self, self.table)


def norm_weights(size: int, dtype) -> WeightTable:
    return {"scale": WeightSpec((size,), ("norm",), dtype, nn.initializers.ones)}


def mlp_weights(hidden_size: int, intermediate_size: int, initializer_range: float, dtype) -> WeightTable:
    """The SwiGLU MLP's weights (dense layers and the shared expert)."""
    init = normal_init(initializer_range)
    shape_in = (hidden_size, intermediate_size)
    return {"gate_proj": WeightSpec(shape_in, ("embed", "mlp"), dtype, init),
            "up_proj": WeightSpec(shape_in, ("embed", "mlp"), dtype, init),
            "down_proj": WeightSpec(shape_in[::-1], ("mlp", "embed"), dtype, init)}


def dense(x: jax.Array, weight, impl: str = "dequantize") -> jax.Array:
    """x [..., I] . weight [I, O] -> [..., O] in x's dtype: a float weight cast to x's dtype
    through `project` (training's mixed-precision backward), a QuantizedTensor through
    glm5_jax.quant.matmul.linear (`impl`: it may stay quantized)."""
    if is_quantized(weight):
        return linear(x, weight, impl, x.dtype)
    return project(x, weight.astype(x.dtype))


def weight_product(spec: str, x: jax.Array, weight, impl: str = "dequantize") -> jax.Array:
    """einsum `spec` (x's axes, the weight's, the output's; e.g. "BTR,RNH->BTNH") in x's dtype,
    for weights of several input or output axes: a float weight through `mixed_einsum`, a
    QuantizedTensor through glm5_jax.quant.matmul.linear (`impl`)."""
    if is_quantized(weight):
        x_axes, w_axes = spec.split("->")[0].split(",")
        return linear(x, weight, impl, x.dtype, in_ndim=len(set(x_axes) & set(w_axes)))
    return mixed_einsum(spec, x, weight.astype(x.dtype))


def mixed_einsum(spec: str, a: jax.Array, b: jax.Array, out_dtype=None) -> jax.Array:
    """jnp.einsum of two operands (spec "A,B->C", no axis summed within one operand) whose dots,
    forward and backward, multiply the operands in their own dtype and accumulate in float32;
    the result in out_dtype (default a's).

    Why not autodiff's backward: it multiplies the cotangent in the output's dtype, so a
    float32 output (attention scores, the LM head) makes the backward dots float32 (off bfloat16
    GEMMs on any device), and a bfloat16 one is a bfloat16-result dot, which XLA:CPU runs in
    float32, off AMX. Here the cotangent is cast to the compute dtype, as torch.autocast does.
    On XLA:CPU without a mesh each backward dot also reads its left operand as a row-major copy
    (`_accumulated_canonical`): left to itself XLA:CPU transposes an operand inside the fusion
    that produces it (e.g. SwiGLU's backward transposing the gate gradient for the weight
    gradient), whose strided writes ran ~10x slower than row-major ones. Under a mesh the
    copies would make GSPMD gather the operands, so there they are made for 16-bit operands
    only, which XLA:CPU cannot always multiply otherwise; GPU/TPU GEMMs read transposed operands."""
    _einsum_axes(spec)  # a spec the backward cannot take fails here, not at the first gradient
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    narrow = min(a.dtype.itemsize, b.dtype.itemsize) < 4
    row_major = jax.default_backend() == "cpu" and (jax.sharding.get_abstract_mesh().empty or narrow)
    return _mixed_einsum(spec, out_dtype, row_major, a, b)


def _einsum_axes(spec: str) -> tuple[str, str, str]:
    """"A,B->C" -> (A, B, C); every axis of one operand must appear in the other or the output."""
    inputs, out = spec.replace(" ", "").split("->")
    a_axes, b_axes = inputs.split(",")
    if not set(a_axes) <= set(b_axes + out) or not set(b_axes) <= set(a_axes + out):
        raise ValueError(f"mixed_einsum: {spec!r} sums an axis within one operand")
    return a_axes, b_axes, out


def _accumulated(spec: str, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """A bfloat16 dot that asks for a bfloat16 result runs in float32 on XLA:CPU: ask for float32."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mixed_einsum(spec, out_dtype, row_major, a, b):
    return _accumulated(spec, a, b, out_dtype)


def _mixed_einsum_forward(spec, out_dtype, row_major, a, b):
    return _accumulated(spec, a, b, out_dtype), (a, b)


def _mixed_einsum_backward(spec, out_dtype, row_major, saved, d_out):
    a, b = saved
    a_axes, b_axes, out = _einsum_axes(spec)
    d_out = d_out.astype(a.dtype)
    d_a = _accumulated_canonical(out, d_out, b_axes, b.astype(a.dtype), a_axes, row_major)
    d_b = _accumulated_canonical(a_axes, a.astype(b.dtype), out, d_out.astype(b.dtype), b_axes, row_major)
    return d_a.astype(a.dtype), d_b.astype(b.dtype)


_mixed_einsum.defvjp(_mixed_einsum_forward, _mixed_einsum_backward)


def _accumulated_canonical(x_axes: str, x: jax.Array, y_axes: str, y: jax.Array, out_axes: str,
                           row_major: bool):
    """einsum x_axes,y_axes->out_axes in float32; with row_major, x copied row-major as [batch,
    free, contracted] first. XLA:CPU would otherwise read x through a layout whose contracted
    axes are not minor: its bfloat16 dot kernels reject that, and on some shapes (an attention
    key gradient, contracting the query axis) the fallback fails outright ("Unsupported element
    type for DotThunk::Execute: BF16 x BF16 = F32", jax 0.10.2)."""
    batch = [axis for axis in x_axes if axis in y_axes and axis in out_axes]
    free = [axis for axis in x_axes if axis not in y_axes]
    contracted = [axis for axis in x_axes if axis in y_axes and axis not in out_axes]
    order = "".join(batch + free + contracted)
    if row_major and order != x_axes:
        x, x_axes = _row_major_transpose(x, tuple(x_axes.index(axis) for axis in order)), order
    return jnp.einsum(f"{x_axes},{y_axes}->{out_axes}", x, y, preferred_element_type=jnp.float32)


def _row_major_transpose(x: jax.Array, permutation: tuple[int, ...]) -> jax.Array:
    """jnp.transpose materialised row-major. A transpose of the minor axes alone becomes a layout
    change that XLA:CPU folds into the consuming dot, which then reads a column-major operand:
    a layout its bfloat16 (AMX) kernels reject, so the dot is upcast to float32 (4-7x slower at
    the weight gradients' shapes). Through a view with a trailing unit axis the transpose stays
    a copy; the barrier keeps XLA from folding it back into the dot."""
    moved = jnp.transpose(x[..., None], permutation + (x.ndim,))
    return jax.lax.optimization_barrier(moved.reshape(moved.shape[:-1]))


def batched_matmul(x: jax.Array, weight: jax.Array, out_dtype=None) -> jax.Array:
    """x [G, C, I] . weight [G, I, O] -> [G, C, O] (out_dtype: default x's), `mixed_einsum`."""
    return mixed_einsum("GCI,GIO->GCO", x, weight, out_dtype)


def project(x: jax.Array, weight: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., I] . weight [I, O] -> [..., O] (out_dtype: default x's), `mixed_einsum`."""
    if not jax.sharding.get_abstract_mesh().empty:  # x's axes as they are sharded
        return jnp.einsum("...I,IO->...O", x, weight, preferred_element_type=jnp.dtype(out_dtype or x.dtype))
    flat = mixed_einsum("CI,IO->CO", x.reshape(-1, x.shape[-1]), weight, out_dtype)
    return flat.reshape(x.shape[:-1] + weight.shape[-1:])


def vocab_logits(x: jax.Array, lm_head: jax.Array) -> jax.Array:
    """Logits of a vocabulary-wide projection in float32. x: [B, T, D]; lm_head: [D, V] in x's
    dtype. Returns [B, T, V]. Its weight gradient multiplies a contiguous x^T (`mixed_einsum`):
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


def swiglu(gate: jax.Array, up: jax.Array, limit: float = 0.0) -> jax.Array:
    """silu(gate) * up, elementwise (any matching shapes, e.g. [..., F]), in gate's dtype.

    limit > 0 (GLM-5.3-Flash's `swiglu_limit`) first clamps the inputs: gate to at most limit,
    up to [-limit, limit], bounding the activation of outlier tokens; 0 (GLM-5) leaves them as
    they are. Every feed-forward path (dense MLP, shared and routed experts) calls this."""
    if limit < 0:
        raise ValueError(f"swiglu_limit must be >= 0 (0 = no clamp), got {limit}")
    if limit:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def swiglu_mlp(x: jax.Array, weights: dict[str, Any], impl: str = "dequantize",
               swiglu_limit: float = 0.0) -> jax.Array:
    """down(swiglu(x gate, x up)). x: [..., D]; weights: gate_proj, up_proj [D, F], down_proj
    [F, D] (`mlp_weights`; float or quantized, see `dense`) -> [..., D]. swiglu_limit: see
    `swiglu` (0 = no clamp)."""
    gate, up = dense(x, weights["gate_proj"], impl), dense(x, weights["up_proj"], impl)
    return dense(swiglu(gate, up, swiglu_limit), weights["down_proj"], impl)
