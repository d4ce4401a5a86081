"""Per-request accounting around textstream.Generation: cached prompt tokens in `usage`, the
rate-limit reservation settled with the real token count, and the finish reason counted."""

from __future__ import annotations

from glm5_jax.api.limits import Reservation
from glm5_jax.api.metrics import ServerMetrics
from glm5_jax.engine.textstream import Generation
from glm5_jax.engine.types import SamplingParams


class AccountedGeneration(Generation):
    """A Generation that reports cached tokens in its usage and, once it is over, settles its rate-limit
    reservation with the real token count and counts its finish reason."""

    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, reservation: Reservation,
                 metrics: ServerMetrics):
        super().__init__(engine, prompt_ids, params)
        self._reservation, self._metrics, self._closed = reservation, metrics, False

    def usage(self) -> dict:
        # The engine sets the stream's cached-token count when it admits the request.
        return {**super().usage(), "prompt_tokens_details": {"cached_tokens": self.stream.cached_tokens}}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._reservation.settle(self.prompt_tokens + self.completion_tokens)
            self._metrics.finished.labels(self.finish_reason or "abort").inc()
