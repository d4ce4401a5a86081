"""Weight-only FP8 block-scaled matmul in Pallas: activations times a float8_e4m3fn weight with a
float32 scale per 128x128 block, the weight dequantized tile by tile inside the kernel.

    out[r, c] = sum_k scales[k, c // 128] * sum_{i in contraction block k} x[r, i] * values[i, c]

Each 128-deep slice of a weight tile is upcast (exactly: every E4M3 value is a bfloat16) to x's
dtype, multiplied with float32 accumulation and scaled by its block scale on the way into the
float32 accumulator, so only fp8 values and block scales are read and the float weight never
exists. With `group_ids` the op is batched over a stack of matrices: batch b multiplies x[b] by
matrix group_ids[b] (an MoE reads its chosen experts straight from the expert stack, no
gathered copy).

Shapes (spelled out; the model's einsum letters are not used here): x [rows, contract] or
[batch, rows, contract]; values [contract, cols] or [groups, contract, cols]; scales
[ceil(contract / 128), ceil(cols / 128)] (with the groups axis when values has it); group_ids
[batch] int. Result [rows, cols] or [batch, rows, cols].

Schedules:
- "grid" (Mosaic, and the interpreter): grid (batch, row blocks, col blocks, contraction blocks);
  Pallas DMAs each [block_contract, block_cols] fp8 tile (the group's, via scalar prefetch of
  group_ids) and the tile's block scales (SMEM); a float32 VMEM accumulator runs along the
  "arbitrary" contraction axis.
- "loop" (Triton, whose programs run in parallel and cannot accumulate across the grid): grid
  (batch, row blocks, col blocks); each program loops over 128-deep contraction steps with
  masked tile loads, one block scale per step (block_cols divides 128).
Both run in the interpreter, so the CPU tests check both.

Edges: x is zero-padded to the block grid (activations: cheap); the weight is never padded or
copied. Contraction rows past the weight's end are masked to zero in the kernel (their memory is
undefined); columns past its end only feed output columns that are cut off.
Serving only: no gradient is defined.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import KernelCase, call_options, resolve_backend
from kernels_pallas.flash_attention import dot_nn, round_up, scalar_spec

__all__ = ["Tiling", "DEFAULT_TILINGS", "fp8_matmul", "fp8_matmul_reference", "benchmark_cases"]

BLOCK = 128  # the weight's scale block, both axes (glm5_jax.quant.formats.FP8_BLOCK)
SCHEDULES = ("grid", "loop")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Block sizes (rows x contraction x cols) and schedule; shrunk to fit small operands.
    The "loop" schedule steps through the contraction 128 deep whatever block_contract says."""

    block_rows: int
    block_contract: int
    block_cols: int
    schedule: str
    num_warps: int = 4  # Triton only
    num_stages: int = 3  # Triton only


# Decode multiplies few rows by a large weight: the tiles are sized for the weight stream.
# Triton: tl.dot wants powers of two >= 16, and a column block within one scale block (<= 128);
# narrow column blocks give more programs to the GPU's SMs. Mosaic: fp8 tiles of 512 x 512
# (256 KiB) amortise the ~0.35 us per grid step; rows a multiple of 16 (bf16 packing).
DEFAULT_TILINGS = {
    "interpret": Tiling(16, 256, 256, "grid"),
    "triton": Tiling(16, 128, 64, "loop"),
    "mosaic_tpu": Tiling(16, 512, 512, "grid"),
}


# ----------------------------------------------------------------------------- checks and tiling
def _check_inputs(x, values, scales, group_ids) -> None:
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be [rows, contract] or [batch, rows, contract], got shape {x.shape}")
    if values.ndim != x.ndim:
        raise ValueError(f"values must be [contract, cols] for a 2-D x and [groups, contract, cols] for "
                         f"a 3-D x; got x {x.shape}, values {values.shape}")
    if values.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"values must be float8_e4m3fn, got {values.dtype}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be floating point, got {x.dtype}")
    contract, cols = values.shape[-2:]
    if x.shape[-1] != contract:
        raise ValueError(f"contract dims differ: x {x.shape} vs values {values.shape}")
    want = values.shape[:-2] + (-(-contract // BLOCK), -(-cols // BLOCK))
    if scales.shape != want or scales.dtype != jnp.float32:
        raise ValueError(f"scales must be float32 {want} (one per {BLOCK}x{BLOCK} block), got "
                         f"{scales.dtype} {scales.shape}")
    if min(x.shape) == 0 or min(values.shape) == 0:
        raise ValueError(f"empty operands are not supported: x {x.shape}, values {values.shape}")
    if group_ids is not None:
        if x.ndim != 3 or group_ids.shape != x.shape[:1]:
            raise ValueError(f"group_ids must be [batch]=({x.shape[0]},) with a 3-D x, got "
                             f"{group_ids.shape} for x {x.shape}")
        if not jnp.issubdtype(group_ids.dtype, jnp.integer):
            raise ValueError(f"group_ids must be integers, got {group_ids.dtype}")
    elif x.ndim == 3 and values.shape[0] != x.shape[0]:
        raise ValueError(f"without group_ids batch b uses matrix b: x {x.shape} needs values "
                         f"[{x.shape[0]}, ...], got {values.shape}")


def _check_tiling(tiling: Tiling, backend: str) -> None:
    if tiling.schedule not in SCHEDULES:
        raise ValueError(f"tiling.schedule must be one of {SCHEDULES}, got {tiling.schedule!r}")
    if backend == "triton" and tiling.schedule != "loop":
        raise ValueError("the Triton backend needs schedule='loop' (programs cannot accumulate across "
                         "the grid)")
    if backend == "mosaic_tpu" and tiling.schedule != "grid":
        raise ValueError("the Mosaic backend needs schedule='grid' (tiles must come from BlockSpecs)")
    blocks = (tiling.block_rows, tiling.block_contract, tiling.block_cols)
    if min(blocks) <= 0:
        raise ValueError(f"block sizes must be positive, got {blocks}")
    if tiling.schedule == "grid" and (tiling.block_contract % BLOCK or tiling.block_cols % BLOCK):
        raise ValueError(f"schedule 'grid' needs block_contract and block_cols multiples of {BLOCK}, "
                         f"got {blocks}")
    if tiling.schedule == "loop" and BLOCK % tiling.block_cols:
        raise ValueError(f"schedule 'loop' needs block_cols dividing {BLOCK} (one scale per tile), got "
                         f"{tiling.block_cols}")
    if backend == "triton" and any(b & (b - 1) or b < 16 for b in (tiling.block_rows, tiling.block_cols)):
        raise ValueError(f"Triton block sizes must be powers of two >= 16, got {blocks}")
    if backend == "mosaic_tpu" and tiling.block_rows % 8:
        raise ValueError(f"Mosaic block_rows must be a multiple of 8, got {tiling.block_rows}")


def _fit(tiling: Tiling, backend: str, rows: int, contract: int, cols: int) -> tuple[int, int, int]:
    """Blocks no larger than the (aligned) operand, so small shapes need little padding."""
    if tiling.schedule == "loop":  # powers of two, at least 16 for tl.dot
        fit = lambda block, dim: min(block, max(16, pl.next_power_of_2(dim)))  # noqa: E731
        return fit(tiling.block_rows, rows), BLOCK, fit(tiling.block_cols, cols)
    sublane = 16 if backend == "mosaic_tpu" else 8
    return (min(tiling.block_rows, round_up(rows, sublane)),
            min(tiling.block_contract, round_up(contract, BLOCK)),
            min(tiling.block_cols, round_up(cols, BLOCK)))


# ----------------------------------------------------------------------------- kernels
def _grid_kernel(group_ids, x_ref, values_ref, scales_ref, out_ref, acc_ref, *, contract: int):
    """Grid (batch, row block, col block, contraction block). x [bt, bk]; values [bk, bo] fp8;
    scales [bk / 128, bo / 128] (SMEM on Mosaic); out [bt, bo]; acc [bt, bo] float32."""
    del group_ids  # used by the index maps only
    step = pl.program_id(3)
    block_contract = values_ref.shape[0]

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    tile = values_ref[...].astype(x.dtype)  # exact: E4M3 values are bf16 / f32 values
    if contract % block_contract:  # rows past the weight's end hold undefined memory
        rows = step * block_contract + jax.lax.broadcasted_iota(jnp.int32, tile.shape, 0)
        tile = jnp.where(rows < contract, tile, jnp.zeros_like(tile))
    for i in range(block_contract // BLOCK):
        for j in range(tile.shape[1] // BLOCK):
            inner, outer = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            acc_ref[:, outer] += dot_nn(x[:, inner], tile[inner, outer]) * scales_ref[i, j]

    @pl.when(step == pl.num_programs(3) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _loop_kernel(group_ids_ref, x_ref, values_ref, scales_ref, out_ref, *, contract: int, cols: int):
    """Grid (batch, row block, col block). x [bt, contract padded] (this block's rows); values
    [groups, contract, cols], scales [groups, Kb, Ob] and group_ids [batch] whole; out [bt, bo]."""
    batch, col_block = pl.program_id(0), pl.program_id(2)
    block_cols = out_ref.shape[1]
    group = group_ids_ref[batch]
    first_col = col_block * block_cols
    col_ok = first_col + jax.lax.broadcasted_iota(jnp.int32, (1, block_cols), 1) < cols
    scale_col = first_col // BLOCK  # block_cols divides 128: one scale column per tile

    def contract_step(step, acc):
        first = pl.multiple_of(step * BLOCK, BLOCK)
        x = x_ref[:, pl.ds(first, BLOCK)]
        ok = (first + jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0) < contract) & col_ok
        # Masked-off lanes are undefined after the load: zero them after the (exact) upcast.
        tile = plgpu.load(values_ref.at[group, pl.ds(first, BLOCK), pl.ds(first_col, block_cols)], mask=ok)
        tile = jnp.where(ok, tile.astype(x.dtype), jnp.zeros((), x.dtype))
        return acc + dot_nn(x, tile) * scales_ref[group, step, scale_col]

    acc = jax.lax.fori_loop(0, pl.cdiv(contract, BLOCK), contract_step,
                            jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls
@functools.partial(jax.jit, static_argnames=("out_dtype", "backend", "tiling"))
def _fp8_matmul(x, values, scales, group_ids, *, out_dtype, backend: str, tiling: Tiling):
    """x [batch, rows, contract]; values [groups, contract, cols]; scales [groups, Kb, Ob];
    group_ids [batch] int32 -> [batch, rows, cols] in out_dtype."""
    batch, rows, contract = x.shape
    cols = values.shape[-1]
    block_rows, block_contract, block_cols = _fit(tiling, backend, rows, contract, cols)
    rows_pad, contract_pad = round_up(rows, block_rows), round_up(contract, block_contract)
    cols_pad = round_up(cols, block_cols)
    x = jnp.pad(x, ((0, 0), (0, rows_pad - rows), (0, contract_pad - contract)))
    out_shape = jax.ShapeDtypeStruct((batch, rows_pad, cols_pad), out_dtype)
    grid = (batch, rows_pad // block_rows, cols_pad // block_cols)
    options = call_options(backend, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
                           dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

    if tiling.schedule == "grid":
        # Scales regrouped per tile: [groups, Kb, Ob] -> [groups, K tiles, col tiles, bk/128, bo/128].
        sub_k, sub_n = block_contract // BLOCK, block_cols // BLOCK
        k_tiles, n_tiles = contract_pad // block_contract, grid[2]
        tiled = jnp.pad(scales, ((0, 0), (0, k_tiles * sub_k - scales.shape[1]),
                                 (0, n_tiles * sub_n - scales.shape[2])), constant_values=1.0)
        tiled = tiled.reshape(-1, k_tiles, sub_k, n_tiles, sub_n).transpose(0, 1, 3, 2, 4)
        smem = {"memory_space": pltpu.SMEM} if backend == "mosaic_tpu" else {}
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=grid + (k_tiles,),
            in_specs=[
                pl.BlockSpec((None, block_rows, block_contract), lambda b, m, n, k, ids: (b, m, k)),
                pl.BlockSpec((None, block_contract, block_cols), lambda b, m, n, k, ids: (ids[b], k, n)),
                pl.BlockSpec((None, None, None, sub_k, sub_n), lambda b, m, n, k, ids: (ids[b], k, n, 0, 0),
                             **smem),
            ],
            out_specs=pl.BlockSpec((None, block_rows, block_cols), lambda b, m, n, k, ids: (b, m, n)),
            scratch_shapes=[pltpu.VMEM((block_rows, block_cols), jnp.float32)])
        out = pl.pallas_call(functools.partial(_grid_kernel, contract=contract), out_shape=out_shape,
                             grid_spec=grid_spec, name="fp8_matmul", **options)(group_ids, x, values, tiled)
    else:
        whole = pl.BlockSpec()  # the kernel indexes the weight itself (masked loads)
        out = pl.pallas_call(
            functools.partial(_loop_kernel, contract=contract, cols=cols), out_shape=out_shape, grid=grid,
            in_specs=[scalar_spec(backend),
                      pl.BlockSpec((None, block_rows, contract_pad), lambda b, m, n: (b, m, 0)),
                      whole, whole],
            out_specs=pl.BlockSpec((None, block_rows, block_cols), lambda b, m, n: (b, m, n)),
            name="fp8_matmul", **options)(group_ids, x, values, scales)
    return out[:, :rows, :cols]


def fp8_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, group_ids: jax.Array | None = None,
               out_dtype=None, tiling: Tiling | None = None, backend: str | None = None) -> jax.Array:
    """x times an FP8 block-scaled weight, dequantized per tile in the kernel (see module doc).

    x [rows, contract] (or [batch, rows, contract]) bf16 / f32; values float8_e4m3fn [contract,
    cols] (or [groups, contract, cols]); scales float32 [ceil(contract/128), ceil(cols/128)] (with
    the groups axis); group_ids optional int [batch] (default: batch b uses matrix b).
    Returns [rows, cols] (or [batch, rows, cols]) in out_dtype (default x.dtype); float32
    accumulation. backend: "interpret" | "triton" | "mosaic_tpu" | None (from the default device).
    """
    _check_inputs(x, values, scales, group_ids)
    backend = resolve_backend(backend)
    tiling = DEFAULT_TILINGS[backend] if tiling is None else tiling
    _check_tiling(tiling, backend)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if x.ndim == 2:
        return _fp8_matmul(x[None], values[None], scales[None], jnp.zeros((1,), jnp.int32),
                           out_dtype=out_dtype, backend=backend, tiling=tiling)[0]
    ids = jnp.arange(x.shape[0], dtype=jnp.int32) if group_ids is None else group_ids.astype(jnp.int32)
    return _fp8_matmul(x, values, scales, ids, out_dtype=out_dtype, backend=backend, tiling=tiling)


def fp8_matmul_reference(x: jax.Array, values: jax.Array, scales: jax.Array, *,
                         group_ids: jax.Array | None = None, out_dtype=None, tiling: Tiling | None = None,
                         backend: str | None = None) -> jax.Array:
    """Plain jnp, same signature (tiling and backend ignored): the weight dequantized whole in
    float32 (values x block scale), then a float32 matmul."""
    del tiling, backend
    _check_inputs(x, values, scales, group_ids)
    contract, cols = values.shape[-2:]
    expanded = jnp.repeat(jnp.repeat(scales, BLOCK, axis=-2), BLOCK, axis=-1)[..., :contract, :cols]
    weight = values.astype(jnp.float32) * expanded
    if group_ids is not None:
        weight = weight[group_ids]
    out = jnp.matmul(x.astype(jnp.float32), weight, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype if out_dtype is None else out_dtype)


# ----------------------------------------------------------------------------- benchmarks
def _random_problem(key, rows: int, contract: int, cols: int, groups: int, batch: int, dtype):
    """x, then an FP8 weight (values, 128x128 block scales) quantized from normal floats, and for
    a stack, random group ids. Outputs are O(1)."""
    k_x, k_w, k_ids = jax.random.split(key, 3)
    shape = (batch, rows, contract) if groups else (rows, contract)
    x = jax.random.normal(k_x, shape, jnp.float32).astype(dtype)
    weight = jax.random.normal(k_w, (max(groups, 1), contract, cols), jnp.float32) / contract ** 0.5
    blocks = jnp.pad(weight, ((0, 0), (0, -contract % BLOCK), (0, -cols % BLOCK)))
    blocks = blocks.reshape(weight.shape[0], -1, BLOCK, blocks.shape[-1] // BLOCK, BLOCK)
    scales = jnp.max(jnp.abs(blocks), axis=(2, 4)) / 448.0  # [groups, Kb, Ob]
    expanded = jnp.repeat(jnp.repeat(scales, BLOCK, axis=1), BLOCK, axis=2)[:, :contract, :cols]
    values = (weight / expanded).astype(jnp.float8_e4m3fn)
    if not groups:
        return x, values[0], scales[0]
    return x, values, scales, jax.random.randint(k_ids, (batch,), 0, groups)


def _call(matmul):
    def run(x, values, scales, group_ids=None):
        return matmul(x, values, scales, group_ids=group_ids)
    return run


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """GLM-5 decode matmuls (bf16 activations, FP8 weights): 8 rows times q_b_proj-like
    [2048, 16384] and o_proj-like [16384, 6144], and 8 tokens x top-8 experts read by id from a
    stack of 64 [6144, 2048] expert matrices (one device's share of 256 over 4; built in float32
    first, so 3 GiB of temporaries). small: tiny float32 shapes for the interpreter."""
    if small:
        problems = [("fp8 small", 5, 200, 150, 0, 0), ("fp8 small gathered", 1, 200, 72, 4, 6)]
        dtype = jnp.float32
    else:
        problems = [("fp8 q_b", 8, 2048, 16384, 0, 0), ("fp8 o_proj", 8, 16384, 6144, 0, 0),
                    ("fp8 experts top-8", 1, 6144, 2048, 64, 64)]
        dtype = jnp.bfloat16
    cases = []
    for name, rows, contract, cols, groups, batch in problems:
        matrices = batch if groups else 1
        make = functools.partial(_random_problem, rows=rows, contract=contract, cols=cols, groups=groups,
                                 batch=batch, dtype=dtype)
        flops = 2.0 * matrices * rows * contract * cols
        weight_bytes = matrices * (contract * cols + 4 * -(-contract // BLOCK) * -(-cols // BLOCK))
        bytes_moved = weight_bytes + matrices * rows * (contract + cols) * jnp.dtype(dtype).itemsize
        tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == jnp.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        shape = f" [{rows},{contract}]x[{contract},{cols}]" + (f" x{batch} of {groups}" if groups else "")
        cases.append(KernelCase(name + shape, make, _call(fp8_matmul_reference), _call(fp8_matmul), flops,
                                bytes_moved, **tolerance))
    return cases
