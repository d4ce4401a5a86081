"""DSA lightning-indexer scores fused with top-k selection: the [T, S] score matrix never leaves
the chip.

    I[t, s] = sum_m w_m(t) * ReLU(q_m(t) . k(s) * H^-0.5)      (w already holds the M^-0.5)
over the keys a query may see (key_position <= query_position, same segment id), then the top
k = min(topk, S) keys per query, with glm5_jax.model.dsa.select_topk's semantics: a masked key
ranks below every allowed one (as -inf), ties go to the lower key index, and the boundary gap is
I(k-th) - I((k+1)-th), +inf when no allowed (k+1)-th key exists.

Algorithm (one program per (batch, block of bq queries), keys of that batch row resident):
  1. Radix select of the k-th largest score, 4 bits per pass over an order-preserving int32 code
     of the float score (masked keys get the smallest code): 8 passes, each recomputing the score
     blocks and counting, per query, the keys at or above 15 candidate thresholds. Along the way
     it tracks how many keys lie strictly above / at-or-above the final threshold.
  2. One emission pass: keys above the threshold plus the first (k - #above) keys equal to it, in
     key order. The selected keys of a key block take the output slots [taken before the block,
     taken after it) of their row; slot p gets the block's key whose inclusive count of selected
     keys first exceeds p (prefix counts are a triangular matmul per key block). Only the slot
     chunks that some row of the query block fills from this key block are visited (Triton and
     the interpreter; Mosaic visits every chunk, masked). It also finds the largest code below
     the threshold, for the gap.
Key blocks that no query of the block may see (from min/max summaries of positions and segment
ids, as in flash attention) are skipped: the radix passes loop over [lo, hi) of the key blocks and
the emission over [0, hi). Keys past hi are masked for every query of the block, so a row with
fewer than k allowed keys, having taken every key before hi, gets the next keys in order: slot p
holds key p from hi * block_k on (the wrapper writes them). For a causal prefill this halves the
work.
Cost: 9 recomputations of the scores over the visible key blocks (2*M*H flops per (t, s) each)
plus about (spread of the rows' selected counts + block_k * k / S) compares per (t, s) in the
emission, against the XLA path's one score pass + [T, S] in HBM + a sort-based top_k. Keeping
each query block's score row on chip (TPU VMEM scratch) would cut the 9x to 1x; that is the next
step. Output indices are in increasing key order (select_topk: decreasing score); the SET is the
same whenever the boundary gap is not a float-rounding tie (see `selected_scores` for the check
that holds across rounding).

There is no backward: the indices are discrete and the model stops gradients into the indexer
(the reference runs it under no_grad).

Einsum letters (glm5_jax/model/layers.py): B batch, T queries, S keys, M indexer heads,
H indexer head dim, K selected keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.common import KernelCase, call_options, resolve_backend
from kernels_pallas.flash_attention import (
    PAD_KEY_POSITION,
    PAD_KEY_SEGMENT,
    PAD_QUERY_POSITION,
    PAD_QUERY_SEGMENT,
    block_ranges,
    dot_nt,
    loop_bounds,
    scalar_spec,
    visible,
)

INT32_MIN = -(2**31)
RADIX_BITS = 4  # bits decided per counting pass: 8 passes, 15 candidate thresholds each


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Queries per program, keys per score block, output slots per emission compare chunk.
    Triton: powers of two >= 16 (tl.dot); Mosaic: block_q a multiple of 8."""

    block_q: int = 16
    block_k: int = 128
    block_slots: int = 128


DEFAULT_BLOCK_SIZES = {
    "interpret": BlockSizes(16, 128, 128),
    "triton": BlockSizes(16, 32, 32),  # keeps the [bq, bk, slots] compare in registers
    "mosaic_tpu": BlockSizes(16, 128, 128),
}


# ----------------------------------------------------------------------------- reference


def select_topk_reference(scores, allowed, topk: int):
    """Top-k keys per query among the allowed ones, and the boundary gap.

    scores: [B, T, S] float32; allowed: bool [B, T, S]; k = min(topk, S). Returns (indices
    [B, T, k] int32 by decreasing score, ties to the lower index, masked keys filling rows with
    fewer than k allowed keys; gap [B, T] float32 between the k-th and (k+1)-th allowed scores,
    +inf where no (k+1)-th exists). The same rule as the model's glm5_jax.model.dsa.select_topk
    (tests/kernels/test_kernels_dsa.py compares the two); kept here so kernels import nothing from glm5_jax.
    """
    num_keys = scores.shape[-1]
    k = min(topk, num_keys)
    masked = jnp.where(allowed, scores, -jnp.inf)
    values, indices = jax.lax.top_k(masked, min(k + 1, num_keys))
    if k < num_keys:
        gap = jnp.where(jnp.isneginf(values[..., k]), jnp.inf, values[..., k - 1] - values[..., k])
    else:
        gap = jnp.full(scores.shape[:2], jnp.inf, jnp.float32)
    return jax.lax.stop_gradient(indices[..., :k].astype(jnp.int32)), jax.lax.stop_gradient(gap)


def indexer_scores(queries, keys, weights, query_positions, key_positions, query_segment_ids,
                   key_segment_ids):
    """Dense scores [B, T, S] float32 with masked keys at -inf (shapes as indexer_topk_reference).

    The products are exact and accumulate in float32, as in the kernel: bf16 operands multiply in
    bf16 with a float32 result; float32 operands and the head weighting use Precision.HIGHEST, since
    a default-precision float32 dot is TF32 on NVIDIA GPUs (10-bit mantissas, ~1e-3 relative), which
    would move keys across the top-k boundary.
    """
    dtype = jnp.promote_types(queries.dtype, keys.dtype)
    highest = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("BTMH,BSH->BTMS", queries.astype(dtype), keys.astype(dtype),
                        precision=highest if dtype == jnp.float32 else None,
                        preferred_element_type=jnp.float32)
    scores = jax.nn.relu(scores * queries.shape[-1] ** -0.5)
    scores = jnp.einsum("BTM,BTMS->BTS", weights.astype(jnp.float32), scores, precision=highest)
    allowed = visible(query_positions[:, :, None], query_segment_ids[:, :, None],
                      key_positions[:, None, :], key_segment_ids[:, None, :], 0)
    return jnp.where(allowed, scores, -jnp.inf)


def _over_query_chunks(fn, query_chunk: int | None, per_query: tuple, t_len: int):
    """fn(*arrays) in chunks of query_chunk queries (lax.map), so [B, chunk, ...] intermediates
    replace [B, T, ...] ones. per_query: (array [B, T, ...], padding value) pairs (positions are
    padded with a query that sees nothing); fn returns [B, chunk, ...] pytrees, joined back to
    [B, T, ...]."""
    if query_chunk is None or query_chunk >= t_len:
        return fn(*(x for x, _ in per_query))
    t_pad = _round_up(t_len, query_chunk)
    chunks = t_pad // query_chunk

    def split(x, fill):  # [B, T, ...] -> [n, B, chunk, ...]
        x = _pad_to(x, 1, t_pad, fill)
        return x.reshape(x.shape[0], chunks, query_chunk, *x.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(x, fill) for x, fill in per_query))
    merge = lambda y: y.swapaxes(0, 1).reshape(y.shape[1], t_pad, *y.shape[3:])[:, :t_len]  # noqa: E731
    return jax.tree.map(merge, out)


def indexer_topk_reference(queries, keys, weights, query_positions, key_positions, query_segment_ids,
                           key_segment_ids, *, topk: int, query_chunk: int | None = None):
    """Plain jnp: dense [B, T, S] scores (`indexer_scores`), lax.top_k (`select_topk_reference`).

    queries [B, T, M, H]; keys [B, S, H]; weights [B, T, M] (float32, include M^-0.5);
    positions / segment ids int [B, T] and [B, S]. Returns (indices [B, T, k] int32 by decreasing
    score, boundary gap [B, T] float32), k = min(topk, S). query_chunk: compute query_chunk queries
    at a time (the [B, T, M, S] float32 intermediate is 128 GiB at T = S = 32K, M = 32).
    """
    def chunk(q, w, q_pos, q_seg):
        scores = indexer_scores(q, keys, w, q_pos, key_positions, q_seg, key_segment_ids)
        return select_topk_reference(scores, jnp.isfinite(scores), topk)

    per_query = ((queries, 0), (weights, 0), (query_positions, PAD_QUERY_POSITION),
                 (query_segment_ids, PAD_QUERY_SEGMENT))
    return _over_query_chunks(chunk, query_chunk, per_query, queries.shape[1])


def selected_scores(queries, keys, weights, query_positions, key_positions, query_segment_ids,
                    key_segment_ids, indices, *, query_chunk: int | None = None):
    """Scores of a selection, by decreasing score: [B, T, K] float32 (`indexer_scores`; an index
    that is masked or outside [0, S) scores -inf).

    The check of a top-k selection that holds across float rounding: two selections of the same
    scores computed in different summation orders (the kernel and the reference) may swap keys
    whose scores differ by a rounding error, so their index sets can differ; these sorted values
    then differ only by such errors, while a wrong key shows as a score difference.
    """
    num_keys = keys.shape[1]

    def chunk(q, w, q_pos, q_seg, idx):
        scores = indexer_scores(q, keys, w, q_pos, key_positions, q_seg, key_segment_ids)
        picked = jnp.take_along_axis(scores, jnp.clip(idx, 0, num_keys - 1), axis=-1)
        picked = jnp.where((idx >= 0) & (idx < num_keys), picked, -jnp.inf)
        return -jnp.sort(-picked, axis=-1)

    per_query = ((queries, 0), (weights, 0), (query_positions, PAD_QUERY_POSITION),
                 (query_segment_ids, PAD_QUERY_SEGMENT), (indices, 0))
    return _over_query_chunks(chunk, query_chunk, per_query, queries.shape[1])


# ----------------------------------------------------------------------------- kernel


def order_code(scores):
    """float32 -> int32 whose signed order is the float order (-0.0 folded into +0.0)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(scores == 0, 0.0, scores), jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def code_to_float(code):
    """Inverse of order_code (for codes of real scores)."""
    bits = jnp.where(code >= 0, code, code ^ 0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _int32(value: int) -> int:
    """A 32-bit pattern as a Python int in int32 range."""
    value &= 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value


def _indexer_kernel(bounds_ref, q_ref, w_ref, k_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, idx_ref,
                    thr_ref, next_ref, taken_ref, *, topk: int, scale: float, block_slots: int,
                    num_blocks: int, num_q_blocks: int, visit_all_slots: bool):
    """bounds_ref: int32 [B * nq * 2], per query block the key blocks [lo, hi) it may see.
    q_ref [M, bq, H]; w_ref [M, bq, 1]; k_ref [nb, bk, H]; qpos/qseg [bq, 1]; kpos/kseg [nb, 1, bk].
    Outputs: idx_ref [bq, Kp] selected key indices (slots past taken_ref are the wrapper's to
    fill); thr_ref / next_ref [bq, 1] order codes of the k-th and (k+1)-th largest scores (next =
    INT32_MIN when there is none); taken_ref [bq, 1] slots filled from key blocks [0, hi)."""
    num_heads, block_q = q_ref.shape[0], q_ref.shape[1]
    block_k = k_ref.shape[1]
    base = (pl.program_id(0) * num_q_blocks + pl.program_id(1)) * 2
    lo, hi = bounds_ref[base], bounds_ref[base + 1]
    qpos, qseg = qpos_ref[...], qseg_ref[...]
    column = jnp.zeros((block_q, 1), jnp.int32)

    def codes(j):
        """Order codes of key block j: [bq, bk]; masked keys get INT32_MIN."""
        keys = k_ref[j]

        def head(m, acc):
            return acc + w_ref[m] * jnp.maximum(dot_nt(q_ref[m], keys) * scale, 0.0)

        scores = jax.lax.fori_loop(0, num_heads, head, jnp.zeros((block_q, block_k), jnp.float32))
        allowed = visible(qpos, qseg, kpos_ref[j], kseg_ref[j], 0)
        return jnp.where(allowed, order_code(scores), INT32_MIN)

    # 1. Radix select over the visible key blocks (masked keys, INT32_MIN, never reach a candidate).
    # prefix: the threshold's high bits in unsigned order (code ^ INT32_MIN).
    # above: #keys above the current bucket; at_or_above: #keys in or above it.
    def radix_pass(level, state):
        prefix, above, at_or_above = state
        shift = 32 - RADIX_BITS * (level + 1)

        def candidate(d):  # signed code of the unsigned value prefix | d << shift
            return (prefix | (jnp.int32(d) << shift)) ^ INT32_MIN

        def count_block(j, counts):
            block = codes(j)
            return tuple(c + jnp.sum((block >= candidate(d)).astype(jnp.int32), axis=1, keepdims=True)
                         for d, c in zip(range(1, 2**RADIX_BITS), counts, strict=True))

        counts = jax.lax.fori_loop(lo, hi, count_block, (column,) * (2**RADIX_BITS - 1))
        # Counts fall with d; the chosen digit is how many candidates still keep >= topk keys.
        digit = sum((c >= topk).astype(jnp.int32) for c in counts)
        pick = lambda d_counts, default: functools.reduce(  # noqa: E731
            lambda acc, dc: jnp.where(digit == dc[0], dc[1], acc), d_counts, default)
        at_or_above = pick(list(zip(range(1, 2**RADIX_BITS), counts, strict=True)), at_or_above)
        above = pick(list(zip(range(0, 2**RADIX_BITS - 1), counts, strict=True)), above)
        return prefix | (digit << shift), above, at_or_above

    total = jnp.full((block_q, 1), num_blocks * block_k, jnp.int32)
    prefix, above, at_or_above = jax.lax.fori_loop(0, 32 // RADIX_BITS, radix_pass, (column, column, total))
    threshold = prefix ^ INT32_MIN
    need = topk - above  # ties at the threshold to take, lowest key index first

    # 2. Emission over key blocks [0, hi): the masked keys before lo are ties when a row needs fill.
    rows = jax.lax.broadcasted_iota(jnp.int32, (block_k, block_k), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (block_k, block_k), 1)
    inclusive = (rows <= cols).astype(jnp.bfloat16)  # x @ inclusive = inclusive prefix sums (0/1: exact)
    num_chunks = idx_ref.shape[1] // block_slots
    idx_ref[...] = jnp.zeros(idx_ref.shape, jnp.int32)

    def prefix_sum(mask):
        counts = jnp.dot(mask.astype(jnp.bfloat16), inclusive, preferred_element_type=jnp.float32)
        return counts.astype(jnp.int32)

    def emit_block(j, carry):
        ties_before, taken_before, below = carry
        block = codes(j)
        tie = block == threshold
        tie_rank = ties_before + prefix_sum(tie)  # inclusive
        chosen = (block > threshold) | (tie & (tie_rank <= need))
        taken = taken_before + prefix_sum(chosen)  # [bq, bk] inclusive count of chosen keys
        taken_after = taken_before + jnp.sum(chosen.astype(jnp.int32), axis=1, keepdims=True)

        def write_chunk(c, carry):  # slots of this chunk that a row fills from this block
            start = c * block_slots if isinstance(c, int) else pl.multiple_of(c * block_slots, block_slots)
            slot = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_slots), 1)
            key = j * block_k + jnp.sum((taken[:, :, None] <= slot[:, None, :]).astype(jnp.int32), axis=1)
            mine = (slot >= taken_before) & (slot < taken_after)  # [bq, slots]
            chunk = idx_ref[:, pl.ds(start, block_slots)]
            idx_ref[:, pl.ds(start, block_slots)] = jnp.where(mine, key, chunk)
            return carry

        if visit_all_slots:  # Mosaic: every chunk, static offsets (no vector -> scalar bounds)
            for c in range(num_chunks):
                write_chunk(c, 0)
        else:  # only chunks some row fills here (counts are >= 0: lax.div truncation = floor)
            first = jax.lax.div(jnp.min(taken_before), jnp.int32(block_slots))
            last = jnp.minimum(jax.lax.div(jnp.max(taken_after) + block_slots - 1, jnp.int32(block_slots)),
                               num_chunks)
            jax.lax.fori_loop(first, last, write_chunk, 0)
        below = jnp.maximum(below, jnp.max(jnp.where(block < threshold, block, INT32_MIN), axis=1,
                                           keepdims=True))
        return (ties_before + jnp.sum(tie.astype(jnp.int32), axis=1, keepdims=True), taken_after, below)

    _, taken, below = jax.lax.fori_loop(0, hi, emit_block,
                                        (column, column, jnp.full((block_q, 1), INT32_MIN, jnp.int32)))
    thr_ref[...] = threshold
    next_ref[...] = jnp.where(at_or_above > topk, threshold, below)
    taken_ref[...] = taken


# ----------------------------------------------------------------------------- wrapper


def _pad_to(x, axis: int, size: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _check_inputs(queries, keys, weights, query_positions, key_positions, query_segment_ids,
                  key_segment_ids, topk):
    if queries.ndim != 4 or keys.ndim != 3 or weights.ndim != 3:
        raise ValueError(f"queries, keys, weights must be [B, T, M, H], [B, S, H], [B, T, M]; got "
                         f"{queries.shape}, {keys.shape}, {weights.shape}")
    batch, t_len, heads, dim = queries.shape
    if keys.shape[0] != batch or keys.shape[2] != dim:
        raise ValueError(f"keys {keys.shape} must be [B={batch}, S, H={dim}]")
    if weights.shape != (batch, t_len, heads):
        raise ValueError(f"weights {weights.shape} must be [B, T, M] = {(batch, t_len, heads)}")
    for name, array, length in (("query_positions", query_positions, t_len),
                                ("query_segment_ids", query_segment_ids, t_len),
                                ("key_positions", key_positions, keys.shape[1]),
                                ("key_segment_ids", key_segment_ids, keys.shape[1])):
        if array.shape != (batch, length) or not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be int [B, {length}] = {(batch, length)}, got {array.dtype} "
                             f"{array.shape}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")


def _choose_blocks(backend: str, blocks: BlockSizes | None, t_len: int, s_len: int, k: int) -> BlockSizes:
    default = DEFAULT_BLOCK_SIZES[backend]
    if blocks is None:
        blocks = BlockSizes(default.block_q, min(default.block_k, max(16, _pow2(s_len))),
                            min(default.block_slots, max(16, _pow2(k))))
    for name in ("block_q", "block_k", "block_slots"):
        size = getattr(blocks, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    del t_len
    return blocks


def indexer_topk(queries, keys, weights, query_positions, key_positions, query_segment_ids,
                 key_segment_ids, *, topk: int, backend: str | None = None,
                 block_sizes: BlockSizes | None = None):
    """Fused indexer scores + top-k (see the module docstring).

    queries [B, T, M, H] (rotated); keys [B, S, H]; weights [B, T, M] (x Wiw * M^-0.5);
    query_positions, query_segment_ids int [B, T]; key_positions, key_segment_ids int [B, S].
    Returns (indices [B, T, k] int32 in increasing key order, boundary gap [B, T] float32),
    k = min(topk, S); no gradient.
    """
    _check_inputs(queries, keys, weights, query_positions, key_positions, query_segment_ids,
                  key_segment_ids, topk)
    # The selection carries no gradient; stopping it here keeps autodiff out of the pallas_call.
    queries, keys, weights = jax.lax.stop_gradient((queries, keys, weights))
    backend = resolve_backend(backend)
    batch, t_len, heads, dim = queries.shape
    s_len = keys.shape[1]
    k = min(topk, s_len)
    blocks = _choose_blocks(backend, block_sizes, t_len, s_len, k)
    bq, bk = blocks.block_q, blocks.block_k
    t_pad, k_pad, num_blocks = _round_up(t_len, bq), _round_up(k, blocks.block_slots), -(-s_len // bk)
    # Triton block dims must be powers of two: pad heads (zero weight), features (zeros), key
    # blocks (masked, never visited) and slots (sliced off); none changes a result.
    pow2 = _pow2 if backend == "triton" else (lambda n: n)
    dim_pad, heads_pad, k_pad, blocks_pad = pow2(dim), pow2(heads), pow2(k_pad), pow2(num_blocks)
    s_pad = blocks_pad * bk

    # Heads first ([B, M, T, H]) so a head's query block is a leading-axis index in the kernel.
    q = _pad_to(_pad_to(_pad_to(queries, 1, t_pad), 2, heads_pad), 3, dim_pad).transpose(0, 2, 1, 3)
    w = _pad_to(_pad_to(weights.astype(jnp.float32), 1, t_pad), 2, heads_pad).transpose(0, 2, 1)[..., None]
    kv = _pad_to(_pad_to(keys, 1, s_pad), 2, dim_pad).reshape(batch, blocks_pad, bk, dim_pad)
    ints = lambda x, size, fill: _pad_to(x.astype(jnp.int32), 1, size, fill)  # noqa: E731
    qpos = ints(query_positions, t_pad, PAD_QUERY_POSITION)
    qseg = ints(query_segment_ids, t_pad, PAD_QUERY_SEGMENT)
    kpos = ints(key_positions, s_pad, PAD_KEY_POSITION)
    kseg = ints(key_segment_ids, s_pad, PAD_KEY_SEGMENT)
    bounds = loop_bounds(block_ranges(qpos, qseg, kpos, kseg, bq, bk, 0))  # [B * nq * 2]: key blocks [lo, hi)

    per_query = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, i: (b, i) + (0,) * (len(shape) - 1))  # noqa: E731
    heads_first = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, i: (b, 0, i, 0))  # noqa: E731
    whole_row = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, i: (b,) + (0,) * len(shape))  # noqa: E731
    indices, threshold, following, taken = pl.pallas_call(
        functools.partial(_indexer_kernel, topk=k, scale=dim**-0.5, block_slots=blocks.block_slots,
                          num_blocks=num_blocks, num_q_blocks=t_pad // bq,
                          visit_all_slots=backend == "mosaic_tpu"),
        grid=(batch, t_pad // bq),
        in_specs=[scalar_spec(backend), heads_first(heads_pad, bq, dim_pad), heads_first(heads_pad, bq, 1),
                  whole_row(blocks_pad, bk, dim_pad), per_query(bq, 1), per_query(bq, 1),
                  whole_row(blocks_pad, 1, bk), whole_row(blocks_pad, 1, bk)],
        out_specs=[per_query(bq, k_pad), per_query(bq, 1), per_query(bq, 1), per_query(bq, 1)],
        out_shape=[jax.ShapeDtypeStruct((batch, t_pad, k_pad), jnp.int32)]
        + [jax.ShapeDtypeStruct((batch, t_pad, 1), jnp.int32)] * 3,
        name="dsa_indexer_topk",
        **call_options(backend, dimension_semantics=("parallel", "parallel")),
    )(bounds, q, w, kv, qpos[..., None], qseg[..., None], kpos.reshape(batch, blocks_pad, 1, bk),
      kseg.reshape(batch, blocks_pad, 1, bk))
    # A row with fewer than k allowed keys took every key of blocks [0, hi) (allowed, or masked
    # ties in key order), so its slots from `taken` = hi * block_k on are the next keys, all masked
    # for its query block: slot p holds key p (select_topk's fill).
    slot = jnp.arange(k, dtype=jnp.int32)
    indices = jnp.where(slot >= taken[:, :t_len], slot, indices[:, :t_len, :k])
    threshold, following = threshold[:, :t_len, 0], following[:, :t_len, 0]
    gap = jnp.where(following == INT32_MIN, jnp.inf, code_to_float(threshold) - code_to_float(following))
    if k == s_len:  # select_topk: no (k+1)-th key at all
        gap = jnp.full_like(gap, jnp.inf)
    return indices, gap


# ----------------------------------------------------------------------------- benchmarks


def _make_inputs(batch, length, heads, dim, dtype):
    def make(key):
        kq, kk, kw = jax.random.split(key, 3)
        queries = jax.random.normal(kq, (batch, length, heads, dim), dtype)
        keys = jax.random.normal(kk, (batch, length, dim), dtype)
        weights = jax.random.normal(kw, (batch, length, heads), jnp.float32) * heads**-0.5
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        segments = jnp.zeros((batch, length), jnp.int32)
        return queries, keys, weights, positions, positions, segments, segments
    return make


def _query_chunk(batch: int, heads: int, length: int, cap_bytes: int = 8 << 30) -> int:
    """Queries per chunk so the reference's [B, chunk, M, S] float32 scores stay <= cap_bytes (a
    power of two; all T = S queries at S=8K, M=32: 8 GiB, as on the H200 so far)."""
    per_query = batch * heads * length * 4
    return max(1, 1 << (max(cap_bytes // per_query, 1).bit_length() - 1))


def _selection_check(query_chunk: int):
    """compare_as for the benchmark: (scores of the selected keys by decreasing score [B, T, k],
    boundary gap [B, T], distinct indices per query [B, T]). Exact index equality is the wrong
    check at full size: kernel and reference sum each score in a different order, and among 8K
    keys the k-th and (k+1)-th scores are often within that rounding (~1e-6), so some rows
    legitimately swap a near-tied key. These values differ only by such rounding; a wrong or
    repeated key shows as a score (or count) difference."""
    def values(inputs, output):
        indices, gap = output
        scores = selected_scores(*inputs, indices, query_chunk=query_chunk)
        ordered = jnp.sort(indices, axis=-1)
        distinct = 1 + jnp.sum(ordered[..., 1:] != ordered[..., :-1], axis=-1)
        return scores, gap, distinct.astype(jnp.float32)
    return values


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """GLM-5 indexer: 32 heads x 128, k = 2048, causal prefill of S = 8K and 32K keys.

    Timed: the kernel (indices in key order) and the reference (by score), each as the model calls
    it. Checked (`_selection_check`, atol 2e-5 on scores of magnitude ~1, about 10x the rounding
    of a 32 x 128 float32 sum): the scores each selected, the gap and the count of distinct
    indices. The reference runs in query chunks of <= 8 GiB of scores (16 chunks at S=32K).
    """
    shapes = [(1, 64, 4, 32, 16)] if small else [(1, 8192, 32, 128, 2048), (1, 32768, 32, 128, 2048)]
    dtype = jnp.float32 if small else jnp.bfloat16
    cases = []
    for batch, length, heads, dim, topk in shapes:
        pairs = batch * length * (length + 1) / 2  # causal (t, s) pairs
        flops = 2.0 * pairs * heads * dim * (32 // RADIX_BITS + 1)  # score recomputations
        bytes_moved = (batch * length * (heads + 1) * dim * jnp.dtype(dtype).itemsize
                       + batch * length * min(topk, length) * 4)
        chunk = _query_chunk(batch, heads, length)
        cases.append(KernelCase(
            name=f"dsa_indexer S={length} M={heads} H={dim} k={topk}",
            make_inputs=_make_inputs(batch, length, heads, dim, dtype),
            reference=functools.partial(indexer_topk_reference, topk=topk, query_chunk=chunk),
            kernel=functools.partial(indexer_topk, topk=topk),
            flops=flops, bytes_moved=float(bytes_moved), atol=2e-5, rtol=0.0,
            compare_as=_selection_check(chunk)))
    return cases
