"""DSA kernels against their jnp references (Pallas interpret mode on CPU; the indexer compiled
where a GPU is the default device), and lowering for "cuda" (Triton) and "tpu" (Mosaic).

Tolerances: the indexer's selection is compared exactly as sets on integer-valued inputs (every
score exact, so ties and the masked-key fill are checked too); on real-valued inputs the scores
each selection picked (`selected_scores`) agree within 1e-5, since near-tied keys may swap under
a different summation order, and the gap within 1e-5. Sparse attention in float32: outputs and
gradients within 1e-5 of the largest magnitude.
"""

import ast
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import kernels_pallas
from glm5_jax.model.dsa import select_topk
from kernels_pallas import dsa_indexer, sparse_attention
from kernels_pallas.common import CUSTOM_CALL_MARKERS, lower_as_text
from kernels_pallas.dsa_indexer import (
    BlockSizes,
    indexer_topk,
    indexer_topk_reference,
    select_topk_reference,
    selected_scores,
)
from kernels_pallas.sparse_attention import sparse_attention_reference

ATTENTION_TOL = 1e-5


def packed_positions(segment_lengths):
    """Rows of packed documents -> (positions, segment ids), int32 [B, T]."""
    positions = [np.concatenate([np.arange(n) for n in row]) for row in segment_lengths]
    segments = [np.concatenate([np.full(n, i) for i, n in enumerate(row)]) for row in segment_lengths]
    return jnp.asarray(np.stack(positions), jnp.int32), jnp.asarray(np.stack(segments), jnp.int32)


def sorted_sets(indices):
    return np.sort(np.asarray(indices), axis=-1)


# ----------------------------------------------------------------------------- indexer


def random_indexer_inputs(length, heads, dim, seed=0):
    """One causal row: (queries, keys, weights, positions x2, segment ids x2), numpy-made."""
    rng = np.random.default_rng(seed)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    segments = jnp.zeros((1, length), jnp.int32)
    return (jnp.asarray(rng.normal(size=(1, length, heads, dim)), jnp.float32),
            jnp.asarray(rng.normal(size=(1, length, dim)), jnp.float32),
            jnp.asarray(rng.normal(size=(1, length, heads)) * heads**-0.5, jnp.float32),
            positions, positions, segments, segments)


def test_kernel_reference_selection_is_the_models():
    """kernels_pallas keeps its own jnp selection rule (it imports nothing from glm5_jax): it must
    equal the model's select_topk, ties, masked fill and k >= S included."""
    rng = np.random.default_rng(5)
    scores = jnp.asarray(rng.integers(-2, 3, (2, 9, 9)), jnp.float32)  # many ties
    allowed = jnp.asarray(np.tril(np.ones((9, 9), bool))[None].repeat(2, 0))
    for topk in (1, 4, 9, 12):
        kernel_rule = select_topk_reference(scores, allowed, topk)
        for ours, model in zip(kernel_rule, select_topk(scores, allowed, topk), strict=True):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(model))


def test_kernels_import_nothing_from_glm5_jax():
    """The lower floor stands alone: no kernels_pallas module imports glm5_jax."""
    for path in sorted(Path(kernels_pallas.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.split(".")[0] == "glm5_jax" for name in names), f"{path.name} imports {names}"


def test_indexer_topk_equals_reference_with_ties_packing_and_masked_fill():
    """Small-integer inputs: scores are exact, with many ties (ReLU zeros and repeats), so the
    whole selection (lowest index wins a tie; masked keys fill rows with < k allowed keys) and
    the gap must match exactly. Odd T=37 over 3 key blocks and 2 output slot chunks."""
    kq, kk, kw = jax.random.split(jax.random.key(0), 3)
    batch, length, heads, dim, topk = 2, 37, 3, 16, 20
    queries = jax.random.randint(kq, (batch, length, heads, dim), -2, 3).astype(jnp.float32)
    keys = jax.random.randint(kk, (batch, length, dim), -2, 3).astype(jnp.float32)
    weights = jax.random.randint(kw, (batch, length, heads), -1, 3).astype(jnp.float32)
    positions, segments = packed_positions([[37], [11, 20, 6]])
    args = (queries, keys, weights, positions, positions, segments, segments)
    ref_indices, ref_gap = indexer_topk_reference(*args, topk=topk)
    indices, gap = indexer_topk(*args, topk=topk, block_sizes=BlockSizes(16, 16, 16))
    assert indices.shape == (batch, length, topk) and indices.dtype == jnp.int32
    np.testing.assert_array_equal(sorted_sets(indices), sorted_sets(ref_indices))
    np.testing.assert_array_equal(np.asarray(gap), np.asarray(ref_gap))
    assert np.any(np.asarray(ref_gap) == 0) and np.any(np.isinf(np.asarray(ref_gap)))  # ties and fills seen
    assert np.all(np.diff(np.asarray(indices), axis=-1) > 0)  # key order, no repeats
    # The reference in query chunks (as the 32K benchmark runs it) is the same function.
    chunked = indexer_topk_reference(*args, topk=topk, query_chunk=16)
    for whole, part in zip((ref_indices, ref_gap), chunked, strict=True):
        np.testing.assert_array_equal(np.asarray(part), np.asarray(whole))


def test_indexer_topk_selects_the_reference_scores_real_valued():
    """Real-valued inputs, k < S: T = S = 96 over 6 key blocks and 2 output slot chunks (the
    emission visits only the chunks a key block fills), packed documents in row 1 (early queries
    of each document fill with masked keys, some from skipped blocks). The selected scores
    (`selected_scores`, the benchmark's check) and the gap agree within 1e-5; the sets agree
    wherever the boundary gap is clear of rounding."""
    args = list(random_indexer_inputs(96, heads=4, dim=32, seed=2))
    rows = [random_indexer_inputs(96, heads=4, dim=32, seed=3)[i] for i in range(3)]
    args[:3] = [jnp.concatenate([a, b]) for a, b in zip(args[:3], rows, strict=True)]
    positions, segments = packed_positions([[96], [30, 50, 16]])
    args[3:] = [positions, positions, segments, segments]
    ref_indices, ref_gap = indexer_topk_reference(*args, topk=24)
    indices, gap = indexer_topk(*args, topk=24, block_sizes=BlockSizes(16, 16, 16))
    np.testing.assert_allclose(np.asarray(selected_scores(*args, indices)),
                               np.asarray(selected_scores(*args, ref_indices)), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gap), np.asarray(ref_gap), rtol=0, atol=1e-5)
    clear = np.asarray(ref_gap) > 1e-5
    assert clear.mean() > 0.8
    np.testing.assert_array_equal(sorted_sets(indices)[clear], sorted_sets(ref_indices)[clear])
    assert np.all(np.diff(np.asarray(indices), axis=-1) > 0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TPU interpreter check runs on the CPU")
def test_indexer_mosaic_path_in_tpu_interpreter(monkeypatch):
    """The Mosaic variant (SMEM loop bounds, every slot chunk visited per key block) run by
    Pallas's TPU interpreter equals the reference on integer-valued inputs with ties and fill."""
    kq, kk, kw = jax.random.split(jax.random.key(1), 3)
    length, topk = 40, 20
    positions, segments = packed_positions([[25, 15]])
    args = (jax.random.randint(kq, (1, length, 2, 16), -2, 3).astype(jnp.float32),
            jax.random.randint(kk, (1, length, 16), -2, 3).astype(jnp.float32),
            jax.random.randint(kw, (1, length, 2), -1, 3).astype(jnp.float32),
            positions, positions, segments, segments)
    tpu_interpreter = lambda backend, **_: {"interpret": pltpu.InterpretParams()}  # noqa: E731
    monkeypatch.setattr(dsa_indexer, "call_options", tpu_interpreter)
    indices, gap = indexer_topk(*args, topk=topk, backend="mosaic_tpu", block_sizes=BlockSizes(16, 16, 16))
    ref_indices, ref_gap = indexer_topk_reference(*args, topk=topk)
    np.testing.assert_array_equal(sorted_sets(indices), sorted_sets(ref_indices))
    np.testing.assert_array_equal(np.asarray(gap), np.asarray(ref_gap))


def test_indexer_topk_equals_reference_real_valued_k_at_least_s():
    """topk > S: k = S, every key selected (masked ones as fill), gap +inf. (Real-valued k < S is
    covered through the model in tests/model/test_kernel_switch.py.)"""
    length, topk = 9, 20
    args = random_indexer_inputs(length, heads=4, dim=32)
    ref_indices, ref_gap = indexer_topk_reference(*args, topk=topk)
    indices, gap = indexer_topk(*args, topk=topk)
    assert indices.shape == ref_indices.shape == (1, length, min(topk, length))
    clear = np.asarray(ref_gap) > 1e-5
    assert clear.mean() > 0.8
    np.testing.assert_array_equal(sorted_sets(indices)[clear], sorted_sets(ref_indices)[clear])
    finite = np.isfinite(np.asarray(ref_gap))
    np.testing.assert_array_equal(np.isfinite(np.asarray(gap)), finite)
    np.testing.assert_allclose(np.asarray(gap)[finite], np.asarray(ref_gap)[finite], atol=1e-6)


def test_indexer_topk_rejects_bad_input():
    args = random_indexer_inputs(8, heads=2, dim=16)
    with pytest.raises(ValueError, match="weights"):
        indexer_topk(args[0], args[1], args[2][:, :, :1], *args[3:], topk=4)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(*args, topk=0)
    with pytest.raises(ValueError, match="block_k"):
        indexer_topk(*args, topk=4, block_sizes=BlockSizes(16, 24, 16))


# ----------------------------------------------------------------------------- sparse attention


@pytest.fixture(scope="module")
def attention_case():
    """Odd T=11, two packed documents in row 1, K=6 with invalid entries: -1, out of range, a
    future key, a key of another document; query (1, 0)'s list holds no allowed key at all."""
    batch, length, heads, rank, rope_dim, topk = 2, 11, 4, 32, 16, 6
    rng = np.random.default_rng(3)
    args = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in (
        (batch, length, heads, rank), (batch, length, heads, rope_dim), (batch, length, rank),
        (batch, length, rope_dim))]
    positions, segments = packed_positions([[11], [5, 6]])
    # Distinct random earlier-or-equal keys, padded with -1 when fewer than K exist.
    indices = np.stack([np.stack([np.concatenate([rng.permutation(t + 1), -np.ones(topk, int)])[:topk]
                                  for t in range(length)]) for _ in range(batch)])
    indices[0, 7, :2] = [-1, 99]
    indices[0, 4, 0] = 9  # future key
    indices[1, 8, 0] = 2  # other document
    indices[1, 0, :] = [5, 6, 7, -1, 200, 8]  # nothing allowed -> output 0
    args[4:] = [jnp.asarray(indices), positions, positions, segments, segments]
    return tuple(args)


def _close(actual, expected, what):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0,
                               atol=ATTENTION_TOL * max(np.abs(expected).max(), 1e-6), err_msg=what)


def test_sparse_attention_reference_equals_dense_masked_attention(attention_case):
    """The gathered formulation equals softmax over all S keys with the selected & causal &
    same-document mask (the model's dense formulation)."""
    ql, qr, lat, kr, idx, qpos, kpos, qseg, kseg = attention_case
    scale = 0.2
    clipped, allowed = sparse_attention.selected_allowed(idx, qpos, kpos, qseg, kseg)
    dense_allowed = jnp.zeros((2, 11, 11), bool)
    dense_allowed = jax.vmap(jax.vmap(lambda row, i, a: row.at[i].max(a)))(dense_allowed, clipped, allowed)
    logits = (jnp.einsum("BTNR,BSR->BNTS", ql, lat) + jnp.einsum("BTNH,BSH->BNTS", qr, kr)) * scale
    logits = jnp.where(dense_allowed[:, None], logits, -jnp.inf)
    probs = jnp.nan_to_num(jax.nn.softmax(logits, axis=-1))  # no allowed key -> 0
    dense = jnp.einsum("BNTS,BSR->BTNR", probs, lat)
    out = sparse_attention_reference(*attention_case, scale=scale)
    _close(out, dense, "reference vs dense")
    assert np.all(np.asarray(out)[1, 0] == 0)


def test_sparse_attention_forward_and_gradients_equal_reference(attention_case):
    scale = 0.2
    kernel = functools.partial(sparse_attention.sparse_attention, scale=scale, backend="interpret",
                               block_k=16)
    reference = functools.partial(sparse_attention_reference, scale=scale)
    _close(kernel(*attention_case), reference(*attention_case), "forward")
    d_out = jax.random.normal(jax.random.key(5), attention_case[0].shape)

    def grads(fn):
        return jax.grad(lambda *x: jnp.sum(fn(*x, *attention_case[4:]) * d_out), argnums=(0, 1, 2, 3))(
            *attention_case[:4])

    for name, got, want in zip(("q_latent", "q_rope", "latent", "k_rope"), grads(kernel), grads(reference),
                               strict=True):
        _close(got, want, f"d {name}")


def test_sparse_attention_tpu_row_path_in_interpret_mode(attention_case):
    """The Mosaic code path (scalar-prefetched indices, one gathered row per grid step) run by the
    interpreter: same output and log-sum-exp as the gather path."""
    plan = sparse_attention._Plan("interpret", 0.2, 16)
    rows_out, rows_lse = sparse_attention._forward_rows(plan, *attention_case)
    gather_out, gather_lse = sparse_attention._forward_gather(plan, *attention_case)
    _close(rows_out, sparse_attention_reference(*attention_case, scale=0.2), "row path")
    np.testing.assert_allclose(np.asarray(rows_lse), np.asarray(gather_lse), rtol=0, atol=1e-5)


def test_sparse_attention_rejects_bad_input(attention_case):
    ql, qr, lat, kr, idx, *rest = attention_case
    with pytest.raises(ValueError, match="latent"):
        sparse_attention.sparse_attention(ql, qr, lat[..., :8], kr, idx, *rest)
    with pytest.raises(ValueError, match="indices"):
        sparse_attention.sparse_attention(ql, qr, lat, kr, idx.astype(jnp.float32), *rest)
    with pytest.raises(ValueError, match="block_k"):
        sparse_attention.sparse_attention(ql, qr, lat, kr, idx, *rest, block_k=24)


# ----------------------------------------------------------------------------- lowering


def _specs(arrays):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_indexer_lowers(backend):
    args = _specs(dsa_indexer._make_inputs(1, 40, 4, 32, jnp.bfloat16)(jax.random.key(0)))
    text = lower_as_text(lambda *a: indexer_topk(*a, topk=8, backend=backend), *args, backend=backend)
    assert CUSTOM_CALL_MARKERS[backend] in text


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_sparse_attention_forward_and_backward_lower(backend):
    args = _specs(sparse_attention._make_inputs(1, 24, 16, 64, 16, 16, jnp.bfloat16)(jax.random.key(0)))

    def loss(*a):
        out = sparse_attention.sparse_attention(*a, backend=backend)
        return jnp.sum(out.astype(jnp.float32))

    forward = lower_as_text(loss, *args, backend=backend)
    training = lower_as_text(jax.grad(loss, argnums=(0, 1, 2, 3)), *args, backend=backend)
    marker = CUSTOM_CALL_MARKERS[backend]
    assert marker in forward
    # Triton: the forward kernel (residuals) and the atomic-add backward kernel; Mosaic: the forward
    # kernel, then the reference's XLA vjp.
    assert training.count(marker) >= (2 if backend == "triton" else 1)
