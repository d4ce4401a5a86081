"""The continuous-batching inference engine.

A background thread owns the model state: a latent cache of `max_slots` sequences of
`max_context` positions (glm5_jax.model.decode; sliding-window layers keep only a ring of
`sliding_window` entries, copied with the slot on insertion), and the per-slot sampler state. Each loop
iteration it admits waiting requests into free slots (prefill with the prompt padded to a
power-of-two bucket, so only a handful of shapes ever compile, then insertion into the slot),
runs ONE jitted decode step over all slots (idle slots write nowhere), samples a token per
slot and hands each request its event. Requests join and leave between steps; cancellation
frees a slot at the next step. Compilations are counted from JAX's own compile events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.decode import decode_step, init_cache, insert_slot
from glm5_jax.serve.sampling import init_sampling_state, sample, set_slot
from glm5_jax.serve.types import MAX_TOP_LOGPROBS, GenerationEvent, InvalidRequestError, SamplingParams

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_MIN_BUCKET = 16


class RequestStream:
    """A request's output: an async iterator of GenerationEvent, ending with a finish reason."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.params = params
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.finished = False

    def cancel(self) -> None:
        """Stops generation; the engine frees the slot and ends the stream with "abort"."""
        self.cancelled.set()

    def _deliver(self, event: GenerationEvent) -> None:  # engine thread
        if event.finish_reason is not None:
            self.finished = True
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (client and server shut down)
            pass

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            event = await self._events.get()
            yield event
            if event.finish_reason is not None:
                return


@dataclasses.dataclass
class _Slot:
    stream: RequestStream
    position: int  # where the next fed token goes
    last_token: int
    generated: int
    max_new: int


@jax.jit
def _sample_one_slot(logits, position, state, slot):
    """Samples slot `slot`'s first token from prefill logits [1, C, V] at `position`, leaving the
    other slots' sampler state untouched. Indices are traced: no compile per slot or length."""
    row = jax.lax.dynamic_index_in_dim(logits[0], position, 0, keepdims=True)  # [1, V]
    one = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1), state)
    token, logprob, top_ids, top_logprobs, one = sample(row, one, MAX_TOP_LOGPROBS)
    state = jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, slot, 0), state, one)
    return token[0], logprob[0], top_ids[0], top_logprobs[0], state


def prefill_buckets(max_context: int) -> list[int]:
    """Prompt lengths prefill compiles for: powers of two from 16, and max_context."""
    buckets = [b for b in (2**i for i in range(4, 31)) if b < max_context]
    return buckets + [max_context]


class Engine:
    """Serves one model. Thread-safe `submit`; call it from the asyncio event loop."""

    def __init__(self, config: ModelConfig, params, tokenizer: tokenizers.Tokenizer | None, *,
                 max_slots: int = 8, max_context: int = 1024, seed: int | None = None):
        if max_slots < 1 or max_context < 2:
            raise ValueError(f"max_slots ({max_slots}) must be >= 1 and max_context ({max_context}) >= 2")
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.max_slots = max_slots
        self.max_context = min(max_context, config.max_position_embeddings)
        self.eos_token_ids = tuple(config.eos_token_ids)
        self._buckets = prefill_buckets(self.max_context)
        self._cache = init_cache(config, max_slots, self.max_context)
        self._sampling = init_sampling_state(max_slots, config.vocab_size)
        self._slots: list[_Slot | None] = [None] * max_slots
        self._waiting: queue.Queue[RequestStream] = queue.Queue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._seed_source = np.random.default_rng(seed)
        self._compiles = 0
        self.steps = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration_event)
        self._thread = threading.Thread(target=self._run, name="glm5-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public
    @property
    def compile_count(self) -> int:
        """XLA compilations since the engine started (steady state adds none)."""
        return self._compiles

    @property
    def active_requests(self) -> int:
        return sum(slot is not None for slot in self._slots)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        params.validate()
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens but this server's context is "
                f"{self.max_context} tokens (prompt + output); shorten the prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.config.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        stream = RequestStream(f"req-{next(self._ids)}", list(prompt_ids), params,
                               asyncio.get_running_loop())
        self._waiting.put(stream)
        self._wakeup.set()
        return stream

    def shutdown(self) -> None:
        """Stops the engine thread; unfinished requests end with "abort"."""
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=30)
        jax.monitoring.unregister_event_duration_listener(self._on_duration_event)

    # ------------------------------------------------------------------ engine thread
    def _on_duration_event(self, event: str, duration: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            self._compiles += 1

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drop_cancelled()
                self._admit()
                if any(slot is not None for slot in self._slots):
                    self._decode()
                else:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        finally:
            for index, slot in enumerate(self._slots):
                if slot is not None:
                    self._finish(index, "abort")
            while not self._waiting.empty():
                self._waiting.get_nowait()._deliver(GenerationEvent(None, finish_reason="abort"))

    def _drop_cancelled(self) -> None:
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.stream.cancelled.is_set():
                self._finish(index, "abort")

    def _finish(self, index: int, reason: str, event: GenerationEvent | None = None) -> None:
        slot = self._slots[index]
        self._slots[index] = None
        slot.stream._deliver(event if event is not None else GenerationEvent(None, finish_reason=reason))

    def _admit(self) -> None:
        while not self._waiting.empty() and None in self._slots:
            stream = self._waiting.get_nowait()
            if stream.cancelled.is_set():
                stream._deliver(GenerationEvent(None, finish_reason="abort"))
                continue
            self._prefill(self._slots.index(None), stream)

    def _prefill(self, index: int, stream: RequestStream) -> None:
        prompt = stream.prompt_ids
        length = len(prompt)
        bucket = next(b for b in self._buckets if b >= length)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :length] = prompt
        # Padding positions point past the cache: their cache writes are dropped.
        positions = np.full((1, bucket), self.max_context, np.int32)
        positions[0, :length] = np.arange(length)
        single = init_cache(self.config, 1, self.max_context)
        logits, single = decode_step(self.config, self.params, single, jnp.asarray(tokens),
                                     jnp.asarray(positions))
        self._cache = insert_slot(self._cache, single, jnp.int32(index))
        params = stream.params
        seed = params.seed if params.seed is not None else int(self._seed_source.integers(2**62))
        self._sampling = set_slot(self._sampling, index, params, prompt, seed)
        slot = _Slot(stream, position=length, last_token=0, generated=0,
                     max_new=min(params.max_tokens, self.max_context - length))
        self._slots[index] = slot
        token, logprob, top_ids, top_logprobs, self._sampling = _sample_one_slot(
            logits, jnp.int32(length - 1), self._sampling, jnp.int32(index))
        self._emit(index, int(token), float(logprob), np.asarray(top_ids), np.asarray(top_logprobs))

    def _decode(self) -> None:
        tokens = np.zeros((self.max_slots, 1), np.int32)
        positions = np.full((self.max_slots, 1), self.max_context, np.int32)
        for index, slot in enumerate(self._slots):
            if slot is not None:
                tokens[index, 0], positions[index, 0] = slot.last_token, slot.position
        logits, self._cache = decode_step(self.config, self.params, self._cache, jnp.asarray(tokens),
                                          jnp.asarray(positions))
        chosen, logprobs, top_ids, top_logprobs, self._sampling = sample(
            logits[:, 0], self._sampling, MAX_TOP_LOGPROBS)
        chosen, logprobs = np.asarray(chosen), np.asarray(logprobs)
        top_ids, top_logprobs = np.asarray(top_ids), np.asarray(top_logprobs)
        self.steps += 1
        for index, slot in enumerate(self._slots):
            if slot is not None:
                slot.position += 1
                self._emit(index, int(chosen[index]), float(logprobs[index]), top_ids[index],
                           top_logprobs[index])

    def _emit(self, index: int, token: int, logprob: float, top_ids, top_logprobs) -> None:
        slot = self._slots[index]
        params = slot.stream.params
        slot.generated += 1
        slot.last_token = token
        alternatives = ()
        if params.logprobs:
            alternatives = tuple((int(i), float(p)) for i, p in
                                 zip(top_ids[:params.logprobs], top_logprobs[:params.logprobs], strict=True))
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif slot.generated >= slot.max_new:
            reason = "length"
        event = GenerationEvent(token, logprob if params.logprobs is not None else None, alternatives,
                                reason)
        if reason is None:
            slot.stream._deliver(event)
        else:
            self._finish(index, reason, event)


def warm_up(engine: Engine, prompt_lengths=(1,), timeout: float = 600.0) -> None:
    """Compiles prefill for the given prompt lengths' buckets, slot insertion, the samplers and
    the decode step, so that requests do not pay for compilation. Runs the requests twice: the
    second round compiles what only a cache or sampler state that came out of a step needs."""

    async def one(length):
        stream = engine.submit([0] * length, SamplingParams(max_tokens=2, temperature=0.0))
        async for _ in stream:
            pass

    async def all_lengths():
        for _ in range(2):
            await asyncio.wait_for(asyncio.gather(*(one(n) for n in prompt_lengths)), timeout)

    asyncio.run(all_lengths())
