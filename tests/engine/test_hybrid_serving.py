"""The engine serves hybrid models (GLM-5.3-Flash, glm5_next: KDA linear layers, hyper-connections,
pooled DSA): greedy output equals the argmax chain of `forward` with chunked prefill, concurrent
sequences, preemption on a tiny page pool and prompts past index_topk (the pooled sparse
regime); seeded sampling is the same with and without preemption; the KDA state per sequence
does not grow with the context; prefix caching restores KDA state snapshots (prefix hits equal
`forward`, with preemption and different continuations; snapshots are freed with their pages) and
is off without snapshot slots (and says why); MTP speculation is refused.

One engine (one compilation) serves every test: 2 slots, 4-token pages, 16-token chunks, prefix
caching with 4 state snapshots."""

import asyncio

import jax
import numpy as np
import pytest
from next_models import tiny_next
from reference import greedy_chain, perturbed_params
from streams import run_together

import glm5_jax
from glm5_jax.engine.engine import HYBRID_NO_PREFIX_CACHING, Engine
from glm5_jax.engine.types import SamplingParams
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.paged_decode import (
    StepBatch,
    init_paged_cache,
    paged_cache_bytes_per_page,
    paged_step,
    serving_layout,
    state_bytes_per_sequence,
)

# One xdist worker runs this module, so its engine is compiled once.
pytestmark = pytest.mark.xdist_group("hybrid_engine")

MAX_CONTEXT = 40
PAGE = 4
# tests/next_models.py's tiny model with 2 indexer heads of 8.
CHANGES = dict(index_num_heads=2, index_head_dim=8)


@pytest.fixture(scope="module")
def model():
    config = tiny_next(**CHANGES)
    return config, perturbed_params(config, 5)


@pytest.fixture(scope="module")
def engine(model):
    config, params = model
    # 12 pages of 4 positions: one sequence of up to 40 positions fits (10 pages), two long ones
    # do not, so the later one is preempted and recomputed.
    engine = Engine(config, params, None, max_slots=2, max_context=MAX_CONTEXT, page_size=PAGE, num_pages=12,
                    token_budget=16, decode_steps=4, seed=0, state_snapshots=4)
    yield engine
    engine.shutdown()


def generate(engine, requests, with_logprobs: bool = False):
    """[(prompt, SamplingParams)] submitted together -> each one's tokens (and log-probabilities)."""
    outputs = [[(e.token_id, e.logprob) for e in events if e.token_id is not None]
               for events in run_together(engine, requests)]
    return [[pair if with_logprobs else pair[0] for pair in output] for output in outputs]


def forward_logprobs(config, params, prompt, tokens) -> np.ndarray:
    """log_softmax of `forward`'s logits at each generated token (one [1, MAX_CONTEXT] shape)."""
    ids = np.zeros((1, MAX_CONTEXT), np.int32)
    ids[0, :len(prompt) + len(tokens)] = prompt + tokens
    logits = np.asarray(jax.nn.log_softmax(glm5_jax.forward(config, params, ids)[0], axis=-1))
    return logits[np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens)), tokens]


def test_greedy_equals_forward_chunked_concurrent_preempted_sparse(model, engine):
    config, params = model
    rng = np.random.default_rng(1)
    # 21 and 30 tokens: prefill in 16-token chunks, past index_topk 8 (pooled selection), and
    # together more pages than the pool has; 3 and 1 tokens: short rows and a decode at position 0.
    prompts = [rng.integers(2, config.vocab_size, n).tolist() for n in (21, 30, 3, 1)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    preemptions = engine.preemptions
    outputs = generate(engine, [(prompt, greedy) for prompt in prompts], with_logprobs=True)
    assert engine.preemptions > preemptions  # the tiny pool forced a recomputation
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = [token for token, _ in output]
        assert tokens == greedy_chain(config.replace(eos_token_ids=[]), params, prompt, 8, length=MAX_CONTEXT)
        # Beyond the argmax: the served log-probabilities are forward's (a KDA state off by a
        # padding token's write moves them by ~1e-3 without flipping a token).
        np.testing.assert_allclose([lp for _, lp in output], forward_logprobs(config, params, prompt, tokens),
                                   atol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_step_rows_equal_forward_and_padding_rows_leave_states(model, impl):
    """The serving step itself, teacher-forced: two sequences in scrambled pages and state slots
    (prefill chunks, decode rows, both in one step; the pooled sparse regime past 8 positions)
    give forward's logits at every position, while every padding row (and each chunk row's
    padding tail) names a live sequence's state slot: padding must leave states untouched.
    "pallas": the ragged paged-attention kernel (interpreted on a CPU) on NoPE latents and
    pooled key lists."""
    config, params = model
    options = ExecutionOptions(decode_attention_impl=impl)
    rng = np.random.default_rng(3)
    sequences = [rng.integers(2, config.vocab_size, n).tolist() for n in (13, 7)]
    chunk, rows, slots = (5, 1), 2, (3, 1)  # sequence 0: 5-token chunks; 1: one token per step
    cache = init_paged_cache(config, 9, PAGE, state_slots=4)
    tables = np.asarray([[7, 2, 5, 8], [4, 1, 6, 3]], np.int32)
    layout = serving_layout(config, params)
    got, done = [[], []], [0, 0]
    while done != [len(s) for s in sequences]:
        batch = StepBatch(np.zeros(rows, np.int32), np.full(rows, -1, np.int32),
                          np.zeros((rows, 5), np.int32), np.full((rows, 5), -1, np.int32),
                          np.zeros((2 * rows, 4), np.int32),
                          np.full(2 * rows, slots[0], np.int32))  # padding rows: sequence 0's slot
        owners = []
        for s, sequence in enumerate(sequences):
            count = min(chunk[s], len(sequence) - done[s])
            if count == 0:
                continue
            start = done[s]
            if count == 1:
                row = rows - 1 - s  # decode rows in both orders over the steps
                batch.decode_tokens[row], batch.decode_positions[row] = sequence[start], start
                owners.append((s, [row]))
            else:
                row = rows + s
                batch.chunk_tokens[s, :count] = sequence[start:start + count]
                batch.chunk_positions[s, :count] = np.arange(start, start + count)
                owners.append((s, [rows + s * 5 + i for i in range(count)]))
            batch.block_tables[row], batch.state_slots[row] = tables[s], slots[s]
            done[s] += count
        logits, cache = paged_step(config, layout, cache, batch, np.arange(rows * 6), options=options,
                                   block_pages=2)
        for s, flat in owners:
            got[s].extend(np.asarray(logits)[flat])
    for s, sequence in enumerate(sequences):
        # forward_logprobs' one [1, MAX_CONTEXT] shape (causal: the padding after changes nothing),
        # so this forward is the program the engine tests already compiled.
        ids = np.zeros((1, MAX_CONTEXT), np.int32)
        ids[0, :len(sequence)] = sequence
        want = np.asarray(glm5_jax.forward(config, params, ids))[0, :len(sequence)]
        np.testing.assert_allclose(np.stack(got[s]), want, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_same_with_and_without_preemption(model, engine):
    config, _ = model
    rng = np.random.default_rng(2)
    prompt = rng.integers(2, config.vocab_size, 18).tolist()
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = generate(engine, [(prompt, sampled)])[0]
    preemptions = engine.preemptions
    other = rng.integers(2, config.vocab_size, 24).tolist()
    # Admitted second, so it is the one preempted when the other one grows.
    together = generate(engine, [(other, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)),
                                 (prompt, sampled)])[1]
    assert engine.preemptions > preemptions
    assert together == alone and len(alone) == 12


def test_state_per_sequence_does_not_grow_with_the_context(model, engine):
    config, _ = model
    states = {name: pools for name, pools in engine.runner.cache.items() if "recurrent" in pools}
    assert set(states) == {"layers_0_to_0", "layers_1_to_2"}  # the KDA stacks: state, no pages
    for name, pools in states.items():
        layers = 2 if name == "layers_1_to_2" else 1
        assert pools["conv"].shape == (layers * 2, 3, 48)  # [L * slots, K-1, 3NH]
        assert pools["recurrent"].shape == (layers * 2, 2, 8, 8)  # [L * slots, N, H, H]
    # Any context, any pool size: the same state shapes; only the pages grow.
    short, long = (jax.eval_shape(lambda n=n: init_paged_cache(config, n, PAGE, state_slots=2))
                   for n in (4, 4096))
    for name in states:
        assert jax.tree.map(lambda a: a.shape, short[name]) == jax.tree.map(lambda a: a.shape, long[name])
    assert long["layers_3_to_3"]["latent"].shape[0] == 4096
    # Per sequence: 3 layers x ((K-1) x 3NH conv values + N x H x H float32) bytes.
    assert state_bytes_per_sequence(config) == 3 * (3 * 48 * 4 + 2 * 8 * 8 * 4)
    # Per page of 4 tokens: the one MLA layer's latent, indexer key and gate logits.
    assert paged_cache_bytes_per_page(config, PAGE) == 4 * (16 + 0 + 8 + 8) * 4


def test_prefix_caching_off_without_snapshots_and_no_speculation(model, engine):
    config, params = model
    assert engine.prefix_caching_off is None and engine.scheduler.prefix_caching
    off = Engine(config, params, None, max_slots=1, max_context=MAX_CONTEXT, state_snapshots=0)
    try:
        assert off.prefix_caching_off == HYBRID_NO_PREFIX_CACHING and not off.scheduler.prefix_caching
        assert off.runner.snapshots is None and off.pages.snapshots is None
    finally:
        off.shutdown()
    with pytest.raises(ValueError, match="hybrid"):
        Engine(config, params, None, max_slots=1, max_context=MAX_CONTEXT, speculative_tokens=1)


# ----------------------------------------------------------------------------- prefix caching
# (the snapshots' bookkeeping without JAX: tests/engine/test_hybrid_prefix_cache.py)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


def generate_cached(engine, requests):
    """[(prompt, params)] together -> [(tokens, log-probabilities, cached_tokens)]."""
    results = []
    for events in run_together(engine, requests):
        tokens = [e.token_id for e in events if e.token_id is not None]
        logprobs = [e.logprob for e in events if e.token_id is not None]
        results.append((tokens, logprobs, events[-1].cached_tokens))
    return results


def check_forward(config, params, prompt, tokens, logprobs):
    assert tokens == greedy_chain(config.replace(eos_token_ids=[]), params, prompt, len(tokens),
                                  length=MAX_CONTEXT)
    np.testing.assert_allclose(logprobs, forward_logprobs(config, params, prompt, tokens), atol=2e-5)


def test_prefix_hit_restores_the_state_and_equals_forward(model, engine):
    config, params = model
    rng = np.random.default_rng(11)
    prefix = rng.integers(2, config.vocab_size, 24).tolist()  # 6 pages
    snapshots = engine.pages.snapshots
    restores = snapshots.restores
    first = prefix + rng.integers(2, config.vocab_size, 3).tolist()
    (tokens, logprobs, cached), = generate_cached(engine, [(first, GREEDY)])
    assert cached == 0
    check_forward(config, params, first, tokens, logprobs)
    # Chunks 0..16, 16..24 (cut at the boundary), 24..27: snapshots after pages 4 and 6.
    for suffix_length in (5, 2):  # different continuations of the same prefix
        prompt = prefix + rng.integers(2, config.vocab_size, suffix_length).tolist()
        (tokens, logprobs, cached), = generate_cached(engine, [(prompt, GREEDY)])
        assert cached == 24  # all 6 pages, the KDA state from the snapshot after page 6
        check_forward(config, params, prompt, tokens, logprobs)
    assert snapshots.restores == restores + 2


def test_prefix_hits_with_preemption_equal_forward(model, engine):
    config, params = model
    rng = np.random.default_rng(12)
    prefix = rng.integers(2, config.vocab_size, 16).tolist()
    warm = prefix + [3]
    generate_cached(engine, [(warm, SamplingParams(max_tokens=1, temperature=0.0))])
    # Two 26-token prompts on the prefix growing to 38 positions: 20 pages wanted, 12 in the pool,
    # so the later one is preempted, then recomputed from the cache (its own pages' snapshots).
    prompts = [prefix + rng.integers(2, config.vocab_size, 10).tolist() for _ in range(2)]
    preemptions, restores = engine.preemptions, engine.pages.snapshots.restores
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    results = generate_cached(engine, [(prompt, greedy) for prompt in prompts])
    assert engine.preemptions > preemptions
    assert engine.pages.snapshots.restores >= restores + 3  # both first admissions and a return
    for prompt, (tokens, logprobs, cached) in zip(prompts, results, strict=True):
        assert cached == 16
        check_forward(config, params, prompt, tokens, logprobs)


def test_snapshots_do_not_outlive_their_pages(model, engine):
    config, _ = model
    rng = np.random.default_rng(13)
    quick = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for _ in range(4):  # more distinct prefixes than the pool and the snapshot slots hold
        generate_cached(engine, [(rng.integers(2, config.vocab_size, n).tolist(), quick) for n in (21, 9)])
    pages, snapshots = engine.pages, engine.pages.snapshots
    assert snapshots.used + len(snapshots._free) == snapshots.capacity
    assert sorted(snapshots._slot_of.values()) + sorted(snapshots._free) != []
    assert len(set(snapshots._slot_of.values()) | set(snapshots._free)) == snapshots.capacity
    assert all(pages.knows(key) for key in snapshots._slot_of)  # each on a cached page
    assert pages.used == 0 and engine.active_requests == 0


def test_streams_end_and_slots_free(engine):
    async def cancel_early():
        stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        count = 0
        async for event in stream:
            count += 1
            if count == 2:
                stream.cancel()
            last = event
        return last, count

    last, count = asyncio.run(cancel_early())
    assert last.finish_reason == "abort" and count < 30
    assert engine.active_requests == 0
