"""Flash attention (forward and backward) in Pallas, for training and prefill.

A query may see a key iff key_position <= query_position, both carry the same segment id
(packed documents) and, with a sliding window, query_position - key_position < window. Softmax
runs online in float32 over key blocks; the backward recomputes probabilities from the saved
log-sum-exp (dq in one kernel over query blocks, dk/dv in one over key blocks).

Layout: the wrapper moves heads before time ([B, N, T, H]) so each block's last two dims are
(time, head dim), which both Triton and Mosaic accept, and pads time to the block size. Key
blocks that cannot hold an allowed key for a query block (from per-block min/max of positions
and segment ids) are skipped: each query block loops only over [lo, hi) of the key blocks.

Einsum letters as in glm5_jax/model/layers.py: B batch, T queries, S keys, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import KernelCase, call_options, resolve_backend

# Finite "minus infinity": keeps max/exp free of inf - inf = nan on fully masked blocks.
NEG_INF = -1e30
# log-sum-exp stored for a query that sees no key: exp(s - BIG_LSE) == 0 in the backward.
BIG_LSE = 1e30
# Padding sentinels: a padded key is never visible, a padded query sees nothing.
PAD_KEY_POSITION = 2**30
PAD_QUERY_POSITION = -(2**30)
PAD_KEY_SEGMENT = -(2**30)
PAD_QUERY_SEGMENT = -(2**30) + 1


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query and key rows per block. Triton wants powers of two (>= 16 for tl.dot); Mosaic wants
    multiples of 8 (sublanes); 128 fills the TPU MXU."""

    block_q: int
    block_k: int


DEFAULT_BLOCK_SIZES = {
    "interpret": BlockSizes(128, 128),
    "triton": BlockSizes(64, 64),  # 64 x 256 fp32 accumulators fit the H200 register file
    "mosaic_tpu": BlockSizes(128, 128),
}


# ----------------------------------------------------------------------------- shared helpers


def visible(query_pos, query_seg, key_pos, key_seg, window: int):
    """The attention rule on broadcastable blocks (e.g. [bq, 1] against [1, bk]) -> bool."""
    allowed = (key_pos <= query_pos) & (key_seg == query_seg)
    if window:
        allowed = allowed & (query_pos - key_pos < window)
    return allowed


def online_softmax_step(m, norm, acc, logits, allowed, value):
    """One key block of the online softmax.

    m, norm: [rows, 1] running max and normaliser; acc: [rows, Hv] float32; logits: [rows, cols]
    float32 (already scaled); allowed: bool [rows, cols]; value: [cols, Hv]. Returns new (m, norm, acc).
    """
    logits = jnp.where(allowed, logits, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
    # where(), not exp alone: a fully masked row has logits == m_new and would count as 1.
    probs = jnp.where(allowed, jnp.exp(logits - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    norm_new = alpha * norm + jnp.sum(probs, axis=1, keepdims=True)
    acc_new = alpha * acc + dot_nn(probs.astype(value.dtype), value)
    return m_new, norm_new, acc_new


def finish_softmax(norm, acc):
    """acc / norm, with 0 for rows that saw no key (norm == 0)."""
    return acc / jnp.where(norm > 0, norm, 1.0)


def _precision(a):
    # float32 operands get exact float32 products (Triton would otherwise use TF32); bf16 needs none.
    return jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def dot_nt(a, b):
    """a [m, k] . b [n, k]^T -> float32 [m, n]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a),
                               preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [m, k] . b [k, n] -> float32 [m, n]."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a),
                               preferred_element_type=jnp.float32)


def scalar_spec(backend: str) -> pl.BlockSpec:
    """Whole small int array readable with scalar indices: SMEM on TPU, a plain ref elsewhere."""
    if backend == "mosaic_tpu":
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec()


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def triton_dim(d: int) -> int:
    """Triton loads whole rows with tl.arange and tl.dot wants >= 16: next power of two >= 16."""
    return max(16, pl.next_power_of_2(d))


def time_rows(ref, buffer, start, size):
    """Rows [start, start + size) of this program's (batch, head) slab [L, H].

    buffer None: ref is that slab as a block (Triton, interpreter: loads read it in place).
    Otherwise (Mosaic) ref is the whole [B, N, L, H] array left in HBM and the rows are DMA'd
    into the VMEM buffer, so VMEM holds one block, not a whole sequence.
    """
    if buffer is None:
        return ref[pl.ds(start, size), :]
    pltpu.sync_copy(ref.at[pl.program_id(0), pl.program_id(1), pl.ds(start, size), :], buffer)
    return buffer[...]


def slab_spec(backend: str, length: int, width: int) -> pl.BlockSpec:
    """One (batch, head)'s whole [length, width] slab for grids (B, N, ...); on Mosaic the array
    stays in HBM (see time_rows)."""
    if backend == "mosaic_tpu":
        return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec((None, None, length, width), lambda b, n, i: (b, n, 0, 0))


def slab_buffers(backend: str, rows: int, *widths_and_dtypes):
    """VMEM scratch for time_rows on Mosaic (one [rows, width] buffer per slab), else none."""
    if backend != "mosaic_tpu":
        return []
    return [pltpu.VMEM((rows, width), dtype) for width, dtype in widths_and_dtypes]


# ----------------------------------------------------------------------------- kernels


def _forward_kernel(bounds_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, q_ref, k_ref, v_ref,
                    o_ref, lse_ref, *buffers, scale, window, block_k, num_q_blocks):
    """Grid (B, N, query blocks). q [bq, H]; k, v slabs [Sp, H/Hv] (see time_rows); q positions
    as columns [bq, 1]; key positions as rows [nk, bk]. Writes o [bq, Hv] and lse [bq, 1]."""
    k_buffer, v_buffer = buffers or (None, None)
    base = (pl.program_id(0) * num_q_blocks + pl.program_id(2)) * 2
    lo, hi = bounds_ref[base], bounds_ref[base + 1]
    q = q_ref[...]
    qpos, qseg = qpos_ref[...], qseg_ref[...]

    def body(j, carry):
        start = pl.multiple_of(j * block_k, block_k)
        k = time_rows(k_ref, k_buffer, start, block_k)
        v = time_rows(v_ref, v_buffer, start, block_k)
        allowed = visible(qpos, qseg, kpos_ref[pl.ds(j, 1), :], kseg_ref[pl.ds(j, 1), :], window)
        return online_softmax_step(*carry, dot_nt(q, k) * scale, allowed, v)

    rows = q.shape[0]
    init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros(o_ref.shape, jnp.float32))
    m, norm, acc = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = finish_softmax(norm, acc).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(norm > 0, m + jnp.log(jnp.where(norm > 0, norm, 1.0)), BIG_LSE)


def _dq_kernel(bounds_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *buffers, scale, window, block_k, num_q_blocks):
    """Grid (B, N, query blocks): dq = scale * sum_j ds_j . k_j, ds = p * (do . v^T - delta)."""
    k_buffer, v_buffer = buffers or (None, None)
    base = (pl.program_id(0) * num_q_blocks + pl.program_id(2)) * 2
    lo, hi = bounds_ref[base], bounds_ref[base + 1]
    q, do = q_ref[...], do_ref[...]
    qpos, qseg, lse, delta = qpos_ref[...], qseg_ref[...], lse_ref[...], delta_ref[...]

    def body(j, dq):
        start = pl.multiple_of(j * block_k, block_k)
        k = time_rows(k_ref, k_buffer, start, block_k)
        v = time_rows(v_ref, v_buffer, start, block_k)
        allowed = visible(qpos, qseg, kpos_ref[pl.ds(j, 1), :], kseg_ref[pl.ds(j, 1), :], window)
        probs = jnp.where(allowed, jnp.exp(dot_nt(q, k) * scale - lse), 0.0)  # [bq, bk]
        dscores = probs * (dot_nt(do, v) - delta)
        return dq + dot_nn(dscores.astype(k.dtype), k)

    dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(bounds_ref, kpos_ref, kseg_ref, qpos_ref, qseg_ref, k_ref, v_ref, q_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *buffers, scale, window, block_q, num_k_blocks):
    """Grid (B, N, key blocks), transposed so no dot contracts a leading dim: k, v [bk, H/Hv];
    key positions as columns [bk, 1]; q, do slabs [Tp, H/Hv] (see time_rows); q positions, lse,
    delta as rows [nq, bq]. dv = sum_i p_i^T . do_i; dk = scale * sum_i ds_i^T . q_i."""
    q_buffer, do_buffer = buffers or (None, None)
    base = (pl.program_id(0) * num_k_blocks + pl.program_id(2)) * 2
    lo, hi = bounds_ref[base], bounds_ref[base + 1]
    k, v = k_ref[...], v_ref[...]
    kpos, kseg = kpos_ref[...], kseg_ref[...]

    def body(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * block_q, block_q)
        q = time_rows(q_ref, q_buffer, start, block_q)
        do = time_rows(do_ref, do_buffer, start, block_q)
        allowed = visible(qpos_ref[pl.ds(i, 1), :], qseg_ref[pl.ds(i, 1), :], kpos, kseg, window)
        probs_t = jnp.where(allowed, jnp.exp(dot_nt(k, q) * scale - lse_ref[pl.ds(i, 1), :]), 0.0)
        dv = dv + dot_nn(probs_t.astype(do.dtype), do)
        dscores_t = probs_t * (dot_nt(v, do) - delta_ref[pl.ds(i, 1), :])  # [bk, bq]
        dk = dk + dot_nn(dscores_t.astype(q.dtype), q)
        return dk, dv

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(lo, hi, body, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- layout helpers


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call: backend, blocks, padded sizes."""

    backend: str
    block_q: int
    block_k: int
    window: int
    scale: float
    head_pad: int  # padded query/key head dim
    value_pad: int  # padded value head dim


def _pad_time(x, length, fill):
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=fill)


def _heads_first(x, length, head_pad):
    """[B, L, N, H] -> zero-padded [B, N, length, head_pad]."""
    pad = ((0, 0), (0, length - x.shape[1]), (0, 0), (0, head_pad - x.shape[3]))
    return jnp.pad(x, pad).transpose(0, 2, 1, 3)


def block_ranges(q_pos, q_seg, k_pos, k_seg, block_q, block_k, window):
    """Conservative visibility per (query block, key block) from min/max summaries.

    Padded int arrays [B, Tp] and [B, Sp] -> bool [B, nq, nk]; False means no query of the block
    can see any key of the other, so the kernels skip the pair.
    """
    big = 2**31 - 1

    def summary(pos, seg, block, pad_seg):
        pos, seg = pos.reshape(pos.shape[0], -1, block), seg.reshape(seg.shape[0], -1, block)
        real = seg != pad_seg
        lo = lambda x: jnp.min(jnp.where(real, x, big), axis=-1)  # noqa: E731
        hi = lambda x: jnp.max(jnp.where(real, x, -big), axis=-1)  # noqa: E731
        return lo(pos), hi(pos), lo(seg), hi(seg), jnp.any(real, axis=-1)

    qp_lo, qp_hi, qs_lo, qs_hi, q_real = summary(q_pos, q_seg, block_q, PAD_QUERY_SEGMENT)
    kp_lo, kp_hi, ks_lo, ks_hi, k_real = summary(k_pos, k_seg, block_k, PAD_KEY_SEGMENT)
    q = lambda x: x[:, :, None]  # noqa: E731
    k = lambda x: x[:, None, :]  # noqa: E731
    possible = (k(kp_lo) <= q(qp_hi)) & (k(ks_lo) <= q(qs_hi)) & (k(ks_hi) >= q(qs_lo))
    possible = possible & q(q_real) & k(k_real)
    if window:
        possible = possible & (q(qp_lo) - k(kp_hi) < window)
    return possible


def loop_bounds(possible):
    """bool [B, rows, cols] -> int32 [B * rows * 2]: per row the [first, last + 1) True column
    (0, 0 when none), flattened so a kernel reads them as scalars."""
    cols = possible.shape[-1]
    has_any = jnp.any(possible, axis=-1)
    first = jnp.argmax(possible, axis=-1)
    last = cols - jnp.argmax(possible[..., ::-1], axis=-1)
    bounds = jnp.stack([jnp.where(has_any, first, 0), jnp.where(has_any, last, 0)], axis=-1)
    return bounds.reshape(-1).astype(jnp.int32)


def _prepare(plan: _Plan, query, key, value, q_pos, k_pos, q_seg, k_seg):
    """Pads and lays out the inputs; returns a dict of kernel operands."""
    (batch, t_len), s_len = q_pos.shape, k_pos.shape[1]
    t_pad, s_pad = round_up(t_len, plan.block_q), round_up(s_len, plan.block_k)
    q_pos = _pad_time(q_pos, t_pad, PAD_QUERY_POSITION)
    q_seg = _pad_time(q_seg, t_pad, PAD_QUERY_SEGMENT)
    k_pos = _pad_time(k_pos, s_pad, PAD_KEY_POSITION)
    k_seg = _pad_time(k_seg, s_pad, PAD_KEY_SEGMENT)
    possible = block_ranges(q_pos, q_seg, k_pos, k_seg, plan.block_q, plan.block_k, plan.window)
    return {
        "q": _heads_first(query, t_pad, plan.head_pad),  # [B, N, Tp, Hp]
        "k": _heads_first(key, s_pad, plan.head_pad),  # [B, N, Sp, Hp]
        "v": _heads_first(value, s_pad, plan.value_pad),  # [B, N, Sp, Hvp]
        "q_cols": (q_pos[..., None], q_seg[..., None]),  # [B, Tp, 1]
        "q_rows": (q_pos.reshape(batch, -1, plan.block_q), q_seg.reshape(batch, -1, plan.block_q)),
        "k_cols": (k_pos[..., None], k_seg[..., None]),  # [B, Sp, 1]
        "k_rows": (k_pos.reshape(batch, -1, plan.block_k), k_seg.reshape(batch, -1, plan.block_k)),
        "q_bounds": loop_bounds(possible),  # per query block: key blocks [lo, hi)
        "k_bounds": loop_bounds(possible.transpose(0, 2, 1)),  # per key block: query blocks
    }


def _warps(plan: _Plan) -> int:
    return 8 if max(plan.head_pad, plan.value_pad) >= 128 else 4


def _forward(plan: _Plan, ops):
    """-> (out [B, N, Tp, Hvp], lse [B, N, Tp, 1] float32)."""
    batch, heads, t_pad, head_pad = ops["q"].shape
    s_pad, num_q_blocks = ops["k"].shape[2], t_pad // plan.block_q
    bq, value_pad = plan.block_q, plan.value_pad
    col = pl.BlockSpec((None, bq, 1), lambda b, n, i: (b, i, 0))
    rows = pl.BlockSpec((None, s_pad // plan.block_k, plan.block_k), lambda b, n, i: (b, 0, 0))
    whole = functools.partial(slab_spec, plan.backend, s_pad)
    block = lambda h: pl.BlockSpec((None, None, bq, h), lambda b, n, i: (b, n, i, 0))  # noqa: E731
    kernel = functools.partial(_forward_kernel, scale=plan.scale, window=plan.window,
                               block_k=plan.block_k, num_q_blocks=num_q_blocks)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, num_q_blocks),
        in_specs=[scalar_spec(plan.backend), col, col, rows, rows, block(head_pad), whole(head_pad),
                  whole(value_pad)],
        out_specs=[block(value_pad), block(1)],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, t_pad, value_pad), ops["q"].dtype),
                   jax.ShapeDtypeStruct((batch, heads, t_pad, 1), jnp.float32)],
        scratch_shapes=slab_buffers(plan.backend, plan.block_k, (head_pad, ops["k"].dtype),
                                    (value_pad, ops["v"].dtype)),
        name="flash_attention_forward",
        **call_options(plan.backend, num_warps=_warps(plan), dimension_semantics=("parallel",) * 3),
    )(ops["q_bounds"], *ops["q_cols"], *ops["k_rows"], ops["q"], ops["k"], ops["v"])


def _backward(plan: _Plan, ops, out, lse, d_out):
    """out, d_out: [B, N, Tp, Hvp]; lse: [B, N, Tp, 1] -> (dq, dk, dv) in the padded layout."""
    batch, heads, t_pad, head_pad = ops["q"].shape
    s_pad, value_pad = ops["k"].shape[2], plan.value_pad
    bq, bk = plan.block_q, plan.block_k
    nq, nk = t_pad // bq, s_pad // bk
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    options = call_options(plan.backend, num_warps=_warps(plan), dimension_semantics=("parallel",) * 3)
    common = dict(scale=plan.scale, window=plan.window)

    q_block = lambda h: pl.BlockSpec((None, None, bq, h), lambda b, n, i: (b, n, i, 0))  # noqa: E731
    k_whole = functools.partial(slab_spec, plan.backend, s_pad)
    q_col = pl.BlockSpec((None, bq, 1), lambda b, n, i: (b, i, 0))
    k_rows = pl.BlockSpec((None, nk, bk), lambda b, n, i: (b, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=bk, num_q_blocks=nq, **common),
        grid=(batch, heads, nq),
        in_specs=[scalar_spec(plan.backend), q_col, q_col, k_rows, k_rows, q_block(head_pad),
                  k_whole(head_pad), k_whole(value_pad), q_block(value_pad), q_block(1), q_block(1)],
        out_specs=q_block(head_pad),
        out_shape=jax.ShapeDtypeStruct(ops["q"].shape, ops["q"].dtype),
        scratch_shapes=slab_buffers(plan.backend, bk, (head_pad, ops["k"].dtype),
                                    (value_pad, ops["v"].dtype)),
        name="flash_attention_dq",
        **options,
    )(ops["q_bounds"], *ops["q_cols"], *ops["k_rows"], ops["q"], ops["k"], ops["v"], d_out, lse, delta)

    k_block = lambda h: pl.BlockSpec((None, None, bk, h), lambda b, n, j: (b, n, j, 0))  # noqa: E731
    q_whole = functools.partial(slab_spec, plan.backend, t_pad)
    k_col = pl.BlockSpec((None, bk, 1), lambda b, n, j: (b, j, 0))
    q_rows = pl.BlockSpec((None, nq, bq), lambda b, n, j: (b, 0, 0))
    stat_rows = pl.BlockSpec((None, None, nq, bq), lambda b, n, j: (b, n, 0, 0))
    to_rows = lambda x: x.reshape(batch, heads, nq, bq)  # noqa: E731  [B, N, Tp, 1] -> [B, N, nq, bq]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=bq, num_k_blocks=nk, **common),
        grid=(batch, heads, nk),
        in_specs=[scalar_spec(plan.backend), k_col, k_col, q_rows, q_rows, k_block(head_pad),
                  k_block(value_pad), q_whole(head_pad), q_whole(value_pad), stat_rows, stat_rows],
        out_specs=[k_block(head_pad), k_block(value_pad)],
        out_shape=[jax.ShapeDtypeStruct(ops["k"].shape, ops["k"].dtype),
                   jax.ShapeDtypeStruct(ops["v"].shape, ops["v"].dtype)],
        scratch_shapes=slab_buffers(plan.backend, bq, (head_pad, ops["q"].dtype), (value_pad, d_out.dtype)),
        name="flash_attention_dkv",
        **options,
    )(ops["k_bounds"], *ops["k_cols"], *ops["q_rows"], ops["k"], ops["v"], ops["q"], d_out,
      to_rows(lse), to_rows(delta))
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom_vjp


def _unpad(x, length, width):
    """[B, N, Lp, Hp] -> [B, length, N, width]."""
    return x[:, :, :length, :width].transpose(0, 2, 1, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, query, key, value, q_pos, k_pos, q_seg, k_seg):
    return _flash_fwd(plan, query, key, value, q_pos, k_pos, q_seg, k_seg)[0]


def _flash_fwd(plan, query, key, value, q_pos, k_pos, q_seg, k_seg):
    ops = _prepare(plan, query, key, value, q_pos, k_pos, q_seg, k_seg)
    out, lse = _forward(plan, ops)
    result = _unpad(out, query.shape[1], value.shape[-1])
    return result, (query, key, value, q_pos, k_pos, q_seg, k_seg, out, lse)


def _flash_bwd(plan, residuals, d_result):
    query, key, value, q_pos, k_pos, q_seg, k_seg, out, lse = residuals
    ops = _prepare(plan, query, key, value, q_pos, k_pos, q_seg, k_seg)
    d_out = _heads_first(d_result.astype(out.dtype), out.shape[2], plan.value_pad)
    dq, dk, dv = _backward(plan, ops, out, lse, d_out)
    t_len, s_len = query.shape[1], key.shape[1]
    return (_unpad(dq, t_len, query.shape[-1]), _unpad(dk, s_len, key.shape[-1]),
            _unpad(dv, s_len, value.shape[-1]), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public API


def _check_inputs(query, key, value, query_positions, key_positions, query_segment_ids,
                  key_segment_ids, sliding_window):
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"query, key, value must be [B, T, N, H], [B, S, N, H], [B, S, N, Hv]; got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    batch, t_len, heads, head_dim = query.shape
    if key.shape[:1] + key.shape[2:] != (batch, heads, head_dim):
        raise ValueError(f"key {key.shape} must be [B={batch}, S, N={heads}, H={head_dim}]")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value {value.shape} must be [B, S, N] = {key.shape[:3]} + [Hv]")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"query, key, value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    for name, array, length in (("query_positions", query_positions, t_len),
                                ("query_segment_ids", query_segment_ids, t_len),
                                ("key_positions", key_positions, key.shape[1]),
                                ("key_segment_ids", key_segment_ids, key.shape[1])):
        if array.shape != (batch, length):
            raise ValueError(f"{name} must be [B, {length}] = {(batch, length)}, got {array.shape}")
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {array.dtype}")
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0 = off), got {sliding_window}")


def _choose_blocks(backend: str, block_q: int | None, block_k: int | None, t_len: int, s_len: int):
    """Per-backend defaults, shrunk for short inputs, and checked against the backend's rules."""
    default = DEFAULT_BLOCK_SIZES[backend]

    def pick(block, default_block, length):
        if block is not None:
            chosen = block
        elif backend == "triton":
            chosen = min(default_block, max(16, pl.next_power_of_2(length)))
        else:
            chosen = min(default_block, round_up(length, 8))
        if chosen <= 0 or (backend != "triton" and chosen % 8):
            raise ValueError(f"block size {chosen} must be a positive multiple of 8 on {backend}")
        if backend == "triton" and (chosen < 16 or chosen & (chosen - 1)):
            raise ValueError(f"block size {chosen} must be a power of two >= 16 on triton")
        return chosen

    return pick(block_q, default.block_q, t_len), pick(block_k, default.block_k, s_len)


def flash_attention(query, key, value, query_positions, key_positions, query_segment_ids,
                    key_segment_ids, *, sliding_window: int = 0, scale: float | None = None,
                    backend: str | None = None, block_q: int | None = None, block_k: int | None = None):
    """Blocked flash attention with causal, segment and sliding-window masking.

    query [B, T, N, H]; key [B, S, N, H]; value [B, S, N, Hv]; query_positions,
    query_segment_ids int [B, T]; key_positions, key_segment_ids int [B, S]. A query with no
    visible key gets 0. Returns [B, T, N, Hv] in query's dtype; differentiable in query, key, value.
    """
    _check_inputs(query, key, value, query_positions, key_positions, query_segment_ids,
                  key_segment_ids, sliding_window)
    backend = resolve_backend(backend)
    bq, bk = _choose_blocks(backend, block_q, block_k, query.shape[1], key.shape[1])
    # Zero padding of head dims changes no dot product; Triton needs it (see triton_dim).
    pad_dim = triton_dim if backend == "triton" else (lambda d: d)
    plan = _Plan(backend=backend, block_q=bq, block_k=bk, window=int(sliding_window),
                 scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
                 head_pad=pad_dim(query.shape[-1]), value_pad=pad_dim(value.shape[-1]))
    ints = [x.astype(jnp.int32) for x in (query_positions, key_positions, query_segment_ids, key_segment_ids)]
    return _flash(plan, query, key, value, *ints)


def flash_attention_reference(query, key, value, query_positions, key_positions, query_segment_ids,
                              key_segment_ids, *, sliding_window: int = 0, scale: float | None = None,
                              backend: str | None = None, block_q: int | None = None,
                              block_k: int | None = None):
    """Plain-jnp attention with the same signature and rule (backend and blocks are ignored).

    Float32 logits and softmax; probabilities cast to value's dtype before the value product, as
    glm5_jax.model.mla.attend does. Rows with no visible key give 0.
    """
    del backend, block_q, block_k
    _check_inputs(query, key, value, query_positions, key_positions, query_segment_ids,
                  key_segment_ids, sliding_window)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    allowed = visible(query_positions[:, :, None], query_segment_ids[:, :, None],
                      key_positions[:, None, :], key_segment_ids[:, None, :], sliding_window)[:, None]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  exact for bf16; XLA:CPU has no bf16 x bf16 -> f32 dot
    logits = jnp.einsum("BTNH,BSNH->BNTS", f32(query), f32(key)) * scale
    logits = jnp.where(allowed, logits, NEG_INF)
    probs = jnp.where(allowed, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return jnp.einsum("BNTS,BSNH->BTNH", f32(probs.astype(value.dtype)), f32(value)).astype(query.dtype)


# ----------------------------------------------------------------------------- benchmarks


def _attention_problem(key, *, batch, length, heads, head_dim, value_dim, dtype):
    """Causal single-document inputs: (query, key, value, positions, positions, segments, segments)."""
    kq, kk, kv = jax.random.split(key, 3)
    query = jax.random.normal(kq, (batch, length, heads, head_dim), jnp.float32).astype(dtype)
    keys = jax.random.normal(kk, (batch, length, heads, head_dim), jnp.float32).astype(dtype)
    value = jax.random.normal(kv, (batch, length, heads, value_dim), jnp.float32).astype(dtype)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    segments = jnp.zeros((batch, length), jnp.int32)
    return query, keys, value, positions, positions, segments, segments


def _visible_pairs(length: int, window: int) -> int:
    """Query-key pairs a causal (optionally windowed) attention over one document computes."""
    if not window:
        return length * (length + 1) // 2
    return sum(min(t + 1, window) for t in range(length))


def _with_gradients(attention, **options):
    """(inputs) -> (dq, dk, dv) of the sum of outputs: one forward and one backward pass."""
    def run(query, key, value, *masks):
        loss = lambda q, k, v: attention(q, k, v, *masks, **options).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(query, key, value)
    return run


def _cudnn_attention(query, key, value, *masks):
    """jax.nn.dot_product_attention, cuDNN's fused kernel on a GPU (plain XLA elsewhere, so the
    small CPU smoke run works). Causal with no packing, the only mask the case uses."""
    implementation = "cudnn" if jax.default_backend() == "gpu" else None
    return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation=implementation)


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """Causal MLA-shaped attention (H = Hv = 256, bf16) at T = S = 4096, forward and forward +
    backward, a sliding-window case, and one case against cuDNN at H = 128 (cuDNN's fused flash
    attention takes head dims up to 128 on every recent cuDNN; 256 needs cuDNN >= 9.5 on Hopper).
    Backward FLOPs count as 2.5x the forward's (the usual convention; the kernels recompute
    probabilities, so they do ~3.5x). small: tiny float32 shapes for the interpreter."""
    if small:
        problems = [("flash small", 1, 64, 2, 32, 32, 0), ("flash small window=16", 1, 64, 2, 32, 32, 16)]
        dtype, grad_problems, cudnn_problem = jnp.float32, problems[:1], ("small", 1, 64, 2, 32)
    else:
        problems = [("flash N=16", 1, 4096, 16, 256, 256, 0), ("flash N=64", 1, 4096, 64, 256, 256, 0),
                    ("flash N=16 window=1024", 1, 4096, 16, 256, 256, 1024)]
        dtype, grad_problems, cudnn_problem = jnp.bfloat16, problems[:1], ("N=16", 1, 4096, 16, 128)
    itemsize = jnp.dtype(dtype).itemsize
    cases = []
    for name, batch, length, heads, head_dim, value_dim, window in problems:
        make = functools.partial(_attention_problem, batch=batch, length=length, heads=heads,
                                 head_dim=head_dim, value_dim=value_dim, dtype=dtype)
        flops = 2.0 * batch * heads * _visible_pairs(length, window) * (head_dim + value_dim)
        bytes_moved = batch * length * heads * (2 * head_dim + 2 * value_dim) * itemsize
        label = f"{name} B={batch} T=S={length} H={head_dim}"
        kernel = functools.partial(flash_attention, sliding_window=window)
        reference = functools.partial(flash_attention_reference, sliding_window=window)
        cases.append(KernelCase(label + " fwd", make, reference, kernel, flops, bytes_moved))
        if (name, batch, length, heads, head_dim, value_dim, window) in grad_problems:
            grads = functools.partial(_with_gradients, sliding_window=window)
            cases.append(KernelCase(label + " fwd+bwd", make, grads(flash_attention_reference),
                                    grads(flash_attention), 3.5 * flops, 3 * bytes_moved,
                                    atol=5e-2, rtol=5e-2))
    name, batch, length, heads, head_dim = cudnn_problem
    make = functools.partial(_attention_problem, batch=batch, length=length, heads=heads,
                             head_dim=head_dim, value_dim=head_dim, dtype=dtype)
    cases.append(KernelCase(f"flash vs cudnn causal {name} B={batch} T=S={length} H={head_dim} fwd", make,
                            _cudnn_attention, flash_attention,
                            4.0 * batch * heads * _visible_pairs(length, 0) * head_dim,
                            4 * batch * length * heads * head_dim * itemsize))
    return cases
