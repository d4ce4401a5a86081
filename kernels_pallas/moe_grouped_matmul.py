"""Grouped matmul for the MoE expert FFN: rows sorted by expert, each group of rows times its
own expert matrix, as a Pallas kernel with a custom VJP (forward, d_lhs and d_rhs kernels).

    out[r]  = lhs[r] @ rhs[g(r)]            for rows r in group g; rows past sum(sizes) -> 0
    d_lhs   = grouped_matmul(d_out, rhs^T)  (the same kernel, rhs read transposed)
    d_rhs[g] = lhs_g^T @ d_out_g            (a transposed grouped matmul, its own kernel)

Shapes (spelled out; the model's einsum letters are not used here): lhs [rows, contract],
rhs [groups, contract, cols], group_sizes [groups] int32, out [rows, cols].

Row tiles may straddle group boundaries. Two schedules handle that:
- "visits" (TPU, and the interpreter): a sequential grid over (group, row tile) visits listed
  in order by jnp metadata passed through scalar prefetch. Consecutive visits of one row tile
  write their own group's rows into the resident output block; consecutive visits of one group
  accumulate d_rhs in a scratch tile. At most row_tiles + groups - 1 visits.
- "tiles" (Triton, where grid programs run in parallel and cannot revisit an output block):
  one program per output tile, looping over the groups (or row tiles) it overlaps.
Both accumulate in float32 and run in the interpreter, so the CPU tests check both.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import KernelCase, call_options, resolve_backend

SCHEDULES = ("visits", "tiles")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Block sizes (rows x contract x cols) and schedule; shrunk to fit small operands."""

    block_rows: int
    block_contract: int
    block_cols: int
    schedule: str
    num_warps: int = 4  # Triton only
    num_stages: int = 2  # Triton only


# Triton needs power-of-two blocks of at least 16 for tl.dot; Mosaic needs the last two block
# dims divisible by (8, 128) (16 rows for bf16) and likes large tiles to amortise each step.
DEFAULT_TILINGS = {
    "interpret": Tiling(32, 128, 128, "visits"),
    "triton": Tiling(64, 64, 128, "tiles", num_warps=4, num_stages=3),
    "mosaic_tpu": Tiling(128, 512, 512, "visits"),
}


# ----------------------------------------------------------------------------- checks and tiling
def _check_inputs(lhs, rhs, group_sizes) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [rows, contract], got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be [groups, contract, cols], got shape {rhs.shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"contract dims differ: lhs {lhs.shape} vs rhs {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes must be [groups]=({rhs.shape[0]},), got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"lhs and rhs must share one float dtype, got {lhs.dtype} and {rhs.dtype}")
    if lhs.shape[0] == 0 or min(rhs.shape) == 0:
        raise ValueError(f"empty operands are not supported: lhs {lhs.shape}, rhs {rhs.shape}")


def _check_tiling(tiling: Tiling, backend: str) -> None:
    if tiling.schedule not in SCHEDULES:
        raise ValueError(f"tiling.schedule must be one of {SCHEDULES}, got {tiling.schedule!r}")
    if backend == "triton" and tiling.schedule != "tiles":
        raise ValueError("the Triton backend needs schedule='tiles' (no scalar prefetch or scratch)")
    if backend == "mosaic_tpu" and tiling.schedule != "visits":
        raise ValueError("the Mosaic backend needs schedule='visits' (blocks must come from the grid)")
    blocks = (tiling.block_rows, tiling.block_contract, tiling.block_cols)
    if min(blocks) <= 0:
        raise ValueError(f"block sizes must be positive, got {blocks}")
    if backend == "triton" and any(b & (b - 1) or b < 16 for b in blocks):
        raise ValueError(f"Triton block sizes must be powers of two >= 16, got {blocks}")
    if backend == "mosaic_tpu" and (tiling.block_rows % 8 or tiling.block_contract % 128
                                    or tiling.block_cols % 128):
        raise ValueError(f"Mosaic block sizes must be multiples of (8, 128, 128), got {blocks}")


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _fit_blocks(tiling: Tiling, backend: str, rows: int, contract: int, cols: int,
                dtype) -> tuple[int, int, int]:
    """Blocks no larger than the (aligned) operand, so tiny test shapes need little padding."""
    if backend == "mosaic_tpu":
        sublane = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)  # bf16 packs 16 rows per vreg
        return (min(_round_up(tiling.block_rows, sublane), _round_up(rows, sublane)),
                min(tiling.block_contract, _round_up(contract, 128)),
                min(tiling.block_cols, _round_up(cols, 128)))
    # Triton (and the interpreter, which mirrors it): powers of two, at least 16 for tl.dot.
    return tuple(min(block, max(16, _next_power_of_two(dim)))
                 for block, dim in ((tiling.block_rows, rows), (tiling.block_contract, contract),
                                    (tiling.block_cols, cols)))


def _pad_to(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """Zero-pads each trailing axis of x up to a multiple (zeros add nothing to a matmul)."""
    lead = x.ndim - len(multiples)
    trailing = zip(x.shape[lead:], multiples, strict=True)
    pads = [(0, 0)] * lead + [(0, _round_up(d, m) - d) for d, m in trailing]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


# ----------------------------------------------------------------------------- metadata (jnp)
def _group_offsets(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(starts [groups], ends [groups]) of each group's rows, clipped to the real rows."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def _visit_metadata(group_sizes: jax.Array, num_rows: int, block_rows: int, num_row_tiles: int):
    """The "visits" schedule: (group, row tile, row_lo, row_hi) per visit, each [visits] int32.

    Visits run group by group over the row tiles each group overlaps (an empty group gets one
    visit with an empty row range, so d_rhs writes its zeros), then one visit per row tile past
    the last group (so the forward writes their zeros), then padding visits that repeat the last
    tile and group with an empty range. Tiles and groups never decrease along the list, so a
    tile's (or a group's) visits are consecutive. visits = row_tiles + groups - 1 (static).
    """
    num_groups = group_sizes.shape[0]
    starts, ends = _group_offsets(group_sizes, num_rows)
    first_tile = jnp.minimum(starts // block_rows, num_row_tiles - 1)
    last_tile = jnp.where(ends > starts, (ends - 1) // block_rows, first_tile)
    per_group = last_tile - first_tile + 1
    group_visit_end = jnp.cumsum(per_group)
    group_visits = group_visit_end[-1]

    visit = jnp.arange(num_row_tiles + num_groups - 1, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(group_visit_end, visit, side="right"), num_groups - 1)
    in_group = visit < group_visits
    tile_in_group = first_tile[group] + visit - (group_visit_end[group] - per_group[group])
    tail_tile = jnp.minimum(last_tile[-1] + 1 + visit - group_visits, num_row_tiles - 1)
    tile = jnp.where(in_group, tile_in_group, tail_tile)
    row_lo = jnp.where(in_group, jnp.maximum(starts[group], tile * block_rows), 0)
    row_hi = jnp.where(in_group, jnp.minimum(ends[group], (tile + 1) * block_rows), 0)
    return tuple(a.astype(jnp.int32) for a in (group, tile, row_lo, row_hi))


def _tile_group_ranges(starts, ends, block_rows: int, num_row_tiles: int):
    """The "tiles" schedule: first and last group overlapping each row tile, [row_tiles] each."""
    tile_start = jnp.arange(num_row_tiles, dtype=jnp.int32) * block_rows
    first = jnp.searchsorted(ends, tile_start, side="right")
    last = jnp.searchsorted(starts, tile_start + block_rows, side="left") - 1
    return first.astype(jnp.int32), last.astype(jnp.int32)


# ----------------------------------------------------------------------------- kernel bodies
def _dot(a: jax.Array, b: jax.Array, transpose_b: bool) -> jax.Array:
    """a [m, k] @ b [k, n] (or b [n, k] read transposed), accumulated in float32."""
    contract_b = 1 if transpose_b else 0
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _dot_lhs_transposed(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k]^T @ b [m, n] -> [k, n] in float32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _row_mask(first_row, block_rows: int, width: int, lo, hi) -> jax.Array:
    """[block_rows, width] bool: rows first_row + i inside [lo, hi)."""
    rows = first_row + jax.lax.broadcasted_iota(jnp.int32, (block_rows, width), 0)
    return (rows >= lo) & (rows < hi)


def _gmm_visits_kernel(group_ids, tile_ids, row_lo, row_hi, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                       transpose_rhs: bool, num_contract_blocks: int):
    """Grid (col block, visit, contract block); out block = this visit's row tile."""
    del group_ids  # used by the index maps only
    visit, step = pl.program_id(1), pl.program_id(2)
    block_rows, block_cols = acc_ref.shape
    lo, hi = row_lo[visit], row_hi[visit]

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo < hi)  # empty groups, tail tiles and padding visits skip the matmul
    def _():
        acc_ref[...] += _dot(lhs_ref[...], rhs_ref[...], transpose_rhs)

    @pl.when(step == num_contract_blocks - 1)
    def _():
        tile = tile_ids[visit]
        in_group = _row_mask(tile * block_rows, block_rows, block_cols, lo, hi)
        result = acc_ref[...].astype(out_ref.dtype)
        # The first visit of a tile owns the block (its old contents are garbage): rows of no
        # group become 0. Later visits of the same tile keep the rows earlier groups wrote.
        first = (visit == 0) | (tile_ids[jnp.maximum(visit - 1, 0)] != tile)

        @pl.when(first)
        def _():
            out_ref[...] = jnp.where(in_group, result, jnp.zeros_like(result))

        @pl.when(jnp.logical_not(first))
        def _():
            out_ref[...] = jnp.where(in_group, result, out_ref[...])


def _tgmm_visits_kernel(group_ids, tile_ids, row_lo, row_hi, lhs_ref, grad_ref, out_ref, acc_ref):
    """Grid (contract block, col block, visit); out block = this visit's group's [tk, tn] tile."""
    visit, num_visits = pl.program_id(2), pl.num_programs(2)
    block_rows = lhs_ref.shape[0]
    group, lo, hi = group_ids[visit], row_lo[visit], row_hi[visit]

    @pl.when((visit == 0) | (group_ids[jnp.maximum(visit - 1, 0)] != group))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo < hi)
    def _():
        first_row = tile_ids[visit] * block_rows
        lhs = lhs_ref[...]
        grad = grad_ref[...]
        # Rows of other groups are zeroed in both operands (0 * inf would be nan).
        lhs = jnp.where(_row_mask(first_row, block_rows, lhs.shape[1], lo, hi), lhs, jnp.zeros_like(lhs))
        grad = jnp.where(_row_mask(first_row, block_rows, grad.shape[1], lo, hi), grad,
                         jnp.zeros_like(grad))
        acc_ref[...] += _dot_lhs_transposed(lhs, grad)

    @pl.when((visit == num_visits - 1)
             | (group_ids[jnp.minimum(visit + 1, num_visits - 1)] != group))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _gmm_tiles_kernel(first_group_ref, last_group_ref, starts_ref, ends_ref, lhs_ref, rhs_ref,
                      out_ref, *, transpose_rhs: bool, num_contract_blocks: int, block_contract: int):
    """Grid (row tile, col block); loops over the groups overlapping this row tile."""
    tile, col_block = pl.program_id(0), pl.program_id(1)
    block_rows, block_cols = out_ref.shape
    first_row = tile * block_rows
    row_slice = pl.ds(pl.multiple_of(first_row, block_rows), block_rows)
    col_slice = pl.ds(pl.multiple_of(col_block * block_cols, block_cols), block_cols)

    def group_product(group):
        def contract_step(step, acc):
            k_slice = pl.ds(pl.multiple_of(step * block_contract, block_contract), block_contract)
            a = lhs_ref[row_slice, k_slice]
            b = rhs_ref[group, col_slice, k_slice] if transpose_rhs else rhs_ref[group, k_slice, col_slice]
            return acc + _dot(a, b, transpose_rhs)

        return jax.lax.fori_loop(0, num_contract_blocks, contract_step,
                                 jnp.zeros((block_rows, block_cols), jnp.float32))

    def group_step(group, out):
        lo, hi = starts_ref[group], ends_ref[group]
        # Empty groups inside the tile cost nothing (decode: most of 32 experts may be empty).
        in_group = _row_mask(first_row, block_rows, block_cols, lo, hi)
        return jax.lax.cond(lo < hi, lambda: jnp.where(in_group, group_product(group), out), lambda: out)

    out = jax.lax.fori_loop(first_group_ref[tile], last_group_ref[tile] + 1, group_step,
                            jnp.zeros((block_rows, block_cols), jnp.float32))
    out_ref[...] = out.astype(out_ref.dtype)


def _tgmm_tiles_kernel(starts_ref, ends_ref, lhs_ref, grad_ref, out_ref, *, block_rows: int):
    """Grid (group, contract block, col block); loops over the row tiles of this group."""
    group, k_block, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_contract, block_cols = out_ref.shape
    k_slice = pl.ds(pl.multiple_of(k_block * block_contract, block_contract), block_contract)
    col_slice = pl.ds(pl.multiple_of(col_block * block_cols, block_cols), block_cols)
    lo, hi = starts_ref[group], ends_ref[group]

    def tile_step(tile, acc):
        first_row = tile * block_rows
        row_slice = pl.ds(pl.multiple_of(first_row, block_rows), block_rows)
        lhs = lhs_ref[row_slice, k_slice]
        grad = grad_ref[row_slice, col_slice]
        lhs = jnp.where(_row_mask(first_row, block_rows, block_contract, lo, hi), lhs, jnp.zeros_like(lhs))
        grad = jnp.where(_row_mask(first_row, block_rows, block_cols, lo, hi), grad, jnp.zeros_like(grad))
        return acc + _dot_lhs_transposed(lhs, grad)

    last_tile = jnp.where(hi > lo, (hi - 1) // block_rows + 1, lo // block_rows)
    acc = jax.lax.fori_loop(lo // block_rows, last_tile, tile_step,
                            jnp.zeros((block_contract, block_cols), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls
def _gmm(lhs, rhs, group_sizes, backend: str, tiling: Tiling, transpose_rhs: bool) -> jax.Array:
    """lhs [rows, contract] x rhs [groups, contract, cols] ([groups, cols, contract] if
    transpose_rhs) -> [rows, cols] in lhs.dtype."""
    rows, contract = lhs.shape
    cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = _fit_blocks(tiling, backend, rows, contract, cols, lhs.dtype)
    lhs_p = _pad_to(lhs, (tm, tk))
    rhs_p = _pad_to(rhs, (tn, tk) if transpose_rhs else (tk, tn))
    num_row_tiles, num_k = lhs_p.shape[0] // tm, lhs_p.shape[1] // tk
    num_col_blocks = _round_up(cols, tn) // tn
    out_shape = jax.ShapeDtypeStruct((num_row_tiles * tm, num_col_blocks * tn), lhs.dtype)
    options = call_options(backend, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
                           dimension_semantics=("parallel", "arbitrary", "arbitrary"))

    if tiling.schedule == "visits":
        metadata = _visit_metadata(group_sizes, rows, tm, num_row_tiles)
        rhs_block = (pl.squeezed, tn, tk) if transpose_rhs else (pl.squeezed, tk, tn)

        def rhs_index(n, v, k, groups, *_):
            return (groups[v], n, k) if transpose_rhs else (groups[v], k, n)

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_col_blocks, metadata[0].shape[0], num_k),
            in_specs=[pl.BlockSpec((tm, tk), lambda n, v, k, groups, tiles, *_: (tiles[v], k)),
                      pl.BlockSpec(rhs_block, rhs_index)],
            out_specs=pl.BlockSpec((tm, tn), lambda n, v, k, groups, tiles, *_: (tiles[v], n)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)])
        kernel = functools.partial(_gmm_visits_kernel, transpose_rhs=transpose_rhs,
                                   num_contract_blocks=num_k)
        out = pl.pallas_call(kernel, out_shape=out_shape, grid_spec=grid_spec, **options)(
            *metadata, lhs_p, rhs_p)
    else:
        starts, ends = _group_offsets(group_sizes, rows)
        first_group, last_group = _tile_group_ranges(starts, ends, tm, num_row_tiles)
        kernel = functools.partial(_gmm_tiles_kernel, transpose_rhs=transpose_rhs,
                                   num_contract_blocks=num_k, block_contract=tk)
        whole = pl.BlockSpec()  # whole array: the kernel slices lhs/rhs itself
        out = pl.pallas_call(
            kernel, out_shape=out_shape, grid=(num_row_tiles, num_col_blocks),
            in_specs=[whole] * 6, out_specs=pl.BlockSpec((tm, tn), lambda m, n: (m, n)),
            **options)(first_group, last_group, starts, ends, lhs_p, rhs_p)
    return out[:rows, :cols]


def _tgmm(lhs, grad, group_sizes, backend: str, tiling: Tiling) -> jax.Array:
    """Per group lhs_g^T @ grad_g: lhs [rows, contract], grad [rows, cols] -> [groups, contract, cols]."""
    rows, contract = lhs.shape
    cols = grad.shape[1]
    num_groups = group_sizes.shape[0]
    tm, tk, tn = _fit_blocks(tiling, backend, rows, contract, cols, lhs.dtype)
    lhs_p, grad_p = _pad_to(lhs, (tm, tk)), _pad_to(grad, (tm, tn))
    num_row_tiles, num_k = lhs_p.shape[0] // tm, lhs_p.shape[1] // tk
    num_col_blocks = grad_p.shape[1] // tn
    out_shape = jax.ShapeDtypeStruct((num_groups, num_k * tk, num_col_blocks * tn), lhs.dtype)
    options = call_options(backend, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
                           dimension_semantics=("parallel", "parallel", "arbitrary"))

    if tiling.schedule == "visits":
        metadata = _visit_metadata(group_sizes, rows, tm, num_row_tiles)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_k, num_col_blocks, metadata[0].shape[0]),
            in_specs=[pl.BlockSpec((tm, tk), lambda k, n, v, groups, tiles, *_: (tiles[v], k)),
                      pl.BlockSpec((tm, tn), lambda k, n, v, groups, tiles, *_: (tiles[v], n))],
            out_specs=pl.BlockSpec((pl.squeezed, tk, tn), lambda k, n, v, groups, *_: (groups[v], k, n)),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)])
        out = pl.pallas_call(_tgmm_visits_kernel, out_shape=out_shape, grid_spec=grid_spec, **options)(
            *metadata, lhs_p, grad_p)
    else:
        starts, ends = _group_offsets(group_sizes, rows)
        whole = pl.BlockSpec()
        out = pl.pallas_call(
            functools.partial(_tgmm_tiles_kernel, block_rows=tm), out_shape=out_shape,
            grid=(num_groups, num_k, num_col_blocks), in_specs=[whole] * 4,
            out_specs=pl.BlockSpec((pl.squeezed, tk, tn), lambda g, k, n: (g, k, n)),
            **options)(starts, ends, lhs_p, grad_p)
    return out[:, :contract, :cols]


# ----------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(lhs, rhs, group_sizes, backend, tiling):
    return _gmm(lhs, rhs, group_sizes, backend, tiling, transpose_rhs=False)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, backend, tiling):
    return _gmm(lhs, rhs, group_sizes, backend, tiling, transpose_rhs=False), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(backend, tiling, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)
    d_lhs = _gmm(d_out, rhs, group_sizes, backend, tiling, transpose_rhs=True)
    d_rhs = _tgmm(lhs, d_out, group_sizes, backend, tiling)
    return d_lhs, d_rhs, None  # group_sizes is integer: no cotangent


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
_grouped_matmul_jit = jax.jit(_grouped_matmul, static_argnums=(3, 4))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str | None = None,
                   tiling: Tiling | None = None) -> jax.Array:
    """Rows of lhs sorted by group; group g's rows multiply rhs[g]. Differentiable in lhs and rhs.

    lhs [rows, contract]; rhs [groups, contract, cols]; group_sizes [groups] int, sum <= rows.
    Returns [rows, cols] in lhs.dtype (float32 accumulation); rows past sum(group_sizes) are 0.
    backend: "interpret" | "triton" | "mosaic_tpu" | None (from the default device).
    """
    backend = resolve_backend(backend)
    tiling = DEFAULT_TILINGS[backend] if tiling is None else tiling
    _check_inputs(lhs, rhs, group_sizes)
    _check_tiling(tiling, backend)
    return _grouped_matmul_jit(lhs, rhs, group_sizes.astype(jnp.int32), backend, tiling)


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The same contract through jax.lax.ragged_dot."""
    _check_inputs(lhs, rhs, group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


# ----------------------------------------------------------------------------- MoE experts
def _swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(gate) * up; limit > 0 clamps gate to <= limit and up to [-limit, limit] first (the
    same contract as glm5_jax.model.layers.swiglu, which this package may not import)."""
    if limit:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def routed_experts_pallas(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                          up_proj: jax.Array, down_proj: jax.Array, *, backend: str | None = None,
                          tiling: Tiling | None = None, swiglu_limit: float = 0.0) -> jax.Array:
    """glm5_jax.model.moe.routed_experts_ragged with the Pallas grouped matmul.

    x [T, D]; weights [T, K] float; experts [T, K] int; gate/up [E, D, F]; down [E, F, D].
    Returns [T, D] in x.dtype: sum_k weights[t, k] * down(silu(g) * u) of expert k, with
    g = gate(x_t), u = up(x_t), first clamped (g <= L, |u| <= L) when swiglu_limit L > 0 (static).
    """
    if swiglu_limit < 0:
        raise ValueError(f"swiglu_limit must be >= 0 (0 = no clamp), got {swiglu_limit}")
    if x.ndim != 2 or weights.shape != experts.shape or experts.shape[:1] != x.shape[:1]:
        raise ValueError(f"need x [T, D], weights/experts [T, K]; got {x.shape}, {weights.shape}, "
                         f"{experts.shape}")
    num_experts, hidden, inner = gate_proj.shape
    if (hidden != x.shape[1] or up_proj.shape != gate_proj.shape
            or down_proj.shape != (num_experts, inner, hidden)):
        raise ValueError(f"expert weights must be gate/up [E, D, F], down [E, F, D] with D={x.shape[1]}; "
                         f"got {gate_proj.shape}, {up_proj.shape}, {down_proj.shape}")
    num_tokens, top_k = experts.shape
    dtype = x.dtype
    matmul = functools.partial(grouped_matmul, backend=backend, tiling=tiling)
    flat_experts = experts.reshape(-1)  # [T*K]
    order = jnp.argsort(flat_experts, stable=True)
    token_of_row = order // top_k  # [T*K] source token of each sorted row
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    rows = x[token_of_row]  # [T*K, D]
    gate = matmul(rows, gate_proj.astype(dtype), group_sizes)  # [T*K, F]
    up = matmul(rows, up_proj.astype(dtype), group_sizes)
    out = matmul(_swiglu(gate, up, swiglu_limit), down_proj.astype(dtype), group_sizes)  # [T*K, D]
    out = out * weights.reshape(-1)[order][:, None].astype(dtype)
    return jnp.zeros((num_tokens, hidden), dtype).at[token_of_row].add(out)


# ----------------------------------------------------------------------------- benchmarks
def _random_problem(key, rows: int, contract: int, cols: int, groups: int, dtype):
    """lhs, rhs scaled so outputs are O(1); group sizes from uniform random expert choices."""
    k_lhs, k_rhs, k_groups = jax.random.split(key, 3)
    lhs = jax.random.normal(k_lhs, (rows, contract), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(k_rhs, (groups, contract, cols), jnp.float32) / contract ** 0.5).astype(dtype)
    choice = jax.random.randint(k_groups, (rows,), 0, groups)
    return lhs, rhs, jnp.bincount(choice, length=groups).astype(jnp.int32)


def _forward_backward(matmul):
    """(lhs, rhs, sizes) -> (out, d_lhs, d_rhs) for the cotangent ones."""
    def run(lhs, rhs, group_sizes):
        out, vjp = jax.vjp(lambda a, b: matmul(a, b, group_sizes), lhs, rhs)
        return (out, *vjp(jnp.ones_like(out)))
    return run


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """GLM-5 expert matmuls (D=6144, F=2048, bf16): gate/up [rows, D] x [E, D, F] and down
    [rows, F] x [E, F, D], forward and forward+backward. small: tiny shapes for the interpreter."""
    if small:
        problems = [("gmm small", 96, 128, 64, 4)]
        dtype = jnp.float32
    else:
        problems = [("gmm gate/up E=8", 4096, 6144, 2048, 8),
                    ("gmm gate/up E=32", 16384, 6144, 2048, 32),
                    ("gmm down E=32", 16384, 2048, 6144, 32)]
        dtype = jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize
    cases = []
    for name, rows, contract, cols, groups in problems:
        make = functools.partial(_random_problem, rows=rows, contract=contract, cols=cols,
                                 groups=groups, dtype=dtype)
        flops = 2.0 * rows * contract * cols
        bytes_moved = (rows * contract + groups * contract * cols + rows * cols) * itemsize
        shape = f" [{rows},{contract}]x[{groups},{contract},{cols}]"
        # bf16: one output rounding (2^-9) on O(1) outputs; float32 differs by summation order only.
        tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == jnp.bfloat16 else dict(atol=1e-3, rtol=1e-3)
        cases.append(KernelCase(name + shape + " fwd", make, grouped_matmul_reference, grouped_matmul,
                                flops, bytes_moved, **tolerance))
        cases.append(KernelCase(name + shape + " fwd+bwd", make, _forward_backward(grouped_matmul_reference),
                                _forward_backward(grouped_matmul), 3 * flops, 3 * bytes_moved, **tolerance))
    return cases
