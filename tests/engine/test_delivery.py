"""Per-request delivery (glm5_jax/engine/delivery.py) gives exactly the events per-token delivery
gave: on random device outputs against a transcription of the per-token loop (stop ids, EOS,
ignore_eos, lengths and the device's -1 rows inside a multi-step call, log-probabilities), and on a
real engine with multi-step calls, sampled and greedy, against the same requests' own unstopped
outputs; plus `decode_inputs` on the row cache against rows built one by one."""

import dataclasses

import numpy as np
import pytest
from reference import perturbed_params
from streams import run_together

from glm5_jax.engine.batches import RowCache, decode_inputs, stop_ids
from glm5_jax.engine.delivery import Burst, accept, stop_set
from glm5_jax.engine.engine import Engine
from glm5_jax.engine.observer import EngineObserver
from glm5_jax.engine.runner import MAX_STOP_IDS
from glm5_jax.engine.scheduler import DecodePlan, Sequence
from glm5_jax.engine.types import GenerationEvent, SamplingParams

pytestmark = pytest.mark.xdist_group("delivery")

EOS = (7,)
STEPS, ROWS, TOP = 8, 6, 4


def per_token_events(tokens, logprobs, top_ids, top_logprobs, rows):
    """The engine's former per-token delivery, step by step over the rows (rows: per row
    [params, generated, max_new]); returns each row's events."""
    events = [[] for _ in rows]
    ended = [False] * len(rows)
    for step in range(tokens.shape[0]):
        for row, state in enumerate(rows):
            token = int(tokens[step, row])
            if token < 0 or ended[row]:
                continue
            params = state[0]
            state[1] += 1
            alternatives = ()
            if params.logprobs:
                pairs = zip(top_ids[step, row][:params.logprobs], top_logprobs[step, row][:params.logprobs],
                            strict=True)
                alternatives = tuple((int(i), float(p)) for i, p in pairs)
            reason = None
            if (token in EOS and not params.ignore_eos) or token in params.stop_token_ids:
                reason = "stop"
            elif state[1] >= state[2]:
                reason = "length"
            logprob = float(logprobs[step, row]) if params.logprobs is not None else None
            events[row].append(GenerationEvent(token, logprob, alternatives, reason,
                                               cached_tokens=5 if reason else 0))
            ended[row] = reason is not None
    return events


def per_request_events(tokens, logprobs, top_ids, top_logprobs, rows):
    """The same through `accept` and `Burst`, as Engine._complete_decode does it."""
    events = []
    for row, (params, generated, max_new) in enumerate(rows):
        column = tokens[:, row].tolist()
        steps = [step for step, token in enumerate(column) if token >= 0]
        column = [column[step] for step in steps]
        if not column:
            events.append([])
            continue
        count, reason = accept(column, generated, max_new, stop_set(params, EOS))
        where = (steps, row)
        burst = Burst(column[:count], cached_tokens=5 if reason else 0, finish_reason=reason)
        if params.logprobs is not None:
            burst = burst._replace(logprobs=logprobs[where][:count])
            if params.logprobs:
                burst = burst._replace(top_ids=top_ids[where][:count, :params.logprobs],
                                       top_logprobs=top_logprobs[where][:count, :params.logprobs])
        events.append(burst.events())
    return events


@pytest.mark.parametrize("seed", range(40))
def test_per_request_delivery_equals_per_token_delivery(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 12, (STEPS, ROWS)).astype(np.int32)  # small ids: stops and EOS are common
    for row in range(ROWS):  # the device stopped some rows (-1 from then on), speculation leaves holes
        kind = rng.integers(4)
        if kind == 1:
            tokens[rng.integers(STEPS):, row] = -1
        elif kind == 2:
            tokens[rng.random(STEPS) < 0.3, row] = -1
    logprobs = rng.normal(size=(STEPS, ROWS)).astype(np.float32)
    top_ids = rng.integers(0, 100, (STEPS, ROWS, TOP)).astype(np.int32)
    top_logprobs = rng.normal(size=(STEPS, ROWS, TOP)).astype(np.float32)
    rows = []
    for _ in range(ROWS):
        stops = tuple(rng.choice(12, rng.integers(0, 3), replace=False).tolist())
        params = SamplingParams(stop_token_ids=stops, ignore_eos=bool(rng.integers(2)),
                                logprobs=[None, 0, 2, TOP][rng.integers(4)])
        generated = int(rng.integers(0, 10))
        rows.append([params, generated, generated + int(rng.integers(1, 12))])
    expected = per_token_events(tokens, logprobs, top_ids, top_logprobs, [list(r) for r in rows])
    assert per_request_events(tokens, logprobs, top_ids, top_logprobs, rows) == expected


def test_accept_cases():
    stops = frozenset({3, 7})
    assert accept([1, 2, 3, 4], 0, 10, stops) == (3, "stop")
    assert accept([1, 2, 3, 4], 0, 2, stops) == (2, "length")  # the stop comes after the length
    assert accept([1, 2, 3, 4], 0, 3, stops) == (3, "stop")  # the same token: stop wins
    assert accept([1, 2, 4], 5, 20, stops) == (3, None)
    assert accept([1, 2, 4], 5, 8, stops) == (3, "length")

    class Matcher:  # completes at its third token
        def __init__(self):
            self.seen = []

        def advance(self, token):
            self.seen.append(token)
            return len(self.seen) == 3

    matcher = Matcher()
    assert accept([1, 2, 4, 5, 6], 0, 10, stops, matcher) == (3, "stop")
    assert matcher.seen == [1, 2, 4]  # advanced by the tokens taken, no further


def test_burst_events_carry_first_and_last_fields():
    burst = Burst([4, 5], np.array([-0.5, -1.0], np.float32), None, None, "length", 3,
                  prompt_logprobs=((None, ()),))
    first, last = burst.events()
    assert first == GenerationEvent(4, -0.5, (), None, 0, None, ((None, ()),))
    assert last == GenerationEvent(5, -1.0, (), "length", 3)


class _Pages:
    def __init__(self, table_width):
        self.table_width = table_width

    def padding_decode(self, rows):
        return {"tokens": np.zeros(rows, np.int32), "positions": np.full(rows, -1, np.int32),
                "tables": np.zeros((rows, self.table_width), np.int32), "slots": np.zeros(rows, np.int32),
                "remaining": np.zeros(rows, np.int32),
                "stop_ids": np.full((rows, MAX_STOP_IDS), -1, np.int32)}


@dataclasses.dataclass
class _Payload:
    stream: object
    constrained: object = None
    after_token: int | None = None


@dataclasses.dataclass
class _Stream:
    params: SamplingParams


def test_decode_inputs_from_the_row_cache_equal_rows_built_one_by_one():
    rng = np.random.default_rng(0)
    width, page_size, max_slots = 6, 4, 5
    runner, cache = _Pages(width), RowCache(max_slots, width, EOS)
    sequences = []
    for slot in (3, 0, 4):
        params = SamplingParams(stop_token_ids=tuple(range(slot)), ignore_eos=slot == 0)
        sequence = Sequence(f"r{slot}", rng.integers(0, 50, 9).tolist(), 5, 20, slot=slot, computed=8,
                            generated=4, pages=[slot * 10, slot * 10 + 1, slot * 10 + 2],
                            payload=_Payload(_Stream(params)))
        sequences.append(sequence)

    def check():
        inputs, limits = decode_inputs(runner, cache, DecodePlan(sequences, 8, []), max_slots, page_size)
        assert len(limits) == 4  # the decode bucket holding 3 rows (1, 4, 5)
        for row, sequence in enumerate(sequences):
            table = np.zeros(width, np.int32)
            table[:len(sequence.pages)] = sequence.pages
            ids = stop_ids(sequence, EOS)
            np.testing.assert_array_equal(inputs["tables"][row], table)
            np.testing.assert_array_equal(inputs["stop_ids"][row], ids + [-1] * (MAX_STOP_IDS - len(ids)))
            assert (inputs["tokens"][row], inputs["positions"][row], inputs["slots"][row]) == \
                (sequence.tokens[-1], sequence.computed, sequence.slot)
            assert inputs["remaining"][row] == sequence.max_new - sequence.generated
            assert limits[row] == len(sequence.pages) * page_size
        assert inputs["positions"][3] == -1 and limits[3] == 0  # padding

    check()
    sequences[0].pages.append(99)  # grown in place
    sequences[1].pages = [7]  # freed and re-admitted: a new list
    sequences[2] = Sequence("new", [1, 2], 1, 3, slot=4, computed=1, pages=[5],  # a new request in slot 4
                            payload=_Payload(_Stream(SamplingParams(stop_token_ids=(9,)))))
    check()


# ------------------------------------------------------------------ a real engine
class Recorder(EngineObserver):
    def __init__(self):
        self.first, self.finished = [], []

    def on_first_token(self, request_id, seconds):
        self.first.append(request_id)

    def on_finished(self, request_id, reason, prompt_tokens, cached_tokens, generated, seconds):
        self.finished.append((request_id, reason, generated))


@pytest.fixture(scope="module")
def engine(tiny_config):
    config = tiny_config.replace(num_mtp_layers=0, eos_token_ids=[255])
    observer = Recorder()
    engine = Engine(config, perturbed_params(config, 5), None, max_slots=4, max_context=48, seed=0,
                    token_budget=16, decode_steps=8, observer=observer)
    yield engine, observer
    engine.shutdown()


@pytest.mark.parametrize(("temperature", "logprobs"), [(0.0, 2), (0.9, 2), (0.9, None)])
def test_stops_inside_multi_step_calls(engine, temperature, logprobs):
    """Each request's events with a stop id or a length inside a multi-step call equal its
    unstopped run's events cut there (tokens, logprobs, top_logprobs), ending with the right reason;
    the observer hears of each first token and end once. (EOS and ignore_eos: the random test.)"""
    engine, observer = engine
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 200, n).tolist() for n in (5, 11, 3, 8)]
    base = [SamplingParams(max_tokens=30, temperature=temperature, seed=10 + i, logprobs=logprobs,
                           ignore_eos=True) for i in range(len(prompts))]
    full = run_together(engine, list(zip(prompts, base, strict=True)))
    assert all(len(events) == 30 for events in full)
    for events in full:
        assert [e.finish_reason for e in events] == [None] * 29 + ["length"]
        if logprobs is None:
            assert all(e.logprob is None and e.top_logprobs == () for e in events)
        else:
            assert all(e.logprob is not None and len(e.top_logprobs) == logprobs for e in events)
    # A stop id first met at positions 2..13 (inside the first and second multi-step calls: the
    # first token comes from the prefill step), a length of 11, and a stop id that is also EOS.
    cut_params, cuts = [], []
    for i, events in enumerate(full):
        tokens = [e.token_id for e in events]
        if i == 1:
            cut_params.append(dataclasses.replace(base[i], max_tokens=11))
            cuts.append((11, "length"))
            continue
        position = next((p for p in range(2 + i, 30) if tokens[p] not in tokens[:p]), None)
        assert position is not None
        stop = tokens[position]
        if i == 3:
            cut_params.append(dataclasses.replace(base[i], ignore_eos=False, stop_token_ids=(stop,)))
        else:
            cut_params.append(dataclasses.replace(base[i], stop_token_ids=(stop, 100000)))
        cuts.append((position + 1, "stop"))
    observer.first.clear()
    observer.finished.clear()
    cut = run_together(engine, list(zip(prompts, cut_params, strict=True)))
    for events, whole, (length, reason) in zip(cut, full, cuts, strict=True):
        expected = [dataclasses.replace(e, finish_reason=None, cached_tokens=0) for e in whole[:length]]
        expected[-1] = dataclasses.replace(expected[-1], finish_reason=reason,
                                           cached_tokens=events[-1].cached_tokens)
        assert events == expected
    assert len(observer.first) == len(set(observer.first)) == 4
    assert sorted((reason, generated) for _, reason, generated in observer.finished) == \
        sorted(cuts[i][::-1] for i in range(4))
