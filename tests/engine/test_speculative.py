"""MTP speculative decoding in the real engine: greedy output is `forward`'s argmax chain with
speculation on (drafts accepted and rejected, chunked prefill, preemption, prefix-cache hits,
stop tokens, length limits), reported log-probabilities are the model's, sampled rows are
seeded, and the counters behind /metrics add up. The acceptance rule's distribution is tested
statistically in test_speculative_rule.py."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import greedy_chain, perturbed_params
from streams import run_together

from glm5_jax import forward
from glm5_jax.api.metrics import ServerMetrics
from glm5_jax.engine.engine import Engine
from glm5_jax.engine.types import SamplingParams

pytestmark = pytest.mark.xdist_group("speculative")

MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def model(tiny_config):
    """A random model whose drafts are often right: with the LM head tied to the embedding it
    tends to repeat tokens, and its MTP layer mostly passes the next token's embedding through,
    so it predicts a repeat. Both accepted and rejected drafts occur."""
    config = tiny_config.replace(eos_token_ids=[255])
    params = dict(perturbed_params(config, 3))
    params["lm_head"] = jnp.asarray(params["embed"]).T * 4.0
    width = config.hidden_size
    params["mtp"] = dict(params["mtp"], eh_proj=jnp.concatenate([jnp.eye(width) * 8.0,
                                                                 jnp.zeros((width, width))]))
    return config, params


@pytest.fixture(scope="module")
def engine(model):
    config, params = model
    # 10 pages of 8: two 50-position sequences do not fit together, so they preempt each other.
    engine = Engine(config, params, None, max_slots=2, max_context=MAX_CONTEXT, page_size=8, num_pages=10,
                    token_budget=16, decode_steps=4, speculative_tokens=2, seed=0, observer=ServerMetrics())
    yield engine
    engine.shutdown()


def tokens_of(events):
    return [e.token_id for e in events if e.token_id is not None]


def test_greedy_output_is_the_argmax_chain(model, engine):
    config, params = model
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 250, n).tolist() for n in (12, 21, 5)]
    prompts.append(prompts[1][:17] + [9, 9])  # two full pages in common with the second: a prefix hit
    lengths = (34, 28, 22, 16)
    expected = [greedy_chain(config, params, p, n, length=MAX_CONTEXT) for p, n in zip(prompts, lengths,
                                                                                        strict=True)]
    stop = expected[2][9]  # a stop token id in the middle of the third output
    settings = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=1) for n in lengths]
    settings[2] = SamplingParams(max_tokens=lengths[2], temperature=0.0, stop_token_ids=(stop,))
    preemptions, counts = engine.preemptions, engine.speculation.copy()
    results = run_together(engine, list(zip(prompts, settings, strict=True)))
    for index, (want, events) in enumerate(zip(expected, results, strict=True)):
        if index == 2:
            want = want[:want.index(stop) + 1]
        assert tokens_of(events) == want
        finished = "stop" if index == 2 or want[-1] in config.eos_token_ids else "length"
        assert events[-1].finish_reason == finished
    assert results[3][-1].cached_tokens == 16
    assert engine.preemptions > preemptions
    rounds, drafted, accepted = engine.speculation - counts
    assert 0 < accepted < drafted <= 2 * rounds  # drafts were both accepted and rejected
    # The reported log-probabilities are the model's own (raw logits) at each emitted token.
    prompt, events = prompts[0], results[0]
    ids = np.zeros((1, MAX_CONTEXT), np.int32)
    ids[0, :len(prompt) + len(events)] = prompt + tokens_of(events)
    logprobs = np.asarray(jax.nn.log_softmax(forward(config, params, ids)[0], axis=-1))
    want = [logprobs[len(prompt) + i - 1, e.token_id] for i, e in enumerate(events)]
    np.testing.assert_allclose([e.logprob for e in events], want, atol=2e-4)
    assert all(e.top_logprobs[0][0] == int(np.argmax(logprobs[len(prompt) + i - 1]))
               for i, e in enumerate(events))


def test_sampled_rows_are_seeded(model, engine):
    config, params = model
    prompt = [5, 6, 7, 8, 9, 10]
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=13, ignore_eos=True)
    top1 = SamplingParams(max_tokens=24, temperature=1.0, top_k=1, seed=2, ignore_eos=True)
    counts = engine.speculation.copy()
    first, one_hot = run_together(engine, [(prompt, sampled), (prompt, top1)])
    second, _ = run_together(engine, [(prompt, sampled), (prompt, top1)])
    assert tokens_of(first) == tokens_of(second) and len(tokens_of(first)) == 24
    # top_k 1: target and draft distributions are one-hot, so the sampled rule gives the argmax chain.
    assert tokens_of(one_hot) == greedy_chain(config, params, prompt, 24, length=MAX_CONTEXT)
    assert (engine.speculation - counts)[2] > 0
    # /metrics carries the engine's counters (vLLM's names).
    text = engine.observer.render().decode()
    for name, value in zip(("drafts", "draft_tokens", "accepted_tokens"), engine.speculation, strict=True):
        assert f"glm5_spec_decode_num_{name}_total {float(value)}" in text
