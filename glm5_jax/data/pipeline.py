"""The grain input pipeline: sources -> documents -> split -> tokens -> packed rows -> batches.

Training (per source, then mixed):

    documents (train split, this host's shard: every shard_count-th document from shard_index)
    -> split into batch_size streams        so every row of a batch comes from a different place
    -> per stream: MapDataset.shuffle(seed).repeat()   every epoch reshuffled (seed + epoch)
    -> map(tokenise)                        lazily, only what is consumed; `<|endoftext|>` appended
    -> to_iter_dataset (thread prefetch)
    -> ConcatThenSplitIterDataset           rows of seq_len tokens; long documents continue in the
                                            next row; segment_ids 1-based per piece, positions from 0
    -> IterDataset.mix(equal weights)       the streams' rows round-robin
    -> IterDataset.mix(weights)             rows interleaved deterministically in weight proportion,
                                            so weights are shares of training tokens
    -> batch                                {input_ids, segment_ids, positions}: int32 [batch, seq_len]

A document piece continued from the previous row starts a new segment at position 0 (grain's
ConcatThenSplit behaviour): attention never crosses rows, so its positions restart with its context.

The returned iterator is a grain DatasetIterator whose `get_state()` is plain JSON (dicts, lists, ints,
bools); `set_state` accepts it back after json round-tripping. Validation batches come from the
validation documents only, read once in a fixed order, the last row and batch padded with segment 0.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset
from tokenizers import Tokenizer

from glm5_jax.data.sources import Document, SourceSpec, load_documents, split_documents
from glm5_jax.data.tokenizer import end_of_text_id

Batch = dict[str, np.ndarray]
_FEATURE = "input_ids"
# ConcatThenSplit names its outputs after the packed feature.
_OUTPUT_NAMES = {_FEATURE: "input_ids", f"{_FEATURE}_segment_ids": "segment_ids",
                 f"{_FEATURE}_positions": "positions"}
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
    shard_index: int = 0, shard_count: int = 1,
) -> list[list[Document]]:
    """This shard's training documents, per source.

    Args:
        sources: the sources.
        seed: split seed.
        validation_fraction: share of documents held out for validation.
        shard_index: this host's shard, in [0, shard_count).
        shard_count: number of shards (hosts); shards are disjoint and together cover the train split.
    Returns:
        one list of Document per source, sorted by doc_id.
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} is not in [0, shard_count={shard_count})")
    per_source = []
    for spec in sources:
        train, _ = split_documents(load_documents(spec), validation_fraction, seed)
        shard = train[shard_index::shard_count]
        if not shard:
            raise ValueError(
                f"source {spec.name!r}: shard {shard_index} of {shard_count} has no training documents "
                f"({len(train)} in the train split)"
            )
        per_source.append(shard)
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


def _packed_rows(texts: grain.MapDataset, tokenizer: Tokenizer, seq_len: int) -> grain.IterDataset:
    """Texts -> tokenised -> packed rows {input_ids, input_ids_segment_ids, input_ids_positions} [seq_len]."""
    tokens = texts.map(_Tokenise(tokenizer)).to_iter_dataset(_READ_OPTIONS)
    return ConcatThenSplitIterDataset(tokens, length_struct={_FEATURE: seq_len})


def _interleaved_rows(documents: Sequence[Document], tokenizer: Tokenizer, seq_len: int, streams: int,
                      seed: int, source_index: int) -> grain.IterDataset:
    """One source's endless packed rows, taken round-robin from `streams` independent streams.

    Consecutive packed rows of one stream continue the same documents, so a batch of them would
    hold one or two files; splitting the (shuffled) documents into `streams` disjoint streams,
    each packed on its own, puts a different document in every row of a batch.
    """
    order = np.random.default_rng(_derived_seed(seed, "streams", source_index)).permutation(len(documents))
    streams = max(1, min(streams, len(documents)))
    rows = []
    for stream in range(streams):
        texts = grain.MapDataset.source([documents[i].text for i in order[stream::streams]])
        # Shuffle before repeat: grain folds the epoch number into the seed, so each epoch differs.
        texts = texts.shuffle(_derived_seed(seed, "shuffle", source_index, stream)).repeat()
        rows.append(_packed_rows(texts, tokenizer, seq_len))
    return rows[0] if streams == 1 else grain.IterDataset.mix(rows, weights=[1.0] * streams)


def _rename(batch: dict[str, np.ndarray]) -> Batch:
    """Grain's feature names -> input_ids / segment_ids / positions, all int32."""
    return {name: np.asarray(batch[key], dtype=np.int32) for key, name in _OUTPUT_NAMES.items()}


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


def make_train_iterator(
    sources: Sequence[SourceSpec], tokenizer: Tokenizer, *, seq_len: int, batch_size: int, seed: int,
    validation_fraction: float, shard_index: int = 0, shard_count: int = 1,
) -> grain.DatasetIterator:
    """An endless, deterministic iterator of packed training batches for this shard.

    Args:
        sources: the sources; their weights set the share of rows (tokens) each contributes.
        tokenizer: the tokenizer (must have `<|endoftext|>`).
        seq_len: tokens per row.
        batch_size: rows per batch (per host).
        seed: seeds the split and the per-epoch shuffles.
        validation_fraction: share of documents held out (must match make_validation_batches).
        shard_index, shard_count: this host's disjoint share of the training documents.
    Returns:
        grain DatasetIterator yielding {"input_ids", "segment_ids", "positions"}: int32
        [batch_size, seq_len]; segment_ids are 1-based per document piece within a row (0 = padding),
        positions restart at 0 with each segment. get_state()/set_state() round-trip through JSON.
    """
    _check_shapes(seq_len, batch_size)
    if not sources:
        raise ValueError("make_train_iterator needs at least one source")
    shards = training_documents(
        sources, seed=seed, validation_fraction=validation_fraction,
        shard_index=shard_index, shard_count=shard_count,
    )
    per_source = [_interleaved_rows(documents, tokenizer, seq_len, batch_size, seed, index)
                  for index, documents in enumerate(shards)]
    rows = per_source[0] if len(per_source) == 1 else grain.IterDataset.mix(
        per_source, weights=[spec.weight for spec in sources]
    )
    return _BatchDataset(rows.batch(batch_size, drop_remainder=True)).__iter__()


def make_validation_batches(
    sources: Sequence[SourceSpec], tokenizer: Tokenizer, *, seq_len: int, batch_size: int, seed: int,
    validation_fraction: float, max_batches: int,
) -> list[Batch]:
    """Deterministic validation batches from the validation documents only, each read at most once.

    Documents of all sources are shuffled together (fixed by seed) so a max_batches prefix covers
    every source, then packed like training. The last row is padded with segment 0, and the last
    batch with all-zero rows, so every batch has the same shape.

    Args:
        sources, tokenizer, seq_len, batch_size, seed, validation_fraction: as make_train_iterator.
        max_batches: at most this many batches (only the needed documents are tokenised).
    Returns:
        list of {"input_ids", "segment_ids", "positions"}: int32 [batch_size, seq_len]; empty when
        validation_fraction is 0.
    """
    _check_shapes(seq_len, batch_size)
    if validation_fraction == 0 or max_batches <= 0:
        return []
    documents = validation_documents(sources, seed=seed, validation_fraction=validation_fraction)
    if not documents:
        return []
    texts = grain.MapDataset.source([document.text for document in documents])
    texts = texts.shuffle(_derived_seed(seed, "validation"))
    iterator = _BatchDataset(_packed_rows(texts, tokenizer, seq_len).batch(batch_size)).__iter__()
    batches = []
    for batch in iterator:
        rows = batch["input_ids"].shape[0]
        if rows < batch_size:
            batch = {name: np.pad(value, ((0, batch_size - rows), (0, 0))) for name, value in batch.items()}
        batches.append(batch)
        if len(batches) == max_batches:
            break
    return batches
