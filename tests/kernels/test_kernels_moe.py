"""MoE grouped-matmul Pallas kernel: interpreter results and gradients vs lax.ragged_dot for both
schedules, the visit metadata, Triton/Mosaic lowering, input errors, and the tiny model with
moe_impl="pallas" vs "blocked".

One operand shape per dtype and schedule (group sizes are traced), so each kernel compiles once
and the group-size patterns reuse it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import random_params

import glm5_jax
from glm5_jax.model.options import ExecutionOptions
from kernels_pallas.common import CUSTOM_CALL_MARKERS, lower_as_text
from kernels_pallas.moe_grouped_matmul import (
    Tiling,
    _visit_metadata,
    grouped_matmul,
    grouped_matmul_reference,
    routed_experts_pallas,
)

# rows=60 with 16-row tiles: 4 row tiles, the last one partly padding; contract 24 and cols 40
# are padded to 16-multiples too. Patterns: an empty group and a group over two tiles with unused
# tail rows; one group holding every row; tile-aligned groups; all empty; tiny groups around a
# big one.
ROWS, CONTRACT, COLS, GROUPS = 60, 24, 40, 4
GROUP_SIZES = {"empty+big+tail": [5, 0, 40, 3], "one group": [0, 0, 60, 0],
               "aligned": [16, 16, 16, 12], "all empty": [0, 0, 0, 0], "small+big": [1, 30, 1, 1]}
# Per-dtype tolerances vs the float32 reference on the same (rounded) inputs: float32 differs
# only by summation order; bfloat16 adds one output rounding (2^-9 relative) and bf16 gradients.
TOLERANCES = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=3e-2, rtol=2e-2)}
SCHEDULES = ("visits", "tiles")


def _operands(dtype):
    k_lhs, k_rhs, k_cot = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k_lhs, (ROWS, CONTRACT), jnp.float32).astype(dtype)
    rhs = jax.random.normal(k_rhs, (GROUPS, CONTRACT, COLS), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(k_cot, (ROWS, COLS), jnp.float32).astype(dtype)
    return lhs, rhs, cotangent


def _value_and_grads(matmul, lhs, rhs, group_sizes, cotangent):
    """(out, d lhs, d rhs) of sum(out * cotangent)."""
    out, vjp = jax.vjp(lambda a, b: matmul(a, b, group_sizes), lhs, rhs)
    return (out, *vjp(cotangent))


@functools.cache
def _kernel_fn(schedule: str):
    matmul = functools.partial(grouped_matmul, backend="interpret", tiling=Tiling(16, 16, 16, schedule))
    return jax.jit(functools.partial(_value_and_grads, matmul))


@functools.cache
def _reference_fn():
    return jax.jit(functools.partial(_value_and_grads, grouped_matmul_reference))


def _assert_matches_reference(schedule, dtype, sizes):
    lhs, rhs, cotangent = _operands(dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = _kernel_fn(schedule)(lhs, rhs, group_sizes, cotangent)
    upcast = [a.astype(jnp.float32) for a in (lhs, rhs, cotangent)]
    expected = _reference_fn()(upcast[0], upcast[1], group_sizes, upcast[2])
    for name, g, e in zip(("out", "d_lhs", "d_rhs"), got, expected, strict=True):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), e, err_msg=f"{schedule} {name}",
                                   **TOLERANCES[dtype])
    # Rows past sum(group_sizes) are exactly zero, and so are their input gradients.
    used = int(np.sum(sizes))
    assert not np.any(np.asarray(got[0], np.float32)[used:])
    assert not np.any(np.asarray(got[1], np.float32)[used:])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pattern", list(GROUP_SIZES))
def test_interpret_matches_ragged_dot_float32(schedule, pattern):
    _assert_matches_reference(schedule, jnp.float32, GROUP_SIZES[pattern])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_interpret_matches_ragged_dot_bfloat16(schedule):
    _assert_matches_reference(schedule, jnp.bfloat16, GROUP_SIZES["empty+big+tail"])


def test_default_tiling_matches_reference():
    lhs, rhs, _ = _operands(jnp.float32)
    group_sizes = jnp.asarray(GROUP_SIZES["small+big"], jnp.int32)
    np.testing.assert_allclose(grouped_matmul(lhs, rhs, group_sizes, backend="interpret"),
                               grouped_matmul_reference(lhs, rhs, group_sizes), atol=1e-4, rtol=1e-4)


def test_visit_metadata_by_hand():
    # 40 rows in 16-row tiles (3 tiles); groups of 20, 0, 10 rows: rows 0-19, -, 20-29; tile 2
    # (rows 32-39) is tail. visits = 3 tiles + 3 groups - 1 = 5; the last is padding.
    group, tile, lo, hi = (np.asarray(a) for a in _visit_metadata(jnp.asarray([20, 0, 10]), 40, 16, 3))
    np.testing.assert_array_equal(group, [0, 0, 1, 2, 2])
    np.testing.assert_array_equal(tile, [0, 1, 1, 1, 2])
    np.testing.assert_array_equal(lo, [0, 16, 20, 20, 0])
    np.testing.assert_array_equal(hi, [16, 20, 20, 30, 0])


def test_visit_metadata_covers_each_row_once():
    groups, tile_rows, rows = 6, 8, 70
    num_tiles = -(-rows // tile_rows)
    metadata = jax.jit(functools.partial(_visit_metadata, num_rows=rows, block_rows=tile_rows,
                                         num_row_tiles=num_tiles))
    rng = np.random.default_rng(3)
    for _ in range(30):
        sizes = rng.integers(0, 3 * tile_rows, groups) * rng.integers(0, 2, groups)  # many empty
        sizes = np.minimum(sizes, np.maximum(rows - np.cumsum(sizes) + sizes, 0))  # sum <= rows
        group, tile, lo, hi = (np.asarray(a) for a in metadata(jnp.asarray(sizes, jnp.int32)))
        assert len(group) == num_tiles + groups - 1
        assert np.all(np.diff(group) >= 0) and np.all(np.diff(tile) >= 0)
        assert set(tile) == set(range(num_tiles)) and set(group) == set(range(groups))
        ends = np.cumsum(sizes)
        covered = np.zeros(rows, int)
        for g, t, a, b in zip(group, tile, lo, hi, strict=True):
            in_group = ends[g] - sizes[g] <= a < b <= ends[g]
            assert a == b or (in_group and t * tile_rows <= a < b <= (t + 1) * tile_rows)
            covered[a:b] += 1
        np.testing.assert_array_equal(covered, (np.arange(rows) < sizes.sum()).astype(int))


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_forward_and_backward_lower_to_the_platform_kernel(backend):
    shapes = (jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
              jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))

    def forward_backward(lhs, rhs, group_sizes):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, group_sizes, backend=backend), lhs, rhs)
        return out, vjp(out)

    marker = CUSTOM_CALL_MARKERS[backend]
    forward = lambda *args: grouped_matmul(*args, backend=backend)  # noqa: E731
    assert lower_as_text(forward, *shapes, backend=backend).count(marker) == 1
    # forward, d_lhs (transposed rhs) and d_rhs (transposed grouped matmul): three kernels.
    assert lower_as_text(forward_backward, *shapes, backend=backend).count(marker) == 3


def test_bad_inputs_raise_clear_errors():
    lhs, rhs, _ = _operands(jnp.float32)
    sizes = jnp.zeros((GROUPS,), jnp.int32)
    with pytest.raises(ValueError, match="contract dims"):
        grouped_matmul(lhs[:, :8], rhs, sizes, backend="interpret")
    with pytest.raises(ValueError, match="group_sizes must be"):
        grouped_matmul(lhs, rhs, sizes[:2], backend="interpret")
    with pytest.raises(ValueError, match="share one float dtype"):
        grouped_matmul(lhs.astype(jnp.bfloat16), rhs, sizes, backend="interpret")
    with pytest.raises(ValueError, match="powers of two"):
        grouped_matmul(lhs, rhs, sizes, backend="triton", tiling=Tiling(48, 64, 64, "tiles"))
    with pytest.raises(ValueError, match="schedule='visits'"):
        grouped_matmul(lhs, rhs, sizes, backend="mosaic_tpu", tiling=Tiling(128, 128, 128, "tiles"))
    with pytest.raises(ValueError, match="expert weights"):
        routed_experts_pallas(lhs, jnp.ones((ROWS, 2)), jnp.zeros((ROWS, 2), jnp.int32), rhs, rhs,
                              rhs, backend="interpret")


def test_tiny_model_pallas_equals_blocked(tiny_config):
    # Without the MTP head (its MoE layer is the same code) to halve the compile time.
    tiny_config = tiny_config.replace(num_mtp_layers=0)
    params = random_params(tiny_config, 0)
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, tiny_config.vocab_size)
    targets = jnp.roll(ids, -1, axis=1)

    def loss_and_logits(options, params):
        logits = glm5_jax.forward(tiny_config, params, ids, options=options)
        loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
        return loss, logits

    results = {}
    for impl in ("pallas", "blocked"):
        options = ExecutionOptions(moe_impl=impl)
        results[impl] = jax.jit(jax.value_and_grad(functools.partial(loss_and_logits, options),
                                                   has_aux=True))(params)
    (loss, logits), grads = results["pallas"]
    (loss_ref, logits_ref), grads_ref = results["blocked"]
    np.testing.assert_allclose(logits, logits_ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), grads, grads_ref)
    # The expert weights get nonzero gradients through the kernel's backward.
    assert any(float(jnp.abs(g).max()) > 0 for path, g in jax.tree_util.tree_leaves_with_path(grads)
               if "gate_proj" in jax.tree_util.keystr(path))
