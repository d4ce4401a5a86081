"""The serving engine: greedy output equals the argmax chain of `forward`, requests of
different lengths share decode steps, no recompiles in steady state, cancellation frees slots;
on a deliberately small page pool, chunked prefill and preemption leave the output unchanged,
and prefix-cache hits (on the device or reloaded from host memory) give the same tokens."""

import asyncio
import threading

import jax
import numpy as np
import pytest
from reference import greedy_chain, perturbed_params
from streams import events_of, run_together

from glm5_jax.engine.engine import Engine
from glm5_jax.engine.observer import EngineObserver
from glm5_jax.engine.paged_cache import page_hashes
from glm5_jax.engine.types import (
    SHUTTING_DOWN,
    EngineUnavailableError,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
    ShuttingDownError,
)

# One xdist worker runs this module, so its fixtures (compiled engines) are built once.
pytestmark = pytest.mark.xdist_group("engine")

MAX_CONTEXT = 48


@pytest.fixture(scope="module")
def model(tiny_config):
    config = tiny_config.replace(num_mtp_layers=0, eos_token_ids=[255])
    return config, perturbed_params(config, 5)


@pytest.fixture(scope="module")
def engine(model):
    config, params = model
    engine = Engine(config, params, None, max_slots=3, max_context=MAX_CONTEXT, seed=0, token_budget=16)
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params):
    """(the request's token ids, its finish reason)."""
    events = await events_of(engine, prompt, params)
    return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason


def test_greedy_matches_forward_with_concurrent_requests(model, engine):
    config, params = model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 200, n).tolist() for n in (5, 17, 9, 30, 2)]  # 5 requests, 3 slots
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    overlapped = engine.overlapped_calls

    async def run_all():
        return await asyncio.gather(*(collect(engine, p, greedy) for p in prompts))

    results = asyncio.run(run_all())
    for prompt, (tokens, reason) in zip(prompts, results, strict=True):
        expected = greedy_chain(config, params, prompt, 10, length=MAX_CONTEXT)
        assert tokens == expected
        assert reason == ("stop" if expected[-1] in config.eos_token_ids else "length")
    assert engine.overlapped_calls > overlapped  # decode calls dispatched behind running ones


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
    engine = Engine(config, params, None, max_slots=2, max_context=32, seed=0, token_budget=16)
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
        assert tokens == greedy_chain(config, params, prompt, 6, length=32)


class Recorder(EngineObserver):
    """Keeps every hook call as (name, args)."""

    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *args: self.calls.append((name, args))
        return super().__getattribute__(name)

    def named(self, name):
        return [args for n, args in self.calls if n == name]


SMALL_PAGE = 4


@pytest.fixture(scope="module")
def small_pool(model):
    """12 pages of 4 positions: one full-context sequence; a budget of 16 tokens per step."""
    config, params = model
    observer = Recorder()
    engine = Engine(config, params, None, max_slots=3, max_context=MAX_CONTEXT, seed=0,
                    page_size=SMALL_PAGE, num_pages=MAX_CONTEXT // SMALL_PAGE, token_budget=16,
                    host_cache_pages=8, observer=observer)
    yield engine, observer
    engine.shutdown()


def run_concurrently(engine, prompts, params):
    return run_together(engine, [(prompt, params) for prompt in prompts])


def test_preemption_and_chunked_prefill_keep_the_output(engine, small_pool):
    """Greedy and seeded sampled requests (with penalties: the sampler's token counts matter)
    give the same tokens on a pool so small that they preempt each other."""
    small, observer = small_pool
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 200, n).tolist() for n in (14, 11, 9)]  # 34 prompt tokens > budget 16
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True,
                             frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2)
    # Together they need 7 + 6 + 6 pages of 4 at the end: more than the 12 in the pool.
    for params in (greedy, sampled):
        before = small.preemptions
        expected = run_concurrently(engine, prompts, params)
        got = run_concurrently(small, prompts, params)
        for want, have in zip(expected, got, strict=True):
            assert [e.token_id for e in have] == [e.token_id for e in want]  # no repeats, none lost
            assert have[-1].finish_reason == "length"
        assert small.preemptions > before
    assert len(observer.named("on_preempted")) == small.preemptions
    assert small.pages.used == 0 and small.pages.available == small.pages.num_pages
    assert int(small.pages.refs.min()) == 0


def test_prefix_hits_on_device_and_from_host(small_pool):
    small, observer = small_pool
    rng = np.random.default_rng(8)
    prompt = rng.integers(2, 200, 13).tolist()  # 3 full pages can be served from cache (not the last token)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)

    def once(p=prompt):
        return asyncio.run(events_of(small, p, params))

    cold = once()
    compiles = small.compile_count
    warm = once()
    reloads = small.pages.reloads
    # A long distinct request needs 11 of the 12 pages: the prompt's cached pages go to host memory.
    once(rng.integers(2, 200, 40).tolist())
    keys = page_hashes(prompt, SMALL_PAGE, 3)
    assert sum(small.pages.on_host(k) for k in keys) >= 2
    reloaded = once()
    assert small.pages.reloads >= reloads + 2
    assert [cold[-1].cached_tokens, warm[-1].cached_tokens, reloaded[-1].cached_tokens] == [0, 12, 12]
    for events in (warm, reloaded):
        assert [e.token_id for e in events] == [e.token_id for e in cold]
        np.testing.assert_allclose([e.logprob for e in events], [e.logprob for e in cold], atol=1e-5)
    finished = observer.named("on_finished")[-4:]  # (id, reason, prompt, cached, output, seconds)
    assert [f[3] for f in finished] == [0, 12, 0, 12]
    assert [f[4] for f in finished] == [10, 10, 8, 10]  # 40 + 8 = the 48-token context
    lookups = observer.named("on_prefix_lookup")[-4:]
    assert [hit for _, hit in lookups] == [0, 12, 0, 12]
    assert observer.named("on_step") and observer.named("on_first_token")
    assert small.pages.used == 0 and small.pages.host_used <= 8
    assert small.compile_count == compiles  # offload and reload compiled once, before


def test_bad_pool_settings_are_rejected(model):
    config, params = model
    with pytest.raises(ValueError, match="num_pages"):
        Engine(config, params, None, max_context=48, page_size=4, num_pages=11)
    with pytest.raises(ValueError, match="token_budget"):
        Engine(config, params, None, max_slots=8, token_budget=0)


def test_a_failing_step_fails_only_its_requests(engine, monkeypatch):
    """Fault injection in the real engine: the runner's next step raises. The requests in that
    step end with "error"; the engine goes on serving; repeated failures stop it for good."""
    runner = engine.runner
    real_step, failures = runner.mixed_step, []

    def fail_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected device error")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(runner, "mixed_step", fail_once)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    failed = asyncio.run(events_of(engine, [3, 4, 5], greedy))
    assert failed[-1].finish_reason == "error" and "injected" in failed[-1].error
    served = asyncio.run(events_of(engine, [3, 4, 5], greedy))
    assert served[-1].finish_reason == "length" and len(served) == 4
    assert engine.failure is None and engine.active_requests == 0


def test_a_decode_call_failing_after_dispatch(model, engine, monkeypatch):
    """Fault injection where calls overlap: the 2nd decode call's tokens fail to arrive while a
    3rd is already dispatched behind it. The request fails at that point; the next request gets
    `forward`'s greedy chain."""
    config, params = model
    runner = engine.runner
    real_fetch, fetched = runner.fetch, []

    def fail_second(call):
        fetched.append(call)
        if len(fetched) == 2:
            raise RuntimeError("injected device error")
        return real_fetch(call)

    monkeypatch.setattr(runner, "fetch", fail_second)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    overlapped = engine.overlapped_calls
    failed = asyncio.run(events_of(engine, [3, 4, 5], greedy))
    # 1 token from the prefill step, 8 from the first decode call, then the error.
    assert len(failed) == 10 and failed[-1].finish_reason == "error" and "injected" in failed[-1].error
    assert engine.overlapped_calls == overlapped + 2
    monkeypatch.setattr(runner, "fetch", real_fetch)
    assert asyncio.run(collect(engine, [3, 4, 5], greedy)) == (
        greedy_chain(config, params, [3, 4, 5], 30, length=MAX_CONTEXT), "length")
    assert engine.failure is None and engine.active_requests == 0


def test_repeated_failures_stop_the_engine(model):
    config, params = model
    engine = Engine(config, params, None, max_slots=1, max_context=16, token_budget=16,
                    max_consecutive_failures=2, max_waiting=2)

    def broken(*args, **kwargs):
        raise RuntimeError("injected device error")

    engine.runner.mixed_step = broken
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        reasons = [asyncio.run(events_of(engine, [1, 2], greedy))[-1].finish_reason for _ in range(2)]
        assert reasons == ["error", "error"]
        assert "2 model steps failed in a row" in engine.failure
        with pytest.raises(EngineUnavailableError, match="injected"):
            asyncio.run(submit_with(engine, greedy))
    finally:
        engine.shutdown()


def test_bounded_waiting_queue_and_drain(model):
    """A full waiting queue refuses with QueueFullError; drain() ends the waiting requests with
    "abort" (error SHUTTING_DOWN) and refuses new ones; shutdown() ends the rest the same way."""
    config, params = model
    engine = Engine(config, params, None, max_slots=1, max_context=16, token_budget=16, max_waiting=1)
    hold, held = threading.Event(), threading.Event()
    with engine._lock:  # the engine thread waits in a task: submissions stay queued
        engine._tasks.append((lambda: (held.set(), hold.wait(30)), threading.Event()))
    engine._wakeup.set()
    assert held.wait(30)

    async def queue_then_drain():
        queued = engine.submit([1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(QueueFullError, match="waiting queue is full"):
            engine.submit([1, 2], SamplingParams())
        engine.drain()
        events = [event async for event in queued]
        with pytest.raises(ShuttingDownError):
            engine.submit([1, 2], SamplingParams())
        return events

    try:
        events = asyncio.run(queue_then_drain())
        assert [(e.token_id, e.finish_reason, e.error) for e in events] == [(None, "abort", SHUTTING_DOWN)]
        assert engine.idle
    finally:
        hold.set()
        engine.shutdown()
        engine.shutdown()  # a second call does nothing


def test_prompt_logprobs_equal_forward(model, engine):
    """Prompt scoring (echo + logprobs): every prompt token's log-probability given the tokens
    before it equals `forward`'s, across chunked prefill; max_tokens 0 scores without
    generating; a repeated prompt is scored again in full (no prefix-cache hit skips it)."""
    import glm5_jax

    config, params = model
    prompt = np.random.default_rng(9).integers(2, 200, 30).tolist()  # two chunks of the 16-token budget
    ids = np.zeros((1, MAX_CONTEXT), np.int32)  # greedy_chain's padded shape: one compilation
    ids[0, :len(prompt)] = prompt
    logprobs = np.asarray(jax.nn.log_softmax(glm5_jax.forward(config, params, ids)[0, :len(prompt) - 1]))
    want = logprobs[np.arange(len(prompt) - 1), prompt[1:]]
    for max_tokens in (0, 2, 0):
        events = asyncio.run(events_of(engine, prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, prompt_logprobs=2, ignore_eos=True)))
        scores = events[0].prompt_logprobs
        assert len(scores) == len(prompt) and scores[0] == (None, ())
        np.testing.assert_allclose([s[0] for s in scores[1:]], want, atol=2e-4)
        assert [s[1][0][0] for s in scores[1:]] == np.argmax(logprobs, axis=-1).tolist()
        assert all(len(s[1]) == 2 for s in scores[1:])
        assert len(events) == max(max_tokens, 1) and events[-1].finish_reason == "length"
        assert all(e.prompt_logprobs is None for e in events[1:])
    assert events[0].token_id is None


def test_scoring_without_output_answers_for_every_prompt_length(engine):
    """max_tokens 0 + prompt scoring (lm-evaluation-harness' loglikelihood requests) answers
    for a one-token prompt and for one whose last chunk leaves one token, alone and beside a
    decoding request: the prompt's last token used to be planned as a decode row with nothing
    to sample, and the request kept its slot for ever."""
    score = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0)

    async def scored(prompt):
        return await asyncio.wait_for(events_of(engine, prompt, score), timeout=60)

    async def beside_a_decode(prompt):
        decoding = events_of(engine, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0,
                                                                    ignore_eos=True))
        return await asyncio.wait_for(asyncio.gather(events_of(engine, prompt, score), decoding),
                                      timeout=60)

    for prompt in ([7], list(range(2, 19))):  # 1 token; 17 = one 16-token chunk + 1
        for events in (asyncio.run(scored(prompt)), asyncio.run(beside_a_decode(prompt))[0]):
            assert [e.token_id for e in events] == [None] and events[-1].finish_reason == "length"
            assert len(events[0].prompt_logprobs) == len(prompt)
    assert engine.active_requests == 0


def test_requests_reaching_the_context_together(engine):
    """Two requests decoding to the context limit at once, the next decode call dispatched behind
    the one in flight: its pages stay within a sequence's table (the reservation for the call
    behind used to run past the context: "could not broadcast (4,) into (3,)", every request of
    the step failed)."""
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_CONTEXT)
    for lengths in ((5, 12), (1, 12), (5, 20)):
        prompts = [list(range(5, 5 + n)) for n in lengths]
        results = run_concurrently(engine, prompts, greedy)
        for prompt, events in zip(prompts, results, strict=True):
            assert events[-1].finish_reason == "length", events[-1]
            assert sum(e.token_id is not None for e in events) == MAX_CONTEXT - len(prompt)
    assert engine.failure is None and engine.active_requests == 0
