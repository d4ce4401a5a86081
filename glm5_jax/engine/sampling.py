"""Batched, jitted token sampler for the continuous-batching server.

The engine runs S request slots at once; each slot holds its own request's sampling
parameters, PRNG key and token history in a `SamplingState` of device arrays, so one compiled
`sample` call turns the model's [S, V] logits into one token per slot with no Python loop over
slots. `set_slot` installs a new request's `SlotOptions` (its options by name) into a slot between
steps (a small jitted update, the slot index traced so it never recompiles per slot).

Per slot, `sample` follows vLLM's order: repetition penalty (HF style, on tokens in the prompt or
the output so far), presence / frequency penalties (OpenAI style, on the output so far),
temperature, top_k, top_p, min_p, then a categorical draw with the slot's own key;
temperature 0 is greedy argmax of the penalised logits. Reported log-probabilities are those of
the raw model logits (vLLM's default), or, for slots whose request asks for logprobs_mode
"processed", of the processed distribution the token was drawn from (RL's behaviour policy).

A slot's random stream depends only on its seed and on how many steps it has run: its key is
derived from the seed alone and split once per step, and its draw uses only its own key and
logits row, so a seeded request reproduces whatever the other slots hold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from glm5_jax.engine.types import InvalidRequestError, SamplingParams

PRNG_IMPL = "threefry2x32"
_SEED_MASK = (1 << 64) - 1


@struct.dataclass
class SlotOptions:
    """A slot's sampling options by name, the per-slot fields of SamplingState that `set_slot`
    installs: scalars for one slot (float32; top_k int32, 0 = off; processed_logprobs bool, True =
    report log-probabilities of the processed distribution), or [S] arrays for all slots."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    processed_logprobs: jax.Array

    @classmethod
    def of(cls, params: SamplingParams, vocab_size: int) -> SlotOptions:
        """One slot's options from (validated) params, top_k capped at the vocabulary."""
        f32 = np.float32
        return cls(temperature=f32(params.temperature), top_p=f32(params.top_p),
                   top_k=np.int32(min(params.top_k, vocab_size)), min_p=f32(params.min_p),
                   repetition_penalty=f32(params.repetition_penalty),
                   presence_penalty=f32(params.presence_penalty),
                   frequency_penalty=f32(params.frequency_penalty),
                   processed_logprobs=np.bool_(params.logprobs_mode == "processed"))


@struct.dataclass
class SamplingState(SlotOptions):
    """Per-slot sampling parameters and history for S slots over a vocabulary of V tokens.

    SlotOptions' fields as [S] arrays: temperature, top_p, min_p, repetition_penalty,
    presence_penalty, frequency_penalty float32; top_k int32 (0 = off); processed_logprobs bool. And:
    keys: [S, 2] uint32, threefry2x32 key data (one key per slot).
    output_counts: [S, V] int32, how often each token has been generated in the slot's request.
    prompt_mask: [S, V] bool, True for tokens present in the slot's prompt.
    Neutral values (see `init_sampling_state`) leave the logits unchanged and sample at T = 1.
    """

    keys: jax.Array
    output_counts: jax.Array
    prompt_mask: jax.Array

    @property
    def num_slots(self) -> int:
        return self.output_counts.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.output_counts.shape[1]


def init_sampling_state(num_slots: int, vocab_size: int) -> SamplingState:
    """A state of `num_slots` slots with neutral parameters, empty history and seed-0 keys."""
    if num_slots < 1 or vocab_size < 1:
        raise ValueError(f"num_slots and vocab_size must be positive, got {num_slots}, {vocab_size}")
    # Distinct buffers per field (not one shared `ones`): the engine donates the whole state.
    ones = lambda: jnp.ones((num_slots,), jnp.float32)  # noqa: E731
    zeros = lambda: jnp.zeros((num_slots,), jnp.float32)  # noqa: E731
    return SamplingState(
        temperature=ones(),
        top_p=ones(),
        top_k=jnp.zeros((num_slots,), jnp.int32),
        min_p=zeros(),
        repetition_penalty=ones(),
        presence_penalty=zeros(),
        frequency_penalty=zeros(),
        processed_logprobs=jnp.zeros((num_slots,), jnp.bool_),
        keys=make_keys([0] * num_slots),
        output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((num_slots, vocab_size), jnp.bool_),
    )


def _split_seeds(seeds: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Seeds (any Python ints, taken modulo 2**64) -> (high, low) uint32 halves, each [N]."""
    values = [int(seed) & _SEED_MASK for seed in seeds]
    high = np.array([value >> 32 for value in values], np.uint32)
    low = np.array([value & 0xFFFFFFFF for value in values], np.uint32)
    return high, low


def _key_from_halves(high: jax.Array, low: jax.Array) -> jax.Array:
    """uint32 scalars -> [2] uint32 key data; all 64 bits of the seed matter."""
    key = jax.random.fold_in(jax.random.key(low, impl=PRNG_IMPL), high)
    return jax.random.key_data(key)


@jax.jit
def _keys_from_halves(high: jax.Array, low: jax.Array) -> jax.Array:
    return jax.vmap(_key_from_halves)(high, low)


def make_keys(seeds: Sequence[int]) -> jax.Array:
    """Per-slot key data [N, 2] uint32 for `seeds`, exactly as `set_slot` derives a slot's key.

    Useful to seed many slots at once (e.g. `state.replace(keys=make_keys(range(S)))`).
    """
    high, low = _split_seeds(seeds)
    return _keys_from_halves(jnp.asarray(high), jnp.asarray(low))


def slot_options(options: SlotOptions) -> dict[str, jax.Array]:
    """{field: value} of SlotOptions' own fields (of a SamplingState too: its per-slot options)."""
    return {field.name: getattr(options, field.name) for field in dataclasses.fields(SlotOptions)}


@jax.jit
def _set_slot(state: SamplingState, slot: jax.Array, options: SlotOptions, prompt_row: jax.Array,
              seed_high: jax.Array, seed_low: jax.Array) -> SamplingState:
    """Writes one slot's options (scalars), prompt mask [V] and key; resets its output counts."""
    return state.replace(
        **{name: getattr(state, name).at[slot].set(value) for name, value in slot_options(options).items()},
        keys=state.keys.at[slot].set(_key_from_halves(seed_high, seed_low)),
        output_counts=state.output_counts.at[slot].set(0),
        prompt_mask=state.prompt_mask.at[slot].set(prompt_row),
    )


def set_slot(state: SamplingState, slot: int, params: SamplingParams, prompt_ids: Sequence[int],
             seed: int) -> SamplingState:
    """Installs a new request into `slot`; the other slots are untouched.

    Sets the slot's parameters from `params` (validated; InvalidRequestError if out of range,
    or if a prompt id is outside [0, V)), resets its output counts, sets its prompt mask [V]
    from `prompt_ids` and its key from `seed` (any int, taken modulo 2**64; the engine passes
    params.seed when given, else a random one). One compiled function serves every slot.
    """
    num_slots, vocab_size = state.output_counts.shape
    if not 0 <= int(slot) < num_slots:
        raise ValueError(f"slot must be in [0, {num_slots}), got {slot}")
    params.validate()
    ids = np.asarray(list(prompt_ids), np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size}), got "
                                  f"{int(ids.min())}..{int(ids.max())}")
    prompt_row = np.zeros((vocab_size,), np.bool_)
    prompt_row[ids] = True
    high, low = _split_seeds([seed])
    return _set_slot(state, np.int32(slot), SlotOptions.of(params, vocab_size), prompt_row, high[0], low[0])


def apply_penalties(logits: jax.Array, state: SamplingState) -> jax.Array:
    """Repetition, then presence and frequency penalties. logits [S, V] -> [S, V] f32.

    Repetition (per slot r, 1 = off): for tokens in the prompt or the output so far, positive
    logits are divided by r and negative ones multiplied by r. Then, with c the token's output
    count, logit -= presence * (c > 0) + frequency * c.
    """
    logits = logits.astype(jnp.float32)
    counts = state.output_counts
    generated = counts > 0
    seen = state.prompt_mask | generated
    penalty = state.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = jnp.where(seen, repeated, logits)
    return (logits - state.presence_penalty[:, None] * generated.astype(jnp.float32)
            - state.frequency_penalty[:, None] * counts.astype(jnp.float32))


def _filter_sorted(sorted_logits: jax.Array, state: SamplingState) -> jax.Array:
    """top_k, top_p, min_p on temperature-scaled logits sorted descending per row.

    sorted_logits [S, V] -> the same with dropped entries set to -inf. The first (highest)
    entry is always kept.
    """
    num_slots, vocab_size = sorted_logits.shape
    rank = jnp.arange(vocab_size, dtype=jnp.int32)[None, :]
    top_k = state.top_k[:, None]
    keep = (top_k <= 0) | (rank < top_k)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    # Nucleus on the top_k-renormalised distribution: keep a token while the probability mass
    # strictly above it is still below top_p, i.e. the smallest prefix that reaches top_p.
    probs = jax.nn.softmax(masked, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    top_p = state.top_p[:, None]
    keep &= (top_p >= 1.0) | (mass_above < top_p)

    # min_p: p_i >= min_p * p_max  <=>  exp(l_i - l_max) >= min_p (normalisation cancels).
    relative = jnp.exp(sorted_logits - sorted_logits[:, :1])
    keep &= relative >= state.min_p[:, None]
    keep = keep.at[:, 0].set(True)
    return jnp.where(keep, sorted_logits, -jnp.inf)


def filter_logits(scaled_logits: jax.Array, state: SamplingState) -> jax.Array:
    """top_k, top_p, min_p as `sample` applies them, in vocabulary order (for inspection/tests).

    scaled_logits: [S, V], already penalised and divided by temperature. Returns [S, V] f32 with
    the dropped tokens set to -inf; `sample` draws from the softmax of this.
    """
    scaled_logits = scaled_logits.astype(jnp.float32)
    vocab_size = scaled_logits.shape[-1]
    iota = jnp.broadcast_to(jnp.arange(vocab_size, dtype=jnp.int32), scaled_logits.shape)
    neg_sorted, sorted_ids = jax.lax.sort((-scaled_logits, iota), dimension=-1, num_keys=1,
                                          is_stable=True)
    filtered = _filter_sorted(-neg_sorted, state)
    rows = jnp.arange(scaled_logits.shape[0])[:, None]
    return jnp.full_like(scaled_logits, -jnp.inf).at[rows, sorted_ids].set(filtered)


def first_argmax(values: jax.Array, block: int = 128) -> jax.Array:
    """jnp.argmax over the last axis ([..., V] -> [...] int32, the first of tied maxima, NaN
    counting as the maximum), as a max per block of `block` entries, then the first block holding
    the maximum, then the position in it: XLA:CPU runs argmax's (value, index) reduction
    serially, ~3x slower than this at [32, 4096] and ~5x at [1, 4096]."""
    *lead, size = values.shape
    padded = -(-size // block) * block
    if padded != size:  # -inf padding sits after every real entry: never the first maximum
        values = jnp.pad(values, [(0, 0)] * len(lead) + [(0, padded - size)], constant_values=-jnp.inf)
    blocks = values.reshape(*lead, padded // block, block)

    def first_of_max(x):  # plain reductions vectorise; the variadic one does not
        is_max = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
        iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        return jnp.min(jnp.where(is_max, iota, x.shape[-1]), axis=-1)

    block_index = first_of_max(jnp.max(blocks, axis=-1))
    in_block = jnp.take_along_axis(blocks, block_index[..., None, None], axis=-2)[..., 0, :]
    return block_index * block + first_of_max(in_block)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """jax.random.categorical(key, logits) over the last axis (the same Gumbel-max draw, the same
    tokens) with `first_argmax`: [..., V] -> [...] int32."""
    return first_argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def slot_rows(tree, slots):
    """Rows `slots` [R] of a per-slot state (any pytree of [S, ...] arrays)."""
    return jax.tree.map(lambda a: a[slots], tree)


def put_slot_rows(tree, rows, slots, keep):
    """Writes rows [R, ...] back to their slots where keep [R] (other rows are dropped)."""
    return jax.tree.map(lambda a, b: a.at[jnp.where(keep, slots, a.shape[0])].set(b, mode="drop"), tree, rows)


def processed_logits(penalised: jax.Array, state: SamplingState) -> jax.Array:
    """Temperature, then top_k / top_p / min_p: [S, V] -> the logits `sample` draws from
    (speculative decoding gives its draft and target distributions the same processing)."""
    temperature = state.temperature[:, None]
    scaled = penalised / jnp.where(temperature > 0, temperature, 1.0)
    # The sort behind top_k / top_p / min_p is the costly part of a step: skip it when no slot
    # filters. Draws happen in vocabulary order either way, so a slot's tokens do not depend
    # on which branch its neighbours' settings select.
    filtering = jnp.any((state.top_k > 0) | (state.top_p < 1.0) | (state.min_p > 0.0))
    return jax.lax.cond(filtering, lambda: filter_logits(scaled, state), lambda: scaled)


def _draw(key_data: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One slot: key data [2], logits [V] -> (next key data [2], sampled index int32)."""
    next_key, use_key = jax.random.split(jax.random.wrap_key_data(key_data, impl=PRNG_IMPL))
    return jax.random.key_data(next_key), categorical(use_key, logits)


@functools.partial(jax.jit, static_argnames="num_top_logprobs")
def sample(logits: jax.Array, state: SamplingState, num_top_logprobs: int,
           logprobs_wanted: jax.Array | None = None, advance: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, SamplingState]:
    """Samples one token per slot; jitted, `num_top_logprobs` static.

    Args:
      logits: [S, V] model logits (cast to f32).
      state: the `SamplingState` of S slots.
      num_top_logprobs: n, how many top alternatives to report (0..V).
      logprobs_wanted: optional bool scalar; when False no log-probabilities are computed (the
        token's and the top alternatives' come back as zeros).
      advance: optional [S] bool, the slots whose state moves on (key split, token counted);
        default all.

    Returns (tokens, token_logprobs, top_ids, top_logprobs, new_state):
      tokens [S] int32; token_logprobs [S] f32, log_softmax of the RAW logits at `tokens`
      (of the processed logits the draw used, for slots with processed_logprobs and
      temperature > 0); top_ids [S, n] int32 and top_logprobs [S, n] f32, the n best
      log-probabilities of the same distribution, descending; new_state with each advancing
      slot's token counted in output_counts and its key split.

    Processing per slot (vLLM order): repetition penalty, presence / frequency penalties,
    temperature, top_k, top_p, min_p, categorical draw; temperature 0 = argmax of the penalised
    logits. Every slot is processed, active or not: the engine ignores idle slots' tokens and
    `set_slot` resets a slot's history.
    """
    num_slots, vocab_size = state.output_counts.shape
    if logits.shape != (num_slots, vocab_size):
        raise ValueError(f"logits must be [{num_slots}, {vocab_size}], got {logits.shape}")
    if not 0 <= num_top_logprobs <= vocab_size:
        raise ValueError(f"num_top_logprobs must be in [0, {vocab_size}], got {num_top_logprobs}")
    raw = logits.astype(jnp.float32)
    advance = jnp.ones((num_slots,), jnp.bool_) if advance is None else advance

    # Batches where no slot penalises (the common case) skip the [S, V] penalty arithmetic; the
    # conds return tokens, not logits (a branch that passed [S, V] through would copy it).
    penalising = jnp.any((state.repetition_penalty != 1.0) | (state.presence_penalty != 0.0)
                         | (state.frequency_penalty != 0.0))
    greedy_tokens = jax.lax.cond(penalising, lambda: first_argmax(apply_penalties(raw, state)),
                                 lambda: first_argmax(raw))

    # Batches where no advancing row samples (all greedy, or only idle slots at temperature > 0)
    # skip the processing and the draws and keep their keys.
    new_keys, sampled_tokens = jax.lax.cond(
        jnp.any((state.temperature > 0) & advance),
        lambda: jax.vmap(_draw)(state.keys, processed_logits(apply_penalties(raw, state), state)),
        lambda: (state.keys, greedy_tokens))
    tokens = jnp.where(state.temperature > 0, sampled_tokens, greedy_tokens)

    def report(log_probs):
        chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
        if not num_top_logprobs:
            return chosen, jnp.zeros((num_slots, 0), jnp.float32), jnp.zeros((num_slots, 0), jnp.int32)
        values, ids = jax.lax.top_k(log_probs, num_top_logprobs)
        return chosen, values, ids.astype(jnp.int32)

    # Rows reporting the processed distribution (greedy rows report raw: nothing was drawn). The
    # processing runs again here, only when some row asks for it: raw-only batches pay nothing.
    processed_rows = state.processed_logprobs & (state.temperature > 0)

    def reported():
        raw_log_probs = jax.nn.log_softmax(raw, axis=-1)

        def processed():
            log_probs = jax.nn.log_softmax(processed_logits(apply_penalties(raw, state), state), axis=-1)
            return report(jnp.where(processed_rows[:, None], log_probs, raw_log_probs))

        return jax.lax.cond(jnp.any(processed_rows), processed, lambda: report(raw_log_probs))

    def skipped():
        return (jnp.zeros((num_slots,), jnp.float32), jnp.zeros((num_slots, num_top_logprobs), jnp.float32),
                jnp.zeros((num_slots, num_top_logprobs), jnp.int32))

    token_logprobs, top_logprobs, top_ids = (reported() if logprobs_wanted is None
                                             else jax.lax.cond(logprobs_wanted, reported, skipped))
    counts = state.output_counts.at[jnp.arange(num_slots), tokens].add(advance.astype(jnp.int32))
    new_state = state.replace(keys=jnp.where(advance[:, None], new_keys, state.keys), output_counts=counts)
    return tokens, token_logprobs, top_ids, top_logprobs, new_state
