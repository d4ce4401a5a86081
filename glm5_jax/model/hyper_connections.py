"""Manifold-constrained hyper-connections (mHC), GLM-5.3-Flash's residual stream: W parallel
streams [B, T, W, D] instead of one, and around each sublayer (attention, FFN):

    r        = RMS(flatten(x)) (no weight), computed in float32       [B, T, W * D]
    pre      = sigmoid(s_pre  r Fpre  + b_pre) + eps                  [B, T, W]
    post     = 2 sigmoid(s_post r Fpost + b_post)                     [B, T, W]
    comb     = Sinkhorn(softmax(s_comb r Fcomb + b_comb) + eps)       [B, T, W, W], doubly stochastic
    block in = sum_w pre_w x_w                                        [B, T, D]
    x'       = post (x) block_out + comb^T x                          [B, T, W, D]

(F = `fn` [W * D, (2 + W) W], its columns split as [pre W | post W | comb W x W], b = `base`,
s = `scale`: the checkpoint's `hc_attn_*` / `hc_ffn_*`). The Sinkhorn iterations alternate
column and row normalisation so mixing the streams keeps their norms from growing. After the
last layer the streams are averaged (`hyper_head`). Einsum letter W: the streams (glm5_jax/model/layers.py).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model.layers import WeightSpec, WeightTable, normal_init


class HyperSpec(NamedTuple):
    streams: int  # hc_mult
    hidden_size: int
    sinkhorn_iters: int  # hc_sinkhorn_iters
    eps: float  # hc_eps
    norm_eps: float  # rms_norm_eps of the unweighted input norm


def hyper_connection_weights(spec: HyperSpec, param_dtype) -> WeightTable:
    """One hyper-connection's weights (`attn_hc` or `ffn_hc`); base and scale stay float32."""
    width = (2 + spec.streams) * spec.streams
    return {"fn": WeightSpec((spec.streams * spec.hidden_size, width), ("embed_concat", None), param_dtype,
                             normal_init(0.02)),
            "base": WeightSpec((width,), (None,), jnp.float32, nn.initializers.zeros),
            "scale": WeightSpec((3,), (None,), jnp.float32, nn.initializers.ones)}


def sinkhorn(comb: jax.Array, iterations: int, eps: float) -> jax.Array:
    """comb [..., W, W] (positive) -> near doubly stochastic: columns, then rows and columns
    normalised `iterations - 1` more times (the reference's order)."""
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


def hyper_connection(spec: HyperSpec, weights, streams: jax.Array):
    """streams [B, T, W, D] -> (post [B, T, W] float32, comb [B, T, W, W] float32, the sublayer's
    input [B, T, D] in streams' dtype)."""
    width = spec.streams
    flat = streams.reshape(streams.shape[:2] + (-1,)).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + spec.norm_eps)
    mixed = jnp.einsum("BTI,IO->BTO", flat, weights["fn"].astype(jnp.float32))  # fn [W * D, (2 + W) W]
    base, scale = weights["base"].astype(jnp.float32), weights["scale"].astype(jnp.float32)
    pre = jax.nn.sigmoid(mixed[..., :width] * scale[0] + base[:width]) + spec.eps
    post = 2 * jax.nn.sigmoid(mixed[..., width:2 * width] * scale[1] + base[width:2 * width])
    comb_logits = mixed[..., 2 * width:] * scale[2] + base[2 * width:]
    comb_logits = comb_logits.reshape(mixed.shape[:2] + (width, width))
    comb = sinkhorn(jax.nn.softmax(comb_logits, axis=-1) + spec.eps, spec.sinkhorn_iters, spec.eps)
    collapsed = jnp.einsum("BTW,BTWD->BTD", pre, streams.astype(jnp.float32)).astype(streams.dtype)
    return post, comb, collapsed


def expand_streams(post, comb, block_out, residual_streams):
    """post [B, T, W], comb [B, T, W, W], block_out [B, T, D], residual_streams [B, T, W, D] ->
    the next streams post (x) block_out + comb^T residual [B, T, W, D] (weights cast to the
    streams' dtype, as the reference does)."""
    dtype = residual_streams.dtype
    return (post.astype(dtype)[..., None] * block_out[..., None, :]
            + jnp.einsum("BTVW,BTVD->BTWD", comb.astype(dtype), residual_streams))


def hyper_head(streams: jax.Array) -> jax.Array:
    """The final collapse: the streams' mean. [B, T, W, D] -> [B, T, D]."""
    return jnp.mean(streams, axis=2)
