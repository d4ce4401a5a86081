"""MLA latent decode kernel: equals its jnp reference on a paged cache with shuffled pages,
sequences of different lengths, padding queries, a chunk of queries, with and without DSA top-k
(interpret mode on CPU, compiled where a GPU/TPU is the default device); the reference equals the
model's absorbed_attention; input checks; lowering to the Triton and Mosaic custom calls.

Tolerance: float32 max abs error 1e-5 (the kernel only reorders the softmax sums).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from glm5_jax.model.mla import absorbed_attention
from kernels_pallas import mla_decode
from kernels_pallas.common import CUSTOM_CALL_MARKERS, lower_as_text
from kernels_pallas.mla_decode import gather_cache, mla_decode_attention, mla_decode_reference

# Sizes Triton also accepts (page, R, r powers of two >= 16), so the suite runs compiled on a GPU.
BATCH, QUERIES, HEADS, RANK, ROPE, PAGE, MAX_PAGES = 3, 3, 4, 32, 16, 16, 3
SCALE = 0.2


@pytest.fixture(scope="module")
def problem():
    """Pages in shuffled physical order (with unused spare pages); sequence 0 decodes a chunk of
    3 queries at 5..7, sequence 1 has a padding query (-1), sequence 2 ends mid-page at 38."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    num_pages = BATCH * MAX_PAGES + 3
    block_table = rng.permutation(num_pages)[:BATCH * MAX_PAGES].reshape(BATCH, MAX_PAGES)
    positions = np.array([[5, 6, 7], [-1, 20, 21], [36, 37, 38]])
    topk = rng.integers(-1, PAGE * MAX_PAGES, size=(BATCH, QUERIES, 6))
    topk[0, 0, :] = -1  # a query whose top-k is empty sees nothing
    return dict(q_latent=normal(BATCH, QUERIES, HEADS, RANK), q_rope=normal(BATCH, QUERIES, HEADS, ROPE),
                latent_pages=normal(num_pages, PAGE, RANK), rope_pages=normal(num_pages, PAGE, ROPE),
                block_table=jnp.asarray(block_table, jnp.int32),
                query_positions=jnp.asarray(positions, jnp.int32), topk=jnp.asarray(topk, jnp.int32))


def _run(attention, p, use_topk):
    fn = jax.jit(functools.partial(attention, scale=SCALE))
    return fn(p["q_latent"], p["q_rope"], p["latent_pages"], p["rope_pages"], p["block_table"],
              p["query_positions"], topk_positions=p["topk"] if use_topk else None)


@pytest.mark.parametrize("use_topk", [False, True], ids=["dense", "topk"])
def test_kernel_matches_reference(problem, use_topk, monkeypatch):
    # One page per split (3 splits), so the split-KV merge runs, with empty splits for short rows.
    monkeypatch.setattr(mla_decode, "MIN_PAGES_PER_SPLIT", 1)
    assert mla_decode._num_splits("interpret", BATCH * QUERIES, MAX_PAGES) == MAX_PAGES
    got, want = _run(mla_decode_attention, problem, use_topk), _run(mla_decode_reference, problem, use_topk)
    assert got.shape == (BATCH, QUERIES, HEADS, RANK) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1, 0]), 0.0)  # padding query
    assert float(jnp.std(want)) > 0.05
    if use_topk:
        np.testing.assert_array_equal(np.asarray(got[0, 0]), 0.0)  # empty top-k
        # The selection matters: restricting to top-k changes the context.
        assert float(jnp.max(jnp.abs(want - _run(mla_decode_reference, problem, False)))) > 0.1


# A CPU tool: where a GPU is the default device the same files test the compiled Triton path.
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TPU interpreter check runs on the CPU")
def test_mosaic_code_path_in_tpu_interpreter(problem, monkeypatch):
    """The TPU variant (cache left in HBM, one page DMA'd into VMEM scratch per step, scalars in
    SMEM) run by Pallas's TPU interpreter on this CPU equals the reference, with top-k."""
    tpu_interpreter = lambda backend, **_: {"interpret": pltpu.InterpretParams()}  # noqa: E731
    monkeypatch.setattr(mla_decode, "call_options", tpu_interpreter)
    got = jax.jit(functools.partial(mla_decode.mla_decode_attention, scale=SCALE, backend="mosaic_tpu"))(
        problem["q_latent"], problem["q_rope"], problem["latent_pages"], problem["rope_pages"],
        problem["block_table"], problem["query_positions"], topk_positions=problem["topk"])
    np.testing.assert_allclose(np.asarray(got), np.asarray(_run(mla_decode_reference, problem, True)),
                               atol=1e-5, rtol=1e-5)


def test_reference_matches_model_absorbed_attention(problem):
    """With q_latent = q_nope folded through the key half of kv_b_proj and the value half applied
    to the context, the reference equals mla.absorbed_attention on the gathered cache."""
    nope, value_dim = 6, 5
    rng = np.random.default_rng(1)
    kv_b_proj = jnp.asarray(rng.standard_normal((RANK, HEADS, nope + value_dim), np.float32))
    q_nope = jnp.asarray(rng.standard_normal((BATCH, QUERIES, HEADS, nope), np.float32))
    q_latent = jnp.einsum("BTNH,RNH->BTNR", q_nope, kv_b_proj[..., :nope])
    scale = (nope + ROPE) ** -0.5
    context = mla_decode_reference(q_latent, problem["q_rope"], problem["latent_pages"],
                                   problem["rope_pages"], problem["block_table"], problem["query_positions"],
                                   scale=scale)
    got = jnp.einsum("BTNR,RNH->BTNH", context, kv_b_proj[..., nope:])
    latent, k_rope = gather_cache(problem["latent_pages"], problem["rope_pages"], problem["block_table"])
    allowed = jnp.arange(latent.shape[1])[None, None, :] <= problem["query_positions"][:, :, None]
    want = absorbed_attention(q_nope, problem["q_rope"], latent, k_rope, kv_b_proj, allowed)
    real = np.asarray(problem["query_positions"]) >= 0  # absorbed_attention averages an empty row
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-4, rtol=1e-4)


def test_bad_inputs_raise_clear_errors(problem):
    p = dict(problem)
    args = lambda **kw: {**{k: p[k] for k in ("q_latent", "q_rope", "latent_pages", "rope_pages",  # noqa: E731
                                               "block_table", "query_positions")}, **kw}
    with pytest.raises(ValueError, match="latent_pages"):
        mla_decode_attention(**args(latent_pages=p["latent_pages"][..., :16]), scale=SCALE)
    with pytest.raises(ValueError, match="query_positions"):
        mla_decode_attention(**args(query_positions=p["query_positions"][:, :1]), scale=SCALE)
    with pytest.raises(ValueError, match="topk_positions"):
        mla_decode_attention(**args(), scale=SCALE, topk_positions=p["topk"][0])
    with pytest.raises(ValueError, match="page_size"):
        small_pages = args(latent_pages=p["latent_pages"][:, :8], rope_pages=p["rope_pages"][:, :8])
        mla_decode_attention(**small_pages, scale=SCALE, backend="triton")  # page of 8 < 16


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_lowers_to_custom_call(backend):
    """GLM-5 sizes per device (N=64, R=512, r=64, page 64, bf16 cache), with and without top-k."""
    sds = jax.ShapeDtypeStruct
    batch, queries, pages, max_pages = 4, 2, 40, 8
    args = (sds((batch, queries, 64, 512), jnp.bfloat16), sds((batch, queries, 64, 64), jnp.bfloat16),
            sds((pages, 64, 512), jnp.bfloat16), sds((pages, 64, 64), jnp.bfloat16),
            sds((batch, max_pages), jnp.int32), sds((batch, queries), jnp.int32))
    topk = sds((batch, queries, 128), jnp.int32)
    dense = functools.partial(mla_decode_attention, scale=SCALE, backend=backend)
    sparse = lambda *a: mla_decode_attention(*a[:-1], scale=SCALE, topk_positions=a[-1], backend=backend)  # noqa: E731
    assert CUSTOM_CALL_MARKERS[backend] in lower_as_text(dense, *args, backend=backend)
    assert CUSTOM_CALL_MARKERS[backend] in lower_as_text(sparse, *args, topk, backend=backend)
