"""DeepSeek Sparse Attention (DSA): the lightning indexer, top-k selection and attention masks.

The indexer scores every (query, key) pair cheaply:
    I[t, s] = sum_m w_m(t) * ReLU(iq_m(t) . ik(s) / sqrt(index_head_dim)),  w = (u Wiw) / sqrt(M)
and each query attends only to its top-k keys (intersected with the causal/document mask).
This module is the plain-jnp formulation (dense [T, S] scores); the sparse kernels live in
kernels_pallas/.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model import kernel_calls
from glm5_jax.model.layers import WeightSpec, WeightTable, apply_rope, layer_norm, normal_init
from glm5_jax.parallel import constrain
from glm5_jax.parallel.local import run_local

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
    hidden_size: int
    q_lora_rank: int
    index_num_heads: int
    index_head_dim: int
    index_topk: int
    qk_rope_head_dim: int
    index_norm_eps: float
    initializer_range: float
    # "reference": dense [T, S] scores + lax.top_k (below); "pallas": the fused score + top-k kernel
    # (kernels_pallas/dsa_indexer.py), whose indices come in key order instead of score order.
    impl: str = "reference"
    # Pooled DSA (GLM-5.3-Flash, pooled_dsa.py): the indexer scores pools of `kpool` tokens and
    # selects index_topk // kpool of them (plus the query's incomplete pool, always_select_tail);
    # 0 = per-token selection (GLM-5).
    kpool: int = 0
    always_select_tail: bool = True

    @property
    def pooled_width(self) -> int:
        """The width of a pooled selection's key list (pooled_dsa.pooled_selection_indices):
        index_topk, plus the tail's kpool - 1; 0 without pooling."""
        if not self.kpool:
            return 0
        return self.index_topk + (self.kpool - 1 if self.always_select_tail else 0)


def base_mask(positions: jax.Array, segment_ids: jax.Array, key_positions: jax.Array | None = None,
              key_segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal AND same-document mask. positions, segment_ids: [B, T] the queries'; key_positions,
    key_segment_ids: [B, S] the keys' (default: the queries', S = T). Returns bool [B, T, S]."""
    key_positions = positions if key_positions is None else key_positions
    key_segment_ids = segment_ids if key_segment_ids is None else key_segment_ids
    causal = positions[:, :, None] >= key_positions[:, None, :]
    same_doc = segment_ids[:, :, None] == key_segment_ids[:, None, :]
    return causal & same_doc


def sliding_window_mask(positions: jax.Array, window: int,
                        key_positions: jax.Array | None = None) -> jax.Array:
    """Keys within the last `window` positions (the query included). positions: [B, T];
    key_positions: [B, S] (default: positions). Returns bool [B, T, S]."""
    key_positions = positions if key_positions is None else key_positions
    return positions[:, :, None] - key_positions[:, None, :] < window


def whole_sequence(x: jax.Array) -> jax.Array:
    """Context parallelism: every device gets all positions of `x` ([B, S, ...]: keys, their
    positions), all-gathered over the mesh axes of the `length` rule; rows stay split over the
    batch axes and other axes are whole. No-op without a mesh."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def query_slice(x: jax.Array) -> jax.Array:
    """Context parallelism: x [B, T, ...] (scores, masks, selections) keeps each device's own
    queries (`length` split), the trailing axes whole. No-op without a mesh."""
    return constrain(x, ("batch", "length") + (None,) * (x.ndim - 2))


def selection_mask(topk_indices: jax.Array, num_keys: int) -> jax.Array:
    """Scatters selected key indices into a mask. [B, T, K] int (-1 = none: pooled DSA's lists)
    -> bool [B, T, S=num_keys]."""
    empty = jnp.zeros(topk_indices.shape[:2] + (num_keys,), dtype=bool)
    indices = jnp.where(topk_indices < 0, num_keys, topk_indices)
    return jnp.put_along_axis(empty, indices, True, axis=-1, inplace=False, mode="drop")


def indexer_queries(q_latent, cos, sin, wq_b, rope_dim: int) -> jax.Array:
    """q_latent: [B, T, R]; wq_b: [R, M, H] -> rotated indexer queries [B, T, M, H].
    The rope slice comes first in the indexer (unlike MLA, where it comes last)."""
    q = jnp.einsum("BTR,RMH->BTMH", q_latent, wq_b.astype(q_latent.dtype))
    return jnp.concatenate([apply_rope(q[..., :rope_dim], cos, sin), q[..., rope_dim:]], axis=-1)


def indexer_keys(x, cos, sin, wk, k_norm_scale, k_norm_bias, rope_dim: int, eps: float) -> jax.Array:
    """x: [B, S, D]; wk: [D, H] -> rotated, layer-normed indexer keys [B, S, H] (what a cache keeps).
    Under context parallelism each device computes its own positions' keys; callers gather them
    (`whole_sequence`)."""
    k = layer_norm(jnp.einsum("BSD,DH->BSH", x, wk.astype(x.dtype)), k_norm_scale, k_norm_bias, eps)
    return jnp.concatenate([apply_rope(k[..., :rope_dim], cos, sin), k[..., rope_dim:]], axis=-1)


def combine_index_scores(x, queries, keys, weights_proj) -> jax.Array:
    """I[b, t, s] = sum_m w_m(t) ReLU(q_m(t) . k(s) / sqrt(H)), float32.

    x: [B, T, D] (for the head weights w = x Wiw / sqrt(M)); queries: [B, T, M, H];
    keys: [B, S, H]; weights_proj: [D, M]. Returns [B, T, S].
    """
    index_head_dim = queries.shape[-1]
    scores = jnp.einsum("BTMH,BSH->BTMS", queries.astype(jnp.float32), keys.astype(jnp.float32))
    scores = jax.nn.relu(scores * index_head_dim**-0.5)
    return jnp.einsum("BTM,BTMS->BTS", index_head_weights(x, weights_proj), scores)


def index_head_weights(x, weights_proj) -> jax.Array:
    """w = x Wiw / sqrt(M) in float32. x: [B, T, D]; weights_proj: [D, M] -> [B, T, M]."""
    num_index_heads = weights_proj.shape[-1]
    return jnp.einsum("BTD,DM->BTM", x.astype(jnp.float32),
                      weights_proj.astype(jnp.float32)) * num_index_heads**-0.5


def indexer_scores(x: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array,
                   wq_b: jax.Array, wk: jax.Array, k_norm_scale: jax.Array,
                   k_norm_bias: jax.Array, weights_proj: jax.Array, *, rope_dim: int,
                   norm_eps: float) -> jax.Array:
    """Index scores I[b, t, s] in float32 (no mask applied).

    x: [B, T, D] attention input; q_latent: [B, T, R] normalised query latent;
    cos, sin: [B, T, rope_dim/2]; wq_b: [R, M, H]; wk: [D, H]; k_norm_*: [H];
    weights_proj: [D, M]. Returns [B, T, S=T]: under context parallelism each device's queries
    against the whole sequence's keys (gathered), so top-k sees the full causal prefix.
    """
    queries = indexer_queries(q_latent, cos, sin, wq_b, rope_dim)
    keys = whole_sequence(indexer_keys(x, cos, sin, wk, k_norm_scale, k_norm_bias, rope_dim, norm_eps))
    return query_slice(combine_index_scores(x, queries, keys, weights_proj))


def select_topk(scores: jax.Array, allowed: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """Top-k keys per query among the allowed ones.

    scores: [B, T, S] float32; allowed: bool [B, T, S]. k = min(topk, S).
    Returns (indices [B, T, k] int32, boundary_gap [B, T] float32): the gap between the k-th and
    (k+1)-th allowed scores, +inf where no (k+1)-th allowed key exists. A zero gap is a tie at
    the selection boundary, where two correct implementations may pick different keys.
    """
    num_keys = scores.shape[-1]
    k = min(topk, num_keys)
    masked = jnp.where(allowed, scores, NEG_INF)
    if k < num_keys:
        values, indices = jax.lax.top_k(masked, k + 1)
        gap = jnp.where(jnp.isneginf(values[..., k]), jnp.inf, values[..., k - 1] - values[..., k])
        indices = indices[..., :k]
    else:
        indices = jax.lax.top_k(masked, k)[1]
        gap = jnp.full(scores.shape[:2], jnp.inf, jnp.float32)
    return jax.lax.stop_gradient(indices.astype(jnp.int32)), jax.lax.stop_gradient(gap)


def _order_keys(values: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same total order as lax.top_k's (-0 below +0)."""
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _order_values(keys: jax.Array) -> jax.Array:
    """The inverse of `_order_keys`."""
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32((1 << 31) - 1), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def kth_largest_key(keys: jax.Array, k: jax.Array | int) -> jax.Array:
    """The k-th largest of each row of uint32 keys [..., S] -> [...]: built bit by bit from the
    top, keeping a bit when at least k keys reach the value so far (32 counting passes)."""
    found = jnp.zeros(keys.shape[:-1], jnp.uint32)
    for bit in range(31, -1, -1):
        candidate = found | jnp.uint32(1 << bit)
        found = jnp.where(jnp.sum(keys >= candidate[..., None], axis=-1) >= k, candidate, found)
    return found


def select_topk_mask(scores: jax.Array, allowed: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """`select_topk`'s selection as a mask, without sorting: `allowed & selection_mask(indices)`
    and the same boundary gap.

    The k-th largest allowed score of each query comes from a bisection on its bits
    (`kth_largest_key`); the keys above it are selected, and of the keys equal to it the lowest
    positions, as many as are still needed (lax.top_k's rule; exact zeros from the ReLUs do tie).
    On a CPU several times cheaper than lax.top_k (docs/benchmarks.md).
    scores: [B, T, S] float32; allowed: bool [B, T, S].
    Returns (selected bool [B, T, S], boundary gap [B, T] float32).
    """
    num_keys = scores.shape[-1]
    k = min(topk, num_keys)
    if k == num_keys:
        return allowed, jnp.full(scores.shape[:2], jnp.inf, jnp.float32)
    masked = jnp.where(allowed, scores, NEG_INF)
    keys = _order_keys(masked)
    kth = kth_largest_key(keys, k)[..., None]  # [B, T, 1]
    above, tied = keys > kth, keys == kth
    needed = k - jnp.sum(above, axis=-1, keepdims=True)  # >= 1 of the tied keys
    # The tied keys' ranks by position (an associative scan: jnp.cumsum is 3x slower on a CPU).
    tie_rank = jax.lax.associative_scan(jnp.add, tied.astype(jnp.int32), axis=-1)
    selected = allowed & (above | (tied & (tie_rank <= needed)))
    # The (k+1)-th largest: the k-th itself when more than k keys reach it, else the largest below.
    kth_value = _order_values(kth[..., 0])
    reaching = k - needed[..., 0] + jnp.sum(tied, axis=-1)
    below = jnp.max(jnp.where(keys < kth, masked, NEG_INF), axis=-1)
    next_value = jnp.where(reaching > k, kth_value, below)
    gap = jnp.where(jnp.isneginf(next_value), jnp.inf, kth_value - next_value)
    return selected, jax.lax.stop_gradient(gap)


def select_topk_local(scores: jax.Array, allowed: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """`select_topk` per device on its own rows and queries (run_local). Under a mesh XLA's SPMD
    partitioner would all-gather a top_k operand split along an axis other than the sorted one
    (here the [B, T, S] scores, split over the batch axes and `context`). Same shapes."""
    rows = kernel_calls.QUERY_ROWS
    return run_local(functools.partial(select_topk, topk=topk), (scores, allowed), (rows, rows),
                     (rows, ("batch", "length")))


def select_topk_mask_local(scores: jax.Array, allowed: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """`select_topk_mask` per device on its own rows and queries (run_local). Same shapes."""
    rows = kernel_calls.QUERY_ROWS
    return run_local(functools.partial(select_topk_mask, topk=topk), (scores, allowed), (rows, rows),
                     (rows, ("batch", "length")))


def selection_mask_local(topk_indices: jax.Array, num_keys: int) -> jax.Array:
    """`selection_mask` per device on its own rows and queries (run_local: XLA would all-gather
    the scatter's indices over the split query axis). [B, T, K] -> bool [B, T, S]."""
    return run_local(functools.partial(selection_mask, num_keys=num_keys), (topk_indices,),
                     (kernel_calls.QUERY_ROWS,), kernel_calls.QUERY_ROWS)


# The indexer's weights in the order the functions below take them.
INDEXER_WEIGHT_ORDER = ("wq_b", "wk", "k_norm_scale", "k_norm_bias", "weights_proj")


def fused_indexer_topk(x, q_latent, cos, sin, wq_b, wk, k_norm_scale, k_norm_bias, weights_proj,
                       positions, segment_ids, spec: IndexerSpec):
    """`select_topk(indexer_scores(...), base_mask(...))` through the fused Pallas kernel (no [T, S]
    scores in memory). Shapes as `indexer_scores`; positions, segment_ids: [B, T].
    Returns (indices [B, T, k] in key order, boundary gap [B, T])."""
    queries = indexer_queries(q_latent, cos, sin, wq_b, spec.qk_rope_head_dim)
    keys = indexer_keys(x, cos, sin, wk, k_norm_scale, k_norm_bias, spec.qk_rope_head_dim,
                        spec.index_norm_eps)
    return kernel_calls.indexer_topk(queries, keys, index_head_weights(x, weights_proj), positions,
                                     segment_ids, spec.index_topk)


def indexer_weights(spec: IndexerSpec, param_dtype) -> WeightTable:
    """The lightning indexer's weights (checkpoint names under attention/indexer/); the selection
    is the attention backend's (`select_keys` over a sequence, attention/pages.py over pages)."""
    init = normal_init(spec.initializer_range)
    heads, dim = spec.index_num_heads, spec.index_head_dim
    return {
        "wq_b": WeightSpec((spec.q_lora_rank, heads, dim), ("q_lora", "index_heads", "head_dim"),
                           param_dtype, init),
        "wk": WeightSpec((spec.hidden_size, dim), ("embed", "head_dim"), param_dtype, init),
        "k_norm_scale": WeightSpec((dim,), ("norm",), param_dtype, nn.initializers.ones),
        "k_norm_bias": WeightSpec((dim,), ("norm",), param_dtype, nn.initializers.zeros),
        # Kept in float32, as in the reference (its output weighs the heads' scores).
        "weights_proj": WeightSpec((spec.hidden_size, heads), ("embed", "index_heads"), jnp.float32, init),
    } | (pooled_weights(spec, param_dtype) if spec.kpool else {})


def pooled_weights(spec: IndexerSpec, param_dtype) -> WeightTable:
    """Pooled DSA's compression weights: a pool's key is the softmax(x Wgate + ape)-weighted sum
    of its tokens' keys, per channel (reference init: gate ones, ape zeros: the pool's mean)."""
    return {"compress_gate": WeightSpec((spec.hidden_size, spec.index_head_dim), ("embed", "head_dim"),
                                        param_dtype, nn.initializers.ones),
            "compress_ape": WeightSpec((spec.kpool, spec.index_head_dim), (None, "head_dim"), param_dtype,
                                       nn.initializers.zeros)}


def select_keys(weights: dict, spec: IndexerSpec, x, q_latent, cos, sin, allowed, run,
                previous_indices, positions=None, segment_ids=None, with_scores: bool = False,
                with_mask: bool = False):
    """The indexer's top-k over a whole sequence on layers that run it; other layers reuse
    `previous_indices`.

    weights: `indexer_weights`' names; x: [B, T, D]; q_latent: [B, T, R]; cos, sin: [B, T,
    rope_dim/2]; allowed: bool [B, T, S] (impl "reference"; None with impl "pallas", which reads
    positions, segment_ids [B, T]); run: bool scalar (traced under scan) or a Python bool;
    previous_indices: [B, T, k].
    Returns (topk indices [B, T, k] int32, boundary gap [B, T]); see `select_topk`. With
    with_mask (impl "reference"), also the selection as a mask, `allowed & selected` [B, T, S]
    (`select_topk_mask`: no sort; the indices, sorted, are then only computed if used). With
    with_scores (impl "reference"), also the scores [B, T, S] (zeros where the layer reuses),
    differentiable in the indexer's weights: DSA training's KL (dsa_training.py).
    """
    ordered = tuple(weights[name] for name in INDEXER_WEIGHT_ORDER)

    def run_indexer():
        # The indexer is not trained by the language-model loss (the reference runs it
        # under no_grad); its output is a discrete selection anyway.
        if spec.impl == "pallas":
            return fused_indexer_topk(jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent), cos,
                                      sin, *ordered, positions, segment_ids, spec)
        scores = indexer_scores(
            jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent), cos, sin, *ordered,
            rope_dim=spec.qk_rope_head_dim, norm_eps=spec.index_norm_eps)
        indices, gap = select_topk_local(scores, allowed, spec.index_topk)
        if with_mask:
            mask, gap = select_topk_mask_local(scores, allowed, spec.index_topk)
        return (indices, gap) + ((mask,) if with_mask else ()) + ((scores,) if with_scores else ())

    def reuse_previous():
        reused = previous_indices, jnp.full(x.shape[:2], jnp.inf, jnp.float32)
        if with_mask:
            reused += (allowed & selection_mask_local(previous_indices, allowed.shape[-1]),)
        return (*reused, jnp.zeros(allowed.shape, jnp.float32)) if with_scores else reused

    if isinstance(run, bool):
        return run_indexer() if run else reuse_previous()
    return jax.lax.cond(run, run_indexer, reuse_previous)
