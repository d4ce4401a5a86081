"""A deterministic stand-in for glm5_jax.engine.engine.Engine, and a tiny real tokenizer, for API tests.

The fake "model" repeats the prompt's ordinary tokens (no special or thinking-markup tokens), then
emits EOS; with ignore_eos it cycles through them until max_tokens or the context limit. A prompt
that opens a thinking block (ends with `<think>`, as GLM-5 chat prompts do) is answered with an
empty one first (`</think>`, then the echo): the fake does not think. A test that needs a given
answer sets `engine.reply` (token ids, answered instead of the echo, then EOS). A stop_token_ids
token ends the output with "stop" (that token is yielded, as the real engine does). With
SamplingParams.prompt_logprobs set, the first event carries the prompt's log probabilities
(`fake_prompt_logprob(token)` for every token but the first, whose entry is None, and that many
alternatives), and max_tokens 0 scores the prompt without generating. Each stream keeps the
params it was given (`stream.params.constraint`: the Constraint the API asked for). Each token comes
after a small asyncio sleep so that clients can disconnect midway, and at most max_slots requests
run at once (the rest wait), like the real engine's batch slots. Every stream is recorded in
`engine.streams` so tests can check cancellations.

Failures follow the real engine's contract (glm5_jax/engine/types.py): with `fail_after` set, a
request ends after that many tokens with a finish_reason "error" event (a failed model step);
with `max_waiting` set, submit raises QueueFullError while that many requests wait for a slot;
while `failure` is set (a test sets it), submit raises EngineUnavailableError.

A toy prefix cache: a prompt's cached_tokens are its longest prefix of whole `page_size` pages that
an earlier prompt also started with. The engine's observer hooks are called like the real engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import socket
import threading
import time

import tokenizers
import uvicorn
from tokenizers import decoders, models, pre_tokenizers, trainers

from glm5_jax.engine.observer import EngineObserver
from glm5_jax.engine.types import (
    EngineUnavailableError,
    GenerationEvent,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
)

EOS = "<|endoftext|>"
# The GLM-5 chat-format markers, special so that the fake's echo leaves them out, as a model would.
SPECIAL_TOKENS = [EOS, "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# Whole tokens but not special, as in GLM's tokenizer (decoded text keeps them); left out of the echo.
MARKUP_TOKENS = ["<think>", "</think>"]
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "hello world, hello there; the world says hello back.",
    "Stop strings must be cut exactly where they begin, even across tokens.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "client request number 0 1 2 3 4 5 6 7 8 9",
]


def make_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE (like GLM's) trained in a few milliseconds: any text round-trips, and
    characters outside the training text split into byte tokens that decode to U+FFFD alone."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS + MARKUP_TOKENS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    # The markup tokens keep their ids but are not special; the round trip rebuilds the decoder's view.
    tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizers.Tokenizer.from_str(tokenizer.to_str())


def fake_prompt_logprob(token_id: int) -> float:
    """The fake's log probability of a prompt token (not the first): a function of the token alone."""
    return -(token_id % 7 + 1) / 8


class FakeStream:
    """One request's events; records what happened to it (cancel_calls, finish_reason, token_ids)."""

    def __init__(self, engine: FakeEngine, request_id: str, prompt_ids: list[int], params: SamplingParams):
        self.engine, self.request_id, self.params = engine, request_id, params
        self.prompt_ids = list(prompt_ids)
        self.prompt_tokens = len(prompt_ids)
        self.cancel_calls = 0
        self.waiting = True  # submitted, not yet holding a slot
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.cached_tokens = engine.lookup_prefix(self.prompt_ids)
        self.submitted = time.monotonic()

    @property
    def cancelled(self) -> bool:
        return self.cancel_calls > 0

    def cancel(self) -> None:
        self.cancel_calls += 1
        self.waiting = False

    def has_pending(self) -> bool:  # one token at a time: never more than one ready
        return False

    def _script(self):
        token_id = self.engine.tokenizer.token_to_id
        if self.engine.reply is not None:
            body = list(self.engine.reply) or [self.engine.eos_token_ids[0]]
        else:
            skipped = {token_id(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS}
            body = [t for t in self.prompt_ids if t not in skipped] or [self.engine.eos_token_ids[0]]
            if self.prompt_ids[-1] == token_id("<think>"):
                body = [token_id("</think>"), *body]
        if self.params.ignore_eos:
            return itertools.cycle(body)
        return itertools.chain(body, itertools.repeat(self.engine.eos_token_ids[0]))

    async def __aiter__(self):
        limit = min(self.params.max_tokens, self.engine.max_context - self.prompt_tokens)
        observer = self.engine.observer
        try:
            async with self.engine.slots():
                self.waiting = False
                observer.on_admitted(self.request_id, time.monotonic() - self.submitted, self.cached_tokens)
                script = self._script()
                if limit == 0 and self.params.prompt_logprobs is not None:  # score the prompt only
                    self._finished("length")
                    yield GenerationEvent(token_id=None, finish_reason="length",
                                          cached_tokens=self.cached_tokens,
                                          prompt_logprobs=self._prompt_logprobs())
                    return
                for step in range(limit):
                    if self.cancelled:
                        break
                    await asyncio.sleep(self.engine.delay)
                    if self.cancelled:
                        break
                    if step == self.engine.fail_after:  # a failed model step: this request ends with "error"
                        self._finished("error")
                        yield GenerationEvent(token_id=None, finish_reason="error",
                                              error="the fake step failed", cached_tokens=self.cached_tokens)
                        return
                    token = next(script)
                    self.token_ids.append(token)
                    if step == 0:
                        observer.on_first_token(self.request_id, time.monotonic() - self.submitted)
                    ends = token in self.params.stop_token_ids or (
                        token in self.engine.eos_token_ids and not self.params.ignore_eos)
                    finish = "stop" if ends else ("length" if step == limit - 1 else None)
                    event = self._event(token, finish)
                    if step == 0 and self.params.prompt_logprobs is not None:
                        event = dataclasses.replace(event, prompt_logprobs=self._prompt_logprobs())
                    yield event
                    if finish:
                        return
                self._finished("abort")
                yield GenerationEvent(token_id=None, finish_reason="abort", cached_tokens=self.cached_tokens)
        finally:
            self.waiting = False  # also when cancelled before it got a slot

    def _prompt_logprobs(self):
        count, vocab = self.params.prompt_logprobs, self.engine.tokenizer.get_vocab_size()
        return ((None, ()), *((fake_prompt_logprob(token), tuple(((token + i) % vocab, -0.25 - i)
                                                                  for i in range(count)))
                              for token in self.prompt_ids[1:]))

    def _finished(self, reason: str) -> None:
        self.finish_reason = reason
        self.engine.observer.on_finished(self.request_id, reason, self.prompt_tokens, self.cached_tokens,
                                         len(self.token_ids), time.monotonic() - self.submitted)

    def _event(self, token: int, finish: str | None) -> GenerationEvent:
        self.finish_reason = finish
        if finish:
            self._finished(finish)
        count = self.params.logprobs or 0
        vocab = self.engine.tokenizer.get_vocab_size()
        top = tuple(((token + i) % vocab, -0.5 - i) for i in range(count))
        return GenerationEvent(token_id=token, logprob=-0.5, top_logprobs=top, finish_reason=finish,
                               cached_tokens=self.cached_tokens if finish else 0)


class FakeEngine:
    """Implements the Engine interface the API codes against (see glm5_jax/engine/engine.py)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer | None = None, *, max_context: int = 128,
                 max_slots: int = 8, delay: float = 0.001, fail_after: int | None = None,
                 max_waiting: int | None = None, page_size: int = 4, observer: EngineObserver | None = None):
        self.tokenizer = tokenizer or make_tokenizer()
        self.max_context = max_context
        self.eos_token_ids = (self.tokenizer.token_to_id(EOS),)
        self.delay = delay
        self.max_slots = max_slots
        self.fail_after = fail_after  # end each request with "error" after this many tokens
        self.max_waiting = max_waiting
        self.failure: str | None = None  # the real engine's: set once it cannot go on
        self.reply: list[int] | None = None  # set by a test: every request answers these ids
        self.streams: list[FakeStream] = []
        self._semaphore: asyncio.Semaphore | None = None
        self._ids = itertools.count()
        self.page_size = page_size
        self.observer = observer or EngineObserver()
        self._pages: set[tuple[int, ...]] = set()  # every whole-page prefix seen so far

    def lookup_prefix(self, prompt_ids: list[int]) -> int:
        """Cached tokens for this prompt (whole pages seen before, never the last token), then caches it."""
        usable = (len(prompt_ids) - 1) // self.page_size * self.page_size
        prefixes = [tuple(prompt_ids[:end]) for end in range(self.page_size, usable + 1, self.page_size)]
        hit = 0
        for prefix in prefixes:
            if prefix not in self._pages:
                break
            hit = len(prefix)
        self._pages.update(prefixes)
        self.observer.on_prefix_lookup(len(prompt_ids), hit)
        return hit

    @property
    def compile_count(self) -> int:
        return 0

    def slots(self) -> asyncio.Semaphore:
        # Created on first use so that it belongs to the server's event loop, not the test's.
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_slots)
        return self._semaphore

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> FakeStream:
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; at most {self.max_context - 1}")
        params.validate()
        if self.failure is not None:
            raise EngineUnavailableError(self.failure)
        if self.max_waiting is not None and sum(s.waiting for s in self.streams) >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are already waiting", retry_after=0.4)
        request_id = f"fake-{next(self._ids)}"
        self.observer.on_queued(request_id, len(prompt_ids))
        stream = FakeStream(self, request_id, prompt_ids, params)
        self.streams.append(stream)
        return stream

    def shutdown(self) -> None:
        for stream in self.streams:
            stream.cancel()


@contextlib.contextmanager
def running(app):
    """Serves `app` with uvicorn on a free 127.0.0.1 port in a daemon thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", backlog=512,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
