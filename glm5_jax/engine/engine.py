"""The continuous-batching inference engine: a supervised thread that runs the scheduler's plans
on the model runner and turns sampled tokens into request events.

Layers: `glm5_jax.engine.scheduler` decides what each step computes (pure Python: admission,
chunked prefill, preemption, prefix cache, pages); `glm5_jax.engine.runner` owns the device state
and runs the jitted programs (a mixed prefill/decode step, or several decode steps in one call);
`glm5_jax.engine.batches` turns a plan into the runner's host arrays; this module owns requests:
it validates and queues them, applies each plan, checks EOS, stop token ids and lengths on the
host (tokens a multi-step call produced past a request's end are discarded, never sent) and
delivers events to the request's asyncio stream.

Overlap: a decode call is dispatched and not waited for. While it runs, the engine plans the
next call for the same sequences (`Scheduler.continue_decode`), dispatches it behind the first
(its tokens, positions and remaining counts come from the first call's device state), and only
then reads the first call's tokens and delivers them. So in steady decoding the device always
has the next call queued while the host handles the last one. Whenever the host must decide
first (a request to admit, a cancellation, pages that would need preemption), the call in
flight is read before the next plan.

Delivery (`glm5_jax.engine.delivery`): a call's tokens are handled per request, not per token:
each row's tokens are checked as one list, the scheduler hears of them once, and the request's
stream gets them as one Burst, which the event loop turns into GenerationEvents. The loops are
woken (one call_soon_threadsafe per loop) once the next call is dispatched, so that building and
streaming the events runs while this thread waits for the device.

Supervision: a step that raises fails only the requests in it (each ends with finish_reason
"error"); if it destroyed the page pool, every running request fails and the pool is rebuilt.
After `max_consecutive_failures` failing steps in a row the engine stops: `failure` says why,
`submit` raises EngineUnavailableError, and serve.py exits non-zero for its supervisor.
A preempted request keeps its sampler state (key, token counts) and resumes exactly where it was.
Hybrid models (KDA linear layers): each running sequence's recurrent state lives in the runner's
state pool at the sequence's slot; a sequence's first step (position 0) starts it empty, chunked
prefill carries it across steps, and a preempted sequence is recomputed from its first token, so
its state is rebuilt with its pages. Prefix caching keeps state snapshots for them: after a
mixed step, a sequence whose computed tokens end a cached page has its slot's KDA state copied
into a snapshot slot keyed by that page (`Scheduler.snapshot_wanted`, `ModelRunner.save_state`);
a prefix hit ends at a page with a snapshot, which is copied into the new sequence's slot at
admission (`restore_state`), and prefill resumes after the hit. With no snapshot slots
(state_snapshots 0) prefix caching is off for them (HYBRID_NO_PREFIX_CACHING).
With `speculative_tokens` N > 0 a decode call whose rows are all eligible runs speculative rounds
(`glm5_jax.engine.speculative`) and may emit up to N + 1 tokens per row and round; the rest of the
engine is unchanged (a token is a token, whichever program produced it).
Compilations are counted from JAX's own compile events.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time

import jax
import numpy as np
import tokenizers

from glm5_jax.engine import delivery
from glm5_jax.engine.batches import RowCache, allowed_bits, decode_inputs, mixed_inputs
from glm5_jax.engine.delivery import Burst
from glm5_jax.engine.grammar import ConstrainedOutput, GrammarCompiler
from glm5_jax.engine.observer import EngineObserver
from glm5_jax.engine.paged_cache import PageAllocator, StateSnapshots
from glm5_jax.engine.runner import DecodeCall, ModelRunner, Sampled
from glm5_jax.engine.scheduler import (
    DecodePlan,
    MixedPlan,
    Scheduler,
    Sequence,
    chunk_geometries,
    decode_buckets,
)
from glm5_jax.engine.timing import StepTiming
from glm5_jax.engine.types import (
    SHUTTING_DOWN,
    EngineUnavailableError,
    GenerationEvent,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
    ShuttingDownError,
)
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.paged_decode import DEFAULT_BLOCK_POSITIONS

logger = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
DEFAULT_DECODE_STEPS = 8
# Why a hybrid model serves without prefix caching (docs/serving.md, "Hybrid models").
HYBRID_NO_PREFIX_CACHING = (
    "prefix caching is off for this hybrid (KDA linear-attention) model: it has no state snapshots "
    "(state_snapshots 0), and cached pages hold the MLA layers' latents of a prefix but not the KDA "
    "layers' recurrent state after it, so a prefix hit could not resume the sequence")


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
        self._ready: collections.deque[GenerationEvent] = collections.deque()  # for the iterator
        self._waiter: asyncio.Future | None = None  # the iterator waits on it while nothing is ready
        # What the engine thread delivered and the loop has not taken yet (events, and Bursts:
        # a device call's tokens of this request, turned into events on the loop): one loop
        # wake-up per device call at most, never one per token.
        self._handover: list[GenerationEvent | Burst] = []
        self._handover_lock = threading.Lock()
        self.finished = False

    def cancel(self) -> None:
        """Stops generation; the engine frees the slot and ends the stream with "abort"."""
        self.cancelled.set()

    def has_pending(self) -> bool:
        """More events are ready now (a multi-step decode delivers its tokens in one burst)."""
        return bool(self._ready)

    def _deliver(self, event: GenerationEvent) -> None:  # engine thread
        if self._push(event):
            delivery.wake([self])

    def _push(self, item: GenerationEvent | Burst) -> bool:  # engine thread
        """Queues an event or a Burst for the loop; True when the caller must wake the loop for it
        (`delivery.wake`): nothing was waiting, so no hand-over is scheduled yet."""
        if item.finish_reason is not None:
            self.finished = True
        with self._handover_lock:
            self._handover.append(item)
            return len(self._handover) == 1

    def _hand_over(self) -> None:  # event loop
        with self._handover_lock:
            items, self._handover = self._handover, []
        for item in items:
            if isinstance(item, GenerationEvent):
                self._ready.append(item)
            else:
                self._ready.extend(item.events())
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        ready = self._ready
        while True:
            while not ready:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            event = ready.popleft()
            yield event
            if event.finish_reason is not None:
                return



@dataclasses.dataclass
class _InFlight:
    plan: DecodePlan
    call: DecodeCall


@dataclasses.dataclass(eq=False)
class _Request:
    """The engine's per-request data, carried by its scheduler Sequence."""

    stream: RequestStream
    seed: int
    saved_sampler: object = None  # the slot's sampler state when it was last preempted
    first_token_at: float | None = None
    constrained: ConstrainedOutput | None = None  # the output constraint's state, if any
    # Prompt log-probabilities by position (1..n-1) as the prefill computes them, until delivered.
    prompt_scores: dict[int, tuple[float, tuple[tuple[int, float], ...]]] | None = None
    after_token: int | None = None  # the constraint's `after` text when it is a single token
    stops: frozenset[int] = frozenset()  # the ids that end it with "stop" (delivery.stop_set)


class Engine:
    """Serves one model. Thread-safe `submit`; call it from the asyncio event loop. mesh: a
    `jax.sharding.Mesh` to serve on (see ModelRunner), None for one device. runner_factory: what
    builds the runner from ModelRunner's arguments (multi-process serving passes
    multihost.mirrored_runner_factory). state_snapshots: a hybrid model's KDA state snapshots for
    prefix caching (each state_bytes_per_sequence bytes on the device; None = max_slots; 0 =
    prefix caching off for it); ignored for other models. timing: record the host time of every
    device call and the device's busy intervals (`self.timing`, glm5_jax/engine/timing.py)."""

    def __init__(self, config: ModelConfig, params, tokenizer: tokenizers.Tokenizer | None, *,
                 max_slots: int = 8, max_context: int = 1024, seed: int | None = None, page_size: int = 16,
                 num_pages: int | None = None, token_budget: int = 256, prefix_caching: bool = True,
                 host_cache_pages: int = 0, observer: EngineObserver | None = None,
                 max_waiting: int | None = None, decode_steps: int = DEFAULT_DECODE_STEPS, options=None,
                 block_positions: int = DEFAULT_BLOCK_POSITIONS, max_consecutive_failures: int = 3,
                 mesh=None, speculative_tokens: int = 0, runner_factory=ModelRunner,
                 state_snapshots: int | None = None, timing: bool = False):
        if max_slots < 1 or max_context < 2:
            raise ValueError(f"max_slots ({max_slots}) must be >= 1 and max_context ({max_context}) >= 2")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 (prefill tokens per step), got {token_budget}")
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        if speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0 (0 = off), got {speculative_tokens}")
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None for unbounded), got {max_waiting}")
        self.config = config
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
        self.decode_steps = decode_steps
        self.speculative_tokens = speculative_tokens
        # Why prefix caching is off although asked for (None: as asked).
        self.prefix_caching_off: str | None = None
        if state_snapshots is not None and state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0 (0 = none), got {state_snapshots}")
        # Hybrid models: KDA state snapshots at cached page boundaries (the module docs).
        self.state_snapshots = 0
        if prefix_caching and config.has_linear_layers:
            self.state_snapshots = max_slots if state_snapshots is None else state_snapshots
            if not self.state_snapshots:
                self.prefix_caching_off, prefix_caching = HYBRID_NO_PREFIX_CACHING, False
                logger.warning(HYBRID_NO_PREFIX_CACHING)
        snapshots = {"state_snapshots": self.state_snapshots} if self.state_snapshots else {}
        self.max_consecutive_failures = max_consecutive_failures
        self.observer = observer or EngineObserver()
        # Opt-in: host time per device call and the device's idle share (glm5_jax/engine/timing.py).
        self.timing = StepTiming(timing)
        self.runner = runner_factory(config, params, max_slots=max_slots, num_pages=num_pages,
                                     page_size=page_size, max_pages=self.max_pages, options=options,
                                     block_positions=block_positions, mesh=mesh,
                                     speculative_tokens=speculative_tokens, **snapshots)
        # Each slot's block-table and stop-id rows, rebuilt only when they change (batches.py).
        self._rows = RowCache(max_slots, self.runner.table_width, self.eos_token_ids)
        self._host_cache_pages = host_cache_pages
        self.scheduler = Scheduler(self._new_allocator(num_pages), max_slots=max_slots,
                                   max_context=self.max_context, page_size=page_size,
                                   token_budget=token_budget,
                                   decode_steps=decode_steps, prefix_caching=prefix_caching,
                                   max_waiting=max_waiting, positions_per_step=speculative_tokens + 1)
        self.failure: str | None = None
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._lock = threading.Lock()  # guards the scheduler's queue between submit and the engine thread
        self._tasks: list[tuple[callable, threading.Event]] = []  # run on the engine thread (warm-up)
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self.draining = False  # drain(): no new requests; the running ones go on
        self._ids = itertools.count()
        self._seed_source = np.random.default_rng(seed)
        self._compiles = 0
        # Warm-up (warm_up, _compile_all): True until every step shape is compiled; warm_up_done of
        # warm_up_total shapes so far (serve.py's /health reports them while the server starts).
        self.warming_up = False
        self.warm_up_done = self.warm_up_total = 0
        self._on_warm_up_progress = None  # on_progress(done, total), called on the engine thread
        self._consecutive_failures = 0
        # Streams with events queued by the last decode call's delivery, woken by _advance once the
        # next call is dispatched (delivery.wake).
        self._woken: list[RequestStream] = []
        self.steps = 0
        self.overlapped_calls = 0  # decode calls dispatched before the previous call's tokens were read
        # Speculative decoding: verify rounds, drafts verified, drafts accepted (since start).
        self.speculation = np.zeros(3, np.int64)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration_event)
        self._thread = threading.Thread(target=self._run, name="glm5-engine", daemon=True)
        self._thread.start()

    def _new_allocator(self, num_pages: int) -> PageAllocator:
        snapshots = StateSnapshots(self.state_snapshots) if self.state_snapshots else None
        return PageAllocator(num_pages, host_pages=self._host_cache_pages, offload=self._offload,
                             reload=self._reload, snapshots=snapshots)

    # ------------------------------------------------------------------ public
    @property
    def pages(self) -> PageAllocator:
        return self.scheduler.pages

    @property
    def params(self):
        return self.runner.params

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def compile_count(self) -> int:
        """XLA compilations since the engine started (steady state adds none)."""
        return self._compiles

    @property
    def active_requests(self) -> int:
        return sum(slot is not None for slot in self.scheduler.slots)

    @property
    def max_waiting(self) -> int | None:
        """Most requests waiting for a slot (None: unbounded)."""
        return self.scheduler.max_waiting

    @property
    def idle(self) -> bool:
        """No request runs or waits."""
        with self._lock:
            return not (self.scheduler.running or self.scheduler.waiting)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queues a request. Raises InvalidRequestError (bad input), QueueFullError (the waiting
        queue is at max_waiting) or EngineUnavailableError (the engine has failed)."""
        return self.submit_batch([(prompt_ids, params)])[0]

    def submit_batch(self, items: list[tuple[list[int], SamplingParams]]) -> list[RequestStream]:
        """Queues requests (prompt ids, params) all at once, in order: every item is validated
        first (nothing is queued if one is bad), then all are queued under one acquisition of the
        engine lock, so the engine's next plan sees the whole batch (a deterministic batch
        composition: RL rollouts reproduce on resume). Raises as `submit`; QueueFullError if
        the batch does not fit in the waiting queue whole. Call it from the asyncio event loop."""
        if self.failure is not None:
            raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
        if self.draining or self._stopping.is_set():
            raise ShuttingDownError(SHUTTING_DOWN)
        for prompt_ids, params in items:
            self._validate(prompt_ids, params)
        sequences = [self._sequence(prompt_ids, params) for prompt_ids, params in items]
        with self._lock:
            if self.draining:  # drain() ran since the check above
                raise ShuttingDownError(SHUTTING_DOWN)
            waiting = len(self.scheduler.waiting)
            limit = self.max_waiting
            if len(sequences) > 1 and limit is not None and waiting + len(sequences) > limit:
                raise QueueFullError(f"a batch of {len(sequences)} requests does not fit in the server's "
                                     f"waiting queue ({waiting} of {limit} taken); retry later",
                                     retry_after=1.0)
            for sequence in sequences:
                self.scheduler.add(sequence)  # QueueFullError when full (a batch was checked whole)
        for sequence in sequences:
            self.observer.on_queued(sequence.request_id, sequence.prompt_tokens)
        self._wakeup.set()
        return [sequence.payload.stream for sequence in sequences]

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError if the request cannot be served (changes nothing)."""
        params.validate()
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens but this server's context is "
                f"{self.max_context} tokens (prompt + output); shorten the prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.config.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if params.constraint is not None and self.tokenizer is None:
            raise InvalidRequestError("constrained output needs the model's tokenizer")

    def _sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """A validated request's stream and scheduler sequence (not queued yet)."""
        constrained, after_token = self._constrain(params.constraint)
        stream = RequestStream(f"req-{next(self._ids)}", list(prompt_ids), params,
                               asyncio.get_running_loop())
        seed = params.seed if params.seed is not None else int(self._seed_source.integers(2**62))
        max_new = min(params.max_tokens, self.max_context - len(prompt_ids))
        scoring = params.prompt_logprobs is not None
        sequence = Sequence(stream.request_id, list(prompt_ids), len(prompt_ids), max_new,
                            prefix_hits=not scoring,  # cached positions would have no scores
                            payload=_Request(stream, seed, constrained=constrained, after_token=after_token,
                                             prompt_scores={} if scoring else None,
                                             stops=delivery.stop_set(params, self.eos_token_ids)))
        return sequence

    def _constrain(self, constraint):
        """(ConstrainedOutput or None, the `after` text's token id when it is one token)."""
        if constraint is None:
            return None, None
        if self.tokenizer is None:
            raise InvalidRequestError("constrained output needs the model's tokenizer")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        after = self.tokenizer.encode(constraint.after, add_special_tokens=False).ids \
            if constraint.after else []
        return self._grammars.start(constraint, self.tokenizer), after[0] if len(after) == 1 else None

    def warm_up(self, timeout: float = 600.0, wait: bool = True, on_progress=None) -> threading.Event:
        """Compiles every step shape (decode row buckets, chunk geometries), sampler slot setup
        and page copies on the engine thread, so that requests do not pay for compilation.
        Meanwhile `warming_up` is True and `warm_up_done` of `warm_up_total` shapes are done
        (each decode bucket, chunk geometry and the copies); on_progress(done, total) is
        called on the engine thread after each. wait=False returns at once (serve.py listens while
        it compiles); the returned event is set when warm-up has ended (then check `failure`)."""
        shapes = len(decode_buckets(self.max_slots)) + len(chunk_geometries(self.token_budget)) + 1
        self.warm_up_done, self.warm_up_total = 0, shapes
        self._on_warm_up_progress = on_progress
        self.warming_up = True  # before the task is queued: no moment in which a caller sees "ready"
        done = threading.Event()
        with self._lock:
            self._tasks.append((self._compile_all, done))
        self._wakeup.set()
        if not wait:
            return done
        if not done.wait(timeout):
            raise TimeoutError(f"warm-up did not finish within {timeout} s")
        if self.failure is not None:
            raise EngineUnavailableError(f"the engine failed during warm-up: {self.failure}")
        return done

    def load_weights(self, params, timeout: float = 600.0) -> None:
        """Serves `params` from the next request on, without a checkpoint round trip (RL: the
        trainer hands its policy to the rollout engine between rollout batches). params: a
        nested dict in the training layout (`init_params`, TrainState.params) with the served
        params' shapes and dtypes (ValueError naming the first mismatching path otherwise); its
        arrays are copied (on a mesh, into the serving shardings), so the trainer may donate
        them afterwards. Runs on the engine thread between steps and waits for it; compiles
        nothing (the step programs take params as arguments). Refuses (RuntimeError) while
        requests run or wait. Flushes the prefix cache: device pages, host-offloaded pages and
        KDA state snapshots were all computed with the old weights."""
        if not isinstance(self.runner, ModelRunner):
            raise NotImplementedError("load_weights is not available for multi-process serving yet: the "
                                      "followers' runners would keep the old weights")
        if self.failure is not None or self._stopping.is_set():
            raise EngineUnavailableError(f"the engine has stopped: {self.failure or SHUTTING_DOWN}")
        with self._lock:
            self._refuse_busy()
        outcome: list[BaseException | None] = []  # the task's exception, or None once it has run

        def task():
            try:
                with self._lock:
                    self._refuse_busy()  # a request may have arrived since the check above
                    self.runner.load_weights(params)
                    self.scheduler.pages = self._new_allocator(self.scheduler.pages.num_pages)
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - raised in the caller's thread, not the engine's
                outcome.append(exc)

        done = threading.Event()
        with self._lock:
            self._tasks.append((task, done))
        self._wakeup.set()
        if not done.wait(timeout):
            raise TimeoutError(f"load_weights did not finish within {timeout} s")
        if not outcome:  # the engine stopped before running it
            raise EngineUnavailableError(f"the engine has stopped: {self.failure or SHUTTING_DOWN}")
        if outcome[0] is not None:
            raise outcome[0]

    def _refuse_busy(self) -> None:
        """RuntimeError while requests run or wait (their pages and tokens came from the old weights)."""
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        if running or waiting:
            raise RuntimeError(f"load_weights needs an idle engine, and {running} requests are running and "
                               f"{waiting} waiting: hand weights over between rollout batches")
        if any(self.scheduler.slots) or self.pages.used:
            raise RuntimeError(f"load_weights needs an idle engine, and {self.pages.used} pages are still "
                               "held")

    def drain(self) -> None:
        """The first step of a graceful shutdown: submit refuses new requests (ShuttingDownError)
        and every request still waiting for a slot ends now with "abort" (error SHUTTING_DOWN);
        running requests go on until shutdown()."""
        with self._lock:
            self.draining = True
            for sequence in list(self.scheduler.waiting):
                self._finish(sequence, GenerationEvent(None, finish_reason="abort", error=SHUTTING_DOWN))

    def shutdown(self) -> None:
        """Stops the engine thread; unfinished requests end with "abort" (error SHUTTING_DOWN).
        Calling it again does nothing."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=30)
        jax.monitoring.unregister_event_duration_listener(self._on_duration_event)

    # ------------------------------------------------------------------ engine thread
    def _on_duration_event(self, event: str, duration: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            self._compiles += 1

    def _offload(self, page: int):
        return self.runner.read_page(page)

    def _reload(self, page: int, data) -> None:
        self.runner.write_page(page, data)

    def _run(self) -> None:
        reason = "abort"
        in_flight: _InFlight | None = None  # a dispatched decode call whose tokens are not read yet
        try:
            while not self._stopping.is_set():
                plan = following = None
                tasks = []
                with self.timing.host("plan"), self._lock:
                    self._drop_cancelled()
                    self._admit()
                    if in_flight is not None:
                        following = None if self._tasks or self._needs_host(in_flight.plan) else \
                            self.scheduler.continue_decode(in_flight.plan)
                    else:
                        tasks, self._tasks = self._tasks, []
                        plan = self.scheduler.plan()
                        if plan is not None:
                            self._save_preempted(plan.preempted)
                if in_flight is not None:
                    in_flight = self._advance(in_flight, following)
                elif plan is None:
                    if tasks:
                        self._run_tasks(tasks)
                    else:
                        self._wakeup.wait(timeout=0.5)
                        self._wakeup.clear()
                else:
                    self._run_tasks(tasks)
                    if isinstance(plan, DecodePlan):
                        call = self._guarded(plan.sequences, lambda plan=plan: self._launch_decode(plan))
                        in_flight = None if call is None else _InFlight(plan, call)
                    elif self._guarded(plan.decodes + [s for s, _ in plan.chunks],
                                       lambda plan=plan: self._mixed(plan)):
                        self._step_done()
                if self.failure is not None:
                    reason = "error"
                    return
        except Exception as exc:  # a bug outside a model step: stop rather than hang requests
            logger.exception("the engine thread failed")
            self.failure = f"engine thread error: {type(exc).__name__}: {exc}"
            reason = "error"
        finally:
            with self._lock:
                self._wake_streams()
                error = self.failure if reason == "error" else SHUTTING_DOWN
                for sequence in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(sequence, GenerationEvent(None, finish_reason=reason, error=error))
                for _, done in self._tasks:
                    done.set()

    @staticmethod
    def _run_tasks(tasks) -> None:
        while tasks:
            task, done = tasks[0]
            try:
                task()
            finally:
                done.set()
                tasks.pop(0)

    def _advance(self, in_flight: _InFlight, following: DecodePlan | None) -> _InFlight | None:
        """Dispatches `following` (if any) behind the running call, then reads the running call's
        tokens while the device works on the next one. Returns the call now in flight."""
        call = None
        if following is not None:
            call = self._guarded(following.sequences,
                                 lambda: self._launch_decode(following, after=in_flight.call))
            self.overlapped_calls += call is not None
        # The last call's events: the event loop builds and streams them while this thread waits
        # for the device (fetch releases the GIL), not while it plans and dispatches.
        self._wake_streams()
        if not self._guarded(in_flight.plan.sequences, lambda: self._complete_decode(in_flight)):
            self._wake_streams()
            return None  # a call behind a failed one started from its (failed) state: drop it too
        self._step_done()
        if call is None:
            self._wake_streams()
            return None
        return _InFlight(following, call)

    def _wake_streams(self) -> None:
        """Wakes the event loops of the streams the last decode call's delivery queued events for."""
        woken, self._woken = self._woken, []
        delivery.wake(woken)

    def _guarded(self, sequences: list[Sequence], action):
        """action()'s result (True if it returns None). On an exception the step's requests fail,
        the page pool is rebuilt if the failure destroyed it, `failure` is set once failures
        repeat (the engine must stop), and None is returned."""
        try:
            result = action()
            return True if result is None else result
        except Exception as exc:
            logger.exception("a model step failed; failing its %d requests", len(sequences))
            message = f"{type(exc).__name__}: {exc}"
            self._consecutive_failures += 1
            if self._consecutive_failures >= self.max_consecutive_failures:
                # Set before the failed requests hear of it: a client that sees its error sees the state.
                self.failure = f"{self._consecutive_failures} model steps failed in a row; last: {message}"
            with self._lock:
                for sequence in sequences:
                    if sequence.slot is not None:
                        self._finish(sequence, GenerationEvent(None, finish_reason="error", error=message))
                if self.runner.cache_lost():
                    # The failing call consumed the page pool: nothing cached can be trusted.
                    for sequence in list(self.scheduler.running):
                        self._finish(sequence, GenerationEvent(None, finish_reason="error", error=message))
                    self.runner.reset()
                    self.scheduler.pages = self._new_allocator(self.scheduler.pages.num_pages)
            if self.failure is not None:
                logger.error("engine stopping: %s", self.failure)
            return None

    def _step_done(self) -> None:
        self._consecutive_failures = 0
        self.steps += 1
        if self.steps == 1 and self.pages.host_pages:
            # Compile the page copies for a cache that came out of a step (a fresh cache compiles
            # differently), not on the first eviction; writing page 0 back unchanged is a no-op.
            self._reload(0, self._offload(0))
        pages = self.pages
        self.observer.on_step(pages.used, pages.num_pages, pages.host_used, len(self.scheduler.running),
                              len(self.scheduler.waiting), self._compiles)

    def _drop_cancelled(self) -> None:
        for sequence in list(self.scheduler.running) + list(self.scheduler.waiting):
            if sequence.payload.stream.cancelled.is_set():
                self._finish(sequence, GenerationEvent(None, finish_reason="abort"))

    def _finish(self, sequence: Sequence, event: GenerationEvent) -> None:
        cached = self._end(sequence, event.finish_reason)
        if cached is not None:
            sequence.payload.stream._deliver(dataclasses.replace(event, cached_tokens=cached))

    def _end(self, sequence: Sequence, reason: str) -> int | None:
        """Frees the sequence and records its end; returns its cached prompt tokens for its last
        event, or None when its stream has ended already (nothing more to deliver)."""
        self.scheduler.release(sequence)
        stream = sequence.payload.stream
        if stream.finished:
            return None
        cached = sequence.cached_tokens or 0
        # Observer first: a client that sees the end of its stream also sees the metrics updated.
        self.observer.on_finished(stream.request_id, reason, stream.prompt_tokens, cached,
                                  sequence.generated, time.perf_counter() - stream.submitted_at)
        return cached

    def _admit(self) -> None:
        for sequence in self.scheduler.admit():
            request = sequence.payload
            if sequence.computed and self.state_snapshots:  # a hybrid prefix hit: its KDA state
                self.runner.restore_state(sequence.slot, self.pages.snapshots.use(sequence.hashes[-1]))
            if request.saved_sampler is not None:  # back from preemption: resume its key and counts
                self.runner.write_slot(sequence.slot, request.saved_sampler)
            else:
                stream = request.stream
                self.runner.set_slot(sequence.slot, stream.params, stream.prompt_ids, request.seed)
                stream.cached_tokens = sequence.cached_tokens
                self.observer.on_admitted(stream.request_id, time.perf_counter() - stream.submitted_at,
                                          sequence.cached_tokens)
        for prompt_tokens, hit_tokens in self.scheduler.prefix_lookups:
            self.observer.on_prefix_lookup(prompt_tokens, hit_tokens)
        self.scheduler.prefix_lookups.clear()

    def _save_preempted(self, preempted: list[tuple[Sequence, int]]) -> None:
        for sequence, slot in preempted:
            sequence.payload.saved_sampler = self.runner.read_slot(slot)
            self.observer.on_preempted(sequence.request_id)

    # ------------------------------------------------------------------ plans
    @staticmethod
    def _logprobs_wanted(sequences) -> bool:
        return any(s.payload.stream.params.logprobs is not None for s in sequences)

    def _speculating(self, sequences) -> bool:
        """Speculative rounds for these rows: on, and no row's sampling depends on the tokens a
        round draws (penalties) or on the host (a grammar constraint), and no row reports the
        processed distribution's log-probabilities (speculation reports raw ones)."""
        def eligible(params: SamplingParams) -> bool:
            return (params.constraint is None and params.repetition_penalty == 1.0
                    and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
                    and params.logprobs_mode == "raw")
        return self.speculative_tokens > 0 and all(eligible(s.payload.stream.params) for s in sequences)

    def _launch_decode(self, plan: DecodePlan, after: DecodeCall | None = None) -> DecodeCall:
        """Dispatches the plan's decode call (speculative rounds when `_speculating`); a
        continuation (`after` the call before it, same rows) takes each row's token, position
        and remaining count from that call's device state."""
        with self.timing.host("arrays"):
            inputs, limits = decode_inputs(self.runner, self._rows, plan, self.max_slots, self.page_size)
            if after is not None:
                inputs.update(tokens=after.tokens, positions=after.positions, remaining=after.remaining)
            logprobs_wanted = self._logprobs_wanted(plan.sequences)
            speculating = self._speculating(plan.sequences)
            allowed = None if speculating else allowed_bits(self.runner, plan.sequences, len(limits))
        with self.timing.host("dispatch"):
            if speculating:
                call = self.runner.launch_speculative(**inputs, limits=limits, steps=plan.steps,
                                                      logprobs_wanted=logprobs_wanted)
            else:
                call = self.runner.launch_decode(**inputs, steps=plan.steps, logprobs_wanted=logprobs_wanted,
                                                 allowed=allowed)
        self.timing.dispatched("decode", len(plan.sequences), plan.steps, call.outputs)
        return call

    @staticmethod
    def _needs_host(plan: DecodePlan) -> bool:
        """A row's next call depends on this call's tokens as seen by the host (constraints)."""
        return any(s.payload.constrained is not None for s in plan.sequences)

    def _complete_decode(self, in_flight: _InFlight) -> None:
        """Waits for a decode call's tokens and delivers them (a sequence that finished on the
        host meanwhile, or in an earlier call, has no slot: its rows are discarded)."""
        plan = in_flight.plan
        with self.timing.host("fetch"):
            sampled = self.runner.fetch(in_flight.call)
        if in_flight.call.speculation is not None:
            self.speculation += np.asarray(in_flight.call.speculation)
            self.observer.on_speculation(*(int(c) for c in np.asarray(in_flight.call.speculation)))
        with self.timing.host("deliver"), self._lock:
            # Per request, not per token: each row's column of tokens as one Python list.
            columns = sampled.tokens[:, :len(plan.sequences)].T.tolist()  # [n][steps]
            for row, (sequence, column) in enumerate(zip(plan.sequences, columns, strict=True)):
                if sequence.slot is None:  # the host stopped it (an earlier call, a cancellation)
                    continue
                steps = slice(None)
                if -1 in column:  # the device stopped the row (speculation: rejected drafts too)
                    steps = [step for step, token in enumerate(column) if token >= 0]
                    column = [column[step] for step in steps]
                if column:  # the streams are woken by _advance (_wake_streams)
                    self._deliver_tokens(sequence, column, sampled, (steps, row), self._woken, decoding=True)

    def _mixed(self, plan: MixedPlan) -> None:
        chunk_len = plan.geometry[1]
        with self.timing.host("arrays"):
            inputs = mixed_inputs(self.runner, self._rows, plan, self.max_slots,
                                  bool(self.speculative_tokens))
            sampled_index = inputs.sampled
            allowed = allowed_bits(self.runner, inputs.by_index, self.max_slots)
        started = time.perf_counter()
        sampled, scored = self.runner.mixed_step(inputs.batch, inputs.sample_rows, inputs.slots, inputs.mask,
                                                 self._logprobs_wanted(sampled_index), allowed,
                                                 inputs.targets, inputs.next_tokens)
        self.timing.ran("mixed", len(plan.decodes) + len(plan.chunks), 1, started)
        with self.timing.host("deliver"), self._lock:
            woken = []
            try:
                for sequence in plan.decodes:
                    if sequence.slot is not None:
                        self.scheduler.computed(sequence, 1)
                        self._snapshot(sequence)
                        self._deliver_sampled(sequence, sampled, sampled_index[sequence], woken)
                for row, (sequence, count) in enumerate(plan.chunks):
                    if sequence.slot is None:
                        continue
                    if scored is not None and sequence.payload.prompt_scores is not None:
                        self._keep_scores(sequence, scored, row * chunk_len, count)
                    self.scheduler.computed(sequence, count)
                    self._snapshot(sequence)
                    if sequence in sampled_index:
                        self._deliver_sampled(sequence, sampled, sampled_index[sequence], woken)
                    elif sequence.pending == 0:  # max_tokens 0: the prompt is scored, nothing to generate
                        self._finish(sequence, GenerationEvent(None, finish_reason="length",
                                                               prompt_logprobs=self._prompt_logprobs(sequence)))
            finally:
                delivery.wake(woken)

    def _snapshot(self, sequence: Sequence) -> None:
        """After a mixed step (never a decode call: a call queued behind it may already have moved
        the slot's state on): snapshots the KDA state if the sequence's computed tokens end a
        cached page without one (hybrid prefix caching)."""
        key = self.scheduler.snapshot_wanted(sequence) if self.state_snapshots else None
        if key is not None:
            self.runner.save_state(sequence.slot, self.pages.snapshots.take(key))

    def _keep_scores(self, sequence: Sequence, scored, first: int, count: int) -> None:
        """Records the scores of the chunk tokens at flat rows first.. (position p scores p + 1)."""
        request, top = sequence.payload, sequence.payload.stream.params.prompt_logprobs
        start = sequence.computed
        for i in range(min(count, sequence.prompt_tokens - 1 - start)):
            flat = first + i
            pairs = zip(scored.top_ids[flat, :top], scored.top_logprobs[flat, :top], strict=True)
            alternatives = tuple((int(t), float(lp)) for t, lp in pairs)
            request.prompt_scores[start + i + 1] = (float(scored.logprobs[flat]), alternatives)

    @staticmethod
    def _prompt_logprobs(sequence: Sequence):
        """The prompt log-probabilities to deliver (once), or None."""
        request = sequence.payload
        scores, request.prompt_scores = request.prompt_scores, None
        if scores is None:
            return None
        return ((None, ()),) + tuple(scores[p] for p in range(1, sequence.prompt_tokens))

    def _deliver_sampled(self, sequence: Sequence, sampled: Sampled, index: int, woken: list) -> None:
        """Delivers a mixed step's token for the sequence (flat sampled row `index`)."""
        self._deliver_tokens(sequence, [int(sampled.tokens[index])], sampled, (slice(index, index + 1),),
                             woken)

    def _deliver_tokens(self, sequence: Sequence, tokens: list[int], sampled: Sampled, where: tuple,
                        woken: list, decoding: bool = False) -> None:
        """Hands the request the tokens it takes of `tokens` (a row's sampled tokens, in order;
        `delivery.accept` says how many and why it ends) as one Burst. where: indexes the row's
        tokens in `sampled`'s arrays (sampled.logprobs[where] is [len(tokens)]). decoding: the
        taken tokens' inputs entered the cache in this call (a decode call: counted here; a mixed
        step counts its own). A stream to wake is appended to `woken` (`delivery.wake`)."""
        request = sequence.payload
        params, stream = request.stream.params, request.stream
        count, reason = delivery.accept(tokens, sequence.generated, sequence.max_new, request.stops,
                                        request.constrained)
        taken = tokens if count == len(tokens) else tokens[:count]
        sequence.generated += count
        sequence.tokens.extend(taken)
        if decoding:  # (after the tokens: the pages it completes are hashed from them)
            self.scheduler.computed(sequence, count)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
            self.observer.on_first_token(sequence.request_id,
                                         request.first_token_at - request.stream.submitted_at)
        logprobs = top_ids = top_logprobs = None
        if params.logprobs is not None:  # views of the call's host arrays, read on the event loop
            logprobs = sampled.logprobs[where][:count]
            if params.logprobs:
                top_ids = sampled.top_ids[where][:count, :params.logprobs]
                top_logprobs = sampled.top_logprobs[where][:count, :params.logprobs]
        cached = 0
        if reason is not None:
            cached = self._end(sequence, reason)
            if cached is None:  # it has ended already: nothing more to say
                return
        burst = Burst(taken, logprobs, top_ids, top_logprobs, reason, cached, self._prompt_logprobs(sequence))
        if stream._push(burst):
            woken.append(stream)

    # ------------------------------------------------------------------ warm-up
    def _compile_all(self) -> None:
        """Runs every step shape once on padding only (nothing written, no sampler state changes),
        counting each in warm_up_done. One round: the runner's step programs are compiled
        executables (glm5_jax/programs.py), which take a page pool or sampler state that
        came out of a step as they take a fresh one (through jit, the two were two programs)."""
        runner = self.runner

        def shape_done():
            self.warm_up_done += 1
            if self._on_warm_up_progress is not None:
                self._on_warm_up_progress(self.warm_up_done, self.warm_up_total)

        for rows in decode_buckets(self.max_slots):
            inputs = runner.padding_decode(rows)
            call = runner.launch_decode(**inputs, steps=self.decode_steps)
            inputs.update(tokens=call.tokens, positions=call.positions, remaining=call.remaining)
            runner.fetch(runner.launch_decode(**inputs, steps=self.decode_steps))  # a continuation
            if self.speculative_tokens:
                inputs, limits = runner.padding_decode(rows), np.zeros(rows, np.int32)
                call = runner.launch_speculative(**inputs, limits=limits, steps=self.decode_steps)
                inputs.update(tokens=call.tokens, positions=call.positions, remaining=call.remaining)
                runner.fetch(runner.launch_speculative(**inputs, limits=limits, steps=self.decode_steps))
            shape_done()
        for geometry in chunk_geometries(self.token_budget):
            unused = np.zeros(self.max_slots, np.int32)
            mask = np.zeros(self.max_slots, bool)
            runner.mixed_step(runner.padding_batch(*geometry), unused, unused, mask)
            shape_done()
        runner.write_slot(0, runner.read_slot(0))
        if self.state_snapshots:  # out-of-range targets: compiled, nothing written
            runner.save_state(0, self.state_snapshots)
            runner.restore_state(self.max_slots, 0)
        runner.set_slot(0, SamplingParams(), [0], 0)
        if self.pages.host_pages:
            self._reload(0, self._offload(0))
        shape_done()
        self.warming_up = False

def warm_up(engine: Engine, prompt_lengths=(), timeout: float = 600.0) -> None:
    """Compiles everything steady-state serving runs (see Engine.warm_up). prompt_lengths is
    accepted for compatibility: every shape is compiled regardless of the prompts to come."""
    del prompt_lengths
    engine.warm_up(timeout)
