"""GLM-5.3-Flash's pooled DSA indexer (transformers glm5_next's Glm5NextTextIndexer), plain jnp.

GLM-5's lightning indexer (dsa.py) scores every key token; GLM-5.3-Flash's scores POOLS of
`kpool` consecutive tokens and selects whole pools:
  * no RoPE: the indexer's queries and keys are unrotated (dsa.py's functions with rope_dim=0);
  * a pool's key is a per-channel softmax-weighted sum of its tokens' indexer keys:
        pool_key[h] = sum_j softmax_j(x_j Wgate[:, h] + ape[j, h]) * k_j[h],   j = 0..kpool-1;
  * pools start at each DOCUMENT's first token (positions 0..kpool-1, kpool..2 kpool-1, ...; the
    reference starts them at a row's first non-padding token, which is the same thing for a
    document alone in a row); only complete pools are candidates, and only those whose last token
    the query sees (causal, same document);
  * the top index_topk // kpool pools by I = sum_m w_m ReLU(q_m . pool_key / sqrt(H)) (float32,
    w = x Wiw / sqrt(M): dsa.combine_index_scores) are selected and expanded to their tokens;
  * with `always_select_tail`, the query's own incomplete pool (its last (position + 1) % kpool
    visible tokens, itself included) is always added.

REPRESENTATION (the "per-slot" layout): pools are addressed by their LAST token. Key slot s holds
the pool that ends at s, which exists iff positions[s] % kpool == kpool - 1 and the kpool slots
s-kpool+1..s hold positions[s]-kpool+1..positions[s] of the same document (`pool_valid[s]`);
other slots hold zeros and are never candidates. A pool is then a candidate for a query iff
pool_valid[s] and the usual causal / same-document mask allows key slot s. The same arrays live
in a paged cache: per token slot, the pool key ending there (written on the step that completes
the pool, from that step's token and the previous kpool-1 tokens' raw indexer keys and gate
logits, which the cache has to keep until then; `pooled_index_keys` on those kpool slots gives it
in its last slot). A compact cache (one pool slot per kpool tokens, pool index = position //
kpool for one document per sequence) works with the same pieces: `expand_pools` takes any
token -> pool-slot map.

Letters: B batch, T queries, S key slots, D model width, M indexer heads, H indexer head dim,
K top-k (list form).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model import dsa
from glm5_jax.model.layers import WeightSpec, WeightTable


def pooled_indexer_weights(spec: dsa.IndexerSpec, index_kpool: int, param_dtype) -> WeightTable:
    """The pooled indexer's weights IN ADDITION to `dsa.indexer_weights` (same scope,
    attention/indexer/). HF: compress_gate = index_kpool_compress_gate.T ([H, D] there),
    compress_ape = index_kpool_compress_ape ([kpool, H]). Initialised as the reference's
    _init_weights does: gate ones, ape zeros."""
    dim = spec.index_head_dim
    return {
        "compress_gate": WeightSpec((spec.hidden_size, dim), ("embed", "head_dim"), param_dtype,
                                    nn.initializers.ones),
        "compress_ape": WeightSpec((index_kpool, dim), (None, "head_dim"), param_dtype,
                                   nn.initializers.zeros),
    }


def pool_gate_logits(x: jax.Array, compress_gate: jax.Array) -> jax.Array:
    """x Wgate in float32. x: [B, S, D]; compress_gate: [D, H] -> [B, S, H]."""
    return jnp.einsum("BSD,DH->BSH", x.astype(jnp.float32), compress_gate.astype(jnp.float32))


def _shifted(x: jax.Array, shift: int, fill) -> jax.Array:
    """x[:, s - shift] along axis 1 ([B, S, ...]), `fill` where s - shift < 0."""
    if shift == 0:
        return x
    shift = min(shift, x.shape[1])  # a row shorter than the shift: all fill
    pad = jnp.full((x.shape[0], shift) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([pad, x[:, :x.shape[1] - shift]], axis=1)


def pooled_index_keys(keys: jax.Array, gate_logits: jax.Array, ape: jax.Array, positions: jax.Array,
                      segment_ids: jax.Array, kpool: int) -> tuple[jax.Array, jax.Array]:
    """Pool keys in the per-slot layout (module docstring): slot s holds the pool ENDING at s.

    keys: [B, S, H] indexer keys (`dsa.indexer_keys`, rope_dim=0); gate_logits: [B, S, H] float32
    (`pool_gate_logits`); ape: [kpool, H]; positions, segment_ids: [B, S] (positions restart at 0
    per document; a document's slots are consecutive).
    Returns (pool_keys [B, S, H] in keys.dtype, zeros where no pool ends; pool_valid bool [B, S]).
    Only slots inside this array are used: a chunk continuing a sequence must come with the
    previous kpool - 1 slots of its document, or the pools straddling its start are invalid.
    Cost O(kpool B S H), memory O(B S H) (the kpool shifts are unrolled, not stacked).
    """
    ape = ape.astype(jnp.float32)
    slots = jnp.arange(positions.shape[1])
    valid = positions % kpool == kpool - 1
    # window[j] = slot s - (kpool - 1 - j), the pool's j-th token (ape[j]).
    logits = []
    for j in range(kpool):
        shift = kpool - 1 - j
        valid &= (slots >= shift) & (_shifted(segment_ids, shift, 0) == segment_ids) & (
            _shifted(positions, shift, 0) == positions - shift)
        logits.append(_shifted(gate_logits.astype(jnp.float32), shift, 0.0) + ape[j])
    peak = logits[0]
    for logit in logits[1:]:
        peak = jnp.maximum(peak, logit)
    weights = [jnp.exp(logit - peak) for logit in logits]
    total = sum(weights)
    # As the reference: probabilities cast to the keys' dtype, the weighted sum in that dtype.
    pool_keys = sum((w / total).astype(keys.dtype) * _shifted(keys, kpool - 1 - j, 0)
                    for j, w in enumerate(weights))
    return jnp.where(valid[..., None], pool_keys, 0).astype(keys.dtype), valid


def pool_end_slots(positions: jax.Array, kpool: int) -> jax.Array:
    """Per-slot layout: the slot of each token's pool (the slot of its last token), s + kpool - 1
    - positions[s] % kpool (may be >= S: a pool not complete in the row). [B, S] -> int32 [B, S]."""
    slots = jnp.arange(positions.shape[1], dtype=jnp.int32)
    return slots + (kpool - 1 - positions % kpool).astype(jnp.int32)


def expand_pools(selected_pools: jax.Array, token_pool: jax.Array) -> jax.Array:
    """Selected pools -> their tokens. selected_pools: bool [B, T, P] over pool slots; token_pool:
    int [B, S] each token's pool slot (`pool_end_slots`, or position // kpool in a compact cache;
    out of [0, P): none). Returns bool [B, T, S]; callers AND it with the causal/document mask."""
    num_pools = selected_pools.shape[-1]
    inside = (token_pool >= 0) & (token_pool < num_pools)
    index = jnp.broadcast_to(jnp.clip(token_pool, 0, num_pools - 1)[:, None, :],
                             selected_pools.shape[:2] + token_pool.shape[1:])
    return jnp.take_along_axis(selected_pools, index, axis=-1) & inside[:, None, :]


def tail_mask(positions: jax.Array, key_positions: jax.Array, kpool: int) -> jax.Array:
    """Keys in the query's own incomplete pool (the reference's append_visible_tail): key
    position >= ((position + 1) // kpool) * kpool, i.e. its pool ends after the query. Not masked:
    AND it with the causal/document mask. positions: [B, T]; key_positions: [B, S] -> [B, T, S]."""
    first_tail = (positions + 1) // kpool * kpool
    return key_positions[:, None, :] >= first_tail[:, :, None]


def pool_candidates(pool_valid: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                    key_positions: jax.Array | None = None,
                    key_segment_ids: jax.Array | None = None) -> jax.Array:
    """Candidate pools (per-slot layout): complete, ending at or before the query, same document.
    pool_valid: [B, S]; positions, segment_ids: [B, T]; key_*: [B, S] (default: the queries').
    Returns bool [B, T, S]."""
    return dsa.base_mask(positions, segment_ids, key_positions, key_segment_ids) & pool_valid[:, None, :]


def pooled_selection(scores: jax.Array, pool_valid: jax.Array, positions: jax.Array,
                     segment_ids: jax.Array, *, index_topk: int, kpool: int, always_select_tail: bool,
                     key_positions: jax.Array | None = None,
                     key_segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The selection as a token mask (like `dsa.select_topk_mask` / select_keys' with_mask).

    scores: [B, T, S] float32 pool scores in the per-slot layout
    (`dsa.combine_index_scores(x, queries, pool_keys, weights_proj)`); pool_valid: [B, S];
    positions, segment_ids: [B, T] the queries'; key_positions, key_segment_ids: [B, S] the key
    slots' (default: the queries', S = T). Decoding: T = 1 against a cache's slots.
    Returns (selected bool [B, T, S]: the top index_topk // kpool candidate pools' tokens, plus
    the tail with always_select_tail, AND causal & same document; boundary gap [B, T] between the
    k-th and (k+1)-th candidate pool scores, +inf where no (k+1)-th exists).
    """
    key_positions = positions if key_positions is None else key_positions
    visible = dsa.base_mask(positions, segment_ids, key_positions, key_segment_ids)
    candidates = visible & pool_valid[:, None, :]
    pools, gap = dsa.select_topk_mask_local(scores, candidates, index_topk // kpool)
    selected = expand_pools(pools, pool_end_slots(key_positions, kpool)) & visible
    if always_select_tail:
        selected |= visible & tail_mask(positions, key_positions, kpool)
    return selected, gap


def pooled_selection_indices(scores: jax.Array, pool_valid: jax.Array, positions: jax.Array,
                             segment_ids: jax.Array, *, index_topk: int, kpool: int,
                             always_select_tail: bool, key_positions: jax.Array | None = None,
                             key_segment_ids: jax.Array | None = None,
                             query_slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The selection as key slots, in the reference indexer's layout: k = index_topk // kpool
    pools in score order, each as its kpool slots in order (all -1 for a pool beyond the
    query's candidates), then (always_select_tail, kpool > 1) kpool - 1 tail slots (-1 beyond the
    tail), padded with -1 to K' = index_topk (+ kpool - 1 with the tail). The same entries as the
    reference's list; only where a row holds fewer than k complete pools does the reference
    shorten its pool part (to the row's pool count), moving the tail forward.

    Arguments as `pooled_selection`; query_slots: [B, T] each query's own slot on the key axis
    (default S - T + t: the queries are the last T key slots, as in a sequence or a cache's
    newest step). Returns (indices int32 [B, T, K'], boundary gap [B, T]).
    """
    batch, num_queries = positions.shape
    num_slots = scores.shape[-1]
    candidates = pool_candidates(pool_valid, positions, segment_ids, key_positions, key_segment_ids)
    ends, gap = dsa.select_topk_local(scores, candidates, index_topk // kpool)  # [B, T, k]
    chosen = jnp.take_along_axis(candidates, ends, axis=-1)
    tokens = ends[..., None] - (kpool - 1) + jnp.arange(kpool, dtype=jnp.int32)  # [B, T, k, kpool]
    parts = [jnp.where(chosen[..., None], tokens, -1).reshape(batch, num_queries, -1)]
    width = index_topk
    if always_select_tail and kpool > 1:
        if query_slots is None:
            query_slots = jnp.broadcast_to(num_slots - num_queries + jnp.arange(num_queries), positions.shape)
        count = ((positions + 1) % kpool)[..., None]  # [B, T, 1]
        offsets = jnp.arange(kpool - 1, dtype=jnp.int32)
        parts.append(jnp.where(offsets < count, query_slots[..., None] - count + 1 + offsets, -1))
        width += kpool - 1
    indices = jnp.concatenate(parts, axis=-1).astype(jnp.int32)
    indices = jnp.pad(indices, ((0, 0), (0, 0), (0, width - indices.shape[-1])), constant_values=-1)
    return indices, gap


def pooled_indexer_scores(x: jax.Array, q_latent: jax.Array, weights: dict, positions: jax.Array,
                          segment_ids: jax.Array, *, kpool: int,
                          norm_eps: float) -> tuple[jax.Array, jax.Array]:
    """Pool scores over a whole sequence (no mask applied), like `dsa.indexer_scores`.

    x: [B, T, D]; q_latent: [B, T, R]; weights: `dsa.indexer_weights`' names plus
    `pooled_indexer_weights`'; positions, segment_ids: [B, T].
    Returns (scores [B, T, S=T] float32 in the per-slot layout, pool_valid [B, S]); under context
    parallelism each device's queries against the whole sequence's pools.
    """
    no_rope = jnp.zeros(x.shape[:2] + (0,), jnp.float32)
    queries = dsa.indexer_queries(q_latent, no_rope, no_rope, weights["wq_b"], 0)
    keys = dsa.indexer_keys(x, no_rope, no_rope, weights["wk"], weights["k_norm_scale"],
                            weights["k_norm_bias"], 0, norm_eps)
    gate_logits = pool_gate_logits(x, weights["compress_gate"])
    # A pool may straddle two devices' positions: pool after gathering.
    pool_keys, pool_valid = pooled_index_keys(
        dsa.whole_sequence(keys), dsa.whole_sequence(gate_logits), weights["compress_ape"],
        dsa.whole_sequence(positions), dsa.whole_sequence(segment_ids), kpool)
    scores = dsa.combine_index_scores(x, queries, pool_keys, weights["weights_proj"])
    return dsa.query_slice(scores), pool_valid


def pooled_select_keys(weights: dict, x: jax.Array, q_latent: jax.Array, positions: jax.Array,
                       segment_ids: jax.Array, *, index_topk: int, kpool: int, always_select_tail: bool,
                       norm_eps: float, with_indices: bool = False):
    """The pooled indexer's selection over a whole sequence (packed documents allowed), not
    differentiated (the reference runs it under no_grad).

    Shapes as `pooled_indexer_scores`. Returns (selected bool [B, T, S=T], boundary gap [B, T])
    (`pooled_selection`), plus with with_indices the list form [B, T, K'] (`pooled_selection_indices`).
    """
    scores, pool_valid = pooled_indexer_scores(
        jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent), weights, positions, segment_ids,
        kpool=kpool, norm_eps=norm_eps)
    options = dict(index_topk=index_topk, kpool=kpool, always_select_tail=always_select_tail,
                   key_positions=dsa.whole_sequence(positions),
                   key_segment_ids=dsa.whole_sequence(segment_ids))
    selected, gap = pooled_selection(scores, pool_valid, positions, segment_ids, **options)
    if not with_indices:
        return selected, gap
    indices, _ = pooled_selection_indices(scores, pool_valid, positions, segment_ids, **options)
    return selected, gap, indices
