"""Staged data mixtures: source weights (and difficulty up-weighting) that change at step boundaries.

`config.data.schedule` is a list of stages; every stage but the last ends at an `until_step`, the
last runs to the end of training:

    schedule = [
        dict(until_step=1000, weights=dict(web=1.0, code=1.0)),
        dict(until_step=4000, weights=dict(web=1.0, code=3.0), difficulty_weight=1.0),
        dict(weights=dict(code=1.0), difficulty_weight=dict(code=2.0)),
    ]

A stage trains the steps after the previous stage's `until_step` up to and including its own (the
first stage from step 1). `weights` are the shares of rows (tokens) per source name (>= 0; a source
left out gets 0; the total must be > 0); with a schedule the sources' own `weight` is not used.
`difficulty_weight` (default 0) up-weights hard documents within a source: a document is drawn with
probability proportional to exp(difficulty_weight * difficulty), with replacement, where difficulty
is its score in a `prepared` source's records (field DIFFICULTY_FIELD: bits per byte under a
reference model, written by prepare's difficulty stage); 0 keeps the plain shuffled epochs. A
number applies to every source with a positive weight in the stage; a mapping names sources.

Rows are assigned to sources by a fixed interleave of the stage's weights (the same evenly spread
pattern as grain's `IterDataset.mix`, restarted at each stage), a pure function of the row's index
within its stage, so a stage's row counts are within a row per source of share x rows, and stage
switches fall on the exact step whatever the run's history. A source's document stream continues
across stages while its difficulty weight stays the same (a stage that gives it weight 0 does not
count as a change); a new difficulty weight starts a new stream seeded by (seed, stage). The
iterator's state holds the step, the stage and each started source's stream state, so a run
resumed anywhere reproduces the uninterrupted one.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from glm5_jax.data.prepared import DIFFICULTY_FIELD
from glm5_jax.data.sources import DataSourceError, Document, SourceSpec, resolve_source_files

_STAGE_KEYS = ("until_step", "weights", "difficulty_weight")
# Stage weights become integer proportions of this total: shares exact to about 1e-6.
_PROPORTION_SCALE = 2**20


class ScheduleError(ValueError):
    """A data.schedule is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a MixtureSchedule.

    Attributes:
        until_step: the last step of the stage (None: the last stage, open-ended).
        weights: per source (in the sources' order), >= 0 with a positive total.
        difficulty_weights: per source, the exponent on difficulty scores (0: uniform).
    """

    until_step: int | None
    weights: tuple[float, ...]
    difficulty_weights: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class MixtureSchedule:
    """Mixture weights per training stage over named sources (build with schedule_from_config)."""

    source_names: tuple[str, ...]
    stages: tuple[Stage, ...]

    @functools.cached_property
    def _boundaries(self) -> list[int]:
        return [stage.until_step for stage in self.stages[:-1]]

    def stage_at(self, step: int) -> int:
        """The stage that supplies the batch of step `step + 1`, i.e. batch index `step` (0-based)."""
        return bisect.bisect_right(self._boundaries, step)

    def start_step(self, stage: int) -> int:
        """The number of steps trained before `stage` begins."""
        return 0 if stage == 0 else self._boundaries[stage - 1]

    def stage_starts(self, step: int) -> bool:
        """True when batch index `step` is the first of its stage."""
        return step == self.start_step(self.stage_at(step))

    @functools.cached_property
    def _proportions(self) -> list[tuple[tuple[int, int], ...]]:
        """Per stage, (source index, integer proportion) for the sources with a positive weight."""
        result = []
        for stage in self.stages:
            total = sum(stage.weights)
            result.append(
                tuple(
                    (index, max(1, round(weight / total * _PROPORTION_SCALE)))
                    for index, weight in enumerate(stage.weights)
                    if weight > 0
                )
            )
        return result

    def source_of_row(self, stage: int, row: int) -> int:
        """The source index of row `row` (0-based, counted from the start of `stage`).

        Grain's interleave (mix.py `_dataset_and_key_of_next_element`): the first source takes rows
        where ceil(row * p / total) steps up, the others share the remaining rows the same way, so
        every source's rows are evenly spread; after n rows the first source's count is within 1 of
        n * share, and each later one adds at most 1 to the error of the ones before.
        """
        proportions = self._proportions[stage]
        remaining = sum(proportion for _, proportion in proportions)
        before, after = row, row + 1
        for index, proportion in proportions:
            next_before = before * (remaining - proportion) // remaining
            next_after = after * (remaining - proportion) // remaining
            if before - next_before != after - next_after:
                return index
            remaining -= proportion
            before, after = next_before, next_after
        raise AssertionError("unreachable: the last source takes every remaining row")

    @functools.cached_property
    def _segments(self) -> list[list[tuple[int, float]]]:
        """[source][stage] -> (stage where the source's current document stream began, its
        difficulty weight). A stage with weight 0 for the source keeps the previous stream."""
        segments = []
        for source in range(len(self.source_names)):
            current, per_stage = (0, 0.0), []
            for index, stage in enumerate(self.stages):
                exponent = stage.difficulty_weights[source] if stage.weights[source] > 0 else current[1]
                if exponent != current[1]:
                    current = (index, exponent)
                per_stage.append(current)
            segments.append(per_stage)
        return segments

    def segment(self, source: int, stage: int) -> tuple[int, float]:
        """(first stage, difficulty weight) of the document stream `source` reads in `stage`."""
        return self._segments[source][stage]

    def uses_difficulty(self, source: int) -> bool:
        return any(exponent != 0 for _, exponent in self._segments[source])

    def describe(self, stage: int) -> dict[str, float]:
        """The stage for metrics.jsonl: data/stage, data/stage_until_step (not for the last stage),
        data/weight/<source> (shares summing to 1), data/difficulty_weight/<source> (non-zero only)."""
        current = self.stages[stage]
        total = sum(current.weights)
        record = {"data/stage": stage}
        if current.until_step is not None:
            record["data/stage_until_step"] = current.until_step
        record.update(
            {
                f"data/weight/{name}": weight / total
                for name, weight in zip(self.source_names, current.weights, strict=True)
            }
        )
        record.update(
            {
                f"data/difficulty_weight/{name}": exponent
                for name, weight, exponent in zip(
                    self.source_names, current.weights, current.difficulty_weights, strict=True
                )
                if exponent != 0 and weight > 0
            }
        )
        return record


def _as_dict(values: Any, where: str) -> dict[str, Any]:
    """A plain dict from a Mapping or ConfigDict, else a ScheduleError naming `where`."""
    if isinstance(values, Mapping) or hasattr(values, "keys"):
        return {key: values[key] for key in values.keys()}
    raise ScheduleError(f"{where} must be a dict, got {type(values).__name__}")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScheduleError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _per_source(values: Any, names: Sequence[str], where: str) -> dict[int, float]:
    """{source index: number} from a mapping of source names, naming unknown names."""
    result = {}
    for name, value in _as_dict(values, where).items():
        if name not in names:
            raise ScheduleError(f"{where}: unknown source {name!r}; the sources are {list(names)}")
        result[names.index(name)] = _number(value, f"{where}[{name!r}]")
    return result


def _stage(values: Any, index: int, is_last: bool, sources: Sequence[SourceSpec]) -> Stage:
    where = f"data.schedule[{index}]"
    values = _as_dict(values, where)
    unknown = sorted(set(values) - set(_STAGE_KEYS))
    if unknown:
        raise ScheduleError(f"{where}: unknown key(s) {unknown}; expected some of {list(_STAGE_KEYS)}")
    names = [spec.name for spec in sources]
    until_step = values.get("until_step")
    if is_last and until_step is not None:
        raise ScheduleError(
            f"{where}.until_step: the last stage runs to the end of training; leave "
            f"until_step out (got {until_step!r})"
        )
    if not is_last and (isinstance(until_step, bool) or not isinstance(until_step, int) or until_step < 1):
        raise ScheduleError(
            f"{where}.until_step must be an integer >= 1 (every stage but the last "
            f"ends at a step), got {until_step!r}"
        )
    if "weights" not in values:
        raise ScheduleError(f"{where}.weights is missing: give dict(source_name=weight, ...)")
    given = _per_source(values["weights"], names, f"{where}.weights")
    for source, weight in given.items():
        if weight < 0:
            raise ScheduleError(f"{where}.weights[{names[source]!r}] must be >= 0, got {weight}")
    weights = tuple(given.get(source, 0.0) for source in range(len(names)))
    total = sum(weights)
    if total <= 0:
        raise ScheduleError(f"{where}.weights: the total weight must be > 0, got {total}")
    for source, weight in enumerate(weights):
        if 0 < weight < total / _PROPORTION_SCALE:
            raise ScheduleError(
                f"{where}.weights[{names[source]!r}] = {weight} is below "
                f"1/{_PROPORTION_SCALE} of the stage's total"
            )
    exponent = values.get("difficulty_weight", 0.0)
    if isinstance(exponent, int | float) and not isinstance(exponent, bool):
        number = _number(exponent, f"{where}.difficulty_weight")
        exponents = tuple(number if weight > 0 else 0.0 for weight in weights)
    else:
        given = _per_source(exponent, names, f"{where}.difficulty_weight")
        exponents = tuple(given.get(source, 0.0) for source in range(len(names)))
    for source, spec in enumerate(sources):
        if exponents[source] != 0 and weights[source] > 0 and spec.kind != "prepared":
            raise ScheduleError(
                f"{where}.difficulty_weight applies to source {spec.name!r} (kind {spec.kind!r}), which "
                f"has no difficulty scores: only 'prepared' sources carry a {DIFFICULTY_FIELD!r} field "
                "(give a dict naming the prepared sources)"
            )
    return Stage(until_step, weights, exponents)


def schedule_from_config(values: Any, sources: Sequence[SourceSpec]) -> MixtureSchedule | None:
    """Checks `config.data.schedule` against the sources.

    Args:
        values: the list of stage dicts (None or empty: no schedule).
        sources: the training sources; their names are the keys of the stages' weights.
    Returns:
        the MixtureSchedule, or None without a schedule.
    Raises:
        ScheduleError naming the field: unknown keys or source names, non-increasing until_step,
        negative weights or a total <= 0, difficulty weights on sources without scores.
    """
    if values is None or (isinstance(values, Sequence) and not values):
        return None
    if isinstance(values, str | Mapping) or not isinstance(values, Sequence):
        raise ScheduleError(f"data.schedule must be a list of stage dicts, got {type(values).__name__}")
    names = [spec.name for spec in sources]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ScheduleError(
            f"data.sources: names {duplicates} appear more than once; data.schedule "
            "names sources, so give each a distinct 'name'"
        )
    if any(spec.kind == "preference_jsonl" for spec in sources):
        raise ScheduleError("data.schedule: preference_jsonl sources (DPO pairs) are not mixed by a schedule")
    stages = tuple(
        _stage(stage, index, index == len(values) - 1, sources) for index, stage in enumerate(values)
    )
    for index in range(1, len(stages) - 1):
        if stages[index].until_step <= stages[index - 1].until_step:
            raise ScheduleError(
                f"data.schedule[{index}].until_step ({stages[index].until_step}) must be greater than "
                f"data.schedule[{index - 1}].until_step ({stages[index - 1].until_step})"
            )
    return MixtureSchedule(tuple(names), stages)


def document_difficulties(spec: SourceSpec, documents: Sequence[Document]) -> np.ndarray:
    """The difficulty scores of a prepared source's documents, from its shards' records.

    Args:
        spec: a source of kind "prepared".
        documents: documents of that source (e.g. this host's training shard).
    Returns:
        float64 [len(documents)], in the documents' order.
    Raises:
        DataSourceError naming the source and the first document without a finite score.
    """
    from glm5_jax.data.prepared import read_records  # array_record only when scores are used

    if spec.kind != "prepared":
        raise DataSourceError(f"source {spec.name!r} (kind {spec.kind!r}) has no difficulty scores")
    scores = {}
    for _, path in resolve_source_files(spec):
        for record in read_records(path):
            scores[record["id"]] = record.get(DIFFICULTY_FIELD)
    values = []
    for document in documents:
        score = scores.get(document.doc_id)
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise DataSourceError(
                f"source {spec.name!r}: record {document.doc_id!r} has no finite {DIFFICULTY_FIELD!r} "
                f"score (got {score!r}); data.schedule's difficulty_weight needs one on every record"
            )
        values.append(float(score))
    return np.asarray(values, dtype=np.float64)


class ScheduledBatches(grain.DatasetIterator):
    """Batches of `rows_per_step` rows, each row taken from the source the schedule assigns it.

    `make_rows(source, first_stage, difficulty_weight)` builds a source's endless row stream (a grain
    IterDataset of rows {input_ids, segment_ids, positions, loss_mask}: [seq_len]); it must depend
    only on its arguments, so a stream rebuilt on restore is the one the uninterrupted run read.
    Streams start when a stage first draws from them.
    """

    def __init__(
        self,
        schedule: MixtureSchedule,
        make_rows: Callable[[int, int, float], grain.IterDataset],
        rows_per_step: int,
    ):
        super().__init__()
        self._schedule = schedule
        self._make_rows = make_rows
        self._rows_per_step = rows_per_step
        self._step = 0
        # source -> ((first stage, difficulty weight), its row iterator)
        self._streams: dict[int, tuple[tuple[int, float], grain.DatasetIterator]] = {}

    def _start(self, source: int, segment: tuple[int, float]) -> grain.DatasetIterator:
        if source in self._streams:
            self._streams[source][1].close()
        stream = iter(self._make_rows(source, *segment))
        self._streams[source] = (segment, stream)
        return stream

    def _stream(self, source: int, stage: int) -> grain.DatasetIterator:
        segment = self._schedule.segment(source, stage)
        current = self._streams.get(source)
        if current is None or current[0] != segment:
            return self._start(source, segment)
        return current[1]

    def __next__(self) -> dict[str, np.ndarray]:
        """-> {name: [rows_per_step, seq_len]} for the next step."""
        stage = self._schedule.stage_at(self._step)
        first_row = (self._step - self._schedule.start_step(stage)) * self._rows_per_step
        rows = [
            next(self._stream(self._schedule.source_of_row(stage, first_row + offset), stage))
            for offset in range(self._rows_per_step)
        ]
        self._step += 1
        return {name: np.stack([row[name] for row in rows]) for name in rows[0]}

    def get_state(self) -> dict[str, Any]:
        """{"step", "stage", "sources": {name: {"first_stage", "difficulty_weight", "rows": the
        stream's grain state}}} for the sources whose stream has started."""
        names = self._schedule.source_names
        return {
            "step": self._step,
            "stage": self._schedule.stage_at(self._step),
            "sources": {
                names[source]: {
                    "first_stage": first_stage,
                    "difficulty_weight": exponent,
                    "rows": stream.get_state(),
                }
                for source, ((first_stage, exponent), stream) in sorted(self._streams.items())
            },
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores the saved streams as they were; a schedule edited since the save switches a
        stream at its next row only where the stream's (first stage, difficulty weight) changed."""
        if not isinstance(state, Mapping) or not {"step", "sources"} <= set(state):
            raise ValueError(
                "the data iterator state was not written with a data.schedule (it has no "
                "'step' and 'sources'); resume with the run's original data config"
            )
        names = self._schedule.source_names
        unknown = sorted(set(state["sources"]) - set(names))
        if unknown:
            raise ValueError(
                f"the data iterator state names sources {unknown} that are not in data.sources {list(names)}"
            )
        for _, stream in self._streams.values():
            stream.close()
        self._streams = {}
        self._step = int(state["step"])
        for name, saved in state["sources"].items():
            segment = (int(saved["first_stage"]), float(saved["difficulty_weight"]))
            self._start(names.index(name), segment).set_state(saved["rows"])

    def close(self) -> None:
        for _, stream in self._streams.values():
            stream.close()
        super().close()
