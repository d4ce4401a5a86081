"""Per-request accounting around textstream.Generation: cached prompt tokens in `usage`, the
rate-limit reservation settled with the real token count, and the finish reason counted."""

from __future__ import annotations

from glm5_jax.serve.limits import Reservation
from glm5_jax.serve.metrics import ServerMetrics
from glm5_jax.serve.textstream import Generation
from glm5_jax.serve.types import SamplingParams


class UsageStream:
    """The engine's request stream, keeping the cached-token count of its final event."""

    def __init__(self, stream):
        self._stream, self._cached_tokens = stream, None

    @property
    def cached_tokens(self) -> int:
        # A stop string ends the request before the engine's final event; then the stream's own
        # count (if the engine keeps one) is the best there is.
        if self._cached_tokens is None:
            return getattr(self._stream, "cached_tokens", None) or 0
        return self._cached_tokens

    def cancel(self) -> None:
        self._stream.cancel()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        async for event in self._stream:
            if event.finish_reason is not None:
                self._cached_tokens = getattr(event, "cached_tokens", 0)
            yield event


class AccountedGeneration(Generation):
    """A Generation that reports cached tokens in its usage and, once it is over, settles its rate-limit
    reservation with the real token count and counts its finish reason."""

    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, reservation: Reservation,
                 metrics: ServerMetrics):
        super().__init__(engine, prompt_ids, params)
        self.stream = UsageStream(self.stream)
        self._reservation, self._metrics, self._closed = reservation, metrics, False

    def usage(self) -> dict:
        return {**super().usage(), "prompt_tokens_details": {"cached_tokens": self.stream.cached_tokens}}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._reservation.settle(self.prompt_tokens + self.completion_tokens)
            self._metrics.finished.labels(self.finish_reason or "abort").inc()
