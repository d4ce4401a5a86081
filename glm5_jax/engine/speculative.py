"""MTP speculative decoding on the paged cache: the checkpoint's MTP layer drafts, the main model
verifies, speculative sampling keeps the target distribution.

One round for a decoding row with pending token x at position p (not yet in the cache) and a
first draft d_1 (drawn when x was produced, from the MTP layer at p - 1):
  1. chain: the MTP layer runs N - 1 more single-token steps, each on its own previous output
     and draft (positions p .. p + N - 2), drawing d_2 .. d_N (as vLLM and MaxText chain one
     MTP layer);
  2. verify: the main model runs [x, d_1 .. d_N] at positions p .. p + N as one chunk of the
     row (one `paged_step`), giving the target distribution after each;
  3. accept (`rejection_sampling.accept_drafts`): a drafts kept, then one more token y (the residual
     draw at the first rejection, or the bonus token): a + 1 tokens emitted;
  4. the MTP layer runs over the verified positions p .. p + a with the main model's hidden
     states and the emitted tokens (rewriting the chain's provisional entries with the ones a
     plain decode would have written) and draws the next round's d_1 at p + a.
Rollback is free: cache entries are addressed by position and attention is causal, so what the
rejected drafts wrote past p + a (pages, index keys, MTP entries) is never read before the next
round overwrites it; the scheduler reserves pages for the longest outcome and positions past a
row's pages are never written.

The draft state (d_1, its distribution and the MTP output it chains from) is kept per slot on
the device (`DraftState`), so a call continues from the previous call's device state. Rows are
eligible when their sampling does not depend on the tokens drawn within the round (no
repetition / presence / frequency penalty, no grammar constraint); the engine uses plain decode
calls otherwise. Draft and target distributions get the same temperature / top-k / top-p / min-p
processing as `sampling.sample`; greedy rows accept a draft iff it is the target's argmax, so
greedy output is the plain decoder's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from glm5_jax.engine.rejection_sampling import accept_drafts
from glm5_jax.engine.sampling import (
    PRNG_IMPL,
    SamplingState,
    categorical,
    first_argmax,
    processed_logits,
    put_slot_rows,
    slot_rows,
)
from glm5_jax.engine.types import MAX_TOP_LOGPROBS
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.paged_decode import StepBatch, paged_mtp_step, paged_step

_CHAIN, _NEXT_ROUND, _ACCEPT = 1, 1000, 2000  # fold_in tags of a round's key


@struct.dataclass
class DraftState:
    """Per slot: token [S] int32, the next round's first draft; probs [S, V] float32, the
    distribution it was drawn from; hidden [S, D], the MTP layer's output it chains from."""

    token: jax.Array
    probs: jax.Array
    hidden: jax.Array


def init_draft_state(num_slots: int, vocab_size: int, hidden_size: int) -> DraftState:
    return DraftState(jnp.zeros((num_slots,), jnp.int32), jnp.full((num_slots, vocab_size), 1.0 / vocab_size),
                      jnp.zeros((num_slots, hidden_size), jnp.float32))


def sampling_probs(logits, rows: SamplingState):
    """The distribution `sampling.sample` draws from, for eligible rows (no penalties):
    logits [R, V] -> probs [R, V] float32 (greedy rows: one-hot argmax), argmax [R] int32."""
    raw = logits.astype(jnp.float32)
    greedy = first_argmax(raw)
    probs = jnp.where(rows.temperature[:, None] > 0, jax.nn.softmax(processed_logits(raw, rows), axis=-1),
                      jax.nn.one_hot(greedy, raw.shape[-1], dtype=jnp.float32))
    return probs, greedy


def draw_drafts(logits, rows: SamplingState, keys):
    """Draft tokens [R] and their distributions [R, V] from MTP logits [R, V]; keys [R] typed."""
    probs, greedy = sampling_probs(logits, rows)
    drawn = jax.vmap(lambda key, p: categorical(key, jnp.log(p)))(keys, probs)
    return jnp.where(rows.temperature > 0, drawn, greedy), probs


def _tagged(keys, tag: int):
    return jax.vmap(lambda key: jax.random.fold_in(key, tag))(keys)


def _write_slots(drafts: DraftState, slots, keep, token, probs, hidden) -> DraftState:
    return put_slot_rows(drafts, DraftState(token, probs, hidden.astype(jnp.float32)), slots, keep)


def mtp_after_step(config: ModelConfig, params, cache, drafts: DraftState, rows: SamplingState,
                   batch: StepBatch, hidden, next_tokens, sample_rows, slots, mask, *, options,
                   block_pages: int):
    """The MTP layer over a mixed step's tokens, after its sampling: writes the MTP cache entry of
    every flat token whose next token is known (next_tokens [T], -1 = unknown; the sampled
    tokens already scattered in) and draws the first draft of the slots sampled (mask [R]).
    hidden: [T, D] the main model's final-normed hidden states; rows: the sampled slots' state."""
    known = next_tokens >= 0
    decode_rows = batch.decode_tokens.shape[0]
    mtp_batch = batch._replace(
        decode_positions=jnp.where(known[:decode_rows], batch.decode_positions, -1),
        chunk_positions=jnp.where(known[decode_rows:].reshape(batch.chunk_positions.shape),
                                  batch.chunk_positions, -1))
    logits, out, cache = paged_mtp_step(config, params, cache, mtp_batch, hidden, next_tokens, sample_rows,
                                        options=options, block_pages=block_pages)
    keys = _tagged(jax.random.wrap_key_data(rows.keys, impl=PRNG_IMPL), _NEXT_ROUND)
    token, probs = draw_drafts(logits, rows, keys)
    return cache, _write_slots(drafts, slots, mask, token, probs, out)


@functools.partial(jax.jit, static_argnames=("config", "options", "block_pages", "steps", "num_drafts"),
                   donate_argnames=("cache", "state", "drafts"))
def speculative_loop(config: ModelConfig, params, cache, state: SamplingState, drafts: DraftState, tokens,
                     positions, tables, limits, slots, remaining, stop_ids, logprobs_wanted, *, options,
                     block_pages: int, steps: int, num_drafts: int):
    """Up to `steps` speculative rounds (see the module docs) on the device.

    tokens, positions, slots, remaining: [R] int32 as `runner.decode_loop` (position -1 =
    padding row); tables: [R, W]; limits: [R] int32, the positions the row's pages cover (no
    write at or past it: drafts there are not verified); stop_ids: [R, MAX_STOP_IDS].
    Returns (outputs: tokens, logprobs, top_ids, top_logprobs of [steps * (N + 1), R] rows,
    token -1 where nothing was emitted; (tokens, positions, remaining) after the last round;
    counts [3] int32: verify rounds (rows x rounds), drafts verified, drafts accepted; cache, state,
    drafts).
    """
    rows, n = tokens.shape[0], num_drafts
    width = n + 1
    empty_decode = jnp.zeros((0,), jnp.int32)
    offsets = jnp.arange(width, dtype=jnp.int32)
    outputs = (jnp.full((steps * width, rows), -1, jnp.int32), jnp.zeros((steps * width, rows), jnp.float32),
               jnp.zeros((steps * width, rows, MAX_TOP_LOGPROBS), jnp.int32),
               jnp.zeros((steps * width, rows, MAX_TOP_LOGPROBS), jnp.float32))

    def body(carry):
        step, cache, state, drafts, tokens, positions, remaining, counts, outputs = carry
        active = (positions >= 0) & (remaining > 0) & (positions < limits)
        row_state = slot_rows(state, slots)
        keys = jax.random.wrap_key_data(row_state.keys, impl=PRNG_IMPL)
        split = jax.vmap(jax.random.split)(keys)
        next_keys, round_keys = split[:, 0], split[:, 1]

        # 1. chain the MTP layer from the slot's first draft
        draft_tokens, draft_probs = [drafts.token[slots]], [drafts.probs[slots]]
        hidden = drafts.hidden[slots]
        for j in range(1, n):
            chain_positions = positions - 1 + j
            chain_positions = jnp.where(active & (chain_positions < limits), chain_positions, -1)
            batch = StepBatch(empty_decode, empty_decode, draft_tokens[-1][:, None], chain_positions[:, None],
                              tables)
            logits, hidden, cache = paged_mtp_step(config, params, cache, batch, hidden, draft_tokens[-1],
                                                   jnp.arange(rows), options=options, block_pages=block_pages)
            token, probs = draw_drafts(logits, row_state, _tagged(round_keys, _CHAIN + j))
            draft_tokens.append(token)
            draft_probs.append(probs)
        draft_tokens, draft_probs = jnp.stack(draft_tokens, 1), jnp.stack(draft_probs, 1)  # [R, N], [R, N, V]

        # 2. verify [x, d_1 .. d_N] in one chunk per row
        chunk_positions = positions[:, None] + offsets
        valid = active[:, None] & (chunk_positions < limits[:, None])
        chunk_positions = jnp.where(valid, chunk_positions, -1)
        chunk = jnp.concatenate([tokens[:, None], draft_tokens], axis=1)
        batch = StepBatch(empty_decode, empty_decode, chunk, chunk_positions, tables)
        logits, main_hidden, cache = paged_step(config, params, cache, batch, jnp.arange(rows * width),
                                                options=options, block_pages=block_pages, with_hidden=True)
        repeated = jax.tree.map(lambda a: jnp.repeat(a, width, axis=0), row_state)
        target_probs, target_greedy = sampling_probs(logits, repeated)

        # 3. accept
        verifiable = jnp.clip(jnp.sum(valid, axis=1) - 1, 0, n).astype(jnp.int32)
        accepted, next_token = accept_drafts(
            target_probs.reshape(rows, width, -1), target_greedy.reshape(rows, width), draft_tokens,
            draft_probs, row_state.temperature <= 0, verifiable,
            jax.random.key_data(_tagged(round_keys, _ACCEPT)))
        padded = jnp.concatenate([draft_tokens, jnp.zeros((rows, 1), jnp.int32)], axis=1)
        verified = jnp.where(offsets[None, :] < accepted[:, None], padded,  # [R, N + 1]
                             jnp.where(offsets[None, :] == accepted[:, None], next_token[:, None], -1))
        stops = jnp.any(verified[:, :, None] == stop_ids[:, None, :], axis=-1) & (verified >= 0)
        first_stop = jnp.min(jnp.where(stops, offsets[None, :], width), axis=1)
        count = jnp.where(active, jnp.minimum(jnp.minimum(accepted + 1, remaining), first_stop + 1), 0)
        stopped = first_stop < count  # a stop token is among the emitted ones
        kept = offsets[None, :] < count[:, None]
        emitted = jnp.where(kept, verified, -1)
        def reported():
            raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(rows, width, -1)
            chosen = jnp.take_along_axis(raw, jnp.maximum(emitted, 0)[..., None], axis=-1)[..., 0]
            values, ids = jax.lax.top_k(raw, MAX_TOP_LOGPROBS)
            return chosen, ids.astype(jnp.int32), values

        def skipped():
            return (jnp.zeros((rows, width), jnp.float32),
                    jnp.zeros((rows, width, MAX_TOP_LOGPROBS), jnp.int32),
                    jnp.zeros((rows, width, MAX_TOP_LOGPROBS), jnp.float32))

        logprobs, top_ids, top_logprobs = jax.lax.cond(logprobs_wanted, reported, skipped)
        values = (emitted, logprobs, top_ids, top_logprobs)
        outputs = tuple(jax.lax.dynamic_update_slice_in_dim(out, jnp.swapaxes(value, 0, 1), step * width, 0)
                        for out, value in zip(outputs, values, strict=True))

        # 4. the MTP layer over the verified positions, then the next round's first draft
        mtp_positions = jnp.where(offsets[None, :] <= accepted[:, None], chunk_positions, -1)
        mtp_batch = StepBatch(empty_decode, empty_decode, chunk, mtp_positions, tables)
        last = jnp.arange(rows) * width + accepted
        mtp_logits, mtp_out, cache = paged_mtp_step(
            config, params, cache, mtp_batch, main_hidden, jnp.maximum(verified, 0).reshape(-1), last,
            options=options, block_pages=block_pages)
        token, probs = draw_drafts(mtp_logits, row_state, _tagged(round_keys, _NEXT_ROUND))
        drafts = _write_slots(drafts, slots, active, token, probs, mtp_out)

        counted = jnp.where(kept, emitted, row_state.output_counts.shape[1])  # out of range: dropped
        row_state = row_state.replace(
            keys=jnp.where(active[:, None], jax.random.key_data(next_keys), row_state.keys),
            output_counts=row_state.output_counts.at[jnp.arange(rows)[:, None], counted].add(1, mode="drop"))
        state = put_slot_rows(state, row_state, slots, active)
        kept_drafts = jnp.where(active, jnp.minimum(accepted, count), 0)
        counts = counts + jnp.stack([jnp.sum(active), jnp.sum(jnp.where(active, verifiable, 0)),
                                     jnp.sum(kept_drafts)]).astype(jnp.int32)
        tokens = jnp.where(active, next_token, tokens)
        positions = jnp.where(active, positions + accepted + 1, positions)
        remaining = jnp.where(active, jnp.where(stopped, 0, remaining - count), remaining)
        return step + 1, cache, state, drafts, tokens, positions, remaining, counts, outputs

    def more(carry):
        step, positions, remaining = carry[0], carry[5], carry[6]
        return (step < steps) & jnp.any((positions >= 0) & (remaining > 0) & (positions < limits))

    counts = jnp.zeros((3,), jnp.int32)
    carry = (jnp.int32(0), cache, state, drafts, tokens, positions, remaining, counts, outputs)
    _, cache, state, drafts, tokens, positions, remaining, counts, outputs = jax.lax.while_loop(
        more, body, carry)
    return outputs, (tokens, positions, remaining), counts, cache, state, drafts
