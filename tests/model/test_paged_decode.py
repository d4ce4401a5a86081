"""The paged flat-batch step computes the same function as the full forward: several sequences
in scrambled pages, fed in prefill chunks and decode tokens that share steps (with padding
tokens), give forward's logits at every position; page copies to host and back are exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import perturbed_params

import glm5_jax
from glm5_jax.model.moe import InputMajorExperts
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.paged_decode import (
    StepBatch,
    init_paged_cache,
    paged_cache_bytes_per_page,
    paged_step,
    read_page,
    serving_layout,
    write_page,
)
from glm5_jax.model.transformer import sown_values

PAGE = 4
MAX_PAGES = 8  # 32 positions per sequence (a multiple of BLOCK_PAGES)
BLOCK_PAGES = 2  # several streamed blocks per row
ROWS = 3


def schedule(lengths, chunk):
    """Steps of (sequence, start, count), round-robin with at most `chunk` tokens per sequence per
    step, so prefill chunks and single decode tokens mix."""
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        step = []
        for s, n in enumerate(lengths):
            take = min(chunk[s], n - done[s])
            if take > 0:
                step.append((s, done[s], take))
                done[s] += take
        steps.append(step)
    return steps


def paged_logits(config, params, sequences, chunk, options=None, on_cpu=None):
    """Teacher-forced paged run; single tokens go to decode rows, longer runs to chunk rows (one
    padded row shape). Returns {sequence: logits [len, V]}."""
    num_pages = len(sequences) * MAX_PAGES + 1
    cache = init_paged_cache(config, num_pages, PAGE, options and options.compute_dtype, on_cpu=on_cpu)
    params = serving_layout(config, params, options)  # as the engine's runner holds them
    unrolled = (options or ExecutionOptions()).scan_unroll >= config.num_moe_layers
    assert isinstance(params["moe_layers"], tuple) == unrolled
    if options and options.moe_impl == "dense":  # the dense path reads gate and up input-major
        assert all(isinstance(layer["moe"]["gate_proj"], InputMajorExperts) for layer in params["moe_layers"])
    # Scrambled, interleaved page ownership (page 0 unused by anyone): tables must be followed.
    order = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    tables = order.reshape(len(sequences), MAX_PAGES).astype(np.int32)
    chunk_len = max(chunk)
    rows = {s: [] for s in range(len(sequences))}
    for step in schedule([len(s) for s in sequences], chunk):
        decode_tokens, decode_positions = np.zeros(ROWS, np.int32), np.full(ROWS, -1, np.int32)
        chunk_tokens = np.zeros((ROWS, chunk_len), np.int32)
        chunk_positions = np.full((ROWS, chunk_len), -1, np.int32)
        block = np.zeros((2 * ROWS, MAX_PAGES), np.int32)
        owners = []
        for r, (s, start, count) in enumerate(step):
            if count == 1:
                decode_tokens[r], decode_positions[r], block[r] = sequences[s][start], start, tables[s]
                owners += [(s, r)]
            else:
                chunk_tokens[r, :count] = sequences[s][start:start + count]
                chunk_positions[r, :count] = np.arange(start, start + count)
                block[ROWS + r] = tables[s]
                owners += [(s, ROWS + r * chunk_len + i) for i in range(count)]
        batch = StepBatch(decode_tokens, decode_positions, chunk_tokens, chunk_positions, block)
        # Every flat token's logits (one sample_rows shape, as the engine pads it: one program).
        logits, cache = paged_step(config, params, cache, batch, np.arange(ROWS * (1 + chunk_len)),
                                   options=options, block_pages=BLOCK_PAGES)
        logits = np.asarray(logits)
        for s, row in owners:
            rows[s].append(logits[row])
    return {s: np.stack(r) for s, r in rows.items()}, cache


@pytest.mark.parametrize("variant,options,chunk", [
    # Unrolled: the step runs the layers one by one on per-layer weights (serving_layout).
    (dict(attention_types=["dsa", "sliding_window", "dsa", "sliding_window"], sliding_window=5,
          indexer_types=["full", "full", "shared", "full"]),
     ExecutionOptions(scan_unroll=4, moe_impl="dense"), (8, 3, 2)),
    (dict(num_layers=2, indexer_types=["full"] * 2, attention_types=["sliding_window"] * 2,
          sliding_window=3), ExecutionOptions(moe_impl="blocked"), (3, 4, 1)),
    # The Pallas kernel (interpret mode on CPU) reading pages through the block table.
    # Two layers (one per stack, one of each kind) keep the interpreted kernel's compile short.
    (dict(num_layers=2, indexer_types=["full"] * 2, attention_types=["dsa", "sliding_window"],
          sliding_window=5), ExecutionOptions(decode_attention_impl="pallas"), (6, 2, 3)),
])
def test_paged_rows_equal_forward_rows(tiny_config, variant, options, chunk):
    config = tiny_config.replace(num_mtp_layers=0, **variant)
    params = perturbed_params(config, 3)
    rng = np.random.default_rng(4)
    # The interpreted Pallas kernel runs slowly: shorter sequences (still past index_topk 8).
    lengths = (12, 9, 10) if options and options.decode_attention_impl == "pallas" else (21, 14, 17)
    sequences = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    paged, _ = paged_logits(config, params, sequences, chunk, options)
    # One causal forward over the sequences padded to one length: row p depends on tokens <= p only.
    longest = max(len(s) for s in sequences)
    batch = np.asarray([s + [0] * (longest - len(s)) for s in sequences])
    outputs = glm5_jax.apply_model(config, params, batch, collect_intermediates=True, options=options)
    gaps = [float(np.min(v)) for _, v in sown_values(outputs["intermediates"], "selection_gap")]
    assert min(gaps) > 1e-5, f"top-k boundary tie (gap {min(gaps):.3g}); choose another seed"
    for s, sequence in enumerate(sequences):
        np.testing.assert_allclose(paged[s], np.asarray(outputs["logits"][s, :len(sequence)]), atol=1e-4,
                                   rtol=1e-4)


def test_bfloat16_pool_stored_as_float32_on_cpu_gives_the_same_logits(tiny_config):
    """A CPU stores a bfloat16 page pool as float32 (`page_storage_dtype`: XLA:CPU converted
    the whole bfloat16 pool at every gather and scatter). The values stay bfloat16 ones: the
    logits equal those over a pool stored in bfloat16, bit for bit."""
    config = tiny_config.replace(num_mtp_layers=0, num_layers=2, indexer_types=["full"] * 2,
                                 attention_types=["dsa", "sliding_window"], sliding_window=5)
    params = perturbed_params(config, 3)
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, config.vocab_size, n).tolist() for n in (13, 9, 11)]
    options = ExecutionOptions(dtype="bfloat16")
    wide, wide_cache = paged_logits(config, params, sequences, (5, 1, 3), options, on_cpu=True)
    narrow, narrow_cache = paged_logits(config, params, sequences, (5, 1, 3), options, on_cpu=False)
    assert {leaf.dtype for leaf in jax.tree.leaves(wide_cache)} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(narrow_cache)} == {jnp.dtype(jnp.bfloat16)}
    for s in range(len(sequences)):
        np.testing.assert_array_equal(wide[s], narrow[s])


def test_padding_writes_nothing_and_pages_round_trip(tiny_config):
    config = tiny_config.replace(num_mtp_layers=0)
    params = perturbed_params(config, 3)
    cache = init_paged_cache(config, 3, PAGE)
    assert cache["moe_layers"]["latent"].shape == (3 * 3, PAGE, config.kv_lora_rank)  # [L * P, page, R]
    assert paged_cache_bytes_per_page(config, PAGE) == sum(
        leaf.nbytes for leaf in jax.tree.leaves(cache)) // 3
    # One chunk row of three real tokens and five padding tokens, plus an all-padding decode row.
    chunk_tokens = np.arange(8, dtype=np.int32)[None] + 5
    chunk_positions = np.array([[0, 1, 2, -1, -1, -1, -1, -1]], np.int32)
    block = np.tile(np.array([[2, 0]], np.int32), (2, 1))
    batch = StepBatch(np.zeros(1, np.int32), np.full(1, -1, np.int32), chunk_tokens, chunk_positions, block)
    _, cache = paged_step(config, params, cache, batch, np.arange(9), block_pages=1)
    def by_layer(pool):  # [L * P, page, F] -> [L, P, page, F]
        return np.asarray(pool).reshape((-1, 3) + pool.shape[1:])

    written = by_layer(cache["moe_layers"]["latent"])
    assert np.all(written[:, :2] == 0)  # pages 0, 1 untouched (padding rows point at page 2 too)
    assert np.all(written[:, 2, 3] == 0) and np.all(np.abs(written[:, 2, :3]).sum(-1) > 0)
    saved = jax.tree.map(np.asarray, read_page(cache, 2, num_pages=3))
    cache = write_page(cache, 0, saved, num_pages=3)
    np.testing.assert_array_equal(by_layer(cache["moe_layers"]["latent"])[:, 0], written[:, 2])
    index_keys = by_layer(cache["dense_layers"]["index_keys"])
    np.testing.assert_array_equal(index_keys[:, 0], index_keys[:, 2])


def test_bad_pool_is_rejected(tiny_config):
    with pytest.raises(ValueError, match="num_pages"):
        init_paged_cache(tiny_config, 0, PAGE)


def test_a_new_attention_backend_is_one_module_and_runs_in_forward_and_serving(tiny_config):
    """The one decoder: tests/toy_attention.py (uniform causal attention) is registered by name
    and selected by the execution options; `forward` and the paged serving step both run it, and
    agree, and it is not the reference (the logits differ from the reference backend's)."""
    from toy_attention import UniformCausalAttention

    from glm5_jax.model.attention import backend_names, register_backend

    register_backend("toy_uniform", UniformCausalAttention())
    assert "toy_uniform" in backend_names()
    toy = ExecutionOptions(attention_impl="toy_uniform", decode_attention_impl="toy_uniform")
    config = tiny_config.replace(num_mtp_layers=0, num_layers=2, indexer_types=["full"] * 2,
                                 attention_types=["dsa"] * 2)
    params = perturbed_params(config, 5)
    sequences = [np.random.default_rng(6).integers(0, config.vocab_size, 11).tolist()]
    paged, _ = paged_logits(config, params, sequences, (4,), toy)
    forward = np.asarray(glm5_jax.forward(config, params, np.asarray(sequences), options=toy))[0]
    np.testing.assert_allclose(paged[0], forward, atol=1e-4, rtol=1e-4)
    reference = np.asarray(glm5_jax.forward(config, params, np.asarray(sequences)))[0]
    assert np.max(np.abs(forward - reference)) > 1e-2
