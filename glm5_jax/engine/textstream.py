"""Engine events -> text for the API: incremental detokenisation that never emits half a UTF-8
character, stop strings (cut before the match, engine request cancelled), and EOS / stop-token
text kept out of the output (the token itself is kept aside, for scoring clients that count it).
The prompt's log probabilities, when asked for, are kept from the first event."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from glm5_jax.engine.types import GenerationEvent, SamplingParams


class Detokenizer:
    """Generated ids -> text that is safe to show: whole characters only, stop strings cut.

    Decoding a window of ids (ids[prefix:] against ids[prefix:read]) instead of all ids keeps each
    step O(1) while still giving tokenizers the left context they need (e.g. for leading spaces).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._tokenizer, self._stop, self._ids = tokenizer, stop, []
        self._prefix = self._read = 0
        self.text = ""  # decoded so far; stop strings never start before `self._sent`
        self._sent = 0
        self.stopped = False

    def push(self, token_id: int) -> None:
        self._ids.append(token_id)
        self._decode(final=False)

    def _decode(self, final: bool) -> None:
        if self.stopped:
            return
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for the next token to complete it.
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            hits = [i for stop in self._stop if (i := self.text.find(stop, self._sent)) >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True

    def take(self, final: bool = False) -> str:
        """The new text that can no longer turn into a stop string (all of it when final)."""
        if final:
            self._decode(final=True)
        end = len(self.text)
        if not (final or self.stopped):
            # Hold back the longest tail that is the start of some stop string.
            for stop in self._stop:
                for k in range(min(len(stop) - 1, len(self.text) - self._sent), 0, -1):
                    if self.text.endswith(stop[:k]):
                        end = min(end, len(self.text) - k)
                        break
        new, self._sent = self.text[self._sent:end], end
        return new


@dataclasses.dataclass
class Piece:
    text: str
    events: list[GenerationEvent]  # the tokens (for logprobs) that this text completes
    finish_reason: str | None = None


class Generation:
    """One engine request; `pieces()` yields its output text. Leaving early cancels the request."""

    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams):
        self.stream = engine.submit(prompt_ids, params)
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # the final event's (types.SHUTTING_DOWN: a drain ended it)
        # From the first event, when the request asked for them (SamplingParams.prompt_logprobs).
        self.prompt_logprobs: tuple | None = None
        self.hidden_event: GenerationEvent | None = None  # the EOS / stop token that ended it, unshown
        hidden = set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.eos_token_ids))
        self._hidden = frozenset(hidden)
        self._text = Detokenizer(engine.tokenizer, params.stop)

    async def pieces(self) -> AsyncIterator[Piece]:
        pending: list[GenerationEvent] = []
        try:
            async for event in self.stream:
                finish = event.finish_reason
                if event.prompt_logprobs is not None:
                    self.prompt_logprobs = event.prompt_logprobs
                if event.token_id is not None:
                    self.completion_tokens += 1
                    # The EOS / stop token that ends the request is counted but its text is not shown.
                    if finish == "stop" and event.token_id in self._hidden:
                        self.hidden_event = event
                    else:
                        pending.append(event)
                        self._text.push(event.token_id)
                if self._text.stopped:  # a stop string: the engine need not generate any further
                    if finish is None:
                        self.stream.cancel()
                    finish = "stop"
                if finish is not None:
                    self.finish_reason, self.error = finish, event.error
                    yield Piece(self._text.take(final=True), pending, finish)
                    return
                # A burst of tokens (several decode steps per device call) goes out as one piece.
                if not self.stream.has_pending() and (text := self._text.take()):
                    yield Piece(text, pending)
                    pending = []
            self.finish_reason = "abort"  # the engine ended the stream without saying why
            yield Piece(self._text.take(final=True), pending, "abort")
        finally:
            if self.finish_reason is None:  # the client went away or the task was cancelled
                self.stream.cancel()

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
