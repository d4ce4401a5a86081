"""Truly sparse DSA attention: each query attends only to its K gathered keys (cost ~T*K, not T*S).

Absorbed-MLA (MQA-like) formulation, as DeepSeek's sparse MLA kernels: every head of a query
attends over the same gathered latent rows, so one gathered row serves all N heads.
    logits[n, k] = (q_latent[n] . latent[i_k] + q_rope[n] . k_rope[i_k]) * scale
    out[n]       = sum_k softmax_k(logits[n]) latent[i_k]          (values = the latent itself)
The caller folds kv_b_proj's key half into q_latent beforehand and applies its value half to
`out` afterwards (glm5_jax/model/mla.py). A selected index i_k counts only if 0 <= i_k < S,
key_position[i_k] <= query_position and the segment ids agree (top-k lists of queries with
fewer than K allowed keys are padded with masked keys). A query with no allowed key gets 0.
Indices must be distinct per query (top-k output is): a repeated index would be counted twice.

Backends:
  "triton", "interpret": one program per (batch, query) holding all N heads as matmul rows; it
      loops over the K indices in chunks of `block_k`, gathering latent/rope rows with vector
      loads (a pointer gather on Triton), with the online softmax of kernels_pallas.flash_attention.
  "mosaic_tpu": TPU has no vector gather from HBM; the indices are scalar-prefetched into SMEM
      and the BlockSpec index_map fetches one gathered row per grid step (grid B x T x K,
      softmax state in VMEM scratch). Correct and lowerable; per-step overhead makes it slow,
      and T*K indices must fit SMEM (chunk long prefills). A manual multi-row DMA version is the
      obvious next step.
Backward ("triton", "interpret"): one program per (batch, query) recomputes its probabilities
from the saved log-sum-exp, accumulates d q_latent / d q_rope, and scatter-adds the gradient rows
of its K gathered keys into d latent / d k_rope with atomic adds (invalid entries go to a dummy
row S that is sliced off). "mosaic_tpu" (no atomics): the vjp of `sparse_attention_reference`,
XLA gathers plus a scatter-add; ~T*K work either way.

Einsum letters (glm5_jax/model/layers.py): B batch, T queries, S keys, N heads, R latent width,
H rope width, K selected keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from kernels_pallas.common import KernelCase, call_options, resolve_backend
from kernels_pallas.flash_attention import dot_nt, finish_softmax, online_softmax_step, visible

DEFAULT_BLOCK_K = 64  # gathered rows per online-softmax step (Triton: power of two >= 16)


def _pow2(n: int) -> int:
    """Next power of two, at least 16 (Triton's tl.dot minimum)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


# ----------------------------------------------------------------------------- reference


def gather_rows(table: jax.Array, indices: jax.Array) -> jax.Array:
    """table [B, S, ...], indices [B, T, K] (already in range) -> [B, T, K, ...]."""
    return jax.vmap(lambda rows, idx: rows[idx])(table, indices)


def selected_allowed(indices, query_positions, key_positions, query_segment_ids, key_segment_ids):
    """Which selected keys a query may see. indices [B, T, K] -> (clipped indices, bool [B, T, K])."""
    num_keys = key_positions.shape[1]
    in_range = (indices >= 0) & (indices < num_keys)
    clipped = jnp.clip(indices, 0, num_keys - 1)
    key_pos, key_seg = gather_rows(key_positions, clipped), gather_rows(key_segment_ids, clipped)
    allowed = visible(query_positions[..., None], query_segment_ids[..., None], key_pos, key_seg, 0)
    return clipped, in_range & allowed


def sparse_attention_reference(q_latent, q_rope, latent, k_rope, indices, query_positions,
                               key_positions, query_segment_ids, key_segment_ids, *, scale: float):
    """Plain-jnp gathered top-k attention (the XLA formulation; ~T*K*(R+H) memory for the gather).

    q_latent [B, T, N, R]; q_rope [B, T, N, H]; latent [B, S, R]; k_rope [B, S, H];
    indices int [B, T, K]; positions/segment ids int [B, T] and [B, S]. Returns [B, T, N, R]
    in q_latent's dtype (float32 softmax).
    """
    clipped, allowed = selected_allowed(indices, query_positions, key_positions, query_segment_ids,
                                        key_segment_ids)
    keys = gather_rows(latent, clipped)  # [B, T, K, R]
    rope = gather_rows(k_rope, clipped)  # [B, T, K, H]
    logits = (jnp.einsum("BTNR,BTKR->BTNK", q_latent, keys, preferred_element_type=jnp.float32)
              + jnp.einsum("BTNH,BTKH->BTNK", q_rope, rope, preferred_element_type=jnp.float32)) * scale
    logits = jnp.where(allowed[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1) * allowed[:, :, None]  # rows with no allowed key -> 0
    return jnp.einsum("BTNK,BTKR->BTNR", probs.astype(latent.dtype), keys,
                      preferred_element_type=jnp.float32).astype(q_latent.dtype)


# ----------------------------------------------------------------------------- kernels


def _gather_kernel(idx_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, ql_ref, qr_ref, lat_ref, kr_ref,
                   o_ref, lse_ref, *, scale: float, block_k: int, num_keys: int):
    """One (batch, query) program. idx_ref [Kp]; q*_ref [1]; k*_ref, lat_ref, kr_ref: whole arrays
    (gathered with vector indices); ql_ref [N, R]; qr_ref [N, H]; o_ref [N, R]; lse_ref [N, 1]."""
    b = pl.program_id(0)
    ql, qr = ql_ref[...], qr_ref[...]
    qpos, qseg = qpos_ref[...][None, :], qseg_ref[...][None, :]  # [1, 1]
    heads = ql.shape[0]

    def body(c, carry):
        raw = idx_ref[pl.ds(c * block_k, block_k)]  # [bk]
        idx = jnp.clip(raw, 0, num_keys - 1)
        keys, rope = lat_ref[b, idx, :], kr_ref[b, idx, :]  # gathers: [bk, R], [bk, H]
        allowed = ((raw >= 0) & (raw < num_keys))[None, :] & visible(
            qpos, qseg, kpos_ref[b, idx][None, :], kseg_ref[b, idx][None, :], 0)  # [1, bk]
        logits = (dot_nt(ql, keys) + dot_nt(qr, rope)) * scale  # [N, bk]
        return online_softmax_step(*carry, logits, jnp.broadcast_to(allowed, logits.shape), keys)

    init = (jnp.full((heads, 1), -jnp.inf, jnp.float32), jnp.zeros((heads, 1), jnp.float32),
            jnp.zeros(o_ref.shape, jnp.float32))
    m, norm, acc = jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, body, init)
    o_ref[...] = finish_softmax(norm, acc).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(norm > 0, m + jnp.log(jnp.where(norm > 0, norm, 1.0)), jnp.inf)


def _row_kernel(idx_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, ql_ref, qr_ref, lat_ref, kr_ref,
                o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale: float, num_keys: int):
    """Mosaic: grid step (b, t, k) sees the k-th selected row, fetched by the index_map.

    idx_ref: SMEM [B*T*K] raw indices; q*_ref [1, 1]; k*_ref [1, 1]; ql_ref [N, R];
    qr_ref [N, H]; lat_ref [1, R]; kr_ref [1, H]; scratch m, l [N, 1], acc [N, R]."""
    b, t, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    count = pl.num_programs(2)

    @pl.when(k == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    raw = idx_ref[(b * pl.num_programs(1) + t) * count + k]
    row, rope = lat_ref[...].astype(jnp.float32), kr_ref[...].astype(jnp.float32)  # [1, R], [1, H]
    logits = (jnp.sum(ql_ref[...].astype(jnp.float32) * row, axis=1, keepdims=True)
              + jnp.sum(qr_ref[...].astype(jnp.float32) * rope, axis=1, keepdims=True)) * scale  # [N, 1]
    allowed = ((raw >= 0) & (raw < num_keys)) & visible(qpos_ref[...], qseg_ref[...], kpos_ref[...],
                                                        kseg_ref[...], 0)  # [1, 1]
    allowed = jnp.broadcast_to(allowed, logits.shape)
    m = m_ref[...]
    m_new = jnp.maximum(m, jnp.where(allowed, logits, -jnp.inf))
    alpha = jnp.where(m_new == -jnp.inf, 1.0, jnp.exp(m - m_new))
    probs = jnp.where(allowed, jnp.exp(logits - m_new), 0.0)
    l_ref[...] = alpha * l_ref[...] + probs
    acc_ref[...] = alpha * acc_ref[...] + probs * row
    m_ref[...] = m_new

    @pl.when(k == count - 1)
    def _():
        norm = l_ref[...]
        o_ref[...] = finish_softmax(norm, acc_ref[...]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(norm > 0, m_ref[...] + jnp.log(jnp.where(norm > 0, norm, 1.0)), jnp.inf)


def _gather_backward_kernel(idx_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, ql_ref, qr_ref, lat_ref, kr_ref,
                            do_ref, lse_ref, delta_ref, dlat_in, dkr_in, dql_ref, dqr_ref, dlat_ref, dkr_ref,
                            *, scale: float, block_k: int, num_keys: int):
    """Shapes as `_gather_kernel`, plus do_ref [N, R], lse_ref / delta_ref [N, 1]; outputs
    dql_ref [N, R], dqr_ref [N, H] and the whole d latent [B, S+1, R] / d k_rope [B, S+1, H]
    (aliased to zero-filled inputs dlat_in, dkr_in), added to atomically."""
    del dlat_in, dkr_in  # the same buffers as dlat_ref, dkr_ref
    b = pl.program_id(0)
    ql, qr, d_out = ql_ref[...], qr_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qpos, qseg = qpos_ref[...][None, :], qseg_ref[...][None, :]

    def body(c, carry):
        dql, dqr = carry
        raw = idx_ref[pl.ds(c * block_k, block_k)]
        valid = (raw >= 0) & (raw < num_keys)
        idx = jnp.clip(raw, 0, num_keys - 1)
        keys, rope = lat_ref[b, idx, :], kr_ref[b, idx, :]
        key_pos, key_seg = kpos_ref[b, idx][None, :], kseg_ref[b, idx][None, :]
        allowed = valid[None, :] & visible(qpos, qseg, key_pos, key_seg, 0)
        logits = (dot_nt(ql, keys) + dot_nt(qr, rope)) * scale  # [N, bk]
        probs = jnp.where(allowed, jnp.exp(logits - lse), 0.0)
        d_logits = probs * (dot_nt(d_out, keys) - delta)  # softmax backward, [N, bk]
        dql = dql + jnp.dot(d_logits.astype(keys.dtype), keys, preferred_element_type=jnp.float32) * scale
        dqr = dqr + jnp.dot(d_logits.astype(rope.dtype), rope, preferred_element_type=jnp.float32) * scale
        d_keys = (jnp.dot(d_logits.T.astype(ql.dtype), ql, preferred_element_type=jnp.float32) * scale
                  + jnp.dot(probs.T.astype(d_out.dtype), d_out, preferred_element_type=jnp.float32))
        d_rope = jnp.dot(d_logits.T.astype(qr.dtype), qr, preferred_element_type=jnp.float32) * scale
        # Entries that are not allowed contribute zero rows; send the out-of-range ones to row S.
        target = jnp.where(valid, idx, num_keys)[:, None]
        batch_col = jnp.full(target.shape, b, jnp.int32)
        for ref, rows in ((dlat_ref, d_keys), (dkr_ref, d_rope)):
            cols = jax.lax.broadcasted_iota(jnp.int32, (1, rows.shape[1]), 1)
            pl_triton.atomic_add(ref, (batch_col, target, cols), rows.astype(ref.dtype))
        return dql, dqr

    init = (jnp.zeros(dql_ref.shape, jnp.float32), jnp.zeros(dqr_ref.shape, jnp.float32))
    dql, dqr = jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, body, init)
    dql_ref[...] = dql.astype(dql_ref.dtype)
    dqr_ref[...] = dqr.astype(dqr_ref.dtype)


# ----------------------------------------------------------------------------- forward calls


@dataclasses.dataclass(frozen=True)
class _Plan:
    backend: str
    scale: float
    block_k: int


def _pad_axis(x, axis: int, size: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _gather_layout(plan: _Plan, q_latent, q_rope, latent, k_rope, indices):
    """Triton / interpret operands padded to powers of two (zero features and heads, index -1 for
    the extra top-k slots change nothing), and the BlockSpec makers of the gather kernels."""
    n_p, r_p, h_p = _pow2(q_latent.shape[2]), _pow2(q_latent.shape[3]), _pow2(q_rope.shape[-1])
    block_k = min(plan.block_k, _pow2(indices.shape[-1]))
    k_p = -(-indices.shape[-1] // block_k) * block_k
    padded = (_pad_axis(_pad_axis(q_latent, 2, n_p), 3, r_p), _pad_axis(_pad_axis(q_rope, 2, n_p), 3, h_p),
              _pad_axis(latent, 2, r_p), _pad_axis(k_rope, 2, h_p), _pad_axis(indices, 2, k_p, -1))
    whole = pl.BlockSpec(memory_space=pl.ANY) if plan.backend == "triton" else pl.BlockSpec()
    per_query = lambda *tail: pl.BlockSpec((None, None) + tail, lambda b, t: (b, t) + (0,) * len(tail))  # noqa: E731
    in_specs = [per_query(k_p), per_query(1), per_query(1), whole, whole,
                per_query(n_p, r_p), per_query(n_p, h_p), whole, whole]
    return padded, block_k, whole, per_query, in_specs


def _forward_gather(plan: _Plan, q_latent, q_rope, latent, k_rope, indices, q_pos, k_pos, q_seg, k_seg):
    """Triton / interpret forward. Returns (out [B, T, N, R], lse [B, T, N])."""
    batch, t_len, heads, rank = q_latent.shape
    (ql, qr, lat, kr, idx), block_k, _, per_query, in_specs = _gather_layout(
        plan, q_latent, q_rope, latent, k_rope, indices)
    out, lse = pl.pallas_call(
        functools.partial(_gather_kernel, scale=plan.scale, block_k=block_k, num_keys=latent.shape[1]),
        grid=(batch, t_len),
        in_specs=in_specs,
        out_specs=[per_query(*ql.shape[2:]), per_query(ql.shape[2], 1)],
        out_shape=[jax.ShapeDtypeStruct(ql.shape, q_latent.dtype),
                   jax.ShapeDtypeStruct(ql.shape[:3] + (1,), jnp.float32)],
        **call_options(plan.backend),
    )(idx, q_pos[..., None], q_seg[..., None], k_pos, k_seg, ql, qr, lat, kr)
    return out[:, :, :heads, :rank], lse[:, :, :heads, 0]


def _backward_gather(plan: _Plan, operands, out, lse, d_out):
    """Triton / interpret backward. Returns (d q_latent, d q_rope, d latent, d k_rope)."""
    q_latent, q_rope, latent, k_rope, indices, q_pos, k_pos, q_seg, k_seg = operands
    batch, t_len, heads, rank = q_latent.shape
    num_keys, rope_dim = latent.shape[1], q_rope.shape[-1]
    (ql, qr, lat, kr, idx), block_k, whole, per_query, in_specs = _gather_layout(
        plan, q_latent, q_rope, latent, k_rope, indices)
    n_p, r_p, h_p = ql.shape[2], ql.shape[3], qr.shape[3]
    # delta = rowsum(dO * O): the softmax backward's per-row correction, [B, T, N, 1].
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    padded_rows = lambda x, n: _pad_axis(x, 2, n)  # noqa: E731  heads
    # float32 accumulators with a dummy key row S for the out-of-range entries.
    zeros_lat = jnp.zeros((batch, num_keys + 1, r_p), jnp.float32)
    zeros_kr = jnp.zeros((batch, num_keys + 1, h_p), jnp.float32)
    dql, dqr, dlat, dkr = pl.pallas_call(
        functools.partial(_gather_backward_kernel, scale=plan.scale, block_k=block_k, num_keys=num_keys),
        grid=(batch, t_len),
        in_specs=in_specs + [per_query(n_p, r_p), per_query(n_p, 1), per_query(n_p, 1)] + [whole] * 2,
        out_specs=[per_query(n_p, r_p), per_query(n_p, h_p), whole, whole],
        out_shape=[jax.ShapeDtypeStruct(ql.shape, q_latent.dtype),
                   jax.ShapeDtypeStruct(qr.shape, q_rope.dtype),
                   jax.ShapeDtypeStruct(zeros_lat.shape, jnp.float32),
                   jax.ShapeDtypeStruct(zeros_kr.shape, jnp.float32)],
        input_output_aliases={12: 2, 13: 3},
        **call_options(plan.backend),
    )(idx, q_pos[..., None], q_seg[..., None], k_pos, k_seg, ql, qr, lat, kr,
      _pad_axis(padded_rows(d_out, n_p), 3, r_p), padded_rows(lse[..., None], n_p),
      padded_rows(delta, n_p), zeros_lat, zeros_kr)
    return (dql[:, :, :heads, :rank], dqr[:, :, :heads, :rope_dim],
            dlat[:, :num_keys, :rank].astype(latent.dtype), dkr[:, :num_keys, :rope_dim].astype(k_rope.dtype))


def _forward_rows(plan: _Plan, q_latent, q_rope, latent, k_rope, indices, q_pos, k_pos, q_seg, k_seg):
    """Mosaic TPU: the index_map gathers one selected row per grid step."""
    batch, t_len, heads, rank = q_latent.shape
    num_keys, rope_dim, topk = latent.shape[1], q_rope.shape[-1], indices.shape[-1]

    def key_row(b, t, k, idx_ref):
        row = jnp.clip(idx_ref[(b * t_len + t) * topk + k], 0, num_keys - 1)
        return (b, row, 0, 0)

    query_block = lambda *tail: pl.BlockSpec((None, None) + tail, lambda b, t, k, idx_ref: (b, t, 0, 0))  # noqa: E731
    key_block = lambda width: pl.BlockSpec((None, None, 1, width), key_row)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, t_len, topk),
        in_specs=[query_block(1, 1), query_block(1, 1), key_block(1), key_block(1),
                  query_block(heads, rank), query_block(heads, rope_dim),
                  key_block(rank), key_block(rope_dim)],
        out_specs=[query_block(heads, rank), query_block(heads, 1)],
        scratch_shapes=[pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
                        pltpu.VMEM((heads, rank), jnp.float32)],
    )
    col = lambda x: x[..., None, None]  # noqa: E731  [B, L] -> [B, L, 1, 1]
    out, lse = pl.pallas_call(
        functools.partial(_row_kernel, scale=plan.scale, num_keys=num_keys),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((batch, t_len, heads, rank), q_latent.dtype),
                   jax.ShapeDtypeStruct((batch, t_len, heads, 1), jnp.float32)],
        **call_options(plan.backend, dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(indices.reshape(-1), col(q_pos), col(q_seg), col(k_pos), col(k_seg), q_latent, q_rope,
      latent[:, :, None, :], k_rope[:, :, None, :])
    return out, lse[..., 0]


def _forward(plan: _Plan, *operands):
    if plan.backend == "mosaic_tpu":
        return _forward_rows(plan, *operands)
    return _forward_gather(plan, *operands)


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse(plan, q_latent, q_rope, latent, k_rope, indices, q_pos, k_pos, q_seg, k_seg):
    return _forward(plan, q_latent, q_rope, latent, k_rope, indices, q_pos, k_pos, q_seg, k_seg)[0]


def _sparse_fwd(plan, *operands):
    out, lse = _forward(plan, *operands)
    return out, (operands, out, lse)


def _sparse_bwd(plan, residuals, d_out):
    operands, out, lse = residuals
    rest = operands[4:]
    if plan.backend != "mosaic_tpu":
        return _backward_gather(plan, operands, out, lse, d_out) + (None,) * len(rest)
    # TPU: the reference's vjp, XLA gathers and a scatter-add of the per-selected-key gradients
    # into latent and k_rope (the gather's transpose); ~T*K work like the forward.
    differentiable = operands[:4]
    _, vjp = jax.vjp(lambda *x: sparse_attention_reference(*x, *rest, scale=plan.scale), *differentiable)
    return vjp(d_out) + (None,) * len(rest)


_sparse.defvjp(_sparse_fwd, _sparse_bwd)


def _check_inputs(q_latent, q_rope, latent, k_rope, indices, query_positions, key_positions,
                  query_segment_ids, key_segment_ids):
    if q_latent.ndim != 4 or q_rope.ndim != 4 or latent.ndim != 3 or k_rope.ndim != 3:
        raise ValueError("q_latent, q_rope, latent, k_rope must be [B, T, N, R], [B, T, N, H], [B, S, R], "
                         f"[B, S, H]; got {q_latent.shape}, {q_rope.shape}, {latent.shape}, {k_rope.shape}")
    batch, t_len, heads, rank = q_latent.shape
    num_keys = latent.shape[1]
    if q_rope.shape[:3] != (batch, t_len, heads):
        raise ValueError(f"q_rope {q_rope.shape} must be [B, T, N] = {(batch, t_len, heads)} + [H]")
    if latent.shape != (batch, num_keys, rank):
        raise ValueError(f"latent {latent.shape} must be [B={batch}, S, R={rank}]")
    if k_rope.shape != (batch, num_keys, q_rope.shape[-1]):
        raise ValueError(f"k_rope {k_rope.shape} must be [B, S, H] = {(batch, num_keys, q_rope.shape[-1])}")
    index_ok = indices.ndim == 3 and indices.shape[:2] == (batch, t_len)
    if not index_ok or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be int [B, T, K] with [B, T] = {(batch, t_len)}, got "
                         f"{indices.dtype} {indices.shape}")
    for name, array, length in (("query_positions", query_positions, t_len),
                                ("query_segment_ids", query_segment_ids, t_len),
                                ("key_positions", key_positions, num_keys),
                                ("key_segment_ids", key_segment_ids, num_keys)):
        if array.shape != (batch, length) or not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be int [B, {length}] = {(batch, length)}, got {array.dtype} "
                             f"{array.shape}")


def sparse_attention(q_latent, q_rope, latent, k_rope, indices, query_positions, key_positions,
                     query_segment_ids, key_segment_ids, *, scale: float | None = None,
                     backend: str | None = None, block_k: int = DEFAULT_BLOCK_K):
    """Gathered top-k MLA attention (see the module docstring).

    q_latent [B, T, N, R]; q_rope [B, T, N, H]; latent [B, S, R]; k_rope [B, S, H];
    indices int [B, T, K]; query_positions, query_segment_ids int [B, T]; key_positions,
    key_segment_ids int [B, S]. scale defaults to (R + H)^-0.5. Returns [B, T, N, R];
    differentiable in q_latent, q_rope, latent and k_rope.
    """
    _check_inputs(q_latent, q_rope, latent, k_rope, indices, query_positions, key_positions,
                  query_segment_ids, key_segment_ids)
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    scale = (q_latent.shape[-1] + q_rope.shape[-1]) ** -0.5 if scale is None else float(scale)
    plan = _Plan(resolve_backend(backend), scale, block_k)
    ints = [x.astype(jnp.int32) for x in (indices, query_positions, key_positions, query_segment_ids,
                                          key_segment_ids)]
    return _sparse(plan, q_latent, q_rope, latent, k_rope, *ints)


# ----------------------------------------------------------------------------- benchmarks


def _make_inputs(batch, t_len, heads, rank, rope_dim, topk, dtype):
    def make(key):
        keys = jax.random.split(key, 5)
        ql = jax.random.normal(keys[0], (batch, t_len, heads, rank), dtype)
        qr = jax.random.normal(keys[1], (batch, t_len, heads, rope_dim), dtype)
        lat = jax.random.normal(keys[2], (batch, t_len, rank), dtype)
        kr = jax.random.normal(keys[3], (batch, t_len, rope_dim), dtype)
        # Causal top-k-like selection: K distinct random keys at or before each query.
        pos = jnp.arange(t_len, dtype=jnp.int32)
        noise = jax.random.uniform(keys[4], (batch, t_len, t_len))
        noise = jnp.where(pos[None, :, None] >= pos[None, None, :], noise, -1.0)
        idx = jax.lax.top_k(noise, min(topk, t_len))[1].astype(jnp.int32)
        positions = jnp.broadcast_to(pos, (batch, t_len))
        segments = jnp.zeros((batch, t_len), jnp.int32)
        return ql, qr, lat, kr, idx, positions, positions, segments, segments
    return make


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """GLM-5 sparse MLA prefill: 64 heads (per device), latent 512 + rope 64, K = 2048."""
    shapes = ([(1, 64, 16, 32, 16, 16)] if small else
              [(1, 4096, 64, 512, 64, 2048), (1, 8192, 64, 512, 64, 2048)])
    dtype = jnp.float32 if small else jnp.bfloat16
    cases = []
    for batch, t_len, heads, rank, rope_dim, topk in shapes:
        width = rank + rope_dim
        flops = 2.0 * batch * t_len * heads * topk * (width + rank)
        elements = batch * t_len * topk * width + 2 * batch * t_len * heads * width
        bytes_moved = elements * jnp.dtype(dtype).itemsize
        scale = width**-0.5
        cases.append(KernelCase(
            name=f"sparse_attention T={t_len} N={heads} R={rank}+{rope_dim} K={topk}",
            make_inputs=_make_inputs(batch, t_len, heads, rank, rope_dim, topk, dtype),
            reference=functools.partial(sparse_attention_reference, scale=scale),
            kernel=functools.partial(sparse_attention, scale=scale),
            flops=flops, bytes_moved=float(bytes_moved),
            atol=2e-2 if dtype == jnp.bfloat16 else 1e-4, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-4))
    return cases

