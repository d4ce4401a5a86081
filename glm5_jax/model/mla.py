"""Multi-head Latent Attention (MLA): the projections, the attention math and its weights.

Query path: r = RMS(u Wqa) (q_lora_rank wide); q = r Wqb -> [N, nope + rope].
KV path:    c = u Wkva; latent = RMS(c[:kv_lora_rank]); k_rope = c[kv_lora_rank:] (one head);
            [k_nope, v] = latent Wkvb per head; K = [k_nope, k_rope broadcast over heads].
Scores Q.K / sqrt(qk_head_dim), softmax in float32 over the allowed keys, o = P V, out = o Wo.
`mla_attention` composes a layer's attention: the projections here, then the source of keys and
its backend (glm5_jax/model/attention: the sequence or the page pool; which keys a DSA or
sliding-window layer sees), then o_proj.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model.attention import get_backend
from glm5_jax.model.dsa import IndexerSpec, indexer_weights
from glm5_jax.model.layers import (
    WeightSpec,
    WeightTable,
    apply_rope,
    dense,
    mixed_einsum,
    normal_init,
    rms_norm,
    rope_angles,
    weight_product,
)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm_eps: float
    sliding_window: int
    rope_theta: float
    initializer_range: float
    indexer: IndexerSpec
    # "reference": dense [B, T, S] masks and `attend`; "pallas": gathered top-k attention on DSA
    # layers and flash attention on sliding-window layers (attention/pallas.py).
    attention_impl: str = "reference"
    dsa_stage: str = "off"  # DSA training (dsa_training.py): "off", "dense_warmup" or "sparse"
    causal_block_size: int = 0  # ExecutionOptions.causal_block_size (`attend_causal_blocks`)
    # The backend over the serving step's page pool (glm5_jax.model.attention): "reference" or "pallas".
    decode_attention_impl: str = "reference"
    # How weights that stay quantized are multiplied (glm5_jax.quant.matmul.IMPLS; serving only).
    quantized_matmul: str = "dequantize"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class LayerKinds:
    """Per-layer choices inside a scanned stack: a Python bool when the whole stack agrees
    (no runtime branch), else a traced bool scalar for the current layer."""

    run_indexer: bool | jax.Array
    sliding: bool | jax.Array

    @classmethod
    def of(cls, run_flag, sliding_flag, uniform_run: bool | None, uniform_sliding: bool | None) -> LayerKinds:
        """A layer's kinds from its scanned flags, the stack's uniform values where it has them."""
        return cls(run_indexer=run_flag if uniform_run is None else uniform_run,
                   sliding=sliding_flag if uniform_sliding is None else uniform_sliding)


def attention_probs(query: jax.Array, key: jax.Array, allowed: jax.Array) -> jax.Array:
    """Masked softmax in float32. query: [B, T, N, H]; key: [B, S, N, H]; allowed: bool [B, T, S].
    Returns [B, N, T, S] float32."""
    scale = query.shape[-1] ** -0.5
    logits = mixed_einsum("BTNH,BSNH->BNTS", query, key, jnp.float32)
    logits = jnp.where(allowed[:, None], logits * scale, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)


def attend(query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array) -> jax.Array:
    """Masked softmax attention with float32 softmax.

    query: [B, T, N, H]; key: [B, S, N, H]; value: [B, S, N, Hv]; allowed: bool [B, T, S].
    Returns [B, T, N, Hv].
    """
    return attend_with(attention_probs(query, key, allowed), value)


def attend_causal_blocks(query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array,
                         block_size: int) -> jax.Array:
    """`attend` for self-attention where no query sees a later key (`allowed` causal by index):
    the queries in blocks of `block_size`, each against the keys up to its own end only, so most
    of the masked upper triangle is never computed ((n + 1) / 2n of the [T, S] work for n blocks).
    Shapes as `attend`, with S = T divisible by block_size; the same result."""
    outputs = []
    for start in range(0, query.shape[1], block_size):
        rows, end = slice(start, start + block_size), start + block_size
        outputs.append(attend(query[:, rows], key[:, :end], value[:, :end], allowed[:, rows, :end]))
    return jnp.concatenate(outputs, axis=1)


def attend_with(probs: jax.Array, value: jax.Array) -> jax.Array:
    """probs: [B, N, T, S]; value: [B, S, N, Hv] -> [B, T, N, Hv]."""
    return mixed_einsum("BNTS,BSNH->BTNH", probs.astype(value.dtype), value)


def query_path(x, q_a_proj, q_a_norm, q_b_proj, eps: float, nope_dim: int, impl: str = "dequantize"):
    """x: [B, T, D] -> (q_latent [B, T, Rq] normalised, q_nope [B, T, N, nope], q_rope [B, T, N, rope]
    not yet rotated). Weights: q_a_proj [D, Rq], q_a_norm [Rq], q_b_proj [Rq, N, nope + rope]
    (float, or quantized and multiplied by `impl`: glm5_jax.quant.matmul)."""
    q_latent = rms_norm(dense(x, q_a_proj, impl), q_a_norm, eps)
    query = weight_product("BTR,RNH->BTNH", q_latent, q_b_proj, impl)
    return q_latent, query[..., :nope_dim], query[..., nope_dim:]


def kv_latent(x, kv_a_proj, kv_a_norm, kv_lora_rank: int, eps: float, impl: str = "dequantize"):
    """x: [B, S, D] -> (latent [B, S, Rkv] normalised, k_rope [B, S, rope] not yet rotated): the
    per-token quantities a decode cache keeps. kv_a_proj: [D, Rkv + rope]; kv_a_norm: [Rkv]."""
    compressed = dense(x, kv_a_proj, impl)
    return rms_norm(compressed[..., :kv_lora_rank], kv_a_norm, eps), compressed[..., kv_lora_rank:]


def expand_latent(latent, k_rope, kv_b_proj, nope_dim: int):
    """Per-head keys and values from the latent. latent: [B, S, Rkv]; k_rope: [B, S, rope] (rotated);
    kv_b_proj: [Rkv, N, nope + Hv]. Returns (key [B, S, N, nope + rope], value [B, S, N, Hv])."""
    kv = mixed_einsum("BSR,RNH->BSNH", latent, kv_b_proj)
    k_nope, value = kv[..., :nope_dim], kv[..., nope_dim:]
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3] + k_rope.shape[-1:])
    return jnp.concatenate([k_nope, k_rope], axis=-1), value


def absorbed_attention(q_nope, q_rope, latent, k_rope, kv_b_proj, allowed):
    """Attention computed on the latent cache with Wkvb folded into the query and the output.

    q_nope: [B, T, N, nope]; q_rope: [B, T, N, rope] (rotated); latent: [B, S, Rkv];
    k_rope: [B, S, rope] (rotated); kv_b_proj: [Rkv, N, nope + Hv]; allowed: bool [B, T, S].
    Returns [B, T, N, Hv], equal to `attend` on `expand_latent`'s keys and values.
    """
    nope_dim = q_nope.shape[-1]
    scale = (nope_dim + q_rope.shape[-1]) ** -0.5
    q_absorbed = jnp.einsum("BTNH,RNH->BTNR", q_nope, kv_b_proj[..., :nope_dim])  # [B, T, N, Rkv]
    logits = (jnp.einsum("BTNR,BSR->BNTS", q_absorbed, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("BTNH,BSH->BNTS", q_rope, k_rope, preferred_element_type=jnp.float32))
    logits = jnp.where(allowed[:, None], logits * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(latent.dtype)
    context = jnp.einsum("BNTS,BSR->BTNR", probs, latent)  # [B, T, N, Rkv]
    return jnp.einsum("BTNR,RNH->BTNH", context, kv_b_proj[..., nope_dim:])


def attention_weights(spec: AttentionSpec, param_dtype) -> WeightTable:
    """One MLA layer's weights (checkpoint names under attention/), the indexer's included."""
    init = normal_init(spec.initializer_range)
    ones = nn.initializers.ones
    heads = spec.num_heads

    def weight(shape, axes, initializer=init):
        return WeightSpec(shape, axes, param_dtype, initializer)

    return {
        "q_a_proj": weight((spec.hidden_size, spec.q_lora_rank), ("embed", "q_lora")),
        "q_a_norm": weight((spec.q_lora_rank,), ("norm",), ones),
        "q_b_proj": weight((spec.q_lora_rank, heads, spec.qk_head_dim),
                           ("q_lora", "heads", "head_dim")),
        "kv_a_proj": weight((spec.hidden_size, spec.kv_lora_rank + spec.qk_rope_head_dim),
                            ("embed", "kv_lora")),
        "kv_a_norm": weight((spec.kv_lora_rank,), ("norm",), ones),
        "kv_b_proj": weight((spec.kv_lora_rank, heads, spec.qk_nope_head_dim + spec.v_head_dim),
                            ("kv_lora", "heads", "head_dim")),
        "o_proj": weight((heads, spec.v_head_dim, spec.hidden_size), ("heads", "head_dim", "embed")),
        "indexer": indexer_weights(spec.indexer, param_dtype),
    }


class Projected(NamedTuple):
    """One layer's queries and per-token keys for its tokens (rows [B, T]; the serving step's
    flat tokens are B rows of T = 1)."""

    q_latent: jax.Array  # [B, T, Rq] normalised (the indexer's queries read it)
    q_nope: jax.Array  # [B, T, N, nope]
    q_rope: jax.Array  # [B, T, N, rope], rotated
    latent: jax.Array  # [B, T, Rkv] normalised: what a cache keeps
    k_rope: jax.Array  # [B, T, rope], rotated: what a cache keeps
    cos: jax.Array  # [B, T, rope / 2]
    sin: jax.Array


def project_tokens(spec: AttentionSpec, weights, x, positions) -> Projected:
    """x: [B, T, D] normalised; positions: [B, T] -> the layer's `Projected` queries and keys.
    Weights in x's dtype (quantized ones multiplied per spec.quantized_matmul)."""
    impl = spec.quantized_matmul
    q_latent, q_nope, q_rope = query_path(x, weights["q_a_proj"], weights["q_a_norm"], weights["q_b_proj"],
                                          spec.latent_norm_eps, spec.qk_nope_head_dim, impl)
    latent, k_rope = kv_latent(x, weights["kv_a_proj"], weights["kv_a_norm"], spec.kv_lora_rank,
                               spec.latent_norm_eps, impl)
    cos, sin = rope_angles(positions, spec.qk_rope_head_dim, spec.rope_theta)
    return Projected(q_latent, q_nope, apply_rope(q_rope, cos, sin), latent, apply_rope(k_rope, cos, sin),
                     cos, sin)


def mla_attention(spec: AttentionSpec, weights, x, keys, kinds: LayerKinds, previous):
    """One MLA layer's attention. x: [B, T, D] normalised; keys: the source of keys
    (`attention.sequence.SequenceKeys` or `attention.pages.PagedKeys`), which picks the backend
    (spec.attention_impl or spec.decode_attention_impl); previous: the previous DSA layer's
    selection (the source's `no_selection()` before the first).

    Returns (out [B, T, D], selection, boundary gap [B, T] or None, {diagnostic: value}, keys
    (a page pool: with this layer's new entries written))."""
    projected = project_tokens(spec, weights, x, keys.positions)
    keys, (heads, selection, gap, stats) = keys.attend(get_backend(keys.backend_name(spec)), spec, weights,
                                                      x, projected, kinds, previous)
    out = weight_product("BTNH,NHD->BTD", heads.astype(x.dtype), weights["o_proj"], spec.quantized_matmul)
    return out, selection, gap, stats, keys
