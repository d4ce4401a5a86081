"""Tests for the batched sampler: penalties, filters, temperature, seeds, logprobs, state."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.engine import sampling
from glm5_jax.engine.sampling import (
    SamplingState,
    init_sampling_state,
    make_keys,
    sample,
    set_slot,
)
from glm5_jax.engine.types import InvalidRequestError, SamplingParams

# Jitted here (the engine calls them inside its jitted step): eagerly, every op compiles alone.
apply_penalties = jax.jit(sampling.apply_penalties)
filter_logits = jax.jit(sampling.filter_logits)

N_DRAWS = 4000  # slots in the statistical tests: one vectorised call = N_DRAWS draws
V_SMALL = 4
PROBS = np.array([0.5, 0.3, 0.15, 0.05])
N_TOP = 20


def many_slots(logits_row, **params) -> tuple[jax.Array, SamplingState]:
    """N_DRAWS slots, all with `logits_row` and the same params, each with its own seed."""
    state = init_sampling_state(N_DRAWS, len(logits_row))
    values = {name: jnp.full((N_DRAWS,), value, getattr(state, name).dtype)
              for name, value in params.items()}
    state = state.replace(keys=make_keys(range(1000, 1000 + N_DRAWS)), **values)
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (N_DRAWS, len(logits_row)))
    return logits, state


def draw_frequencies(logits_row, **params) -> np.ndarray:
    logits, state = many_slots(logits_row, **params)
    tokens = np.asarray(sample(logits, state, 0)[0])
    return np.bincount(tokens, minlength=len(logits_row)) / N_DRAWS


def softmax(x):
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def run_steps(logits, state, steps):
    tokens = []
    for _ in range(steps):
        step_tokens, _, _, _, state = sample(logits, state, min(N_TOP, logits.shape[-1]))
        tokens.append(np.asarray(step_tokens))
    return np.stack(tokens, axis=1), state


# --- greedy and penalties ---------------------------------------------------------------------


def test_greedy_picks_argmax_and_penalty_changes_it():
    logits = jnp.array([[2.0, -1.0, 1.5, 0.5, 0.0, -3.0], [0.1, 0.2, 3.0, 0.3, 0.0, 0.0]])
    state = init_sampling_state(2, 6)
    for slot in range(2):
        state = set_slot(state, slot, SamplingParams(temperature=0.0), [], seed=slot)
    np.testing.assert_array_equal(np.asarray(sample(logits, state, 6)[0]), [0, 2])

    # Slot 0: token 0 in the prompt, repetition penalty 2: step 1 -> 2.0 / 2 = 1.0 < 1.5 -> 2;
    # step 2 -> token 2 generated too, 1.5 / 2 = 0.75 < 1.0 -> 0; step 3 -> still 0 (1.0 > 0.5).
    state = set_slot(state, 0, SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], seed=0)
    # Slot 1: frequency 1.5 on token 2 (3.0): 3.0 -> 2; 1.5 -> 2; 0.0 < 0.3 -> 3.
    state = set_slot(state, 1, SamplingParams(temperature=0.0, frequency_penalty=1.5), [], seed=1)
    tokens, _ = run_steps(logits, state, 3)
    np.testing.assert_array_equal(tokens, [[2, 0, 0], [2, 2, 3]])


def test_repetition_penalty_hand_computed():
    state = init_sampling_state(2, V_SMALL)
    state = set_slot(state, 0, SamplingParams(repetition_penalty=2.0), [0, 1, 1], seed=0)
    state = set_slot(state, 1, SamplingParams(repetition_penalty=1.25), [3], seed=1)
    logits = jnp.array([[3.0, -1.5, 0.7, -0.2], [3.0, -1.5, 0.7, -0.2]])
    got = np.asarray(apply_penalties(logits, state))
    expected = np.array([[3.0 / 2.0, -1.5 * 2.0, 0.7, -0.2], [3.0, -1.5, 0.7, -0.2 * 1.25]])
    np.testing.assert_allclose(got, expected, rtol=1e-6)

    # Generated tokens are penalised as well as prompt tokens (slot 1 generates token 2 greedily).
    state = set_slot(state, 1, SamplingParams(temperature=0.0, repetition_penalty=1.25), [3], seed=1)
    _, _, _, _, state = sample(jnp.array([[0.0, 0.0, 5.0, 0.0]] * 2), state, 0)
    got = np.asarray(apply_penalties(logits, state))[1]
    np.testing.assert_allclose(got, [3.0, -1.5, 0.7 / 1.25, -0.2 * 1.25], rtol=1e-6)


def test_presence_and_frequency_penalties_hand_computed():
    # Greedy on [1.0, 0.8] with frequency 0.15: counts (0,0) -> 0; (1,0): 0.85 vs 0.8 -> 0;
    # (2,0): 0.70 vs 0.80 -> 1; (2,1): 0.70 vs 0.65 -> 0; (3,1): 0.55 vs 0.65 -> 1.
    state = init_sampling_state(2, 2)
    state = set_slot(state, 0, SamplingParams(temperature=0.0, frequency_penalty=0.15), [], seed=0)
    state = set_slot(state, 1, SamplingParams(temperature=0.0, presence_penalty=0.5,
                                              frequency_penalty=0.25), [0, 1], seed=1)
    logits = jnp.array([[1.0, 0.8], [1.0, 0.8]])
    tokens, state = run_steps(logits, state, 5)
    np.testing.assert_array_equal(tokens[0], [0, 0, 1, 0, 1])
    # Slot 1 (prompt tokens are NOT hit by presence/frequency): counts (0,0) -> 0;
    # (1,0): 1 - 0.5 - 0.25 = 0.25 vs 0.8 -> 1; (1,1): 0.25 vs 0.05 -> 0; (2,1): 0.0 vs 0.05 -> 1;
    # (2,2): 0.0 vs -0.2 -> 0.
    np.testing.assert_array_equal(tokens[1], [0, 1, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(state.output_counts), [[3, 2], [3, 2]])
    got = np.asarray(apply_penalties(logits, state))
    expected = [[1.0 - 0.15 * 3, 0.8 - 0.15 * 2], [1.0 - 0.5 - 0.25 * 3, 0.8 - 0.5 - 0.25 * 2]]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# --- filters ----------------------------------------------------------------------------------


def test_top_k_one_is_greedy_at_any_temperature():
    logits_row = np.array([0.3, 1.0, 0.9, 0.95])
    for temperature in (0.7, 5.0, 100.0):
        freqs = draw_frequencies(logits_row, temperature=temperature, top_k=1)
        np.testing.assert_array_equal(freqs, [0.0, 1.0, 0.0, 0.0])


def test_top_k_never_samples_outside_top_k():
    rng = np.random.default_rng(0)
    logits_row = rng.normal(size=16) * 0.3
    top3 = np.argsort(-logits_row)[:3]
    freqs = draw_frequencies(logits_row, temperature=2.0, top_k=3)
    outside = np.setdiff1d(np.arange(16), top3)
    assert freqs[outside].sum() == 0.0
    assert np.all(freqs[top3] > 0.2)  # the three survivors all appear, renormalised
    expected = softmax(logits_row[top3] / 2.0)
    np.testing.assert_allclose(freqs[top3], expected, atol=0.03)


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits_row = np.log(PROBS)
    freqs = draw_frequencies(logits_row, top_p=0.7)
    assert freqs[2] == 0.0 and freqs[3] == 0.0
    np.testing.assert_allclose(freqs[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)

    # top_p below the top probability still keeps the top token.
    np.testing.assert_array_equal(draw_frequencies(logits_row, top_p=0.1), [1.0, 0.0, 0.0, 0.0])
    # 0.85 needs the third token too (0.5 + 0.3 < 0.85).
    freqs = draw_frequencies(logits_row, top_p=0.85)
    assert freqs[3] == 0.0 and np.all(freqs[:3] > 0.1)

    freqs = draw_frequencies(logits_row, top_p=1.0)
    assert np.all(freqs > 0.0)
    np.testing.assert_allclose(freqs, PROBS, atol=0.03)


def test_min_p_drops_tokens_below_fraction_of_max():
    logits_row = np.log(PROBS)
    # threshold 0.4 * 0.5 = 0.2: tokens 0 (0.5) and 1 (0.3) stay.
    freqs = draw_frequencies(logits_row, min_p=0.4)
    assert freqs[2] == 0.0 and freqs[3] == 0.0
    np.testing.assert_allclose(freqs[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)
    # threshold 0.25 * 0.5 = 0.125: token 2 (0.15) stays, token 3 (0.05) goes.
    freqs = draw_frequencies(logits_row, min_p=0.25)
    assert freqs[3] == 0.0 and np.all(freqs[:3] > 0.1)


def test_filter_masks_hand_computed():
    logits_row = np.log(PROBS)[[2, 0, 3, 1]]  # unsorted: probs [0.15, 0.5, 0.05, 0.3]
    state = init_sampling_state(6, V_SMALL)
    state = state.replace(top_k=jnp.array([0, 2, 0, 0, 0, 0], jnp.int32),
                          top_p=jnp.array([1.0, 1.0, 0.7, 0.85, 1.0, 1.0], jnp.float32),
                          min_p=jnp.array([0.0, 0.0, 0.0, 0.0, 0.4, 0.25], jnp.float32))
    got = np.isfinite(np.asarray(filter_logits(jnp.tile(jnp.asarray(logits_row), (6, 1)), state)))
    expected = [[1, 1, 1, 1], [0, 1, 0, 1], [0, 1, 0, 1], [1, 1, 0, 1], [0, 1, 0, 1], [1, 1, 0, 1]]
    np.testing.assert_array_equal(got, np.array(expected, bool))

    # top_p = 1 keeps every token even when float32 cumulative sums reach 1 before the tail.
    state = init_sampling_state(1, 6)
    assert np.isfinite(np.asarray(filter_logits(jnp.array([[30.0, 0.0, 0.0, -1.0, 0.0, 0.0]]), state))).all()
    state = state.replace(top_p=jnp.array([0.999], jnp.float32))
    got = np.asarray(filter_logits(jnp.array([[30.0, 0.0, 0.0, -1.0, 0.0, 0.0]]), state))
    np.testing.assert_array_equal(np.isfinite(got), [[1, 0, 0, 0, 0, 0]])


# --- temperature --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    logits_row = np.array([2.0, 1.0, 0.0, -1.0])
    freqs = draw_frequencies(logits_row, temperature=temperature)
    np.testing.assert_allclose(freqs, softmax(logits_row / temperature), atol=0.025)
    # The tolerance is tight enough to tell temperatures apart.
    for other in {0.5, 1.0, 2.0} - {temperature}:
        assert np.abs(freqs - softmax(logits_row / other)).max() > 0.05


# --- seeds --------------------------------------------------------------------------------------


def test_same_seed_same_sequence_whatever_other_slots_hold():
    vocab = 64
    rng = np.random.default_rng(1)
    row = rng.normal(size=vocab).astype(np.float32) * 0.5
    params = SamplingParams(temperature=1.0, top_p=0.95, presence_penalty=0.3)

    # Run A: seed 123 in slot 0; the others greedy / other seeds.
    state = init_sampling_state(3, vocab)
    state = set_slot(state, 0, params, [1, 2, 3], seed=123)
    state = set_slot(state, 1, SamplingParams(temperature=0.0), [5], seed=7)
    state = set_slot(state, 2, SamplingParams(temperature=1.5, top_k=5), [], seed=8)
    logits = np.stack([row, rng.normal(size=vocab), rng.normal(size=vocab)]).astype(np.float32)
    tokens_a, _ = run_steps(jnp.asarray(logits), state, 6)

    # Run B: the same request in slot 2, different neighbours with other logits, after slot 2
    # served another request first (set_slot must reset its stream).
    state = init_sampling_state(3, vocab)
    state = set_slot(state, 2, SamplingParams(temperature=1.0), [9], seed=5)
    _, state = run_steps(jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32), state, 2)
    state = set_slot(state, 2, params, [1, 2, 3], seed=123)
    state = set_slot(state, 0, SamplingParams(temperature=0.8, min_p=0.1), [0], seed=2**40 + 123)
    logits = np.stack([rng.normal(size=vocab), rng.normal(size=vocab), row]).astype(np.float32)
    tokens_b, _ = run_steps(jnp.asarray(logits), state, 6)
    np.testing.assert_array_equal(tokens_a[0], tokens_b[2])

    # A different seed gives a different sequence; so does a seed differing only in the high bits.
    for other_seed in (124, 2**40 + 123):
        state = set_slot(init_sampling_state(3, vocab), 0, params, [1, 2, 3], seed=other_seed)
        tokens_c, _ = run_steps(jnp.asarray(logits[[2, 0, 1]]), state, 6)
        assert not np.array_equal(tokens_a[0], tokens_c[0])
    # Consecutive steps differ (the key advances): with flat logits 6 equal draws are ~impossible.
    assert len(set(tokens_a[0].tolist())) > 1


def test_first_argmax_equals_argmax_on_ties_nan_and_padding():
    """The blocked argmax the sampler uses is jnp.argmax exactly: the first of tied maxima (also
    across blocks), NaN as the maximum, all -inf rows, a vocabulary the block does not divide."""
    rng = np.random.default_rng(5)
    rows = rng.integers(-3, 4, size=(7, 300)).astype(np.float32)  # many ties, across blocks of 128
    rows[1, [5, 200]] = np.nan
    rows[2, :] = -np.inf
    rows[3, 290:] = 9.0  # the maximum only in the last, partial block
    rows[4, [0, 128, 256]] = 9.0
    rows[5, :] = 0.0
    rows[5, 129] = -0.0  # -0.0 == 0.0: still the first position
    first = jax.jit(sampling.first_argmax, static_argnames="block")
    for values in (rows, rows.reshape(7, 2, 150), rows[:, :256]):
        expected = np.asarray(jnp.argmax(jnp.asarray(values), axis=-1))
        for block in (128, 16):
            got = np.asarray(first(jnp.asarray(values), block=block))
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.asarray(first(jnp.asarray(rows)))[1:6], [5, 0, 290, 0, 0])
    # The draw built on it is jax.random.categorical's, token for token.
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(64, 300)), jnp.float32)
    keys = jax.random.split(jax.random.key(7), 64)
    ours = jax.jit(jax.vmap(sampling.categorical))(keys, logits)
    reference = jax.vmap(jax.random.categorical)(keys, logits)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    vocab = 32
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 2.0
    state = init_sampling_state(3, vocab)
    state = set_slot(state, 0, SamplingParams(temperature=0.0, repetition_penalty=3.0),
                     list(range(vocab)), seed=0)
    state = set_slot(state, 1, SamplingParams(temperature=0.3, top_k=4, presence_penalty=2.0), [], seed=1)
    state = set_slot(state, 2, SamplingParams(temperature=2.0, top_p=0.5), [], seed=2)
    expected = log_softmax(logits)
    for n in (N_TOP, 0):
        tokens, token_lp, top_ids, top_lp, _ = sample(jnp.asarray(logits), state, n)
        tokens = np.asarray(tokens)
        assert tokens.dtype == np.int32 and token_lp.dtype == np.float32
        np.testing.assert_allclose(np.asarray(token_lp), expected[np.arange(3), tokens], atol=1e-5)
        assert top_ids.shape == (3, n) and top_lp.shape == (3, n) and top_ids.dtype == np.int32
        best = np.argsort(-expected, axis=-1)[:, :n]
        np.testing.assert_array_equal(np.asarray(top_ids), best)
        np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(expected, best, -1), atol=1e-5)
        assert np.all(np.diff(np.asarray(top_lp), axis=-1) <= 0)


# --- state --------------------------------------------------------------------------------------


def test_output_counts_and_set_slot_resets_only_its_slot():
    vocab = 8
    rng = np.random.default_rng(3)
    state = init_sampling_state(3, vocab)
    for slot in range(3):
        state = set_slot(state, slot, SamplingParams(temperature=1.0), [slot], seed=slot)
    tokens, state = run_steps(jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32), state, 7)
    counts = np.asarray(state.output_counts)
    # The keys advance: with unchanged logits and no penalties a slot's draws still vary.
    assert all(len(set(row.tolist())) > 1 for row in tokens)
    expected = np.stack([np.bincount(row, minlength=vocab) for row in tokens])
    np.testing.assert_array_equal(counts, expected)
    assert counts.sum() == 21

    # advance: only the masked slots count their token and split their key; no logprobs wanted:
    # the same tokens, zeros for the log-probabilities.
    logits = jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32)
    keep = jnp.array([True, False, True])
    all_tokens, all_lp, _, _, _ = sample(logits, state, N_TOP % vocab)
    tokens, token_lp, top_ids, top_lp, advanced = sample(logits, state, N_TOP % vocab, jnp.bool_(False), keep)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(all_tokens))
    assert not any(np.any(np.asarray(value)) for value in (token_lp, top_lp, top_ids))
    assert np.any(np.asarray(all_lp))
    moved = np.asarray(advanced.output_counts) - counts
    np.testing.assert_array_equal(moved.sum(axis=1), [1, 0, 1])
    np.testing.assert_array_equal(moved[[0, 2], np.asarray(tokens)[[0, 2]]], [1, 1])
    np.testing.assert_array_equal(np.asarray(advanced.keys)[1], np.asarray(state.keys)[1])
    assert np.all(np.asarray(advanced.keys)[[0, 2]] != np.asarray(state.keys)[[0, 2]])

    before = jax.tree.map(np.asarray, state)
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=3, min_p=0.05, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=-0.2)
    state = set_slot(state, 1, params, [4, 6, 6], seed=99)
    after = jax.tree.map(np.asarray, state)
    for name in before.__dataclass_fields__:
        old, new = getattr(before, name), getattr(after, name)
        np.testing.assert_array_equal(new[[0, 2]], old[[0, 2]], err_msg=name)
    assert np.all(after.output_counts[1] == 0)
    np.testing.assert_array_equal(after.prompt_mask[1], [i in (4, 6) for i in range(vocab)])
    np.testing.assert_allclose(
        [after.temperature[1], after.top_p[1], after.min_p[1], after.repetition_penalty[1],
         after.presence_penalty[1], after.frequency_penalty[1]], [0.5, 0.9, 0.05, 1.3, 0.4, -0.2],
        rtol=1e-6)
    assert after.top_k[1] == 3
    np.testing.assert_array_equal(after.keys[1], np.asarray(make_keys([99]))[0])


def test_init_state_is_neutral_and_set_slot_compiles_once():
    state = init_sampling_state(4, V_SMALL)
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(4, V_SMALL)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, state)), np.asarray(logits))
    assert state.keys.shape == (4, 2) and state.keys.dtype == jnp.uint32

    from glm5_jax.engine import sampling

    state = set_slot(state, 0, SamplingParams(), [1], seed=1)
    compiled = sampling._set_slot._cache_size()
    for slot in (1, 3, 2):
        state = set_slot(state, slot, SamplingParams(top_k=2, seed=5), [0, 2], seed=2**63 + slot)
    assert sampling._set_slot._cache_size() == compiled


def test_set_slot_rejects_bad_input():
    state = init_sampling_state(2, V_SMALL)
    with pytest.raises(InvalidRequestError, match="top_p"):
        set_slot(state, 0, SamplingParams(top_p=0.0), [], seed=0)
    with pytest.raises(InvalidRequestError, match="prompt"):
        set_slot(state, 0, SamplingParams(), [V_SMALL], seed=0)
    with pytest.raises(ValueError, match="slot"):
        set_slot(state, 2, SamplingParams(), [], seed=0)


def test_slot_options_are_the_per_slot_fields_of_the_state():
    from glm5_jax.engine.sampling import SlotOptions, slot_options

    state = init_sampling_state(2, V_SMALL)
    assert isinstance(state, SlotOptions)  # the state holds every slot's options
    assert set(slot_options(state)) < {f.name for f in dataclasses.fields(state)}
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=V_SMALL + 3, min_p=0.05, repetition_penalty=1.5,
                            presence_penalty=0.25, frequency_penalty=-0.5)
    state = set_slot(state, 1, params, [], seed=0)
    for name, value in slot_options(SlotOptions.of(params, V_SMALL)).items():
        row = np.asarray(getattr(state, name))
        assert row[1] == value and row.dtype == np.asarray(value).dtype, name
        assert row[0] == np.asarray(getattr(init_sampling_state(2, V_SMALL), name))[0], name
    assert int(state.top_k[1]) == V_SMALL  # capped at the vocabulary
