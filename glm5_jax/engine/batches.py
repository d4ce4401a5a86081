"""A scheduler plan -> the host arrays of the runner's call.

A decode plan becomes `decode_inputs`: per row (in a bucket of decode_buckets rows) its last token,
position, block table, slot, remaining tokens, stop ids (EOS unless ignored; a constrained row's
one-token `after` text) and the positions its pages cover (speculation); tables and stop ids are
gathered by slot from a `RowCache`, which rebuilds a slot's rows only when they change. A mixed
plan becomes `mixed_inputs`: the flat StepBatch of decode rows and prefill chunk rows (each row's
KDA state slot is its sequence's slot), the rows to sample and their slots, the chunk tokens' next
prompt tokens when a prompt is scored, and (speculation) each flat token's next token where the
host knows it. `allowed_bits` is each row's grammar bitmask.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from glm5_jax.engine.runner import MAX_STOP_IDS
from glm5_jax.engine.scheduler import DecodePlan, MixedPlan, Sequence, decode_buckets


def stop_ids(sequence: Sequence, eos_token_ids) -> list[int]:
    """The ids that end the row on the device: its stop token ids, then EOS unless ignored."""
    params = sequence.payload.stream.params
    ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    return ids[:MAX_STOP_IDS]


def allowed_bits(runner, sequences, rows: int) -> np.ndarray | None:
    """The token bitmask of each row's next token [rows, ceil(V/32)] (all set when free; a None
    sequence is a padding row); None when no row is constrained (the runner's all-allowed mask)."""
    if all(sequence is None or sequence.payload.constrained is None for sequence in sequences):
        return None
    allowed = runner.free_bits(rows)
    for row, sequence in enumerate(sequences):
        if sequence is not None and sequence.payload.constrained is not None:
            sequence.payload.constrained.fill(allowed[row])
    return allowed


class RowCache:
    """Each slot's block-table row [W] and stop-id row [MAX_STOP_IDS] as last built, rebuilt only
    when the slot's sequence or its pages change, so that a decode call's arrays are gathered by
    slot (numpy fancy indexing) instead of built row by row. A sequence's pages only ever grow by
    appending (the scheduler replaces the list when it frees or re-admits them), so the list's
    identity and length say whether the row is current."""

    def __init__(self, max_slots: int, table_width: int, eos_token_ids):
        self.tables = np.zeros((max_slots, table_width), np.int32)  # [S, W]
        self.stop_ids = np.full((max_slots, MAX_STOP_IDS), -1, np.int32)  # [S, MAX_STOP_IDS]
        self.eos_token_ids = tuple(eos_token_ids)
        self._built: list[tuple | None] = [None] * max_slots  # (sequence, its pages list, pages in row)

    def refresh(self, sequence: Sequence) -> int:
        """Brings the sequence's slot rows up to date; returns the slot."""
        slot, pages = sequence.slot, sequence.pages
        built = self._built[slot]
        if built is None or built[0] is not sequence:
            ids = stop_ids(sequence, self.eos_token_ids)
            self.stop_ids[slot] = -1
            self.stop_ids[slot, :len(ids)] = ids
            built = None
        if built is not None and built[1] is pages and built[2] == len(pages):
            return slot
        if built is not None and built[1] is pages and built[2] < len(pages):  # appended pages
            self.tables[slot, built[2]:len(pages)] = pages[built[2]:]
        else:
            self.tables[slot] = 0
            self.tables[slot, :len(pages)] = pages
        self._built[slot] = (sequence, pages, len(pages))
        return slot

    def table(self, sequence: Sequence) -> np.ndarray:
        """The sequence's block-table row [W] (a view: copy it into the call's arrays)."""
        return self.tables[self.refresh(sequence)]


def decode_inputs(runner, row_cache: RowCache, plan: DecodePlan, max_slots: int, page_size: int
                  ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the runner's `launch_decode` inputs, limits [R]: the positions each row's pages cover) for
    the plan's rows, padded to the smallest decode bucket that holds them."""
    sequences = plan.sequences
    count = len(sequences)
    rows = next(b for b in decode_buckets(max_slots) if b >= count)
    inputs = runner.padding_decode(rows)
    slots = np.fromiter([row_cache.refresh(s) for s in sequences], np.int32, count)  # [n]
    state = np.array([(s.tokens[-1], s.computed, s.max_new - s.generated, len(s.pages)) for s in sequences],
                     np.int32).reshape(count, 4)  # [n, (token, position, remaining, pages)]
    inputs["tokens"][:count], inputs["positions"][:count] = state[:, 0], state[:, 1]
    inputs["remaining"][:count], inputs["slots"][:count] = state[:, 2], slots
    inputs["tables"][:count] = row_cache.tables[slots]
    inputs["stop_ids"][:count] = row_cache.stop_ids[slots]
    limits = np.zeros(rows, np.int32)
    limits[:count] = state[:, 3] * page_size
    for row, sequence in enumerate(sequences):
        request = sequence.payload
        if request.constrained is None:
            continue
        # (constrained rows never speculate)
        if request.constrained.active or request.after_token is None:
            # The next mask depends on this token (or the host must look for `after`).
            inputs["remaining"][row] = min(inputs["remaining"][row], 1)
        else:  # free until the one-token `after`: the device pauses the row there
            ids = ([request.after_token] + stop_ids(sequence, row_cache.eos_token_ids))[:MAX_STOP_IDS]
            inputs["stop_ids"][row] = -1
            inputs["stop_ids"][row, :len(ids)] = ids
    return inputs, limits


class MixedInputs(NamedTuple):
    """A mixed step's host arrays. batch: the StepBatch (max_slots decode rows, then the chunk
    rows); sample_rows, slots, mask [max_slots]: the flat rows sampled, their slots, which are
    real; sampled: {sequence: its index in sample_rows}; by_index [max_slots]: the sequence at
    each index (None = padding); targets: None, or [Gc * Qc] next prompt tokens of the chunk tokens
    (-1 = none) when a chunk's prompt is scored; next_tokens: None, or [T] each flat token's next
    token where known (speculation; -1 = unknown)."""

    batch: object
    sample_rows: np.ndarray
    slots: np.ndarray
    mask: np.ndarray
    sampled: dict
    by_index: list
    targets: np.ndarray | None
    next_tokens: np.ndarray | None


def mixed_inputs(runner, row_cache: RowCache, plan: MixedPlan, max_slots: int, speculating: bool
                 ) -> MixedInputs:
    chunk_len = plan.geometry[1]
    decode_rows = max_slots
    batch = runner.padding_batch(*plan.geometry)
    sample_rows, slots = np.zeros(max_slots, np.int32), np.zeros(max_slots, np.int32)
    mask = np.zeros(max_slots, bool)
    sampled_index = {}

    def sample_from(sequence, flat_row):
        index = len(sampled_index)
        sample_rows[index], slots[index], mask[index] = flat_row, sequence.slot, True
        sampled_index[sequence] = index

    for row, sequence in enumerate(plan.decodes):
        batch.decode_tokens[row], batch.decode_positions[row] = sequence.tokens[-1], sequence.computed
        batch.block_tables[row] = row_cache.table(sequence)
        batch.state_slots[row] = sequence.slot  # its KDA state (hybrid models) lives in its slot
        sample_from(sequence, row)
    targets = None  # next-token ids of the chunk tokens, when a chunk's prompt is scored
    # Speculation: the MTP layer's input, each flat token's next token where known (the
    # sampled ones are filled in on the device).
    next_tokens = np.full(decode_rows + batch.chunk_tokens.size, -1, np.int32) if speculating else None
    for row, (sequence, count) in enumerate(plan.chunks):
        start = sequence.computed
        batch.chunk_tokens[row, :count] = sequence.tokens[start:start + count]
        if next_tokens is not None:
            known = sequence.tokens[start + 1:start + count + 1]
            first = decode_rows + row * chunk_len
            next_tokens[first:first + len(known)] = known
        batch.chunk_positions[row, :count] = np.arange(start, start + count)
        batch.block_tables[decode_rows + row] = row_cache.table(sequence)
        batch.state_slots[decode_rows + row] = sequence.slot
        if start + count == len(sequence.tokens) and sequence.max_new > 0:
            sample_from(sequence, decode_rows + row * chunk_len + count - 1)
        if sequence.payload.prompt_scores is not None:
            targets = np.full(batch.chunk_tokens.size, -1, np.int32) if targets is None else targets
            end = min(start + count, sequence.prompt_tokens - 1)  # positions with a next prompt token
            first = row * chunk_len
            targets[first:first + max(0, end - start)] = sequence.tokens[start + 1:end + 1]
    by_index = [None] * max_slots
    for sequence, index in sampled_index.items():
        by_index[index] = sequence
    return MixedInputs(batch, sample_rows, slots, mask, sampled_index, by_index, targets, next_tokens)
