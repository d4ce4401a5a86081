"""The grain input pipeline: sources -> documents -> split -> tokens -> packed rows -> batches.

Training (per source, then mixed):

    documents (the train split; every process of a multi-process run reads the same global
              batches and places its own devices' rows: glm5_jax/train/loop.py)
    -> split into batch_size streams        so every row of a batch comes from a different place
    -> per stream: MapDataset.shuffle(seed).repeat()   every epoch reshuffled (seed + epoch)
    -> map(tokenise)                        lazily, only what is consumed; `<|endoftext|>` appended
    -> to_iter_dataset (thread prefetch)
    -> ConcatThenSplitIterDataset           rows of seq_len tokens; long documents continue in the
                                            next row; segment_ids 1-based per piece, positions from 0
    -> IterDataset.mix(equal weights)       the streams' rows round-robin
    -> IterDataset.mix(weights)             rows interleaved deterministically in weight proportion,
                                            so weights are shares of training tokens
    -> batch                                {input_ids, segment_ids, positions, loss_mask}:
                                            int32 [batch, seq_len]

Chat sources (kind "chat_jsonl", glm5_jax/data/chat.py) are tokenised up front into examples with a
loss mask on the assistant turns (their counts land in a ChatStatistics), then shuffled, repeated
and packed whole with first-fit packing (FirstFitPackIterDataset): an example is never split
across rows, so a target never loses its context; examples longer than seq_len were cut (counted).
Text rows have loss_mask 1 on every real token.

With a `schedule` (glm5_jax/data/schedule.py, `config.data.schedule`) the last mix is replaced by
ScheduledBatches: each stage's weights assign rows to sources by a fixed interleave, switching at
exact steps, and a source whose stage has a difficulty weight draws its documents with replacement,
hard ones more often, instead of in shuffled epochs.

A document piece continued from the previous row starts a new segment at position 0 (grain's
ConcatThenSplit behaviour): attention never crosses rows, so its positions restart with its context.

The returned iterator is a grain DatasetIterator whose `get_state()` is plain JSON (dicts, lists, ints,
bools); `set_state` accepts it back after json round-tripping. Validation batches come from the
validation documents only, read once in a fixed order, the last row and batch padded with segment 0.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset, FirstFitPackIterDataset
from tokenizers import Tokenizer

from glm5_jax.data.schedule import MixtureSchedule, ScheduledBatches, document_difficulties
from glm5_jax.data.sources import Document, SourceSpec, load_documents, split_documents
from glm5_jax.data.tokenizer import end_of_text_id

Batch = dict[str, np.ndarray]
_FEATURE = "input_ids"
BATCH_FEATURES = ("input_ids", "segment_ids", "positions", "loss_mask")
# Tokenising in a few threads keeps ahead of training on small hosts; HF tokenizers drop the GIL.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=16)


class _Tokenise:
    """Document text -> {"input_ids": int32 [tokens + 1]}, the last token being `<|endoftext|>`."""

    def __init__(self, tokenizer: Tokenizer):
        # A private copy that encodes special-token strings inside documents as plain text, so a
        # literal "<|endoftext|>" in the data cannot fake a document boundary.
        self._tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._tokenizer.encode_special_tokens = True
        self._end_of_text = end_of_text_id(tokenizer)

    def __call__(self, text: str) -> dict[str, np.ndarray]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        ids.append(self._end_of_text)
        return {_FEATURE: np.asarray(ids, dtype=np.int32)}


def _derived_seed(seed: int, *parts: object) -> int:
    """A 32-bit seed fixed by (seed, parts), so each source shuffles independently yet reproducibly."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big")


def training_documents(
    sources: Sequence[SourceSpec], *, seed: int, validation_fraction: float,
) -> list[list[Document]]:
    """The training documents, per source.

    Args:
        sources: the sources.
        seed: split seed.
        validation_fraction: share of documents held out for validation.
    Returns:
        one list of Document per source, sorted by doc_id.
    """
    per_source = []
    for spec in sources:
        train, _ = split_documents(load_documents(spec), validation_fraction, seed)
        if not train:
            raise ValueError(f"source {spec.name!r} has no training documents (validation_fraction "
                             f"{validation_fraction} leaves none)")
        per_source.append(train)
    return per_source


def validation_documents(
    sources: Sequence[SourceSpec], *, seed: int, validation_fraction: float
) -> list[Document]:
    """The validation documents of all sources (the complement of the train split).

    Args:
        sources, seed, validation_fraction: as training_documents.
    Returns:
        list of Document: sources in order, each source's documents sorted by doc_id.
    """
    pooled = []
    for spec in sources:
        pooled.extend(split_documents(load_documents(spec), validation_fraction, seed)[1])
    return pooled


def _row_features(row: dict[str, np.ndarray]) -> Batch:
    """A packed row under the batch names (grain names segment ids and positions after the feature);
    rows without a loss mask (text) train on every real token."""
    segment_ids = row[f"{_FEATURE}_segment_ids"]
    loss_mask = row["loss_mask"] if "loss_mask" in row else (segment_ids > 0)
    return {"input_ids": row[_FEATURE], "segment_ids": segment_ids, "positions": row[f"{_FEATURE}_positions"],
            "loss_mask": loss_mask.astype(np.int32)}


def _packed_rows(texts: grain.MapDataset, tokenizer: Tokenizer, seq_len: int) -> grain.IterDataset:
    """Texts -> tokenised -> packed rows {input_ids, segment_ids, positions, loss_mask} [seq_len]."""
    tokens = texts.map(_Tokenise(tokenizer)).to_iter_dataset(_READ_OPTIONS)
    return ConcatThenSplitIterDataset(tokens, length_struct={_FEATURE: seq_len}).map(_row_features)


def _packed_examples(examples: grain.MapDataset, seq_len: int, bins: int) -> grain.IterDataset:
    """Chat examples ({input_ids, loss_mask} of at most seq_len) packed whole into rows (first fit)."""
    packed = FirstFitPackIterDataset(examples.to_iter_dataset(_READ_OPTIONS),
                                     length_struct={_FEATURE: seq_len, "loss_mask": seq_len},
                                     num_packing_bins=bins, shuffle_bins=False)
    return packed.map(_row_features)


def _chat_examples(documents: Sequence[Document], spec: SourceSpec, tokenizer: Tokenizer, seq_len: int,
                   renderer, statistics, required: bool = True) -> list:
    """The source's chat examples (chat_jsonl) or pairs (preference_jsonl), counted in `statistics`;
    with `required`, none is an error naming the source (training)."""
    from glm5_jax.chat.template import ChatRenderer
    from glm5_jax.data.chat import ChatStatistics, chat_examples  # jinja2 only when chat data is used
    from glm5_jax.data.preference import preference_pairs

    build = preference_pairs if spec.kind == "preference_jsonl" else chat_examples
    examples, counts = build(documents, renderer or ChatRenderer(None), tokenizer, seq_len)
    if statistics is not None:
        statistics.add(counts)
    if not examples and required:
        raise ValueError(f"source {spec.name!r}: nothing to train on fits seq_len={seq_len} "
                         f"({ChatStatistics.as_dict(counts)})")
    return examples


def _preference_sources(sources: Sequence[SourceSpec]) -> bool:
    """True when the sources are preference pairs (DPO); they cannot be mixed with other kinds."""
    kinds = {spec.kind == "preference_jsonl" for spec in sources}
    if len(kinds) > 1:
        raise ValueError("preference_jsonl sources (DPO pairs) cannot be mixed with other source kinds")
    return kinds == {True}


def _pair_batches(pairs: grain.IterDataset, batch_size: int) -> grain.IterDataset:
    """Pairs ([2, T] per feature) -> batches of batch_size rows [B, T]: chosen rows even, rejected odd."""
    if batch_size % 2:
        raise ValueError(f"batch_size ({batch_size}) must be even for preference pairs (a chosen and a "
                         "rejected row each)")
    return pairs.batch(batch_size // 2, drop_remainder=True).map(
        lambda batch: {name: value.reshape((-1,) + value.shape[2:]) for name, value in batch.items()})


def _example_rows(examples: list, seq_len: int, bins: int, seed: int, source_index: int) -> grain.IterDataset:
    """Chat examples' endless packed rows, reshuffled every epoch."""
    shuffle_seed = _derived_seed(seed, "shuffle", source_index)
    examples = grain.MapDataset.source(examples).shuffle(shuffle_seed).repeat()
    return _packed_examples(examples, seq_len, bins)


def _chat_rows(documents: Sequence[Document], spec: SourceSpec, tokenizer: Tokenizer, seq_len: int,
               bins: int, seed: int, source_index: int, renderer, statistics) -> grain.IterDataset:
    """One chat source's endless packed rows, reshuffled every epoch."""
    examples = _chat_examples(documents, spec, tokenizer, seq_len, renderer, statistics)
    return _example_rows(examples, seq_len, bins, seed, source_index)


def _stream_members(count: int, streams: int, seed: int, source_index: int) -> list[np.ndarray]:
    """A seeded partition of range(count) into min(streams, count) (at least 1) disjoint index arrays."""
    order = np.random.default_rng(_derived_seed(seed, "streams", source_index)).permutation(count)
    streams = max(1, min(streams, count))
    return [order[stream::streams] for stream in range(streams)]


def _mixed_streams(rows: list[grain.IterDataset]) -> grain.IterDataset:
    return rows[0] if len(rows) == 1 else grain.IterDataset.mix(rows, weights=[1.0] * len(rows))


def _interleaved_rows(documents: Sequence[Document], tokenizer: Tokenizer, seq_len: int, streams: int,
                      seed: int, source_index: int) -> grain.IterDataset:
    """One source's endless packed rows, taken round-robin from `streams` independent streams.

    Consecutive packed rows of one stream continue the same documents, so a batch of them would
    hold one or two files; splitting the (shuffled) documents into `streams` disjoint streams,
    each packed on its own, puts a different document in every row of a batch.
    """
    rows = []
    for stream, members in enumerate(_stream_members(len(documents), streams, seed, source_index)):
        texts = grain.MapDataset.source([documents[i].text for i in members])
        # Shuffle before repeat: grain folds the epoch number into the seed, so each epoch differs.
        texts = texts.shuffle(_derived_seed(seed, "shuffle", source_index, stream)).repeat()
        rows.append(_packed_rows(texts, tokenizer, seq_len))
    return _mixed_streams(rows)


class _WeightedDraws:
    """An endless random-access sequence of texts drawn with replacement: element i is text j with
    probability weights[j] / sum(weights), fixed by (seed, i), so any element can be re-read."""

    def __init__(self, texts: Sequence[str], log_weights: np.ndarray, seed: int):
        self._texts = list(texts)
        self._cumulative = np.cumsum(np.exp(log_weights - log_weights.max()))  # [len(texts)]
        self._seed = seed

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> str:
        draw = np.random.default_rng((self._seed, index)).random() * self._cumulative[-1]
        chosen = int(np.searchsorted(self._cumulative, draw, side="right"))
        return self._texts[min(chosen, len(self._texts) - 1)]  # min: draw may round up to the total


def _weighted_rows(documents: Sequence[Document], log_weights: np.ndarray, tokenizer: Tokenizer, seq_len: int,
                   streams: int, seed: int, source_index: int) -> grain.IterDataset:
    """Like _interleaved_rows, but each stream draws its documents with replacement with probability
    proportional to exp(log_weights) (float [len(documents)]) instead of in shuffled epochs."""
    rows = []
    for stream, members in enumerate(_stream_members(len(documents), streams, seed, source_index)):
        draws = _WeightedDraws([documents[i].text for i in members], log_weights[members],
                               _derived_seed(seed, "draws", source_index, stream))
        rows.append(_packed_rows(grain.MapDataset.source(draws), tokenizer, seq_len))
    return _mixed_streams(rows)


def _rename(batch: dict[str, np.ndarray]) -> Batch:
    """The batch features, all int32."""
    return {name: np.asarray(batch[name], dtype=np.int32) for name in BATCH_FEATURES}


def _json_state(state: Any) -> Any:
    """Grain's iterator state as plain JSON values (tuples become lists, numpy scalars Python ints)."""
    return json.loads(json.dumps(state, default=lambda value: value.item()))


def _grain_state(state: Any) -> Any:
    """Undoes JSON's tuple -> list: ConcatThenSplit compares `remainder_slices` values to tuples."""
    if isinstance(state, dict):
        return {
            key: ({name: tuple(sl) for name, sl in value.items()} if key == "remainder_slices"
                  else _grain_state(value))
            for key, value in state.items()
        }
    if isinstance(state, list):
        return [_grain_state(value) for value in state]
    return state


class _BatchIterator(grain.DatasetIterator):
    """Renames the batch features and keeps the checkpoint state JSON-serialisable."""

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)

    def __next__(self) -> Batch:
        return _rename(next(self._parent))

    def get_state(self) -> dict[str, Any]:
        return _json_state(self._parent.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(_grain_state(state))


class _BatchDataset(grain.IterDataset):
    """IterDataset whose iterator is a _BatchIterator."""

    def __iter__(self) -> _BatchIterator:
        return _BatchIterator(self._parent.__iter__())


def _check_shapes(seq_len: int, batch_size: int) -> None:
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")


def _scheduled_batches(sources: Sequence[SourceSpec], shards: list[list[Document]], schedule: MixtureSchedule,
                       tokenizer: Tokenizer, seq_len: int, batch_size: int, seed: int, chat_renderer,
                       chat_statistics) -> ScheduledBatches:
    """Batches mixed by a MixtureSchedule: chat examples and difficulty scores are read once here; a
    source's row stream for a segment (first stage, difficulty weight) is rebuilt on demand from them.
    The segment starting at stage 0 is seeded like the unscheduled pipeline, later ones by (seed, stage)."""
    names = tuple(spec.name for spec in sources)
    if schedule.source_names != names:
        raise ValueError(f"the schedule's sources {list(schedule.source_names)} are not the sources "
                         f"{list(names)}")
    examples = {index: _chat_examples(documents, spec, tokenizer, seq_len, chat_renderer, chat_statistics)
                for index, (spec, documents) in enumerate(zip(sources, shards, strict=True))
                if spec.kind == "chat_jsonl"}
    difficulties = {index: document_difficulties(sources[index], shards[index])
                    for index in range(len(sources)) if schedule.uses_difficulty(index)}

    def make_rows(source: int, first_stage: int, difficulty_weight: float) -> grain.IterDataset:
        stage_seed = seed if first_stage == 0 else _derived_seed(seed, "stage", first_stage)
        if source in examples:
            return _example_rows(examples[source], seq_len, batch_size, stage_seed, source)
        if difficulty_weight == 0:
            return _interleaved_rows(shards[source], tokenizer, seq_len, batch_size, stage_seed, source)
        return _weighted_rows(shards[source], difficulty_weight * difficulties[source], tokenizer, seq_len,
                              batch_size, stage_seed, source)

    return ScheduledBatches(schedule, make_rows, batch_size)


def make_train_iterator(
    sources: Sequence[SourceSpec], tokenizer: Tokenizer, *, seq_len: int, batch_size: int, seed: int,
    validation_fraction: float, chat_renderer=None, chat_statistics=None,
    schedule: MixtureSchedule | None = None,
) -> grain.DatasetIterator:
    """An endless, deterministic iterator of packed training batches.

    Args:
        sources: the sources; their weights set the share of rows (tokens) each contributes.
        tokenizer: the tokenizer (must have `<|endoftext|>`).
        seq_len: tokens per row.
        batch_size: rows per batch (the global batch: the same in every process).
        seed: seeds the split and the per-epoch shuffles.
        validation_fraction: share of documents held out (must match make_validation_batches).
        chat_renderer: a glm5_jax.chat.template.ChatRenderer for chat_jsonl sources (None: the
            built-in GLM-5 format).
        chat_statistics: a glm5_jax.data.chat.ChatStatistics that counts the chat examples kept,
            truncated and skipped (optional).
        schedule: a glm5_jax.data.schedule.MixtureSchedule over these sources (None: the sources'
            fixed weights): per-stage weights and difficulty up-weighting, switched at exact steps.
    Returns:
        grain DatasetIterator yielding {"input_ids", "segment_ids", "positions", "loss_mask"}: int32
        [batch_size, seq_len]; segment_ids are 1-based per document piece within a row (0 = padding),
        positions restart at 0 with each segment, loss_mask is 1 on tokens that are targets.
        get_state()/set_state() round-trip through JSON.
    """
    _check_shapes(seq_len, batch_size)
    if not sources:
        raise ValueError("make_train_iterator needs at least one source")
    shards = training_documents(sources, seed=seed, validation_fraction=validation_fraction)
    if _preference_sources(sources):
        if schedule is not None:
            raise ValueError("preference_jsonl sources (DPO pairs) are not mixed by a schedule")
        pairs = [pair for spec, documents in zip(sources, shards, strict=True) for pair in
                 _chat_examples(documents, spec, tokenizer, seq_len, chat_renderer, chat_statistics)]
        pairs = grain.MapDataset.source(pairs).shuffle(_derived_seed(seed, "shuffle", "pairs")).repeat()
        return _BatchDataset(_pair_batches(pairs.to_iter_dataset(_READ_OPTIONS), batch_size)).__iter__()
    if schedule is not None:
        return _BatchIterator(_scheduled_batches(sources, shards, schedule, tokenizer, seq_len, batch_size,
                                                 seed, chat_renderer, chat_statistics))
    per_source = [
        _chat_rows(documents, spec, tokenizer, seq_len, batch_size, seed, index,
                   chat_renderer, chat_statistics)
        if spec.kind == "chat_jsonl"
        else _interleaved_rows(documents, tokenizer, seq_len, batch_size, seed, index)
        for index, (spec, documents) in enumerate(zip(sources, shards, strict=True))]
    rows = per_source[0] if len(per_source) == 1 else grain.IterDataset.mix(
        per_source, weights=[spec.weight for spec in sources]
    )
    return _BatchDataset(rows.batch(batch_size, drop_remainder=True)).__iter__()


def make_validation_batches(
    sources: Sequence[SourceSpec], tokenizer: Tokenizer, *, seq_len: int, batch_size: int, seed: int,
    validation_fraction: float, max_batches: int, chat_renderer=None, chat_statistics=None,
) -> list[Batch]:
    """Deterministic validation batches from the validation documents only, each read at most once.

    Text documents of all sources are shuffled together (fixed by seed) so a max_batches prefix
    covers every source, then packed like training; chat conversations likewise, packed whole;
    when both exist their rows alternate. The last row is padded with segment 0, and the last
    batch with all-zero rows, so every batch has the same shape.

    Args:
        sources, tokenizer, seq_len, batch_size, seed, validation_fraction, chat_renderer,
        chat_statistics: as make_train_iterator.
        max_batches: at most this many batches (only the needed text documents are tokenised).
    Returns:
        list of {"input_ids", "segment_ids", "positions", "loss_mask"}: int32 [batch_size, seq_len];
        empty when validation_fraction is 0.
    """
    _check_shapes(seq_len, batch_size)
    if validation_fraction == 0 or max_batches <= 0:
        return []
    if _preference_sources(sources):
        documents = validation_documents(sources, seed=seed, validation_fraction=validation_fraction)
        pairs = (_chat_examples(documents, sources[0], tokenizer, seq_len, chat_renderer, chat_statistics,
                                required=False) if documents else [])
        pairs = pairs[:max_batches * (batch_size // 2)]
        if not pairs:
            return []
        padding = {name: np.zeros_like(value) for name, value in pairs[0].items()}  # a pair of no tokens
        pairs += [padding] * (-len(pairs) % (batch_size // 2))
        return list(_pair_batches(grain.MapDataset.source(pairs).to_iter_dataset(), batch_size))
    streams = []
    text_sources = [spec for spec in sources if spec.kind != "chat_jsonl"]
    documents = validation_documents(text_sources, seed=seed, validation_fraction=validation_fraction)
    if documents:
        texts = grain.MapDataset.source([document.text for document in documents])
        shuffled = texts.shuffle(_derived_seed(seed, "validation"))
        streams.append(iter(_packed_rows(shuffled, tokenizer, seq_len)))
    for spec in (spec for spec in sources if spec.kind == "chat_jsonl"):
        chat_documents = validation_documents([spec], seed=seed, validation_fraction=validation_fraction)
        if chat_documents:
            examples = _chat_examples(chat_documents, spec, tokenizer, seq_len,
                                      chat_renderer, chat_statistics, required=False)
            if examples:
                streams.append(iter(_packed_examples(grain.MapDataset.source(examples), seq_len, batch_size)))
    rows = []
    while streams and len(rows) < max_batches * batch_size:
        for stream in list(streams):
            row = next(stream, None)
            if row is None:
                streams.remove(stream)
            else:
                rows.append(_rename(row))
    rows = rows[:max_batches * batch_size]
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = {name: np.stack([row[name] for row in chunk]) for name in BATCH_FEATURES}
        if len(chunk) < batch_size:
            padding = ((0, batch_size - len(chunk)), (0, 0))
            batch = {name: np.pad(value, padding) for name, value in batch.items()}
        batches.append(batch)
    return batches
