"""Rollouts -> one GRPO train batch (numpy): completions packed whole into rows, with the
per-token fields the loss reads (glm5_jax/train/grpo.py).

Packing: each completion, after its prompt, is one segment (segment_ids 1, 2, ... per row,
positions from 0), placed first-fit in rollout order, never split. The row count is the least
`min_rows * 2^k` that holds them (a few compiled shapes, and a step's cost follows the real
tokens within 2x, never the configured maxima). Token fields are aligned with the logits:
column t of `rollout_log_probs`, `advantages` and `token_weights` belongs to the token at t + 1.
With microbatches, rows split into `grad_accum_steps` contiguous groups and the token weights are
normalised within each (microbatches weigh equally, as in every train step).
"""

from __future__ import annotations

import numpy as np

from glm5_jax.rl.rollouts import Rollout
from glm5_jax.train.grpo import group_advantages, token_weights


def row_count(needed: int, min_rows: int) -> int:
    """The least min_rows * 2^k >= needed."""
    rows = min_rows
    while rows < needed:
        rows *= 2
    return rows


def pack(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit: sequence indices per row (each length <= seq_len)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index, length in enumerate(lengths):
        if length > seq_len:
            raise ValueError(f"a rollout of {length} tokens does not fit a row of seq_len {seq_len}")
        for row, room in enumerate(free):
            if room >= length:
                rows[row].append(index)
                free[row] -= length
                break
        else:
            rows.append([index])
            free.append(seq_len - length)
    return rows


def grpo_batch(rollouts: list[Rollout], *, group_size: int, seq_len: int, min_rows: int,
               advantage: str, advantage_eps: float, aggregation: str, max_new_tokens: int,
               grad_accum_steps: int = 1) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """rollouts: prompt-major groups of `group_size` (as RolloutWorker.generate returns them),
    rewards filled. Returns (batch [rows, seq_len] fields, statistics: rows, real_tokens,
    padding_share, zero_advantage_groups)."""
    rewards = np.array([r.reward for r in rollouts], np.float64).reshape(-1, group_size)
    advantages = group_advantages(rewards, advantage, advantage_eps).reshape(-1)
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    placement = pack(lengths, seq_len)
    rows = row_count(len(placement), min_rows)
    rows = -(-rows // grad_accum_steps) * grad_accum_steps
    shape = (rows, seq_len)
    batch = {"input_ids": np.zeros(shape, np.int32), "segment_ids": np.zeros(shape, np.int32),
             "positions": np.zeros(shape, np.int32), "loss_mask": np.zeros(shape, np.int32),
             "rollout_log_probs": np.zeros(shape, np.float32), "advantages": np.zeros(shape, np.float32),
             "token_weights": np.zeros(shape, np.float32)}
    per_group = rows // grad_accum_steps
    spans = []  # (rollout index, row, first completion column - 1, completion length)
    for row, members in enumerate(placement):
        offset = 0
        for segment, index in enumerate(members, start=1):
            rollout = rollouts[index]
            tokens = rollout.prompt_ids + rollout.completion_ids
            end = offset + len(tokens)
            batch["input_ids"][row, offset:end] = tokens
            batch["segment_ids"][row, offset:end] = segment
            batch["positions"][row, offset:end] = np.arange(len(tokens))
            start = offset + len(rollout.prompt_ids)
            batch["loss_mask"][row, start:end] = 1
            count = len(rollout.completion_ids)
            batch["rollout_log_probs"][row, start - 1:end - 1] = rollout.log_probs
            batch["advantages"][row, start - 1:end - 1] = advantages[index]
            spans.append((index, row, start - 1, count))
            offset = end
    for group in range(grad_accum_steps):  # weights normalised per microbatch
        members = [span for span in spans if span[1] // per_group == group]
        weights = token_weights(np.array([span[3] for span in members]), aggregation, max_new_tokens)
        for (_, row, column, count), weight in zip(members, weights, strict=True):
            batch["token_weights"][row, column:column + count] = weight
    real = int(sum(lengths))
    statistics = {"rows": rows, "real_tokens": real, "padding_share": 1.0 - real / (rows * seq_len),
                  "zero_advantage_groups": float(np.mean(np.all(rewards == rewards[:, :1], axis=1)))}
    return batch, statistics
