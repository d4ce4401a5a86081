"""Tests for staged data mixtures (glm5_jax/data/schedule.py, `config.data.schedule`).

Real pipelines use tiny synthetic sources: lower-case and upper-case word documents (a row's
tokens tell which source or kind of document it came from) and a ~300-token BPE. Streams hold a
few hundred documents each: grain's index shuffle costs milliseconds per element on streams of a
handful of documents. The 10k-row proportion check runs the scheduler on stub row streams.
"""

import json
import random

import grain
import ml_collections
import numpy as np
import pytest

from glm5_jax.data import SourceSpec, make_train_iterator, train_bpe_tokenizer
from glm5_jax.data.schedule import ScheduledBatches, ScheduleError, schedule_from_config
from glm5_jax.data.sources import DataSourceError
from glm5_jax.prepare.writer import write_shards

SEQ_LEN = 16
DOCS = 300  # per source


def _words(rng: random.Random, upper: bool) -> str:
    letters = "ABCDEFGHIJ" if upper else "abcdefghij"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(2, 6))
    )


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    rng = random.Random(0)
    lower = [_words(rng, upper=False) for _ in range(DOCS)]
    upper = [_words(rng, upper=True) for _ in range(DOCS)]
    _write_jsonl(root / "lower.jsonl", lower)
    _write_jsonl(root / "upper.jsonl", upper)
    # A prepared source whose upper-case documents are the hard ones (difficulty 1, else 0).
    graded = [(text, 0.0) for text in lower] + [(text, 1.0) for text in upper]
    records = [
        {
            "id": f"graded/{index}",
            "text": text,
            "domain": "prose",
            "source": "synthetic",
            "quality": None,
            "difficulty": difficulty,
        }
        for index, (text, difficulty) in enumerate(graded)
    ]
    (root / "graded").mkdir()
    write_shards(records, root / "graded", docs_per_shard=256)
    tokenizer = train_bpe_tokenizer(lower + upper, vocab_size=300)
    # Per token id: 1 if its text has lower-case letters, 2 upper-case, 0 neither (space, end of text).
    kinds = np.zeros(tokenizer.get_vocab_size(), np.int64)
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id])
        kinds[token_id] = 2 if any(c.isupper() for c in text) else 1 if any(c.islower() for c in text) else 0
    return {
        "lower": SourceSpec(kind="jsonl", paths=(str(root / "lower.jsonl"),), name="lower"),
        "upper": SourceSpec(kind="jsonl", paths=(str(root / "upper.jsonl"),), name="upper"),
        "graded": SourceSpec(kind="prepared", paths=(str(root / "graded"),), name="graded"),
        "tokenizer": tokenizer,
        "kinds": kinds,
        "root": root,
    }


def _iterator(data, names, stages, batch_size=2):
    sources = [data[name] for name in names]
    return make_train_iterator(
        sources,
        data["tokenizer"],
        seq_len=SEQ_LEN,
        batch_size=batch_size,
        seed=0,
        validation_fraction=0.1,
        schedule=schedule_from_config(stages, sources),
    )


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def _upper_lower_tokens(data, batch):
    """[rows, 2]: each row's count of upper-case and lower-case word tokens."""
    kinds = data["kinds"][batch["input_ids"]] * (batch["segment_ids"] > 0)
    return np.stack([(kinds == 2).sum(axis=1), (kinds == 1).sum(axis=1)], axis=1)


def _stub_rows(source: int, first_stage: int, difficulty_weight: float) -> grain.IterDataset:
    """Rows [SEQ_LEN] carrying (source, first stage, position in the stream) in input_ids[:3]."""
    del difficulty_weight

    def row(index):
        ids = np.zeros(SEQ_LEN, np.int32)
        ids[:3] = source, first_stage, index
        return {"input_ids": ids}

    return grain.MapDataset.range(10**9).map(row).to_iter_dataset(grain.ReadOptions(num_threads=0))


def test_stage_proportions_within_2_percent_over_10k_rows_and_exact_switches():
    sources = [SourceSpec(kind="files", paths=("unused",), name=name) for name in ("web", "code", "papers")]
    stages = [
        dict(until_step=1250, weights=dict(web=3.0, code=1.0)),
        dict(until_step=2500, weights=dict(web=1.0, code=2.0, papers=1.0)),
        dict(weights=dict(code=0.15, papers=0.85)),
    ]
    schedule = schedule_from_config(stages, sources)
    batches = ScheduledBatches(schedule, _stub_rows, rows_per_step=8)
    ids = np.stack([next(batches)["input_ids"][:, :3] for _ in range(3750)])  # [steps, 8, 3]
    sources_per_stage = ids[:, :, 0].reshape(3, 10_000)  # 1250 steps of 8 rows each
    for stage, expected in enumerate([(0.75, 0.25, 0.0), (0.25, 0.5, 0.25), (0.0, 0.15, 0.85)]):
        shares = np.bincount(sources_per_stage[stage], minlength=3) / 10_000
        np.testing.assert_allclose(shares, expected, atol=0.02)
        np.testing.assert_allclose(shares, expected, atol=1e-4)  # the interleave is exact to a row
        logged = schedule.describe(stage)
        assert logged["data/stage"] == stage
        assert [logged[f"data/weight/{name}"] for name in ("web", "code", "papers")] == pytest.approx(
            expected
        )
    # The switches fall on the exact steps: no papers row before step 1250, no web row from 2500.
    assert not (ids[:1250, :, 0] == 2).any() and (ids[1250, :, 0] == 2).any()
    assert (ids[2499, :, 0] == 0).any() and not (ids[2500:, :, 0] == 0).any()
    assert [schedule.stage_at(step) for step in (0, 1249, 1250, 2499, 2500, 10**6)] == [0, 0, 1, 1, 2, 2]
    assert schedule.stage_starts(1250) and not schedule.stage_starts(1251)
    assert "data/stage_until_step" not in schedule.describe(2)
    # Each source's stream continues across stages (no difficulty change): positions count up.
    for source in range(3):
        positions = ids[:, :, 2][ids[:, :, 0] == source]
        assert np.array_equal(positions, np.arange(len(positions)))


def test_stage_switch_at_the_exact_step(data):
    stages = [dict(until_step=3, weights=dict(lower=1.0)), dict(weights=dict(upper=1.0))]
    counts = [
        _upper_lower_tokens(data, batch) for batch in _take(_iterator(data, ["lower", "upper"], stages), 6)
    ]
    assert all(count[:, 0].sum() == 0 and count[:, 1].all() for count in counts[:3])  # steps 1-3: lower only
    assert all(
        count[:, 1].sum() == 0 and count[:, 0].all() for count in counts[3:]
    )  # from step 4: upper only


def test_resume_mid_stage_reproduces_the_uninterrupted_run(data):
    """Stages switch sources and difficulty weights (a new `graded` stream at stages 1 and 2); a state
    saved at any step, JSON round-tripped and restored into a new iterator continues bit for bit."""
    names = ["lower", "upper", "graded"]
    stages = [
        dict(until_step=2, weights=dict(lower=1.0, graded=1.0)),
        dict(
            until_step=4, weights=dict(lower=1.0, upper=1.0, graded=2.0), difficulty_weight=dict(graded=2.0)
        ),
        dict(weights=dict(upper=1.0, graded=1.0)),
    ]
    iterator = _iterator(data, names, stages, batch_size=4)
    states, batches = [], []
    for _ in range(6):
        states.append(json.loads(json.dumps(iterator.get_state())))
        batches.append(next(iterator))
    assert [state["stage"] for state in states] == [0, 0, 1, 1, 2, 2]
    graded = states[3]["sources"]["graded"]  # the difficulty-weighted stream
    assert (graded["first_stage"], graded["difficulty_weight"]) == (1, 2.0)
    for taken in (1, 2, 3, 5):  # mid stage 0, on a boundary, mid stage 1, mid stage 2
        restored = _iterator(data, names, stages, batch_size=4)
        restored.set_state(states[taken])
        for expected, got in zip(batches[taken:], _take(restored, 6 - taken), strict=True):
            assert all(np.array_equal(expected[key], got[key]) for key in expected)
    again = _take(_iterator(data, names, stages, batch_size=4), 6)  # and a fresh run is the same run
    assert all(np.array_equal(a[key], b[key]) for a, b in zip(batches, again, strict=True) for key in a)
    with pytest.raises(ValueError, match="data.schedule"):
        restored.set_state({"parents": [], "index": 0, "stop": False})  # a state without a schedule


def test_difficulty_weight_raises_the_share_of_hard_documents(data):
    """Half of `graded` is hard (difficulty 1): exp(2 * difficulty) sampling should draw it with
    probability e^2 / (1 + e^2) = 0.88, against 0.5 for plain shuffled epochs."""
    stages = [
        dict(until_step=25, weights=dict(graded=1.0)),
        dict(weights=dict(graded=1.0), difficulty_weight=2.0),
    ]
    counts = np.stack(
        [
            _upper_lower_tokens(data, batch).sum(axis=0)
            for batch in _take(_iterator(data, ["graded"], stages, batch_size=4), 50)
        ]
    )
    uniform, weighted = (counts[:25].sum(axis=0), counts[25:].sum(axis=0))
    uniform_share, weighted_share = uniform[0] / uniform.sum(), weighted[0] / weighted.sum()
    assert 0.35 < uniform_share < 0.65
    assert weighted_share > 0.78 and weighted_share > uniform_share + 0.2


def test_bad_schedules_name_the_field(data, tmp_path):
    sources = [data["lower"], data["graded"]]

    def error(stages, match, sources=sources):
        with pytest.raises(ScheduleError, match=match):
            schedule_from_config(stages, sources)

    error(
        [dict(until_step=5, weights=dict(lower=1.0)), dict(weights=dict(lowr=1.0))],
        r"data.schedule\[1\].weights: unknown source 'lowr'",
    )
    error(
        [
            dict(until_step=5, weights=dict(lower=1.0)),
            dict(until_step=5, weights=dict(lower=1.0)),
            dict(weights=dict(lower=1.0)),
        ],
        r"data.schedule\[1\].until_step \(5\) must be greater",
    )
    error([dict(weights=dict(lower=1.0)), dict(weights=dict(lower=1.0))], r"data.schedule\[0\].until_step")
    error(
        [dict(until_step=5, weights=dict(lower=1.0)), dict(until_step=9, weights=dict(lower=1.0))],
        r"data.schedule\[1\].until_step: the last stage",
    )
    error(
        [dict(until_step=0, weights=dict(lower=1.0)), dict(weights=dict(lower=1.0))],
        r"data.schedule\[0\].until_step must be an integer >= 1",
    )
    error([dict(weights=dict(lower=-1.0, graded=2.0))], r"data.schedule\[0\].weights\['lower'\] must be >= 0")
    error([dict(weights=dict(lower=0.0))], r"data.schedule\[0\].weights: the total weight must be > 0")
    error([dict(weights=dict(lower=float("nan")))], r"data.schedule\[0\].weights\['lower'\] must be a finite")
    error([dict(weights=dict(lower=1.0), mix=2)], r"data.schedule\[0\]: unknown key\(s\) \['mix'\]")
    error([dict(difficulty_weight=0.0)], r"data.schedule\[0\].weights is missing")
    error(
        [dict(weights=dict(lower=1.0), difficulty_weight=1.0)], r"difficulty_weight applies to source 'lower'"
    )
    error(
        [dict(weights=dict(graded=1.0), difficulty_weight=dict(grade=1.0))],
        r"data.schedule\[0\].difficulty_weight: unknown source 'grade'",
    )
    error(dict(weights=dict(lower=1.0)), "data.schedule must be a list")
    error(
        [dict(weights=dict(lower=1.0))],
        "names .'lower'. appear more than once",
        [data["lower"], data["lower"]],
    )
    assert schedule_from_config(None, sources) is None and schedule_from_config([], sources) is None
    # A ConfigDict (what train.py passes) works; a number difficulty_weight covers the weighted sources.
    config = ml_collections.ConfigDict(
        dict(schedule=[dict(weights=dict(lower=0.0, graded=1.0), difficulty_weight=1.5)])
    )
    (stage,) = schedule_from_config(config.schedule, sources).stages
    assert stage.weights == (0.0, 1.0) and stage.difficulty_weights == (0.0, 1.5)
    # A prepared record without a score fails when the iterator is built, naming the record.
    write_shards(
        [
            {"id": f"plain/{index}", "text": "abc def", "domain": "prose", "source": "s", "quality": None}
            for index in range(3)
        ],
        tmp_path,
        docs_per_shard=8,
    )
    plain = SourceSpec(kind="prepared", paths=(str(tmp_path),), name="plain")
    with pytest.raises(DataSourceError, match="'plain'.*'plain/0' has no finite 'difficulty'"):
        make_train_iterator(
            [plain],
            data["tokenizer"],
            seq_len=SEQ_LEN,
            batch_size=2,
            seed=0,
            validation_fraction=0.0,
            schedule=schedule_from_config([dict(weights=dict(plain=1.0), difficulty_weight=1.0)], [plain]),
        )
