"""The serving engine: greedy output equals the argmax chain of `forward`, requests of
different lengths share decode steps, no recompiles in steady state, cancellation frees slots."""

import asyncio

import numpy as np
import pytest
from reference import perturbed_params

import glm5_jax
from glm5_jax.serve.engine import Engine
from glm5_jax.serve.types import InvalidRequestError, SamplingParams

MAX_CONTEXT = 48


@pytest.fixture(scope="module")
def model(tiny_config):
    config = tiny_config.replace(num_mtp_layers=0, eos_token_ids=[255])
    return config, perturbed_params(config, 5)


@pytest.fixture(scope="module")
def engine(model):
    config, params = model
    engine = Engine(config, params, None, max_slots=3, max_context=MAX_CONTEXT, seed=0)
    yield engine
    engine.shutdown()


def greedy_reference(config, params, prompt, max_tokens):
    """The argmax chain of the full forward (no cache), stopping at EOS."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        token = int(np.argmax(np.asarray(glm5_jax.forward(config, params, np.asarray([sequence])))[0, -1]))
        sequence.append(token)
        if token in config.eos_token_ids:
            break
    return sequence[len(prompt):]


async def collect(engine, prompt, params):
    events = [event async for event in engine.submit(prompt, params)]
    return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason


def test_greedy_matches_forward_with_concurrent_requests(model, engine):
    config, params = model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 200, n).tolist() for n in (5, 17, 9, 30, 2)]  # 5 requests, 3 slots
    greedy = SamplingParams(max_tokens=10, temperature=0.0)

    async def run_all():
        return await asyncio.gather(*(collect(engine, p, greedy) for p in prompts))

    results = asyncio.run(run_all())
    for prompt, (tokens, reason) in zip(prompts, results, strict=True):
        expected = greedy_reference(config, params, prompt, 10)
        assert tokens == expected
        assert reason == ("stop" if expected[-1] in config.eos_token_ids else "length")


def test_no_recompiles_in_steady_state(engine):
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3)

    async def batch():
        await asyncio.gather(*(collect(engine, [1, 2, 3] * k, params) for k in range(1, 5)))

    asyncio.run(batch())  # compiles whatever these buckets need
    before = engine.compile_count
    asyncio.run(batch())
    asyncio.run(batch())
    assert engine.compile_count == before


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=42)
    first = asyncio.run(collect(engine, [7, 8, 9], params))
    second = asyncio.run(collect(engine, [7, 8, 9], params))
    assert first == second


def test_cancel_frees_the_slot(engine):
    async def cancel_early():
        stream = engine.submit([4, 5, 6], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        events = []
        async for event in stream:
            events.append(event)
            if len(events) == 2:
                stream.cancel()
        return events

    events = asyncio.run(cancel_early())
    assert events[-1].finish_reason == "abort" and len(events) < 40
    assert engine.active_requests == 0


def test_output_stops_at_the_context(engine):
    prompt = list(range(1, 41))  # 40 of 48 positions
    tokens, reason = asyncio.run(collect(engine, prompt, SamplingParams(
        max_tokens=100, temperature=0.0, ignore_eos=True)))
    assert len(tokens) == MAX_CONTEXT - len(prompt) and reason == "length"


def test_bad_prompts_are_rejected(engine):
    async def submit(prompt):
        engine.submit(prompt, SamplingParams())

    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(submit([]))
    with pytest.raises(InvalidRequestError, match="48"):
        asyncio.run(submit([1] * MAX_CONTEXT))
    with pytest.raises(InvalidRequestError, match="temperature"):
        asyncio.run(submit_with(engine, SamplingParams(temperature=-1.0)))


async def submit_with(engine, params):
    engine.submit([1, 2], params)


def test_sliding_window_layers_on_the_ring_cache(model):
    """Mixed DSA / sliding-window stacks: the ring state travels with prefill insertion and
    prompts longer than the window still give forward's greedy chain."""
    config, params = model
    config = config.replace(attention_types=["dsa", "sliding_window", "dsa", "sliding_window"],
                            sliding_window=4)
    engine = Engine(config, params, None, max_slots=2, max_context=32, seed=0)
    try:
        rng = np.random.default_rng(2)
        prompts = [rng.integers(0, 200, n).tolist() for n in (3, 11, 6)]
        greedy = SamplingParams(max_tokens=6, temperature=0.0)

        async def run_all():
            return await asyncio.gather(*(collect(engine, p, greedy) for p in prompts))

        results = asyncio.run(run_all())
    finally:
        engine.shutdown()
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == greedy_reference(config, params, prompt, 6)
