"""The model runner: owns the parameters, the page pool, the per-slot sampler state and the jitted
device programs the engine calls (no scheduling decisions).

- `mixed_step`: one `paged_step` over decode rows and prefill chunk rows, then sampling of the
  slots whose pending tokens are all computed.
- `decode`: up to `steps` decode steps in ONE device call (`decode_loop`): model step, sampling,
  EOS / stop-token / length checks; rows that finish stop writing; all new tokens come back at
  once. Pages for those steps are reserved by the scheduler beforehand. `launch_decode` only
  dispatches (the engine prepares the next call meanwhile); a continuation starts from the
  previous call's device state, so back-to-back calls need no host round trip in between.
- `launch_speculative`: the same, in rounds of MTP speculative decoding (glm5_jax/engine/
  speculative.py): the MTP layer drafts, one chunk per row verifies, up to N + 1 tokens per round.
Shapes come from a few fixed buckets (decode rows: powers of two up to max_slots; chunk
geometries of one token budget; block tables padded to max_pages), so steady state compiles
nothing. Every step program runs through its ahead-of-time compiled executable (`_call`,
glm5_jax/programs.py): compiled, or loaded from the program store, once per shape, then
dispatched without tracing or hashing static options; host arrays go in as they are.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.engine.grammar import ALL_ALLOWED, apply_allowed_bits, bitmask_words
from glm5_jax.engine.sampling import (
    SamplingState,
    init_sampling_state,
    put_slot_rows,
    sample,
    set_slot,
    slot_rows,
)
from glm5_jax.engine.speculative import DraftState, init_draft_state, mtp_after_step, speculative_loop
from glm5_jax.engine.types import MAX_TOP_LOGPROBS, SamplingParams
from glm5_jax.model.attention.linear_pages import restore_state, save_state
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.paged_decode import (
    DEFAULT_BLOCK_POSITIONS,
    StepBatch,
    init_paged_cache,
    init_state_snapshots,
    paged_step,
    read_page,
    serving_layout,
    write_page,
)
from glm5_jax.model.transformer import param_logical_axes
from glm5_jax.parallel import constrain
from glm5_jax.parallel.sharding import SERVING_RULES, activate, replicated, serving_param_shardings
from glm5_jax.programs import ProgramStore, default_directory, program_store, signature

MAX_STOP_IDS = 16  # stop token ids the device checks per row (the host re-checks all of them)


def host_array(array) -> np.ndarray:
    """A device array as a host array. One split over other processes' devices (multi-process
    serving, glm5_jax/engine/multihost.py) is gathered first: a collective, which every process
    reaches at the same point because every process makes the same runner calls."""
    if isinstance(array, jax.Array) and not (array.is_fully_addressable or array.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


class DecodeCall(NamedTuple):
    """A dispatched `decode_loop` or `speculative_loop` (JAX dispatch is asynchronous: nothing
    waits for it here). outputs: device arrays [steps, R] (see Sampled; [steps * (N + 1), R] for
    N-draft speculation, -1 where a round emitted fewer); tokens, positions, remaining [R]: the
    loop's final state on the device, where a continuation call starts without a host round
    trip; speculation: [3] int32 (verify rounds, drafts verified, drafts accepted) or None."""

    outputs: tuple
    tokens: jax.Array
    positions: jax.Array
    remaining: jax.Array
    speculation: jax.Array | None = None


class Scored(NamedTuple):
    """Host copies of a step's prompt scores, per chunk token: logprobs [T] of its target
    (the next prompt token), top_ids / top_logprobs [T, MAX_TOP_LOGPROBS]."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class Sampled(NamedTuple):
    """Host copies of sampled tokens. tokens [..., R] int32 (-1 = none), logprobs [..., R],
    top_ids / top_logprobs [..., R, MAX_TOP_LOGPROBS]."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def _sample_rows(logits, rows: SamplingState, logprobs_wanted, allowed, advance=None):
    """Samples rows of logits [R, V] with their own sampler state rows [R, ...] (the state of
    each row's slot). logprobs_wanted: bool scalar, whether any row reports log-probabilities.
    allowed: [R, ceil(V/32)] int32 bitmask of the tokens each row may sample (constrained
    decoding; all bits set = free). advance: see `sample`. Returns `sample`'s tuple."""
    logits = constrain(logits, (None, None))  # on a mesh: whole rows (the vocab gathered) for the sampler
    return sample(apply_allowed_bits(logits, allowed), rows, MAX_TOP_LOGPROBS, logprobs_wanted, advance)


@functools.partial(jax.jit, donate_argnames=("state",))
def _sample_slots(logits, state: SamplingState, slots, mask, logprobs_wanted, allowed):
    """`_sample_rows` with the sampler state of `slots` [R]; only rows where mask [R] advance
    their slot's state (keys, counts)."""
    rows = slot_rows(state, slots)
    tokens, logprobs, top_ids, top_logprobs, rows = _sample_rows(logits, rows, logprobs_wanted, allowed, mask)
    return tokens, logprobs, top_ids, top_logprobs, put_slot_rows(state, rows, slots, mask)


def _score(logits, targets):
    """Prompt scoring: logits [T, V], targets [T] int32 (-1 = none) -> (log-probability of each
    target [T], top alternatives' ids and log-probabilities [T, MAX_TOP_LOGPROBS])."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_logprobs


@functools.partial(jax.jit, static_argnames=("config", "options", "block_pages"),
                   donate_argnames=("cache", "state", "drafts"))
def _mixed_step(config, params, cache, state, batch: StepBatch, sample_rows, slots, mask, logprobs_wanted,
                allowed, targets, drafts, next_tokens, *, options, block_pages):
    """One step. targets: None, or [Gc * Qc] int32 next-token ids of the chunk tokens (-1 =
    none) to score every chunk token's logits against (prompt log-probabilities). drafts: None,
    or the DraftState of speculative decoding, with next_tokens [T] (each flat token's next
    token where the host knows it, else -1): the MTP layer then runs over the step's tokens
    (`speculative.mtp_after_step`) and draws the sampled slots' first drafts."""
    rows = sample_rows
    if targets is not None:
        chunk_rows = batch.decode_tokens.shape[0] + jnp.arange(targets.shape[0], dtype=jnp.int32)
        rows = jnp.concatenate([sample_rows, chunk_rows])
    logits, hidden, cache = paged_step(config, params, cache, batch, rows, options=options,
                                       block_pages=block_pages, with_hidden=True)
    sampled = sample_rows.shape[0]
    tokens, logprobs, top_ids, top_logprobs, state = _sample_slots(logits[:sampled], state, slots, mask,
                                                                   logprobs_wanted, allowed)
    scores = None if targets is None else _score(logits[sampled:], targets)
    if drafts is not None:
        sampled_rows = jnp.where(mask, sample_rows, next_tokens.shape[0])  # out of range: dropped
        next_tokens = next_tokens.at[sampled_rows].set(tokens, mode="drop")
        cache, drafts = mtp_after_step(config, params, cache, drafts, slot_rows(state, slots), batch, hidden,
                                       next_tokens, sample_rows, slots, mask, options=options,
                                       block_pages=block_pages)
    return (tokens, logprobs, top_ids, top_logprobs), scores, cache, state, drafts


@functools.partial(jax.jit, static_argnames=("config", "options", "block_pages", "steps"),
                   donate_argnames=("cache", "state"))
def decode_loop(config: ModelConfig, params, cache, state: SamplingState, tokens, positions, tables, slots,
                remaining, stop_ids, logprobs_wanted, allowed, *, options, block_pages: int, steps: int):
    """Up to `steps` decode steps on the device.

    tokens, positions, slots, remaining: [R] int32 (position -1 = padding row; slots: each row's
    sampler slot, which is also its KDA state slot; remaining = tokens the row may still
    generate); tables: [R, W]; stop_ids: [R, MAX_STOP_IDS] (-1 = none), ids that
    end a row (EOS included unless ignored); allowed: [R, ceil(V/32)] int32 token bitmask applied
    at every step (a constrained row runs one step per call: remaining 1). Returns (Sampled-like
    tuple of [steps, R] arrays with token -1 after a row finished, (tokens, positions,
    remaining) after the last step, cache, state). Stops early when every row has finished.
    """
    rows = tokens.shape[0]
    empty_chunk = jnp.zeros((0, 0), jnp.int32)
    outputs = (jnp.full((steps, rows), -1, jnp.int32), jnp.zeros((steps, rows), jnp.float32),
               jnp.zeros((steps, rows, MAX_TOP_LOGPROBS), jnp.int32),
               jnp.zeros((steps, rows, MAX_TOP_LOGPROBS), jnp.float32))

    # The rows' sampler state is read from its slots once and written back once, not per step.
    started = (positions >= 0) & (remaining > 0)  # rows that may run at all (a row never restarts)
    row_state = slot_rows(state, slots)

    def body(carry):
        step, cache, row_state, tokens, positions, remaining, outputs = carry
        active = (positions >= 0) & (remaining > 0)
        batch = StepBatch(tokens, jnp.where(active, positions, -1), empty_chunk, empty_chunk, tables, slots)
        logits, cache = paged_step(config, params, cache, batch, jnp.arange(rows), options=options,
                                   block_pages=block_pages)
        new, logprobs, top_ids, top_logprobs, row_state = _sample_rows(logits, row_state, logprobs_wanted,
                                                                       allowed, active)
        new = jnp.where(active, new, -1)
        outputs = tuple(out.at[step].set(value) for out, value in
                        zip(outputs, (new, logprobs, top_ids, top_logprobs), strict=True))
        stopped = jnp.any(new[:, None] == stop_ids, axis=-1) & (new >= 0)
        remaining = jnp.where(stopped, 0, remaining - 1)
        return step + 1, cache, row_state, new, jnp.where(active, positions + 1, -1), remaining, outputs

    def more(carry):
        step, _, _, _, positions, remaining, _ = carry
        return (step < steps) & jnp.any((positions >= 0) & (remaining > 0))

    carry = (jnp.int32(0), cache, row_state, tokens, positions, remaining, outputs)
    _, cache, row_state, tokens, positions, remaining, outputs = jax.lax.while_loop(more, body, carry)
    return outputs, (tokens, positions, remaining), cache, put_slot_rows(state, row_state, slots, started)


class ModelRunner:
    """Device state and programs of one served model (see the module docs).

    mesh: serve on a `jax.sharding.Mesh` (see glm5_jax.parallel.mesh): the weights (float or
    quantized) split by their logical axes under SERVING_RULES (`serving_param_shardings`:
    heads, MLP units and vocab over `tensor`, routed experts over `expert`); the step's tokens,
    the page pool and the sampler state replicated (every tensor shard's heads read the whole
    MLA latent); the sampler on gathered logits. Weights already placed that way (loaded
    straight into their shardings) are not moved.

    state_snapshots: a hybrid model's snapshot pool size (prefix caching: the KDA state at cached
    page boundaries, `save_state` / `restore_state`; 0 = none), replicated like the page pool.

    programs: where the compiled step programs come from (None: the process's store in
    `programs.default_directory()`, inside JAX's compilation cache when that is on).
    """

    def __init__(self, config: ModelConfig, params, *, max_slots: int, num_pages: int, page_size: int,
                 max_pages: int, options=None, block_positions: int = DEFAULT_BLOCK_POSITIONS,
                 mesh: jax.sharding.Mesh | None = None, speculative_tokens: int = 0,
                 state_snapshots: int = 0, programs: ProgramStore | None = None):
        if state_snapshots and not config.has_linear_layers:
            raise ValueError("state snapshots are for hybrid (KDA) models; this model has no linear layers")
        if speculative_tokens and config.has_linear_layers:
            raise ValueError("speculative decoding is not available for hybrid (GLM-5.3-Flash, glm5_next) "
                             "models: their checkpoints' MTP layer is not loaded here, and a rejected draft "
                             "would have to roll the KDA state back; serve with speculative_tokens 0")
        if speculative_tokens and not config.num_mtp_layers:
            raise ValueError("speculative decoding drafts with the model's MTP layer, and this model has "
                             "none (num_mtp_layers = 0): serve it with speculative_tokens 0")
        self.config = config
        self.speculative_tokens = speculative_tokens
        self.mesh = mesh
        self.options = options
        self.programs = programs if programs is not None else program_store(default_directory())
        self._compiled: dict[tuple, jax.stages.Compiled] = {}  # (name, steps, input signature) -> program
        self._free_bits: dict[int, jax.Array] = {}  # rows -> all-allowed device mask
        self._install(params)
        self.max_slots = max_slots
        self.page_size = page_size
        self.block_pages = max(1, min(block_positions // page_size, max_pages))
        if config.index_kpool:  # pooled DSA streams whole pools: blocks a multiple of index_kpool
            step = config.index_kpool // math.gcd(config.index_kpool, page_size)
            self.block_pages = -(-self.block_pages // step) * step
        # Table width: whole streamed blocks, so the last block never reads past the table.
        self.table_width = -(-max_pages // self.block_pages) * self.block_pages
        self.num_pages = num_pages
        self.state_snapshots = state_snapshots
        self.reset()

    def _install(self, params, copy: bool = False) -> None:
        """Serves `params` (the training layout): placed on the mesh's serving shardings, then
        `serving_layout`; copy: never alias the caller's buffers (see load_weights)."""
        if self.mesh is not None:
            shardings = serving_param_shardings(param_logical_axes(self.config), self.mesh, params)
            params = jax.device_put(params, shardings, may_alias=False if copy else None)
        elif copy:  # a buffer copy, where the arrays are (jnp.array would compile a copy program per shape)
            params = jax.device_put(params, may_alias=False)
        # What load_weights checks new params against: the training layout's shapes and dtypes.
        self.param_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.params = serving_layout(self.config, params, self.options)  # per-layer arrays when unrolled

    def load_weights(self, params) -> None:
        """Serves `params` from now on: a nested dict in the training layout (as `init_params` or
        the trainer's TrainState.params give), with the shapes and dtypes of the params served
        now (ValueError naming the first mismatching path otherwise). The arrays are copied
        (device_put into the serving shardings on a mesh): the trainer may donate its buffers
        afterwards. Same shapes, dtypes and shardings: the step programs are not recompiled.
        The caller must not run a step meanwhile, and must flush every cached page computed
        with the old weights (Engine.load_weights does both)."""
        mismatch = _first_mismatch(self.param_specs, params)
        if mismatch is not None:
            raise ValueError(f"load_weights: {mismatch}; the served model's parameters have other "
                             "shapes/dtypes (a different config, or quantized params?)")
        self._install(params, copy=True)

    def _place(self, tree):
        return tree if self.mesh is None else jax.device_put(tree, replicated(self.mesh))

    def _on_mesh(self):
        """The context jitted programs are traced and run in (the mesh and its rules)."""
        return contextlib.nullcontext() if self.mesh is None else activate(self.mesh, SERVING_RULES)

    def _call(self, name: str, function, args: tuple, inputs: tuple, static_args: tuple = (),
              **static_kwargs):
        """`function(*static_args, *args, **static_kwargs)` through its compiled program. inputs:
        the part of args that changes from call to call (host arrays, a continuation's device
        state); its shapes and dtypes, with static_kwargs' `steps`, select the program. The
        runner's own state (params, page pool, sampler state) keeps its shapes and shardings,
        and every other static argument is the runner's own: neither is hashed per call."""
        key = (name, static_kwargs.get("steps"), signature(inputs))
        program = self._compiled.get(key)
        if program is None:
            with self._on_mesh():
                program = self.programs.compiled(name, function, static_args, args, static_kwargs, self.mesh)
            self._compiled[key] = program
        return program(*args)

    # ------------------------------------------------------------------ sampler slots
    def set_slot(self, slot: int, params: SamplingParams, prompt_ids, seed: int) -> None:
        with self._on_mesh():
            self.sampling = set_slot(self.sampling, slot, params, prompt_ids, seed)

    def read_slot(self, slot: int) -> SamplingState:
        """The slot's sampler state (parameters, key, counts) as host arrays, to restore after
        preemption."""
        slot = np.int32(slot)
        return jax.tree.map(host_array, self._call("read_slot", _read_slot, (self.sampling, slot), (slot,)))

    def write_slot(self, slot: int, row: SamplingState) -> None:
        slot = np.int32(slot)
        self.sampling = self._call("write_slot", _write_slot, (self.sampling, slot, row), (slot, row))

    # ------------------------------------------------------------------ pages
    def read_page(self, page: int):
        page = np.int32(page)
        return jax.tree.map(host_array, self._call("read_page", read_page, (self.cache, page), (page,),
                                                   num_pages=self.num_pages))

    def write_page(self, page: int, data) -> None:
        page = np.int32(page)
        self.cache = self._call("write_page", write_page, (self.cache, page, data), (page, data),
                                num_pages=self.num_pages)

    # ------------------------------------------------------------------ KDA state snapshots
    def save_state(self, slot: int, snapshot: int) -> None:
        """Snapshot `snapshot` := the KDA state of sampler/state slot `slot` (every KDA layer).
        snapshot >= state_snapshots: nothing written (warm-up)."""
        with self._on_mesh():
            self.snapshots = save_state({name: self.cache[name] for name in self.snapshots}, self.snapshots,
                                        jnp.int32(slot), jnp.int32(snapshot), slots=self.max_slots,
                                        snapshots=self.state_snapshots)

    def restore_state(self, slot: int, snapshot: int) -> None:
        """Slot `slot`'s KDA state := snapshot `snapshot` (a prefix hit resumes from it). slot >=
        max_slots: nothing written (warm-up)."""
        with self._on_mesh():
            restored = restore_state({name: self.cache[name] for name in self.snapshots}, self.snapshots,
                                     jnp.int32(slot), jnp.int32(snapshot), slots=self.max_slots,
                                     snapshots=self.state_snapshots)
        self.cache = {**self.cache, **restored}

    def padding_batch(self, chunk_rows: int, chunk_len: int) -> StepBatch:
        """An all-padding mixed step (max_slots decode rows, a chunk geometry); fill in place.
        Rows' KDA state slots start at max_slots, an index whose writes are dropped."""
        rows = self.max_slots
        chunk = (chunk_rows, chunk_len)
        tables = np.zeros((rows + chunk_rows, self.table_width), np.int32)
        return StepBatch(np.zeros(rows, np.int32), np.full(rows, -1, np.int32), np.zeros(chunk, np.int32),
                         np.full(chunk, -1, np.int32), tables, np.full(rows + chunk_rows, rows, np.int32))

    def padding_decode(self, rows: int) -> dict[str, np.ndarray]:
        """All-padding `decode` inputs for `rows` rows (tokens, positions -1, tables, slots,
        remaining, stop_ids -1); fill in place."""
        return {"tokens": np.zeros(rows, np.int32), "positions": np.full(rows, -1, np.int32),
                "tables": np.zeros((rows, self.table_width), np.int32), "slots": np.zeros(rows, np.int32),
                "remaining": np.zeros(rows, np.int32),
                "stop_ids": np.full((rows, MAX_STOP_IDS), -1, np.int32)}

    # ------------------------------------------------------------------ steps
    def free_bits(self, rows: int) -> np.ndarray:
        """An all-allowed token bitmask [rows, ceil(V/32)] (fill constrained rows in place)."""
        return np.full((rows, bitmask_words(self.config.vocab_size)), ALL_ALLOWED, np.int32)

    def _allowed(self, allowed: np.ndarray | None, rows: int):
        """The mask a program takes: the host array, or for None (no row constrained) a cached
        all-allowed device array [rows, ceil(V/32)], so a free step builds and sends no mask."""
        if allowed is not None:
            return np.asarray(allowed, np.int32)
        if rows not in self._free_bits:
            placement = None if self.mesh is None else replicated(self.mesh)
            self._free_bits[rows] = jax.device_put(self.free_bits(rows), placement)
        return self._free_bits[rows]

    def mixed_step(self, batch: StepBatch, sample_rows: np.ndarray, slots: np.ndarray,
                   mask: np.ndarray, logprobs_wanted: bool = True, allowed: np.ndarray | None = None,
                   targets: np.ndarray | None = None, next_tokens: np.ndarray | None = None
                   ) -> tuple[Sampled, Scored | None]:
        """One step; samples rows sample_rows [R] of the flat batch for `slots` [R] where mask,
        each from the tokens its row of `allowed` (a bitmask, None = all) permits. With targets
        [Gc * Qc] (next-token ids of the chunk tokens, -1 = none) the chunk tokens are scored
        too (a separate compiled step, used only for prompt log-probabilities). With speculative
        decoding on, next_tokens [T] (each flat token's next token where known, else -1; None =
        none known) feed the MTP layer, which drafts for the sampled slots."""
        if self.drafts is not None and next_tokens is None:
            next_tokens = np.full(batch.decode_tokens.size + batch.chunk_tokens.size, -1, np.int32)
        inputs = (StepBatch(*(np.asarray(a, np.int32) for a in batch)), np.asarray(sample_rows, np.int32),
                  np.asarray(slots, np.int32), np.asarray(mask, bool), np.asarray(logprobs_wanted, bool),
                  self._allowed(allowed, len(sample_rows)),
                  None if targets is None else np.asarray(targets, np.int32))
        next_tokens = None if self.drafts is None else np.asarray(next_tokens, np.int32)
        args = (self.params, self.cache, self.sampling, *inputs, self.drafts, next_tokens)
        outputs, scores, self.cache, self.sampling, self.drafts = self._call(
            "mixed_step", _mixed_step, args, (*inputs, next_tokens), (self.config,), options=self.options,
            block_pages=self.block_pages)
        scored = None if scores is None else Scored(*(host_array(a) for a in scores))
        return Sampled(*(host_array(a) for a in outputs)), scored

    def launch_decode(self, tokens, positions, tables, slots, remaining, stop_ids, steps: int,
                      logprobs_wanted: bool = True, allowed: np.ndarray | None = None) -> DecodeCall:
        """Dispatches `decode_loop` and returns at once. tokens, positions, remaining may be host
        arrays or the device state of the previous call (`DecodeCall`), for a continuation.
        allowed: token bitmask [R, ceil(V/32)] (None = all tokens)."""
        inputs = (*_int32(tokens, positions, tables, slots, remaining, stop_ids),
                  np.asarray(logprobs_wanted, bool), self._allowed(allowed, len(slots)))
        args = (self.params, self.cache, self.sampling, *inputs)
        outputs, (tokens, positions, remaining), self.cache, self.sampling = self._call(
            "decode_loop", decode_loop, args, inputs, (self.config,), options=self.options,
            block_pages=self.block_pages, steps=steps)
        return DecodeCall(outputs, tokens, positions, remaining)

    def launch_speculative(self, tokens, positions, tables, limits, slots, remaining, stop_ids, steps: int,
                           logprobs_wanted: bool = True) -> DecodeCall:
        """Dispatches `speculative.speculative_loop` (`steps` rounds of speculative_tokens drafts)
        and returns at once; inputs as `launch_decode`, plus limits [R]: the positions each row's
        pages cover. Rows must be eligible (no penalties, no constraint: see speculative.py)."""
        inputs = (*_int32(tokens, positions, tables, limits, slots, remaining, stop_ids),
                  np.asarray(logprobs_wanted, bool))
        args = (self.params, self.cache, self.sampling, self.drafts, *inputs)
        outputs, (tokens, positions, remaining), counts, self.cache, self.sampling, self.drafts = self._call(
            "speculative_loop", speculative_loop, args, inputs, (self.config,), options=self.options,
            block_pages=self.block_pages, steps=steps, num_drafts=self.speculative_tokens)
        return DecodeCall(outputs, tokens, positions, remaining, counts)

    @staticmethod
    def fetch(call: DecodeCall) -> Sampled:
        """Waits for a dispatched call; its [steps, R] outputs as host arrays."""
        return Sampled(*(host_array(a) for a in call.outputs))

    def decode(self, tokens, positions, tables, slots, remaining, stop_ids, steps: int,
               logprobs_wanted: bool = True, allowed: np.ndarray | None = None) -> Sampled:
        """`decode_loop` on host arrays, waited for; returns [steps, R] host arrays."""
        return self.fetch(self.launch_decode(tokens, positions, tables, slots, remaining, stop_ids, steps,
                                             logprobs_wanted, allowed))

    def cache_lost(self) -> bool:
        """True when a failed step consumed (donated) the page pool or the sampler state, or left
        them holding an error (a call that failed on the device after dispatch)."""
        leaves = jax.tree.leaves((self.cache, self.sampling, self.drafts, self.snapshots))
        if any(leaf.is_deleted() for leaf in leaves):
            return True
        try:
            jax.block_until_ready(leaves)
        except Exception:  # noqa: BLE001 - any device error poisons the arrays for good
            return True
        return False

    def reset(self) -> None:
        """Fresh page pool, sampler state, draft state and state snapshots (at start, and after a
        failure destroyed them)."""
        config = self.config
        self.cache = self._place(init_paged_cache(config, self.num_pages, self.page_size,
                                                  self.options and self.options.compute_dtype,
                                                  mtp=bool(self.speculative_tokens),
                                                  state_slots=self.max_slots))
        self.sampling = self._place(init_sampling_state(self.max_slots, config.vocab_size))
        self.drafts: DraftState | None = self._place(init_draft_state(
            self.max_slots, config.vocab_size, config.hidden_size)) if self.speculative_tokens else None
        self.snapshots = self._place(init_state_snapshots(
            config, self.state_snapshots, self.options and self.options.compute_dtype)) \
            if self.state_snapshots else None


def _int32(*arrays) -> tuple:
    """Host arrays as int32 numpy arrays; device arrays (a continuation's state) as they are."""
    return tuple(a if isinstance(a, jax.Array) else np.asarray(a, np.int32) for a in arrays)


def _first_mismatch(specs, params) -> str | None:
    """The first difference of params from specs (tree structure, shape or dtype) in words, or None."""
    spec_leaves = dict(jax.tree_util.tree_leaves_with_path(specs))
    leaves = dict(jax.tree_util.tree_leaves_with_path(params))
    for path, spec in spec_leaves.items():
        if path not in leaves:
            return f"parameter {jax.tree_util.keystr(path)} is missing from the new params"
        leaf = leaves[path]
        shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf))
        if shape != spec.shape or dtype != spec.dtype:
            return (f"parameter {jax.tree_util.keystr(path)} is {dtype}{list(shape)}, the served one "
                    f"{spec.dtype}{list(spec.shape)}")
    extra = [path for path in leaves if path not in spec_leaves]
    return f"parameter {jax.tree_util.keystr(extra[0])} is not a served parameter" if extra else None


@functools.partial(jax.jit, donate_argnames=("state",))
def _write_slot(state: SamplingState, slot, row: SamplingState) -> SamplingState:
    return jax.tree.map(lambda a, b: a.at[slot].set(b), state, row)


@jax.jit
def _read_slot(state: SamplingState, slot) -> SamplingState:
    """Slot `slot`'s row of every field (one program, not a slice program per field)."""
    return jax.tree.map(lambda a: a[slot], state)
