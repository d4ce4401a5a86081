"""Ragged paged MLA kernel: equals its jnp reference on a mixed step (a decode row at a long
position, a prefill chunk starting mid-sequence and crossing a page, an empty row, padding tokens,
shuffled pages), causal and with top-k (-1 entries, an empty list), split over the page list
(interpret mode on CPU, compiled where a GPU/TPU is the default device); the block plan visits
only the pages the positions reach; the reference equals mla_decode's on decode rows; input
checks; lowering to the Triton and Mosaic custom calls.

Tolerance: float32 max abs error 1e-5 (the kernel only reorders the softmax sums).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import ragged_paged_attention as ragged
from kernels_pallas.common import CUSTOM_CALL_MARKERS, lower_as_text
from kernels_pallas.mla_decode import mla_decode_reference
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference, ragged_paged_mla_attention

# Sizes Triton also accepts (page, R, r powers of two >= 16), so the suite runs compiled on a GPU.
TOKENS, HEADS, RANK, ROPE, PAGE, MAX_PAGES, TOPK = 12, 4, 32, 16, 16, 4, 6
QUERY_BLOCK, SPLITS, MAX_ROW_LEN = 4, 3, 7
SCALE = 0.2
ARG_NAMES = ("q_latent", "q_rope", "latent_pages", "rope_pages", "block_tables", "row_starts", "row_lens",
             "query_positions")


@pytest.fixture(scope="module")
def problem():
    """Row 0 decodes one token (flat index 9) at position 57, on its 4th page; row 1 is a prefill
    chunk of 7 tokens (1..7) at positions 13..19; row 2 is unused. Tokens 0, 8, 11 are padding
    (-1) and token 10 has a position but no row: all must return 0. Pages shuffled, with spares."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    num_pages = 3 * MAX_PAGES + 2
    block_tables = rng.permutation(num_pages)[:3 * MAX_PAGES].reshape(3, MAX_PAGES)
    positions = np.full(TOKENS, -1)
    positions[9], positions[1:8], positions[10] = 57, np.arange(13, 20), 5
    topk = rng.integers(-1, PAGE * MAX_PAGES, size=(TOKENS, TOPK))
    topk[9, :3] = [3, 40, 57]  # the decode token keeps a few positions in range
    topk[2, :] = -1  # a chunk token whose top-k is empty sees nothing
    return dict(q_latent=normal(TOKENS, HEADS, RANK), q_rope=normal(TOKENS, HEADS, ROPE),
                latent_pages=normal(num_pages, PAGE, RANK), rope_pages=normal(num_pages, PAGE, ROPE),
                block_tables=jnp.asarray(block_tables, jnp.int32),
                row_starts=jnp.asarray([9, 1, 0], jnp.int32), row_lens=jnp.asarray([1, 7, 0], jnp.int32),
                query_positions=jnp.asarray(positions, jnp.int32), topk=jnp.asarray(topk, jnp.int32))


def _run(attention, p, use_topk, **options):
    fn = jax.jit(functools.partial(attention, scale=SCALE, max_row_len=MAX_ROW_LEN, **options))
    return fn(*(p[name] for name in ARG_NAMES), topk_positions=p["topk"] if use_topk else None)


@pytest.mark.parametrize("use_topk", [False, True], ids=["causal", "topk"])
def test_kernel_matches_reference(problem, use_topk):
    # 3 splits of at most 4 pages: the split merge runs, with empty splits for the short blocks.
    got = _run(ragged_paged_mla_attention, problem, use_topk, query_block=QUERY_BLOCK, num_splits=SPLITS)
    want = _run(ragged_paged_attention_reference, problem, use_topk)
    assert got.shape == (TOKENS, HEADS, RANK) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[np.array([0, 8, 10, 11])]), 0.0)  # padding, no row
    assert float(jnp.std(want[1:8])) > 0.05 and float(jnp.std(want[9])) > 0.05
    if use_topk:
        np.testing.assert_array_equal(np.asarray(got[2]), 0.0)  # empty top-k
        # The selection matters: restricting to top-k changes the context.
        assert float(jnp.max(jnp.abs(want - _run(ragged_paged_attention_reference, problem, False)))) > 0.1


def test_block_plan_follows_positions(problem):
    """Blocks: row 0's decode token, then row 1's tokens 1-4 and 5-7; two spare (empty) blocks
    fill the static bound. Pages visited: 0..57 // 16 for the decode token, 0..1 for the chunk;
    with top-k only the pages holding a selected, visible position."""
    num_blocks = ragged._num_blocks(TOKENS, 3, MAX_ROW_LEN, QUERY_BLOCK)
    assert num_blocks == 5  # min((12 + 3 * 3) // 4, 3 * ceil(7 / 4))
    args = (problem["row_starts"], problem["row_lens"], problem["query_positions"])
    options = dict(max_pages=MAX_PAGES, page_size=PAGE, query_block=QUERY_BLOCK, num_blocks=num_blocks)
    block_plan = jax.jit(functools.partial(ragged._block_plan, **options))
    plan = block_plan(*args, None)
    np.testing.assert_array_equal(plan["row"][:3], [0, 1, 1])
    np.testing.assert_array_equal(plan["tokens"][:3], [[9, 12, 12, 12], [1, 2, 3, 4], [5, 6, 7, 12]])
    np.testing.assert_array_equal(plan["page_counts"], [4, 2, 2, 0, 0])
    plan = block_plan(*args, problem["topk"])
    topk, positions = np.asarray(problem["topk"]), np.asarray(problem["query_positions"])
    for b, tokens in enumerate(np.asarray(plan["tokens"])[:3]):
        live = [t for t in tokens if t < TOKENS]
        want = sorted({int(p) // PAGE for t in live for p in topk[t] if 0 <= p <= positions[t]})
        assert list(np.asarray(plan["pages"][b, :plan["page_counts"][b]])) == want


# A CPU tool: where a GPU is the default device the same files test the compiled Triton path.
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TPU interpreter check runs on the CPU")
def test_mosaic_code_path_in_tpu_interpreter(problem, monkeypatch):
    """The TPU variant (cache in HBM, one page DMA'd into VMEM scratch per step, scalars in SMEM)
    run by Pallas's TPU interpreter on this CPU equals the reference, with top-k."""
    tpu_interpreter = lambda backend, **_: {"interpret": pltpu.InterpretParams()}  # noqa: E731
    monkeypatch.setattr(ragged, "call_options", tpu_interpreter)
    got = _run(ragged.ragged_paged_mla_attention, problem, True, query_block=QUERY_BLOCK,
               backend="mosaic_tpu")
    want = _run(ragged_paged_attention_reference, problem, True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_reference_matches_mla_decode_reference(problem):
    """One decode token per row: the ragged reference equals mla_decode's on [G, 1] queries."""
    p = problem
    positions = jnp.asarray([57, 20, 33], jnp.int32)
    tokens = jnp.asarray([4, 0, 2])  # row g's token, out of order, with padding between
    query_positions = jnp.full((TOKENS,), -1, jnp.int32).at[tokens].set(positions)
    got = jax.jit(functools.partial(ragged_paged_attention_reference, scale=SCALE))(
        p["q_latent"], p["q_rope"], p["latent_pages"], p["rope_pages"], p["block_tables"], tokens,
        jnp.ones(3, jnp.int32), query_positions)
    want = jax.jit(functools.partial(mla_decode_reference, scale=SCALE))(
        p["q_latent"][tokens][:, None], p["q_rope"][tokens][:, None], p["latent_pages"], p["rope_pages"],
        p["block_tables"], positions[:, None])
    np.testing.assert_allclose(np.asarray(got[tokens]), np.asarray(want[:, 0]), atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_clear_errors(problem):
    args = lambda **kw: {**{k: problem[k] for k in ARG_NAMES}, **kw}  # noqa: E731
    with pytest.raises(ValueError, match="latent_pages"):
        ragged_paged_mla_attention(**args(latent_pages=problem["latent_pages"][..., :16]), scale=SCALE)
    with pytest.raises(ValueError, match="row_lens"):
        ragged_paged_mla_attention(**args(row_lens=problem["row_lens"][:2]), scale=SCALE)
    with pytest.raises(ValueError, match="topk_positions"):
        ragged_paged_mla_attention(**args(), scale=SCALE, topk_positions=problem["topk"][:3])
    with pytest.raises(ValueError, match="query_block"):
        ragged_paged_mla_attention(**args(), scale=SCALE, topk_positions=problem["topk"], query_block=64)
    with pytest.raises(ValueError, match="page_size"):
        small_pages = args(latent_pages=problem["latent_pages"][:, :8],
                           rope_pages=problem["rope_pages"][:, :8])
        ragged_paged_mla_attention(**small_pages, scale=SCALE, backend="triton")  # page of 8 < 16


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_lowers_to_custom_call(backend):
    """GLM-5 sizes per device (N=64, R=512, r=64, page 64, bf16 cache; 40 tokens in 6 rows, a
    non-power-of-two max_pages), causal and with top-k, each with a multi-query block."""
    sds = jax.ShapeDtypeStruct
    tokens, rows, pages, max_pages = 40, 6, 64, 10
    args = (sds((tokens, 64, 512), jnp.bfloat16), sds((tokens, 64, 64), jnp.bfloat16),
            sds((pages, 64, 512), jnp.bfloat16), sds((pages, 64, 64), jnp.bfloat16),
            sds((rows, max_pages), jnp.int32), sds((rows,), jnp.int32), sds((rows,), jnp.int32),
            sds((tokens,), jnp.int32))
    topk = sds((tokens, 128), jnp.int32)
    options = dict(scale=SCALE, max_row_len=16, query_block=2, num_splits=2, backend=backend)
    causal = functools.partial(ragged_paged_mla_attention, **options)
    sparse = lambda *a: ragged_paged_mla_attention(*a[:-1], topk_positions=a[-1], **options)  # noqa: E731
    assert CUSTOM_CALL_MARKERS[backend] in lower_as_text(causal, *args, backend=backend)
    assert CUSTOM_CALL_MARKERS[backend] in lower_as_text(sparse, *args, topk, backend=backend)
