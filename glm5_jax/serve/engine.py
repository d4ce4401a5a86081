"""The continuous-batching inference engine on a paged latent cache.

A background thread owns the model state: a pool of cache pages (glm5_jax.model.paged_decode),
their bookkeeping (glm5_jax.serve.paged_cache: allocator, prefix cache, host offload) and the
per-slot sampler state. Each iteration it
  1. drops cancelled requests and admits waiting ones into free slots when their uncached
     prompt fits in the free pages (prefix-cache hits are taken at admission);
  2. plans one step of at most `token_budget` tokens: one decode token per running sequence
     first, then prefill chunks of the waiting prompts (chunked prefill: a long prompt is spread
     over several steps and never stalls running requests), allocating pages as positions need
     them; when pages run out, the most recently admitted sequence is preempted: its pages are
     released and it is requeued at the front with prompt + generated tokens, to be recomputed
     (mostly from the prefix cache) later, its stream continuing without repeats;
  3. runs ONE jitted `paged_step` over the flat token batch, padded to one of two budgets (a small
     one for decode-only steps), so the compile count stays constant in steady state;
  4. samples the sequences whose pending tokens are all computed and hands out their events;
     full pages are registered in the prefix cache.
Compilations are counted from JAX's own compile events.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.paged_decode import init_paged_cache, paged_step, read_page, write_page
from glm5_jax.serve.observer import EngineObserver
from glm5_jax.serve.paged_cache import PageAllocator, page_hashes
from glm5_jax.serve.sampling import init_sampling_state, sample, set_slot
from glm5_jax.serve.types import MAX_TOP_LOGPROBS, GenerationEvent, InvalidRequestError, SamplingParams

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_SMALL_BUDGET = 64


class RequestStream:
    """A request's output: an async iterator of GenerationEvent, ending with a finish reason."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.params = params
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        # Prompt tokens served from the prefix cache, set at first admission (the API's usage).
        self.cached_tokens = 0
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
class _Sequence:
    """A request's engine-side state; survives preemption (then slot is None, pages empty)."""

    stream: RequestStream
    tokens: list[int]  # prompt + generated; tokens[computed:] still have to run through the model
    max_new: int
    seed: int
    slot: int | None = None
    computed: int = 0
    generated: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of pages[:len(hashes)]
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (first admission)
    first_token_at: float | None = None


@jax.jit
def _sample_rows(logits, state, mask):
    """Samples every slot but keeps the sampler state (keys, counts) of slots where mask [S] is
    False, i.e. slots that are mid-prefill or idle this step."""
    tokens, logprobs, top_ids, top_logprobs, new = sample(logits, state, MAX_TOP_LOGPROBS)
    keep = lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
    return tokens, logprobs, top_ids, top_logprobs, jax.tree.map(keep, new, state)


class Engine:
    """Serves one model. Thread-safe `submit`; call it from the asyncio event loop."""

    def __init__(self, config: ModelConfig, params, tokenizer: tokenizers.Tokenizer | None, *,
                 max_slots: int = 8, max_context: int = 1024, seed: int | None = None, page_size: int = 16,
                 num_pages: int | None = None, token_budget: int = 256, prefix_caching: bool = True,
                 host_cache_pages: int = 0, observer: EngineObserver | None = None):
        if max_slots < 1 or max_context < 2:
            raise ValueError(f"max_slots ({max_slots}) must be >= 1 and max_context ({max_context}) >= 2")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if token_budget < max_slots:
            raise ValueError(f"token_budget ({token_budget}) must be >= max_slots ({max_slots}): every "
                             "running sequence needs a decode token per step")
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.max_slots = max_slots
        self.max_context = min(max_context, config.max_position_embeddings)
        self.eos_token_ids = tuple(config.eos_token_ids)
        self.page_size = page_size
        self.max_pages = -(-self.max_context // page_size)  # pages one sequence can need
        num_pages = max_slots * self.max_pages if num_pages is None else num_pages
        if num_pages < self.max_pages:
            raise ValueError(f"num_pages ({num_pages}) must hold one full-context sequence: at least "
                             f"{self.max_pages} pages of {page_size} for max_context {self.max_context}")
        self.token_budget = token_budget
        self._budgets = sorted({min(token_budget, max(_SMALL_BUDGET, max_slots)), token_budget})
        self.prefix_caching = prefix_caching
        self.observer = observer or EngineObserver()
        self._cache = init_paged_cache(config, num_pages, page_size)
        self.pages = PageAllocator(num_pages, host_pages=host_cache_pages, offload=self._offload,
                                   reload=self._reload)
        self._sampling = init_sampling_state(max_slots, config.vocab_size)
        self._slots: list[_Sequence | None] = [None] * max_slots
        self._running: list[_Sequence] = []  # admission order (the last is preempted first)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._seed_source = np.random.default_rng(seed)
        self._compiles = 0
        self.steps = 0
        self.preemptions = 0
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
        seed = params.seed if params.seed is not None else int(self._seed_source.integers(2**62))
        max_new = min(params.max_tokens, self.max_context - len(prompt_ids))
        sequence = _Sequence(stream, list(prompt_ids), max_new, seed)
        self.observer.on_queued(stream.request_id, len(prompt_ids))
        self._waiting.append(sequence)
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

    def _offload(self, page: int):
        return jax.tree.map(np.asarray, read_page(self._cache, jnp.int32(page)))

    def _reload(self, page: int, data) -> None:
        self._cache = write_page(self._cache, jnp.int32(page), data)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self._step()
                else:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        finally:
            for sequence in list(self._running):
                self._finish(sequence, GenerationEvent(None, finish_reason="abort"))
            while self._waiting:
                self._finish(self._waiting.popleft(), GenerationEvent(None, finish_reason="abort"))

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self._running if s.stream.cancelled.is_set()]:
            self._finish(sequence, GenerationEvent(None, finish_reason="abort"))

    def _release(self, sequence: _Sequence) -> None:
        # Last page first: in the LRU order a prefix's tail is evicted before its head.
        for page in reversed(sequence.pages):
            self.pages.release(page)
        sequence.pages, sequence.hashes = [], []
        if sequence.slot is not None:
            self._slots[sequence.slot] = None
            sequence.slot = None
        if sequence in self._running:
            self._running.remove(sequence)

    def _finish(self, sequence: _Sequence, event: GenerationEvent) -> None:
        self._release(sequence)
        cached, stream = sequence.cached_tokens or 0, sequence.stream
        # Observer first: a client that sees the end of its stream also sees the metrics updated.
        self.observer.on_finished(stream.request_id, event.finish_reason, stream.prompt_tokens, cached,
                                  sequence.generated, time.perf_counter() - stream.submitted_at)
        stream._deliver(dataclasses.replace(event, cached_tokens=cached))

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        while self._waiting and None in self._slots:
            sequence = self._waiting[0]
            if sequence.stream.cancelled.is_set():
                self._waiting.popleft()
                self._finish(sequence, GenerationEvent(None, finish_reason="abort"))
                continue
            if not self._try_admit(sequence):
                return  # head-of-line: wait for pages rather than starve long prompts
            self._waiting.popleft()

    def _try_admit(self, sequence: _Sequence) -> bool:
        tokens = sequence.tokens
        pages, keys = [], []
        if self.prefix_caching:
            # At most (len - 1) // page pages: the last token is always computed (its logits sample).
            keys = page_hashes(tokens, self.page_size, (len(tokens) - 1) // self.page_size)
            pages, _ = self.pages.match(keys)
            self.observer.on_prefix_lookup(len(tokens), len(pages) * self.page_size)
        needed = -(-len(tokens) // self.page_size) - len(pages)
        if needed > self.pages.available and self._running:
            for page in reversed(pages):
                self.pages.release(page)
            return False
        sequence.pages, sequence.hashes = pages, keys[:len(pages)]
        sequence.computed = len(pages) * self.page_size
        sequence.slot = self._slots.index(None)
        self._slots[sequence.slot] = sequence
        self._running.append(sequence)
        stream = sequence.stream
        self._sampling = set_slot(self._sampling, sequence.slot, stream.params, stream.prompt_ids,
                                  sequence.seed)
        if sequence.cached_tokens is None:  # first admission (not a return from preemption)
            sequence.cached_tokens = stream.cached_tokens = sequence.computed
            self.observer.on_admitted(stream.request_id, time.perf_counter() - stream.submitted_at,
                                      sequence.computed)
        return True

    def _preempt(self, sequence: _Sequence) -> None:
        """Frees the sequence's pages and requeues it at the front; computed tokens are redone."""
        self._release(sequence)
        sequence.computed = 0
        self._waiting.appendleft(sequence)
        self.preemptions += 1
        self.observer.on_preempted(sequence.stream.request_id)

    # ------------------------------------------------------------------ one step
    def _grow(self, sequence: _Sequence, end: int) -> bool:
        """Allocates pages until `sequence` covers positions < end, preempting the most recently
        admitted sequences as needed. False if `sequence` itself had to be preempted."""
        while len(sequence.pages) * self.page_size < end:
            page = self.pages.allocate()
            if page is None:
                victim = self._running[-1]
                self._preempt(victim)
                if victim is sequence:
                    return False
                continue
            sequence.pages.append(page)
        return True

    def _plan(self) -> list[tuple[_Sequence, int]]:
        """(sequence, token count) for this step: decodes first, then prefill chunks, within budget."""
        plan, room = [], self.token_budget
        decodes = [s for s in self._running if len(s.tokens) - s.computed == 1]
        prefills = [s for s in self._running if len(s.tokens) - s.computed > 1]
        for sequence in decodes + prefills:
            if room == 0:
                break
            if sequence not in self._running:  # preempted earlier in this plan
                continue
            count = min(len(sequence.tokens) - sequence.computed, room)
            if self._grow(sequence, sequence.computed + count):
                plan.append((sequence, count))
                room -= count
        # Growing a later sequence may have preempted one planned earlier.
        return [(s, n) for s, n in plan if s in self._running]

    def _step(self) -> None:
        plan = self._plan()
        if not plan:
            return
        used = sum(count for _, count in plan)
        budget = next(b for b in self._budgets if b >= used)
        tokens = np.zeros(budget, np.int32)
        positions = np.full(budget, -1, np.int32)
        tables = np.zeros((budget, self.max_pages), np.int32)
        rows = np.zeros(self.max_slots, np.int32)
        sampling = np.zeros(self.max_slots, bool)
        start = 0
        for sequence, count in plan:
            end = start + count
            tokens[start:end] = sequence.tokens[sequence.computed:sequence.computed + count]
            positions[start:end] = np.arange(sequence.computed, sequence.computed + count)
            tables[start:end, :len(sequence.pages)] = sequence.pages
            if sequence.computed + count == len(sequence.tokens):
                rows[sequence.slot], sampling[sequence.slot] = end - 1, True
            start = end
        logits, self._cache = paged_step(self.config, self.params, self._cache, jnp.asarray(tokens),
                                         jnp.asarray(positions), jnp.asarray(tables), jnp.asarray(rows))
        chosen, logprobs, top_ids, top_logprobs, self._sampling = _sample_rows(
            logits, self._sampling, jnp.asarray(sampling))
        chosen, logprobs = np.asarray(chosen), np.asarray(logprobs)
        top_ids, top_logprobs = np.asarray(top_ids), np.asarray(top_logprobs)
        self.steps += 1
        if self.steps == 1 and self.pages.host_pages:
            # Compile the page copies for a cache that came out of a step (a fresh cache compiles
            # differently), not on the first eviction; writing page 0 back unchanged is a no-op.
            self._reload(0, self._offload(0))
        for sequence, count in plan:
            sequence.computed += count
            self._register_full_pages(sequence)
            if sampling[sequence.slot]:
                slot = sequence.slot
                self._emit(sequence, int(chosen[slot]), float(logprobs[slot]), top_ids[slot],
                           top_logprobs[slot])
        self.observer.on_step(self.pages.used, self.pages.num_pages, self.pages.host_used, len(self._running),
                              len(self._waiting), self._compiles)

    def _register_full_pages(self, sequence: _Sequence) -> None:
        if not self.prefix_caching:
            return
        full = sequence.computed // self.page_size
        if full > len(sequence.hashes):
            parent = sequence.hashes[-1] if sequence.hashes else b""
            start = len(sequence.hashes)
            new = page_hashes(sequence.tokens[start * self.page_size:], self.page_size, full - start, parent)
            for page, key in zip(sequence.pages[start:full], new, strict=True):
                self.pages.register(page, key)
            sequence.hashes += new

    def _emit(self, sequence: _Sequence, token: int, logprob: float, top_ids, top_logprobs) -> None:
        params = sequence.stream.params
        sequence.generated += 1
        sequence.tokens.append(token)
        if sequence.first_token_at is None:
            sequence.first_token_at = time.perf_counter()
            self.observer.on_first_token(sequence.stream.request_id,
                                         sequence.first_token_at - sequence.stream.submitted_at)
        alternatives = ()
        if params.logprobs:
            alternatives = tuple((int(i), float(p)) for i, p in
                                 zip(top_ids[:params.logprobs], top_logprobs[:params.logprobs], strict=True))
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif sequence.generated >= sequence.max_new:
            reason = "length"
        event = GenerationEvent(token, logprob if params.logprobs is not None else None, alternatives, reason)
        if reason is None:
            sequence.stream._deliver(event)
        else:
            self._finish(sequence, event)


def warm_up(engine: Engine, prompt_lengths=(1,), timeout: float = 600.0) -> None:
    """Compiles both step budgets, the sampler and slot setup (the engine thread compiles the host
    offload page copies after its first step), so that requests do not pay for compilation. Runs
    the requests twice: the second round compiles what only a cache or sampler state that came
    out of a step needs."""
    longest = min(engine.max_context - 1, engine._budgets[0] + 1)  # a prompt that needs the big budget
    lengths = tuple(prompt_lengths) + (longest,)

    async def one(length):
        stream = engine.submit([0] * length, SamplingParams(max_tokens=2, temperature=0.0))
        async for _ in stream:
            pass

    async def all_lengths():
        for _ in range(2):
            await asyncio.wait_for(asyncio.gather(*(one(n) for n in lengths)), timeout)

    asyncio.run(all_lengths())
