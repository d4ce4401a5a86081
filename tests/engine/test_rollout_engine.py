"""The engine as an RL rollout worker (issue #42): weight hand-off without a checkpoint round trip
(`Engine.load_weights`: the engine's log-probabilities afterwards are `forward`'s with the new
params, nothing recompiles, the prefix cache is flushed, the trainer's buffers are not aliased),
behaviour-policy log-probabilities (logprobs_mode "processed": of the distribution the token was
drawn from) on sampled requests, and `submit_batch`'s all-or-nothing queueing.

One tiny engine serves the whole module (the CI suite's time budget)."""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import perturbed_params
from streams import events_of

from glm5_jax.engine.engine import Engine
from glm5_jax.engine.timing import summarize
from glm5_jax.engine.types import InvalidRequestError, SamplingParams
from glm5_jax.model.transformer import apply_model

pytestmark = pytest.mark.xdist_group("rollout_engine")

MAX_CONTEXT = 32
TOLERANCE = 1e-4  # float32, the acceptance bound


@pytest.fixture(scope="module")
def model(tiny_config):
    """(config, params A the engine starts on, params B the "trainer" hands over)."""
    config = tiny_config.replace(num_mtp_layers=0, eos_token_ids=[255])
    return config, perturbed_params(config, 5), perturbed_params(config, 6)


@pytest.fixture(scope="module")
def engine(model):
    config, params_a, _ = model
    engine = Engine(config, params_a, None, max_slots=2, max_context=MAX_CONTEXT, seed=0, token_budget=16,
                    timing=True)  # also the real engine under glm5_jax/engine/timing.py (last test)
    yield engine
    engine.shutdown()


def forward_logprobs(config, params, tokens) -> np.ndarray:
    """log_softmax of `apply_model`'s logits over tokens [n] -> [n, V] (row i predicts token i + 1);
    one padded shape [1, MAX_CONTEXT], so every call shares one compilation."""
    ids = np.zeros((1, MAX_CONTEXT), np.int32)
    ids[0, :len(tokens)] = tokens
    logits = apply_model(config, params, jnp.asarray(ids))["logits"][0, :len(tokens)]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def run(engine, prompt, params):
    return asyncio.run(events_of(engine, prompt, params))


def generated(events):
    return [e.token_id for e in events if e.token_id is not None]


def test_logprobs_after_the_hand_off_equal_forward_with_the_new_params(model, engine):
    """The acceptance item: after load_weights(B) the engine's prompt and sampled-token
    log-probabilities are log_softmax(apply_model(B)) within 1e-4 (and not A's); the hand-off
    and the requests after it compile nothing; a prefix cached under A is not reused under B;
    the engine holds its own copy (the trainer's donated buffers may be deleted)."""
    config, params_a, params_b = model
    prompt = np.random.default_rng(3).integers(2, 250, 20).tolist()  # one full 16-token page
    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0)

    def check(params, greedy_events, scored_events):
        tokens = generated(greedy_events)
        want = forward_logprobs(config, params, prompt + tokens)
        n = len(prompt)
        assert tokens == [int(np.argmax(want[n - 1 + i])) for i in range(len(tokens))]
        np.testing.assert_allclose([e.logprob for e in greedy_events],
                                   want[np.arange(n - 1, n - 1 + len(tokens)), tokens], atol=TOLERANCE)
        prompt_scores = [score for score, _ in scored_events[0].prompt_logprobs[1:]]
        np.testing.assert_allclose(prompt_scores, want[np.arange(n - 1), prompt[1:]], atol=TOLERANCE)
        return np.asarray(prompt_scores)

    before = run(engine, prompt, greedy)
    assert before[-1].cached_tokens == 0
    assert run(engine, prompt, greedy)[-1].cached_tokens == 16  # the prefix cache works under A
    scores_a = check(params_a, before, run(engine, prompt, scoring))

    trainer_params = jax.tree.map(jnp.array, params_b)  # the trainer's buffers (it will donate them)
    compiles = engine.compile_count  # counts every compilation in the process
    engine.load_weights(trainer_params)
    assert engine.compile_count == compiles
    jax.tree.map(lambda a: a.delete(), trainer_params)  # a donating train step frees them

    after = run(engine, prompt, greedy)
    assert after[-1].cached_tokens == 0  # pages computed with A are not reused under B
    scores_b = check(params_b, after, run(engine, prompt, scoring))
    assert np.max(np.abs(scores_a - scores_b)) > 1e-2  # B really is served, not A
    assert engine.compile_count == compiles  # same shapes as under A: nothing new to compile


def test_processed_logprobs_are_the_sampled_distribution(model, engine):
    """Sampled requests (temperature 0.7, one batch): "processed" reports log_softmax(logits /
    0.7) at each drawn token, alternatives from the same distribution; with top_k the filtered
    distribution; "raw" still log_softmax(logits). The same seed draws the same tokens in both
    modes (the mode changes the report, never the draw)."""
    config, _, params_b = model
    engine.load_weights(params_b)
    prompt = [5, 9, 14, 200, 31, 7]
    base = SamplingParams(max_tokens=6, temperature=0.7, top_p=1.0, seed=11, logprobs=2, ignore_eos=True)
    modes = {"processed": dataclasses.replace(base, logprobs_mode="processed"), "raw": base,
             "top_k": dataclasses.replace(base, logprobs_mode="processed", top_k=5, seed=12)}

    async def events(stream):
        return [event async for event in stream]

    async def batch():
        streams = engine.submit_batch([(prompt, params) for params in modes.values()])
        return await asyncio.gather(*(events(stream) for stream in streams))

    results = dict(zip(modes, asyncio.run(batch()), strict=True))
    assert generated(results["processed"]) == generated(results["raw"])
    for mode, events in results.items():
        tokens = generated(events)
        logits = forward_logprobs(config, params_b, prompt + tokens)  # log_softmax: logits up to a shift
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        if mode != "raw":
            rows = rows / 0.7
        if mode == "top_k":
            rows = np.where(rows >= np.sort(rows, axis=-1)[:, -5:-4], rows, -np.inf)
        want = rows - np.logaddexp.reduce(rows, axis=-1, keepdims=True)
        np.testing.assert_allclose([e.logprob for e in events], want[np.arange(len(tokens)), tokens],
                                   atol=TOLERANCE, err_msg=mode)
        best = np.sort(want, axis=-1)[:, ::-1][:, :2]
        np.testing.assert_allclose([[lp for _, lp in e.top_logprobs] for e in events], best, atol=TOLERANCE,
                                   err_msg=mode)


def test_load_weights_refusals_and_submit_batch_atomicity(model, engine):
    """load_weights refuses while a request waits or runs, and names the first parameter whose
    shape or dtype differs; submit_batch queues nothing when one item is bad."""
    _, _, params_b = model

    async def with_a_running_request():
        stream = engine.submit([4, 5, 6], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        with pytest.raises(RuntimeError, match="1 requests are running and 0 waiting|0 requests are running "
                                               "and 1 waiting"):
            engine.load_weights(params_b)
        stream.cancel()
        return [e async for e in stream]

    assert asyncio.run(with_a_running_request())[-1].finish_reason in ("abort", "length")

    leaves = jax.tree_util.tree_leaves_with_path(params_b)
    path, other_path = leaves[0][0], leaves[-1][0]
    reshaped = jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.zeros((a.shape[0] + 1,) + a.shape[1:], a.dtype) if p == path else a, params_b)
    with pytest.raises(ValueError, match=f"parameter {jax.tree_util.keystr(path)}".replace("[", r"\[")):
        engine.load_weights(reshaped)
    recast = jax.tree_util.tree_map_with_path(lambda p, a: a.astype(jnp.bfloat16) if p == other_path else a,
                                              params_b)
    with pytest.raises(ValueError, match="bfloat16"):
        engine.load_weights(recast)

    async def bad_batch(items):
        engine.submit_batch(items)

    good = ([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(bad_batch([good, ([], SamplingParams())]))
    with pytest.raises(InvalidRequestError, match="logprobs_mode must be one of"):
        asyncio.run(bad_batch([good, ([1], SamplingParams(logprobs_mode="sampled"))]))
    assert engine.idle and engine.active_requests == 0
    engine.load_weights(params_b)  # idle again: accepted


def test_step_timing_records_the_engine_calls(engine):
    """timing=True: every device call of the module's requests has a record; decode calls are
    stamped ready by the watcher after their dispatch, and their figures are sane."""
    engine.timing.settle()
    records = engine.timing.snapshot()
    decodes = [r for r in records if r.kind == "decode"]
    assert decodes and any(r.kind == "mixed" for r in records)
    assert all(r.ready is not None and r.ready >= r.dispatched and 1 <= r.rows <= 2 for r in records)
    assert all(r.phases.get("dispatch", 0) > 0 for r in decodes)
    summary = summarize(decodes)
    assert summary["calls"] == len(decodes) and summary["steps"] == sum(r.steps for r in decodes)
    assert summary["host_ms_per_call"] > 0 and summary["device_ms_per_call"] > 0
    assert 0.0 <= summary["idle_share"] <= 1.0

