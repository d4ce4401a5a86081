"""The engine's scheduler: admission, token budget, chunked prefill, preemption, prefix cache and
page allocation, in pure Python (no JAX: unit-testable on its own).

Each iteration the engine asks for one `StepPlan`:
  - `DecodePlan` when every running sequence is decoding: one device call runs up to
    `decode_steps` decode steps for all of them (pages for those steps are reserved up front);
  - `MixedPlan` otherwise: one step with a decode token for every decoding sequence and prefill
    chunks of the others, packed into one of a few fixed chunk geometries (rows x tokens) of
    `token_budget` tokens or a quarter of it, so the compile count stays constant in steady state.
While a decode call runs, `continue_decode` plans the next one for the same sequences (the
engine dispatches it before reading the running call's tokens) whenever no host decision is
needed in between. When pages run out the most recently admitted sequence is preempted: its
pages are released and it is requeued at the front with prompt + generated tokens, to be
recomputed (mostly from the prefix cache) later; the plan lists it (with the slot it left) so
the engine can keep its sampler state. Admission takes prefix-cache hits and waits (head of
line) until the uncached part of the prompt fits in the free pages.

Hybrid models (the allocator has `snapshots`, KDA state snapshots): a prefix hit must end at a
page whose state snapshot exists (the engine restores the sequence's KDA state from it), and a
prefill chunk that crosses a page boundary is cut at its last boundary, so that the state after
every chunk, and after the last full page of each prompt, can be snapshotted
(`snapshot_wanted`).
"""

from __future__ import annotations

import collections
import dataclasses

from glm5_jax.engine.paged_cache import PageAllocator, page_hashes
from glm5_jax.engine.types import QueueFullError


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request's scheduling state; survives preemption (then slot is None, pages empty)."""

    request_id: str
    tokens: list[int]  # prompt + generated; tokens[computed:] still have to run through the model
    prompt_tokens: int
    max_new: int
    slot: int | None = None
    computed: int = 0
    generated: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of pages[:len(hashes)]
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (first admission)
    preempted: bool = False  # it has been preempted at least once (its sampler state is saved)
    prefix_hits: bool = True  # False: compute the whole prompt (its every position is scored)
    payload: object = None  # the engine's per-request data (stream, saved sampler state)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        """Its next step is a decode row: one token to run, and a token to sample after it. A
        scored prompt with max_tokens 0 samples nothing: its last token runs as a chunk."""
        return self.pending == 1 and self.generated < self.max_new


@dataclasses.dataclass
class DecodePlan:
    sequences: list[Sequence]  # all decoding; one row each
    steps: int  # decode steps to run on the device
    preempted: list[tuple[Sequence, int]]  # (sequence, the slot it left)


@dataclasses.dataclass
class MixedPlan:
    decodes: list[Sequence]
    chunks: list[tuple[Sequence, int]]  # (sequence, token count from sequence.computed)
    geometry: tuple[int, int]  # (chunk rows, tokens per row)
    preempted: list[tuple[Sequence, int]]


def chunk_geometries(token_budget: int) -> list[tuple[int, int]]:
    """(rows, tokens per row) shapes of prefill chunks: many short rows for many short prompts,
    one long row for one long prompt; of `token_budget` tokens and of a quarter of it, so that a
    few short prompts (one client's) do not pay for a full budget (a step costs its padded rows)."""
    totals = sorted({token_budget} | ({token_budget // 4} if token_budget >= 64 else set()))
    return [(total // q, q) for total in totals for q in sorted({q for q in (16, 64, total) if q <= total})]


def decode_buckets(max_slots: int) -> list[int]:
    """Decode row counts compiled for: powers of four below max_slots, and max_slots (padding
    rows cost matmul rows; each bucket costs a compilation)."""
    buckets, size = [], 1
    while size < max_slots:
        buckets.append(size)
        size *= 4
    return buckets + [max_slots]


class Scheduler:
    """Decides what each step computes (see the module docs). Not thread-safe: the engine thread
    owns it; `add` and `cancel` go through the engine."""

    def __init__(self, pages: PageAllocator, *, max_slots: int, max_context: int, page_size: int,
                 token_budget: int, decode_steps: int = 1, prefix_caching: bool = True,
                 max_waiting: int | None = None, positions_per_step: int = 1):
        if token_budget < 1 or decode_steps < 1:
            raise ValueError(f"token_budget ({token_budget}) and decode_steps ({decode_steps}) must be >= 1")
        self.pages = pages
        self.max_slots = max_slots
        self.max_context = max_context
        self.page_size = page_size
        self.token_budget = token_budget
        self.decode_steps = decode_steps
        # Cache positions one decode step may write: 1, or N + 1 with N-token speculation (a
        # verify round writes the pending token and N drafts, whatever it accepts).
        self.positions_per_step = positions_per_step
        self.prefix_caching = prefix_caching
        self.max_waiting = max_waiting
        self.geometries = chunk_geometries(token_budget)
        self.slots: list[Sequence | None] = [None] * max_slots
        self.running: list[Sequence] = []  # admission order (the last is preempted first)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.preemptions = 0
        self.prefix_lookups: list[tuple[int, int]] = []  # (prompt tokens, hit tokens) since last read

    # ------------------------------------------------------------------ requests
    def add(self, sequence: Sequence) -> None:
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the server's waiting queue is full ({self.max_waiting} requests); "
                                 "retry later", retry_after=1.0)
        self.waiting.append(sequence)

    def release(self, sequence: Sequence) -> None:
        """Frees the sequence's pages and slot and forgets it (finished, cancelled or failed)."""
        self._free(sequence)
        if sequence in self.waiting:
            self.waiting.remove(sequence)

    def _free(self, sequence: Sequence) -> None:
        # Last page first: in the LRU order a prefix's tail is evicted before its head.
        for page in reversed(sequence.pages):
            self.pages.release(page)
        sequence.pages, sequence.hashes = [], []
        if sequence.slot is not None:
            self.slots[sequence.slot] = None
            sequence.slot = None
        if sequence in self.running:
            self.running.remove(sequence)

    # ------------------------------------------------------------------ admission
    def admit(self) -> list[Sequence]:
        """Moves waiting sequences into free slots while their prompts fit; returns them."""
        admitted = []
        while self.waiting and None in self.slots:
            if not self._try_admit(self.waiting[0]):
                break  # head-of-line: wait for pages rather than starve long prompts
            admitted.append(self.waiting.popleft())
        return admitted

    def _try_admit(self, sequence: Sequence) -> bool:
        tokens = sequence.tokens
        pages, keys = [], []
        if self.prefix_caching and sequence.prefix_hits:
            # At most (len - 1) // page pages: the last token is always computed (its logits sample).
            keys = page_hashes(tokens, self.page_size, (len(tokens) - 1) // self.page_size)
            pages = self._match(keys)
            self.prefix_lookups.append((len(tokens), len(pages) * self.page_size))
        needed = -(-len(tokens) // self.page_size) - len(pages)
        if needed > self.pages.available and self.running:
            for page in reversed(pages):
                self.pages.release(page)
            return False
        sequence.pages, sequence.hashes = pages, keys[:len(pages)]
        sequence.computed = len(pages) * self.page_size
        sequence.slot = self.slots.index(None)
        self.slots[sequence.slot] = sequence
        self.running.append(sequence)
        if sequence.cached_tokens is None:
            sequence.cached_tokens = sequence.computed
        return True

    def _match(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of keys; with state snapshots (hybrid models)
        the longest one whose last page has a snapshot."""
        snapshots = self.pages.snapshots
        if snapshots is None:
            return self.pages.match(keys)[0]
        usable = max((i + 1 for i, key in enumerate(keys) if key in snapshots), default=0)
        pages = self.pages.match(keys[:usable])[0] if usable else []
        while pages and keys[len(pages) - 1] not in snapshots:
            self.pages.release(pages.pop())
        return pages

    def snapshot_wanted(self, sequence: Sequence) -> bytes | None:
        """With state snapshots: the key of the page that ends exactly at the sequence's computed
        tokens, when it is cached and has no snapshot yet (its KDA state in the slot is the state
        at that boundary right after the step that computed it); else None."""
        snapshots = self.pages.snapshots
        full, rest = divmod(sequence.computed, self.page_size)
        if snapshots is None or rest or not full or len(sequence.hashes) < full:
            return None
        key = sequence.hashes[full - 1]
        return key if key not in snapshots and self.pages.knows(key) else None

    def _chunk_length(self, sequence: Sequence, length: int) -> int:
        """Tokens of the sequence's next chunk in rows of `length`; with state snapshots, cut at
        the last page boundary it crosses (the rest runs in the next step)."""
        count = min(sequence.pending, length)
        if self.pages.snapshots is not None:
            boundary = (sequence.computed + count) // self.page_size * self.page_size
            if sequence.computed < boundary < sequence.computed + count:
                count = boundary - sequence.computed
        return count

    # ------------------------------------------------------------------ planning
    def _preempt(self, sequence: Sequence, preempted: list) -> None:
        preempted.append((sequence, sequence.slot))
        self._free(sequence)
        sequence.computed = 0
        sequence.preempted = True
        self.waiting.appendleft(sequence)
        self.preemptions += 1

    def _grow(self, sequence: Sequence, end: int, preempted: list) -> bool:
        """Allocates pages until `sequence` covers positions < end, preempting the most recently
        admitted sequences as needed. False if `sequence` itself had to be preempted."""
        while len(sequence.pages) * self.page_size < end:
            page = self.pages.allocate()
            if page is None:
                victim = self.running[-1]
                self._preempt(victim, preempted)
                if victim is sequence:
                    return False
                continue
            sequence.pages.append(page)
        return True

    def plan(self) -> DecodePlan | MixedPlan | None:
        """The next step, or None when nothing runs."""
        preempted: list[tuple[Sequence, int]] = []
        if self.running and all(s.decoding for s in self.running):
            steps = self.decode_steps
            for sequence in list(self.running):
                if sequence in self.running:
                    # Positions this call may write: positions_per_step per step, at most one per
                    # token still allowed (the device writes nothing past a row's pages).
                    allowed = sequence.max_new - sequence.generated
                    self._grow(sequence, sequence.computed + min(steps * self.positions_per_step, allowed),
                               preempted)
            if self.running:
                return DecodePlan(list(self.running), steps, preempted)
            return None
        decodes = [s for s in self.running if s.decoding]
        for sequence in decodes:
            if sequence in self.running:
                self._grow(sequence, sequence.computed + 1, preempted)
        prefills = [s for s in self.running if not s.decoding]
        # The most prompt tokens; of those, the fewest padded ones, then the shortest rows.
        geometry = max(self.geometries, key=lambda g: (self._covered(prefills, g), -g[0] * g[1], -g[1]))
        rows, length = geometry
        chunks = []
        for sequence in prefills[:rows]:
            if sequence not in self.running:  # preempted while growing an earlier one
                continue
            count = self._chunk_length(sequence, length)
            if self._grow(sequence, sequence.computed + count, preempted):
                chunks.append((sequence, count))
        # Growing a later sequence may have preempted one planned earlier.
        decodes = [s for s in decodes if s in self.running]
        chunks = [(s, n) for s, n in chunks if s in self.running]
        if not decodes and not chunks:
            return None
        return MixedPlan(decodes, chunks, geometry, preempted)

    def continue_decode(self, plan: DecodePlan) -> DecodePlan | None:
        """The next decode call for `plan`'s sequences while `plan` is still on the device, or
        None when the host must see its results first.

        Pages are reserved as if every sequence ran all of `plan`'s steps (an upper bound; the
        device carries each row's real state into the continuation, and rows that stopped stay
        stopped). None when a request waits for admission, a running sequence is not in `plan`
        (admitted or cancelled since), every sequence will have reached its length, or the
        pages do not fit without preemption (preemption needs the host's view of the tokens).
        """
        if self.waiting or set(self.running) != set(plan.sequences):
            return None
        ends = []
        for sequence in plan.sequences:
            allowed = sequence.max_new - sequence.generated
            end = sequence.computed + min((plan.steps + self.decode_steps) * self.positions_per_step,
                                          max(allowed, plan.steps))
            # Never past the context: a sequence's table has pages for max_context positions, and
            # the device writes nothing past a row's pages.
            ends.append(min(end, self.max_context))
        if all(s.max_new - s.generated <= plan.steps for s in plan.sequences):
            return None
        needed = sum(max(0, -(-end // self.page_size) - len(s.pages))
                     for s, end in zip(plan.sequences, ends, strict=True))
        if needed > self.pages.available:
            return None
        for sequence, end in zip(plan.sequences, ends, strict=True):
            self._grow(sequence, end, [])  # fits: never preempts
        return DecodePlan(list(plan.sequences), self.decode_steps, [])

    def _covered(self, prefills: list[Sequence], geometry: tuple[int, int]) -> int:
        rows, length = geometry
        return sum(self._chunk_length(s, length) for s in prefills[:rows])

    # ------------------------------------------------------------------ after a step
    def computed(self, sequence: Sequence, count: int) -> None:
        """`count` more of the sequence's tokens are in the cache: full pages join the prefix cache."""
        sequence.computed += count
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
