"""A device call's sampled tokens -> each request's events, per request rather than per token.

The engine thread decides per row how many of a call's tokens its request takes and why it ends
(`accept`: Python list and set operations on the row's column of tokens, no per-token objects),
then hands the request's stream one `Burst`: the taken token ids and, when the request asked for
them, views of the call's log-probability arrays. The GenerationEvents are built from a Burst on
the event loop's thread (`Burst.events`), off the engine's critical path, and are exactly those a
per-token delivery built: the same tokens in the same order, with logprob / top_logprobs,
finish_reason and cached_tokens on the last event, prompt_logprobs on the first.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from glm5_jax.engine.types import GenerationEvent


def stop_set(params, eos_token_ids) -> frozenset[int]:
    """The token ids that end a request with "stop": its stop token ids, and EOS unless ignored."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))


def accept(tokens: list[int], generated: int, max_new: int, stops: frozenset[int], constrained=None
           ) -> tuple[int, str | None]:
    """(how many of `tokens`, a row's sampled tokens in order, its request takes; the finish
    reason of the last one taken, None while it goes on). The first token that is a stop id
    (`stop_set`) or completes the output constraint ends it with "stop", else the one that
    reaches max_new tokens ends it with "length". A constrained row advances its matcher
    (`ConstrainedOutput.advance`) by every token taken, in order."""
    limit = max(max_new - generated, 1)  # the first token is always taken
    if constrained is None:
        if not stops.isdisjoint(tokens):
            for index, token in enumerate(tokens):
                if token in stops:
                    if index < limit:
                        return index + 1, "stop"
                    break
        if len(tokens) >= limit:
            return limit, "length"
        return len(tokens), None
    for index, token in enumerate(tokens):
        complete = constrained.advance(token)
        if complete or token in stops:
            return index + 1, "stop"
        if index + 1 >= limit:
            return index + 1, "length"
    return len(tokens), None


class Burst(NamedTuple):
    """A request's tokens from one device call (n >= 1). tokens: their ids; logprobs [n] or None
    (not asked for); top_ids / top_logprobs [n, K] (K = the request's `logprobs`) or None (none
    asked for); finish_reason of the last token (None: the request goes on); cached_tokens: on the
    last event when it finishes; prompt_logprobs: on the first event (None: none)."""

    tokens: list[int]
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    prompt_logprobs: tuple | None = None

    def events(self) -> list[GenerationEvent]:
        """One GenerationEvent per token (called on the event loop's thread)."""
        count = len(self.tokens)
        logprobs = [None] * count if self.logprobs is None else self.logprobs.tolist()
        if self.top_ids is None:
            alternatives = [()] * count
        else:  # ((id, log probability), ...) per token, as Python ints and floats
            pairs = zip(self.top_ids.tolist(), self.top_logprobs.tolist(), strict=True)
            alternatives = [tuple(zip(ids, values, strict=True)) for ids, values in pairs]
        events = [GenerationEvent(token, logprob, alternative)
                  for token, logprob, alternative in zip(self.tokens, logprobs, alternatives, strict=True)]
        if self.prompt_logprobs is not None:
            events[0] = dataclasses.replace(events[0], prompt_logprobs=self.prompt_logprobs)
        if self.finish_reason is not None:
            events[-1] = dataclasses.replace(events[-1], finish_reason=self.finish_reason,
                                             cached_tokens=self.cached_tokens)
        return events


def wake(streams) -> None:
    """Hands over the pushed events of `streams` (RequestStream, each of which `_push` asked to
    wake) with one call_soon_threadsafe per event loop instead of one per stream."""
    by_loop: dict = {}
    for stream in streams:
        by_loop.setdefault(stream._loop, []).append(stream)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_hand_over_all, group)
        except RuntimeError:  # the event loop is gone (client and server shut down)
            pass


def _hand_over_all(streams) -> None:  # event loop
    for stream in streams:
        stream._hand_over()
